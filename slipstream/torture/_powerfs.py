"""PowerFS: a FUSE filesystem that forgets, at a simulated power failure, every write that was
not made durable, in the manner of Jepsen's lazyfs.

A kill -9 cannot tell a broker that fsyncs from one that never does: the page cache outlives
the process. PowerFS can. It passes every operation through to a backing directory (the live
state, what a reader sees while the "machine" runs) and keeps, beside it, the durable state:

* a file's data (and size) as of its last ``fsync``/``fdatasync``, through any of its names or
  handles (durability belongs to the inode, as on a real filesystem);
* a directory's entries (create, mkdir, rename, link, unlink, rmdir change them) as of the last
  ``fsync`` of that directory, never of the file: a file whose data was synced but whose name
  was not is gone after a power failure, and a name that was synced whose data was not comes
  back as an empty file;
* everything present at mount is durable;
* with ``tear``, each file's last write after its last sync also lands, cut to a random length
  (a torn write: a prefix of it reached the disk, the rest did not).

``PowerFS.power_fail()`` unmounts (every process using the mount must be dead by then: a power
failure kills them all) and rewrites the backing directory to the durable state; ``mount()``
then serves that state again. The server runs in its own process (``python -m
slipstream.torture._powerfs serve ...``), single-threaded, on libfuse 3 through ``mfusepy``.

What it does not model: metadata other than names and sizes (modes, times) is kept as the live
state had it; symbolic links, extended attributes and locks forwarded to the filesystem are not
supported (the kernel keeps POSIX and flock locks itself); a directory that ends up named in two
synced parents comes back in the first one found only.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import random
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any

log = logging.getLogger("slipstream.torture.powerfs")

_REQUEST = "power-fail.request"  # in the control directory: fail power at the next unmount
_DONE = "power-fail.done"


def fuse_unusable() -> str | None:
    """Why a PowerFS cannot be mounted here (None: it can): no usable /dev/fuse, no
    fusermount3, or no libfuse (scripts/ensure-fuse.sh installs the last two)."""
    try:
        fd = os.open("/dev/fuse", os.O_RDWR)
    except OSError as exc:
        return f"/dev/fuse is not usable: {exc}"
    os.close(fd)
    if shutil.which("fusermount3") is None:
        return "fusermount3 is missing (run scripts/ensure-fuse.sh)"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as exc:
        return f"mfusepy or libfuse is missing ({exc}): pip install 'slipstream[torture]'"
    return None


class PowerFS:
    """Mounts a PowerFS at ``mountpoint`` over ``backing`` and fails its power on demand.

    ``control`` (default: ``<backing>.powerfs`` beside it) holds the durable copies of file
    data and the server's log. ``seed`` makes torn writes reproducible.
    """

    def __init__(
        self,
        backing: Path,
        mountpoint: Path,
        *,
        tear: bool = False,
        seed: int = 0,
        control: Path | None = None,
    ) -> None:
        self.backing = backing
        self.mountpoint = mountpoint
        self.tear = tear
        self.seed = seed
        self.control = control or backing.with_name(backing.name + ".powerfs")
        self.failures = 0
        self._server: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        return self.control / "server.log"

    def mount(self, timeout: float = 20.0) -> None:
        """Serve the backing directory (its current content is all durable) at the mountpoint."""
        if self._server is not None:
            raise RuntimeError("already mounted")
        for path in (self.backing, self.mountpoint, self.control):
            path.mkdir(parents=True, exist_ok=True)
        (self.control / _REQUEST).unlink(missing_ok=True)
        (self.control / _DONE).unlink(missing_ok=True)
        args = [
            sys.executable,
            "-m",
            "slipstream.torture._powerfs",
            "serve",
            str(self.backing),
            str(self.mountpoint),
            str(self.control),
            "--seed",
            str(self.seed + self.failures),
        ]
        if self.tear:
            args.append("--tear")
        with open(self.log_path, "ab") as out:
            self._server = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not os.path.ismount(self.mountpoint):
            if self._server.poll() is not None or time.monotonic() > deadline:
                self._server.kill()
                self._server.wait()
                self._server = None
                raise RuntimeError(f"PowerFS did not mount:\n{self.server_log()}")
            time.sleep(0.02)

    def power_fail(self, timeout: float = 20.0) -> None:
        """Lose everything not durable: unmount and rewrite the backing directory to the
        durable state. Kill every process using the mount first (their open files keep it busy).
        The mount stays down until ``mount()``."""
        (self.control / _REQUEST).touch()
        self._unmount(timeout)
        if not (self.control / _DONE).exists():
            raise RuntimeError(f"PowerFS did not fail power:\n{self.server_log()}")
        self.failures += 1

    def unmount(self, timeout: float = 20.0) -> None:
        """Unmount, keeping the live state (a clean shutdown: nothing is lost)."""
        if self._server is not None:
            self._unmount(timeout)

    def _unmount(self, timeout: float) -> None:
        server = self._server
        if server is None:
            raise RuntimeError("not mounted")
        self._server = None
        deadline = time.monotonic() + timeout
        busy = False
        while server.poll() is None:
            result = subprocess.run(
                ["fusermount3", "-u", str(self.mountpoint)], capture_output=True, check=False
            )
            if result.returncode == 0 or not os.path.ismount(self.mountpoint):
                break
            if time.monotonic() > deadline:  # a process still holds files on it: detach it
                busy = True
                subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], check=False)
                break
            time.sleep(0.1)
        try:
            server.wait(5 if busy else timeout)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
            raise RuntimeError(
                f"{self.mountpoint} stayed busy: a process still has files open on it"
            ) from None
        if server.returncode != 0:
            raise RuntimeError(
                f"PowerFS server exited with {server.returncode}:\n{self.server_log()}"
            )

    def server_log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def __enter__(self) -> PowerFS:
        self.mount()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.unmount()


# --- the server ---------------------------------------------------------------------------

_Entry = tuple[int, bool]  # node id, is a directory


class _Handle:
    __slots__ = ("append", "fd", "node")

    def __init__(self, fd: int, node: int, append: bool) -> None:
        self.fd = fd
        self.node = node
        self.append = append


class PowerOperations:
    """The FUSE operations (mfusepy's high-level interface): passthrough plus durability
    bookkeeping. Node ids, not inode numbers, name files in the durable state, because the
    backing filesystem reuses the number of a deleted inode for a new file."""

    use_ns = True

    def __init__(self, backing: Path, control: Path, *, tear: bool, seed: int) -> None:
        self.backing = str(backing)
        self.control = control
        self.shadow = control / "durable"  # node id -> the file's durable data
        self.tear = tear
        self.rng = random.Random(seed)
        self._node_of_ino: dict[int, int] = {}
        self._next_node = 1
        self._entries: dict[int, dict[str, _Entry]] = {}  # directory node -> durable entries
        self._dirty: dict[int, list[tuple[int, int]]] = {}  # node -> (offset, length) unsynced
        self._last_write: dict[int, tuple[int, bytes]] = {}  # node -> last unsynced write
        self._handles: dict[int, _Handle] = {}
        shutil.rmtree(self.shadow, ignore_errors=True)
        self.shadow.mkdir(parents=True)
        self.root = self._snapshot_all()

    # --- durable state ---------------------------------------------------------------------

    def _new_node(self, ino: int) -> int:
        node = self._next_node
        self._next_node += 1
        self._node_of_ino[ino] = node
        return node

    def _node(self, ino: int) -> int:
        node = self._node_of_ino.get(ino)
        return self._new_node(ino) if node is None else node

    def _snapshot_all(self) -> int:
        """Everything in the backing directory at mount is durable: its entries, and copies of
        its files' data."""
        root = self._node(os.lstat(self.backing).st_ino)
        for directory, _, files in os.walk(self.backing):
            self._snapshot_dir(self._node(os.lstat(directory).st_ino), directory)
            for name in files:
                path = os.path.join(directory, name)
                st = os.lstat(path)
                if stat.S_ISREG(st.st_mode):
                    shutil.copyfile(path, self.shadow / str(self._node(st.st_ino)))
        return root

    def _snapshot_dir(self, node: int, full: str) -> None:
        entries: dict[str, _Entry] = {}
        for name in os.listdir(full):
            st = os.lstat(os.path.join(full, name))
            if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode):
                entries[name] = (self._node(st.st_ino), stat.S_ISDIR(st.st_mode))
        self._entries[node] = entries

    def _mark(self, node: int, offset: int, length: int) -> None:
        if length > 0:
            self._dirty.setdefault(node, []).append((offset, length))

    def _sync_file(self, node: int, fd: int) -> None:
        """Make the file's data durable: copy the ranges written since the last sync."""
        ranges = self._dirty.pop(node, [])
        self._last_write.pop(node, None)
        source = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)  # the handle may be write-only
        target = os.open(self.shadow / str(node), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            size = os.fstat(source).st_size
            os.ftruncate(target, size)
            for offset, length in _merged(ranges):
                end = min(offset + length, size)
                while offset < end:
                    copied = os.copy_file_range(source, target, end - offset, offset, offset)
                    if copied == 0:
                        break
                    offset += copied
        finally:
            os.close(source)
            os.close(target)

    def rebuild(self) -> None:
        """Replace the backing directory with the durable state (the power failed)."""
        new = self.backing + ".powerfs-new"
        old = self.backing + ".powerfs-old"
        shutil.rmtree(new, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
        os.mkdir(new)
        placed: dict[int, str] = {}  # node -> where it went (files: hard links after the first)
        torn = 0

        def build(node: int, path: str) -> None:
            nonlocal torn
            for name, (child, is_dir) in sorted(self._entries.get(node, {}).items()):
                target = os.path.join(path, name)
                if child in placed:
                    if not is_dir:  # the same file under a second durable name
                        os.link(placed[child], target)
                    continue
                placed[child] = target
                if is_dir:
                    os.mkdir(target)
                    build(child, target)
                    continue
                durable = self.shadow / str(child)
                if durable.exists():
                    shutil.copyfile(durable, target)
                else:
                    open(target, "wb").close()  # the name was synced, the data never was
                last = self._last_write.get(child)
                if self.tear and last is not None and len(last[1]) > 1:
                    offset, data = last
                    cut = self.rng.randrange(1, len(data))
                    fd = os.open(target, os.O_WRONLY)
                    try:
                        os.pwrite(fd, data[:cut], offset)
                    finally:
                        os.close(fd)
                    torn += 1

        placed[self.root] = new
        build(self.root, new)
        os.rename(self.backing, old)
        os.rename(new, self.backing)
        shutil.rmtree(old)
        log.info("power failed: %d names kept, %d writes torn", len(placed) - 1, torn)

    # --- operations ------------------------------------------------------------------------

    def _full(self, path: str) -> str:
        return os.path.join(self.backing, path.lstrip("/"))

    def getattr(self, path: str | None, fh: int | None = None) -> dict[str, Any]:
        st = (
            os.fstat(self._handles[fh].fd)
            if path is None and fh
            else os.lstat(self._full(path or "/"))
        )
        return {
            "st_mode": st.st_mode,
            "st_ino": st.st_ino,
            "st_nlink": st.st_nlink,
            "st_uid": st.st_uid,
            "st_gid": st.st_gid,
            "st_size": st.st_size,
            "st_blocks": st.st_blocks,
            "st_blksize": st.st_blksize,
            "st_atime": st.st_atime_ns,
            "st_mtime": st.st_mtime_ns,
            "st_ctime": st.st_ctime_ns,
        }

    def readdir(self, path: str, fh: int) -> list[tuple[str, dict[str, int], int]]:
        # with use_ino the kernel takes inode numbers from here, and readdir(3) skips ino 0
        full = self._full(path)
        found = []
        for name in (".", "..", *os.listdir(full)):
            st = os.lstat(os.path.join(full, name))
            found.append((name, {"st_mode": st.st_mode, "st_ino": st.st_ino}, 0))
        return found

    def statfs(self, path: str) -> dict[str, int]:
        sv = os.statvfs(self._full(path))
        keys = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files")
        return {key: getattr(sv, key) for key in (*keys, "f_flag", "f_frsize", "f_namemax")}

    def _open(self, path: str, flags: int, mode: int = 0o644) -> int:
        full = self._full(path)
        old_size = os.lstat(full).st_size if not flags & os.O_CREAT else 0
        fd = os.open(full, flags & (os.O_ACCMODE | os.O_CREAT | os.O_EXCL | os.O_TRUNC), mode)
        st = os.fstat(fd)
        node = self._new_node(st.st_ino) if flags & os.O_CREAT else self._node(st.st_ino)
        if flags & os.O_TRUNC:
            self._mark(node, 0, old_size)
        self._handles[fd] = _Handle(fd, node, bool(flags & os.O_APPEND))
        return fd

    def open(self, path: str, flags: int) -> int:
        return self._open(path, flags & ~os.O_CREAT)

    def create(self, path: str, mode: int, fi: int | None = None) -> int:
        flags = (fi or os.O_WRONLY) | os.O_CREAT
        if os.path.lexists(self._full(path)):  # O_CREAT of an existing name: same inode
            flags &= ~os.O_CREAT
        return self._open(path, flags, mode)

    def read(self, path: str | None, size: int, offset: int, fh: int) -> bytes:
        return os.pread(self._handles[fh].fd, size, offset)

    def write(self, path: str | None, data: bytes, offset: int, fh: int) -> int:
        handle = self._handles[fh]
        if handle.append:  # the kernel's offset may be stale for O_APPEND (no writeback cache)
            offset = os.fstat(handle.fd).st_size
        written = os.pwrite(handle.fd, data, offset)
        self._mark(handle.node, offset, written)
        if self.tear:
            self._last_write[handle.node] = (offset, bytes(data[:written]))
        return written

    def truncate(self, path: str | None, length: int, fh: int | None = None) -> int:
        if path is None:
            raise OSError(errno.EIO, "truncate of a file without a name")
        full = self._full(path)
        st = os.lstat(full)
        os.truncate(full, length)
        node = self._node(st.st_ino)
        low, high = sorted((st.st_size, length))
        self._mark(node, low, high - low)  # cut bytes (or new zeros) differ from durable ones
        return 0

    def flush(self, path: str | None, fh: int) -> int:
        return 0

    def release(self, path: str | None, fh: int) -> int:
        handle = self._handles.pop(fh)
        os.close(handle.fd)
        return 0

    def fsync(self, path: str | None, datasync: int, fh: int) -> int:
        handle = self._handles[fh]
        self._sync_file(handle.node, handle.fd)
        return 0

    def fsyncdir(self, path: str, datasync: int, fh: int) -> int:
        full = self._full(path)
        self._snapshot_dir(self._node(os.lstat(full).st_ino), full)
        return 0

    def mkdir(self, path: str, mode: int) -> int:
        full = self._full(path)
        os.mkdir(full, mode)
        node = self._new_node(os.lstat(full).st_ino)
        self._entries[node] = {}  # a new directory's own entries: none durable yet
        return 0

    def rmdir(self, path: str) -> int:
        os.rmdir(self._full(path))
        return 0

    def unlink(self, path: str) -> int:
        os.unlink(self._full(path))
        return 0

    def rename(self, old: str, new: str) -> int:
        os.rename(self._full(old), self._full(new))
        return 0

    def link(self, target: str, source: str) -> int:
        os.link(self._full(source), self._full(target))
        return 0

    def chmod(self, path: str, mode: int) -> int:
        os.chmod(self._full(path), mode)
        return 0

    def chown(self, path: str, uid: int, gid: int) -> int:
        os.chown(self._full(path), uid, gid)
        return 0

    def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
        if times is None:
            os.utime(self._full(path))
        else:
            os.utime(self._full(path), ns=times)
        return 0

    def access(self, path: str, amode: int) -> int:
        if not os.access(self._full(path), amode):
            raise OSError(errno.EACCES, os.strerror(errno.EACCES))
        return 0


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for offset, length in sorted(ranges):
        if out and offset <= out[-1][0] + out[-1][1]:
            start, previous = out[-1]
            out[-1] = (start, max(previous, offset + length - start))
        else:
            out.append((offset, length))
    return out


def serve(backing: Path, mountpoint: Path, control: Path, *, tear: bool, seed: int) -> None:
    """Mount and serve until unmounted; then, if a power failure was requested, rewrite the
    backing directory to the durable state."""
    import mfusepy

    operations = PowerOperations(backing, control, tear=tear, seed=seed)
    # hard_remove: an unlinked open file must not linger as a ".fuse_hidden" name; use_ino:
    # hard links are one file to stat(), as the chunk store's samefile() expects
    mfusepy.FUSE(
        operations,
        str(mountpoint),
        foreground=True,
        nothreads=True,
        hard_remove=True,
        use_ino=True,
        fsname="powerfs",
    )
    request = control / _REQUEST
    if request.exists():
        operations.rebuild()
        request.unlink()
        (control / _DONE).touch()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m slipstream.torture._powerfs")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("serve", help="mount a PowerFS (use PowerFS to drive it)")
    run.add_argument("backing", type=Path)
    run.add_argument("mountpoint", type=Path)
    run.add_argument("control", type=Path)
    run.add_argument("--tear", action="store_true")
    run.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    with contextlib.suppress(KeyboardInterrupt):
        serve(args.backing, args.mountpoint, args.control, tear=args.tear, seed=args.seed)


if __name__ == "__main__":
    main()

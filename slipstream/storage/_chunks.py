"""LongTermStore: durable tier 2, immutable named chunks of back-to-back record batches.

A chunk is written once, whole, and is durable when ``write_chunk`` returns; it is read by byte
ranges and deleted whole (that is how retention frees space). A chunk holds one segment's
batches at the positions its catalog index records: back to back when copied, or in place
inside a hard-linked sealed journal file (``LocalChunkStore.adopt_ranges``). Names look like
object keys, ``<stream id>/<segment>/<base offset:020d>``, and the mover adds a suffix unique to
each attempt, ``-<lease epoch>-<8 random hex digits>`` (``writer_tag``): two brokers that both
believe they own a container (one paused past its lease), or one retrying a move, never upload
to the same name, so no upload overwrites a chunk that another one recorded. Readers use the
name the catalog's chunk record holds, so names without the suffix (written before) stay
readable.

Orphans. A chunk is uploaded before its catalog record commits, and deleted after its record is
removed; a crash, a failed delete or a lost lease between the two leaves an object that nothing
references. ``ChunkSweep`` deletes those once they are older than a grace period (see there).

LocalChunkStore serves reads from memory maps of its files, not copies. Why: a replay through
``pread`` spent a quarter of the broker's CPU copying page cache into user memory, plus the page
faults of fresh buffers; with maps, the broker's CPU per 205 MB replayed fell from 0.09-0.14 s
to 0.07-0.11 s and the replay rate rose by a fifth to a third (bench/README.md). Chunk files
never change once written (written whole and renamed, or a sealed journal file that is never
truncated), so a map stays valid; a file replaced or deleted through this store drops its map.

A map's page that cannot be read raises SIGBUS, not an error, when touched. So every range is
loaded with ``MADV_POPULATE_READ`` in the reader thread first, which reports a failed device read
as an ``OSError`` (a typed ``StorageError`` here) instead. The trade-off we accept: if memory
pressure evicts a loaded page before the broker has sent it, and the device then fails to read
it back, the broker dies of SIGBUS. That is a crash like any other: recovery loses nothing
acknowledged. Kernels older than 5.14 lack the advice; the store then reads with ``pread``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import re
import secrets
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .._errors import CorruptData, StorageError
from ._journal import Buffer, _writev_all, ensure_dir, fsync_dir, storage_error

if TYPE_CHECKING:
    from ._meta import MetaStore

log = logging.getLogger("slipstream.storage")

MADV_POPULATE_READ = 22  # Linux 5.14; not in Python 3.11's mmap module
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def chunk_name(stream_id: int, segment: int, base_offset: int, writer: str = "") -> str:
    """A chunk's name: ``<stream id>/<segment>/<base offset:020d>``, then ``-<writer>`` when
    given (the mover gives ``writer_tag``'s, so that no two uploads share a name)."""
    name = f"{stream_id}/{segment}/{base_offset:020d}"
    return f"{name}-{writer}" if writer else name


def writer_tag(epoch: int) -> str:
    """A name suffix unique to one upload attempt: the writer's lease epoch (0 without a
    lease) and 32 random bits. The epoch tells an operator which holding wrote an object; the
    random part keeps two attempts of one holding (a retried move) apart, so the orphan sweep
    can never delete a name that a later attempt reuses."""
    return f"{epoch}-{secrets.token_hex(4)}"


_CHUNK_NAME = re.compile(r"(\d+)/(\d+)/(\d{20})(?:-[0-9A-Za-z-]+)?")


def parse_chunk_name(name: str) -> tuple[int, int, int] | None:
    """``(stream id, segment, base offset)`` of a chunk's name, or None if ``name`` is not a
    chunk's (a journal object, the write probe, anything else in the bucket)."""
    match = _CHUNK_NAME.fullmatch(name)
    if match is None:
        return None
    return int(match[1]), int(match[2]), int(match[3])


#: how old (seconds, by the store's clock) a chunk object nothing references must be before
#: ``ChunkSweep`` deletes it; SLIPSTREAM_ORPHAN_GRACE_S overrides it (tests)
ORPHAN_GRACE_S = 600.0

#: the longest a mover may take from its first upload of a journal file's chunks to the
#: catalog commit that records them; a move that took longer gives up before committing (its
#: uploads become orphans, the file is moved again under new names). It must stay well below
#: ``ORPHAN_GRACE_S``: that margin is what makes the sweep safe (see ChunkSweep).
MOVE_COMMIT_WINDOW_S = 240.0


class LongTermStore(ABC):
    """Immutable chunks by name. Errors: ``StorageFull``/``StorageError`` on write,
    ``CorruptData`` when a chunk is missing or shorter than asked."""

    @abstractmethod
    def write_chunk(self, name: str, buffers: Sequence[Buffer]) -> None:
        """Store the concatenated buffers under ``name``, durably and atomically."""

    @abstractmethod
    def read_chunk(self, name: str, start: int = 0, length: int | None = None) -> Buffer:
        """Bytes ``[start, start + length)`` of a chunk (to its end when ``length`` is None).

        Read-only; may be a view of memory the store shares (LocalChunkStore's maps)."""

    @abstractmethod
    def delete_chunk(self, name: str) -> None:
        """Remove a chunk; deleting a missing chunk is not an error."""

    @abstractmethod
    def list_chunks(self, prefix: str = "") -> list[str]:
        """Names of stored chunks that start with ``prefix``, sorted."""

    @abstractmethod
    def list_chunk_times(self, prefix: str = "") -> list[tuple[str, float]]:
        """``(name, when it was stored)`` of the chunks that start with ``prefix``, sorted by
        name; the time in seconds since 1970 by the store's clock (an object's last-modified
        time, a file's change time: a hard link made now counts as now)."""

    def adopt_ranges(self, name: str, source: Path, ranges: Sequence[tuple[int, int]]) -> list[int]:
        """Store byte ranges ``(position, length)`` of a durable local file as chunk ``name``;
        returns where each range starts inside the stored chunk.

        The default copies them (``copy_ranges``). A store on the same filesystem may keep the
        file as it is instead (see LocalChunkStore), so journal data is written once; the
        chunk then holds the whole file, and the file's space lives as long as the chunk.
        """
        return self.copy_ranges(name, source, ranges)

    def copy_ranges(self, name: str, source: Path, ranges: Sequence[tuple[int, int]]) -> list[int]:
        """Store byte ranges ``(position, length)`` of a local file, copied back to back, as
        chunk ``name``; returns where each range starts inside it."""
        with open(source, "rb") as f:
            parts = [os.pread(f.fileno(), length, position) for position, length in ranges]
        self.write_chunk(name, parts)
        starts, at = [], 0
        for part in parts:
            starts.append(at)
            at += len(part)
        return starts


class LocalChunkStore(LongTermStore):
    """Chunks as files under a directory: written to a temporary name, fsynced, renamed; read
    through memory maps (see the module docstring), or with ``pread`` where ``map_reads`` is
    false or the kernel cannot load a map's pages safely."""

    #: Open maps kept; a map costs address space and page tables, not memory of its own.
    MAX_MAPS = 128

    def __init__(self, directory: Path, *, fsync: bool = True, map_reads: bool = True) -> None:
        self.directory = directory
        self._fsync = fsync
        self._map_reads = map_reads
        self._maps: OrderedDict[str, memoryview] = OrderedDict()
        self._maps_lock = threading.Lock()
        ensure_dir(directory, sync=fsync)

    def _path(self, name: str) -> Path:
        return self.directory / f"{name}.chunk"

    def write_chunk(self, name: str, buffers: Sequence[Buffer]) -> None:
        path = self._path(name)
        tmp = path.with_suffix(".tmp")
        try:
            ensure_dir(path.parent, sync=self._fsync)  # <stream>/<segment>/, durably
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                _writev_all(fd, list(buffers))
                if self._fsync:
                    os.fdatasync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            self._unmap(name)
            if self._fsync:
                fsync_dir(path.parent)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise storage_error(exc, f"writing chunk {name}") from exc

    def adopt_ranges(self, name: str, source: Path, ranges: Sequence[tuple[int, int]]) -> list[int]:
        # A hard link: the sealed journal file becomes the chunk without a second write. The
        # ranges stay where they are; bytes of other segments in the file are never read
        # through this chunk, and the inode is freed when the last chunk linking it goes.
        path = self._path(name)
        tmp = path.with_suffix(".tmp")
        try:
            ensure_dir(path.parent, sync=self._fsync)  # <stream>/<segment>/, durably
            tmp.unlink(missing_ok=True)
            if path.exists() and os.path.samefile(path, source):
                return [position for position, _ in ranges]  # adopted before a retry or crash
            os.link(source, tmp)
            os.replace(tmp, path)
            self._unmap(name)
            if self._fsync:
                fsync_dir(path.parent)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            if exc.errno in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                return super().adopt_ranges(name, source, ranges)  # another filesystem: copy
            raise storage_error(exc, f"linking chunk {name}") from exc
        return [position for position, _ in ranges]

    def read_chunk(self, name: str, start: int = 0, length: int | None = None) -> Buffer:
        data = self._mapped(name) if self._map_reads else None
        if data is None:
            return self._pread(name, start, length)
        end = len(data) if length is None else start + length
        if end > start and (end > len(data) or not self._populate(data, start, end)):
            # the file changed under its map, the device failed, or the kernel is too old:
            # ``pread`` says which, with the typed error (CorruptData, StorageError)
            self._unmap(name)
            return self._pread(name, start, length)
        return data[start:end]

    def _pread(self, name: str, start: int, length: int | None) -> bytes:
        try:
            with open(self._path(name), "rb") as f:
                f.seek(start)
                data = f.read() if length is None else f.read(length)
        except FileNotFoundError as exc:
            raise CorruptData(
                f"chunk {name} is missing from long-term storage", chunk=name
            ) from exc
        except OSError as exc:
            raise storage_error(exc, f"reading chunk {name}") from exc
        if length is not None and len(data) != length:
            raise CorruptData(
                f"chunk {name} is shorter than its catalog entry", chunk=name, position=start
            )
        return data

    def _mapped(self, name: str) -> memoryview | None:
        """A read-only view of the whole chunk file, mapped once and kept (LRU)."""
        with self._maps_lock:
            data = self._maps.get(name)
            if data is not None:
                self._maps.move_to_end(name)
                return data
        try:
            with open(self._path(name), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size == 0:
                    return memoryview(b"")  # mmap refuses empty files
                data = memoryview(mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ))
        except FileNotFoundError as exc:
            raise CorruptData(
                f"chunk {name} is missing from long-term storage", chunk=name
            ) from exc
        except OSError as exc:
            raise storage_error(exc, f"mapping chunk {name}") from exc
        with self._maps_lock:
            self._maps[name] = data
            while len(self._maps) > self.MAX_MAPS:
                self._maps.popitem(last=False)  # views still sent keep their map alive
        return data

    def _populate(self, data: memoryview, start: int, end: int) -> bool:
        """Load ``[start, end)`` of a map into memory, so that touching it cannot raise SIGBUS;
        False if that failed (``MADV_POPULATE_READ`` fails where the touch would raise).

        No ``MADV_WILLNEED`` read-ahead: on the development VM it made a cold read slower (1.4
        vs 2.1 GB/s for 4 MiB ranges in order; ``pread`` of the same ranges: 0.5-0.7 GB/s).
        """
        address = np.frombuffer(data, np.uint8).ctypes.data  # a map's pages: page-aligned
        low = start - start % mmap.PAGESIZE
        # through ctypes, which lets go of the GIL while the disk reads; mmap.madvise keeps it
        if _libc.madvise(ctypes.c_void_p(address + low), end - low, MADV_POPULATE_READ) == 0:
            return True
        if ctypes.get_errno() == errno.EINVAL:
            self._map_reads = False  # before Linux 5.14: read with pread from now on
        return False

    def _unmap(self, name: str) -> None:
        with self._maps_lock:
            self._maps.pop(name, None)

    def delete_chunk(self, name: str) -> None:
        self._unmap(name)
        path = self._path(name)
        path.unlink(missing_ok=True)
        if self._fsync:  # else the file comes back after a power failure, holding its space
            with contextlib.suppress(FileNotFoundError):
                fsync_dir(path.parent)

    def list_chunks(self, prefix: str = "") -> list[str]:
        names = (
            str(p.relative_to(self.directory).with_suffix(""))
            for p in self.directory.rglob("*.chunk")
        )
        return sorted(n for n in names if n.startswith(prefix))

    def list_chunk_times(self, prefix: str = "") -> list[tuple[str, float]]:
        found = []
        for path in self.directory.rglob("*.chunk"):
            name = str(path.relative_to(self.directory).with_suffix(""))
            if not name.startswith(prefix):
                continue
            try:
                stat = path.stat()
            except FileNotFoundError:
                continue  # deleted meanwhile
            # ctime, not only mtime: a link to a journal file sealed long ago is new
            found.append((name, max(stat.st_mtime, stat.st_ctime)))
        return sorted(found)


class MemoryChunkStore(LongTermStore):
    """Chunks in a dict: the in-memory implementation for tests and embedded use."""

    def __init__(self) -> None:
        self._chunks: dict[str, bytes] = {}
        self._written: dict[str, float] = {}
        self._lock = threading.Lock()

    def write_chunk(self, name: str, buffers: Sequence[Buffer]) -> None:
        data = b"".join(bytes(b) for b in buffers)
        with self._lock:
            self._chunks[name] = data
            self._written[name] = time.time()

    def read_chunk(self, name: str, start: int = 0, length: int | None = None) -> bytes:
        with self._lock:
            data = self._chunks.get(name)
        if data is None:
            raise CorruptData(f"chunk {name} is missing from long-term storage", chunk=name)
        end = len(data) if length is None else start + length
        if end > len(data):
            raise CorruptData(f"chunk {name} is shorter than its catalog entry", chunk=name)
        return data[start:end]

    def delete_chunk(self, name: str) -> None:
        with self._lock:
            self._chunks.pop(name, None)
            self._written.pop(name, None)

    def list_chunks(self, prefix: str = "") -> list[str]:
        with self._lock:
            return sorted(n for n in self._chunks if n.startswith(prefix))

    def list_chunk_times(self, prefix: str = "") -> list[tuple[str, float]]:
        with self._lock:
            return sorted((n, t) for n, t in self._written.items() if n.startswith(prefix))


class ChunkSweep:
    """Deletes chunks that no catalog record names once they are older than ``grace_s``.

    What it collects: chunks whose record retention or a stream's deletion removed but whose
    delete failed (the store was down) or never ran (the broker died between the catalog's
    commit and the delete); chunks a mover uploaded whose record never committed (a crash,
    LeaseLost, a failed commit, a move given up as too slow). Only names that parse as chunk
    names (``parse_chunk_name``) are considered: journal objects are the ObjectJournal's
    (``collect_orphans``), and anything else in the bucket is left alone.

    Why the grace makes it safe. Between its upload and its record's commit a chunk is
    unreferenced, and nothing tells such an upload in flight from an orphan but its age. An
    object older than the grace is never recorded afterwards: the mover gives up, before its
    commit, a move whose first upload began more than ``MOVE_COMMIT_WINDOW_S`` (4 min) earlier
    (Container._move_file), and every attempt uploads under fresh names (``writer_tag``), so
    no retry brings an old name back. The default grace (10 min) exceeds that window by the
    commit itself (bounded by the catalog's connection and idle-transaction timeouts) and by
    any skew between the store's clock, which stamps objects, and this host's, which the
    sweep compares with. A grace below the window (tests) gives that guarantee up; a warning
    says so. A broker paused for longer than the grace between that check and its commit does
    not break it either: another live broker has taken its containers by then (the lease ttl
    is seconds), so the commit is fenced (LeaseLost); a broker alone pauses its own sweep too.

    Order: list the chunks with their times, keep those older than the grace, then read
    the catalog (after the listing: a record missing now was not there when the listing
    began), per segment from the lowest such base offset (``chunks_from`` in pages, without
    indexes), and delete what no record names. Cost: a LIST of every chunk plus a page of
    records per segment that has old chunks, per 1000 chunks; so it runs every ``grace_s / 2``
    (``due``), not after every move. Several brokers may sweep at once: a delete of a
    missing chunk is not an error.

    Threads: ``sweep`` runs on one thread at a time (it blocks on the store and the catalog);
    ``stop`` may be called from any, and makes a running sweep return early.
    """

    def __init__(
        self,
        store: LongTermStore,
        meta: MetaStore,
        *,
        grace_s: float | None = None,
        page: int = 1000,
    ) -> None:
        if grace_s is None:
            grace_s = float(os.environ.get("SLIPSTREAM_ORPHAN_GRACE_S", ORPHAN_GRACE_S))
        self.store = store
        self.meta = meta
        self.grace_s = grace_s
        self.page = page
        #: chunks deleted by this sweeper since it was made (the broker's metric)
        self.swept = 0
        self._last = -float("inf")
        self._stop = threading.Event()
        if grace_s <= MOVE_COMMIT_WINDOW_S:
            log.warning(
                "orphaned chunks are swept after %g s, not above the mover's commit window "
                "(%g s): a slow move's chunks may be deleted before they are recorded (for "
                "tests only)",
                grace_s,
                MOVE_COMMIT_WINDOW_S,
            )

    def due(self) -> bool:
        """Whether ``grace_s / 2`` has passed since the last sweep began (or none ran)."""
        return time.monotonic() - self._last >= self.grace_s / 2

    def stop(self) -> None:
        self._stop.set()

    def sweep(self, now: float | None = None) -> list[str]:
        """Delete the orphaned chunks older than the grace (``now``: seconds since 1970, by
        default this host's clock); returns their names. Raises StorageError if the listing
        or the catalog fails (nothing more is deleted then; the next sweep starts over); a
        delete that fails is logged and left for the next sweep."""
        self._last = time.monotonic()
        now = time.time() if now is None else now
        old: dict[tuple[int, int], list[tuple[int, str]]] = {}
        for name, stored in self.store.list_chunk_times():
            parsed = parse_chunk_name(name)
            if parsed is None or now - stored < self.grace_s:
                continue
            stream_id, segment, base = parsed
            old.setdefault((stream_id, segment), []).append((base, name))
        swept = []
        for (stream_id, segment), found in sorted(old.items()):
            if self._stop.is_set():
                break
            recorded = self._recorded(stream_id, segment, min(b for b, _ in found))
            for _, name in found:
                if name in recorded:
                    continue
                try:
                    self.store.delete_chunk(name)
                except (StorageError, OSError) as exc:
                    log.warning(
                        "deleting orphaned chunk %s failed, next sweep retries: %s", name, exc
                    )
                    continue
                swept.append(name)
        self.swept += len(swept)
        if swept:
            log.info(
                "deleted %d orphaned chunks (older than %g s, in no catalog record)",
                len(swept),
                self.grace_s,
            )
        return swept

    def _recorded(self, stream_id: int, segment: int, offset: int) -> set[str]:
        """The names of the segment's chunk records from base offset ``offset`` on."""
        names: set[str] = set()
        while True:
            records = self.meta.chunks_from(stream_id, segment, offset, self.page)
            names.update(r.name for r in records)
            if len(records) < self.page:
                return names
            offset = records[-1].base_offset + 1

"""Journal: durable tier 1 of a container, an append-only log of opaque entries.

On-disk layout of a ``FileJournal``: a directory of files ``<file_id:016d>.journal``; the
highest id is the active file, the rest are sealed. Each file is a sequence of entries:

    offset size  field    meaning
    0      4     length   u32, payload bytes (> 0); bit 31 (SELF_CHECKED) is a flag, see below
    4      4     crc32c   u32, CRC32C of the payload (of its first CHECKED_PREFIX bytes if
                          SELF_CHECKED)
    8      ...   payload  ``length`` bytes

Recovery reads entries in file order. In the active (last) file, the first entry that is
short, zero-length or fails its CRC starts a torn or corrupt tail: it is cut off (the file
truncated) and logged, so nothing half-written is served. The one exception is *padding*: fewer
than ``BLOCK`` zero bytes that end a file whose size is a multiple of ``BLOCK``, which a direct
write leaves after the last entry; it is dropped quietly.

Damage in a *sealed* file is not a torn write: a file is synced before it is sealed, so every
entry in it was durable and later files hold acknowledged entries too. A journal given a
``resync`` marker (bytes every payload carries at a fixed position: the broker's batch magic)
skips such damage instead of cutting there: it searches for the marker, takes the first
candidate after the damaged entry whose length and CRC check out as the next entry, and records
the bytes in between as a ``DamagedRange`` (with the unverified heads of the entries their
length fields outline, for the owner to name what was lost). Sealed-file damage without a
marker, or with no valid entry after it in its file, is recorded the same way up to the file's
end; nothing is truncated and no later file is removed. We chose this over cutting the rest of
the container's journal (as a torn tail is cut) because that lost every acknowledged entry of
every segment after one flipped bit, and offsets were then handed out a second time.

The synced part of the active file is treated the same way when the journal keeps a *sync
checkpoint* (``checkpoint_seconds``): after a sync, at most that often, it overwrites the file
``synced.checkpoint`` with the active file's id and synced size (u64, u64, and a u32 CRC32C of
those 16 bytes) and syncs it. Recovery skips damage before that size and cuts only from there
on, where a torn write is possible. A checkpoint that fails its CRC is ignored.

Self-checked entries (a journal given a ``check``, writing directly): a large entry whose last
part lies in memory at ``payload_alignment`` within its block is written from that memory, not
copied. It starts on a block boundary: zero bytes pad the file from the previous entry to the
first boundary at least 8 bytes on (so padding always begins with a zero length, which no entry
has). Its CRC covers only the first ``CHECKED_PREFIX`` payload bytes (the broker's segment id
and batch header) and ``check`` the rest (the batch's own CRC32C), at recovery and on reads;
together they cover every byte, as a whole-payload CRC does. Recovery skips padding only when a
valid self-checked entry follows it; anything else there cuts the journal as above. Copying
and checksumming 2 MiB batches took a fifth of the journal's time in a bulk produce. The price:
a batch damaged in the broker's memory after it was verified on arrival and before it was
written fails recovery's check, so recovery cuts the journal there; with a whole-payload CRC,
computed from the damaged bytes, only reads of that batch would have failed.

Direct IO: a journal that syncs (``fsync=True``) writes with ``O_DIRECT`` where the filesystem
allows it. Each append copies its entries (but the middle blocks of self-checked ones) into a
reused, page-aligned 4 MiB buffer behind the file's last partial block and writes whole blocks
at block-aligned offsets, zero-padded at the end; the next append rewrites that last block
with the same bytes plus its own. The data goes to the device without passing through the
page cache, which is what the broker's writes cost most: on the development VM a buffered
write ran at 350 MB/s of kernel CPU into memory the VM had not touched recently, a direct one
at 1.5 GB/s with almost none.
A torn rewrite of the last block cannot damage earlier entries (their bytes are rewritten
unchanged). Readers use ordinary buffered reads, which Linux keeps coherent with direct
writes. Where ``O_DIRECT`` is refused (``EINVAL``), the journal falls back to buffered writes.

One parser, one padding rule: ``parse_entry`` is the only code that reads the layout above
(recovery, its search for the next entry after damage and its outline of a damaged range,
``entries``, ``heads`` and ``read``), and ``aligned_start`` (where a self-checked entry starts)
and ``block_end`` (where a direct write's padding ends) the only padding arithmetic, the
writer's and the parser's alike.

Files and their names: a journal that syncs (``fsync=True``) makes every change to its
directory durable before the call that made it returns: its own name (``ensure_dir``), a new
file (the first one, ``roll``), a removed one (``delete_file``, and recovery's removals and
cuts). A name is durable only once its directory is fsynced; fsyncing the file does not do it.
Without the sync, a deleted file could come back after a power failure, taking its disk space
again. Recovery tolerates that anyway: a container's file up to ``moved_through`` is removed
again unread, and a staging file that comes back holds only entries of finished transactions,
which the coordinator ignores.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import logging
import mmap
import os
import struct
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Protocol, cast

import crc32c
import msgspec
import numpy as np

from .._errors import CorruptData, StorageError, StorageFull

log = logging.getLogger("slipstream.journal")

_ENTRY = struct.Struct("<II")
ENTRY_OVERHEAD = _ENTRY.size
#: alignment of direct writes (file offset, length, memory); covers 512 B and 4 KiB devices
BLOCK = 4096
_DIRECT_BUFFER_BYTES = 4 * 1024 * 1024
#: length-field flag of a self-checked entry: its CRC covers only the payload's first
#: ``CHECKED_PREFIX`` bytes, and the payload's own checksum (the journal's ``check``) the rest
SELF_CHECKED = 0x8000_0000
CHECKED_PREFIX = 72
#: entries from this size on are written straight from their memory when it is aligned
ZERO_COPY_MIN_BYTES = 256 * 1024
_O_DIRECT: int = getattr(os, "O_DIRECT", 0)
Buffer = bytes | bytearray | memoryview
Check = Callable[[memoryview], bool]
_CHECKPOINT_NAME = "synced.checkpoint"
_CHECKPOINT_HEAD = struct.Struct("<QQ")  # active file id, its synced size
_CRC = struct.Struct("<I")  # CRC32C of the head, after it


class JournalAddress(msgspec.Struct, frozen=True, gc=False):
    """Where an entry's payload lies: file, byte position of the payload, payload length."""

    file_id: int
    position: int
    length: int


class DamagedRange(msgspec.Struct, frozen=True):
    """Bytes ``[start, end)`` of synced data in file ``file_id`` that hold no valid entry;
    ``heads`` are the first ``CHECKED_PREFIX`` bytes of each entry their length fields outline,
    in order, unverified (they may be damaged too)."""

    file_id: int
    start: int
    end: int
    heads: tuple[bytes, ...] = ()


class RecoveryReport(msgspec.Struct):
    """What recovery found: entries kept, bytes cut off as a torn or corrupt tail, and damaged
    ranges skipped in sealed files (in journal order)."""

    entries: int = 0
    files: int = 0
    cut_bytes: int = 0
    cut_reason: str | None = None
    damaged: list[DamagedRange] = msgspec.field(default_factory=list)


def storage_error(exc: OSError, action: str) -> StorageFull | StorageError:
    """The typed error for an IO failure while making appends durable."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageFull(f"disk full while {action}: free space, then retry ({exc})")
    return StorageError(f"IO error while {action}: {exc}")


class Journal(ABC):
    """An append-only log of entries with explicit durability.

    ``report`` says what the last ``recover`` kept and cut.

    ``append`` writes entries but does not make them durable; ``sync`` makes everything appended
    so far durable. If ``append`` raises, none of its entries was written (a partial write is
    cut off before it returns); earlier entries are untouched. If ``sync`` raises, the entries
    since the last successful ``sync`` are in an unknown state: a caller that acknowledges only
    synced entries calls ``discard_unsynced`` (which cuts them off) before appending again; a
    caller that acknowledged after ``append`` (fsync=interval/never) must keep them. Only one
    thread appends.
    """

    report: RecoveryReport

    @abstractmethod
    def recover(self, moved_through: int = -1) -> Iterator[tuple[JournalAddress, memoryview]]:
        """Yield every valid entry in order, cutting off a torn or corrupt tail first.

        Files with ids up to ``moved_through`` are already in long-term storage (their chunks
        may be hard links to them): they are removed unread, never cut or truncated. Damage in
        a sealed file, or in the synced part of the active one, is skipped, not cut (see the
        module docstring): ``report.damaged`` lists it, and has each file's ranges before that
        file's first entry is yielded.
        """

    @abstractmethod
    def append(self, entries: Sequence[Sequence[Buffer]]) -> list[JournalAddress]:
        """Write entries (each given as buffers to concatenate); return their addresses."""

    @abstractmethod
    def sync(self) -> None:
        """Make every appended entry durable. Raises StorageFull / StorageError."""

    @abstractmethod
    def discard_unsynced(self) -> None:
        """Cut off entries appended since the last successful ``sync``."""

    @abstractmethod
    def read(self, address: JournalAddress) -> bytes:
        """The payload at ``address``; raises CorruptData if it no longer checks out."""

    @abstractmethod
    def roll(self) -> int | None:
        """Seal the active file and start a new one; returns the sealed id (None if empty)."""

    @abstractmethod
    def sealed_files(self) -> list[int]:
        """Ids of sealed files, oldest first."""

    @abstractmethod
    def entries(self, file_id: int) -> Iterator[tuple[JournalAddress, memoryview]]:
        """The entries of one sealed file."""

    def heads(self, file_id: int, size: int) -> Iterator[tuple[JournalAddress, bytes]]:
        """The first ``size`` bytes (fewer if shorter) of each entry of one sealed file, for
        callers that need headers only. Unlike ``entries`` it need not check CRCs."""
        for address, payload in self.entries(file_id):
            yield address, bytes(payload[:size])

    def file_path(self, file_id: int) -> Path | None:
        """The local file holding a sealed file's bytes, if there is one (for zero-copy moves)."""
        return None

    def collect_orphans(self) -> list[str]:
        """Names of data the journal stored but is not (or no longer) part of it: an
        ObjectJournal's objects whose record a crash cut off, or whose file moved. Call it on
        the thread that syncs; ``delete_objects`` deletes them, on any thread. Files on disk
        are their own record: nothing to collect."""
        return []

    def delete_objects(self, names: Sequence[str]) -> None:  # noqa: B027 - see collect_orphans
        """Delete what ``collect_orphans`` returned."""

    @abstractmethod
    def delete_file(self, file_id: int) -> None:
        """Remove a sealed file whose entries have all moved to long-term storage (or are no
        longer needed); durably, if the journal syncs (see FileJournal)."""

    @property
    @abstractmethod
    def active_bytes(self) -> int:
        """Bytes in the active file."""

    @property
    @abstractmethod
    def total_bytes(self) -> int:
        """Bytes in all files."""

    def close(self) -> None:  # noqa: B027 - optional hook; in-memory journals hold no files
        """Release files; appends after close fail."""


Resync = tuple[bytes, int]
_Entries = list[tuple[JournalAddress, memoryview]]


# --- the entry format: one parser, one padding rule ------------------------------------------
#
# Every path that reads entries (recovery, its resync scan after damage and its outline of a
# damaged range, ``entries``, ``heads``, ``read``) goes through ``parse_entry``; every path that
# places or skips padding (the writer's plan and staging buffer, the parser) through
# ``aligned_start`` and ``block_end``. tests/storage/test_journal_format.py pins both to bytes
# built by hand from the module docstring.


def block_end(pos: int) -> int:
    """The first block boundary at or after ``pos``: where a direct write's zero padding ends
    (the only file sizes such padding may end)."""
    return -(-pos // BLOCK) * BLOCK


def aligned_start(pos: int) -> int:
    """Where a self-checked entry goes when the previous entry ends at ``pos``: ``pos`` itself
    on a block boundary, else the first boundary at least ENTRY_OVERHEAD bytes on, so that
    alignment padding always begins with a zero length field, which no entry has."""
    return pos if pos % BLOCK == 0 else block_end(pos + ENTRY_OVERHEAD)


class Parsed(enum.Enum):
    """What ``parse_entry`` found."""

    ENTRY = "entry"  # an entry (checked, unless parsed with verify=False)
    END = "end"  # the end of the bytes, or the zero padding a direct write leaves there
    TORN = "torn"  # a short header, a zero length, or a payload running past the end
    DAMAGED = "damaged"  # a whole entry that fails its CRC32C (or its check, if self-checked)


class EntryAt(NamedTuple):
    """``parse_entry``'s answer. For ENTRY, ``start`` is where the entry's header is (past any
    alignment padding), ``length`` its payload length; otherwise ``start`` is the position
    parsed and ``reason`` says what is wrong there (None at END)."""

    kind: Parsed
    start: int
    length: int = 0
    self_checked: bool = False
    reason: str | None = None

    @property
    def payload_start(self) -> int:
        return self.start + ENTRY_OVERHEAD

    @property
    def end(self) -> int:
        """Where the next entry may start."""
        return self.start + ENTRY_OVERHEAD + self.length


class _Source(Protocol):
    """The bytes ``parse_entry`` reads: ``size`` of them; ``read`` returns ``[pos, pos + n)``
    (fewer at the end)."""

    size: int

    def read(self, pos: int, n: int) -> Buffer: ...


class _InMemory:
    """A buffer as a _Source: reads are slices, never copies."""

    __slots__ = ("_view", "size")

    def __init__(self, data: Buffer) -> None:
        self._view = memoryview(data).cast("B")
        self.size = len(self._view)

    def read(self, pos: int, n: int) -> Buffer:
        return self._view[pos : pos + n]


class _InFile:
    """An open file as a _Source, read ahead ``_READ_AHEAD`` bytes at a time (as a buffered
    file is), so small entries cost no syscall each. Parsed with ``verify=False``, payloads
    are skipped: a file of large entries is read only around its headers."""

    __slots__ = ("_at", "_fd", "_window", "size")

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self.size = os.fstat(fd).st_size
        self._at = 0  # the file position of _window
        self._window = memoryview(b"")

    def read(self, pos: int, n: int) -> Buffer:
        skip = pos - self._at
        if skip >= 0 and skip + n <= len(self._window):
            return self._window[skip : skip + n]
        if n >= _READ_AHEAD:
            return os.pread(self._fd, n, pos)
        self._window, self._at = memoryview(os.pread(self._fd, _READ_AHEAD, pos)), pos
        return self._window[:n]


_READ_AHEAD = 64 * 1024


def parse_entry(
    data: Buffer | _Source, pos: int, check: Check | None = None, *, verify: bool = True
) -> EntryAt:
    """What is at byte ``pos`` of ``data`` (a file's bytes from its start; the layout is in
    the module docstring), the one parser of the format:

    * END at the end of ``data``, or where fewer than BLOCK zero bytes end it and its size is
      a multiple of BLOCK (a direct write's padding);
    * an ENTRY past alignment padding: zeros from ``pos`` to ``aligned_start(pos)`` followed
      by a self-checked entry that checks out (with ``verify=False``: whose payload fits);
    * else the entry right at ``pos``: TORN if its header is short, its length zero or its
      payload runs past the end; DAMAGED if it fails its CRC32C, or is self-checked and there
      is no ``check`` or the check fails; else an ENTRY.

    ``verify=False`` reads framing only: no CRC32C, no check (``heads``, the damage outline).
    """
    source = data if isinstance(data, (_InMemory, _InFile)) else _InMemory(cast(Buffer, data))
    size = source.size
    if pos >= size:
        return EntryAt(Parsed.END, pos)
    header = source.read(pos, ENTRY_OVERHEAD)
    if len(header) == ENTRY_OVERHEAD and _ENTRY.unpack(header)[0] != 0:
        return _entry_at(source, pos, header, check, verify)  # the common case: no padding
    if size - pos < BLOCK and size % BLOCK == 0 and _zeros(source.read(pos, size - pos)):
        return EntryAt(Parsed.END, pos)
    boundary = aligned_start(pos)
    if (
        boundary != pos
        and boundary + ENTRY_OVERHEAD <= size
        and _zeros(source.read(pos, boundary - pos))
    ):
        after = _entry_at(source, boundary, source.read(boundary, ENTRY_OVERHEAD), check, verify)
        if after.kind is Parsed.ENTRY and after.self_checked:
            return after
    return _entry_at(source, pos, header, check, verify)


def _entry_at(
    source: _Source, pos: int, header: Buffer, check: Check | None, verify: bool
) -> EntryAt:
    """The entry whose header (read already) is at ``pos``; no padding rules."""
    if len(header) < ENTRY_OVERHEAD:
        return EntryAt(Parsed.TORN, pos, reason=f"torn entry header at byte {pos}")
    field, crc = _ENTRY.unpack(header)
    length = field & ~SELF_CHECKED
    self_checked = bool(field & SELF_CHECKED)
    if length == 0 or pos + ENTRY_OVERHEAD + length > source.size:
        reason = f"torn or zero-length entry at byte {pos} (length {length})"
        return EntryAt(Parsed.TORN, pos, length, self_checked, reason)
    if verify:
        payload = memoryview(source.read(pos + ENTRY_OVERHEAD, length))
        if not _checks_out(field, crc, payload, check):
            reason = f"CRC32C mismatch in entry at byte {pos}"
            return EntryAt(Parsed.DAMAGED, pos, length, self_checked, reason)
    return EntryAt(Parsed.ENTRY, pos, length, self_checked)


def _zeros(data: Buffer) -> bool:
    return not bytes(data).strip(b"\0")


def checkpoint_record(file_id: int, synced: int) -> bytes:
    """The sync checkpoint's bytes: file id and synced size (u64, u64), their CRC32C (u32)."""
    head = _CHECKPOINT_HEAD.pack(file_id, synced)
    return head + _CRC.pack(crc32c.crc32c(head))


def parse_checkpoint(record: bytes) -> tuple[int, int] | None:
    """The (file id, synced size) of a sync checkpoint's bytes; None if they do not check out."""
    head = record[: _CHECKPOINT_HEAD.size]
    if len(record) != len(head) + _CRC.size or len(head) != _CHECKPOINT_HEAD.size:
        return None
    if _CRC.unpack_from(record, len(head))[0] != crc32c.crc32c(head):
        return None
    file_id, synced = _CHECKPOINT_HEAD.unpack(head)
    return int(file_id), int(synced)


def _checks_out(field: int, crc: int, payload: memoryview, check: Check | None) -> bool:
    if not field & SELF_CHECKED:
        return crc32c.crc32c(payload) == crc
    return (
        check is not None
        and len(payload) > CHECKED_PREFIX
        and crc32c.crc32c(payload[:CHECKED_PREFIX]) == crc
        and check(payload)
    )


def _parse_entries(
    file_id: int, data: memoryview, check: Check | None = None, start: int = 0
) -> tuple[_Entries, int, str | None]:
    """Valid entries of one file's bytes from ``start``, where they end, and why they stop
    there (None: at the end of the file, or at padding that ends it)."""
    source = _InMemory(data)
    found: _Entries = []
    at = parse_entry(source, start, check)
    while at.kind is Parsed.ENTRY:
        found.append(
            (JournalAddress(file_id, at.payload_start, at.length), data[at.payload_start : at.end])
        )
        at = parse_entry(source, at.end, check)
    return found, at.start, at.reason


def _parse_file(
    file_id: int, data: bytes, check: Check | None, resync: Resync | None, durable: int
) -> tuple[_Entries, list[DamagedRange], int, str | None]:
    """Valid entries of one file's bytes. Damage that starts before byte ``durable`` (synced,
    so not torn by a crash) is skipped, up to the next entry ``resync`` finds or to
    ``durable``; damage from ``durable`` on ends the file's valid part. Returns the entries,
    the damaged ranges, where the valid part ends and why (None: the file ends cleanly)."""
    view = memoryview(data)
    found: _Entries = []
    damaged: list[DamagedRange] = []
    pos = 0
    while True:
        entries, valid, reason = _parse_entries(file_id, view, check, start=pos)
        found += entries
        if reason is None or valid >= durable:
            return found, damaged, valid, reason
        after = len(data) if resync is None else _next_entry(data, valid, check, resync)
        after = min(after, durable)
        damaged.append(DamagedRange(file_id, valid, after, _outline(view, valid, after)))
        if after == len(data):
            return found, damaged, after, None
        pos = after


def _next_entry(data: bytes, bad: int, check: Check | None, resync: Resync) -> int:
    """Where the first valid entry after the bad one at ``bad`` starts (``len(data)`` if
    none): a payload whose ``marker`` sits ``at`` bytes in, that ``parse_entry`` takes."""
    marker, at = resync
    lead = ENTRY_OVERHEAD + at
    source = _InMemory(data)
    found = data.find(marker, bad + 1 + lead)
    while found >= 0:
        candidate = parse_entry(source, found - lead, check)
        if candidate.kind is Parsed.ENTRY:
            return candidate.start
        found = data.find(marker, found + 1)
    return len(data)


def _outline(data: memoryview, pos: int, end: int) -> tuple[bytes, ...]:
    """The heads of the entries that the length fields in ``data[pos:end]`` outline (past
    alignment padding), unverified."""
    source = _InMemory(data[:end])
    heads = []
    at = parse_entry(source, pos, verify=False)
    while at.kind is Parsed.ENTRY:
        start = at.payload_start
        heads.append(bytes(data[start : start + min(at.length, CHECKED_PREFIX)]))
        at = parse_entry(source, at.end, verify=False)
    return tuple(heads)


def _entry_buffers(entry: Sequence[Buffer]) -> list[Buffer]:
    length = sum(len(b) for b in entry)
    crc = 0
    for b in entry:
        crc = crc32c.crc32c(b, crc)
    return [_ENTRY.pack(length, crc), *entry]


def _address_of(buffer: Buffer) -> int:
    return int(np.frombuffer(buffer, np.uint8).ctypes.data)


def payload_alignment(prefix_bytes: int) -> int:
    """Where in a block the last part of an entry must start, after ``prefix_bytes`` of other
    parts, for the entry to be written straight from that part's memory: allocate receive
    buffers so that ``address % BLOCK`` equals this."""
    return (ENTRY_OVERHEAD + prefix_bytes) % BLOCK


@dataclass(frozen=True, slots=True)
class _ZeroCopy:
    """A self-checked entry written from its own memory: ``head`` (entry header and the
    payload's leading parts) then ``body``, whose address is ``len(head)`` past a block."""

    head: bytes
    body: memoryview


class FileJournal(Journal):
    """The journal on local files: one write per group (direct where possible, see the module
    docstring), one ``fdatasync`` per sync. ``direct`` defaults to ``fsync``."""

    def __init__(
        self,
        directory: Path,
        *,
        fsync: bool = True,
        direct: bool | None = None,
        fault: Callable[[str], None] | None = None,
        check: Check | None = None,
        resync: Resync | None = None,
        checkpoint_seconds: float | None = None,
    ) -> None:
        self.directory = directory
        self._check = check  # verifies self-checked payloads; None: write none, accept none
        self._resync = resync  # (marker, position in payload): finds entries after damage
        self._damaged: dict[int, list[tuple[int, int]]] = {}  # file -> ranges recovery skipped
        self._checkpoint_every = checkpoint_seconds  # None: no sync checkpoints
        self._checkpointed = float("-inf")  # monotonic time of the last checkpoint
        self._checkpoint_fd = -1
        ensure_dir(directory, sync=fsync)
        self._fsync = fsync
        self._want_direct = (fsync if direct is None else direct) and _O_DIRECT != 0
        self._direct = False  # whether the active file's fd is open with O_DIRECT
        self._tail = b""  # the active file's last partial block (direct writes rewrite it)
        self._buffer: mmap.mmap | None = None  # page-aligned staging for direct writes
        self._fault = fault  # deterministic fault injection: called with "write" / "sync"
        self._files: dict[int, int] = {}  # file id -> size in bytes
        self._active_id = 0
        self._fd = -1
        self._synced_size = 0
        self._lock = threading.Lock()  # guards the fd against a concurrent close
        self.report = RecoveryReport()

    @property
    def direct(self) -> bool:
        """Whether appends go to the active file with ``O_DIRECT``."""
        return self._direct

    def _path(self, file_id: int) -> Path:
        return self.directory / f"{file_id:016d}.journal"

    def recover(self, moved_through: int = -1) -> Iterator[tuple[JournalAddress, memoryview]]:
        ids = sorted(int(p.stem) for p in self.directory.glob("*.journal"))
        report = self.report
        for file_id in ids:
            path = self._path(file_id)
            if file_id <= moved_through:
                path.unlink()
                continue
            data = path.read_bytes()
            report.files += 1
            durable = len(data) if file_id != ids[-1] else self._durable_size(file_id, len(data))
            entries, damaged, valid, reason = _parse_file(
                file_id, data, self._check, self._resync, durable
            )
            for damage in damaged:
                log.error(
                    "journal %s: bytes %d to %d are damaged (%d entries outlined); "
                    "skipped, the entries after them are kept",
                    path.name,
                    damage.start,
                    damage.end,
                    len(damage.heads),
                )
            if damaged:
                report.damaged += damaged
                self._damaged[file_id] = [(d.start, d.end) for d in damaged]
            report.entries += len(entries)
            if reason is not None:
                report.cut_bytes += len(data) - valid
                report.cut_reason = f"{path.name}: {reason}"
                log.warning(
                    "journal %s: cutting %d bytes: %s", path.name, len(data) - valid, reason
                )
                with open(path, "r+b") as f:
                    f.truncate(valid)
                    os.fsync(f.fileno())
            elif valid < len(data):  # a direct write's padding: nothing to report or sync
                os.truncate(path, valid)
            self._files[file_id] = valid
            yield from entries
        if report.cut_reason is not None or moved_through >= 0:
            fsync_dir(self.directory)  # make the removals and the cut durable
        self._active_id = max(self._files, default=0)
        if not self._files:
            self._files[0] = 0
        self._open_active()

    def _durable_size(self, file_id: int, size: int) -> int:
        """How much of the active file the last sync checkpoint says was synced."""
        try:
            record = (self.directory / _CHECKPOINT_NAME).read_bytes()
        except FileNotFoundError:
            return 0
        checkpoint = parse_checkpoint(record)
        if checkpoint is None or checkpoint[0] != file_id:
            return 0
        synced = checkpoint[1]
        if synced > size:
            log.error(
                "journal %s: %d bytes synced before are missing (the file was cut short)",
                self._path(file_id).name,
                synced - size,
            )
        return min(int(synced), size)

    def _write_checkpoint(self) -> None:
        """Record the active file's synced size (see the module docstring). A failure only
        costs recovery the ability to tell rot from a torn write; it is logged, not raised."""
        try:
            if self._checkpoint_fd < 0:
                path = self.directory / _CHECKPOINT_NAME
                self._checkpoint_fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
                fsync_dir(self.directory)
            os.pwrite(self._checkpoint_fd, checkpoint_record(self._active_id, self._synced_size), 0)
            os.fdatasync(self._checkpoint_fd)
        except OSError as exc:
            log.warning("journal %s: could not write the sync checkpoint: %s", self.directory, exc)

    def _open_active(self) -> None:
        path = self._path(self._active_id)
        size = self._files[self._active_id]
        self._fd = self._open_for_append(path)
        self._tail = b""
        if self._direct and size % BLOCK:
            with open(path, "rb") as f:
                f.seek(size - size % BLOCK)
                self._tail = f.read(size % BLOCK)
        self._synced_size = size
        if size == 0:
            fsync_dir(self.directory)

    def _open_for_append(self, path: Path) -> int:
        """Open (creating) a journal file for appends: with O_DIRECT if wanted and allowed."""
        if self._want_direct:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | _O_DIRECT, 0o644)
                self._direct = True
                return fd
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._direct_refused(exc)
        self._direct = False
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def _direct_refused(self, exc: OSError) -> None:
        self._want_direct = False
        log.info("journal %s: no direct IO (%s), writing buffered", self.directory, exc)

    def append(self, entries: Sequence[Sequence[Buffer]]) -> list[JournalAddress]:
        start = self._files[self._active_id]
        items, addresses, position = self._plan(entries, start)
        try:
            if self._fault:
                self._fault("write")
            self._write(items, start)
        except OSError as exc:
            self._truncate_active(start)  # nothing of a failed append stays
            if not (exc.errno == errno.EINVAL and self._direct):
                raise storage_error(exc, "writing the journal") from exc
            self._direct_refused(exc)  # a device with coarser alignment: write buffered
            self._reopen()
            items, addresses, position = self._plan(entries, start)  # all plain entries now
            try:
                _writev_all(self._fd, cast(list[Buffer], items))
            except OSError as retry:
                self._truncate_active(start)
                raise storage_error(retry, "writing the journal") from retry
        self._files[self._active_id] = position
        return addresses

    def _plan(
        self, entries: Sequence[Sequence[Buffer]], position: int
    ) -> tuple[list[Buffer | _ZeroCopy], list[JournalAddress], int]:
        """What to write for ``entries`` from file position ``position``: plain entries as
        buffers, aligned ones as _ZeroCopy (after alignment padding); their addresses; the new
        end."""
        items: list[Buffer | _ZeroCopy] = []
        addresses = []
        for entry in entries:
            length = sum(len(b) for b in entry)
            if length == 0:
                raise ValueError("journal entries must not be empty")
            aligned = self._zero_copy(entry, length)
            if aligned is None:
                items.extend(_entry_buffers(entry))
            else:
                position = aligned_start(position)
                items.append(aligned)
            addresses.append(JournalAddress(self._active_id, position + ENTRY_OVERHEAD, length))
            position += ENTRY_OVERHEAD + length
        return items, addresses, position

    def _zero_copy(self, entry: Sequence[Buffer], length: int) -> _ZeroCopy | None:
        """The entry as a self-checked one written from its last part's memory, if it is large,
        the journal writes directly and can check such entries, and the last part sits where
        its block alignment lets the device read it in place (see ``payload_alignment``)."""
        if not self._direct or self._check is None or length < ZERO_COPY_MIN_BYTES:
            return None
        *lead, last = entry
        lead_bytes = b"".join(bytes(b) for b in lead)
        body = memoryview(last).cast("B")
        if len(lead_bytes) >= CHECKED_PREFIX or len(body) < BLOCK:
            return None
        if _address_of(body) % BLOCK != payload_alignment(len(lead_bytes)):
            return None
        crc = crc32c.crc32c(body[: CHECKED_PREFIX - len(lead_bytes)], crc32c.crc32c(lead_bytes))
        return _ZeroCopy(_ENTRY.pack(length | SELF_CHECKED, crc) + lead_bytes, body)

    def _write(self, items: list[Buffer | _ZeroCopy], start: int) -> None:
        if not self._direct:
            _writev_all(self._fd, cast(list[Buffer], items))
            return
        if self._buffer is None:
            self._buffer = mmap.mmap(-1, _DIRECT_BUFFER_BYTES)  # page-aligned, reused
        out = memoryview(self._buffer)
        # Bytes go through ``out`` (a staging buffer, block-aligned in the file) except the
        # middle blocks of _ZeroCopy entries, which go from their own memory: ``pieces`` is
        # one pwritev's worth of both, block-aligned, for the file from byte ``at``.
        at = start - len(self._tail)  # block-aligned: the last partial block is written again
        fill = len(self._tail)  # bytes in ``out``; fill % BLOCK == file position % BLOCK
        staged = 0  # where the bytes of ``out`` not yet in ``pieces`` begin
        pieces: list[memoryview] = []
        out[:fill] = self._tail

        def stage(data: memoryview) -> None:
            nonlocal fill, staged, at
            while data:
                n = min(len(data), len(out) - fill)
                out[fill : fill + n] = data[:n]
                fill += n
                data = data[n:]
                if fill == len(out):  # staging is full: write everything so far
                    pieces.append(out[staged:])
                    at = _pwritev_all(self._fd, pieces, at)
                    pieces.clear()
                    fill = staged = 0

        for item in items:
            if not isinstance(item, _ZeroCopy):
                stage(memoryview(item).cast("B"))
                continue
            stage(memoryview(bytes(aligned_start(fill) - fill)))  # zeros up to the entry
            head = BLOCK - len(item.head)  # body bytes in the entry's first block
            out[fill : fill + len(item.head)] = item.head
            out[fill + len(item.head) : fill + BLOCK] = item.body[:head]
            fill += BLOCK
            middle = (len(item.body) - head) // BLOCK * BLOCK
            pieces += [out[staged:fill], item.body[head : head + middle]]
            staged = fill
            stage(item.body[head + middle :])
        end = block_end(fill)
        out[fill:end] = bytes(end - fill)  # zero padding, never stale bytes
        pieces.append(out[staged:end])
        _pwritev_all(self._fd, pieces, at)
        self._tail = bytes(out[fill - fill % BLOCK : fill])

    def _reopen(self) -> None:
        with self._lock:
            os.close(self._fd)
            self._open_active()

    def sync(self) -> None:
        try:
            if self._fault:
                self._fault("sync")
            if self._fsync:
                os.fdatasync(self._fd)
        except OSError as exc:
            raise storage_error(exc, "syncing the journal") from exc
        self._synced_size = self._files[self._active_id]
        if self._fsync and self._checkpoint_every is not None and self._synced_size:
            now = time.monotonic()
            if now - self._checkpointed >= self._checkpoint_every:
                self._checkpointed = now
                self._write_checkpoint()

    def discard_unsynced(self) -> None:
        # After a failed fsync the page cache may be lying (the PostgreSQL "fsyncgate" lesson):
        # cut back to the last synced size and reopen, so later appends start from known bytes.
        self._truncate_active(self._synced_size)

    def _truncate_active(self, size: int) -> None:
        synced = min(self._synced_size, size)
        with self._lock:
            os.close(self._fd)
            with open(self._path(self._active_id), "r+b") as f:
                f.truncate(size)
            self._files[self._active_id] = size
            self._open_active()
        self._synced_size = synced

    def read(self, address: JournalAddress) -> bytes:
        with open(self._path(address.file_id), "rb") as f:
            f.seek(address.position - ENTRY_OVERHEAD)
            data = f.read(address.length + ENTRY_OVERHEAD)
        at = parse_entry(data, 0, self._check)
        if at.kind is not Parsed.ENTRY or at.end != len(data) or at.length != address.length:
            raise CorruptData(
                f"journal entry at {self._path(address.file_id).name}:{address.position} "
                "failed its CRC32C check",
                file=address.file_id,
                position=address.position,
            )
        return data[ENTRY_OVERHEAD:]

    def roll(self) -> int | None:
        if self._files[self._active_id] == 0:
            return None
        self.sync()
        sealed = self._active_id
        with self._lock:
            try:
                self._cut_padding()
                fd = self._open_for_append(self._path(sealed + 1))
                fsync_dir(self.directory)  # the new file's name must survive a power cut
            except OSError as exc:
                raise storage_error(exc, "starting a new journal file") from exc
            os.close(self._fd)
            self._fd = fd
            self._active_id = sealed + 1
            self._files[self._active_id] = 0
            self._synced_size = 0
            self._tail = b""
        return sealed

    def _cut_padding(self) -> None:
        """Trim a direct write's padding off the active file (tidiness: recovery and readers
        skip it anyway, so the trim need not be synced)."""
        if self._direct and self._tail:
            os.ftruncate(self._fd, self._files[self._active_id])

    def sealed_files(self) -> list[int]:
        ids = list(self._files)  # one C-level copy: the IO thread may add a file meanwhile
        return sorted(i for i in ids if i != self._active_id)

    def entries(self, file_id: int) -> Iterator[tuple[JournalAddress, memoryview]]:
        data = self._path(file_id).read_bytes()
        if file_id in self._damaged:  # damaged in recovery: skip what recovery skipped
            return iter(_parse_file(file_id, data, self._check, self._resync, len(data))[0])
        found, _, reason = _parse_entries(file_id, memoryview(data), self._check)
        if reason is not None:
            raise CorruptData(f"sealed journal file {file_id}: {reason}", file=file_id)
        return iter(found)

    def heads(self, file_id: int, size: int) -> Iterator[tuple[JournalAddress, bytes]]:
        # Reads entry headers (and padding) and ``size`` bytes of each payload, and skips the
        # rest of payloads larger than the read-ahead: the mover needs only batch headers, and
        # reading whole files of large batches back would pull every byte written (directly,
        # past the page cache) into memory once more.
        skips = dict(self._damaged.get(file_id, ()))  # start -> end of ranges recovery skipped
        with open(self._path(file_id), "rb") as f:
            source = _InFile(f.fileno())
            pos = 0
            while True:
                if pos in skips:
                    pos = skips[pos]
                    continue
                at = parse_entry(source, pos, verify=False)
                if at.kind is Parsed.END:
                    return
                if at.kind is not Parsed.ENTRY:
                    raise CorruptData(
                        f"sealed journal file {file_id}: torn entry at byte {pos}", file=file_id
                    )
                start = at.start + ENTRY_OVERHEAD
                pos = start + at.length
                yield (
                    JournalAddress(file_id, start, at.length),
                    bytes(source.read(start, min(size, at.length))),
                )

    def file_path(self, file_id: int) -> Path | None:
        return self._path(file_id)

    def delete_file(self, file_id: int) -> None:
        if file_id == self._active_id:
            raise ValueError("the active journal file cannot be deleted")
        self._path(file_id).unlink(missing_ok=True)
        del self._files[file_id]
        self._damaged.pop(file_id, None)
        if self._fsync:
            fsync_dir(self.directory)  # the removal survives a power failure (module docstring)

    @property
    def active_bytes(self) -> int:
        return self._files[self._active_id]

    @property
    def total_bytes(self) -> int:
        return sum(self._files.values())

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                with contextlib.suppress(OSError):
                    self._cut_padding()
                os.close(self._fd)
                self._fd = -1
            if self._checkpoint_fd >= 0:
                os.close(self._checkpoint_fd)
                self._checkpoint_fd = -1


class MemoryJournal(Journal):
    """The journal in memory: for tests and embedded use where a crash may lose everything.

    It honours the same contract (including discard after failure) so the conformance suite runs
    on it, and ``fault`` injects the same failures as on files.
    """

    def __init__(self, *, fault: Callable[[str], None] | None = None) -> None:
        self._fault = fault
        self.report = RecoveryReport()
        self._files: dict[int, list[bytes]] = {0: []}
        self._active_id = 0
        self._synced = 0

    def recover(self, moved_through: int = -1) -> Iterator[tuple[JournalAddress, memoryview]]:
        for file_id in sorted(self._files):
            if file_id <= moved_through and file_id != self._active_id:
                del self._files[file_id]
                continue
            for index, payload in enumerate(self._files[file_id]):
                yield JournalAddress(file_id, index, len(payload)), memoryview(payload)

    def append(self, entries: Sequence[Sequence[Buffer]]) -> list[JournalAddress]:
        if any(sum(len(b) for b in entry) == 0 for entry in entries):
            raise ValueError("journal entries must not be empty")
        try:
            if self._fault:
                self._fault("write")
        except OSError as exc:
            raise storage_error(exc, "writing the journal") from exc
        active = self._files[self._active_id]
        addresses = []
        for entry in entries:
            payload = b"".join(bytes(b) for b in entry)
            addresses.append(JournalAddress(self._active_id, len(active), len(payload)))
            active.append(payload)
        return addresses

    def sync(self) -> None:
        try:
            if self._fault:
                self._fault("sync")
        except OSError as exc:
            raise storage_error(exc, "syncing the journal") from exc
        self._synced = len(self._files[self._active_id])

    def discard_unsynced(self) -> None:
        del self._files[self._active_id][self._synced :]

    def read(self, address: JournalAddress) -> bytes:
        entries = self._files.get(address.file_id)
        if entries is None:
            raise FileNotFoundError(f"journal file {address.file_id} was deleted")
        return entries[address.position]

    def roll(self) -> int | None:
        if not self._files[self._active_id]:
            return None
        self.sync()
        sealed = self._active_id
        self._active_id += 1
        self._files[self._active_id] = []
        self._synced = 0
        return sealed

    def sealed_files(self) -> list[int]:
        return sorted(i for i in self._files if i != self._active_id)

    def entries(self, file_id: int) -> Iterator[tuple[JournalAddress, memoryview]]:
        for index, payload in enumerate(self._files[file_id]):
            yield JournalAddress(file_id, index, len(payload)), memoryview(payload)

    def delete_file(self, file_id: int) -> None:
        if file_id == self._active_id:
            raise ValueError("the active journal file cannot be deleted")
        del self._files[file_id]

    @property
    def active_bytes(self) -> int:
        return sum(map(len, self._files[self._active_id]))

    @property
    def total_bytes(self) -> int:
        return sum(sum(map(len, f)) for f in self._files.values())


_IOV_MAX = 1024


def _pwritev_all(fd: int, pieces: list[memoryview], offset: int) -> int:
    """Write ``pieces`` at ``offset`` (fewer bytes may go per call); returns the end offset."""
    pending = [p for p in pieces if len(p)]
    while pending:
        written = os.pwritev(fd, pending[:_IOV_MAX], offset)
        offset += written
        _drop_written(pending, written)
    return offset


def _writev_all(fd: int, buffers: list[Buffer]) -> None:
    # os.writev may write less than asked (and takes at most IOV_MAX buffers); loop until done.
    pending = [memoryview(b) for b in buffers if len(b)]
    while pending:
        _drop_written(pending, os.writev(fd, pending[:_IOV_MAX]))


def _drop_written(pending: list[memoryview], written: int) -> None:
    """Remove the first ``written`` bytes from the front of ``pending``."""
    while written and pending:
        if written >= len(pending[0]):
            written -= len(pending.pop(0))
        else:
            pending[0] = pending[0][written:]
            written = 0


def fsync_dir(directory: Path) -> None:
    """Make the entries of ``directory`` durable: names created, renamed, linked or removed in
    it survive a power failure only after this (fsyncing a file does not sync its name)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def ensure_dir(directory: Path, *, sync: bool = True) -> None:
    """Create ``directory`` and its missing parents, durably with ``sync``: each new directory's
    name is synced in its parent before this returns. Without that, a power failure can take a
    directory away with every file synced inside it. Raises OSError."""
    missing = []
    at = directory
    while not at.is_dir():
        missing.append(at)
        if at.parent == at:
            break
        at = at.parent
    for path in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another thread or process made it
            path.mkdir()
        if sync:
            fsync_dir(path.parent)

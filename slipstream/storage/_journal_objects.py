"""ObjectJournal: a container's journal whose durable copy is in an S3-compatible object store.

How the Journal interface maps onto objects:

* A journal *file* is a logical byte sequence, numbered as a FileJournal's files are, made of
  objects. Entries use the FileJournal's framing (``u32 length``, ``u32 CRC32C`` of the
  payload, the payload; storage/_journal.py), never padded nor self-checked, so an address's
  ``position`` is the payload's byte position in its logical file.
* ``append`` frames entries into memory; nothing leaves the process.
* ``sync`` uploads every entry appended since the last sync as ONE object (one PUT), then
  records it in the MetaStore (``add_journal_object``), and returns only after both: an
  acknowledgement (the container's group commit acknowledges after ``sync``) means the object
  is stored and its record committed. The object's name: ``journal/<container>/<file id:016d>/
  <start:016d>-<lease epoch>`` (no ``-<epoch>`` without a lease, as before leases), ``start``
  being the position of its first byte in the file. A sync with nothing appended does nothing.
* Why the epoch is in the name: a broker paused (SIGSTOP, a long GC) after choosing its next
  object's name and before its PUT may resume after another broker took the container over,
  recovered the file and recorded its own next object at the same position. Its PUT then lands
  beside that object, not over it (an acknowledged append would read back as the paused
  broker's bytes), and its record is refused by the lease (LeaseLost): the upload is an orphan
  for the sweep. Records hold the names, so objects named without an epoch stay readable.
* If ``sync`` fails, the upload or the record may or may not have happened. ``discard_unsynced``
  drops the entries from memory and leaves the position they took unused: the next object of
  the file starts after it, so no name and no record position is ever used twice in one run
  (a record committed although its commit raised would otherwise collide with the next one).
  Its entries come back at recovery if the record did commit, as unacknowledged entries of a
  FileJournal whose fsync failed may.
* ``roll`` syncs, then starts the next file, recording an empty marker for it (``start`` -1,
  size 0, no object) so that a restart knows the rolled file is sealed. It uploads nothing.
* ``sealed_files``, ``entries``, ``delete_file`` work per file as on a FileJournal; the mover
  gets ``entries`` (``file_path`` is None, so chunks are written from the bytes). ``delete_file``
  forgets the file's records; its objects, no longer listed, are orphans, deleted by the next
  sweep off the journal thread (a file of small objects is thousands of DELETEs).
* ``recover`` lists the committed records from the MetaStore, never the bucket: an object
  uploaded whose record was not committed was never acknowledged, and it is not read. Files up
  to ``moved_through`` are forgotten (their objects left to the sweep). The last recorded file is
  the active one (appends continue in it).
* The sweep: ``collect_orphans`` (the container's mover calls it on the journal thread, so no
  sync is between its upload and its record) lists the objects under the container's prefix
  that the MetaStore does not list: uploads whose record never committed (a crash between the
  two, a failed sync), moved files' objects, deletes that failed; ``delete_objects`` deletes
  them on the mover's thread.

Reads: ``read`` serves entries still in memory (appended, or in the ``cache_bytes`` of the
newest objects synced), else a ranged GET of exactly the entry (framing included, its CRC
checked). The container reads the journal only for batches its tail cache dropped and for the
mover's ``entries`` of a sealed file, so the cache mostly saves the mover GETs of small files.

Damage: an object's bytes are written whole by one PUT, so there is no torn tail; an entry that
fails its CRC is CorruptData (at recovery: the rest of that object is recorded in
``report.damaged`` and skipped, as a FileJournal skips damage in a sealed file; a missing object
is CorruptData too).

Threads: one thread appends, syncs, rolls and deletes (the container's journal thread); ``read``
and ``entries`` may run on others. ``_lock`` guards the maps they share; object IO runs
outside it.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import crc32c

from .._errors import CorruptData, StorageError
from ._chunks import LongTermStore
from ._journal import (
    _ENTRY,
    ENTRY_OVERHEAD,
    Buffer,
    DamagedRange,
    Journal,
    JournalAddress,
    Parsed,
    RecoveryReport,
    parse_entry,
    storage_error,
)
from ._meta import JournalObject, Lease, MetaStore

log = logging.getLogger("slipstream.journal")

#: GETs in flight while recovery or the mover reads a run of objects
FETCH_AHEAD = 8

#: default bytes of the newest synced objects kept in memory for reads and the mover
CACHE_BYTES = 32 * 1024 * 1024


def journal_prefix(container: int) -> str:
    """Where a container's journal objects live, under the object store's prefix."""
    return f"journal/{container}/"


def object_name(container: int, file_id: int, start: int, epoch: int | None = None) -> str:
    """A journal object's name; ``epoch``: the writer's lease epoch (module docstring)."""
    name = f"{journal_prefix(container)}{file_id:016d}/{start:016d}"
    return name if epoch is None else f"{name}-{epoch}"


class ObjectJournal(Journal):
    """A Journal in an object store with its records in a MetaStore (see the module docstring
    for how files, syncs and rolls map onto objects).

    Guarantees: ``sync`` returns only once the object holding every entry appended since the
    last sync is stored and its record committed; then recovery (on any broker that reads the
    same MetaStore and bucket) yields them, in order. If ``sync`` raises (StorageError: the
    store or the MetaStore failed), none of those entries may be acknowledged; the caller calls
    ``discard_unsynced`` before appending again. ``fault(op)`` is called with "write" (append),
    "sync" (before the upload) and "record" (after the upload, before the record: raising there
    is a crash between the two, which leaves an orphan).
    """

    def __init__(
        self,
        store: LongTermStore,
        meta: MetaStore,
        container: int,
        *,
        cache_bytes: int = CACHE_BYTES,
        fault: Callable[[str], None] | None = None,
    ) -> None:
        self.store = store
        self.meta = meta
        self.container = container
        #: the container's lease, set by the container holding it (Container.hold; a whole
        #: immutable value, replaced by one assignment): every catalog write of the journal
        #: is fenced by it, so a broker that lost the container records no object
        self.lease: Lease | None = None
        self.report = RecoveryReport()
        self._fault = fault
        self._cache_limit = max(0, cache_bytes)
        self._lock = threading.Lock()
        # file id -> its recorded objects, by start (size-0 markers have none)
        self._files: dict[int, list[JournalObject]] = {0: []}
        self._active_id = 0
        self._end = 0  # where the active file's next entry goes (past discarded gaps)
        self._pending: list[bytes] = []  # framed entries appended since the last sync
        self._pending_start = 0
        self._pending_bytes = 0
        self._cache: OrderedDict[str, bytes] = OrderedDict()  # object name -> bytes, LRU
        self._cached_bytes = 0
        self._damaged: dict[int, list[DamagedRange]] = {}
        self._marker_unknown = False  # a roll's marker record failed: it may be there

    # --- recovery ------------------------------------------------------------------------

    def recover(self, moved_through: int = -1) -> Iterator[tuple[JournalAddress, memoryview]]:
        self.report = RecoveryReport()
        records = self.meta.journal_objects(self.container)
        moved = sorted({r.file_id for r in records if r.file_id <= moved_through})
        if moved:
            # their objects are orphans now: the mover's first sweep deletes them
            self.meta.remove_journal_objects(self.container, moved, lease=self.lease)
        files: dict[int, list[JournalObject]] = {}
        for record in records:
            if record.file_id > moved_through:
                files.setdefault(record.file_id, []).append(record)
        active = max(files, default=moved_through + 1)
        files.setdefault(active, [])
        with self._lock:
            self._files = files
            self._active_id = active
            self._end = self._pending_start = max(
                (r.start + r.size for r in files[active] if r.size), default=0
            )
            self._pending, self._pending_bytes = [], 0
            self._damaged = {}
        self.report.files = len(files)
        ordered = [r for file_id in sorted(files) for r in files[file_id] if r.size]
        for record, data in self._fetch_in_order(ordered):
            found, damage = _parse_object(record.file_id, record, data)
            if damage is not None:
                self.report.damaged.append(damage)
                self._damaged.setdefault(record.file_id, []).append(damage)
            for address, payload in found:
                self.report.entries += 1
                yield address, payload

    # --- writing -------------------------------------------------------------------------

    def append(self, entries: Sequence[Sequence[Buffer]]) -> list[JournalAddress]:
        framed: list[bytes] = []
        for entry in entries:
            payload = b"".join(entry)
            if not payload:
                raise ValueError("journal entries must not be empty")
            framed.append(_ENTRY.pack(len(payload), crc32c.crc32c(payload)) + payload)
        try:
            if self._fault:
                self._fault("write")
        except OSError as exc:
            raise storage_error(exc, "writing the journal") from exc
        addresses = []
        with self._lock:
            at = self._pending_start + self._pending_bytes
            for item in framed:
                addresses.append(
                    JournalAddress(self._active_id, at + ENTRY_OVERHEAD, len(item) - ENTRY_OVERHEAD)
                )
                at += len(item)
            self._pending += framed
            self._pending_bytes += sum(map(len, framed))
        return addresses

    def sync(self) -> None:
        try:
            if self._fault:
                self._fault("sync")
        except OSError as exc:
            raise storage_error(exc, "syncing the journal") from exc
        if not self._pending_bytes:
            return
        data = b"".join(self._pending)
        lease = self.lease
        record = JournalObject(
            self._active_id,
            self._pending_start,
            len(data),
            object_name(
                self.container,
                self._active_id,
                self._pending_start,
                None if lease is None else lease.epoch,
            ),
        )
        # from here on, whatever fails, this position is not used again (module docstring)
        self._end = self._pending_start + len(data)
        self.store.write_chunk(record.name, [data])
        try:
            if self._fault:
                self._fault("record")
        except OSError as exc:
            raise storage_error(exc, "recording a journal object") from exc
        self.meta.add_journal_object(self.container, record, lease=self.lease)
        with self._lock:
            self._files[self._active_id].append(record)
            self._pending, self._pending_bytes = [], 0
            self._pending_start = self._end
            self._remember(record.name, data)

    def discard_unsynced(self) -> None:
        with self._lock:
            self._pending, self._pending_bytes = [], 0
            self._pending_start = self._end

    def roll(self) -> int | None:
        if not self._pending_bytes and not any(r.size for r in self._files[self._active_id]):
            return None
        self.sync()
        sealed, new = self._active_id, self._active_id + 1
        marker = JournalObject(new, -1, 0, "")
        # a roll whose marker failed may have committed it anyway: the retry looks first
        if not self._marker_unknown or marker not in self.meta.journal_objects(self.container):
            self._marker_unknown = True
            self.meta.add_journal_object(self.container, marker, lease=self.lease)
        self._marker_unknown = False
        with self._lock:
            self._files[new] = []
            self._active_id = new
            self._end = self._pending_start = 0
        return sealed

    # --- reading -------------------------------------------------------------------------

    def read(self, address: JournalAddress) -> bytes:
        start = address.position - ENTRY_OVERHEAD
        with self._lock:
            records = self._files.get(address.file_id)
            if records is None:
                raise FileNotFoundError(f"journal file {address.file_id} was deleted")
            if address.file_id == self._active_id and start >= self._pending_start:
                data: Buffer = b"".join(self._pending)
                at = start - self._pending_start
                record = None
            else:
                index = bisect.bisect_right([r.start for r in records], start) - 1
                if index < 0 or start >= records[index].start + records[index].size:
                    raise CorruptData(
                        f"journal file {address.file_id} has no entry at {address.position}",
                        file=address.file_id,
                        position=address.position,
                    )
                record = records[index]
                cached = self._cache.get(record.name)
                if cached is not None:
                    self._cache.move_to_end(record.name)
                data, at = (cached, start - record.start) if cached is not None else (b"", 0)
        if record is not None and not data:
            try:
                data = self.store.read_chunk(
                    record.name, start - record.start, address.length + ENTRY_OVERHEAD
                )
            except CorruptData as exc:
                with self._lock:
                    if address.file_id not in self._files:
                        raise FileNotFoundError(
                            f"journal file {address.file_id} was deleted"
                        ) from exc
                raise
        parsed = parse_entry(memoryview(data)[at : at + address.length + ENTRY_OVERHEAD], 0)
        if parsed.kind is not Parsed.ENTRY or parsed.length != address.length:
            raise CorruptData(
                f"journal entry at file {address.file_id}, position {address.position} failed "
                "its CRC32C check",
                file=address.file_id,
                position=address.position,
            )
        return bytes(memoryview(data)[at + ENTRY_OVERHEAD : at + ENTRY_OVERHEAD + address.length])

    def sealed_files(self) -> list[int]:
        with self._lock:
            return sorted(i for i in self._files if i != self._active_id)

    def entries(self, file_id: int) -> Iterator[tuple[JournalAddress, memoryview]]:
        with self._lock:
            records = list(self._files[file_id])
        for record, data in self._fetch_in_order([r for r in records if r.size]):
            found, damage = _parse_object(file_id, record, data)
            if damage is not None and damage not in self._damaged.get(file_id, ()):
                raise CorruptData(
                    f"journal object {record.name}: an entry at {damage.start} fails its CRC32C",
                    file=file_id,
                    position=damage.start,
                )
            yield from found

    def delete_file(self, file_id: int) -> None:
        if file_id == self._active_id:
            raise ValueError("the active journal file cannot be deleted")
        with self._lock:
            records = self._files.get(file_id, [])
        # only the records: the objects are orphans now, deleted by the next sweep
        # (collect_orphans, delete_objects) off the journal thread, so appends never wait for
        # a file's worth of DELETEs
        self.meta.remove_journal_objects(self.container, [file_id], lease=self.lease)
        with self._lock:
            self._files.pop(file_id, None)
            self._damaged.pop(file_id, None)
            for record in records:
                self._forget(record.name)

    def collect_orphans(self) -> list[str]:
        """The objects under this container's journal prefix that the MetaStore does not list
        (see the module docstring): uploads whose record never committed, and the objects of
        moved files. Call it on the thread that syncs (so no upload is between its PUT and its
        record); it also moves the active file's next position past any orphan there, so no
        later upload reuses a name about to be deleted. Raises StorageError if listing fails."""
        recorded = {r.name for r in self.meta.journal_objects(self.container)}
        orphans = []
        for name in self.store.list_chunks(journal_prefix(self.container)):
            if name in recorded:
                continue
            try:
                file_part, start_part = name.rsplit("/", 2)[1:]
                file_id, start = int(file_part), int(start_part.split("-", 1)[0])
            except ValueError:
                continue  # not a journal object's name: not ours to delete
            if file_id == self._active_id and start >= self._pending_start:
                if self._pending_bytes:
                    continue  # addresses are handed out from here: next sweep
                self._end = self._pending_start = start + 1
            orphans.append(name)
        return orphans

    def delete_objects(self, names: Sequence[str]) -> None:
        """Delete objects ``collect_orphans`` returned (any thread). A delete that fails is
        logged; the next sweep finds the object again."""
        for name in names:
            self._delete_object(name)

    def delete_orphans(self) -> list[str]:
        """``collect_orphans`` and ``delete_objects`` in one call (on the thread that syncs)."""
        orphans = self.collect_orphans()
        self.delete_objects(orphans)
        return orphans

    @property
    def active_bytes(self) -> int:
        with self._lock:
            return sum(r.size for r in self._files[self._active_id]) + self._pending_bytes

    @property
    def total_bytes(self) -> int:
        with self._lock:
            recorded = sum(r.size for records in self._files.values() for r in records)
            return recorded + self._pending_bytes

    # --- helpers -------------------------------------------------------------------------

    def _object_bytes(self, record: JournalObject) -> Buffer:
        with self._lock:
            cached = self._cache.get(record.name)
        if cached is not None:
            return cached
        data = self.store.read_chunk(record.name, 0, record.size)
        if len(data) != record.size:
            raise CorruptData(f"journal object {record.name} is shorter than its record")
        return data

    def _fetch_in_order(
        self, records: list[JournalObject]
    ) -> Iterator[tuple[JournalObject, Buffer]]:
        """The objects' bytes in order, up to ``FETCH_AHEAD`` GETs in flight: a file of
        50 ms objects is thousands of small objects, and one GET at a time would make
        recovery (and the mover) wait for each round trip."""
        if len(records) <= 1:
            yield from ((r, self._object_bytes(r)) for r in records)
            return
        with ThreadPoolExecutor(FETCH_AHEAD, thread_name_prefix="journal-fetch") as pool:
            pending: deque[tuple[JournalObject, Future[Buffer]]] = deque()
            for record in records:
                pending.append((record, pool.submit(self._object_bytes, record)))
                if len(pending) >= FETCH_AHEAD:
                    done, future = pending.popleft()
                    yield done, future.result()
            while pending:
                done, future = pending.popleft()
                yield done, future.result()

    def _delete_object(self, name: str) -> None:
        try:
            self.store.delete_chunk(name)
        except (StorageError, OSError) as exc:  # an orphan now: delete_orphans retries
            log.warning(
                "deleting journal object %s failed, left for the next cleanup: %s", name, exc
            )

    def _remember(self, name: str, data: bytes) -> None:
        """Cache an object's bytes (under ``_lock``), dropping the least recently used."""
        if len(data) > self._cache_limit:
            return
        self._cache[name] = data
        self._cached_bytes += len(data)
        while self._cached_bytes > self._cache_limit:
            _, dropped = self._cache.popitem(last=False)
            self._cached_bytes -= len(dropped)

    def _forget(self, name: str) -> None:
        dropped = self._cache.pop(name, None)
        if dropped is not None:
            self._cached_bytes -= len(dropped)


def _parse_object(
    file_id: int, record: JournalObject, data: Buffer
) -> tuple[list[tuple[JournalAddress, memoryview]], DamagedRange | None]:
    """The entries of one object, and the damaged rest of it if an entry fails its check."""
    view = memoryview(data).cast("B")
    found: list[tuple[JournalAddress, memoryview]] = []
    at = parse_entry(view, 0)
    while at.kind is Parsed.ENTRY:
        found.append(
            (
                JournalAddress(file_id, record.start + at.payload_start, at.length),
                view[at.payload_start : at.end],
            )
        )
        at = parse_entry(view, at.end)
    if at.kind is Parsed.END:
        return found, None
    return found, DamagedRange(file_id, record.start + at.start, record.start + record.size)

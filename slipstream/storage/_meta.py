"""MetaStore: the catalog of streams, segments and chunks, producer identities, transaction
commit records and subscriptions (durable cursors and queue state). SQLite by default.

Everything that must change together changes in one transaction: a stream with its segments;
a journal file's chunks with the mark that the file has moved; retention's chunk removals with
the new start offsets; a transaction's commit record with its transactional id's last commit and
the subscription positions it consumed; a stream with its subscriptions; a scale event's seals,
successors and record.
Key ranges are unsigned 64-bit; SQLite integers are signed, so they are stored shifted by -2**63.
"""

from __future__ import annotations

import builtins
import sqlite3
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec

from .._errors import (
    InvalidArgument,
    LeaseLost,
    SegmentNotFound,
    StaleGeneration,
    StorageError,
    StorageFull,
    StreamExists,
    StreamNotFound,
    SubscriptionExists,
    SubscriptionNotFound,
    TransactionAborted,
)

_SHIFT = 1 << 63


class SegmentRecord(msgspec.Struct, frozen=True):
    """A segment of any epoch: the keys ``key_lo..key_hi`` (inclusive) it owns from ``epoch``
    on, open or ``sealed``. A sealed segment keeps its record (readers finish it, retention
    trims it) and its ``end_offset``, the offset after its last event; -1 while it is open.
    ``predecessors``: the sealed segments whose keys it took over when a scale event opened
    it (empty for a stream's first segments)."""

    number: int
    epoch: int
    key_lo: int
    key_hi: int
    container: int
    sealed: bool = False
    start_offset: int = 0
    #: the segment's idempotent-producer state as of its newest chunk (msgpack; b"" if none),
    #: kept when retention removes that chunk: a retry of a batch in it is still recognised
    producers: bytes = b""
    predecessors: list[int] = []
    end_offset: int = -1


class StreamRecord(msgspec.Struct, frozen=True):
    """A live stream with its segments of every epoch, by number. ``scaling`` is its scaling
    policy's one-line text (``str(ScalingPolicy)``, e.g. ``"events 5000/s factor 2 min 1"``);
    "" means fixed at the segment count it was created with. The store keeps the text and
    does not parse it (storage does not depend on the streams layer)."""

    id: int
    name: str
    retention_ms: int | None
    retention_bytes: int | None
    created_ms: int
    segments: list[SegmentRecord]
    scaling: str = ""


class ScaleRecord(msgspec.Struct, frozen=True):
    """One scale event of a stream, stored in the transaction that made it: at ``at_ms`` the
    segments ``sealed`` (segment -> its end offset) were sealed and the segments ``created``
    opened, in epoch ``epoch`` (the first scale event makes epoch 1). ``decision``: why, as
    the caller encoded it (``ScalingDecision.to_json()``; b"" when none), kept as given.
    Together with the segments' records (key ranges, predecessors) these rebuild the
    stream's segment graph (``SegmentGraph.from_history``)."""

    stream_id: int
    epoch: int
    at_ms: int
    sealed: dict[int, int]
    created: list[int]
    decision: builtins.bytes = b""


class ChunkRecord(msgspec.Struct, frozen=True):
    """A chunk of one segment: offsets ``[base_offset, next_offset)``, its batch bytes and
    times, and ``index``: little-endian int64 triples (base offset, byte position in the chunk,
    length) for every batch, in offset order."""

    stream_id: int
    segment: int
    base_offset: int
    next_offset: int
    bytes: int
    min_timestamp: int
    max_timestamp: int
    name: str
    index: builtins.bytes
    #: the segment's idempotent-producer state as of the chunk's end (msgpack; b"" if none)
    producers: builtins.bytes = b""
    #: the chunk's find index (storage/_index.py; b"" if none): stored by ``add_chunks``, read
    #: back only through ``chunk_finds``, never with the record
    finds: builtins.bytes = b""


class JournalObject(msgspec.Struct, frozen=True):
    """One object of a container's object journal (storage/_journal_objects.py): bytes
    ``[start, start + size)`` of its journal file ``file_id``, stored as the object ``name``.
    A record with ``start`` -1, ``size`` 0 and no name marks a file begun by a roll."""

    file_id: int
    start: int
    size: int
    name: str


class Lease(msgspec.Struct, frozen=True):
    """A broker's hold on a container (``MetaStore.acquire_lease``): ``owner`` holds
    ``container`` until ``expires_ms`` (milliseconds since 1970 on the catalog's clock: the
    database server's on PostgreSQL, this host's on SQLite) unless it renews. ``epoch`` grows
    by one with every acquisition: writes fenced by a lease commit only while its epoch is the
    container's current one."""

    container: int
    owner: str
    epoch: int
    expires_ms: int


class Member(msgspec.Struct, frozen=True):
    """A broker of a cluster as registered in the catalog (``MetaStore.register_member``): its
    id, the binary protocol's and the HTTP API's advertised addresses, when its current run of
    registrations began (``started_ms``) and when the registration lapses unless renewed
    (``expires_ms``), both on the catalog's clock, as for ``Lease``."""

    broker_id: str
    address: str
    http_address: str
    started_ms: int
    expires_ms: int


class SegmentChunks(msgspec.Struct, frozen=True):
    """What a segment's chunks add up to (``MetaStore.segment_chunks``): what the broker keeps
    in memory of them, whatever the retained history; the rest is looked up on demand."""

    stream_id: int
    segment: int
    count: int
    bytes: int
    min_timestamp: int
    max_timestamp: int
    #: the newest chunk, with its index
    newest: ChunkRecord


class CommitPart(msgspec.Struct, frozen=True, array_like=True):
    """One segment of a committed transaction: its staged batches are applied there as the
    owner's idempotent batches starting at ``start_sequence``."""

    stream_id: int
    segment: int
    start_sequence: int


class PositionCommit(msgspec.Struct, frozen=True, array_like=True):
    """Positions a transaction consumed: stored with its commit record, atomically, so the
    events it wrote and the input it read become visible together. ``generation`` is the
    subscription's reset count the positions were read under (a reset since refuses them)."""

    stream_id: int
    subscription: str
    generation: int
    positions: dict[int, int]


class TxnCommit(msgspec.Struct, frozen=True):
    """The commit record of a transaction: once stored, the transaction is committed, and a
    broker that crashes before it has applied every part finishes the job on restart.
    ``metadata`` is committed atomically with the events (e.g. the Spark sink's batch id)."""

    txn_id: int
    transactional_id: str
    producer_id: int
    epoch: int
    parts: list[CommitPart]
    metadata: builtins.bytes
    committed_ms: int
    batches: int = 0  # staged batches, to notice staging lost after the commit record
    merged: list[int] = []  # anonymous transactions committed with it (their batches follow)
    positions: list[PositionCommit] = []  # subscription positions committed with it
    #: the container whose staging journal holds its batches, in a cluster (docs/cluster.md,
    #: "Transactions"); -1: a standalone broker's own staging directory
    coordinator: int = -1


class QueueOptions(msgspec.Struct, frozen=True):
    """How a work queue (modes ``queue`` and ``key_ordered_queue``) redelivers: an event not
    acknowledged within ``ack_timeout_ms`` is delivered again after a backoff (doubling from
    ``backoff_ms`` up to ``max_backoff_ms``); after ``max_deliveries`` it goes to the stream
    ``dead_letter``. ``max_unacked``: events one member may hold unacknowledged."""

    ack_timeout_ms: int = 30_000
    max_deliveries: int = 5
    backoff_ms: int = 1_000
    max_backoff_ms: int = 60_000
    max_unacked: int = 1_000
    dead_letter: str = ""  # "" for "<stream>.dlq"


class QueueSegment(msgspec.Struct, frozen=True, array_like=True):
    """A work queue's state in one segment above its floor (the subscription's position
    there, below which every event is settled): offsets settled above the floor
    (acknowledged or dead-lettered), and how often events still open were delivered."""

    done: list[int] = []
    deliveries: dict[int, int] = {}


class SubscriptionRecord(msgspec.Struct, frozen=True):
    """A named, durable cursor on one stream. ``positions``: per segment, the offset of the
    first event not yet consumed (ordered mode: committed; queues: the floor below which
    everything is settled, with ``queue`` holding what is settled above it). A segment
    missing from ``positions`` starts at its first retained event. ``generation`` counts
    resets: a reset replaces every position, and commits made under an older generation are
    refused (``StaleGeneration``)."""

    stream_id: int
    name: str
    mode: str
    created_ms: int
    positions: dict[int, int]
    generation: int = 0
    queue: dict[int, QueueSegment] = {}
    options: QueueOptions | None = None


class Identity(msgspec.Struct, frozen=True):
    """A transactional id's producer id and current epoch, and its last committed
    transaction with that transaction's metadata (JSON bytes, b"" when none)."""

    transactional_id: str
    producer_id: int
    epoch: int
    last_txn_id: int = -1
    last_metadata: builtins.bytes = b""
    committed_ms: int = 0


class MetaStore(ABC):
    """The catalog interface; implementations must be safe to call from several threads."""

    @abstractmethod
    def create_stream(
        self,
        name: str,
        segments: Sequence[SegmentRecord],
        retention_ms: int | None,
        retention_bytes: int | None,
        created_ms: int,
        scaling: str = "",
    ) -> StreamRecord:
        """Add a stream with its first segments and scaling policy text (see
        ``StreamRecord.scaling``); raises StreamExists if the name is taken."""

    @abstractmethod
    def delete_stream(
        self, name: str, stream_id: int | None = None
    ) -> tuple[StreamRecord, list[ChunkRecord]]:
        """Remove a stream with its segments, chunk records, subscriptions and scale records;
        returns the stream and its chunk records so the chunks can be deleted.
        Raises StreamNotFound if no stream has that name, or, given ``stream_id``, if the
        stream of that name has another id (the one meant was deleted and the name reused:
        the newer stream is left alone)."""

    @abstractmethod
    def update_retention(
        self, stream_id: int, retention_ms: int | None, retention_bytes: int | None
    ) -> StreamRecord:
        """Change a stream's retention and return the stream as stored. For each limit: None
        leaves it as it is, 0 removes it (stored as no limit), a positive value replaces it.
        Raises StreamNotFound if no live stream has that id (deleted, or never created)."""

    @abstractmethod
    def update_scaling(self, stream_id: int, scaling: str) -> StreamRecord:
        """Replace a stream's scaling policy text (see ``StreamRecord.scaling``; "" for fixed)
        and return the stream as stored. The segments do not change: applying the new
        policy's bounds is the caller's next scale event. Raises StreamNotFound if no live
        stream has that id."""

    @abstractmethod
    def scale_stream(
        self,
        stream_id: int,
        epoch: int,
        at_ms: int,
        sealed: Mapping[int, int],
        created: Sequence[SegmentRecord],
        decision: bytes = b"",
        *,
        leases: Sequence[Lease] = (),
        deadline_ms: int | None = None,
    ) -> StreamRecord:
        """Apply one scale event, all or nothing, and return the stream as stored: seal the
        open segments ``sealed`` (segment -> end offset: the offset after its last event),
        add the successors ``created``, and store the ``ScaleRecord``. After a failure, or a
        crash at any point, the stream is as it was before the call.

        ``epoch`` must be exactly the stream's current epoch (0 until its first scale event,
        then the epoch of its latest) + 1: a caller planning from an outdated view is refused.
        Segments are sealed in number order, then the successors are added in the order
        given. Each successor must be open (``sealed`` False, ``end_offset`` -1) in ``epoch``,
        with a number the stream never had and predecessors among ``sealed``. The store does
        not check key ranges (the segment graph does, ``SegmentGraph.plan``).

        Raises StreamNotFound if no live stream has that id; SegmentNotFound for a segment
        to seal that the stream does not have; InvalidArgument (with ``details["epoch"]``, the
        current epoch, for an epoch conflict) for the wrong epoch, a segment already sealed, a
        successor number the stream already has or that is given twice, nothing sealed or
        nothing created, a negative end offset, or a successor that does not fit the rules above.

        Also refused, nothing stored (docs/cluster.md, "Scaling across brokers"):
        InvalidArgument with ``details["pending_txn"]`` (the
        transaction's id) when a commit record not yet applied (``pending_commits``) names a
        segment to seal (its batches would land past the sealed end; ask again once it is
        applied); LeaseLost unless each of ``leases`` (the containers of the sealed segments,
        in a cluster) is its container's current holding; InvalidArgument with
        ``details["deadline_ms"]`` when the catalog's clock (``clock_ms``) is at or past
        ``deadline_ms`` (a prepared segment's broker may have given up on this scale and
        reopened it, see ``settle_seal``). These checks come after the seals, in the same
        transaction, so a ``commit_txn`` or ``settle_seal`` running meanwhile is ordered before
        or after this event as a whole."""

    def clock_ms(self) -> int:
        """The catalog's clock (ms since 1970): the one leases, members and a scale's
        ``deadline_ms`` are measured by (PostgreSQL: the server's, so brokers with skewed
        clocks agree)."""
        return int(time.time() * 1000)

    @abstractmethod
    def settle_seal(
        self, stream_id: int, numbers: Sequence[int], deadline_ms: int
    ) -> dict[int, int]:
        """The outcome of a merge that prepared segments ``numbers`` on this broker but never
        told it (docs/cluster.md, "Scaling across brokers"): the end offsets of those of them
        that are sealed ({} if none is). Refuses (InvalidArgument with
        ``details["deadline_ms"]``) while the catalog's clock is before ``deadline_ms``; once
        it answers, no ``scale_stream`` fenced by that deadline can seal them any more (it
        locks their rows, and such a scale checks the clock after its seals). Raises
        StreamNotFound if no live stream has that id."""

    @abstractmethod
    def scalings(self, stream_id: int | None = None) -> list[ScaleRecord]:
        """The scale records of one stream (or of every live stream) by stream id and epoch;
        [] for a stream never scaled, or with no live stream of that id (a deleted stream's
        records are deleted with it)."""

    @abstractmethod
    def streams(self) -> list[StreamRecord]:
        """Every live stream, with its segments of every epoch."""

    @abstractmethod
    def chunks(self) -> list[ChunkRecord]:
        """Every chunk record, by stream, segment and offset."""

    @abstractmethod
    def add_chunks(
        self,
        container: int,
        moved_file: int,
        chunks: Sequence[ChunkRecord],
        *,
        lease: Lease | None = None,
    ) -> None:
        """Record new chunks and that journal file ``moved_file`` of ``container`` is moved.
        Each chunk is its segment's newest (a segment's chunks come in offset order): its
        ``producers`` becomes its segment's ``SegmentRecord.producers``, which retention's
        ``remove_chunks_before`` leaves alone.

        Fenced by ``lease`` when given: the write commits only if the lease's epoch is still
        the container's current one, checked in the same transaction; else LeaseLost and
        nothing changes."""

    # --- leases (docs/operations.md, "Leases and fencing") ----------------------------------

    @abstractmethod
    def acquire_lease(
        self, container: int, owner: str, ttl_ms: int, *, take_over: bool = False
    ) -> Lease | None:
        """Take ``container``'s lease for ``ttl_ms`` from the catalog's clock's now: granted
        when the container is free (never leased, released or expired) or already ``owner``'s,
        or with ``take_over`` (a broker that holds the data directory of an embedded catalog,
        where no other can run) whoever holds it; else None (``leases()`` names the holder).
        Every grant starts a new holding, its epoch one above the last: writes fenced by any
        earlier lease of the container, the same owner's included, are refused from then on."""

    @abstractmethod
    def renew_lease(self, lease: Lease, ttl_ms: int) -> Lease:
        """Extend a lease to ``ttl_ms`` from the catalog's clock's now, keeping its epoch.
        Raises LeaseLost, changing nothing, if it expired (even if nobody took it since: a
        broker that could not renew in time may have stopped acknowledging and must take the
        container again) or another holding began."""

    @abstractmethod
    def release_lease(self, lease: Lease) -> None:
        """Give the container up now (a broker that stops cleanly): it is free at once, and the
        next grant's epoch is still one above this one. A lease no longer held is left alone."""

    @abstractmethod
    def leases(self) -> list[Lease]:
        """Every container's last lease, by container (a released one with ``expires_ms`` 0)."""

    # --- cluster membership (docs/operations.md, "Cluster membership") ------------------------

    @abstractmethod
    def register_member(
        self, broker_id: str, address: str, http_address: str, ttl_ms: int
    ) -> Member:
        """Register or renew a broker: its record (addresses replaced) lives until ``ttl_ms``
        from the catalog's clock's now. ``started_ms`` is kept while the record is live and
        starts again at now if it had expired (a broker that comes back after its registration
        lapsed is a new member). Raises InvalidArgument for a negative ttl."""

    @abstractmethod
    def members(self) -> list[Member]:
        """The live members (``expires_ms`` after the catalog's clock's now), by broker id.
        An expired record is not listed, and is replaced by the broker's next registration."""

    @abstractmethod
    def remove_member(self, broker_id: str) -> None:
        """Forget a broker's registration at once (a clean stop); nothing if there is none."""

    @abstractmethod
    def catalog_version(self) -> int:
        """A counter that grows in the same transaction as every change of streams or
        segments (create, delete, scale, retention limits, scaling policy), subscriptions
        (create, delete, reset) and settings (put, a delete that removed one): a broker that
        sees it unchanged knows that none of these changed since it last read them. Not
        changed by chunks, retention's chunk removals, journal objects, leases, members,
        positions, identities or transaction records (the hot paths)."""

    @abstractmethod
    def shared_secret(self, name: str, make: Callable[[], bytes]) -> bytes:
        """The secret ``name`` shared by every broker of the catalog: the stored one, or, if
        there is none yet, ``make()``'s, stored. Brokers racing to create it all get the same
        bytes (the first write wins; others' ``make()`` results are dropped). Kept apart from
        ``settings()``, which never lists it; never changed or removed once stored."""

    @abstractmethod
    def moved_file(self, container: int) -> int:
        """The highest journal file id of a container whose entries are all in chunks (-1)."""

    @abstractmethod
    def add_journal_object(
        self, container: int, record: JournalObject, *, lease: Lease | None = None
    ) -> None:
        """Record an object of ``container``'s object journal; once this returns (committed),
        the object's entries are durable and recovery yields them. Raises StorageError (the
        record's state is then unknown: it may have committed). Fenced by ``lease`` when
        given, as ``add_chunks`` is: LeaseLost, and nothing recorded, unless its epoch is
        the container's current one."""

    @abstractmethod
    def journal_objects(self, container: int) -> list[JournalObject]:
        """The recorded objects of ``container``'s object journal, by file and position."""

    @abstractmethod
    def remove_journal_objects(
        self, container: int, file_ids: Sequence[int], *, lease: Lease | None = None
    ) -> None:
        """Forget every object record of the given journal files of ``container`` (the mover,
        after the files' entries are in chunks; the objects themselves are deleted after).
        Fenced by ``lease`` when given, as ``add_chunks`` is."""

    @abstractmethod
    def remove_chunks_before(self, stream_id: int, cuts: Mapping[int, int]) -> list[ChunkRecord]:
        """Retention by range: for each ``segment: offset`` of ``cuts``, forget the segment's
        chunks that end at or before ``offset`` and move its start offset there (never
        back), all in one transaction. Returns the chunks forgotten (without their ``index``
        and ``producers``), for their files to be deleted."""

    @abstractmethod
    def segment_chunks(self, stream_ids: Collection[int] | None = None) -> list[SegmentChunks]:
        """For every segment with chunks (of the streams ``stream_ids`` only, when given: a
        cluster's refresh asks for the few streams with segments new to it, not the whole
        chunk table): how many, their bytes and times, and the newest; by stream and segment."""

    @abstractmethod
    def chunk_at(self, stream_id: int, segment: int, offset: int) -> ChunkRecord | None:
        """The segment's chunk with the greatest base offset at or before ``offset`` (None if
        there is none), with its index: where a read of ``offset`` finds its batch."""

    @abstractmethod
    def chunk_at_time(self, stream_id: int, segment: int, timestamp: int) -> ChunkRecord | None:
        """Where a time lookup of ``timestamp`` starts in the segment's chunks: a chunk that
        no earlier kept chunk has an event as late as, at or before the first kept chunk that
        has one (the first, unless retention removed a later event's chunk before it); None if
        no kept chunk has an event that late. Found through an index, whatever the history."""

    @abstractmethod
    def chunks_from(
        self, stream_id: int, segment: int, offset: int, limit: int
    ) -> list[ChunkRecord]:
        """Up to ``limit`` of the segment's chunks whose base offset is at or after
        ``offset``, in offset order, without their ``index`` and ``producers``."""

    def chunk_finds(self, stream_id: int, segment: int, base_offset: int) -> bytes:
        """The find index stored with a chunk (``ChunkRecord.finds``); b"" if it has none (a
        chunk moved before find indexes existed) or there is no such chunk."""
        return b""

    @abstractmethod
    def reserve_ids(self, name: str, count: int) -> int:
        """Durably reserve ``count`` ids of the counter ``name``; returns the first."""

    @abstractmethod
    def identities(self) -> list[Identity]:
        """Every transactional id."""

    @abstractmethod
    def save_identity(self, identity: Identity) -> None:
        """Store a transactional id's producer id and epoch (keeps its last commit)."""

    @abstractmethod
    def commit_txn(
        self, commit: TxnCommit, *, lease: Lease | None = None, holds: Sequence[int] = ()
    ) -> None:
        """Store a commit record and make it its transactional id's last commit, atomically.
        With ``lease`` (the coordinating container's, in a cluster): LeaseLost, nothing stored,
        unless it is that container's current holding (a coordinator that lost its container
        can no longer commit what the new holder would never apply). TransactionAborted,
        nothing stored, when a part names a segment that is sealed (a scale on another broker
        sealed it after the transaction staged into it: its batches would land past the
        sealed end); a scale and a commit naming one segment are ordered in the catalog, see
        ``scale_stream``. ``holds``: the position holds (``add_hold``) of the groups whose
        positions it stores, consumed (removed) in the same transaction; TransactionAborted,
        nothing stored, if one is not there (its group let go: it expired, or the group's
        container moved), so a record stored late never moves positions under a group that
        went on without it."""

    @abstractmethod
    def add_hold(self, hold_id: int, stream_id: int, subscription: str, *, lease: Lease) -> None:
        """Record that the group of ``subscription`` is held for a transaction's commit on
        another broker (docs/cluster.md, "Consume-transform-produce"), by the broker
        coordinating the group, under ``lease`` (the container coordinating it): LeaseLost,
        nothing recorded, unless it is that container's current holding. InvalidArgument if
        ``hold_id`` is recorded already. The commit consumes it (``commit_txn(holds=)``)."""

    @abstractmethod
    def remove_holds(self, hold_ids: Sequence[int]) -> list[int]:
        """Remove the holds named (a hold released, or expired): returns those that were
        there, sorted. One not there was consumed by its commit (its record, with the
        positions, is stored: a read of the subscriptions after this one sees them) or never
        recorded; one removed here can no longer be consumed (its commit stores nothing)."""

    @abstractmethod
    def remove_holds_of(self, container: int) -> list[int]:
        """Remove every hold recorded under ``container``'s leases (a broker adopting the
        groups it coordinates, before it reads their positions), as ``remove_holds``."""

    @abstractmethod
    def pending_commits(self) -> list[TxnCommit]:
        """Commit records not yet marked applied, oldest first."""

    @abstractmethod
    def finish_txn(self, txn_id: int) -> None:
        """Mark a committed transaction as applied to every segment."""

    @abstractmethod
    def create_subscription(self, record: SubscriptionRecord) -> None:
        """Add a subscription. Raises StreamNotFound if no live stream has its stream id,
        SubscriptionExists if the stream has one of that name."""

    @abstractmethod
    def subscriptions(self, stream_id: int | None = None) -> list[SubscriptionRecord]:
        """The subscriptions of one stream (or of every stream), by stream id and name."""

    @abstractmethod
    def delete_subscription(self, stream_id: int, name: str) -> None:
        """Remove a subscription; raises SubscriptionNotFound if there is none."""

    @abstractmethod
    def commit_positions(
        self,
        stream_id: int,
        name: str,
        generation: int,
        positions: Mapping[int, int],
        queue: Mapping[int, QueueSegment] | None = None,
        *,
        lease: Lease | None = None,
    ) -> None:
        """Set the positions of the segments named (others keep theirs) and, for a queue,
        those segments' state above the new floor. Raises SubscriptionNotFound, or
        StaleGeneration if the subscription was reset since ``generation``. With ``lease``
        (in a cluster, the lease of the container coordinating the subscription's group):
        LeaseLost, nothing stored, unless it is that container's current holding, checked in
        the same transaction (a coordinator paused past its lease cannot write its older
        positions or queue state over the new holder's)."""

    @abstractmethod
    def reset_subscription(
        self,
        stream_id: int,
        name: str,
        positions: Mapping[int, int],
        *,
        lease: Lease | None = None,
    ) -> SubscriptionRecord:
        """Replace every position (and forget queue state), count one more generation, and
        return the subscription as stored. Raises SubscriptionNotFound; fenced by ``lease``
        when given, as ``commit_positions`` is (LeaseLost, nothing changed)."""

    @abstractmethod
    def put_setting(self, kind: str, key: str, value: bytes) -> None:
        """Store (or replace) one setting: small records the broker keeps besides streams,
        grouped by ``kind`` (access rules, revoked tokens, quotas); the value is opaque here.
        Durable when this returns."""

    @abstractmethod
    def delete_setting(self, kind: str, key: str) -> bool:
        """Remove one setting; False if there was none."""

    @abstractmethod
    def settings(self, kind: str) -> dict[str, bytes]:
        """Every setting of ``kind``, by key, in key order."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the store."""


class SqliteMetaStore(MetaStore):
    """The catalog in SQLite (WAL mode, synchronous=FULL). ``":memory:"`` keeps it in memory.

    Chunk lookups (``chunk_at``, ``chunk_at_time``, ``chunks_from``, ``segment_chunks``) use
    a second connection, so they never wait for a write's fsync. The first three are index
    lookups (``chunk_at_time``: the ``chunks_by_time`` index on a running maximum of the
    chunks' newest event times, kept by ``add_chunks``); ``segment_chunks`` (at start)
    scans. Opening a catalog without that index builds it (an UPDATE ... FROM: SQLite 3.33 or
    later)."""

    def __init__(self, path: Path | str) -> None:
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        # Lookups (reads of chunks, time lookups) use a connection of their own: in WAL mode
        # they go on while a write transaction waits for its fsync. An in-memory catalog has
        # one connection, shared under the one lock.
        self._reader, self._read_lock = self._db, self._lock
        with self._lock:
            version = _sqlite_schema_version(self._db)
            if version > SCHEMA_VERSION:  # refused before anything is written
                self._db.close()
                raise schema_too_new(f"the catalog {path}", version, SCHEMA_VERSION)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            if version == 0:
                self._upgrade_unversioned()
                self._db.execute("DELETE FROM schema_version")
                self._db.execute("INSERT INTO schema_version VALUES (1)")
                version = 1
            # later schema changes: numbered migrations, each in one transaction with its
            # version, so a crash leaves the catalog at one version or the next
            for number, migration in enumerate(SQLITE_MIGRATIONS[version - 1 :], version + 1):
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    for statement in migration.split(";"):
                        self._db.execute(statement)
                    self._db.execute("UPDATE schema_version SET version = ?", (number,))
                except sqlite3.Error as exc:
                    self._db.execute("ROLLBACK")
                    self._db.close()
                    raise StorageError(
                        f"migrating the catalog {path} from schema version {number - 1} to "
                        f"{number} failed: {exc} (that step was rolled back)",
                        schema_version=number - 1,
                        supported=SCHEMA_VERSION,
                    ) from exc
                self._db.execute("COMMIT")
        if str(path) != ":memory:":
            self._reader = sqlite3.connect(str(path), check_same_thread=False)
            self._read_lock = threading.Lock()

    def _upgrade_unversioned(self) -> None:
        """Schema version 1 from nothing, or from a catalog written before schema versions:
        every step is idempotent (a crash half-way is done again at the next open)."""
        self._db.executescript(_SCHEMA)
        columns = [row[1] for row in self._db.execute("PRAGMA table_info(chunks)")]
        if "producers" not in columns:  # catalogs written before idempotent producers
            self._db.execute("ALTER TABLE chunks ADD COLUMN producers BLOB NOT NULL DEFAULT x''")
        columns = [row[1] for row in self._db.execute("PRAGMA table_info(segments)")]
        if "producers" not in columns:  # catalogs that kept it only with the chunks
            self._db.execute("ALTER TABLE segments ADD COLUMN producers BLOB NOT NULL DEFAULT x''")
        columns = [row[1] for row in self._db.execute("PRAGMA table_info(chunks)")]
        if "max_timestamp_so_far" not in columns:  # catalogs without the time index
            self._db.execute("ALTER TABLE chunks ADD COLUMN max_timestamp_so_far INTEGER")
            self._db.execute(
                "UPDATE chunks SET max_timestamp_so_far = w.so_far FROM (SELECT rowid AS r, "
                "MAX(max_timestamp) OVER (PARTITION BY stream_id, segment "
                "ORDER BY base_offset) AS so_far FROM chunks) AS w WHERE chunks.rowid = w.r"
            )
        self._db.execute(_TIME_INDEX)
        for table, column, declaration in _ELASTIC_COLUMNS:  # catalogs before scaling
            if column not in [r[1] for r in self._db.execute(f"PRAGMA table_info({table})")]:
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {declaration}")

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Cursor]:
        with self._lock:
            cursor = self._db.cursor()
            try:
                cursor.execute("BEGIN IMMEDIATE")
                try:
                    yield cursor
                except BaseException:
                    cursor.execute("ROLLBACK")
                    raise
                cursor.execute("COMMIT")
            except sqlite3.OperationalError as exc:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                if "full" in str(exc):
                    raise StorageFull(f"disk full while updating the catalog: {exc}") from exc
                raise StorageError(f"catalog update failed: {exc}") from exc

    def create_stream(
        self,
        name: str,
        segments: Sequence[SegmentRecord],
        retention_ms: int | None,
        retention_bytes: int | None,
        created_ms: int,
        scaling: str = "",
    ) -> StreamRecord:
        with self._transaction() as cur:
            if cur.execute("SELECT 1 FROM streams WHERE name = ?", (name,)).fetchone():
                raise StreamExists(f"stream {name!r} already exists", stream=name)
            cur.execute(
                "INSERT INTO streams (name, retention_ms, retention_bytes, created_ms, scaling) "
                "VALUES (?, ?, ?, ?, ?)",
                (name, retention_ms, retention_bytes, created_ms, scaling),
            )
            stream_id = cur.lastrowid
            assert stream_id is not None
            self._insert_segments(cur, stream_id, segments)
            _bump_version(cur)
        return StreamRecord(
            stream_id, name, retention_ms, retention_bytes, created_ms, list(segments), scaling
        )

    @staticmethod
    def _insert_segments(
        cur: sqlite3.Cursor, stream_id: int, segments: Sequence[SegmentRecord]
    ) -> None:
        """Raises sqlite3.IntegrityError for a number the stream has or that comes twice."""
        cur.executemany(
            "INSERT INTO segments (stream_id, number, epoch, key_lo, key_hi, container, "
            "sealed, start_offset, producers, predecessors, end_offset) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [
                (
                    stream_id,
                    s.number,
                    s.epoch,
                    s.key_lo - _SHIFT,
                    s.key_hi - _SHIFT,
                    s.container,
                    s.sealed,
                    s.start_offset,
                    s.producers,
                    msgspec.json.encode(s.predecessors).decode(),
                    s.end_offset,
                )
                for s in segments
            ],
        )

    def delete_stream(
        self, name: str, stream_id: int | None = None
    ) -> tuple[StreamRecord, list[ChunkRecord]]:
        with self._transaction() as cur:
            record = self._stream(cur, name)
            if stream_id is not None and record.id != stream_id:
                raise StreamNotFound(
                    f"stream {name!r} (id {stream_id}) does not exist; the name now belongs "
                    f"to a newer stream (id {record.id})",
                    stream=name,
                )
            chunks = self._chunks(cur, "WHERE stream_id = ?", (record.id,))
            for table in ("chunks", "segments", "subscriptions", "scalings"):
                cur.execute(f"DELETE FROM {table} WHERE stream_id = ?", (record.id,))
            cur.execute("DELETE FROM streams WHERE id = ?", (record.id,))
            _bump_version(cur)
        return record, chunks

    def update_retention(
        self, stream_id: int, retention_ms: int | None, retention_bytes: int | None
    ) -> StreamRecord:
        with self._transaction() as cur:
            row = cur.execute("SELECT name FROM streams WHERE id = ?", (stream_id,)).fetchone()
            if row is None:
                raise StreamNotFound(f"stream id {stream_id} does not exist", stream_id=stream_id)
            if retention_ms is not None:
                cur.execute(
                    "UPDATE streams SET retention_ms = ? WHERE id = ?",
                    (retention_ms or None, stream_id),
                )
            if retention_bytes is not None:
                cur.execute(
                    "UPDATE streams SET retention_bytes = ? WHERE id = ?",
                    (retention_bytes or None, stream_id),
                )
            _bump_version(cur)
            return self._stream(cur, row[0])

    def update_scaling(self, stream_id: int, scaling: str) -> StreamRecord:
        with self._transaction() as cur:
            name = self._live_name(cur, stream_id)
            cur.execute("UPDATE streams SET scaling = ? WHERE id = ?", (scaling, stream_id))
            _bump_version(cur)
            return self._stream(cur, name)

    def scale_stream(
        self,
        stream_id: int,
        epoch: int,
        at_ms: int,
        sealed: Mapping[int, int],
        created: Sequence[SegmentRecord],
        decision: bytes = b"",
        *,
        leases: Sequence[Lease] = (),
        deadline_ms: int | None = None,
    ) -> StreamRecord:
        _check_scale(epoch, sealed, created)
        with self._transaction() as cur:
            for lease in leases:
                _check_lease(cur, lease)
            name = self._live_name(cur, stream_id)
            (current,) = cur.execute(
                "SELECT COALESCE(MAX(epoch), 0) FROM scalings WHERE stream_id = ?", (stream_id,)
            ).fetchone()
            if epoch != current + 1:
                raise InvalidArgument(
                    f"stream {name!r} is in epoch {current}: a scale event makes epoch "
                    f"{current + 1}, not {epoch} (another scale event came first; reload the "
                    "stream and plan again)",
                    stream=name,
                    epoch=current,
                )
            for number, end_offset in sorted(sealed.items()):
                cur.execute(
                    "UPDATE segments SET sealed = 1, end_offset = ? "
                    "WHERE stream_id = ? AND number = ? AND NOT sealed",
                    (end_offset, stream_id, number),
                )
                if cur.rowcount == 0:
                    raise self._not_sealable(cur, name, stream_id, number)
            pending = [
                msgspec.msgpack.decode(row[0], type=TxnCommit)
                for row in cur.execute("SELECT record FROM txn_commits ORDER BY txn_id")
            ]
            _check_not_pending(name, stream_id, sealed, pending)
            if deadline_ms is not None:
                _check_deadline(name, deadline_ms, self.clock_ms())
            try:
                self._insert_segments(cur, stream_id, created)
            except sqlite3.IntegrityError:
                numbers = [s.number for s in created]
                raise InvalidArgument(
                    f"successors {numbers} of stream {name!r} repeat a number, or use one the "
                    "stream already has: a successor takes a number never used before",
                    stream=name,
                ) from None
            record = ScaleRecord(
                stream_id, epoch, at_ms, dict(sealed), [s.number for s in created], decision
            )
            cur.execute(
                "INSERT INTO scalings (stream_id, epoch, record) VALUES (?, ?, ?)",
                (stream_id, epoch, msgspec.msgpack.encode(record)),
            )
            _bump_version(cur)
            return self._stream(cur, name)

    @staticmethod
    def _not_sealable(
        cur: sqlite3.Cursor, name: str, stream_id: int, number: int
    ) -> InvalidArgument | SegmentNotFound:
        row = cur.execute(
            "SELECT end_offset FROM segments WHERE stream_id = ? AND number = ?",
            (stream_id, number),
        ).fetchone()
        if row is None:
            return SegmentNotFound(
                f"stream {name!r} has no segment {number}", stream=name, segment=number
            )
        return InvalidArgument(
            f"segment {number} of stream {name!r} is already sealed (at offset {row[0]}): "
            "only open segments scale",
            stream=name,
            segment=number,
        )

    def settle_seal(
        self, stream_id: int, numbers: Sequence[int], deadline_ms: int
    ) -> dict[int, int]:
        with self._transaction() as cur:  # BEGIN IMMEDIATE: after or before any scale
            name = self._live_name(cur, stream_id)
            _check_settled(name, deadline_ms, self.clock_ms())
            marks = ",".join("?" * len(numbers))
            rows = cur.execute(
                f"SELECT number, end_offset FROM segments WHERE stream_id = ? AND sealed "
                f"AND number IN ({marks})",
                (stream_id, *numbers),
            ).fetchall()
        return {int(number): int(end) for number, end in rows}

    def scalings(self, stream_id: int | None = None) -> list[ScaleRecord]:
        query = "SELECT record FROM scalings"
        args: tuple[int, ...] = ()
        if stream_id is not None:
            query, args = query + " WHERE stream_id = ?", (stream_id,)
        with self._lock:
            rows = self._db.execute(query + " ORDER BY stream_id, epoch", args).fetchall()
        return [msgspec.msgpack.decode(row[0], type=ScaleRecord) for row in rows]

    @staticmethod
    def _live_name(cur: sqlite3.Cursor, stream_id: int) -> str:
        row = cur.execute("SELECT name FROM streams WHERE id = ?", (stream_id,)).fetchone()
        if row is None:
            raise StreamNotFound(f"stream id {stream_id} does not exist", stream_id=stream_id)
        return str(row[0])

    def streams(self) -> list[StreamRecord]:
        with self._lock:
            cur = self._db.cursor()
            names = [row[0] for row in cur.execute("SELECT name FROM streams ORDER BY name")]
            return [self._stream(cur, name) for name in names]

    def _stream(self, cur: sqlite3.Cursor, name: str) -> StreamRecord:
        row = cur.execute(
            "SELECT id, retention_ms, retention_bytes, created_ms, scaling FROM streams "
            "WHERE name = ?",
            (name,),
        ).fetchone()
        if row is None:
            raise StreamNotFound(f"stream {name!r} does not exist", stream=name)
        segments = [
            SegmentRecord(
                number,
                epoch,
                lo + _SHIFT,
                hi + _SHIFT,
                container,
                bool(sealed),
                start,
                producers,
                msgspec.json.decode(predecessors, type=list[int]),
                end,
            )
            for number, epoch, lo, hi, container, sealed, start, producers, predecessors, end in (
                cur.execute(
                    "SELECT number, epoch, key_lo, key_hi, container, sealed, start_offset, "
                    "producers, predecessors, end_offset FROM segments WHERE stream_id = ? "
                    "ORDER BY number",
                    (row[0],),
                )
            )
        ]
        return StreamRecord(row[0], name, row[1], row[2], row[3], segments, row[4])

    def chunks(self) -> list[ChunkRecord]:
        with self._lock:
            return self._chunks(self._db.cursor(), "", ())

    @staticmethod
    def _chunks(
        cur: sqlite3.Cursor,
        where: str,
        args: tuple[int, ...],
        columns: str = "idx, producers",
        order: str = "",
    ) -> list[ChunkRecord]:
        """Chunk records in offset order (``order``: "DESC" and/or a LIMIT); ``columns``
        picks the index and producers or leaves them empty (``_LIGHT_COLUMNS``)."""
        direction = "DESC" if order.startswith("DESC") else ""
        rows = cur.execute(
            "SELECT stream_id, segment, base_offset, next_offset, bytes, min_timestamp, "
            f"max_timestamp, name, {columns} FROM chunks {where} "
            f"ORDER BY stream_id {direction}, segment {direction}, base_offset {order}",
            args,
        )
        return [ChunkRecord(*row) for row in rows]

    def add_chunks(
        self,
        container: int,
        moved_file: int,
        chunks: Sequence[ChunkRecord],
        *,
        lease: Lease | None = None,
    ) -> None:
        with self._transaction() as cur:
            if lease is not None:
                _check_lease(cur, lease)
            # max_timestamp_so_far: the newest event time of the chunk and every earlier one
            # still kept, which grows with the offset: what time lookups search (_TIME_INDEX)
            cur.executemany(
                "INSERT OR REPLACE INTO chunks (stream_id, segment, base_offset, next_offset, "
                "bytes, min_timestamp, max_timestamp, name, idx, producers, finds, "
                "max_timestamp_so_far) "
                "SELECT ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, MAX(?, COALESCE((SELECT "
                "max_timestamp_so_far FROM chunks WHERE stream_id = ? AND segment = ? AND "
                "base_offset < ? ORDER BY base_offset DESC LIMIT 1), ?)) WHERE EXISTS "
                "(SELECT 1 FROM streams WHERE id = ?)",
                [
                    (
                        *msgspec.structs.astuple(c),
                        c.max_timestamp,
                        c.stream_id,
                        c.segment,
                        c.base_offset,
                        c.max_timestamp,
                        c.stream_id,
                    )
                    for c in chunks
                ],
            )
            cur.executemany(
                "UPDATE segments SET producers = ? WHERE stream_id = ? AND number = ?",
                [(c.producers, c.stream_id, c.segment) for c in chunks],
            )
            cur.execute(
                "INSERT INTO containers (id, moved_file) VALUES (?, ?) "
                "ON CONFLICT (id) DO UPDATE SET moved_file = excluded.moved_file",
                (container, moved_file),
            )

    def add_journal_object(
        self, container: int, record: JournalObject, *, lease: Lease | None = None
    ) -> None:
        with self._transaction() as cur:
            if lease is not None:
                _check_lease(cur, lease)
            cur.execute(
                "INSERT INTO journal_objects (container, file_id, start, size, name) "
                "VALUES (?, ?, ?, ?, ?)",
                (container, *msgspec.structs.astuple(record)),
            )

    def journal_objects(self, container: int) -> list[JournalObject]:
        with self._lock:
            rows = self._db.execute(
                "SELECT file_id, start, size, name FROM journal_objects WHERE container = ? "
                "ORDER BY file_id, start",
                (container,),
            ).fetchall()
        return [JournalObject(*row) for row in rows]

    def remove_journal_objects(
        self, container: int, file_ids: Sequence[int], *, lease: Lease | None = None
    ) -> None:
        with self._transaction() as cur:
            if lease is not None:
                _check_lease(cur, lease)
            cur.executemany(
                "DELETE FROM journal_objects WHERE container = ? AND file_id = ?",
                [(container, file_id) for file_id in file_ids],
            )

    def moved_file(self, container: int) -> int:
        with self._lock:
            row = self._db.execute(
                "SELECT moved_file FROM containers WHERE id = ?", (container,)
            ).fetchone()
        return -1 if row is None else int(row[0])

    def acquire_lease(
        self, container: int, owner: str, ttl_ms: int, *, take_over: bool = False
    ) -> Lease | None:
        _check_ttl(ttl_ms)
        with self._transaction() as cur:
            now = _wall_ms()
            row = cur.execute(
                "SELECT owner, epoch, expires_ms FROM leases WHERE container = ?", (container,)
            ).fetchone()
            granted = _grant(container, owner, ttl_ms, take_over, now, row)
            if granted is not None:
                cur.execute(
                    "INSERT INTO leases (container, owner, epoch, expires_ms) "
                    "VALUES (?, ?, ?, ?) ON CONFLICT (container) DO UPDATE SET "
                    "owner = excluded.owner, epoch = excluded.epoch, "
                    "expires_ms = excluded.expires_ms",
                    msgspec.structs.astuple(granted),
                )
        return granted

    def renew_lease(self, lease: Lease, ttl_ms: int) -> Lease:
        _check_ttl(ttl_ms)
        with self._transaction() as cur:
            now = _wall_ms()
            row = cur.execute(
                "SELECT owner, epoch, expires_ms FROM leases WHERE container = ?",
                (lease.container,),
            ).fetchone()
            renewed = _renewed(lease, ttl_ms, now, row)
            cur.execute(
                "UPDATE leases SET expires_ms = ? WHERE container = ?",
                (renewed.expires_ms, lease.container),
            )
        return renewed

    def release_lease(self, lease: Lease) -> None:
        with self._transaction() as cur:
            cur.execute(
                "UPDATE leases SET expires_ms = 0 WHERE container = ? AND owner = ? AND epoch = ?",
                (lease.container, lease.owner, lease.epoch),
            )

    def leases(self) -> list[Lease]:
        with self._lock:
            rows = self._db.execute(
                "SELECT container, owner, epoch, expires_ms FROM leases ORDER BY container"
            ).fetchall()
        return [Lease(*row) for row in rows]

    def register_member(
        self, broker_id: str, address: str, http_address: str, ttl_ms: int
    ) -> Member:
        _check_ttl(ttl_ms, "a member's")
        with self._transaction() as cur:
            now = _wall_ms()
            row = cur.execute(
                "SELECT started_ms, expires_ms FROM members WHERE broker_id = ?", (broker_id,)
            ).fetchone()
            member = _registered(broker_id, address, http_address, ttl_ms, now, row)
            cur.execute(
                "INSERT OR REPLACE INTO members (broker_id, address, http_address, started_ms, "
                "expires_ms) VALUES (?, ?, ?, ?, ?)",
                msgspec.structs.astuple(member),
            )
        return member

    def members(self) -> list[Member]:
        with self._lock:
            rows = self._db.execute(
                "SELECT broker_id, address, http_address, started_ms, expires_ms FROM members "
                "WHERE expires_ms > ? ORDER BY broker_id",
                (_wall_ms(),),
            ).fetchall()
        return [Member(*row) for row in rows]

    def remove_member(self, broker_id: str) -> None:
        with self._transaction() as cur:
            cur.execute("DELETE FROM members WHERE broker_id = ?", (broker_id,))

    def catalog_version(self) -> int:
        with self._lock:
            row = self._db.execute("SELECT version FROM catalog_version").fetchone()
        return int(row[0])

    def shared_secret(self, name: str, make: Callable[[], bytes]) -> bytes:
        with self._lock:
            row = self._db.execute(
                "SELECT value FROM shared_secrets WHERE name = ?", (name,)
            ).fetchone()
        if row is not None:
            return bytes(row[0])
        made = bytes(make())  # outside the catalog's lock: make may be slow
        with self._transaction() as cur:
            cur.execute(
                "INSERT INTO shared_secrets (name, value) VALUES (?, ?) "
                "ON CONFLICT (name) DO NOTHING",
                (name, made),
            )
            row = cur.execute("SELECT value FROM shared_secrets WHERE name = ?", (name,)).fetchone()
        return bytes(row[0])

    def remove_chunks_before(self, stream_id: int, cuts: Mapping[int, int]) -> list[ChunkRecord]:
        removed: list[ChunkRecord] = []
        with self._transaction() as cur:
            for segment, offset in cuts.items():
                where = "WHERE stream_id = ? AND segment = ? AND next_offset <= ?"
                args = (stream_id, segment, offset)
                removed += self._chunks(cur, where, args, _LIGHT_COLUMNS)
                cur.execute(f"DELETE FROM chunks {where}", args)
                cur.execute(
                    "UPDATE segments SET start_offset = MAX(start_offset, ?) "
                    "WHERE stream_id = ? AND number = ?",
                    (offset, stream_id, segment),
                )
        return removed

    def segment_chunks(self, stream_ids: Collection[int] | None = None) -> list[SegmentChunks]:
        with self._read_lock:
            cur = self._reader.cursor()
            where: str = ""
            args: tuple[str, ...] = ()
            if stream_ids is not None:
                where = "WHERE stream_id IN (SELECT value FROM json_each(?)) "
                args = (msgspec.json.encode(sorted(stream_ids)).decode(),)
            totals = cur.execute(
                "SELECT stream_id, segment, COUNT(*), SUM(bytes), MIN(min_timestamp), "
                f"MAX(max_timestamp), MAX(base_offset) FROM chunks {where}"
                "GROUP BY stream_id, segment ORDER BY stream_id, segment",
                args,
            ).fetchall()
            out = []
            for stream_id, segment, count, size, lo, hi, newest in totals:
                (last,) = self._chunks(
                    cur,
                    "WHERE stream_id = ? AND segment = ? AND base_offset = ?",
                    (stream_id, segment, newest),
                )
                out.append(SegmentChunks(stream_id, segment, count, size, lo, hi, last))
        return out

    def chunk_at(self, stream_id: int, segment: int, offset: int) -> ChunkRecord | None:
        with self._read_lock:
            found = self._chunks(
                self._reader.cursor(),
                "WHERE stream_id = ? AND segment = ? AND base_offset <= ?",
                (stream_id, segment, offset),
                order="DESC LIMIT 1",
            )
        return found[0] if found else None

    def chunk_at_time(self, stream_id: int, segment: int, timestamp: int) -> ChunkRecord | None:
        # The first chunk whose newest event is late enough is the first whose running
        # maximum is: one step down the time index, however long the history.
        with self._read_lock:
            row = self._reader.execute(
                "SELECT stream_id, segment, base_offset, next_offset, bytes, min_timestamp, "
                "max_timestamp, name, idx, producers FROM chunks WHERE stream_id = ? AND "
                "segment = ? AND max_timestamp_so_far >= ? "
                "ORDER BY max_timestamp_so_far, base_offset LIMIT 1",
                (stream_id, segment, timestamp),
            ).fetchone()
        return None if row is None else ChunkRecord(*row)

    def chunks_from(
        self, stream_id: int, segment: int, offset: int, limit: int
    ) -> list[ChunkRecord]:
        with self._read_lock:
            return self._chunks(
                self._reader.cursor(),
                "WHERE stream_id = ? AND segment = ? AND base_offset >= ?",
                (stream_id, segment, offset),
                _LIGHT_COLUMNS,
                f"LIMIT {int(limit)}",
            )

    def chunk_finds(self, stream_id: int, segment: int, base_offset: int) -> bytes:
        with self._read_lock:
            row = self._reader.execute(
                "SELECT finds FROM chunks WHERE stream_id = ? AND segment = ? AND base_offset = ?",
                (stream_id, segment, base_offset),
            ).fetchone()
        return b"" if row is None else bytes(row[0])

    def reserve_ids(self, name: str, count: int) -> int:
        with self._transaction() as cur:
            row = cur.execute("SELECT next FROM counters WHERE name = ?", (name,)).fetchone()
            first = 0 if row is None else int(row[0])
            cur.execute(
                "INSERT INTO counters (name, next) VALUES (?, ?) "
                "ON CONFLICT (name) DO UPDATE SET next = excluded.next",
                (name, first + count),
            )
        return first

    def identities(self) -> list[Identity]:
        with self._lock:
            rows = self._db.execute(
                "SELECT transactional_id, producer_id, epoch, last_txn_id, last_metadata, "
                "committed_ms FROM identities ORDER BY transactional_id"
            ).fetchall()
        return [Identity(*row) for row in rows]

    def save_identity(self, identity: Identity) -> None:
        with self._transaction() as cur:
            cur.execute(
                "INSERT INTO identities (transactional_id, producer_id, epoch) VALUES (?, ?, ?) "
                "ON CONFLICT (transactional_id) DO UPDATE SET producer_id = excluded.producer_id, "
                "epoch = excluded.epoch",
                (identity.transactional_id, identity.producer_id, identity.epoch),
            )

    def commit_txn(
        self, commit: TxnCommit, *, lease: Lease | None = None, holds: Sequence[int] = ()
    ) -> None:
        with self._transaction() as cur:
            if lease is not None:
                _check_lease(cur, lease)
            for hold_id in sorted(holds):
                cur.execute("DELETE FROM position_holds WHERE hold_id = ?", (hold_id,))
                if cur.rowcount != 1:
                    raise _hold_gone(commit, hold_id)
            for named in commit.parts:
                row = cur.execute(
                    "SELECT sealed FROM segments WHERE stream_id = ? AND number = ?",
                    (named.stream_id, named.segment),
                ).fetchone()
                if row is not None and row[0]:
                    raise _sealed_part(commit, named)
            for part in commit.positions:  # first: a stale generation refuses the whole commit
                self._commit_positions(
                    cur, part.stream_id, part.subscription, part.generation, part.positions, None
                )
            cur.execute(
                "INSERT INTO txn_commits (txn_id, record) VALUES (?, ?)",
                (commit.txn_id, msgspec.msgpack.encode(commit)),
            )
            cur.execute(
                "UPDATE identities SET last_txn_id = ?, last_metadata = ?, committed_ms = ? "
                "WHERE transactional_id = ?",
                (commit.txn_id, commit.metadata, commit.committed_ms, commit.transactional_id),
            )

    def pending_commits(self) -> list[TxnCommit]:
        with self._lock:
            rows = self._db.execute("SELECT record FROM txn_commits ORDER BY txn_id").fetchall()
        return [msgspec.msgpack.decode(row[0], type=TxnCommit) for row in rows]

    def add_hold(self, hold_id: int, stream_id: int, subscription: str, *, lease: Lease) -> None:
        with self._transaction() as cur:
            _check_lease(cur, lease)
            try:
                cur.execute(
                    "INSERT INTO position_holds (hold_id, container, stream_id, subscription, "
                    "created_ms) VALUES (?, ?, ?, ?, ?)",
                    (hold_id, lease.container, stream_id, subscription, _wall_ms()),
                )
            except sqlite3.IntegrityError:
                raise _hold_exists(hold_id) from None

    def remove_holds(self, hold_ids: Sequence[int]) -> list[int]:
        removed = []
        with self._transaction() as cur:
            for hold_id in sorted(set(hold_ids)):
                cur.execute("DELETE FROM position_holds WHERE hold_id = ?", (hold_id,))
                if cur.rowcount == 1:
                    removed.append(hold_id)
        return removed

    def remove_holds_of(self, container: int) -> list[int]:
        with self._transaction() as cur:
            rows = cur.execute(
                "SELECT hold_id FROM position_holds WHERE container = ? ORDER BY hold_id",
                (container,),
            ).fetchall()
            cur.execute("DELETE FROM position_holds WHERE container = ?", (container,))
        return [int(row[0]) for row in rows]

    def finish_txn(self, txn_id: int) -> None:
        with self._transaction() as cur:
            cur.execute("DELETE FROM txn_commits WHERE txn_id = ?", (txn_id,))

    def create_subscription(self, record: SubscriptionRecord) -> None:
        with self._transaction() as cur:
            if not cur.execute(
                "SELECT 1 FROM streams WHERE id = ?", (record.stream_id,)
            ).fetchone():
                raise StreamNotFound(f"no stream has id {record.stream_id}")
            if cur.execute(
                "SELECT 1 FROM subscriptions WHERE stream_id = ? AND name = ?",
                (record.stream_id, record.name),
            ).fetchone():
                raise SubscriptionExists(
                    f"subscription {record.name!r} already exists on this stream",
                    subscription=record.name,
                )
            cur.execute(
                "INSERT INTO subscriptions (stream_id, name, record) VALUES (?, ?, ?)",
                (record.stream_id, record.name, msgspec.msgpack.encode(record)),
            )
            _bump_version(cur)

    def subscriptions(self, stream_id: int | None = None) -> list[SubscriptionRecord]:
        query = "SELECT record FROM subscriptions"
        args: tuple[int, ...] = ()
        if stream_id is not None:
            query, args = query + " WHERE stream_id = ?", (stream_id,)
        with self._lock:
            rows = self._db.execute(query + " ORDER BY stream_id, name", args).fetchall()
        return [msgspec.msgpack.decode(row[0], type=SubscriptionRecord) for row in rows]

    def delete_subscription(self, stream_id: int, name: str) -> None:
        with self._transaction() as cur:
            cur.execute(
                "DELETE FROM subscriptions WHERE stream_id = ? AND name = ?", (stream_id, name)
            )
            if cur.rowcount == 0:
                raise _no_subscription(name)
            _bump_version(cur)

    def commit_positions(
        self,
        stream_id: int,
        name: str,
        generation: int,
        positions: Mapping[int, int],
        queue: Mapping[int, QueueSegment] | None = None,
        *,
        lease: Lease | None = None,
    ) -> None:
        with self._transaction() as cur:
            if lease is not None:
                _check_lease(cur, lease)
            self._commit_positions(cur, stream_id, name, generation, positions, queue)

    def _commit_positions(
        self,
        cur: sqlite3.Cursor,
        stream_id: int,
        name: str,
        generation: int,
        positions: Mapping[int, int],
        queue: Mapping[int, QueueSegment] | None,
    ) -> None:
        record = self._subscription(cur, stream_id, name)
        if record.generation != generation:
            raise StaleGeneration(
                f"subscription {name!r} was reset (generation {record.generation}) after "
                f"these positions were read (generation {generation}); they are dropped",
                generation=record.generation,
            )
        state = dict(record.queue)
        state.update(queue or {})
        updated = msgspec.structs.replace(
            record, positions={**record.positions, **positions}, queue=state
        )
        cur.execute(
            "UPDATE subscriptions SET record = ? WHERE stream_id = ? AND name = ?",
            (msgspec.msgpack.encode(updated), stream_id, name),
        )

    def reset_subscription(
        self,
        stream_id: int,
        name: str,
        positions: Mapping[int, int],
        *,
        lease: Lease | None = None,
    ) -> SubscriptionRecord:
        with self._transaction() as cur:
            if lease is not None:
                _check_lease(cur, lease)
            record = self._subscription(cur, stream_id, name)
            updated = msgspec.structs.replace(
                record, positions=dict(positions), queue={}, generation=record.generation + 1
            )
            cur.execute(
                "UPDATE subscriptions SET record = ? WHERE stream_id = ? AND name = ?",
                (msgspec.msgpack.encode(updated), stream_id, name),
            )
            _bump_version(cur)
        return updated

    def _subscription(self, cur: sqlite3.Cursor, stream_id: int, name: str) -> SubscriptionRecord:
        row = cur.execute(
            "SELECT record FROM subscriptions WHERE stream_id = ? AND name = ?", (stream_id, name)
        ).fetchone()
        if row is None:
            raise _no_subscription(name)
        return msgspec.msgpack.decode(row[0], type=SubscriptionRecord)

    def put_setting(self, kind: str, key: str, value: bytes) -> None:
        with self._transaction() as cur:
            cur.execute(
                "INSERT INTO settings (kind, key, value) VALUES (?, ?, ?) "
                "ON CONFLICT (kind, key) DO UPDATE SET value = excluded.value",
                (kind, key, value),
            )
            _bump_version(cur)

    def delete_setting(self, kind: str, key: str) -> bool:
        with self._transaction() as cur:
            cur.execute("DELETE FROM settings WHERE kind = ? AND key = ?", (kind, key))
            if cur.rowcount == 0:
                return False
            _bump_version(cur)
            return True

    def settings(self, kind: str) -> dict[str, bytes]:
        with self._lock:
            rows = self._db.execute(
                "SELECT key, value FROM settings WHERE kind = ? ORDER BY key", (kind,)
            ).fetchall()
        return {key: bytes(value) for key, value in rows}

    def close(self) -> None:
        with self._lock:
            self._db.close()
        if self._reader is not self._db:
            with self._read_lock:
                self._reader.close()


def _wall_ms() -> int:
    """This host's clock, for SQLite's leases (one host: the data directory's lock already
    keeps a second broker off it; PostgreSQL's leases use the server's clock)."""
    return time.time_ns() // 1_000_000


def _check_ttl(ttl_ms: int, what: str = "a lease's") -> None:
    if ttl_ms < 0:
        raise InvalidArgument(f"{what} ttl_ms must be 0 or more, not {ttl_ms}")


def _grant(
    container: int,
    owner: str,
    ttl_ms: int,
    take_over: bool,
    now_ms: int,
    row: Sequence[Any] | None,
) -> Lease | None:
    """``acquire_lease``'s decision from the container's row (owner, epoch, expires_ms) at
    ``now_ms``: the new lease, or None while someone else holds it."""
    if row is None:
        return Lease(container, owner, 1, now_ms + ttl_ms)
    holder, epoch, expires_ms = str(row[0]), int(row[1]), int(row[2])
    if holder != owner and expires_ms > now_ms and not take_over:
        return None
    return Lease(container, owner, epoch + 1, now_ms + ttl_ms)


def _registered(
    broker_id: str,
    address: str,
    http_address: str,
    ttl_ms: int,
    now_ms: int,
    row: Sequence[Any] | None,
) -> Member:
    """``register_member``'s record from the broker's row (started_ms, expires_ms) at
    ``now_ms``: the start kept while the record is live, else now."""
    started = now_ms if row is None or int(row[1]) <= now_ms else int(row[0])
    return Member(broker_id, address, http_address, started, now_ms + ttl_ms)


def _bump_version(cur: sqlite3.Cursor) -> None:
    """Count a change of streams, segments, subscriptions or settings, in its transaction."""
    cur.execute("UPDATE catalog_version SET version = version + 1")


def _renewed(lease: Lease, ttl_ms: int, now_ms: int, row: Sequence[Any] | None) -> Lease:
    """``renew_lease``'s decision, or LeaseLost saying why."""
    if row is None or str(row[0]) != lease.owner or int(row[1]) != lease.epoch:
        raise _lease_lost(lease, row)
    if int(row[2]) <= now_ms:
        raise LeaseLost(
            f"the lease of container {lease.container} (epoch {lease.epoch}) expired "
            f"{now_ms - int(row[2])} ms ago by the catalog's clock before it was renewed",
            container=lease.container,
            epoch=lease.epoch,
        )
    return Lease(lease.container, lease.owner, lease.epoch, now_ms + ttl_ms)


def _lease_lost(lease: Lease, row: Sequence[Any] | None) -> LeaseLost:
    holder = "nobody" if row is None else f"{row[0]} (epoch {row[1]})"
    return LeaseLost(
        f"container {lease.container} is no longer leased to {lease.owner} (epoch "
        f"{lease.epoch}): it is now held by {holder}",
        container=lease.container,
        epoch=lease.epoch,
    )


def _check_lease(cur: sqlite3.Cursor, lease: Lease) -> None:
    """A fenced write's check, in its transaction: LeaseLost unless ``lease`` is the
    container's current holding (SQLite: BEGIN IMMEDIATE already excludes every writer)."""
    row = cur.execute(
        "SELECT owner, epoch, expires_ms FROM leases WHERE container = ?",
        (lease.container,),
    ).fetchone()
    if row is None or row[0] != lease.owner or row[1] != lease.epoch:
        raise _lease_lost(lease, row)


def _check_not_pending(
    name: str, stream_id: int, sealed: Mapping[int, int], pending: Sequence[TxnCommit]
) -> None:
    """A scale's check (``MetaStore.scale_stream``): no commit record still to be applied
    names a segment it seals."""
    for commit in pending:
        for part in commit.parts:
            if part.stream_id == stream_id and part.segment in sealed:
                raise InvalidArgument(
                    f"segment {part.segment} of stream {name!r} has batches of committed "
                    f"transaction {commit.txn_id} still to be applied: it cannot be sealed "
                    "before they are (ask again in a moment)",
                    stream=name,
                    segment=part.segment,
                    pending_txn=commit.txn_id,
                )


def _check_deadline(name: str, deadline_ms: int, now_ms: int) -> None:
    """A scale's check: the catalog's clock is still before the deadline of its prepares."""
    if now_ms >= deadline_ms:
        raise InvalidArgument(
            f"the merge of stream {name!r} came {now_ms - deadline_ms} ms past the deadline "
            "its prepared segments' brokers waited for (they reopen them): plan it again",
            stream=name,
            deadline_ms=deadline_ms,
        )


def _check_settled(name: str, deadline_ms: int, now_ms: int) -> None:
    """``settle_seal``'s check: the catalog's clock has reached the deadline."""
    if now_ms < deadline_ms:
        raise InvalidArgument(
            f"a merge of stream {name!r} may still seal its prepared segments for "
            f"{deadline_ms - now_ms} ms: settle them after that",
            stream=name,
            deadline_ms=deadline_ms,
        )


def _sealed_part(commit: TxnCommit, part: CommitPart) -> TransactionAborted:
    return TransactionAborted(
        f"transaction {commit.txn_id} staged into segment {part.segment} of stream id "
        f"{part.stream_id}, which a scale sealed before it committed: it is aborted, nothing "
        "of it is stored (write it again: the successors take its keys)",
        txn_id=commit.txn_id,
        segment=part.segment,
    )


def _hold_gone(commit: TxnCommit, hold_id: int) -> TransactionAborted:
    return TransactionAborted(
        f"transaction {commit.txn_id} aborted: the hold {hold_id} on the positions it commits "
        "is gone (it expired, or the group's coordinator moved) and the group went on without "
        "it; nothing of it is stored (run it again)",
        txn_id=commit.txn_id,
        hold_id=hold_id,
    )


def _hold_exists(hold_id: int) -> InvalidArgument:
    return InvalidArgument(f"hold {hold_id} is recorded already", hold_id=hold_id)


def _check_scale(epoch: int, sealed: Mapping[int, int], created: Sequence[SegmentRecord]) -> None:
    """What a scale event must be, whatever the stream (see ``MetaStore.scale_stream``)."""
    if not sealed or not created:
        raise InvalidArgument(
            "a scale event seals at least one segment and opens at least one successor"
        )
    for number, end_offset in sealed.items():
        if end_offset < 0:
            raise InvalidArgument(
                f"segment {number} cannot be sealed at offset {end_offset}: an end offset is "
                "0 or more (the offset after the segment's last event)",
                segment=number,
            )
    for s in created:
        if s.epoch != epoch or s.sealed or s.end_offset != -1:
            raise InvalidArgument(
                f"successor {s.number} must be open (no end offset) in epoch {epoch}; it says "
                f"epoch {s.epoch}, sealed {s.sealed}, end offset {s.end_offset}",
                segment=s.number,
            )
        if not s.predecessors or not set(s.predecessors) <= set(sealed):
            raise InvalidArgument(
                f"successor {s.number} names predecessors {s.predecessors}: they must be some "
                f"of the segments this event seals, {sorted(sealed)}",
                segment=s.number,
            )


def _no_subscription(name: str) -> SubscriptionNotFound:
    return SubscriptionNotFound(
        f"no subscription {name!r} on this stream; create it first ('slipstream subscription "
        "create')",
        subscription=name,
    )


#: SQLite catalog migrations after version 1, each one or more SQL statements separated by ";"
#: (no ";" inside a statement) run in one transaction: the first makes version 2 (append,
#: never edit). Version 1 is the schema below, reached from any earlier
#: catalog by the column upgrades of ``SqliteMetaStore._upgrade_unversioned``.
SQLITE_MIGRATIONS: tuple[str, ...] = (
    # 2: the object journal's records (storage/_journal_objects.py)
    "CREATE TABLE IF NOT EXISTS journal_objects (container INTEGER NOT NULL, "
    "file_id INTEGER NOT NULL, start INTEGER NOT NULL, size INTEGER NOT NULL, name TEXT NOT NULL, "
    "PRIMARY KEY (container, file_id, start))",
    # 3: containers' leases to brokers (docs/operations.md, "Leases and fencing")
    "CREATE TABLE IF NOT EXISTS leases (container INTEGER PRIMARY KEY, owner TEXT NOT NULL, "
    "epoch INTEGER NOT NULL, expires_ms INTEGER NOT NULL)",
    # 4: cluster membership, the catalog's version counter, secrets shared by the brokers
    "CREATE TABLE IF NOT EXISTS members (broker_id TEXT PRIMARY KEY, address TEXT NOT NULL, "
    "http_address TEXT NOT NULL, started_ms INTEGER NOT NULL, expires_ms INTEGER NOT NULL); "
    "CREATE TABLE IF NOT EXISTS catalog_version (version INTEGER NOT NULL); "
    "INSERT INTO catalog_version SELECT 0 WHERE NOT EXISTS (SELECT 1 FROM catalog_version); "
    "CREATE TABLE IF NOT EXISTS shared_secrets (name TEXT PRIMARY KEY, value BLOB NOT NULL)",
    # 5: groups held for transactions' commits on other brokers (MetaStore.add_hold)
    "CREATE TABLE IF NOT EXISTS position_holds (hold_id INTEGER PRIMARY KEY, "
    "container INTEGER NOT NULL, stream_id INTEGER NOT NULL, subscription TEXT NOT NULL, "
    "created_ms INTEGER NOT NULL)",
)

#: the SQLite catalog's schema version this code reads and writes (table ``schema_version``)
SCHEMA_VERSION = 1 + len(SQLITE_MIGRATIONS)


def schema_too_new(where: str, version: int, supported: int) -> StorageError:
    """The error for a catalog written by a newer slipstream: nothing is changed in it."""
    return StorageError(
        f"{where} has schema version {version}, newer than this slipstream knows "
        f"({supported}): a newer version wrote it. Run that version, or upgrade this one "
        "(the catalog was left as it was)",
        schema_version=version,
        supported=supported,
    )


def _sqlite_schema_version(db: sqlite3.Connection) -> int:
    """The catalog's schema version without writing anything: 0 for an empty catalog or one
    written before schema versions."""
    if not db.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_version'"
    ).fetchone():
        return 0
    row = db.execute("SELECT MAX(version) FROM schema_version").fetchone()
    return 0 if row is None or row[0] is None else int(row[0])


_TIME_INDEX = (
    "CREATE INDEX IF NOT EXISTS chunks_by_time "
    "ON chunks (stream_id, segment, max_timestamp_so_far, base_offset)"
)

#: columns added for elastic streams, to catalogs written before them: (table, column, type)
_ELASTIC_COLUMNS = (
    ("streams", "scaling", "TEXT NOT NULL DEFAULT ''"),
    ("segments", "predecessors", "TEXT NOT NULL DEFAULT '[]'"),
    ("segments", "end_offset", "INTEGER NOT NULL DEFAULT -1"),
    ("chunks", "finds", "BLOB NOT NULL DEFAULT x''"),  # catalogs before find indexes
)

#: chunk columns a lookup leaves out when it needs neither index nor producer state
_LIGHT_COLUMNS = "x'', x''"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS settings (
    kind TEXT NOT NULL,
    key TEXT NOT NULL,
    value BLOB NOT NULL,
    PRIMARY KEY (kind, key)
);
CREATE TABLE IF NOT EXISTS streams (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL UNIQUE,
    retention_ms INTEGER,
    retention_bytes INTEGER,
    created_ms INTEGER NOT NULL,
    scaling TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS segments (
    stream_id INTEGER NOT NULL,
    number INTEGER NOT NULL,
    epoch INTEGER NOT NULL,
    key_lo INTEGER NOT NULL,
    key_hi INTEGER NOT NULL,
    container INTEGER NOT NULL,
    sealed INTEGER NOT NULL DEFAULT 0,
    start_offset INTEGER NOT NULL DEFAULT 0,
    producers BLOB NOT NULL DEFAULT x'',
    predecessors TEXT NOT NULL DEFAULT '[]',  -- JSON list of segment numbers
    end_offset INTEGER NOT NULL DEFAULT -1,  -- while open
    PRIMARY KEY (stream_id, number)
);
CREATE TABLE IF NOT EXISTS chunks (
    stream_id INTEGER NOT NULL,
    segment INTEGER NOT NULL,
    base_offset INTEGER NOT NULL,
    next_offset INTEGER NOT NULL,
    bytes INTEGER NOT NULL,
    min_timestamp INTEGER NOT NULL,
    max_timestamp INTEGER NOT NULL,
    name TEXT NOT NULL,
    idx BLOB NOT NULL,
    producers BLOB NOT NULL DEFAULT x'',
    max_timestamp_so_far INTEGER,
    finds BLOB NOT NULL DEFAULT x'',  -- the chunk's find index (storage/_index.py)
    PRIMARY KEY (stream_id, segment, base_offset)
);
CREATE TABLE IF NOT EXISTS containers (
    id INTEGER PRIMARY KEY,
    moved_file INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS counters (
    name TEXT PRIMARY KEY,
    next INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS identities (
    transactional_id TEXT PRIMARY KEY,
    producer_id INTEGER NOT NULL,
    epoch INTEGER NOT NULL,
    last_txn_id INTEGER NOT NULL DEFAULT -1,
    last_metadata BLOB NOT NULL DEFAULT x'',
    committed_ms INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS subscriptions (
    stream_id INTEGER NOT NULL,
    name TEXT NOT NULL,
    record BLOB NOT NULL,
    PRIMARY KEY (stream_id, name)
);
CREATE TABLE IF NOT EXISTS scalings (
    stream_id INTEGER NOT NULL,
    epoch INTEGER NOT NULL,
    record BLOB NOT NULL,  -- a msgpack ScaleRecord
    PRIMARY KEY (stream_id, epoch)
);
CREATE TABLE IF NOT EXISTS txn_commits (
    txn_id INTEGER PRIMARY KEY,
    record BLOB NOT NULL
);
"""

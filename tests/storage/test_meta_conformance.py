"""One suite for every MetaStore: SqliteMetaStore on a file and in memory (``":memory:"``), and
PostgresMetaStore on a throwaway PostgreSQL server (tests/pg.py), a fresh database per test.

The contract (slipstream/storage/_meta.py): streams with their segments are created and deleted
in one transaction; stream ids are never reused; a journal file's chunks and the mark that the
file has moved change together; retention removes chunks and moves start offsets forward only;
subscriptions are created with their stream and deleted with it, commits change only the
segments named, resets count generations and refuse older commits, and positions committed in a
transaction's commit record change with it or not at all; a scale event seals, opens and records
all at once or not at all, in the epoch after the stream's current one.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import numpy as np
import psycopg
import pytest

from slipstream import (
    InvalidArgument,
    LeaseLost,
    SegmentNotFound,
    StaleGeneration,
    StorageError,
    StreamExists,
    StreamNotFound,
    SubscriptionExists,
    SubscriptionNotFound,
    TransactionAborted,
)
from slipstream.storage import (
    ChunkRecord,
    CommitPart,
    Identity,
    JournalObject,
    Lease,
    MetaStore,
    PositionCommit,
    QueueOptions,
    QueueSegment,
    ScaleRecord,
    SegmentRecord,
    SqliteMetaStore,
    StreamRecord,
    SubscriptionRecord,
    TxnCommit,
)
from slipstream.storage._meta_pg import PostgresMetaStore
from slipstream.streams import KeyRange, ScaleEvent, SegmentGraph, SegmentNode

MAX_KEY = 2**64 - 1


class Kit:
    """A MetaStore under test and how to open it again: SQLite on a file or in memory, or
    PostgreSQL on a fresh database (``where``: the file, ":memory:" or the DSN). A reopen is a
    new store on the same file or database."""

    def __init__(self, kind: str, where: str) -> None:
        self.kind = kind
        self.where = where
        self.path = Path(where)
        self.meta: MetaStore = self.open()

    @property
    def durable(self) -> bool:
        return self.kind != "memory"

    @property
    def integrity_error(self) -> type[Exception]:
        """What the backend raises for a record that breaks a constraint (a NULL name)."""
        return psycopg.IntegrityError if self.kind == "postgres" else sqlite3.IntegrityError

    def open(self) -> MetaStore:
        if self.kind == "postgres":
            return PostgresMetaStore(self.where)
        return SqliteMetaStore(self.where)

    def reopen(self) -> MetaStore:
        assert self.durable, "an in-memory catalog is gone once closed"
        self.meta.close()
        self.meta = self.open()
        return self.meta


def make_kit(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Kit:
    if kind == "postgres":
        return Kit(kind, request.getfixturevalue("pg_dsn"))
    return Kit(kind, str(tmp_path / "meta.db") if kind == "file" else ":memory:")


@pytest.fixture(params=["file", "memory", "postgres"])
def kit(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Kit]:
    kit = make_kit(request.param, request, tmp_path)
    yield kit
    kit.meta.close()


@pytest.fixture
def meta(kit: Kit) -> MetaStore:
    return kit.meta


@pytest.fixture(params=["file", "postgres"])
def durable_kit(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Kit]:
    """A catalog that survives a reopen: SQLite on a file, PostgreSQL."""
    kit = make_kit(request.param, request, tmp_path)
    yield kit
    kit.meta.close()


@pytest.fixture
def sqlite_kit(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Kit]:
    """SQLite on a file, for what only SQLite catalogs have (their older schemas)."""
    kit = make_kit("file", request, tmp_path)
    yield kit
    kit.meta.close()


def segments(count: int = 2, container: int = 0) -> list[SegmentRecord]:
    bounds = [2**64 * i // count for i in range(count + 1)]
    return [SegmentRecord(n, 0, bounds[n], bounds[n + 1] - 1, container + n) for n in range(count)]


def create(meta: MetaStore, name: str, count: int = 2, **kwargs: int | None) -> int:
    record = meta.create_stream(
        name,
        segments(count),
        kwargs.get("retention_ms"),
        kwargs.get("retention_bytes"),
        kwargs.get("created_ms") or 1_700_000_000_000,
    )
    return record.id


def chunk(
    stream_id: int, segment: int, base: int, count: int = 10, name: str | None = None
) -> ChunkRecord:
    index = np.array([(base, 0, 100), (base + count // 2, 100, 50)], dtype="<i8")
    return ChunkRecord(
        stream_id,
        segment,
        base,
        base + count,
        150,
        1000 + base,
        2000 + base,
        name if name is not None else f"{stream_id}/{segment}/{base:020d}",
        index.tobytes(),
    )


def start_offsets(meta: MetaStore, name: str) -> list[int]:
    (record,) = [s for s in meta.streams() if s.name == name]
    return [s.start_offset for s in record.segments]


def test_empty_catalog(meta: MetaStore) -> None:
    assert meta.streams() == []
    assert meta.chunks() == []
    assert meta.moved_file(0) == -1


def test_create_stream_round_trips_every_field(meta: MetaStore) -> None:
    records = [
        SegmentRecord(0, 0, 0, 2**63 - 1, 3),
        SegmentRecord(1, 2, 2**63, MAX_KEY, 1, sealed=True, start_offset=42),
    ]
    created = meta.create_stream("scope/orders", records, 60_000, 10**9, 1_700_000_000_123)
    (stored,) = meta.streams()
    assert stored == created
    assert stored.name == "scope/orders"
    assert (stored.retention_ms, stored.retention_bytes) == (60_000, 10**9)
    assert stored.created_ms == 1_700_000_000_123
    assert stored.segments == records
    # the unsigned 64-bit key range ends survive SQLite's signed integers exactly
    assert stored.segments[0].key_lo == 0
    assert stored.segments[1].key_hi == MAX_KEY
    assert stored.segments[0].key_hi + 1 == stored.segments[1].key_lo == 2**63


def test_single_segment_covers_the_whole_key_space(meta: MetaStore) -> None:
    meta.create_stream("s/one", [SegmentRecord(0, 0, 0, MAX_KEY, 0)], None, None, 1)
    (stored,) = meta.streams()
    assert (stored.segments[0].key_lo, stored.segments[0].key_hi) == (0, MAX_KEY)
    assert stored.retention_ms is None and stored.retention_bytes is None


def test_duplicate_name_is_stream_exists_and_changes_nothing(meta: MetaStore) -> None:
    first = create(meta, "s/dup", 2)
    with pytest.raises(StreamExists) as raised:
        meta.create_stream("s/dup", segments(5), 1, 1, 1)
    assert raised.value.details["stream"] == "s/dup"
    (stored,) = meta.streams()
    assert stored.id == first
    assert len(stored.segments) == 2
    # the store is still usable after the refused transaction
    assert create(meta, "s/other") > first


def test_streams_lists_every_live_stream_by_name(meta: MetaStore) -> None:
    for name in ("b/two", "a/one", "c/three"):
        create(meta, name, 3)
    listed = meta.streams()
    assert [s.name for s in listed] == ["a/one", "b/two", "c/three"]
    assert all([seg.number for seg in s.segments] == [0, 1, 2] for s in listed)


def test_streams_gives_each_stream_its_own_segments_with_every_field(meta: MetaStore) -> None:
    """streams() is one read of every stream (PostgreSQL: one statement for all segments):
    each record is what create_stream returned, segments in number order, whatever the order
    of creation, of ids and of names, and a deleted stream's segments appear nowhere."""
    made = {}
    for i, name in enumerate(["m/c", "m/a", "m/doomed", "m/b", "m/d"]):
        count = i + 1
        made[name] = meta.create_stream(
            name,
            [
                SegmentRecord(
                    n, n % 2, 2**64 * n // count, 2**64 * (n + 1) // count - 1, 7 - n,
                    sealed=n < count - 1, start_offset=10 * i + n,
                    producers=bytes([i, n]), predecessors=list(range(n)),
                    end_offset=100 * i + n if n < count - 1 else -1,
                )
                for n in reversed(range(count))
            ],
            i * 1000 or None, i or None, 1_700_000_000_000 + i, f"policy {i}",
        )  # fmt: skip
    meta.delete_stream("m/doomed")
    del made["m/doomed"]
    listed = meta.streams()
    assert [s.name for s in listed] == ["m/a", "m/b", "m/c", "m/d"]
    for record in listed:
        expected = made[record.name]
        assert record == msgspec.structs.replace(
            expected, segments=sorted(expected.segments, key=lambda s: s.number)
        )


def test_delete_stream_returns_its_chunks_and_removes_it(meta: MetaStore) -> None:
    doomed = create(meta, "s/doomed")
    kept = create(meta, "s/kept")
    doomed_chunks = [chunk(doomed, 0, 0), chunk(doomed, 0, 10), chunk(doomed, 1, 0)]
    kept_chunks = [chunk(kept, 0, 0)]
    meta.add_chunks(0, 0, doomed_chunks + kept_chunks)

    record, chunks = meta.delete_stream("s/doomed")
    assert record.id == doomed and record.name == "s/doomed"
    assert len(record.segments) == 2
    assert chunks == doomed_chunks
    assert [s.name for s in meta.streams()] == ["s/kept"]
    assert meta.chunks() == kept_chunks
    with pytest.raises(StreamNotFound):
        meta.delete_stream("s/doomed")


def test_delete_of_a_missing_stream_is_stream_not_found(meta: MetaStore) -> None:
    with pytest.raises(StreamNotFound) as raised:
        meta.delete_stream("s/never")
    assert raised.value.details["stream"] == "s/never"


def test_delete_by_id_leaves_a_newer_stream_of_the_same_name_alone(meta: MetaStore) -> None:
    old = create(meta, "s/reused")
    meta.delete_stream("s/reused", old)
    new = create(meta, "s/reused")
    meta.add_chunks(0, 0, [chunk(new, 0, 0)])
    with pytest.raises(StreamNotFound) as raised:
        meta.delete_stream("s/reused", old)  # meant for the old one: already gone
    assert raised.value.details["stream"] == "s/reused"
    assert [r.id for r in meta.streams()] == [new]
    assert meta.chunks() == [chunk(new, 0, 0)]
    record, chunks = meta.delete_stream("s/reused", new)
    assert record.id == new and chunks == [chunk(new, 0, 0)]
    assert meta.streams() == []


def test_update_retention_changes_only_what_it_is_given(meta: MetaStore) -> None:
    stream = create(meta, "s/ret", 2, retention_ms=60_000, retention_bytes=10**9)
    create(meta, "s/other", 1, retention_ms=5_000)
    before = {s.name: s for s in meta.streams()}
    record = meta.update_retention(stream, 7_200_000, None)  # None: the size limit stays
    assert (record.id, record.name) == (stream, "s/ret")
    assert (record.retention_ms, record.retention_bytes) == (7_200_000, 10**9)
    assert record.segments == before["s/ret"].segments
    assert meta.update_retention(stream, None, 4096).retention_bytes == 4096
    assert meta.update_retention(stream, None, None) == msgspec.structs.replace(
        record, retention_bytes=4096
    )
    stored = {s.name: s for s in meta.streams()}
    assert (stored["s/ret"].retention_ms, stored["s/ret"].retention_bytes) == (7_200_000, 4096)
    assert stored["s/other"] == before["s/other"]  # another stream is not touched


def test_update_retention_with_zero_removes_a_limit(meta: MetaStore) -> None:
    stream = create(meta, "s/ret", 1, retention_ms=60_000, retention_bytes=10**9)
    assert meta.update_retention(stream, 0, None).retention_ms is None
    (stored,) = meta.streams()
    assert (stored.retention_ms, stored.retention_bytes) == (None, 10**9)
    meta.update_retention(stream, None, 0)
    (stored,) = meta.streams()
    assert (stored.retention_ms, stored.retention_bytes) == (None, None)


def test_update_retention_of_a_deleted_stream_leaves_a_newer_one_alone(meta: MetaStore) -> None:
    old = create(meta, "s/reused", 1, retention_ms=1000)
    meta.delete_stream("s/reused")
    new = create(meta, "s/reused", 1, retention_ms=2000)
    with pytest.raises(StreamNotFound):
        meta.update_retention(old, 5, 5)
    with pytest.raises(StreamNotFound):
        meta.update_retention(new + 1000, 5, 5)  # never created
    (stored,) = meta.streams()
    assert (stored.id, stored.retention_ms, stored.retention_bytes) == (new, 2000, None)


def test_stream_ids_are_never_reused(meta: MetaStore) -> None:
    seen = {create(meta, "s/a"), create(meta, "s/b")}
    for round_ in range(3):
        meta.delete_stream("s/b")  # the newest: a plain rowid would hand its id out again
        new = create(meta, "s/b")
        assert new not in seen, round_
        assert new > max(seen)
        seen.add(new)


def test_segments_of_a_recreated_stream_are_its_own(meta: MetaStore) -> None:
    old = create(meta, "s/re", 4)
    meta.add_chunks(0, 0, [chunk(old, 0, 0)])
    meta.delete_stream("s/re")
    new = create(meta, "s/re", 1)
    (stored,) = meta.streams()
    assert stored.id == new and len(stored.segments) == 1
    assert meta.chunks() == []


def test_moved_file_is_per_container_and_set_with_the_chunks(meta: MetaStore) -> None:
    stream = create(meta, "s/move")
    assert meta.moved_file(0) == -1
    assert meta.moved_file(1) == -1
    meta.add_chunks(0, 4, [chunk(stream, 0, 0)])
    assert meta.moved_file(0) == 4
    assert meta.moved_file(1) == -1
    meta.add_chunks(1, 0, [])  # a file with no live batches still counts as moved
    assert meta.moved_file(1) == 0
    meta.add_chunks(0, 5, [chunk(stream, 0, 10), chunk(stream, 1, 0)])
    assert meta.moved_file(0) == 5
    assert meta.chunks() == [chunk(stream, 0, 0), chunk(stream, 0, 10), chunk(stream, 1, 0)]


def test_journal_objects_are_per_container_in_order_and_removed_by_file(kit: Kit) -> None:
    meta = kit.meta
    assert meta.journal_objects(0) == []
    records = [
        JournalObject(1, 0, 100, "journal/0/0000000000000001/0000000000000000"),
        JournalObject(1, -1, 0, ""),
        JournalObject(0, -1, 0, ""),  # a file begun by a roll, nothing in it yet
        JournalObject(1, 100, 50, "journal/0/0000000000000001/0000000000000100"),
        JournalObject(2, 0, 7, "journal/0/0000000000000002/0000000000000000"),
    ]
    for record in records:
        meta.add_journal_object(0, record)
    meta.add_journal_object(1, JournalObject(1, 0, 9, "journal/1/0000000000000001/0"))
    assert meta.journal_objects(0) == sorted(records, key=lambda r: (r.file_id, r.start))
    with pytest.raises((kit.integrity_error, StorageError)):
        meta.add_journal_object(0, JournalObject(1, 100, 1, "the same file and position"))
    meta.remove_journal_objects(0, [0, 1])
    assert meta.journal_objects(0) == [records[4]]
    assert meta.journal_objects(1) == [JournalObject(1, 0, 9, "journal/1/0000000000000001/0")]
    meta.remove_journal_objects(0, [5])  # nothing there: no error
    if kit.durable:
        assert kit.reopen().journal_objects(0) == [records[4]]


def test_add_chunks_is_atomic(kit: Kit) -> None:
    meta = kit.meta
    stream = create(meta, "s/atomic")
    meta.add_chunks(0, 1, [chunk(stream, 0, 0)])
    bad = chunk(stream, 0, 20)
    bad = ChunkRecord(*[None if f == "name" else getattr(bad, f) for f in bad.__struct_fields__])
    with pytest.raises(kit.integrity_error):
        meta.add_chunks(0, 2, [chunk(stream, 0, 10), bad])
    assert meta.chunks() == [chunk(stream, 0, 0)]
    assert meta.moved_file(0) == 1, "the file is not marked moved when its chunks are not"


def test_add_chunks_again_replaces_rather_than_duplicates(meta: MetaStore) -> None:
    # a move retried after a crash records the same chunks again
    stream = create(meta, "s/retry")
    meta.add_chunks(0, 0, [chunk(stream, 0, 0)])
    meta.add_chunks(0, 0, [chunk(stream, 0, 0)])
    assert meta.chunks() == [chunk(stream, 0, 0)]


def test_add_chunks_for_a_deleted_stream_stores_nothing(meta: MetaStore) -> None:
    gone = create(meta, "s/gone")
    live = create(meta, "s/live")
    meta.delete_stream("s/gone")
    meta.add_chunks(0, 3, [chunk(gone, 0, 0), chunk(live, 1, 0), chunk(9999, 0, 0)])
    assert meta.chunks() == [chunk(live, 1, 0)]
    assert meta.moved_file(0) == 3


def test_chunks_are_ordered_by_stream_segment_and_offset(meta: MetaStore) -> None:
    a = create(meta, "s/a")
    b = create(meta, "s/b")
    shuffled = [chunk(b, 0, 0), chunk(a, 1, 0), chunk(a, 0, 100), chunk(a, 0, 5), chunk(b, 1, 7)]
    meta.add_chunks(0, 0, shuffled)
    assert meta.chunks() == sorted(shuffled, key=lambda c: (c.stream_id, c.segment, c.base_offset))


def test_retention_keeps_a_higher_start_offset(meta: MetaStore) -> None:
    meta.create_stream("s/high", [SegmentRecord(0, 0, 0, MAX_KEY, 0, start_offset=500)], 1, 1, 1)
    (stream,) = meta.streams()
    meta.add_chunks(0, 0, [chunk(stream.id, 0, 0)])
    meta.remove_chunks_before(stream.id, {0: 10})
    assert start_offsets(meta, "s/high") == [500]


def test_retention_of_a_deleted_stream_is_harmless(meta: MetaStore) -> None:
    stream = create(meta, "s/del")
    meta.add_chunks(0, 0, [chunk(stream, 0, 0)])
    meta.delete_stream("s/del")
    assert meta.remove_chunks_before(stream, {0: 10}) == []
    assert meta.streams() == []
    assert meta.chunks() == []


def test_reopen_from_a_file_keeps_everything(durable_kit: Kit) -> None:
    meta = durable_kit.meta
    a = create(meta, "s/a", 3, retention_ms=1000)
    b = create(meta, "s/b", 1)
    create(meta, "s/deleted")
    meta.delete_stream("s/deleted")
    meta.add_chunks(0, 7, [chunk(a, 0, 0), chunk(a, 0, 10), chunk(b, 0, 0)])
    meta.add_chunks(2, 1, [chunk(a, 2, 0)])
    meta.remove_chunks_before(a, {0: 10})
    meta.update_retention(b, 3_600_000, 1 << 20)
    streams, chunks = meta.streams(), meta.chunks()

    reopened = durable_kit.reopen()
    assert reopened.streams() == streams
    assert reopened.chunks() == chunks
    assert (reopened.moved_file(0), reopened.moved_file(1), reopened.moved_file(2)) == (7, -1, 1)
    assert start_offsets(reopened, "s/a") == [10, 0, 0]
    assert [(s.retention_ms, s.retention_bytes) for s in reopened.streams()] == [
        (1000, None),
        (3_600_000, 1 << 20),
    ]
    # ids keep growing past every id ever handed out, deleted ones included
    assert create(reopened, "s/c") > max(s.id for s in streams) + 1


# --- producer ids, identities and transaction commit records ------------------------------------


def test_reserved_id_blocks_never_overlap_even_after_a_reopen(durable_kit: Kit) -> None:
    meta = durable_kit.meta
    assert meta.reserve_ids("producer_id", 1000) == 0
    assert meta.reserve_ids("producer_id", 10) == 1000
    assert meta.reserve_ids("txn_id", 5) == 0  # counters are independent
    meta = durable_kit.reopen()
    assert meta.reserve_ids("producer_id", 1) == 1010


def test_identities_keep_their_last_commit_across_epochs(durable_kit: Kit) -> None:
    meta = durable_kit.meta
    assert meta.identities() == []
    meta.save_identity(Identity("app-1", 7, 0))
    commit = TxnCommit(42, "app-1", 7, 0, [CommitPart(1, 0, 5)], b'{"batch": 3}', 1_700, 4)
    meta.commit_txn(commit)
    assert meta.pending_commits() == [commit]
    meta.save_identity(Identity("app-1", 7, 1))  # a new epoch keeps the last commit
    meta = durable_kit.reopen()
    assert meta.identities() == [Identity("app-1", 7, 1, 42, b'{"batch": 3}', 1_700)]
    assert meta.pending_commits() == [commit]
    meta.finish_txn(42)
    assert meta.pending_commits() == []
    assert meta.identities()[0].last_txn_id == 42


def test_a_commit_fenced_by_an_old_lease_is_refused_and_stores_nothing(kit: Kit) -> None:
    """In a cluster a commit record names its coordinating container and is stored only under
    that container's current lease: a coordinator that lost it commits nothing."""
    meta = kit.meta
    meta.save_identity(Identity("app-1", 7, 0))
    old = meta.acquire_lease(2, "broker-a", 0)
    assert old is not None
    new = meta.acquire_lease(2, "broker-b", 60_000)
    assert new is not None
    refused = TxnCommit(1, "app-1", 7, 0, [CommitPart(1, 0, 0)], b"old", 1_700, 1, coordinator=2)
    with pytest.raises(LeaseLost):
        meta.commit_txn(refused, lease=old)
    assert meta.pending_commits() == []
    assert meta.identities()[0].last_txn_id == -1
    stored = TxnCommit(2, "app-1", 7, 0, [CommitPart(1, 0, 0)], b"new", 1_800, 1, coordinator=2)
    meta.commit_txn(stored, lease=new)
    assert meta.pending_commits() == [stored]
    assert meta.pending_commits()[0].coordinator == 2
    if kit.durable:
        assert kit.reopen().pending_commits() == [stored]


def test_chunk_producer_snapshots_round_trip(meta: MetaStore) -> None:
    stream_id = create(meta, "s/p", 1)
    record = ChunkRecord(stream_id, 0, 0, 5, 100, 1, 2, "c", b"\0" * 24, b"snapshot")
    meta.add_chunks(0, 0, [record])
    assert meta.chunks() == [record]


def test_a_segments_producer_state_follows_its_newest_chunk_and_outlives_retention(
    kit: Kit,
) -> None:
    meta = kit.meta
    stream_id = create(meta, "s/dedup", 2)
    older = msgspec.structs.replace(chunk(stream_id, 0, 0), producers=b"as of 10")
    newer = msgspec.structs.replace(chunk(stream_id, 0, 10), producers=b"as of 20")
    meta.add_chunks(0, 0, [older])
    meta.add_chunks(0, 1, [newer])
    meta.remove_chunks_before(stream_id, {0: 20})  # retention removes every chunk of segment 0
    assert meta.chunks() == []
    if kit.durable:
        meta = kit.reopen()
    (record,) = meta.streams()
    assert [s.producers for s in record.segments] == [b"as of 20", b""]
    assert [s.start_offset for s in record.segments] == [20, 0]


def test_chunk_lookups_by_offset_and_time_without_loading_the_history(kit: Kit) -> None:
    meta = kit.meta
    stream_id = create(meta, "s/look", 2)
    ours = [chunk(stream_id, 0, base) for base in (0, 10, 20, 30)]
    meta.add_chunks(0, 0, [*ours[:2], chunk(stream_id, 1, 0)])
    meta.add_chunks(0, 1, ours[2:])
    if kit.durable:
        meta = kit.reopen()
    assert meta.chunk_at(stream_id, 0, 0) == ours[0]
    assert meta.chunk_at(stream_id, 0, 19) == ours[1]
    assert meta.chunk_at(stream_id, 0, 10**9) == ours[3], "the newest at or before"
    assert meta.chunk_at(stream_id, 1, 5) == chunk(stream_id, 1, 0)
    assert meta.chunk_at(stream_id + 1, 0, 5) is None
    # chunk(.., base) has its newest event at 2000 + base
    assert meta.chunk_at_time(stream_id, 0, 0) == ours[0]
    assert meta.chunk_at_time(stream_id, 0, 2011) == ours[2]
    assert meta.chunk_at_time(stream_id, 0, 2030) == ours[3]
    assert meta.chunk_at_time(stream_id, 0, 2031) is None
    light = [msgspec.structs.replace(c, index=b"", producers=b"") for c in ours]
    assert meta.chunks_from(stream_id, 0, 10, 2) == light[1:3]
    assert meta.chunks_from(stream_id, 0, 11, 100) == light[2:]
    (seg0, seg1) = meta.segment_chunks()
    assert (seg0.stream_id, seg0.segment, seg0.count, seg0.bytes) == (stream_id, 0, 4, 600)
    assert (seg0.min_timestamp, seg0.max_timestamp, seg0.newest) == (1000, 2030, ours[3])
    assert (seg1.segment, seg1.count, seg1.newest) == (1, 1, chunk(stream_id, 1, 0))


def test_retention_removes_a_range_of_chunks_in_one_call(kit: Kit) -> None:
    meta = kit.meta
    stream_id = create(meta, "s/range", 2)
    ours = [chunk(stream_id, 0, base) for base in (0, 10, 20)]
    theirs = [chunk(stream_id, 1, base) for base in (0, 10)]
    meta.add_chunks(0, 0, [*ours, *theirs])
    removed = meta.remove_chunks_before(stream_id, {0: 20, 1: 5})
    assert [(c.segment, c.base_offset, c.name, c.bytes) for c in removed] == [
        (0, 0, ours[0].name, 150),
        (0, 10, ours[1].name, 150),
    ]
    assert meta.chunks() == [ours[2], *theirs], "a chunk that ends after the cut stays"
    assert start_offsets(meta, "s/range") == [20, 5]
    assert meta.remove_chunks_before(stream_id, {0: 15}) == []
    assert start_offsets(meta, "s/range") == [20, 5], "start offsets never move back"
    if kit.durable:
        meta = kit.reopen()
    assert meta.chunks() == [ours[2], *theirs]
    assert [c.count for c in meta.segment_chunks()] == [1, 2]


def test_segment_chunks_of_some_streams_are_those_of_every_stream_for_them(
    meta: MetaStore,
) -> None:
    """A cluster's refresh asks for the streams with segments new to it only."""
    ids = [create(meta, f"s/part{i}", 3) for i in range(4)]
    meta.add_chunks(
        0, 0, [chunk(s, n, 10 * k) for s in ids for n in range(3) for k in range(n + 1) if n != 1]
    )
    every = meta.segment_chunks()
    assert len(every) == 8
    for wanted in ([ids[1]], [ids[3], ids[0]], ids, [ids[2], max(ids) + 7]):
        assert meta.segment_chunks(set(wanted)) == [c for c in every if c.stream_id in wanted]
    assert meta.segment_chunks([]) == []
    assert meta.segment_chunks([max(ids) + 7]) == []


def test_a_time_lookup_never_starts_after_a_chunk_with_a_late_enough_event(kit: Kit) -> None:
    # Event times need not grow with offsets. The chunk found for a time has no earlier kept
    # chunk with an event that late, and is at or before the first kept chunk that has one;
    # also after retention removed chunks, and in a catalog reopened.
    meta = kit.meta
    stream_id = create(meta, "s/time", 1)
    newest = [2000, 5000, 3000, 6000, 1000, 7000]  # newest event time of each chunk
    kept = [
        msgspec.structs.replace(chunk(stream_id, 0, 10 * i), max_timestamp=t)
        for i, t in enumerate(newest)
    ]
    meta.add_chunks(0, 0, kept[:3])
    meta.add_chunks(0, 1, kept[3:])

    def check(meta: MetaStore) -> None:
        for timestamp in range(0, 8000, 250):
            found = meta.chunk_at_time(stream_id, 0, timestamp)
            late = [c for c in kept if c.max_timestamp >= timestamp]
            if not late:
                assert found is None, timestamp
                continue
            assert found is not None and found.base_offset <= late[0].base_offset, timestamp
            assert found in kept, timestamp
            before = [c for c in kept if c.base_offset < found.base_offset]
            assert all(c.max_timestamp < timestamp for c in before), timestamp

    check(meta)
    meta.remove_chunks_before(stream_id, {0: 20})  # the 5000 goes; 3000 is now first
    del kept[:2]
    check(meta)
    assert meta.chunk_at_time(stream_id, 0, 2500) == kept[0]
    if kit.durable:
        check(kit.reopen())


def test_a_catalog_from_before_the_time_index_gets_it_on_open(sqlite_kit: Kit) -> None:
    meta = sqlite_kit.meta
    stream_id = create(meta, "s/old", 1)
    records = [
        msgspec.structs.replace(chunk(stream_id, 0, 10 * i), max_timestamp=t)
        for i, t in enumerate([4000, 2000, 6000])
    ]
    meta.add_chunks(0, 0, records)
    meta.close()
    with sqlite3.connect(sqlite_kit.path) as db:  # as an older version left it
        db.execute("DROP INDEX chunks_by_time")
        db.execute("ALTER TABLE chunks DROP COLUMN max_timestamp_so_far")
        db.execute("DROP TABLE schema_version")
    meta = sqlite_kit.reopen()
    assert meta.chunk_at_time(stream_id, 0, 3000) == records[0]
    assert meta.chunk_at_time(stream_id, 0, 5000) == records[2]
    assert meta.chunk_at_time(stream_id, 0, 7000) is None


# --- subscriptions ---------------------------------------------------------------------------


def subscription(
    stream_id: int, name: str = "billing", positions: dict[int, int] | None = None
) -> SubscriptionRecord:
    return SubscriptionRecord(stream_id, name, "ordered", 1_700, positions or {0: 0, 1: 0})


def only(meta: MetaStore, stream_id: int, name: str = "billing") -> SubscriptionRecord:
    (record,) = [r for r in meta.subscriptions(stream_id) if r.name == name]
    return record


def test_a_subscription_round_trips_every_field(meta: MetaStore) -> None:
    stream = create(meta, "s/a")
    record = SubscriptionRecord(
        stream,
        "work",
        "key_ordered_queue",
        1_700,
        {0: 5, 1: 7},
        generation=0,
        queue={0: QueueSegment([7, 9], {6: 3})},
        options=QueueOptions(ack_timeout_ms=5_000, dead_letter="s/a.failed"),
    )
    meta.create_subscription(record)
    assert meta.subscriptions(stream) == [record]
    assert meta.subscriptions() == [record]


def test_subscriptions_are_per_stream_and_by_name(meta: MetaStore) -> None:
    first, second = create(meta, "s/a"), create(meta, "s/b")
    for stream, name in [(second, "z"), (first, "b"), (first, "a")]:
        meta.create_subscription(subscription(stream, name))
    assert [r.name for r in meta.subscriptions(first)] == ["a", "b"]
    assert [(r.stream_id, r.name) for r in meta.subscriptions()] == [
        (first, "a"),
        (first, "b"),
        (second, "z"),
    ]


def test_a_duplicate_name_is_subscription_exists_and_changes_nothing(meta: MetaStore) -> None:
    stream = create(meta, "s/a")
    meta.create_subscription(subscription(stream))
    with pytest.raises(SubscriptionExists):
        meta.create_subscription(subscription(stream, positions={0: 9, 1: 9}))
    assert only(meta, stream).positions == {0: 0, 1: 0}


def test_a_subscription_needs_a_live_stream(meta: MetaStore) -> None:
    with pytest.raises(StreamNotFound):
        meta.create_subscription(subscription(12345))
    stream = create(meta, "s/a")
    meta.delete_stream("s/a")
    with pytest.raises(StreamNotFound):
        meta.create_subscription(subscription(stream))


def test_deleting_a_stream_deletes_its_subscriptions(meta: MetaStore) -> None:
    stream = create(meta, "s/a")
    meta.create_subscription(subscription(stream))
    meta.delete_stream("s/a")
    again = create(meta, "s/a")
    assert meta.subscriptions() == []
    meta.create_subscription(subscription(again))  # the name is free on the new stream


def test_commit_changes_only_the_segments_named(meta: MetaStore) -> None:
    stream = create(meta, "s/a")
    meta.create_subscription(subscription(stream))
    meta.commit_positions(stream, "billing", 0, {1: 40})
    meta.commit_positions(stream, "billing", 0, {0: 10})
    assert only(meta, stream).positions == {0: 10, 1: 40}


def test_commit_to_a_missing_subscription_is_not_found(meta: MetaStore) -> None:
    stream = create(meta, "s/a")
    with pytest.raises(SubscriptionNotFound):
        meta.commit_positions(stream, "nobody", 0, {0: 1})
    with pytest.raises(SubscriptionNotFound):
        meta.reset_subscription(stream, "nobody", {0: 1})
    with pytest.raises(SubscriptionNotFound):
        meta.delete_subscription(stream, "nobody")


def test_a_reset_counts_a_generation_and_refuses_older_commits(meta: MetaStore) -> None:
    stream = create(meta, "s/a")
    meta.create_subscription(subscription(stream))
    meta.commit_positions(stream, "billing", 0, {0: 50, 1: 60}, {0: QueueSegment([52])})
    reset = meta.reset_subscription(stream, "billing", {0: 3, 1: 4})
    assert reset.generation == 1 and reset.positions == {0: 3, 1: 4} and reset.queue == {}
    assert only(meta, stream) == reset
    with pytest.raises(StaleGeneration) as caught:
        meta.commit_positions(stream, "billing", 0, {0: 99})
    assert caught.value.details == {"generation": 1}
    assert only(meta, stream).positions == {0: 3, 1: 4}
    meta.commit_positions(stream, "billing", 1, {0: 8})
    assert only(meta, stream).positions == {0: 8, 1: 4}


def test_positions_and_resets_fenced_by_an_old_lease_are_refused_and_store_nothing(
    kit: Kit,
) -> None:
    """In a cluster a group's positions, queue state and resets are written under the lease
    of the container coordinating the group: a coordinator that lost it (paused past its
    lease, then resumed) writes nothing over the new holder's state."""
    meta = kit.meta
    stream = create(meta, "s/a")
    meta.create_subscription(subscription(stream))
    old = meta.acquire_lease(1, "broker-a", 0)
    assert old is not None
    meta.commit_positions(stream, "billing", 0, {0: 5}, {0: QueueSegment([7])}, lease=old)
    new = meta.acquire_lease(1, "broker-b", 60_000)
    assert new is not None
    meta.commit_positions(stream, "billing", 0, {0: 9}, {0: QueueSegment([11])}, lease=new)
    before, version = only(meta, stream), meta.catalog_version()
    with pytest.raises(LeaseLost) as caught:
        meta.commit_positions(stream, "billing", 0, {0: 6, 1: 3}, {0: QueueSegment()}, lease=old)
    assert caught.value.details == {"container": 1, "epoch": old.epoch}
    with pytest.raises(LeaseLost):
        meta.reset_subscription(stream, "billing", {0: 0, 1: 0}, lease=old)
    with pytest.raises(LeaseLost):  # a container never leased is no one's to write for
        meta.commit_positions(stream, "billing", 0, {0: 10}, lease=Lease(7, "broker-b", 1, 0))
    assert only(meta, stream) == before
    assert before.positions == {0: 9, 1: 0} and before.queue == {0: QueueSegment([11])}
    assert meta.catalog_version() == version
    reset = meta.reset_subscription(stream, "billing", {0: 2, 1: 2}, lease=new)
    assert reset.generation == 1 and only(meta, stream) == reset
    if kit.durable:
        assert only(kit.reopen(), stream) == reset


def test_queue_state_is_replaced_per_segment(meta: MetaStore) -> None:
    stream = create(meta, "s/a")
    meta.create_subscription(subscription(stream))
    meta.commit_positions(stream, "billing", 0, {0: 5}, {0: QueueSegment([7], {6: 2})})
    meta.commit_positions(stream, "billing", 0, {1: 2}, {1: QueueSegment([4])})
    meta.commit_positions(stream, "billing", 0, {0: 8}, {0: QueueSegment()})
    record = only(meta, stream)
    assert record.positions == {0: 8, 1: 2}
    assert record.queue == {0: QueueSegment(), 1: QueueSegment([4])}


def test_delete_subscription_removes_only_it(meta: MetaStore) -> None:
    stream = create(meta, "s/a")
    meta.create_subscription(subscription(stream, "a"))
    meta.create_subscription(subscription(stream, "b"))
    meta.delete_subscription(stream, "a")
    assert [r.name for r in meta.subscriptions(stream)] == ["b"]


def test_positions_commit_with_the_transaction_or_not_at_all(durable_kit: Kit) -> None:
    meta = durable_kit.meta
    stream = create(meta, "s/a")
    meta.create_subscription(subscription(stream))
    meta.save_identity(Identity("app", 3, 0))
    commit = TxnCommit(
        7, "app", 3, 0, [CommitPart(stream, 0, 0)], b"", 1_700, 1,
        positions=[PositionCommit(stream, "billing", 0, {0: 12})],
    )  # fmt: skip
    meta.commit_txn(commit)
    meta = durable_kit.reopen()
    assert only(meta, stream).positions == {0: 12, 1: 0}
    assert meta.pending_commits() == [commit]
    # a reset since the positions were read: the whole commit is refused, nothing changes
    meta.reset_subscription(stream, "billing", {0: 0, 1: 0})
    stale = TxnCommit(
        8, "app", 3, 0, [CommitPart(stream, 1, 0)], b"", 1_800, 1,
        positions=[PositionCommit(stream, "billing", 0, {1: 30})],
    )  # fmt: skip
    with pytest.raises(StaleGeneration):
        meta.commit_txn(stale)
    assert [c.txn_id for c in meta.pending_commits()] == [7]
    assert meta.identities()[0].last_txn_id == 7
    assert only(meta, stream).positions == {0: 0, 1: 0}


def test_a_commit_consumes_its_holds_and_stores_nothing_if_one_is_gone(kit: Kit) -> None:
    """Positions held by a group's coordinator for a transaction on another broker
    (docs/cluster.md, "Consume-transform-produce"): the commit record is stored only by
    consuming its holds; a hold removed first (expired, its group adopted) makes the commit
    store nothing, and removing a hold after its commit reports it gone."""
    meta = kit.meta
    stream = create(meta, "s/a")
    meta.create_subscription(subscription(stream))
    meta.save_identity(Identity("app", 3, 0))
    group = meta.acquire_lease(1, "broker-b", 60_000)
    other = meta.acquire_lease(2, "broker-b", 60_000)
    assert group is not None and other is not None

    def commit(txn_id: int, offset: int) -> TxnCommit:
        return TxnCommit(
            txn_id, "app", 3, 0, [CommitPart(stream, 0, 0)], b"", 1_700 + txn_id, 1,
            positions=[PositionCommit(stream, "billing", 0, {0: offset})],
        )  # fmt: skip

    meta.add_hold(11, stream, "billing", lease=group)
    meta.add_hold(12, stream, "billing", lease=group)
    with pytest.raises(InvalidArgument):
        meta.add_hold(11, stream, "billing", lease=group)
    if kit.durable:
        meta = kit.reopen()
    stored = commit(7, 12)
    meta.commit_txn(stored, holds=[11])  # a live hold: stored, the hold consumed
    assert only(meta, stream).positions == {0: 12, 1: 0}
    assert meta.remove_holds([11]) == []  # after the commit: gone, the record is stored

    # a hold the group let go of (expired): the late record stores nothing
    assert meta.remove_holds([12, 99]) == [12]
    for late, holds in ((commit(8, 5), [12]), (commit(9, 5), [13])):  # 13: never recorded
        with pytest.raises(TransactionAborted) as caught:
            meta.commit_txn(late, holds=holds)
        assert caught.value.details == {"txn_id": late.txn_id, "hold_id": holds[0]}
    assert meta.pending_commits() == [stored]
    assert meta.identities()[0].last_txn_id == 7
    assert only(meta, stream).positions == {0: 12, 1: 0}

    # a broker adopting container 1's groups removes their holds (not container 2's)
    meta.add_hold(15, stream, "billing", lease=group)
    meta.add_hold(14, stream, "billing", lease=group)
    meta.add_hold(16, stream, "billing", lease=other)
    assert meta.remove_holds_of(1) == [14, 15]
    assert meta.remove_holds_of(1) == []
    with pytest.raises(TransactionAborted):
        meta.commit_txn(commit(10, 20), holds=[16, 14])  # one of them gone: nothing stored
    assert meta.pending_commits() == [stored]
    meta.commit_txn(commit(11, 30), holds=[16])
    assert only(meta, stream).positions == {0: 30, 1: 0}
    assert meta.remove_holds([16]) == []


def test_a_hold_is_recorded_only_under_its_containers_current_lease(kit: Kit) -> None:
    meta = kit.meta
    stream = create(meta, "s/a")
    meta.create_subscription(subscription(stream))
    old = meta.acquire_lease(1, "broker-a", 0)
    assert old is not None
    new = meta.acquire_lease(1, "broker-b", 60_000)
    assert new is not None
    with pytest.raises(LeaseLost):  # a coordinator that lost the group holds nothing
        meta.add_hold(1, stream, "billing", lease=old)
    assert meta.remove_holds([1]) == []
    meta.add_hold(1, stream, "billing", lease=new)
    assert meta.remove_holds([1]) == [1]


def test_subscriptions_survive_a_reopen(durable_kit: Kit) -> None:
    meta = durable_kit.meta
    stream = create(meta, "s/a")
    meta.create_subscription(subscription(stream))
    meta.commit_positions(stream, "billing", 0, {0: 9})
    meta = durable_kit.reopen()
    assert only(meta, stream).positions == {0: 9, 1: 0}


# --- elastic streams: segments of every epoch, scale events, scaling policies ------------------
#
# A scale event seals open segments at their end offsets, opens successors and stores its record
# in one transaction; the epoch must follow the stream's current one; a stream's history goes
# with it when it is deleted.

HALF = 2**63
QUARTER = 2**62


def successor(
    number: int, epoch: int, lo: int, hi: int, predecessors: list[int], container: int = 0
) -> SegmentRecord:
    return SegmentRecord(number, epoch, lo, hi, container, predecessors=predecessors)


def split_first(epoch: int = 1) -> list[SegmentRecord]:
    """Segment 0 (keys 0 .. 2**63 - 1) of a two-segment stream split into 2 and 3."""
    return [successor(2, epoch, 0, QUARTER - 1, [0]), successor(3, epoch, QUARTER, HALF - 1, [0])]


def stream_of(meta: MetaStore, stream_id: int) -> StreamRecord:
    (record,) = [s for s in meta.streams() if s.id == stream_id]
    return record


def test_every_new_field_round_trips(kit: Kit) -> None:
    meta = kit.meta
    records = [
        SegmentRecord(0, 0, 0, HALF - 1, 0, sealed=True, end_offset=70, producers=b"p"),
        SegmentRecord(1, 1, HALF, MAX_KEY, 1, predecessors=[0], start_offset=3),
    ]
    created = meta.create_stream("s/new", records, None, None, 5, scaling="fixed 2")
    assert created.scaling == "fixed 2"
    assert stream_of(meta, created.id) == created
    assert stream_of(meta, created.id).segments == records
    stream_id = create(meta, "s/elastic", 2)
    assert stream_of(meta, stream_id).scaling == "", "no policy: fixed at the created count"
    assert [(s.predecessors, s.end_offset) for s in stream_of(meta, stream_id).segments] == [
        ([], -1),
        ([], -1),
    ]
    policy = "events 5000/s factor 2 min 1 max 64"
    updated = meta.update_scaling(stream_id, policy)
    assert updated.scaling == policy and updated.segments == stream_of(meta, stream_id).segments
    decision = b'{"action": "split", "rule": "hot_10s"}'
    after = meta.scale_stream(stream_id, 1, 9_000, {0: 1234}, split_first(), decision)
    if kit.durable:
        meta = kit.reopen()
    stored = stream_of(meta, stream_id)
    assert stored == after
    assert stored.scaling == policy
    assert stored.segments == [
        SegmentRecord(0, 0, 0, HALF - 1, 0, sealed=True, end_offset=1234),
        SegmentRecord(1, 0, HALF, MAX_KEY, 1),
        *split_first(),
    ]
    assert meta.scalings(stream_id) == [
        ScaleRecord(stream_id, 1, 9_000, {0: 1234}, [2, 3], decision)
    ]
    assert meta.scalings() == meta.scalings(stream_id)
    assert stream_of(meta, created.id) == created, "another stream is not touched"


def test_scale_events_make_a_history_in_epoch_order(kit: Kit) -> None:
    meta = kit.meta
    stream_id = create(meta, "s/h", 2)
    other = create(meta, "s/other", 1)
    meta.scale_stream(stream_id, 1, 100, {0: 10}, split_first(), b"split")
    merged = successor(4, 2, QUARTER, MAX_KEY, [1, 3])  # 3 and 1 are neighbours
    meta.scale_stream(stream_id, 2, 200, {3: 5, 1: 40}, [merged], b"merge")
    meta.scale_stream(
        other,
        1,
        150,
        {0: 0},
        [successor(1, 1, 0, HALF - 1, [0]), successor(2, 1, HALF, MAX_KEY, [0])],
    )
    history = meta.scalings(stream_id)
    assert [(r.epoch, r.at_ms, r.sealed, r.created, r.decision) for r in history] == [
        (1, 100, {0: 10}, [2, 3], b"split"),
        (2, 200, {1: 40, 3: 5}, [4], b"merge"),
    ]
    assert [(r.stream_id, r.epoch) for r in meta.scalings()] == [
        (stream_id, 1),
        (stream_id, 2),
        (other, 1),
    ]
    segments = {s.number: s for s in stream_of(meta, stream_id).segments}
    assert sorted(segments) == [0, 1, 2, 3, 4], "segments of every epoch"
    assert {n for n, s in segments.items() if s.sealed} == {0, 1, 3}
    assert [segments[n].end_offset for n in (0, 1, 2, 3, 4)] == [10, 40, -1, 5, -1]
    assert segments[4] == merged


def test_reopen_keeps_the_scaling_history(durable_kit: Kit) -> None:
    meta = durable_kit.meta
    stream_id = create(meta, "s/h", 2)
    meta.update_scaling(stream_id, "bytes 2097152/s factor 2 min 1")
    meta.scale_stream(stream_id, 1, 100, {0: 10}, split_first(), b"one")
    streams, history = meta.streams(), meta.scalings()
    meta = durable_kit.reopen()
    assert meta.streams() == streams
    assert meta.scalings() == history
    # the epoch goes on from where it was: 1 is taken, 2 follows
    with pytest.raises(InvalidArgument) as caught:
        meta.scale_stream(stream_id, 1, 200, {2: 3}, [successor(4, 1, 0, QUARTER - 1, [2])])
    assert caught.value.details["epoch"] == 1
    meta.scale_stream(stream_id, 2, 200, {2: 3, 3: 4}, [successor(4, 2, 0, HALF - 1, [2, 3])])
    assert [r.epoch for r in meta.scalings(stream_id)] == [1, 2]


# Scale events refused on a stream in epoch 1 whose segment 1 was split into 2 and 3 (open: 0, 2,
# 3). Segments are sealed in number order, so all but the epoch conflicts are refused after
# segment 0 is sealed: a seal written outside the scale event's transaction would show.
REFUSED = [
    pytest.param(
        InvalidArgument, 1, {0: 8},
        [successor(4, 1, 0, QUARTER - 1, [0]), successor(5, 1, QUARTER, HALF - 1, [0])],
        id="epoch-taken",
    ),
    pytest.param(
        InvalidArgument, 3, {0: 8},
        [successor(4, 3, 0, QUARTER - 1, [0]), successor(5, 3, QUARTER, HALF - 1, [0])],
        id="epoch-ahead",
    ),
    pytest.param(
        InvalidArgument, 2, {0: 8, 1: 5}, [successor(4, 2, 0, MAX_KEY, [0, 1])], id="sealed-again"
    ),
    pytest.param(
        SegmentNotFound, 2, {0: 8, 9: 0}, [successor(4, 2, 0, HALF - 1, [0, 9])], id="no-segment"
    ),
    pytest.param(
        InvalidArgument, 2, {0: 8},
        [successor(4, 2, 0, QUARTER - 1, [0]), successor(3, 2, QUARTER, HALF - 1, [0])],
        id="number-taken",
    ),
    pytest.param(
        InvalidArgument, 2, {0: 8},
        [successor(4, 2, 0, QUARTER - 1, [0]), successor(4, 2, QUARTER, HALF - 1, [0])],
        id="number-twice",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("error", "epoch", "sealed", "created"), REFUSED)
def test_a_refused_scale_event_changes_nothing(
    kit: Kit,
    error: type[Exception],
    epoch: int,
    sealed: dict[int, int],
    created: list[SegmentRecord],
) -> None:
    meta = kit.meta
    stream_id = create(meta, "s/atomic", 2)
    split = [
        successor(2, 1, HALF, HALF + QUARTER - 1, [1]),
        successor(3, 1, HALF + QUARTER, MAX_KEY, [1]),
    ]
    meta.scale_stream(stream_id, 1, 100, {1: 10}, split, b"first")
    before, history = meta.streams(), meta.scalings()
    with pytest.raises(error):
        meta.scale_stream(stream_id, epoch, 200, sealed, created, b"refused")
    if kit.durable:
        meta = kit.reopen()
    assert meta.streams() == before, "no segment sealed, no successor added"
    assert meta.scalings() == history, "no scale record"
    # the store is usable, and the stream still in epoch 1
    merged = successor(4, 2, 0, HALF + QUARTER - 1, [0, 2])
    meta.scale_stream(stream_id, 2, 300, {0: 8, 2: 2}, [merged])
    assert [r.epoch for r in meta.scalings(stream_id)] == [1, 2]


def test_scale_events_that_cannot_be_are_refused_before_the_catalog(meta: MetaStore) -> None:
    stream_id = create(meta, "s/bad", 2)
    before = meta.streams()
    one = [successor(2, 1, 0, HALF - 1, [0])]
    bad: list[tuple[dict[int, int], list[SegmentRecord]]] = [
        ({}, one),  # nothing sealed
        ({0: 5}, []),  # nothing created
        ({0: -1}, one),  # no end offset
        ({0: 5}, [successor(2, 2, 0, HALF - 1, [0])]),  # another epoch
        ({0: 5}, [msgspec.structs.replace(one[0], sealed=True)]),
        ({0: 5}, [msgspec.structs.replace(one[0], end_offset=7)]),
        ({0: 5}, [successor(2, 1, 0, HALF - 1, [])]),  # no predecessor
        ({0: 5}, [successor(2, 1, 0, HALF - 1, [1])]),  # a predecessor not sealed here
    ]
    for sealed, created in bad:
        with pytest.raises(InvalidArgument):
            meta.scale_stream(stream_id, 1, 1, sealed, created)
    assert meta.streams() == before
    assert meta.scalings() == []


def test_scaling_a_deleted_or_unknown_stream_is_stream_not_found(meta: MetaStore) -> None:
    stream_id = create(meta, "s/gone", 2)
    meta.delete_stream("s/gone")
    with pytest.raises(StreamNotFound):
        meta.scale_stream(stream_id, 1, 1, {0: 5}, split_first())
    with pytest.raises(StreamNotFound):
        meta.update_scaling(stream_id, "fixed 3")
    with pytest.raises(StreamNotFound):
        meta.update_scaling(stream_id + 100, "fixed 3")
    assert meta.streams() == [] and meta.scalings() == []


def test_a_recreated_streams_history_is_its_own(kit: Kit) -> None:
    meta = kit.meta
    old = create(meta, "s/re", 2)
    meta.update_scaling(old, "fixed 3")
    meta.scale_stream(old, 1, 100, {0: 10}, split_first(), b"old")
    record, _ = meta.delete_stream("s/re")
    assert len(record.segments) == 4, "the deleted stream's segments of every epoch"
    assert meta.scalings(old) == [] and meta.scalings() == [], "deleted with the stream"
    new = create(meta, "s/re", 2)
    if kit.durable:
        meta = kit.reopen()
    fresh = stream_of(meta, new)
    assert fresh.scaling == ""
    assert [(s.number, s.epoch, s.sealed, s.end_offset) for s in fresh.segments] == [
        (0, 0, False, -1),
        (1, 0, False, -1),
    ]
    assert meta.scalings(new) == []
    meta.scale_stream(new, 1, 200, {0: 3}, split_first(), b"new")  # epoch 1 again: its own
    assert meta.scalings() == [ScaleRecord(new, 1, 200, {0: 3}, [2, 3], b"new")]
    with pytest.raises(StreamNotFound):
        meta.scale_stream(old, 2, 300, {1: 1}, [successor(4, 2, HALF, MAX_KEY, [1])])


def test_chunks_and_retention_work_on_sealed_segments(kit: Kit) -> None:
    meta = kit.meta
    stream_id = create(meta, "s/sealed", 2)
    ours = [chunk(stream_id, 0, base) for base in (0, 10)]
    meta.add_chunks(0, 0, ours[:1])
    meta.scale_stream(stream_id, 1, 100, {0: 20}, split_first())
    # the journal's last data of a segment moves to chunks after the seal
    meta.add_chunks(0, 1, [ours[1], chunk(stream_id, 2, 0)])
    assert meta.chunk_at(stream_id, 0, 15) == ours[1]
    assert meta.chunk_at_time(stream_id, 0, 2005) == ours[1]
    light = [msgspec.structs.replace(c, index=b"", producers=b"") for c in ours]
    assert meta.chunks_from(stream_id, 0, 0, 10) == light
    assert [(c.segment, c.count) for c in meta.segment_chunks()] == [(0, 2), (2, 1)]
    removed = meta.remove_chunks_before(stream_id, {0: 10, 2: 10})
    assert [(c.segment, c.base_offset) for c in removed] == [(0, 0), (2, 0)]
    if kit.durable:
        meta = kit.reopen()
    segments = {s.number: s for s in stream_of(meta, stream_id).segments}
    assert (segments[0].sealed, segments[0].start_offset, segments[0].end_offset) == (True, 10, 20)
    assert (segments[2].sealed, segments[2].start_offset) == (False, 10)
    # retention to the sealed end leaves the segment empty, still sealed, still in the graph
    assert meta.remove_chunks_before(stream_id, {0: 20}) == [light[1]]
    segments = {s.number: s for s in stream_of(meta, stream_id).segments}
    assert (segments[0].sealed, segments[0].start_offset, segments[0].end_offset) == (True, 20, 20)
    assert meta.chunk_at(stream_id, 0, 15) is None
    assert [r.sealed for r in meta.scalings(stream_id)] == [{0: 20}]


def test_the_stored_history_rebuilds_the_segment_graph(kit: Kit) -> None:
    # What the broker will do: plan scale events on the segment graph, store each with
    # scale_stream, and after a restart rebuild the same graph from streams() and scalings().
    graph = SegmentGraph.create(2, at_ms=1_000)
    meta = kit.meta
    initial = [
        SegmentRecord(n.number, 0, n.key_range.lo, n.key_range.hi, n.number) for n in graph.nodes
    ]
    stream_id = meta.create_stream("s/graph", initial, None, None, 1_000).id
    for step, plan in enumerate(
        [
            lambda g: g.split(0, 3, 2_000),
            lambda g: g.merge([4, 1], 3_000),
            lambda g: g.split(5, 2, 4_000),
            lambda g: g.merge([2, 3], 5_000),
        ]
    ):
        event = plan(graph)
        created = [
            SegmentRecord(
                n.number, n.opened_epoch, n.key_range.lo, n.key_range.hi, n.number % 3,
                predecessors=list(n.predecessors),
            )
            for n in event.created
        ]  # fmt: skip
        sealed = {number: 100 * step + number for number in event.sealed}
        meta.scale_stream(stream_id, event.epoch, event.at_ms, sealed, created, b"{}")
        graph = graph.apply(event)
    if kit.durable:
        meta = kit.reopen()

    stream = stream_of(meta, stream_id)
    history = meta.scalings(stream_id)
    by_number = {s.number: s for s in stream.segments}
    later = {n for r in history for n in r.created}
    first = sorted((s for s in stream.segments if s.number not in later), key=lambda s: s.key_lo)
    events = [
        ScaleEvent(
            r.epoch,
            r.at_ms,
            tuple(sorted(r.sealed)),
            tuple(
                SegmentNode(
                    n,
                    KeyRange(by_number[n].key_lo, by_number[n].key_hi),
                    r.epoch,
                    tuple(by_number[n].predecessors),
                    opened_ms=r.at_ms,
                )
                for n in r.created
            ),
        )
        for r in history
    ]
    rebuilt = SegmentGraph.from_history(
        [KeyRange(s.key_lo, s.key_hi) for s in first], events, stream.created_ms
    )
    assert rebuilt.epoch == graph.epoch == 4
    assert rebuilt.nodes == graph.nodes
    assert {n.number for n in graph.nodes if n.sealed} == {
        s.number for s in stream.segments if s.sealed
    }
    assert all(s.end_offset >= 0 for s in stream.segments if s.sealed)


_KILLED_MID_SCALE = """
import os, signal, sys
from slipstream.storage import SegmentRecord, SqliteMetaStore
from slipstream.storage._meta_pg import PostgresMetaStore

class Killed(PostgresMetaStore if sys.argv[1] == "postgres" else SqliteMetaStore):
    def _insert_segments(self, cur, stream_id, segments):
        if any(s.predecessors for s in segments):  # a scale event's successors: die now
            os.kill(os.getpid(), signal.SIGKILL)
        super()._insert_segments(cur, stream_id, segments)

meta = Killed(sys.argv[2])
half = 2**63
successors = [SegmentRecord(2, 1, 0, half // 2 - 1, 0, predecessors=[0, 1]),
              SegmentRecord(3, 1, half // 2, 2**64 - 1, 0, predecessors=[0, 1])]
meta.scale_stream(int(sys.argv[3]), 1, 5, {0: 10, 1: 20}, successors, b"lost")
"""


def test_a_scale_event_killed_after_its_seals_leaves_the_catalog_as_it_was(
    durable_kit: Kit,
) -> None:
    # kill -9 after the seals are written, before the successors: none of it survives
    meta = durable_kit.meta
    stream_id = create(meta, "s/killed", 2)
    before = meta.streams()
    meta.close()
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _KILLED_MID_SCALE,
            durable_kit.kind,
            durable_kit.where,
            str(stream_id),
        ],
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()
    meta = durable_kit.meta = durable_kit.open()
    assert meta.streams() == before
    assert meta.scalings() == []
    meta.scale_stream(stream_id, 1, 6, {0: 10}, split_first())  # epoch 1 is still free
    assert [s.number for s in stream_of(meta, stream_id).segments if s.sealed] == [0]


# The catalog as the schema before elastic streams wrote it (no scaling, predecessors,
# end_offset, no scalings table).
_OLD_SCHEMA = """
CREATE TABLE streams (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL UNIQUE,
    retention_ms INTEGER,
    retention_bytes INTEGER,
    created_ms INTEGER NOT NULL
);
CREATE TABLE segments (
    stream_id INTEGER NOT NULL,
    number INTEGER NOT NULL,
    epoch INTEGER NOT NULL,
    key_lo INTEGER NOT NULL,
    key_hi INTEGER NOT NULL,
    container INTEGER NOT NULL,
    sealed INTEGER NOT NULL DEFAULT 0,
    start_offset INTEGER NOT NULL DEFAULT 0,
    producers BLOB NOT NULL DEFAULT x'',
    PRIMARY KEY (stream_id, number)
);
CREATE TABLE chunks (
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
    PRIMARY KEY (stream_id, segment, base_offset)
);
CREATE INDEX chunks_by_time ON chunks (stream_id, segment, max_timestamp_so_far, base_offset);
CREATE TABLE containers (id INTEGER PRIMARY KEY, moved_file INTEGER NOT NULL);
CREATE TABLE counters (name TEXT PRIMARY KEY, next INTEGER NOT NULL);
CREATE TABLE identities (
    transactional_id TEXT PRIMARY KEY,
    producer_id INTEGER NOT NULL,
    epoch INTEGER NOT NULL,
    last_txn_id INTEGER NOT NULL DEFAULT -1,
    last_metadata BLOB NOT NULL DEFAULT x'',
    committed_ms INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE subscriptions (
    stream_id INTEGER NOT NULL,
    name TEXT NOT NULL,
    record BLOB NOT NULL,
    PRIMARY KEY (stream_id, name)
);
CREATE TABLE txn_commits (txn_id INTEGER PRIMARY KEY, record BLOB NOT NULL);
"""


def test_a_catalog_from_before_elastic_streams_opens_with_everything(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    stored = chunk(1, 0, 0)
    with sqlite3.connect(path) as db:
        db.executescript(_OLD_SCHEMA)
        db.execute("INSERT INTO streams VALUES (1, 's/old', 60000, NULL, 1700)")
        db.executemany(
            "INSERT INTO segments VALUES (1, ?, 0, ?, ?, ?, 0, ?, ?)",
            [(0, -HALF, -1, 0, 10, b"dedup"), (1, 0, HALF - 1, 1, 0, b"")],
        )
        db.execute(
            "INSERT INTO chunks VALUES (1, 0, 0, 10, 150, 1000, 2000, ?, ?, x'', 2000)",
            (stored.name, stored.index),
        )
        db.execute("INSERT INTO containers VALUES (0, 4)")
        db.execute("INSERT INTO counters VALUES ('producer_id', 17)")
        db.execute("INSERT INTO identities VALUES ('app', 3, 1, 9, x'7b7d', 1700)")
        db.execute(
            "INSERT INTO subscriptions VALUES (1, 'billing', ?)",
            (msgspec.msgpack.encode(subscription(1)),),
        )
    db.close()
    meta = SqliteMetaStore(path)
    try:
        (stream,) = meta.streams()
        assert (stream.id, stream.name, stream.retention_ms, stream.created_ms) == (
            1,
            "s/old",
            60000,
            1700,
        )
        assert stream.scaling == ""
        assert stream.segments == [
            SegmentRecord(0, 0, 0, HALF - 1, 0, start_offset=10, producers=b"dedup"),
            SegmentRecord(1, 0, HALF, MAX_KEY, 1),
        ]
        assert meta.chunks() == [stored]
        assert meta.chunk_at_time(1, 0, 1500) == stored
        assert meta.moved_file(0) == 4
        assert meta.reserve_ids("producer_id", 1) == 17
        assert meta.identities() == [Identity("app", 3, 1, 9, b"{}", 1700)]
        assert meta.subscriptions() == [subscription(1)]
        assert meta.scalings() == []
        # and it scales like a new one, keeping it over a reopen
        meta.update_scaling(1, "fixed 3")
        meta.scale_stream(1, 1, 100, {0: 10}, split_first(), b"d")
        meta.close()
        meta = SqliteMetaStore(path)
        (stream,) = meta.streams()
        assert stream.scaling == "fixed 3"
        assert [(s.number, s.sealed, s.end_offset) for s in stream.segments] == [
            (0, True, 10),
            (1, False, -1),
            (2, False, -1),
            (3, False, -1),
        ]
        assert [r.created for r in meta.scalings(1)] == [[2, 3]]
    finally:
        meta.close()


def test_names_and_keys_are_listed_in_the_order_of_their_bytes(meta: MetaStore) -> None:
    # whatever the database's locale: "B" before "a", "a-b" before "ab"
    names = ["s/B", "s/a", "s/a-b", "s/ab"]
    for name in reversed(names):
        create(meta, name)
        meta.save_identity(Identity(name, 1, 0))
        meta.put_setting("rules", name, b"")
    assert [s.name for s in meta.streams()] == names
    assert [i.transactional_id for i in meta.identities()] == names
    assert list(meta.settings("rules")) == names
    stream = meta.streams()[0].id
    for name in reversed(names):
        meta.create_subscription(subscription(stream, name))
    assert [r.name for r in meta.subscriptions(stream)] == names


def test_settings_round_trip_by_kind_in_key_order(meta: MetaStore) -> None:
    assert meta.settings("rules") == {}
    meta.put_setting("rules", "b", b"\x00two")
    meta.put_setting("rules", "a", b"one")
    meta.put_setting("quotas", "a", b"other kind")
    assert list(meta.settings("rules").items()) == [("a", b"one"), ("b", b"\x00two")]
    assert meta.settings("quotas") == {"a": b"other kind"}


def test_put_setting_replaces_and_delete_says_whether_there_was_one(meta: MetaStore) -> None:
    meta.put_setting("rules", "a", b"one")
    meta.put_setting("rules", "a", b"two")
    assert meta.settings("rules") == {"a": b"two"}
    assert meta.delete_setting("rules", "a") is True
    assert meta.delete_setting("rules", "a") is False
    assert meta.settings("rules") == {}


def test_settings_survive_a_reopen(durable_kit: Kit) -> None:
    durable_kit.meta.put_setting("revoked", "t1", b"123")
    assert durable_kit.reopen().settings("revoked") == {"t1": b"123"}


# --- leases and fencing (docs/operations.md, "Leases and fencing") ---------------------------


def test_a_free_container_is_leased_and_refused_to_another_owner(kit: Kit) -> None:
    meta = kit.meta
    assert meta.leases() == []
    lease = meta.acquire_lease(0, "broker-a", 60_000)
    assert lease is not None
    assert (lease.container, lease.owner, lease.epoch) == (0, "broker-a", 1)
    assert meta.acquire_lease(0, "broker-b", 60_000) is None
    assert meta.acquire_lease(1, "broker-b", 60_000) is not None  # leases are per container
    assert [(x.container, x.owner, x.epoch) for x in meta.leases()] == [
        (0, "broker-a", 1),
        (1, "broker-b", 1),
    ]
    if kit.durable:
        assert kit.reopen().leases()[0] == lease


def test_every_grant_starts_a_new_holding_the_same_owners_too(meta: MetaStore) -> None:
    first = meta.acquire_lease(0, "broker-a", 60_000)
    again = meta.acquire_lease(0, "broker-a", 60_000)  # a restarted broker with the same id
    assert first is not None and again is not None
    assert again.epoch == first.epoch + 1
    with pytest.raises(LeaseLost):
        meta.renew_lease(first, 60_000)
    assert meta.renew_lease(again, 60_000).epoch == again.epoch


def test_an_expired_lease_is_taken_over_with_the_next_epoch(meta: MetaStore) -> None:
    old = meta.acquire_lease(0, "broker-a", 0)  # expires at once on the catalog's clock
    assert old is not None
    new = meta.acquire_lease(0, "broker-b", 60_000)
    assert new is not None
    assert (new.owner, new.epoch) == ("broker-b", old.epoch + 1)
    with pytest.raises(LeaseLost) as lost:
        meta.renew_lease(old, 60_000)
    assert lost.value.details == {"container": 0, "epoch": old.epoch}
    assert "broker-b" in lost.value.message
    assert meta.leases() == [new]  # the failed renewal changed nothing


def test_renewing_an_expired_lease_is_lease_lost_even_if_nobody_took_it(meta: MetaStore) -> None:
    lease = meta.acquire_lease(0, "broker-a", 0)
    assert lease is not None
    with pytest.raises(LeaseLost, match="expired"):
        meta.renew_lease(lease, 60_000)
    renewed = meta.renew_lease(held := meta.acquire_lease(0, "broker-a", 60_000) or lease, 1000)
    assert (renewed.epoch, renewed.owner) == (held.epoch, "broker-a")


def test_take_over_grants_a_held_lease_and_release_frees_it(meta: MetaStore) -> None:
    held = meta.acquire_lease(0, "broker-a", 60_000)
    taken = meta.acquire_lease(0, "broker-b", 60_000, take_over=True)
    assert held is not None and taken is not None and taken.epoch == held.epoch + 1
    meta.release_lease(held)  # no longer held: left alone
    assert meta.leases() == [taken]
    meta.release_lease(taken)
    assert meta.leases()[0].expires_ms == 0
    after = meta.acquire_lease(0, "broker-c", 60_000)
    assert after is not None and after.epoch == taken.epoch + 1
    with pytest.raises(InvalidArgument):
        meta.acquire_lease(0, "broker-c", -1)


def test_a_write_fenced_by_an_old_epoch_is_refused_and_changes_nothing(kit: Kit) -> None:
    meta = kit.meta
    stream = create(meta, "s/fenced")
    old = meta.acquire_lease(0, "broker-a", 0)
    assert old is not None
    meta.add_chunks(0, 3, [chunk(stream, 0, 0)], lease=old)  # current, if expired: written
    new = meta.acquire_lease(0, "broker-b", 60_000)
    assert new is not None
    before = (meta.chunks(), meta.moved_file(0), meta.streams())
    with pytest.raises(LeaseLost):
        meta.add_chunks(0, 4, [chunk(stream, 0, 10)], lease=old)
    with pytest.raises(LeaseLost):  # a container never leased is no one's to write
        meta.add_chunks(5, 0, [chunk(stream, 1, 0)], lease=Lease(5, "broker-a", 1, 0))
    assert (meta.chunks(), meta.moved_file(0), meta.streams()) == before
    meta.add_chunks(0, 4, [chunk(stream, 0, 10)], lease=new)
    assert meta.moved_file(0) == 4
    if kit.durable:
        assert kit.reopen().moved_file(0) == 4


def test_owners_racing_for_a_free_lease_exactly_one_wins(kit: Kit) -> None:
    """Threads on one store (PostgreSQL: a connection each, from the pool) race for each of
    20 free containers; every container goes to exactly one of them, at epoch 1."""
    meta = kit.meta
    owners = [f"broker-{n}" for n in range(4)]
    won: dict[int, list[str]] = {c: [] for c in range(20)}
    for container in range(20):
        barrier = threading.Barrier(len(owners))

        def race(
            owner: str, container: int = container, barrier: threading.Barrier = barrier
        ) -> None:
            barrier.wait()
            if meta.acquire_lease(container, owner, 60_000) is not None:
                won[container].append(owner)

        threads = [threading.Thread(target=race, args=(owner,)) for owner in owners]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert all(len(winners) == 1 for winners in won.values()), won
    assert [(x.container, x.owner, x.epoch) for x in meta.leases()] == [
        (c, won[c][0], 1) for c in range(20)
    ]


def test_journal_object_writes_fenced_by_an_old_epoch_are_refused(kit: Kit) -> None:
    meta = kit.meta
    old = meta.acquire_lease(0, "broker-a", 0)
    assert old is not None
    kept = JournalObject(1, 0, 10, "journal/0/0000000000000001/0000000000000000")
    meta.add_journal_object(0, kept, lease=old)
    new = meta.acquire_lease(0, "broker-b", 60_000)
    assert new is not None
    with pytest.raises(LeaseLost):
        meta.add_journal_object(0, JournalObject(1, 10, 5, "journal/0/late"), lease=old)
    with pytest.raises(LeaseLost):
        meta.remove_journal_objects(0, [1], lease=old)
    assert meta.journal_objects(0) == [kept]
    meta.remove_journal_objects(0, [1], lease=new)
    assert meta.journal_objects(0) == []


# --- cluster membership, the catalog's version, shared secrets (issue 20) --------------------


def test_members_register_by_id_renew_keeping_their_start_and_leave(kit: Kit) -> None:
    meta = kit.meta
    assert meta.members() == []
    b2 = meta.register_member("b2", "127.0.0.1:7072", "127.0.0.1:8082", 60_000)
    b1 = meta.register_member("b1", "127.0.0.1:7071", "127.0.0.1:8081", 60_000)
    assert (b1.broker_id, b1.address, b1.http_address) == ("b1", "127.0.0.1:7071", "127.0.0.1:8081")
    assert b1.expires_ms >= b1.started_ms + 60_000
    assert meta.members() == [b1, b2]  # by broker id
    time.sleep(0.01)  # the catalog's clock moves on
    renewed = meta.register_member("b1", "127.0.0.1:9071", "127.0.0.1:9081", 60_000)
    assert renewed.started_ms == b1.started_ms  # still the same run of the broker
    assert renewed.expires_ms > b1.expires_ms
    assert (renewed.address, renewed.http_address) == ("127.0.0.1:9071", "127.0.0.1:9081")
    assert meta.members() == [renewed, b2]
    if kit.durable:
        assert kit.reopen().members() == [renewed, b2]
        meta = kit.meta
    meta.remove_member("b2")
    meta.remove_member("b9")  # never registered: nothing happens
    assert meta.members() == [renewed]
    with pytest.raises(InvalidArgument, match="ttl"):
        meta.register_member("b3", "a:1", "a:2", -1)
    assert meta.members() == [renewed]


def test_an_expired_member_is_gone_and_comes_back_as_a_new_start(meta: MetaStore) -> None:
    gone = meta.register_member("b1", "a:1", "a:2", 0)  # expired at once on the catalog's clock
    assert meta.members() == []
    short = meta.register_member("b2", "b:1", "b:2", 1)
    kept = meta.register_member("b3", "c:1", "c:2", 60_000)
    time.sleep(0.05)
    assert meta.members() == [kept]
    back = meta.register_member("b1", "a:1", "a:2", 60_000)
    assert back.started_ms > gone.started_ms  # a lapsed registration starts again
    assert [m.broker_id for m in meta.members()] == ["b1", "b3"]
    again = meta.register_member("b2", "b:1", "b:2", 60_000)
    assert again.started_ms > short.started_ms


def version_after(meta: MetaStore, change: Callable[[], object]) -> int:
    """How much ``change`` moved the catalog's version."""
    before = meta.catalog_version()
    change()
    return meta.catalog_version() - before


def test_the_catalog_version_grows_with_every_change_of_streams_subscriptions_settings(
    kit: Kit,
) -> None:
    meta = kit.meta
    assert meta.catalog_version() >= 0
    stream = create(meta, "s/a")
    successors = split_first()
    changes: list[tuple[str, Callable[[], object]]] = [
        ("create stream", lambda: create(meta, "s/b")),
        ("retention", lambda: meta.update_retention(stream, 60_000, None)),
        ("scaling policy", lambda: meta.update_scaling(stream, "events 5000/s factor 2 min 1")),
        ("scale", lambda: meta.scale_stream(stream, 1, 1_800, {0: 40}, successors)),
        ("create subscription", lambda: meta.create_subscription(subscription(stream))),
        ("reset subscription", lambda: meta.reset_subscription(stream, "billing", {1: 3})),
        ("delete subscription", lambda: meta.delete_subscription(stream, "billing")),
        ("put setting", lambda: meta.put_setting("quota", "alice", b"1")),
        ("replace setting", lambda: meta.put_setting("quota", "alice", b"2")),
        ("delete setting", lambda: meta.delete_setting("quota", "alice")),
        ("delete stream", lambda: meta.delete_stream("s/b")),
    ]
    for what, change in changes:
        assert version_after(meta, change) > 0, what
    if kit.durable:
        version = meta.catalog_version()
        assert kit.reopen().catalog_version() == version


def test_the_catalog_version_stays_for_chunks_positions_leases_and_refused_changes(
    kit: Kit,
) -> None:
    meta = kit.meta
    stream = create(meta, "s/a")
    meta.create_subscription(subscription(stream))
    meta.save_identity(Identity("app", 3, 0))
    lease = meta.acquire_lease(0, "broker-a", 60_000)
    assert lease is not None
    commit = TxnCommit(
        7, "app", 3, 0, [CommitPart(stream, 0, 0)], b"", 1_700, 1,
        positions=[PositionCommit(stream, "billing", 0, {0: 12})],
    )  # fmt: skip
    kept: list[tuple[str, Callable[[], object]]] = [
        ("chunks", lambda: meta.add_chunks(0, 1, [chunk(stream, 0, 0)], lease=lease)),
        ("retention's removals", lambda: meta.remove_chunks_before(stream, {0: 10})),
        ("journal object", lambda: meta.add_journal_object(0, JournalObject(1, 0, 5, "j/1"))),
        ("journal objects removed", lambda: meta.remove_journal_objects(0, [1])),
        ("positions", lambda: meta.commit_positions(stream, "billing", 0, {1: 4})),
        ("transaction", lambda: meta.commit_txn(commit)),
        ("transaction applied", lambda: meta.finish_txn(7)),
        ("identity", lambda: meta.save_identity(Identity("app", 3, 1))),
        ("ids", lambda: meta.reserve_ids("producers", 10)),
        ("lease", lambda: meta.acquire_lease(1, "broker-a", 60_000)),
        ("renewal", lambda: meta.renew_lease(lease, 60_000)),
        ("release", lambda: meta.release_lease(lease)),
        ("member", lambda: meta.register_member("b1", "a:1", "a:2", 60_000)),
        ("member removed", lambda: meta.remove_member("b1")),
        ("secret", lambda: meta.shared_secret("tokens", lambda: b"k" * 32)),
        ("no such setting", lambda: meta.delete_setting("quota", "nobody")),
    ]
    for what, change in kept:
        assert version_after(meta, change) == 0, what
    for what, refused in [
        ("stream exists", lambda: create(meta, "s/a")),
        ("subscription exists", lambda: meta.create_subscription(subscription(stream))),
        ("no subscription", lambda: meta.delete_subscription(stream, "nobody")),
        ("stale scale", lambda: meta.scale_stream(stream, 5, 1_800, {0: 40}, split_first(5))),
    ]:
        before = meta.catalog_version()
        with pytest.raises(
            (StreamExists, SubscriptionExists, SubscriptionNotFound, InvalidArgument)
        ):
            refused()
        assert meta.catalog_version() == before, what


def test_a_shared_secret_is_made_once_and_kept_apart_from_settings(kit: Kit) -> None:
    meta = kit.meta
    made: list[bytes] = []

    def make(value: bytes) -> Callable[[], bytes]:
        return lambda: made.append(value) or value

    assert meta.shared_secret("claims", make(b"first")) == b"first"
    assert meta.shared_secret("claims", make(b"second")) == b"first"
    assert made == [b"first"], "make is not called once the secret exists"
    assert meta.shared_secret("tokens", make(b"other")) == b"other"  # per name
    assert meta.settings("claims") == {} and meta.settings("tokens") == {}
    assert meta.settings("secret") == {} and meta.settings("shared_secrets") == {}
    if kit.durable:
        meta = kit.reopen()
        assert meta.shared_secret("claims", make(b"third")) == b"first"
        assert made == [b"first", b"other"]


def test_brokers_racing_to_make_a_shared_secret_all_get_the_first_writers(kit: Kit) -> None:
    """Threads on one store (PostgreSQL: a connection each) that all find no secret make
    their own at once (a barrier inside ``make``); every one gets the same stored bytes."""
    meta = kit.meta
    racers = 4
    for round_ in range(10):
        barrier = threading.Barrier(racers)
        got: list[bytes] = []

        def race(
            n: int,
            barrier: threading.Barrier = barrier,
            got: list[bytes] = got,
            name: str = f"s{round_}",
        ) -> None:
            def make() -> bytes:
                # every racer has looked and found nothing before any stores (a store that
                # called make under its own lock would break the barrier: no race then)
                with contextlib.suppress(threading.BrokenBarrierError):
                    barrier.wait(timeout=5)
                return bytes([n]) * 16

            got.append(meta.shared_secret(name, make))

        threads = [threading.Thread(target=race, args=(n,)) for n in range(racers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(got) == racers
        assert len(set(got)) == 1, got
        assert meta.shared_secret(f"s{round_}", lambda: b"late") == got[0]


# --- scaling across brokers: the txn-vs-scale interlock, fences and prepares (h21) ---------


def merge_both(epoch: int = 1) -> list[SegmentRecord]:
    """Segments 0 and 1 of a two-segment stream merged into 2."""
    return [successor(2, epoch, 0, MAX_KEY, [0, 1])]


def test_a_commit_naming_a_sealed_segment_is_aborted_and_stores_nothing(kit: Kit) -> None:
    """A transaction coordinated by one broker staged into a segment another broker sealed
    meanwhile: its commit record would put batches past the sealed end, so it is refused."""
    meta = kit.meta
    stream_id = create(meta, "s/txn-sealed", 2)
    meta.save_identity(Identity("app-1", 7, 0))
    meta.scale_stream(stream_id, 1, 100, {0: 5, 1: 6}, merge_both())
    late = TxnCommit(1, "app-1", 7, 0, [CommitPart(stream_id, 2, 0), CommitPart(stream_id, 1, 0)],
                     b"late", 1_700, 2)  # fmt: skip
    with pytest.raises(TransactionAborted) as caught:
        meta.commit_txn(late)
    assert caught.value.details["segment"] == 1
    assert meta.pending_commits() == []
    assert meta.identities()[0].last_txn_id == -1, "nothing of the commit was stored"
    fine = TxnCommit(2, "app-1", 7, 0, [CommitPart(stream_id, 2, 0)], b"fine", 1_800, 1)
    meta.commit_txn(fine)
    assert meta.pending_commits() == [fine]


def test_a_scale_refuses_segments_a_pending_commit_names_until_it_is_applied(kit: Kit) -> None:
    meta = kit.meta
    stream_id = create(meta, "s/txn-pending", 2)
    other = create(meta, "s/other", 2)
    meta.save_identity(Identity("app-1", 7, 0))
    pending = TxnCommit(5, "app-1", 7, 0, [CommitPart(other, 0, 0), CommitPart(stream_id, 1, 3)],
                        b"", 1_700, 2)  # fmt: skip
    meta.commit_txn(pending)
    before, history = meta.streams(), meta.scalings()
    with pytest.raises(InvalidArgument) as caught:
        meta.scale_stream(stream_id, 1, 100, {0: 5, 1: 6}, merge_both())
    assert caught.value.details["pending_txn"] == 5
    if kit.durable:
        meta = kit.reopen()
    assert meta.streams() == before, "nothing sealed, no successor"
    assert meta.scalings() == history
    # a part naming another stream's segment 0 does not hold up this stream's segment 0
    split = [successor(2, 1, 0, QUARTER - 1, [0]), successor(3, 1, QUARTER, HALF - 1, [0])]
    meta.scale_stream(stream_id, 1, 100, {0: 5}, split)
    meta.finish_txn(5)  # applied: now segment 1 may be sealed
    meta.scale_stream(stream_id, 2, 200, {1: 9}, [successor(4, 2, HALF, MAX_KEY, [1])])
    assert meta.scalings(stream_id)[-1].sealed == {1: 9}


def test_a_scale_fenced_by_leases_and_a_deadline_stores_nothing_once_either_is_gone(
    kit: Kit,
) -> None:
    meta = kit.meta
    stream_id = create(meta, "s/fenced", 2)
    old = meta.acquire_lease(1, "broker-b", 60_000)
    mine = meta.acquire_lease(0, "broker-a", 60_000)
    assert old is not None and mine is not None
    meta.release_lease(old)
    new = meta.acquire_lease(1, "broker-c", 60_000)  # container 1 moved meanwhile
    assert new is not None
    before = meta.streams()
    with pytest.raises(LeaseLost):
        meta.scale_stream(stream_id, 1, 100, {0: 5, 1: 6}, merge_both(), leases=[mine, old])
    with pytest.raises(InvalidArgument) as caught:
        meta.scale_stream(stream_id, 1, 100, {0: 5, 1: 6}, merge_both(),
                          leases=[mine, new], deadline_ms=meta.clock_ms() - 1)  # fmt: skip
    assert "deadline_ms" in caught.value.details
    assert meta.streams() == before and meta.scalings() == []
    meta.scale_stream(stream_id, 1, 100, {0: 5, 1: 6}, merge_both(),
                      leases=[mine, new], deadline_ms=meta.clock_ms() + 60_000)  # fmt: skip
    assert meta.scalings(stream_id)[0].sealed == {0: 5, 1: 6}


def test_settling_a_prepare_waits_for_its_deadline_then_fences_the_merge(kit: Kit) -> None:
    """A broker that prepared segments for a merge whose coordinator went silent asks the
    catalog, once the deadline passed: sealed there -> their ends; not -> {} and no scale with
    that deadline can seal them from then on."""
    meta = kit.meta
    stream_id = create(meta, "s/settle", 2)
    deadline = meta.clock_ms() + 300
    with pytest.raises(InvalidArgument) as caught:
        meta.settle_seal(stream_id, [1], deadline)
    assert caught.value.details["deadline_ms"] == deadline
    while meta.clock_ms() < deadline:
        time.sleep(0.05)
    assert meta.settle_seal(stream_id, [1], deadline) == {}
    with pytest.raises(InvalidArgument):
        meta.scale_stream(stream_id, 1, 100, {0: 5, 1: 6}, merge_both(), deadline_ms=deadline)
    assert meta.scalings() == []
    later = meta.clock_ms() + 60_000
    meta.scale_stream(stream_id, 1, 100, {0: 5, 1: 6}, merge_both(), deadline_ms=later)
    assert meta.settle_seal(stream_id, [1], 0) == {1: 6}
    with pytest.raises(StreamNotFound):
        meta.settle_seal(stream_id + 100, [1], 0)


def race(*calls: Callable[[], object]) -> list[BaseException | None]:
    """Run ``calls`` on threads started together: each one's refusal, or None if it landed."""
    outcomes: list[BaseException | None] = [None] * len(calls)
    start = threading.Barrier(len(calls))

    def run(index: int) -> None:
        start.wait()
        try:
            calls[index]()
        except (TransactionAborted, InvalidArgument) as exc:
            outcomes[index] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


def test_a_commit_and_a_scale_racing_for_one_segment_never_both_land(kit: Kit) -> None:
    """Either the commit record is stored (and the scale refused while it is pending) or the
    segment is sealed (and the commit refused): never a sealed segment with a pending commit."""
    meta = kit.meta
    meta.save_identity(Identity("app-1", 7, 0))
    for round_ in range(12):
        stream_id = create(meta, f"s/race-{round_}", 2)
        commit = TxnCommit(100 + round_, "app-1", 7, 0, [CommitPart(stream_id, 1, 0)], b"",
                           1_700, 1)  # fmt: skip
        outcomes = race(
            functools.partial(meta.commit_txn, commit),
            functools.partial(meta.scale_stream, stream_id, 1, 1, {0: 1, 1: 1}, merge_both()),
        )
        assert outcomes.count(None) == 1, outcomes
        (stream,) = [s for s in meta.streams() if s.id == stream_id]
        sealed = any(s.sealed for s in stream.segments)
        pending = any(c.txn_id == commit.txn_id for c in meta.pending_commits())
        assert sealed != pending
        if pending:
            meta.finish_txn(commit.txn_id)

"""ObjectJournal beyond the shared contract (tests/storage/test_journal_conformance.py runs that
on SeaweedFS): what a crash between an upload and its record leaves (an orphan, never
recovered, deleted by ``delete_orphans``), the object store failing during a sync and coming
back, and the object layout that docs/format.md describes."""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import crc32c
import pytest
from objectstores import SeaweedFS

from slipstream import CorruptData, LeaseLost, StorageError
from slipstream.broker._container import Container, ContainerConfig
from slipstream.broker._controller import Controller
from slipstream.format import (
    binary_array,
    decode_header,
    encode_body,
    encode_header,
    make_record_batch,
    timestamp_array,
    verify,
)
from slipstream.storage import JournalObject, LongTermStore, MetaStore, SqliteMetaStore, chunk_name
from slipstream.storage._chunks import ChunkSweep, parse_chunk_name, writer_tag
from slipstream.storage._journal import Buffer
from slipstream.storage._journal_objects import ObjectJournal, journal_prefix, object_name
from slipstream.storage._objects import ObjectChunkStore


class Crash(Exception):
    """The process 'dies' here: nothing after the fault point runs."""


def crash_at(point: str) -> object:
    def fault(op: str) -> None:
        if op == point:
            raise Crash(op)

    return fault


@pytest.fixture
def meta(tmp_path: Path) -> Iterator[MetaStore]:
    store = SqliteMetaStore(tmp_path / "meta.db")
    yield store
    store.close()


def entries_of(journal: ObjectJournal) -> list[bytes]:
    return [bytes(payload) for _, payload in journal.recover()]


def test_objects_are_named_by_container_file_and_position_with_file_journal_framing(
    seaweedfs: SeaweedFS, meta: MetaStore
) -> None:
    bucket = seaweedfs.create_bucket()
    journal = ObjectJournal(seaweedfs.store(f"s3://{bucket}/p"), meta, 7)
    assert entries_of(journal) == []
    journal.append([[b"one"], [b"two", b"!"]])
    journal.sync()
    journal.append([[b"three"]])
    journal.sync()
    first, second = object_name(7, 0, 0), object_name(7, 0, 8 + 3 + 8 + 4)
    assert first == "journal/7/0000000000000000/0000000000000000"
    assert seaweedfs.objects(bucket) == [f"p/{first}", f"p/{second}"]
    body = seaweedfs.client().get_object(Bucket=bucket, Key=f"p/{first}")["Body"].read()

    def framed(payload: bytes) -> bytes:
        return (
            len(payload).to_bytes(4, "little")
            + crc32c.crc32c(payload).to_bytes(4, "little")
            + payload
        )

    assert body == framed(b"one") + framed(b"two!")
    assert [(r.file_id, r.start, r.size) for r in meta.journal_objects(7)] == [
        (0, 0, len(body)),
        (0, len(body), 13),
    ]


def test_a_crash_between_upload_and_record_leaves_an_orphan_that_is_never_recovered(
    seaweedfs: SeaweedFS, meta: MetaStore
) -> None:
    bucket = seaweedfs.create_bucket()
    store = seaweedfs.store(f"s3://{bucket}/p")
    journal = ObjectJournal(store, meta, 0, fault=crash_at("record"))
    entries_of(journal)
    journal.append([[b"acknowledged"]])
    journal._fault = None
    journal.sync()
    journal._fault = crash_at("record")
    journal.append([[b"uploaded, never recorded"]])
    with pytest.raises(Crash):
        journal.sync()
    # the "process" is gone; a new one starts on the same bucket and catalog
    orphan = f"p/{object_name(0, 0, 8 + len(b'acknowledged'))}"
    assert orphan in seaweedfs.objects(bucket), "the upload happened"
    restarted = ObjectJournal(store, meta, 0)
    assert entries_of(restarted) == [b"acknowledged"], "recovery reads the catalog, not the bucket"
    # another container's objects are not this journal's business
    other = ObjectJournal(store, meta, 1)
    entries_of(other)
    other.append([[b"container 1"]])
    other.sync()
    assert restarted.delete_orphans() == [orphan.removeprefix("p/")]
    assert seaweedfs.objects(bucket, "p/journal/0/") == [f"p/{object_name(0, 0, 0)}"]
    assert len(seaweedfs.objects(bucket, "p/journal/1/")) == 1
    assert restarted.delete_orphans() == []
    # appends go on past the orphan's position: its name is never written again
    restarted.append([[b"after restart"]])
    restarted.sync()
    assert entries_of(ObjectJournal(store, meta, 0)) == [b"acknowledged", b"after restart"]


def test_moved_files_lose_their_records_and_the_sweep_deletes_their_objects(
    seaweedfs: SeaweedFS, meta: MetaStore
) -> None:
    bucket = seaweedfs.create_bucket()
    store = seaweedfs.store(f"s3://{bucket}/p")
    journal = ObjectJournal(store, meta, 0)
    entries_of(journal)
    for group in range(3):
        journal.append([[b"g%d" % group]])
        journal.sync()
        journal.roll()
    assert journal.sealed_files() == [0, 1, 2]
    journal.delete_file(0)
    assert {r.file_id for r in meta.journal_objects(0)} == {1, 2, 3}
    # the objects go in the next sweep, off the journal thread
    assert len(seaweedfs.objects(bucket, f"p/{journal_prefix(0)}")) == 3
    assert journal.delete_orphans() == [object_name(0, 0, 0)]
    assert len(seaweedfs.objects(bucket, f"p/{journal_prefix(0)}")) == 2
    # a restart told file 1 is moved (its chunks committed) forgets it and deletes it unread
    restarted = ObjectJournal(store, meta, 0)
    assert [bytes(p) for _, p in restarted.recover(moved_through=1)] == [b"g2"]
    assert restarted.sealed_files() == [2]
    assert restarted.delete_orphans() == [object_name(0, 1, 0)]
    assert len(seaweedfs.objects(bucket, f"p/{journal_prefix(0)}")) == 1
    assert {r.file_id for r in meta.journal_objects(0)} == {2, 3}


class Proxy:
    """A TCP proxy on loopback in front of the object store that can be cut (``down``: open
    connections reset, new ones refused) and restored."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.up = True
        self.open: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.up:
                client.close()
                continue
            upstream = socket.create_connection(self.target)
            with self.lock:
                self.open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        for s in (a, b):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def down(self) -> None:
        self.up = False
        with self.lock:
            for s in self.open:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            self.open.clear()

    def close(self) -> None:
        self.down()
        self.listener.close()


def test_the_store_failing_during_a_sync_fails_that_sync_and_the_next_one_works(
    seaweedfs: SeaweedFS, meta: MetaStore
) -> None:
    bucket = seaweedfs.create_bucket()
    host, port = seaweedfs.endpoint.removeprefix("http://").split(":")
    proxy = Proxy((host, int(port)))
    try:
        store = ObjectChunkStore(
            f"s3://{bucket}/p",
            endpoint=f"http://127.0.0.1:{proxy.port}",
            access_key_id="slipstream-test",
            secret_access_key="slipstream-test-secret",
            cache_bytes=0,
            max_retries=1,
            timeout=2.0,
            connect_timeout=0.5,
        )
        journal = ObjectJournal(store, meta, 0)
        entries_of(journal)
        (before,) = journal.append([[b"before"]])
        journal.sync()
        proxy.down()
        journal.append([[b"while down"]])
        with pytest.raises(StorageError):
            journal.sync()
        journal.discard_unsynced()
        assert meta.journal_objects(0) == [meta.journal_objects(0)[0]], "nothing recorded"
        proxy.up = True
        (after,) = journal.append([[b"after"]])
        journal.sync()
        assert journal.read(before) == b"before" and journal.read(after) == b"after"
        assert entries_of(ObjectJournal(store, meta, 0)) == [b"before", b"after"]
    finally:
        proxy.close()


def test_recovery_reads_many_objects_in_order(seaweedfs: SeaweedFS, meta: MetaStore) -> None:
    # more objects than GETs in flight (FETCH_AHEAD), over two files
    store = seaweedfs.store(f"s3://{seaweedfs.create_bucket()}/p")
    journal = ObjectJournal(store, meta, 0, cache_bytes=0)
    entries_of(journal)
    written = []
    for group in range(30):
        items = [b"g%02d-%d" % (group, i) for i in range(group % 3 + 1)]
        written += zip(journal.append([[p] for p in items]), items, strict=True)
        journal.sync()
        if group == 12:
            journal.roll()
    recovered = [(a, bytes(p)) for a, p in ObjectJournal(store, meta, 0).recover()]
    assert recovered == written
    assert [bytes(p) for _, p in journal.entries(0)] == [p for a, p in written if a.file_id == 0]


def test_a_damaged_object_loses_only_its_own_entries_and_reads_of_them_fail(
    seaweedfs: SeaweedFS, meta: MetaStore
) -> None:
    bucket = seaweedfs.create_bucket()
    store = seaweedfs.store(f"s3://{bucket}/p")
    journal = ObjectJournal(store, meta, 0, cache_bytes=0)
    entries_of(journal)
    groups = [[b"first", b"second"], [b"third", b"fourth"], [b"fifth"]]
    addresses = []
    for group in groups:
        addresses.append(journal.append([[p] for p in group]))
        journal.sync()
    key = f"p/{object_name(0, 0, addresses[1][0].position - 8)}"
    body = bytearray(seaweedfs.client().get_object(Bucket=bucket, Key=key)["Body"].read())
    body[-1] ^= 0x01  # the last byte of "fourth"
    seaweedfs.client().put_object(Bucket=bucket, Key=key, Body=bytes(body))
    restarted = ObjectJournal(store, meta, 0, cache_bytes=0)
    assert entries_of(restarted) == [b"first", b"second", b"third", b"fifth"]
    (damage,) = restarted.report.damaged
    assert (damage.start, damage.end) == (
        addresses[1][1].position - 8,
        addresses[2][0].position - 8,
    )
    assert restarted.read(addresses[1][0]) == b"third"
    with pytest.raises(CorruptData):
        restarted.read(addresses[1][1])


def test_a_roll_whose_marker_record_failed_is_retried_without_a_duplicate(
    seaweedfs: SeaweedFS, tmp_path: Path
) -> None:
    # the record commits but its caller sees an error (a lost commit acknowledgement)
    class LostAck(SqliteMetaStore):
        fail_next = False

        def add_journal_object(self, container: int, record: JournalObject, **kw: Any) -> None:
            super().add_journal_object(container, record, **kw)
            if self.fail_next:
                self.fail_next = False
                raise StorageError("the commit's answer was lost")

    meta = LostAck(tmp_path / "lost.db")
    try:
        store = seaweedfs.store(f"s3://{seaweedfs.create_bucket()}/p")
        journal = ObjectJournal(store, meta, 0)
        entries_of(journal)
        journal.append([[b"sealed"]])
        journal.sync()
        meta.fail_next = True
        with pytest.raises(StorageError):
            journal.roll()
        assert journal.roll() == 0, "the retry seals the file"
        assert journal.sealed_files() == [0]
        assert [r.file_id for r in meta.journal_objects(0)] == [0, 1]
    finally:
        meta.close()


# --- chunks of one journal file moved by two holdings of its container ------------------------


class GatedUploads(LongTermStore):
    """A store that holds every chunk upload (with ``journal``: every journal object upload
    once ``hold`` is set) until ``open`` is set: a broker paused between choosing a name and
    uploading, as SIGSTOP would."""

    def __init__(self, store: LongTermStore, *, journal: bool = False) -> None:
        self.store = store
        self.journal = journal
        self.hold = threading.Event()
        self.waiting = threading.Event()
        self.open = threading.Event()

    def write_chunk(self, name: str, buffers: Sequence[Buffer]) -> None:
        if self.journal:
            held = name.startswith("journal/") and self.hold.is_set()
        else:
            held = parse_chunk_name(name) is not None
        if held:
            self.waiting.set()
            assert self.open.wait(30), "the test never let the upload go"
        self.store.write_chunk(name, buffers)

    def read_chunk(self, name: str, start: int = 0, length: int | None = None) -> Buffer:
        return self.store.read_chunk(name, start, length)

    def delete_chunk(self, name: str) -> None:
        self.store.delete_chunk(name)

    def list_chunks(self, prefix: str = "") -> list[str]:
        return self.store.list_chunks(prefix)

    def list_chunk_times(self, prefix: str = "") -> list[tuple[str, float]]:
        return self.store.list_chunk_times(prefix)


class Holder:
    """One broker's holding of container 0: a controller, the container over an ObjectJournal
    on the shared bucket and catalog, and the lease it holds."""

    def __init__(self, store: LongTermStore, meta: MetaStore, owner: str) -> None:
        lease = meta.acquire_lease(0, owner, 60_000, take_over=True)
        assert lease is not None
        self.lease = lease
        self.journal = ObjectJournal(store, meta, 0)
        self.pool = ThreadPoolExecutor(2, thread_name_prefix=f"reader-{owner}")
        self.container = Container(
            0, self.journal, store, meta, self.pool, ContainerConfig(roll_ms=600_000)
        )
        self.container.hold(lease, math.inf)
        self.controller = Controller(meta, store, [self.container], self.pool)
        self.controller.recover()
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self.container.run())

    async def read_all(self, stream: str) -> list[bytes]:
        segment = self.controller.stream(stream).segment(0)
        out: list[bytes] = []
        offset = 0
        while batches := await self.container.read(segment, offset, 1 << 20):
            out += [bytes(b) for b in batches]
            offset = decode_header(batches[-1]).next_offset
        return out

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        await self.container.close()
        self.controller.close()
        self.pool.shutdown(wait=True)


def one_batch(tag: str) -> bytearray:
    body = encode_body(
        make_record_batch(
            binary_array([tag.encode()]), binary_array([tag.encode() * 50]), timestamp_array([1])
        )
    )
    header = encode_header(body, event_count=1, min_timestamp=1, max_timestamp=1)
    return bytearray(header + body.to_pybytes())


def test_a_holder_paused_past_its_lease_uploads_under_its_own_names_and_records_nothing(
    seaweedfs: SeaweedFS, pg_dsn: str
) -> None:
    """The old holder (epoch 1) planned the move of journal file 0 and paused before its
    upload; the new holder (epoch 2) recovered the container and moved the same file. The
    old one's upload, when it resumes, lands under another name (its epoch, a random part):
    the chunk the catalog records keeps its bytes, and the stray upload is an orphan that the
    sweep deletes."""
    from slipstream.storage._meta_pg import PostgresMetaStore

    bucket = seaweedfs.create_bucket()
    url = f"s3://{bucket}/p"
    meta_old, meta_new = PostgresMetaStore(pg_dsn), PostgresMetaStore(pg_dsn)
    gated = GatedUploads(seaweedfs.store(url))

    async def body() -> None:
        old = Holder(gated, meta_old, "old")
        await old.controller.create_stream("t/moved", 1, None, None)
        old.start()
        segment = old.controller.stream("t/moved").segment(0)
        for tag in ("a", "b", "c"):
            batch = one_batch(tag)
            await old.container.append(segment, batch, verify(batch))
        expected = await old.read_all("t/moved")
        loop = asyncio.get_running_loop()
        sealed = await loop.run_in_executor(old.container._io, old.journal.roll)
        assert sealed == 0
        moving = asyncio.create_task(old.container._move_file(sealed))
        await loop.run_in_executor(None, gated.waiting.wait, 30)  # paused before its upload

        new = Holder(seaweedfs.store(url), meta_new, "new")
        assert new.lease.epoch == old.lease.epoch + 1
        await new.container._move_file(0)  # (its move loop not started: this is its only move)
        (record,) = meta_new.chunks()
        assert record.name.startswith(chunk_name(record.stream_id, 0, 0, f"{new.lease.epoch}-"))
        recorded = bytes(gated.store.read_chunk(record.name))

        gated.open.set()  # the old holder resumes: uploads, then its commit is fenced
        with pytest.raises(LeaseLost):
            await moving
        names = gated.store.list_chunks(f"{record.stream_id}/0/")
        assert len(names) == 2, "the old holder's upload did not overwrite the recorded chunk"
        (stray,) = [n for n in names if n != record.name]
        assert stray.startswith(chunk_name(record.stream_id, 0, 0, f"{old.lease.epoch}-"))
        assert bytes(gated.store.read_chunk(record.name)) == recorded
        assert meta_old.chunks() == [record]
        assert await new.read_all("t/moved") == expected

        sweep = ChunkSweep(gated.store, meta_new, grace_s=600)
        assert sweep.sweep(now=time.time() + 10**6) == [stray]
        assert await new.read_all("t/moved") == expected
        await old.close()
        await new.close()

    try:
        asyncio.run(body())
    finally:
        meta_old.close()
        meta_new.close()


def test_a_move_slower_than_the_commit_window_records_nothing_and_retries_under_new_names(
    seaweedfs: SeaweedFS, meta: MetaStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A move whose uploads took longer than MOVE_COMMIT_WINDOW_S gives up before its commit
    (the sweep may already take such uploads for orphans); the retry uploads afresh."""
    import slipstream.broker._container as container_module

    store = seaweedfs.store(f"s3://{seaweedfs.create_bucket()}/p")

    async def body() -> None:
        holder = Holder(store, meta, "slow")
        await holder.controller.create_stream("t/slow", 1, None, None)
        holder.start()
        segment = holder.controller.stream("t/slow").segment(0)
        batch = one_batch("a")
        await holder.container.append(segment, batch, verify(batch))
        expected = await holder.read_all("t/slow")
        loop = asyncio.get_running_loop()
        sealed = await loop.run_in_executor(holder.container._io, holder.journal.roll)
        assert sealed is not None
        monkeypatch.setattr(container_module, "MOVE_COMMIT_WINDOW_S", -1.0)  # always too slow
        with pytest.raises(StorageError, match="retried under new names"):
            await holder.container._move_file(sealed)
        assert meta.chunks() == []
        assert holder.journal.sealed_files() == [sealed]
        (first,) = store.list_chunks("1/")
        monkeypatch.undo()
        await holder.container._move_file(sealed)
        (record,) = meta.chunks()
        assert record.name != first
        assert ChunkSweep(store, meta, grace_s=600).sweep(now=time.time() + 10**6) == [first]
        assert await holder.read_all("t/slow") == expected
        await holder.close()

    asyncio.run(body())


def test_the_retention_pass_sweeps_only_on_the_broker_serving_container_0(
    seaweedfs: SeaweedFS, meta: MetaStore
) -> None:
    """In a cluster one broker sweeps (the one serving container 0), not every broker."""
    store = seaweedfs.store(f"s3://{seaweedfs.create_bucket()}/p")
    orphan = chunk_name(9, 0, 0, writer_tag(1))
    store.write_chunk(orphan, [b"left by a failed delete"])

    async def body() -> None:
        holder = Holder(store, meta, "b1")
        holder.controller.chunk_sweep = ChunkSweep(store, meta, grace_s=0.0)
        holder.container.serving = False  # container 0 is another broker's
        await holder.controller.enforce_retention()
        assert store.list_chunks() == [orphan]
        holder.container.serving = True
        await holder.controller.enforce_retention()
        assert store.list_chunks() == []
        assert holder.controller.chunk_sweep.swept == 1
        await holder.close()

    asyncio.run(body())


def test_a_holder_paused_before_its_upload_cannot_overwrite_the_new_holder_s_journal_object(
    seaweedfs: SeaweedFS, pg_dsn: str
) -> None:
    """The old holder (epoch 1) chose its next object's name and paused before the PUT; the new
    holder (epoch 2) recovered the journal, and its next object starts at the same position of
    the same file. The old holder's PUT, when it resumes, must not land on the object the new
    one recorded (an acknowledged append would read back as the old holder's bytes)."""
    from slipstream.storage._meta_pg import PostgresMetaStore

    url = f"s3://{seaweedfs.create_bucket()}/p"
    meta_old, meta_new = PostgresMetaStore(pg_dsn), PostgresMetaStore(pg_dsn)
    try:
        gated = GatedUploads(seaweedfs.store(url), journal=True)
        old = ObjectJournal(gated, meta_old, 0)
        old.lease = meta_old.acquire_lease(0, "old", 60_000)
        entries_of(old)
        old.append([[b"acknowledged by old"]])
        old.sync()
        gated.hold.set()
        old.append([[b"never acknowledged"]])
        syncing = ThreadPoolExecutor(1).submit(old.sync)
        assert gated.waiting.wait(30)  # paused before its PUT

        new = ObjectJournal(seaweedfs.store(url), meta_new, 0)
        new.lease = meta_new.acquire_lease(0, "new", 60_000, take_over=True)
        assert entries_of(new) == [b"acknowledged by old"]
        new.append([[b"acknowledged by new"]])
        new.sync()

        gated.open.set()  # the old holder resumes: its PUT, then its record is fenced
        with pytest.raises(LeaseLost):
            syncing.result(30)
        again = ObjectJournal(seaweedfs.store(url), meta_new, 0)
        assert entries_of(again) == [b"acknowledged by old", b"acknowledged by new"]
        # the old holder's upload is an orphan of the journal's own sweep
        again.lease = new.lease
        assert len(again.delete_orphans()) == 1
        assert entries_of(ObjectJournal(seaweedfs.store(url), meta_new, 0)) == [
            b"acknowledged by old",
            b"acknowledged by new",
        ]
    finally:
        meta_old.close()
        meta_new.close()

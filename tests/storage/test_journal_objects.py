"""ObjectJournal beyond the shared contract (tests/storage/test_journal_conformance.py runs that
on SeaweedFS): what a crash between an upload and its record leaves (an orphan, never
recovered, deleted by ``delete_orphans``), the object store failing during a sync and coming
back, and the object layout that docs/format.md describes."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import crc32c
import pytest
from objectstores import SeaweedFS

from slipstream import CorruptData, StorageError
from slipstream.storage import JournalObject, MetaStore, SqliteMetaStore
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

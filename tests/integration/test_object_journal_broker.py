"""A broker whose journals are in object storage (``slipstream up --objects s3://... --journal
objects``) on a real SeaweedFS: idempotent producers under load, kill -9, restart: every
acknowledged event is there once, in order; the mover compacts journal objects into chunks and
deletes them; a crash between a group's upload and its record leaves an orphan that the
restarted broker deletes and never serves."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from checker import check_history, produce_and_record
from conftest import BrokerProcess
from objectstores import ACCESS_KEY, SECRET_KEY, SeaweedFS

import slipstream
from slipstream import WrongBroker

STREAM = "oj/orders"


def object_journal_broker(
    broker_factory: type[BrokerProcess], seaweedfs: SeaweedFS, bucket: str, *extra: str
) -> BrokerProcess:
    broker = broker_factory(
        *("--objects", f"s3://{bucket}/c", "--s3-endpoint", seaweedfs.endpoint),
        *("--journal", "objects", "--containers", "2"),
        *extra,
    )
    broker.env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    return broker


def wait_for(condition: object, what: str, bound: int = 600) -> None:
    for _ in range(bound):  # a bound, not a timing
        if condition():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError(f"never: {what}")


@pytest.mark.parametrize("catalog", ["sqlite", "postgres"])
def test_acknowledged_events_survive_kill_9_and_journal_objects_become_chunks(
    broker_factory: type[BrokerProcess],
    seaweedfs: SeaweedFS,
    request: pytest.FixtureRequest,
    catalog: str,
) -> None:
    bucket = seaweedfs.create_bucket()
    meta = ("--meta", request.getfixturevalue("pg_dsn")) if catalog == "postgres" else ()
    broker = object_journal_broker(
        broker_factory, seaweedfs, bucket, "--roll", "256KiB", "--roll-seconds", "0.5", *meta
    )
    broker.start(timeout=60)
    with broker.client() as client:
        client.create_stream(STREAM, segments=3)
    acknowledged: dict[bytes, slipstream.Position] = {}
    lock = threading.Lock()
    for life in range(2):
        stop = threading.Event()
        threads = [
            threading.Thread(
                target=produce_and_record,
                args=(broker.address, STREAM, life * 100 + p, acknowledged, lock, stop),
                kwargs={"keys": 5, "per_round": 50, "pause": 0.001},
            )
            for p in range(3)
        ]
        for thread in threads:
            thread.start()
        time.sleep(2.0)
        broker.kill()
        stop.set()
        for thread in threads:
            thread.join(20)
        broker.start(timeout=60)
    assert len(acknowledged) > 500, "the load was too light to mean anything"
    assert not (broker.data_dir / "journal").exists(), "no container journal on local disk"
    with broker.client() as client:
        events = list(client.reader(STREAM, start="earliest", end=client.tail(STREAM)))
    problems = check_history(acknowledged, events)
    assert not problems, "\n".join(problems[:20])

    # idle now: rolls seal the active files, the mover moves them and deletes their objects
    def journal_objects() -> list[str]:
        return seaweedfs.objects(bucket, "c/journal/")

    wait_for(lambda: not journal_objects(), "every journal object moved and deleted")
    chunks = [k for k in seaweedfs.objects(bucket, "c/") if not k.startswith("c/journal/")]
    segments = {tuple(k.split("/")[1:3]) for k in chunks}  # (stream id, segment)
    streams = {stream for stream, _ in segments}
    assert any(len([s for s in segments if s[0] == i]) == 3 for i in streams), "3 segments"
    broker.stop()
    broker.start(timeout=60)
    with broker.client() as client:
        again = list(client.reader(STREAM, start="earliest", end=client.tail(STREAM)))
    assert sorted((e.segment, e.offset, e.value) for e in again) == sorted(
        (e.segment, e.offset, e.value) for e in events
    ), "the same events, now from chunks"


def test_a_crash_between_upload_and_record_leaves_an_orphan_the_restart_deletes(
    broker_factory: type[BrokerProcess], seaweedfs: SeaweedFS
) -> None:
    bucket = seaweedfs.create_bucket()
    broker = object_journal_broker(broker_factory, seaweedfs, bucket, "--containers", "1")
    broker.start(timeout=60)
    with broker.client() as client:
        client.create_stream(STREAM, segments=1)
        with client.producer(STREAM) as producer:
            producer.send(b"acknowledged")
    broker.stop()
    # one object per group: the stream's audit record and the event, in one group or two
    recorded = seaweedfs.objects(bucket, "c/journal/")
    assert recorded
    broker.env["SLIPSTREAM_FAULT"] = "journal.before_record"
    broker.start(timeout=60)
    client = slipstream.connect(broker.address, reconnect_timeout=0.5)
    try:
        with pytest.raises(slipstream.SlipstreamError):
            producer = client.producer(STREAM)
            producer.send(b"never acknowledged").result(timeout=30)
    finally:
        client.close()
    assert broker.proc is not None and broker.proc.wait(30) == -9
    orphans = sorted(set(seaweedfs.objects(bucket, "c/journal/")) - set(recorded))
    assert len(orphans) == 1, "the group's object was uploaded, its record never made"
    del broker.env["SLIPSTREAM_FAULT"]
    broker.start(timeout=60)
    wait_for(lambda: orphans[0] not in seaweedfs.objects(bucket, "c/journal/"), "orphan deleted")
    with broker.client() as client:
        values = [e.value for e in client.reader(STREAM, end=client.tail(STREAM))]
    assert values == [b"acknowledged"]
    assert "deleted 1 unrecorded journal objects" in broker.log()


@pytest.fixture
def own_seaweedfs(tmp_path: Path) -> Iterator[SeaweedFS]:
    server = SeaweedFS(tmp_path / "seaweedfs")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_the_store_down_fails_the_group_unacknowledged_and_the_next_group_works(
    broker_factory: type[BrokerProcess], own_seaweedfs: SeaweedFS
) -> None:
    server = own_seaweedfs
    bucket = server.create_bucket()
    broker = object_journal_broker(broker_factory, server, bucket, "--containers", "1")
    broker.start(timeout=60)

    def send(value: bytes) -> slipstream.Position:
        with broker.client() as client, client.producer(STREAM) as producer:
            return producer.send(value).result(timeout=60)

    with broker.client() as client:
        client.create_stream(STREAM, segments=1)
    send(b"before")
    server.stop()
    with pytest.raises(slipstream.StorageError):
        send(b"while the store is down")
    assert "appends failed, none acknowledged" in broker.log()
    server.start()
    send(b"after")

    def values() -> list[bytes]:
        with broker.client() as client:
            return [e.value for e in client.reader(STREAM, end=client.tail(STREAM))]

    assert values() == [b"before", b"after"]
    broker.kill()
    broker.start(timeout=60)
    assert values() == [b"before", b"after"], "after kill -9: the same, from the bucket"


def test_a_broker_with_a_new_data_directory_rebuilds_everything_from_the_bucket_and_postgres(
    broker_factory: type[BrokerProcess], seaweedfs: SeaweedFS, pg_dsn: str
) -> None:
    # --meta and --journal objects: nothing acknowledged lives only on the first broker's disk
    bucket = seaweedfs.create_bucket()
    first = object_journal_broker(
        broker_factory, seaweedfs, bucket, "--meta", pg_dsn, "--containers", "1"
    )
    first.start(timeout=60)
    with first.client() as client:
        client.create_stream(STREAM, segments=2)
        with client.producer(STREAM) as producer:
            receipts = [producer.send(b"%04d" % i, key=b"k%d" % (i % 3)) for i in range(300)]
            acknowledged = [r.result(timeout=60) for r in receipts]
    first.kill()
    second = object_journal_broker(
        broker_factory, seaweedfs, bucket, "--meta", pg_dsn, "--containers", "1"
    )
    second.start(timeout=60)  # a cluster member: it serves the container once the lease expires
    assert second.data_dir != first.data_dir
    for _ in range(120):  # the killed broker's lease expires (a bound, not a timing)
        try:
            with second.client() as client:
                events = list(client.reader(STREAM, end=client.tail(STREAM)))
            break
        except WrongBroker:
            time.sleep(0.5)
    assert sorted(e.value for e in events) == [b"%04d" % i for i in range(300)]
    assert len(acknowledged) == 300
    for k in range(3):
        mine = [e.value for e in events if e.key == b"k%d" % k]
        assert mine == [b"%04d" % i for i in range(k, 300, 3)], "per-key order"


def test_a_journal_kind_that_would_hide_acknowledged_appends_is_refused_at_start(
    broker_factory: type[BrokerProcess], seaweedfs: SeaweedFS
) -> None:
    with pytest.raises(RuntimeError, match="needs --objects"):
        broker_factory("--journal", "objects").start()
    bucket = seaweedfs.create_bucket()
    objects = ("--objects", f"s3://{bucket}/c", "--s3-endpoint", seaweedfs.endpoint)
    files = broker_factory(*objects)
    files.env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    files.start(timeout=60)
    with files.client() as client:
        client.create_stream(STREAM, segments=1)
        with client.producer(STREAM) as producer:
            producer.send(b"in a journal file")
    files.stop()
    # the same data directory with object journals would not see the journal file's append
    switched = broker_factory(*objects, "--journal", "objects", data_dir=files.data_dir)
    switched.env.update(files.env)
    with pytest.raises(RuntimeError, match=r"holds journal files.*--journal files"):
        switched.start(timeout=60)
    files.start(timeout=60)
    with files.client() as client:
        assert [e.value for e in client.reader(STREAM, end=client.tail(STREAM))] == [
            b"in a journal file"
        ]

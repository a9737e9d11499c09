"""A broker with its chunks in an S3-compatible store (``slipstream up --objects s3://...``) on
a real SeaweedFS: journal files moved by the mover become objects in the bucket and nothing in
the data directory's chunks/, and a broker restarted (kill -9, then a clean stop) replays every
event from the bucket. A bad --objects is a clear error at start, with the data dir untouched.
Chunks whose delete failed while the store was down are swept once it is back.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import BrokerProcess, free_port
from objectstores import ACCESS_KEY, SECRET_KEY, SeaweedFS

from slipstream.storage._chunks import parse_chunk_name

EVENTS = 3000


def local_chunks(data_dir: Path) -> list[Path]:
    return list(data_dir.rglob("*.chunk"))


def with_keys(broker: BrokerProcess, secret: str = SECRET_KEY) -> BrokerProcess:
    broker.env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=secret)
    return broker


def test_a_broker_on_object_storage_moves_chunks_there_and_replays_them(
    broker_factory: type[BrokerProcess], seaweedfs: SeaweedFS
) -> None:
    bucket = seaweedfs.create_bucket()
    objects = ["--objects", f"s3://{bucket}/cluster-a", "--s3-endpoint", seaweedfs.endpoint]
    broker = with_keys(broker_factory(*objects, "--roll", "64KiB", "--roll-seconds", "0.2"))
    broker.start(timeout=60)
    with broker.client() as client:
        client.create_stream("s3/orders", segments=2)
        with client.producer("s3/orders") as producer:
            for i in range(EVENTS):
                producer.send(f"{i:06d}".encode() + b"x" * 200, key=f"k{i % 7}")

    def segments_moved() -> set[str]:  # "<stream>/<segment>" of the chunks in the bucket
        return {key.rsplit("/", 1)[0] for key in seaweedfs.objects(bucket, "cluster-a/")}

    for _ in range(600):  # the mover uploads chunks (a bound, not a timing)
        if len(segments_moved()) >= 2:
            break
        time.sleep(0.05)
    in_bucket = seaweedfs.objects(bucket, "cluster-a/")
    assert len(segments_moved()) >= 2, "both segments' journal data moved to the bucket"
    assert local_chunks(broker.data_dir) == [], "no chunk on local disk"

    for restart in (broker.kill, broker.stop):
        restart()
        broker.start(timeout=60)
        with broker.client() as client:
            events = list(client.reader("s3/orders", end=client.tail("s3/orders")))
            values = sorted(int(e.value[:6]) for e in events)
            assert values == list(range(EVENTS)), "every event, once"
            for k in range(7):
                mine = [int(e.value[:6]) for e in events if e.key == f"k{k}".encode()]
                assert mine == list(range(k, EVENTS, 7)), "per-key order"
    assert set(seaweedfs.objects(bucket, "cluster-a/")) >= set(in_bucket)
    assert local_chunks(broker.data_dir) == []
    # the reads came from the bucket: a cache was filled in the data directory
    assert list((broker.data_dir / "chunk-cache").glob("*.block"))


@pytest.mark.parametrize(
    ("problem", "message"),
    [
        ("bucket", "does not exist"),
        ("credentials", "refused the credentials"),
        ("endpoint", "cannot reach the object store"),
    ],
)
def test_a_bad_objects_store_is_an_error_at_start_with_nothing_written(
    broker_factory: type[BrokerProcess], seaweedfs: SeaweedFS, problem: str, message: str
) -> None:
    bucket = "no-such-bucket" if problem == "bucket" else seaweedfs.create_bucket()
    endpoint = f"http://127.0.0.1:{free_port()}" if problem == "endpoint" else seaweedfs.endpoint
    broker = broker_factory("--objects", f"s3://{bucket}/p", "--s3-endpoint", endpoint)
    with_keys(broker, "wrong" if problem == "credentials" else SECRET_KEY)
    with pytest.raises(RuntimeError, match=message):
        broker.start(timeout=60)
    assert not broker.data_dir.exists(), "nothing written to the data directory"
    if problem != "bucket":
        assert seaweedfs.objects(bucket) == []


@pytest.fixture
def own_seaweedfs(tmp_path: Path) -> Iterator[SeaweedFS]:
    server = SeaweedFS(tmp_path / "seaweedfs")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_the_store_down_under_a_running_broker_delays_moves_and_loses_nothing(
    broker_factory: type[BrokerProcess], own_seaweedfs: SeaweedFS
) -> None:
    server = own_seaweedfs
    bucket = server.create_bucket()
    broker = with_keys(
        broker_factory(
            *("--objects", f"s3://{bucket}/p", "--s3-endpoint", server.endpoint),
            *("--roll", "64KiB", "--roll-seconds", "0.2", "--containers", "1"),
        )
    )
    broker.start(timeout=60)
    with broker.client() as client:
        client.create_stream("s3/down", segments=1)
        with client.producer("s3/down") as producer:
            for i in range(EVENTS // 2):
                producer.send(f"{i:06d}".encode() + b"x" * 200)
        server.stop()
        # journals are local: appends are acknowledged while the store is down
        with client.producer("s3/down") as producer:
            for i in range(EVENTS // 2, EVENTS):
                producer.send(f"{i:06d}".encode() + b"x" * 200)
        for _ in range(600):  # a bound, not a timing
            if "failed, will retry" in broker.log():
                break
            time.sleep(0.05)
        assert "failed, will retry" in broker.log(), "the mover tried, failed and keeps trying"
        server.start()
        for _ in range(600):  # the mover's next rounds upload what waited
            if len(list((broker.data_dir / "journal" / "0").glob("*.journal"))) <= 1:
                break
            time.sleep(0.05)
        assert len(list((broker.data_dir / "journal" / "0").glob("*.journal"))) <= 1
        # the data produced while the store was down is in a chunk of its own now
        bases = [parse_chunk_name(key.removeprefix("p/")) for key in server.objects(bucket, "p/")]
        assert None not in bases
        assert max(b[2] for b in bases if b is not None) >= EVENTS // 2
    broker.kill()
    broker.start(timeout=60)
    with broker.client() as client:
        events = list(client.reader("s3/down", end=client.tail("s3/down")))
    assert [int(e.value[:6]) for e in events] == list(range(EVENTS)), "every event, in order"
    assert local_chunks(broker.data_dir) == []


def test_chunks_whose_delete_failed_while_the_store_was_down_are_swept_later(
    broker_factory: type[BrokerProcess], own_seaweedfs: SeaweedFS
) -> None:
    server = own_seaweedfs
    bucket = server.create_bucket()
    broker = with_keys(
        broker_factory(
            *("--objects", f"s3://{bucket}/p", "--s3-endpoint", server.endpoint),
            *("--roll", "64KiB", "--roll-seconds", "0.2", "--containers", "1"),
            *("--retention-check-seconds", "0.2"),
        )
    )
    broker.env["SLIPSTREAM_ORPHAN_GRACE_S"] = "1"  # tests only: far below the mover's window
    broker.start(timeout=60)

    def chunks() -> list[str]:  # of the newest stream (the one this test made)
        found = {k[2:]: parse_chunk_name(k[2:]) for k in server.objects(bucket, "p/")}
        named = {k: v for k, v in found.items() if v is not None}
        newest = max((v[0] for v in named.values()), default=None)
        return sorted(k for k, v in named.items() if v[0] == newest)

    with broker.client() as client:
        client.create_stream("s3/swept", segments=1)
        rounds = 5
        for r in range(rounds):  # a new chunk per round: the file rolls in between
            moved = len(chunks())
            with client.producer("s3/swept") as producer:
                for i in range(r * EVENTS // rounds, (r + 1) * EVENTS // rounds):
                    producer.send(f"{i:06d}".encode() + os.urandom(200))  # incompressible
            for _ in range(600):  # the mover uploads chunks (a bound, not a timing)
                if len(chunks()) > moved:
                    break
                time.sleep(0.05)
        assert len(chunks()) >= 3
        server.stop()
        # retention forgets the oldest chunks in the catalog; their deletes fail
        client.update_stream("s3/swept", retention_bytes=200 * 1024)
        for _ in range(600):  # a bound, not a timing
            if "left for the orphan sweep" in broker.log():
                break
            time.sleep(0.05)
        failed = {
            line.split("deleting chunk ", 1)[1].split(" failed", 1)[0]
            for line in broker.log().splitlines()
            if "left for the orphan sweep" in line
        }
        assert failed, "a delete failed while the store was down"
        server.start()
        for _ in range(600):  # the sweep, once due, deletes them (a bound, not a timing)
            if not failed & set(chunks()):
                break
            time.sleep(0.05)
        left = set(chunks())
        assert not failed & left, "the chunks whose delete failed were swept"
        assert "orphaned chunks" in broker.log()
        # what the catalog still records was never swept: every kept event reads back
        first = client.describe_stream("s3/swept").segments[0].start_offset
        events = list(client.reader("s3/swept", end=client.tail("s3/swept")))
        assert [int(e.value[:6]) for e in events] == list(range(first, EVENTS))
        assert left, "the kept chunks are still there"

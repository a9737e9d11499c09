"""Broker lifecycle, reading positions, retention and the asyncio API on a real broker."""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
import time

import pytest
from conftest import BrokerProcess, stream_storage

import slipstream


def test_second_broker_on_the_same_data_dir_is_refused(
    broker: BrokerProcess, broker_factory: type[BrokerProcess]
) -> None:
    second = broker_factory(data_dir=broker.data_dir)
    with pytest.raises(RuntimeError, match="already using"):
        second.start(timeout=10)


def test_sigterm_shuts_down_cleanly_and_restart_recovers(broker: BrokerProcess) -> None:
    with broker.client() as client:
        client.create_stream("life/cycle", segments=2)
        with client.producer("life/cycle") as producer:
            producer.send_many([b"a", b"b", b"c"])
    assert broker.stop() == 0
    assert "stopped cleanly" in broker.log()
    broker.start()
    with broker.client() as client:
        events = list(client.reader("life/cycle", end=client.tail("life/cycle")))
        assert sorted(e.value for e in events) == [b"a", b"b", b"c"]
    assert "recovered 1 streams" in broker.log()


def test_same_key_same_segment_and_order_from_tail_and_history(client: slipstream.Client) -> None:
    client.create_stream("life/order", segments=4)
    received: list[slipstream.Event] = []
    start = client.tail("life/order")  # the follower starts here however late its thread runs

    def follow() -> None:
        reader = client.reader("life/order", start=start)
        for event in reader:
            received.append(event)
            if len(received) == 400:
                reader.close()
                return

    thread = threading.Thread(target=follow)
    thread.start()
    with client.producer("life/order", linger_ms=1) as producer:
        for i in range(400):
            producer.send(str(i).encode(), key=f"key-{i % 5}")
    thread.join(20)
    history = list(client.reader("life/order", end=client.tail("life/order")))
    for events in (received, history):
        assert len(events) == 400
        for k in range(5):
            mine = [e for e in events if e.key == f"key-{k}".encode()]
            assert len({e.segment for e in mine}) == 1
            assert [int(e.value) for e in mine] == list(range(k, 400, 5))


def test_start_at_a_time_and_bounded_by_a_cut(client: slipstream.Client) -> None:
    client.create_stream("life/time", segments=2)
    base = 1_800_000_000_000
    with client.producer("life/time") as producer:
        for i in range(100):
            producer.send(str(i).encode(), key=str(i % 3), timestamp=base + i * 1000)
    middle = dt.datetime.fromtimestamp((base + 50_000) / 1000, dt.UTC)
    end = client.tail("life/time")
    values = sorted(int(e.value) for e in client.reader("life/time", start=middle, end=end))
    assert values == list(range(50, 100))
    iso = middle.isoformat()
    assert len(list(client.reader("life/time", start=iso, end=end))) == 50
    assert len(list(client.reader("life/time", start=base + 99_000, end=end))) == 1
    # a StreamCut taken now bounds a reader even while more events arrive
    with client.producer("life/time") as producer:
        producer.send(b"after the cut")
    assert len(list(client.reader("life/time", end=end))) == 100
    assert slipstream.StreamCut.from_json(end.to_json()) == end


def test_batches_carry_segment_and_offset_columns(client: slipstream.Client) -> None:
    client.create_stream("life/batches", segments=1)
    with client.producer("life/batches") as producer:
        producer.send_many([b"x"] * 1000)
    start = slipstream.StreamCut("life/batches", {0: 10})
    batches = list(
        client.reader("life/batches", start=start, end=client.tail("life/batches")).batches()
    )
    offsets = [o for b in batches for o in b.column("offset").to_pylist()]
    assert offsets == list(range(10, 1000))
    assert batches[0].schema.names == ["key", "value", "timestamp", "headers", "segment", "offset"]


def test_headers_round_trip(client: slipstream.Client) -> None:
    client.create_stream("life/headers")
    with client.producer("life/headers") as producer:
        producer.send(b"a", headers={"src": b"web", "trace": b"\x00\x01"})
        producer.send(b"b")
    a, b = client.reader("life/headers", end=client.tail("life/headers"))
    assert dict(a.headers) == {"src": b"web", "trace": b"\x00\x01"}
    assert dict(b.headers) == {}


def test_retention_removes_old_chunks_and_names_the_oldest_position(
    broker_factory: type[BrokerProcess],
) -> None:
    broker = broker_factory(
        "--roll", "8KiB", "--roll-seconds", "0.2", "--retention-check-seconds", "0.2"
    ).start()
    with broker.client() as client:
        client.create_stream("life/retained", segments=1, retention_bytes="32KiB")
        client.create_stream("life/aged", segments=1, retention_time="1s")
        old = int(time.time() * 1000) - 60_000
        for stream in ("life/retained", "life/aged"):
            # uncompressed: 300 x 400 repeated bytes would compress to a few KiB
            with client.producer(stream, batch_bytes=4096, compression=None) as producer:
                for _ in range(300):
                    producer.send(b"v" * 400, timestamp=old if stream == "life/aged" else None)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            retained = client.describe_stream("life/retained").segments[0]
            aged = client.describe_stream("life/aged").segments[0]
            if retained.start_offset > 0 and aged.start_offset > 0:
                break
            time.sleep(0.2)
        assert retained.start_offset > 0, "size retention never removed a chunk"
        assert aged.start_offset > 0, "time retention never removed a chunk"
        assert retained.bytes <= 32 * 1024 + 16 * 1024  # at most one chunk over the limit
        with pytest.raises(slipstream.OffsetOutOfRange) as raised:
            list(
                client.reader(
                    "life/retained",
                    start=slipstream.StreamCut("life/retained", {0: 0}),
                    end=client.tail("life/retained"),
                )
            )
        assert raised.value.details["oldest"] == retained.start_offset
        assert f"oldest retained offset is {retained.start_offset}" in raised.value.message
        events = list(client.reader("life/retained", end=client.tail("life/retained")))
        assert events[0].offset == retained.start_offset
        assert events[-1].offset == 299


def _chunk_disk_bytes(broker: BrokerProcess) -> int:
    """Bytes the chunk files of user streams take, each file (inode) counted once however
    many names it has (the broker's own audit stream writes a record at the deletion)."""
    audit, _ = stream_storage(broker.data_dir, "_system/audit")
    inodes = {}
    for path in (broker.data_dir / "chunks").rglob("*.chunk"):
        if path.parent.parent.name == str(audit):
            continue
        stat = path.stat()
        inodes[stat.st_ino] = stat.st_size
    return sum(inodes.values())


def test_deleting_a_stream_frees_its_disk_space_while_others_share_its_journal(
    broker_factory: type[BrokerProcess],
) -> None:
    # One journal, so the two streams' batches interleave in every journal file; the one that
    # owns most of a file gets it as its chunk, the other a copy of its own batches.
    broker = broker_factory(
        "--containers", "1", "--roll", "256KiB", "--roll-seconds", "0.2"
    ).start()
    with broker.client() as client:
        client.create_stream("disk/big", segments=1)
        client.create_stream("disk/small", segments=1)
        with (
            client.producer("disk/big", linger_ms=0) as big,
            client.producer("disk/small", linger_ms=0) as small,
        ):
            for i in range(300):
                big.send_many([b"b" * 1000] * 3)
                small.send(f"small-{i}".encode().ljust(1000, b"s"))
                big.flush()
                small.flush()
        deadline = time.monotonic() + 20
        journals = list((broker.data_dir / "journal").rglob("*.journal"))
        while time.monotonic() < deadline and any(p.stat().st_size for p in journals):
            time.sleep(0.1)  # until every journal file has become chunks
            journals = list((broker.data_dir / "journal").rglob("*.journal"))
        assert not any(p.stat().st_size for p in journals), "the mover did not catch up"
        small_bytes = client.describe_stream("disk/small").segments[0].bytes
        before = _chunk_disk_bytes(broker)
        client.delete_stream("disk/small")
        freed = before - _chunk_disk_bytes(broker)
        assert freed >= small_bytes, (freed, small_bytes)
        assert before - freed <= 2 * client.describe_stream("disk/big").segments[0].bytes
        events = list(client.reader("disk/big", end=client.tail("disk/big")))
        assert len(events) == 900 and {e.value for e in events} == {b"b" * 1000}


def test_asyncio_api(broker: BrokerProcess) -> None:
    async def main() -> list[bytes]:
        async with await slipstream.connect_async(broker.address) as client:
            await client.create_stream("life/async", segments=2)
            async with await client.producer("life/async") as producer:
                receipt = await producer.send(b"one", key="k")
                await producer.send_many([b"two", b"three"])
            position = await receipt
            assert position.offset == 0
            end = await client.tail("life/async")
            return [e.value async for e in client.reader("life/async", end=end)]

    assert sorted(asyncio.run(main())) == [b"one", b"three", b"two"]


def test_asyncio_producer_waits_for_buffer_space(broker: BrokerProcess) -> None:
    async def main() -> int:
        async with await slipstream.connect_async(broker.address) as client:
            await client.create_stream("life/backpressure")
            producer = await client.producer(
                "life/backpressure", batch_bytes=16 * 1024, buffer_bytes=64 * 1024
            )
            for i in range(3000):  # about 3 MB through a 64 KiB buffer
                await producer.send(i.to_bytes(4, "little") * 250)
                assert producer.core._buffered <= 64 * 1024 + 16 * 1024
            await producer.close()
            tail = await client.tail("life/backpressure")
            return tail.positions[0]

    assert asyncio.run(main()) == 3000

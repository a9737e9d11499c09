"""Queue subscriptions across the brokers of a cluster (issue 20): the broker coordinating a
queue's group reads the segments other brokers serve through ``ReadSegment`` and appends dead
letters through the broker serving the dead-letter segment. A consumer connected through the
broker list gets every event, acks each once, sees its nacks delivered again and its poison
events in the dead-letter stream; when the coordinator is killed -9 mid-stream the queue goes
on at the broker that takes its container over, from the state stored in the catalog: no
event whose ack was answered is delivered again (unanswered ones may be: at-least-once)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import Cluster
from objectstores import SeaweedFS
from pg import PgCluster

import slipstream
from slipstream import OffsetOutOfRange, QueueConsumer, SlipstreamError, WrongBroker
from slipstream.client._connection import Connection
from slipstream.cluster import assign, coordinator
from slipstream.format import events_of, iter_batches, read_body
from slipstream.protocol import Message, ReadSegment, SegmentData

STREAM = "cq/orders"
SEGMENTS = 6
POISON = 8


@pytest.fixture
def cluster(tmp_path: Path, postgres: PgCluster, seaweedfs: SeaweedFS) -> Iterator[Cluster]:
    base = tmp_path / "cluster"
    base.mkdir()
    with Cluster(base, postgres, seaweedfs, brokers=3, containers=4).start() as started:
        deadline = time.monotonic() + 60
        while len(set(started.wait_until_all_containers_served().values())) < 3:
            assert time.monotonic() < deadline, "containers still moving"  # a bound, no timing
            time.sleep(0.1)
        yield started


def _queue_consumer(client: slipstream.Client, name: str) -> QueueConsumer:
    consumer = client.consumer(STREAM, name, max_in_flight=64)
    assert isinstance(consumer, QueueConsumer)
    return consumer


def _layout(cluster: Cluster, client: slipstream.Client, name: str) -> tuple[str, set[str]]:
    """(the broker id coordinating subscription ``name``, the ids serving the stream's
    segments), checked to make the coordinator read at least one other broker's segment;
    once every broker knows the subscription."""
    for i, broker in enumerate(cluster.brokers):  # the client asks any for the mode
        if not cluster.running(i):
            continue
        with slipstream.connect(broker.address) as one:
            deadline = time.monotonic() + 30
            while name not in {s.name for s in one.list_subscriptions(STREAM)}:
                assert time.monotonic() < deadline, f"{broker.address} does not know {name}"
                time.sleep(0.05)
    served = cluster.wait_until_all_containers_served()
    info = client.describe_stream(STREAM)
    owners = {served[s.container] for s in info.segments}
    home = served[coordinator(f"{STREAM}/{name}", cluster.containers)]
    assert len(owners) >= 2 and owners - {home}, (home, owners)
    return home, owners


def test_a_queue_over_two_brokers_delivers_acks_nacks_and_dead_letters(cluster: Cluster) -> None:
    with slipstream.connect(cluster.addresses(), reconnect_timeout=60) as client:
        client.create_stream(STREAM, SEGMENTS)
        client.create_subscription(
            STREAM, "work", mode="queue", max_deliveries=2, backoff=0.05, ack_timeout=30
        )
        home, _ = _layout(cluster, client, "work")
        count = 600
        with client.producer(STREAM, linger_ms=2) as producer:
            for i in range(count):
                producer.send(b"%d" % i, key=f"k{i}")
            for i in range(POISON):  # nacked on every delivery: dead-lettered after two
                producer.send(b"poison %d" % i, key=f"p{i}", headers={"app": b"x"})
        positions = {
            int(e.value): (e.segment, e.offset)
            for e in client.reader(STREAM, end=client.tail(STREAM))
            if not e.value.startswith(b"poison")
        }
        assert len({s for s, _ in positions.values()}) == SEGMENTS

        deliveries: list[tuple[bytes, int, int, int]] = []  # value, segment, offset, count
        acked: list[int] = []
        dead_letters: list[slipstream.Event] = []
        dlq = f"{STREAM}.dlq"
        with _queue_consumer(client, "work") as consumer:
            deadline = time.monotonic() + 120
            looked = 0.0
            while len(acked) < count or len(dead_letters) < POISON:
                assert time.monotonic() < deadline, (len(acked), len(dead_letters))
                for event in consumer.poll(0.2):
                    deliveries.append((event.value, event.segment, event.offset, event.deliveries))
                    if event.value.startswith(b"poison"):
                        event.nack()
                    elif int(event.value) % 50 == 0 and event.deliveries == 1:
                        event.nack()  # once: delivered again, then acked
                    else:
                        event.ack()
                        acked.append(int(event.value))
                if len(acked) >= count and time.monotonic() - looked > 0.5:
                    looked = time.monotonic()
                    if dlq in {s.name for s in client.list_streams()}:
                        dead_letters = list(client.reader(dlq, end=client.tail(dlq)))
            consumer.flush_acks()
            assert consumer.poll(0.5) == []
            ends = {s.number: s.end_offset for s in client.describe_stream(STREAM).segments}
            described = client.describe_subscription(STREAM, "work").segments
            assert {s.segment: s.end_offset for s in described} == ends
            assert [(s.backlog_events, s.in_flight, s.waiting) for s in described] == [
                (0, 0, 0)
            ] * (SEGMENTS)
            assert sum(s.dead_lettered for s in described) == POISON

        assert sorted(acked) == list(range(count)), "an event acked twice or never"
        by_value: dict[bytes, list[tuple[int, int, int]]] = {}
        for value, segment, offset, n in deliveries:
            by_value.setdefault(value, []).append((segment, offset, n))
        for i in range(count):
            expected = (
                [(*positions[i], 1), (*positions[i], 2)] if i % 50 == 0 else [(*positions[i], 1)]
            )
            assert by_value[b"%d" % i] == expected, i
        for i in range(POISON):
            assert [n for _, _, n in by_value[b"poison %d" % i]] == [1, 2]

        assert sorted(e.value for e in dead_letters) == [b"poison %d" % i for i in range(POISON)]
        dlq_info = client.describe_stream(dlq)
        assert len(dlq_info.segments) == SEGMENTS
        served = cluster.wait_until_all_containers_served()
        owner = {s.number: served[s.container] for s in dlq_info.segments}
        assert {owner[d.segment] for d in dead_letters} - {home}, "none appended through a peer"
        for dead in dead_letters:
            assert dead.headers["app"] == b"x"
            assert dead.headers["x-deliveries"] == b"2"
            assert dead.headers["x-source-stream"] == STREAM.encode()
            assert dead.headers["x-source-subscription"] == b"work"
            source = by_value[dead.value][0]
            assert dead.headers["x-source-segment"] == str(source[0]).encode()
            assert dead.headers["x-source-offset"] == str(source[1]).encode()


@pytest.mark.parametrize("fault", ["kill -9", "clean stop", "kill -9 of a segment's broker"])
def test_the_queue_goes_on_at_a_new_coordinator(cluster: Cluster, fault: str) -> None:
    """Events are acked and each batch's acks flushed; those whose flush was answered are
    stored. The coordinator is killed -9 (or stopped, handing its containers over)
    mid-stream: the consumer joins the broker that takes its container over, which must not
    deliver any of those again; the others (acks lost with the broker, events in flight) come
    again, and in the end every event is acked. Killing a broker that serves some of the
    segments but not the coordinator: the queue reads them on at their new brokers. Half of
    the events are appended after the fault (so read from the segments' new brokers)."""
    count = 3000
    with slipstream.connect(cluster.addresses(), reconnect_timeout=60) as client:
        client.create_stream(STREAM, SEGMENTS)
        client.create_subscription(STREAM, "work", mode="queue", ack_timeout=30)
        home, owners = _layout(cluster, client, "work")
        victim = home if fault != "kill -9 of a segment's broker" else min(owners - {home})
        producer = client.producer(STREAM, linger_ms=2)
        for i in range(count // 2):
            producer.send(b"%d" % i, key=f"k{i}")
        producer.flush()
        failed: list[BaseException] = []

        def append_the_rest() -> None:
            try:
                for i in range(count // 2, count):
                    producer.send(b"%d" % i, key=f"k{i}")
                producer.flush()
            except BaseException as exc:
                failed.append(exc)

        appending = threading.Thread(target=append_the_rest, daemon=True)

        confirmed: set[tuple[int, int]] = set()  # acks answered: stored
        maybe: set[int] = set()  # acks whose answer was lost with the broker, or void
        settled: set[int] = set()
        redelivered: list[tuple[int, int]] = []
        killed = False
        with _queue_consumer(client, "work") as consumer:
            deadline = time.monotonic() + 240
            quiet_since = None
            while len(settled | maybe) < count or time.monotonic() - (quiet_since or 0) < 2:
                assert time.monotonic() < deadline, f"{len(settled)} of {count} events acked"
                events = consumer.poll(0.2)
                quiet_since = quiet_since if not events else None
                if not events and len(settled | maybe) >= count and quiet_since is None:
                    quiet_since = time.monotonic()
                for event in events:
                    if (event.segment, event.offset) in confirmed:
                        redelivered.append((event.segment, event.offset))
                    event.ack()
                try:
                    consumer.flush_acks()
                except SlipstreamError:  # not known to be stored: may come again
                    maybe.update(int(e.value) for e in events)
                    continue
                confirmed.update((e.segment, e.offset) for e in events)
                settled.update(int(e.value) for e in events)
                if not killed and len(settled) >= count // 4:
                    if fault == "clean stop":
                        assert cluster.stop(int(victim[1:])) == 0
                    else:
                        cluster.kill(int(victim[1:]))
                    killed = True
                    appending.start()  # while the consumer fetches: asks hit the dead broker
        appending.join()
        assert not failed, failed
        producer.close()
        assert killed
        assert redelivered == [], f"{len(redelivered)} events delivered again after their ack"
        assert settled | maybe == set(range(count))
        assert len(maybe - settled) < count // 3  # (only what was out when the broker died)
        if victim != home:  # the queue read on at the segments' new brokers, unaware
            assert maybe == set()


def _ask(address: str, message: Message) -> tuple[Message, bytes]:
    async def one() -> tuple[Message, bytes]:
        connection = await Connection.open(address)
        try:
            reply, payload = await connection.request(message)
            return reply, bytes(payload)
        finally:
            connection.close()

    return asyncio.run(one())


def test_read_segment_answers_at_the_segments_broker_only(cluster: Cluster) -> None:
    """ReadSegment (what a queue's coordinator asks another broker): whole batches from the
    offset, at least one, up to max_bytes, with the segment's end; WrongBroker naming the
    owner from any other broker; OffsetOutOfRange past the end."""
    with slipstream.connect(cluster.addresses()) as client:
        client.create_stream(STREAM, 1)
        with client.producer(STREAM, linger_ms=0) as producer:
            for i in range(5):  # five batches: each send is flushed alone
                producer.send(b"%d" % i, key="k").result()
        served = cluster.wait_until_all_containers_served()
        [segment] = client.describe_stream(STREAM).segments
        owner = served[segment.container]
        at_owner = cluster.brokers[int(owner[1:])].address
        elsewhere = next(b.address for b in cluster.brokers if b.address != at_owner)

        reply, payload = _ask(at_owner, ReadSegment(STREAM, 0, 0, 1))
        assert reply == SegmentData(1, 5, False)
        [(header, _)] = list(iter_batches(payload))
        assert (header.base_offset, header.next_offset) == (0, 1)

        reply, payload = _ask(at_owner, ReadSegment(STREAM, 0, 2, 1 << 20))
        assert reply == SegmentData(5, 5, False)
        assert [h.base_offset for h, _ in iter_batches(payload)] == [2, 3, 4]
        values = [
            e.value
            for h, b in iter_batches(payload)
            for e in events_of(read_body(b), 0, h.base_offset)
        ]
        assert values == [b"2", b"3", b"4"]

        assert _ask(at_owner, ReadSegment(STREAM, 0, 5)) == (SegmentData(5, 5, False), b"")
        with pytest.raises(OffsetOutOfRange):
            _ask(at_owner, ReadSegment(STREAM, 0, 6))
        with pytest.raises(WrongBroker) as wrong:
            _ask(elsewhere, ReadSegment(STREAM, 0, 0))
        assert wrong.value.details["owner"] == owner


def test_a_key_ordered_queue_over_two_brokers_keeps_each_keys_order(cluster: Cluster) -> None:
    """key_ordered_queue with segments on several brokers: every event once, each key's in
    append order, never two of one key out at a time."""
    keys, count = 12, 600
    with slipstream.connect(cluster.addresses(), reconnect_timeout=60) as client:
        client.create_stream(STREAM, SEGMENTS)
        client.create_subscription(STREAM, "keyed", mode="key_ordered_queue", ack_timeout=30)
        _layout(cluster, client, "keyed")
        with client.producer(STREAM, linger_ms=2) as producer:
            for i in range(count):
                producer.send(b"%d" % i, key=f"k{i % keys}")
        seen: dict[bytes, list[int]] = {}
        with _queue_consumer(client, "keyed") as consumer:
            deadline = time.monotonic() + 120
            while sum(len(v) for v in seen.values()) < count:
                assert time.monotonic() < deadline, sum(len(v) for v in seen.values())
                events = consumer.poll(0.2)
                out = [e.key for e in events]
                assert len(out) == len(set(out)), "two events of one key out at once"
                for event in events:
                    assert event.key is not None
                    seen.setdefault(event.key, []).append(int(event.value))
                    event.ack()
            consumer.flush_acks()
            assert consumer.poll(0.5) == []
        assert sorted(v for values in seen.values() for v in values) == list(range(count))
        for key, values in seen.items():
            assert values == sorted(values), key


def test_a_queue_moves_with_its_coordinator_on_a_hand_over(cluster: Cluster) -> None:
    """A broker joins and the coordinator's container is handed over to it (no process dies):
    the old coordinator stops dispatching at once (its member is told WrongBroker and joins
    the new one), so a second member joining the new coordinator never gets an event the
    first one acknowledged, and every event is acknowledged."""
    assert cluster.stop(2) == 0
    holders = cluster.wait_until_all_containers_served()
    assert set(holders.values()) == {"b0", "b1"}
    wanted = assign(cluster.containers, ["b0", "b1", "b2"], holders)
    moving = {c for c, owner in wanted.items() if owner == "b2"}
    name = next(
        f"work{i}"
        for i in range(1000)
        if coordinator(f"{STREAM}/work{i}", cluster.containers) in moving
    )
    count = 2000
    with slipstream.connect(cluster.addresses(), reconnect_timeout=60) as client:
        client.create_stream(STREAM, SEGMENTS)
        client.create_subscription(STREAM, name, mode="queue", ack_timeout=30)
        _layout(cluster, client, name)
        with client.producer(STREAM, linger_ms=2) as producer:
            for i in range(count):
                producer.send(b"%d" % i, key=f"k{i}")

        confirmed: set[tuple[int, int]] = set()
        maybe: set[int] = set()
        settled: set[int] = set()
        redelivered: list[tuple[int, int]] = []
        first = _queue_consumer(client, name)
        consumers = [first]
        deadline = time.monotonic() + 240
        try:
            while len(settled | maybe) < count:
                assert time.monotonic() < deadline, f"{len(settled)} of {count} events acked"
                for consumer in consumers:
                    events = consumer.poll(0.1)
                    for event in events:
                        if (event.segment, event.offset) in confirmed:
                            redelivered.append((event.segment, event.offset))
                        event.ack()
                    try:
                        consumer.flush_acks()
                    except SlipstreamError:
                        maybe.update(int(e.value) for e in events)
                        continue
                    confirmed.update((e.segment, e.offset) for e in events)
                    settled.update(int(e.value) for e in events)
                if len(consumers) == 1 and len(settled) >= count // 4:
                    cluster.start_broker(2)
                    home = coordinator(f"{STREAM}/{name}", cluster.containers)
                    moved = cluster.wait_until_all_containers_served()
                    assert moved[home] == "b2", moved
                    consumers.append(_queue_consumer(client, name))  # joins at b2
        finally:
            for consumer in consumers:
                consumer.close()
        assert redelivered == [], f"{len(redelivered)} events delivered again after their ack"
        assert settled | maybe == set(range(count))

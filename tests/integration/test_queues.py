"""Work queues (modes ``queue`` and ``key_ordered_queue``) against a real broker process.

Events spread over members and settled one by one; nacks with a delay; redelivery after the
ack timeout with a doubling backoff; dead letters after ``max_deliveries`` with their headers;
the ``max_unacked`` bound; one event per key in flight (and a failing key that holds back
only itself); a member killed -9; a broker restart; a reset; acks of deliveries a member does
not hold; and describe's counts. Time is only ever bounded from below (a delay is at least
what was asked), never from above.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import pytest
from conftest import BrokerProcess

import slipstream
from slipstream import QueueConsumer, QueueEvent, UnknownDelivery
from slipstream.protocol import EventsDelivered, FetchEvents, Settled, SettleEvents


def produce(
    client: slipstream.Client, stream: str, count: int, key: Callable[[int], str | None]
) -> None:
    with client.producer(stream, linger_ms=1) as producer:
        for i in range(count):
            producer.send(b"%d" % i, key=key(i))


def queue_consumer(client: slipstream.Client, stream: str, name: str, **kw: int) -> QueueConsumer:
    consumer = client.consumer(stream, name, **kw)  # type: ignore[arg-type]
    assert isinstance(consumer, QueueConsumer)
    return consumer


def take(consumer: QueueConsumer, count: int, timeout: float = 20.0) -> list[QueueEvent]:
    """Exactly ``count`` events (fails on fewer within ``timeout``)."""
    events: list[QueueEvent] = []
    deadline = time.monotonic() + timeout
    while len(events) < count and time.monotonic() < deadline:
        events.extend(consumer.poll(0.2))
    assert len(events) == count, f"got {len(events)} of {count} events"
    return events


def quiet(consumer: QueueConsumer, seconds: float = 1.0) -> list[QueueEvent]:
    events: list[QueueEvent] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        events.extend(consumer.poll(0.1))
    return events


def wait_for(check: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def counts(client: slipstream.Client, stream: str, name: str) -> tuple[int, int, int, int]:
    """(in flight, waiting, dead-lettered, backlog) summed over the segments."""
    info = client.describe_subscription(stream, name)
    return (
        sum(s.in_flight for s in info.segments),
        sum(s.waiting for s in info.segments),
        sum(s.dead_lettered for s in info.segments),
        sum(s.backlog_events for s in info.segments),
    )


def read_all(client: slipstream.Client, stream: str) -> list[slipstream.Event]:
    return list(client.reader(stream, "earliest", client.tail(stream)))


def test_events_spread_over_members_each_acked_once(client: slipstream.Client) -> None:
    client.create_stream("q/spread", segments=2)
    client.create_subscription("q/spread", "work", mode="queue")
    produce(client, "q/spread", 300, lambda i: f"k{i % 11}")
    members = [queue_consumer(client, "q/spread", "work", max_in_flight=10) for _ in range(3)]
    got: dict[int, list[QueueEvent]] = {i: [] for i in range(3)}
    deadline = time.monotonic() + 30
    while sum(len(v) for v in got.values()) < 300 and time.monotonic() < deadline:
        for i, member in enumerate(members):
            for event in member.poll(0.05):
                got[i].append(event)
                event.ack()
    for member in members:
        member.flush_acks()
    everything = [(e.segment, e.offset) for events in got.values() for e in events]
    assert len(everything) == len(set(everything)) == 300
    assert all(got.values()), "every member got a share"
    assert all(e.deliveries == 1 for events in got.values() for e in events)
    assert {s for s, _ in everything} == {0, 1}
    assert counts(client, "q/spread", "work") == (0, 0, 0, 0)
    assert all(quiet(m, 0.5) == [] for m in members)
    for member in members:
        member.close()


def test_nack_with_delay_and_redelivery_after_the_ack_timeout_with_backoff(
    client: slipstream.Client,
) -> None:
    client.create_stream("q/retry", segments=1)
    client.create_subscription(
        "q/retry", "work", mode="queue", ack_timeout=0.5, backoff=0.3, max_deliveries=10
    )
    produce(client, "q/retry", 2, lambda i: None)
    with queue_consumer(client, "q/retry", "work") as consumer:
        first, second = sorted(take(consumer, 2), key=lambda e: e.offset)
        handed = time.monotonic()
        first.nack(delay=0.8)
        consumer.flush_acks()
        assert counts(client, "q/retry", "work")[:2] == (1, 1)  # second in flight, first waits
        # ``second`` is never settled: out again after the ack timeout plus the backoff,
        # which doubles with each delivery
        seen: dict[tuple[int, int], float] = {}
        deadline = time.monotonic() + 30
        while len(seen) < 3:
            assert time.monotonic() < deadline
            for event in consumer.poll(0.05):
                seen[(event.offset, event.deliveries)] = time.monotonic()
                if event.offset == first.offset or event.deliveries == 3:
                    event.ack()
        assert set(seen) == {(first.offset, 2), (second.offset, 2), (second.offset, 3)}
        assert seen[(first.offset, 2)] - handed >= 0.8
        assert seen[(second.offset, 2)] - handed >= 0.5 + 0.3
        assert seen[(second.offset, 3)] - seen[(second.offset, 2)] >= 0.5 + 0.6
        consumer.flush_acks()
    assert counts(client, "q/retry", "work") == (0, 0, 0, 0)


def test_max_deliveries_sends_the_event_to_the_dead_letter_stream_with_headers(
    client: slipstream.Client,
) -> None:
    client.create_stream("q/poison", segments=3)
    client.create_subscription("q/poison", "work", mode="queue", max_deliveries=2, backoff=0.05)
    with client.producer("q/poison") as producer:
        producer.send(b"poison", key="p", headers={"app": b"1"})
        producer.send(b"fine", key="f")
    with queue_consumer(client, "q/poison", "work") as consumer:
        seen: list[tuple[bytes, int]] = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(seen) < 3:
            for event in consumer.poll(0.1):
                seen.append((event.value, event.deliveries))
                event.nack() if event.value == b"poison" else event.ack()
        assert sorted(seen) == [(b"fine", 1), (b"poison", 1), (b"poison", 2)]
        consumer.flush_acks()
        wait_for(lambda: counts(client, "q/poison", "work") == (0, 0, 1, 0))
        assert quiet(consumer, 0.5) == []
    assert client.describe_stream("q/poison.dlq").segments.__len__() == 3
    [dead] = read_all(client, "q/poison.dlq")
    source = next(e for e in read_all(client, "q/poison") if e.value == b"poison")
    assert (dead.key, dead.value) == (b"p", b"poison")
    assert dead.headers["app"] == b"1"
    assert dead.headers["x-deliveries"] == b"2"
    assert dead.headers["x-source-stream"] == b"q/poison"
    assert dead.headers["x-source-subscription"] == b"work"
    assert dead.headers["x-source-segment"] == str(source.segment).encode()
    assert dead.headers["x-source-offset"] == str(source.offset).encode()
    assert b"max_deliveries" in dead.headers["x-dead-letter-reason"]
    assert b"nacked" in dead.headers["x-dead-letter-reason"]


def test_max_unacked_bounds_what_a_member_holds(client: slipstream.Client) -> None:
    client.create_stream("q/bound", segments=2)
    client.create_subscription("q/bound", "work", mode="queue", max_unacked=5)
    produce(client, "q/bound", 50, lambda i: None)
    with queue_consumer(client, "q/bound", "work", max_in_flight=100) as consumer:
        held = take(consumer, 5)
        assert quiet(consumer, 1.0) == []  # the broker hands out no more
        assert counts(client, "q/bound", "work")[0] == 5
        held[0].ack()
        [one] = take(consumer, 1)
        assert quiet(consumer, 0.5) == []
        for event in [*held[1:], one]:
            event.ack()
        assert len(take(consumer, 5)) == 5
    with queue_consumer(client, "q/bound", "work", max_in_flight=3) as consumer:
        take(consumer, 3)  # the client's own bound
        assert quiet(consumer, 1.0) == []


def test_a_raw_fetch_gets_at_most_max_unacked(client: slipstream.Client) -> None:
    client.create_stream("q/raw", segments=1)
    client.create_subscription("q/raw", "work", mode="queue", max_unacked=4)
    produce(client, "q/raw", 20, lambda i: None)
    with queue_consumer(client, "q/raw", "work", max_in_flight=1) as member:
        take(member, 1)
        other = queue_consumer(client, "q/raw", "work", max_in_flight=1)
        take(other, 1)
        request = client._async._request
        reply = client._loop.run(request(FetchEvents(member.core.member_id, 100, 0)))
        assert isinstance(reply, EventsDelivered)
        assert len(reply.deliveries) == 3  # it holds one already
        other.close()


def test_key_ordered_queue_hands_out_one_event_per_key(client: slipstream.Client) -> None:
    client.create_stream("q/keys", segments=1)
    client.create_subscription("q/keys", "work", mode="key_ordered_queue", backoff=0.05)
    keys = ["a", "b", "c", None]
    produce(client, "q/keys", 40, lambda i: keys[i % 4])
    first = queue_consumer(client, "q/keys", "work", max_in_flight=100)
    second = queue_consumer(client, "q/keys", "work", max_in_flight=100)
    stored: dict[bytes | None, list[int]] = {}
    for e in read_all(client, "q/keys"):
        stored.setdefault(e.key, []).append(e.offset)
    out = take(first, 13)  # the first of each key, and the ten keyless events
    heads = {k: v[0] for k, v in stored.items() if k is not None}
    assert sorted(e.offset for e in out if e.key is not None) == sorted(heads.values())
    assert len([e for e in out if e.key is None]) == 10
    assert quiet(second, 1.0) == []  # every key is busy
    by_key = {e.key: e for e in out}
    by_key[b"a"].nack()  # "a" fails: "a" waits for it, "b" goes on
    by_key[b"b"].ack()
    got = take(second, 1) + take(first, 1)
    assert sorted((e.offset, e.deliveries) for e in got) == sorted(
        [(heads[b"a"], 2), (stored[b"b"][1], 1)]
    )
    first.close()
    second.close()


def test_a_failing_key_holds_back_only_itself(client: slipstream.Client) -> None:
    client.create_stream("q/stall", segments=1)
    client.create_subscription(
        "q/stall", "work", mode="key_ordered_queue", max_deliveries=3, backoff=0.2
    )
    produce(client, "q/stall", 60, lambda i: "bad" if i % 3 == 0 else f"good{i % 3}")
    order: dict[bytes, list[int]] = {}
    bad_deliveries = 0
    with queue_consumer(client, "q/stall", "work") as consumer:
        deadline = time.monotonic() + 60
        acked_good = 0
        while acked_good < 40 or len(order.get(b"bad", [])) < 19:
            assert time.monotonic() < deadline
            for event in consumer.poll(0.1):
                assert event.key is not None
                if event.key == b"bad" and event.offset == 0:
                    bad_deliveries += 1
                    event.nack()  # the first "bad" event always fails
                    continue
                if event.key != b"bad":
                    acked_good += 1
                order.setdefault(event.key, []).append(event.offset)
                event.ack()
        consumer.flush_acks()
    assert bad_deliveries == 3
    for key, offsets in order.items():
        assert offsets == sorted(offsets), f"key {key!r} out of order"
    assert order[b"bad"] == list(range(3, 60, 3))  # the key moved on after its dead letter
    [dead] = read_all(client, "q/stall.dlq")
    assert dead.headers["x-source-offset"] == b"0"


MEMBER = """
import sys, slipstream
client = slipstream.connect(sys.argv[1])
consumer = client.consumer(sys.argv[2], sys.argv[3], max_in_flight=5, session_timeout=2.0)
for event in consumer:
    print(event.segment, event.offset, flush=True)  # and never acks
"""


@pytest.mark.parametrize("how", ["kill -9", "stopped (SIGSTOP) past its session timeout"])
def test_a_vanished_members_events_are_delivered_again(
    client: slipstream.Client, broker: BrokerProcess, how: str
) -> None:
    client.create_stream("q/crash", segments=2)
    client.create_subscription("q/crash", "work", mode="queue", ack_timeout=300)
    produce(client, "q/crash", 20, lambda i: None)
    member = subprocess.Popen(
        [sys.executable, "-c", MEMBER, broker.address, "q/crash", "work"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert member.stdout is not None
        held = {tuple(map(int, member.stdout.readline().split())) for _ in range(5)}
        wait_for(lambda: counts(client, "q/crash", "work")[0] == 5)
        if how == "kill -9":
            member.kill()
            member.wait()
        else:
            member.send_signal(signal.SIGSTOP)
            wait_for(lambda: counts(client, "q/crash", "work")[0] == 0)  # its session expired
    finally:
        member.kill()
        member.wait()
        if member.stdout is not None:
            member.stdout.close()
    with queue_consumer(client, "q/crash", "work", max_in_flight=100) as consumer:
        events = take(consumer, 20)  # long before the 300 s ack timeout
        again = {(e.segment, e.offset) for e in events if e.deliveries == 2}
        assert again == held
        for event in events:
            event.ack()
        consumer.flush_acks()
    assert counts(client, "q/crash", "work") == (0, 0, 0, 0)


def test_a_broker_restart_keeps_acks_and_delivers_the_rest(
    client: slipstream.Client, broker: BrokerProcess
) -> None:
    client.create_stream("q/restart", segments=2)
    client.create_subscription("q/restart", "work", mode="key_ordered_queue", max_deliveries=3)
    produce(client, "q/restart", 100, lambda i: f"k{i % 10}")
    with queue_consumer(client, "q/restart", "work", max_in_flight=1000) as consumer:
        first = take(consumer, 10)  # one per key
        for event in first[:6]:
            event.ack()
        consumer.flush_acks()
        broker.restart()
        for event in first[6:]:  # delivered before the restart: void now
            event.ack()
        with pytest.raises(UnknownDelivery) as caught:
            consumer.flush_acks()
        stale = sorted(tuple(d) for d in caught.value.details["deliveries"])
        assert stale == sorted((e.segment, e.offset) for e in first[6:])
        acked = {(e.segment, e.offset) for e in first[:6]}
        deadline = time.monotonic() + 60
        while len(acked) < 100:
            assert time.monotonic() < deadline
            events = consumer.poll(0.2)
            for event in events:
                event.ack()
            try:
                consumer.flush_acks()
            except UnknownDelivery as exc:  # delivered just before the restart
                unknown = {tuple(d) for d in exc.details["deliveries"]}
            else:
                unknown = set()
            for event in events:
                if (event.segment, event.offset) not in unknown:
                    assert (event.segment, event.offset) not in acked  # acked once only
                    acked.add((event.segment, event.offset))
        assert quiet(consumer, 0.5) == []
    assert counts(client, "q/restart", "work") == (0, 0, 0, 0)


def test_acks_of_deliveries_a_member_does_not_hold_are_unknown(client: slipstream.Client) -> None:
    client.create_stream("q/foreign", segments=1)
    client.create_subscription("q/foreign", "work", mode="queue")
    produce(client, "q/foreign", 3, lambda i: None)
    owner = queue_consumer(client, "q/foreign", "work", max_in_flight=1)
    other = queue_consumer(client, "q/foreign", "work", max_in_flight=1)
    [event] = take(owner, 1)
    take(other, 1)
    request = client._async._request
    foreign = client._loop.run(
        request(SettleEvents(other.core.member_id, [[event.segment, event.offset]], [[0, 99]]))
    )
    assert isinstance(foreign, Settled)
    assert foreign.unknown == [[event.segment, event.offset], [0, 99]]
    event.ack()
    owner.flush_acks()  # the owner's ack took effect: the foreign one changed nothing
    event.ack()  # twice
    with pytest.raises(UnknownDelivery) as caught:
        owner.flush_acks()
    assert caught.value.details["deliveries"] == [[event.segment, event.offset]]
    owner.close()
    other.close()


def test_reset_restarts_the_queue_from_its_new_floors_and_voids_deliveries(
    client: slipstream.Client,
) -> None:
    client.create_stream("q/reset", segments=1)
    client.create_subscription("q/reset", "work", mode="queue")
    produce(client, "q/reset", 10, lambda i: None)
    with queue_consumer(client, "q/reset", "work", max_in_flight=100) as consumer:
        events = take(consumer, 10)
        for event in events:
            event.ack()
        consumer.flush_acks()
        assert counts(client, "q/reset", "work")[3] == 0
        client.reset_subscription("q/reset", "work", "earliest")
        again = take(consumer, 10)  # everything again, from the start, counted afresh
        assert sorted((e.offset, e.deliveries) for e in again) == [(o, 1) for o in range(10)]
        assert counts(client, "q/reset", "work")[:2] == (10, 0)
        events[0].ack()  # a delivery from before the reset: void, even for the same event
        with pytest.raises(UnknownDelivery):
            consumer.flush_acks()
        for event in again:
            event.ack()
        consumer.flush_acks()
    assert counts(client, "q/reset", "work") == (0, 0, 0, 0)


def test_async_queue_consumer(broker: BrokerProcess) -> None:
    async def main() -> None:
        async with slipstream.connect_async(broker.address) as client:
            await client.create_stream("q/async", segments=2)
            await client.create_subscription("q/async", "work", mode="queue")
            async with client.producer("q/async") as producer:
                for i in range(50):
                    await producer.send(b"%d" % i)
            async with client.consumer("q/async", "work") as consumer:
                assert isinstance(consumer, slipstream.AsyncQueueConsumer)
                seen = set()
                async for event in consumer:
                    seen.add(int(event.value))
                    event.ack()
                    if len(seen) == 50:
                        break
                await consumer.flush_acks()
            info = await client.describe_subscription("q/async", "work")
            assert sum(s.backlog_events for s in info.segments) == 0

    asyncio.run(main())


def test_positions_committed_from_outside_move_the_queues_floor(client: slipstream.Client) -> None:
    client.create_stream("q/floor", segments=1)
    client.create_subscription("q/floor", "work", mode="queue")
    produce(client, "q/floor", 10, lambda i: None)
    with queue_consumer(client, "q/floor", "work") as consumer:
        take(consumer, 10)  # and never settled: the consumer leaves, they are open again
    client.commit_subscription("q/floor", "work", {0: 7})  # nobody joined: allowed
    with queue_consumer(client, "q/floor", "work") as consumer:
        assert sorted(e.offset for e in take(consumer, 3)) == [7, 8, 9]
        assert quiet(consumer, 0.5) == []

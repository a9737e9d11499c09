"""Subscriptions and consumer groups (ordered mode) against a real broker process.

Durable cursors (create at earliest, latest, a time or a StreamCut; list, describe with
backlog and lag, reset, delete), fan-out, groups that split a stream's segments and move them
when members join, leave or vanish, the three commit modes, positions committed inside a
transaction, and the typed error of every misuse.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable

import pytest
from conftest import BrokerProcess
from raw import RawConnection

import slipstream
from slipstream import (
    Consumer,
    Event,
    GroupActive,
    InvalidName,
    ModeMismatch,
    NotAssigned,
    OffsetOutOfRange,
    StaleGeneration,
    StreamNotFound,
    SubscriptionExists,
    SubscriptionNotFound,
    UnknownMember,
)
from slipstream.protocol import CommitPositions, Error, JoinGroup, LeaveGroup, PollGroup


def produce(client: slipstream.Client, stream: str, count: int, start: int = 0) -> None:
    with client.producer(stream, linger_ms=1) as producer:
        for i in range(start, start + count):
            producer.send(b"%d" % i, key=f"k{i % 7}")


def take(consumer: Consumer, count: int, timeout: float = 20.0) -> list[Event]:
    """Exactly ``count`` events (fails on fewer within ``timeout``)."""
    events: list[Event] = []
    deadline = time.monotonic() + timeout
    while len(events) < count and time.monotonic() < deadline:
        events.extend(consumer.poll(0.2))
    assert len(events) >= count, f"got {len(events)} of {count} events"
    return events


def quiet(consumers: Iterable[Consumer], seconds: float = 1.0) -> list[Event]:
    """Whatever arrives within ``seconds`` (to show that nothing does)."""
    events: list[Event] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for consumer in consumers:
            events.extend(consumer.poll(0.1))
    return events


def wait_for(check: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def values(events: Iterable[Event]) -> list[int]:
    return [int(e.value) for e in events]


# --- subscriptions ----------------------------------------------------------------------------


def test_create_list_describe_and_delete(client: slipstream.Client) -> None:
    client.create_stream("cg/orders", segments=3)
    produce(client, "cg/orders", 30)
    created = client.create_subscription("cg/orders", "billing")
    assert (created.name, created.mode, created.generation) == ("billing", "ordered", 0)
    client.create_subscription("cg/orders", "audit", start="latest")
    assert [s.name for s in client.list_subscriptions("cg/orders")] == ["audit", "billing"]
    billing = client.describe_subscription("cg/orders", "billing")
    assert sum(s.backlog_events for s in billing.segments) == 30
    assert all(s.position == 0 for s in billing.segments)
    assert all(s.lag_ms >= 0 for s in billing.segments)
    assert any(s.backlog_bytes > 0 for s in billing.segments)
    audit = client.describe_subscription("cg/orders", "audit")
    assert sum(s.backlog_events for s in audit.segments) == 0
    with pytest.raises(SubscriptionExists):
        client.create_subscription("cg/orders", "billing")
    again = client.create_subscription("cg/orders", "billing", start="latest", exist_ok=True)
    assert again.name == "billing"
    client.delete_subscription("cg/orders", "audit")
    assert [s.name for s in client.list_subscriptions("cg/orders")] == ["billing"]
    with pytest.raises(SubscriptionNotFound):
        client.describe_subscription("cg/orders", "audit")
    with pytest.raises(SubscriptionNotFound):
        client.delete_subscription("cg/orders", "audit")


def test_bad_subscription_requests_get_typed_errors(client: slipstream.Client) -> None:
    client.create_stream("cg/bad", segments=2)
    with pytest.raises(StreamNotFound):
        client.create_subscription("cg/missing", "x")
    with pytest.raises(InvalidName):
        client.create_subscription("cg/bad", "Not Valid")
    with pytest.raises(slipstream.InvalidArgument):
        client.create_subscription("cg/bad", "x", mode="fanout")
    with pytest.raises(OffsetOutOfRange):
        client.create_subscription("cg/bad", "x", start=slipstream.StreamCut("cg/bad", {0: 99}))
    with pytest.raises(SubscriptionNotFound):
        client.consumer("cg/bad", "nobody")
    with pytest.raises(SubscriptionNotFound):
        client.reset_subscription("cg/bad", "nobody", "earliest")


def test_a_subscription_starts_at_a_stream_cut_or_a_time(client: slipstream.Client) -> None:
    client.create_stream("cg/start", segments=1)
    produce(client, "cg/start", 10)
    middle = slipstream.StreamCut("cg/start", {0: 4})
    client.create_subscription("cg/start", "cut", start=middle)
    client.create_subscription("cg/start", "future", start="2999-01-01T00:00Z")
    with client.consumer("cg/start", "cut") as consumer:
        assert values(take(consumer, 6)) == list(range(4, 10))
    with client.consumer("cg/start", "future") as consumer:
        assert quiet([consumer], 0.5) == []


# --- one consumer, fan-out, commits -----------------------------------------------------------


def test_committed_events_are_not_delivered_again(client: slipstream.Client) -> None:
    client.create_stream("cg/once", segments=2)
    produce(client, "cg/once", 100)
    client.create_subscription("cg/once", "app")
    with client.consumer("cg/once", "app") as consumer:
        assert sorted(values(take(consumer, 100))) == list(range(100))
        consumer.commit()
    produce(client, "cg/once", 10, start=100)
    with client.consumer("cg/once", "app") as consumer:
        assert sorted(values(take(consumer, 10))) == list(range(100, 110))
        assert quiet([consumer], 0.5) == []
    described = client.describe_subscription("cg/once", "app")
    assert sum(s.backlog_events for s in described.segments) == 0  # auto-commit on close


def test_every_subscription_receives_every_event(client: slipstream.Client) -> None:
    client.create_stream("cg/fan", segments=3)
    for name in ("a", "b", "c"):
        client.create_subscription("cg/fan", name)
    produce(client, "cg/fan", 300)
    for name in ("a", "b", "c"):
        with client.consumer("cg/fan", name) as consumer:
            assert sorted(values(take(consumer, 300))) == list(range(300))


def test_auto_commit_leaves_the_batch_in_hand_uncommitted(client: slipstream.Client) -> None:
    client.create_stream("cg/auto", segments=1)
    produce(client, "cg/auto", 5)
    client.create_subscription("cg/auto", "app")
    consumer = client.consumer("cg/auto", "app")
    first = take(consumer, 5)
    assert values(first) == [0, 1, 2, 3, 4]
    time.sleep(1.5)  # an auto-commit interval: the batch in hand is not finished yet
    assert client.describe_subscription("cg/auto", "app").segments[0].position == 0
    produce(client, "cg/auto", 1, start=5)
    take(consumer, 1)  # asking for more finishes the first batch
    wait_for(lambda: client.describe_subscription("cg/auto", "app").segments[0].position >= 5)
    consumer.close()


def test_at_most_once_commits_before_handing_out(client: slipstream.Client) -> None:
    client.create_stream("cg/amo", segments=1)
    produce(client, "cg/amo", 5)
    client.create_subscription("cg/amo", "app")
    consumer = client.consumer("cg/amo", "app", commit="at_most_once")
    take(consumer, 5)
    assert client.describe_subscription("cg/amo", "app").segments[0].position == 5
    consumer.close()


def test_manual_commit_of_given_positions(client: slipstream.Client) -> None:
    client.create_stream("cg/manual", segments=1)
    produce(client, "cg/manual", 10)
    client.create_subscription("cg/manual", "app")
    with client.consumer("cg/manual", "app", commit="manual") as consumer:
        take(consumer, 10)
        consumer.commit({0: 3})
        assert client.describe_subscription("cg/manual", "app").segments[0].position == 3
        with pytest.raises(OffsetOutOfRange):
            consumer.commit({0: 11})
        with pytest.raises(slipstream.SegmentNotFound):
            consumer.commit({5: 0})
    with client.consumer("cg/manual", "app", commit="manual") as consumer:
        assert values(take(consumer, 7)) == list(range(3, 10))


# --- groups ----------------------------------------------------------------------------------


def test_a_group_splits_the_segments_and_rebalances_on_join_and_leave(
    client: slipstream.Client, broker: BrokerProcess
) -> None:
    client.create_stream("cg/group", segments=4)
    client.create_subscription("cg/group", "workers")
    first = client.consumer("cg/group", "workers", name="first")
    wait_for(lambda: first.assignment == {0, 1, 2, 3})
    with broker.client() as other:
        second = other.consumer("cg/group", "workers", name="second")
        wait_for(lambda: len(first.assignment) == 2 and len(second.assignment) == 2)
        assert first.assignment | second.assignment == {0, 1, 2, 3}
        produce(client, "cg/group", 400)
        got = take_all([first, second], 400)
        assert sorted(values(got[0] + got[1])) == list(range(400))
        for events in got:  # each member holds whole segments: per-key order
            for key in {e.key for e in events}:
                mine = values(e for e in events if e.key == key)
                assert mine == sorted(mine)
        members = client.describe_subscription("cg/group", "workers").members
        assert sorted(m.name for m in members) == ["first", "second"]
        second.close()
    wait_for(lambda: first.assignment == {0, 1, 2, 3})
    first.close()


def take_all(consumers: list[Consumer], count: int, timeout: float = 30.0) -> list[list[Event]]:
    got: list[list[Event]] = [[] for _ in consumers]
    deadline = time.monotonic() + timeout
    while sum(map(len, got)) < count and time.monotonic() < deadline:
        for i, consumer in enumerate(consumers):
            got[i].extend(consumer.poll(0.05))
    assert sum(map(len, got)) >= count, f"got {sum(map(len, got))} of {count}"
    return got


MEMBER = """
import sys, slipstream
client = slipstream.connect(sys.argv[1])
consumer = client.consumer(sys.argv[2], sys.argv[3], commit="manual", session_timeout=2.0)
for event in consumer:
    print(event.segment, int(event.value), flush=True)
"""


def start_member(broker: BrokerProcess, stream: str, subscription: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", MEMBER, broker.address, stream, subscription],
        stdout=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("how", ["kill -9", "stopped (SIGSTOP) past its session timeout"])
def test_a_vanished_members_uncommitted_events_go_to_the_others(
    client: slipstream.Client, broker: BrokerProcess, how: str
) -> None:
    client.create_stream("cg/crash", segments=2)
    client.create_subscription("cg/crash", "workers")
    produce(client, "cg/crash", 200)
    stays = client.consumer("cg/crash", "workers", commit="manual")
    member = start_member(broker, "cg/crash", "workers")
    try:
        assert member.stdout is not None
        segment = int(member.stdout.readline().split()[0])  # it reads, and never commits
        wait_for(lambda: stays.assignment == {1 - segment})
        if how == "kill -9":
            member.kill()
        else:
            member.send_signal(signal.SIGSTOP)
        wait_for(lambda: stays.assignment == {0, 1}, timeout=15)
        events = take(stays, 200)
        assert sorted(values(events)) == list(range(200))
        assert segment in {e.segment for e in events}
    finally:
        member.kill()
        member.wait()
        if member.stdout is not None:
            member.stdout.close()
        stays.close()


def test_a_reset_restarts_live_consumers(client: slipstream.Client) -> None:
    client.create_stream("cg/reset", segments=2)
    produce(client, "cg/reset", 50)
    client.create_subscription("cg/reset", "app")
    with client.consumer("cg/reset", "app", commit="manual") as consumer:
        take(consumer, 50)
        consumer.commit()
        before = client.describe_subscription("cg/reset", "app").generation
        reset = client.reset_subscription("cg/reset", "app", "earliest")
        assert reset.generation == before + 1
        assert sorted(values(take(consumer, 50))) == list(range(50))
        with pytest.raises(StaleGeneration):  # what was read before the reset
            client._loop.run(
                client._async._request(
                    slipstream.protocol.CommitPositions(
                        "cg/reset", "app", consumer.core.member_id, before, {0: 1}
                    )
                )
            )


def test_mode_mismatch_and_commits_from_outside_a_live_group(client: slipstream.Client) -> None:
    client.create_stream("cg/modes", segments=1)
    client.create_subscription("cg/modes", "work", mode="queue")
    with client.consumer("cg/modes", "work") as queue_consumer:  # a queue's own consumer
        assert isinstance(queue_consumer, slipstream.QueueConsumer)
    with pytest.raises(ModeMismatch):  # joined as an ordered group
        client._loop.run(
            client._async._request(JoinGroup("cg/modes", "work", "ordered", "x", 10_000))
        )
    client.create_subscription("cg/modes", "app")
    with client.consumer("cg/modes", "app"), pytest.raises(GroupActive):
        client.commit_subscription("cg/modes", "app", {0: 0})
    client.commit_subscription("cg/modes", "app", {0: 0})  # nobody joined: allowed


def test_deleting_the_stream_deletes_its_subscriptions(client: slipstream.Client) -> None:
    client.create_stream("cg/gone", segments=1)
    client.create_subscription("cg/gone", "app")
    consumer = client.consumer("cg/gone", "app")
    client.delete_stream("cg/gone")
    with pytest.raises((SubscriptionNotFound, StreamNotFound)):
        take(consumer, 1, timeout=10)
    consumer.close()
    client.create_stream("cg/gone", segments=1)
    assert client.list_subscriptions("cg/gone") == []


# --- transactions and restarts ----------------------------------------------------------------


def test_positions_commit_with_a_transaction_exactly_once(client: slipstream.Client) -> None:
    client.create_stream("cg/in", segments=2)
    client.create_stream("cg/out", segments=1)
    client.create_subscription("cg/in", "enrich")
    produce(client, "cg/in", 40)
    with client.consumer("cg/in", "enrich", commit="manual") as consumer:
        events = take(consumer, 40)
        first = [e for e in events if e.segment == 0]
        second = [e for e in events if e.segment == 1]
        assert first and second
        with client.transaction("enricher") as txn:
            for event in first:
                txn.send("cg/out", event.value)
            txn.commit_position(consumer, {0: first[-1].offset + 1})
        # a transaction that aborts commits no position
        with pytest.raises(RuntimeError), client.transaction("enricher") as txn:
            for event in second:
                txn.send("cg/out", event.value)
            txn.commit_position(consumer)
            raise RuntimeError("the transform failed")
    positions = client.describe_subscription("cg/in", "enrich").segments
    assert [s.position for s in positions] == [len(first), 0]
    with client.reader("cg/out", end=client.tail("cg/out")) as reader:
        assert sorted(values(reader)) == sorted(values(first))
    with client.consumer("cg/in", "enrich", commit="manual") as consumer:
        again = take(consumer, len(second))
        assert [(e.segment, e.offset) for e in again] == [(e.segment, e.offset) for e in second]
        assert quiet([consumer], 0.5) == []


def test_a_zombie_cannot_commit_positions_in_a_transaction(
    client: slipstream.Client, broker: BrokerProcess
) -> None:
    client.create_stream("cg/zin", segments=1)
    client.create_stream("cg/zout", segments=1)
    client.create_subscription("cg/zin", "app")
    produce(client, "cg/zin", 5)
    zombie = client.consumer("cg/zin", "app", commit="manual", session_timeout=1.0)
    take(zombie, 5)
    txn = client.transaction("zombie")
    txn.send("cg/zout", b"late")
    txn.commit_position(zombie)
    poll = zombie.core._poll
    assert poll is not None
    client._loop.call(poll.cancel)  # the process stalls (a long pause): no more polls
    with broker.client() as other:
        successor = other.consumer("cg/zin", "app", commit="manual")
        wait_for(lambda: successor.assignment == {0})
        with pytest.raises((NotAssigned, UnknownMember)):
            txn.commit()
        with client.reader("cg/zout", end=client.tail("cg/zout")) as reader:
            assert list(reader) == []  # the transaction aborted
        assert client.describe_subscription("cg/zin", "app").segments[0].position == 0
        assert values(take(successor, 5)) == list(range(5))
        successor.close()
    zombie.close()


def test_a_consumer_rejoins_after_a_broker_restart(
    client: slipstream.Client, broker: BrokerProcess
) -> None:
    client.create_stream("cg/restart", segments=2)
    client.create_subscription("cg/restart", "app")
    produce(client, "cg/restart", 100)
    consumer = client.consumer("cg/restart", "app", commit="manual")
    first = take(consumer, 100)
    consumer.commit()
    broker.restart()
    produce(client, "cg/restart", 50, start=100)
    more = take(consumer, 50, timeout=40)
    assert sorted(values(first + more)) == list(range(150))
    consumer.close()


def test_the_asyncio_consumer_is_the_same_api(broker: BrokerProcess) -> None:
    async def main() -> list[int]:
        async with slipstream.connect_async(broker.address) as client:
            await client.create_stream("cg/async", segments=2)
            await client.create_subscription("cg/async", "app")
            async with client.producer("cg/async") as producer:
                for i in range(20):
                    await producer.send(b"%d" % i, key=f"k{i}")
            got: list[int] = []
            async with client.consumer("cg/async", "app", commit="manual") as consumer:
                async for event in consumer:
                    got.append(int(event.value))
                    if len(got) == 20:
                        break
                await consumer.commit()
                assert consumer.assignment == {0, 1}
            info = await client.describe_subscription("cg/async", "app")
            assert sum(s.position for s in info.segments) == 20
            return got

    assert sorted(asyncio.run(main())) == list(range(20))


def test_misuse_of_the_group_protocol_gets_typed_errors(
    client: slipstream.Client, broker: BrokerProcess
) -> None:
    client.create_stream("cg/raw", segments=2)
    client.create_subscription("cg/raw", "app")
    with client.consumer("cg/raw", "app") as member:
        wait_for(lambda: member.assignment == {0, 1})
        with broker.client() as other:
            second = other.consumer("cg/raw", "app")
            wait_for(lambda: len(member.assignment) == 1 and len(second.assignment) == 1)
            (foreign,) = second.assignment
            with pytest.raises(NotAssigned) as caught:  # another member's segment
                member.commit({foreign: 0})
            assert caught.value.details == {"segments": [foreign]}
            second.close()
        raw = RawConnection(broker.address)
        raw.receive()
        try:
            for message, error in [
                (PollGroup(member.core.member_id), UnknownMember),  # another connection's member
                (LeaveGroup(424242), UnknownMember),
                (JoinGroup("cg/raw", "app", "ordered", "x", 10), slipstream.InvalidArgument),
                (JoinGroup("cg/raw", "nobody", "ordered", "x"), SubscriptionNotFound),
                (CommitPositions("cg/raw", "app", 424242, 0, {0: 0}), UnknownMember),
            ]:
                raw.send_frame(message, 9)
                reply = raw.receive().message
                assert isinstance(reply, Error) and reply.code == error.code, (message, reply)
        finally:
            raw.close()
        assert len(take_all([member], 0)) == 1  # the member is unharmed
    client.delete_stream("cg/raw")
    with pytest.raises(StreamNotFound):
        client.reset_subscription("cg/raw", "app", "earliest")

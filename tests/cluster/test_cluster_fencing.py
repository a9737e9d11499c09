"""A group's coordinator paused past its lease (SIGSTOP) while a member's ack or commit waits
in its socket (issue 20): another broker takes the coordinating container over and the group
goes on there; when the old coordinator resumes (SIGCONT) it handles the waiting request with
the state it had, and the catalog refuses that write (the coordinator's lease fences queue
state, positions and resets, ``MetaStore.commit_positions(lease=...)``). The member is
answered WrongBroker, never success; the catalog keeps the new coordinator's state, so no
event whose ack was answered is delivered again and no committed position goes back, also
once the old broker takes the group back from the catalog."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from harness import Cluster
from objectstores import SeaweedFS
from pg import PgCluster

import slipstream
from slipstream import QueueConsumer, SlipstreamError, WrongBroker
from slipstream.client._connection import Connection
from slipstream.cluster import coordinator
from slipstream.protocol import (
    CommitPositions,
    EventsDelivered,
    FetchEvents,
    GroupAssignment,
    GroupJoined,
    JoinGroup,
    Message,
    PollGroup,
    Settled,
    SettleEvents,
)
from slipstream.storage import SubscriptionRecord
from slipstream.storage._meta_pg import PostgresMetaStore

STREAM = "fence/orders"
SEGMENTS = 2
#: long enough that nothing expires at the paused broker by itself: it resumes with the
#: state it had, the member and its deliveries still its own
SESSION_MS = 300_000


@pytest.fixture
def cluster(tmp_path: Path, postgres: PgCluster, seaweedfs: SeaweedFS) -> Iterator[Cluster]:
    base = tmp_path / "cluster"
    base.mkdir()
    # a 4 s lease: a broker slowed by a loaded machine keeps its containers until paused
    with Cluster(
        base, postgres, seaweedfs, brokers=2, containers=2, lease_ttl=4.0
    ).start() as started:
        yield started


class Member:
    """One group member on its own connection to one broker, driven from the test's thread
    (its event loop runs in another): ``call`` waits for the answer, ``send`` does not."""

    def __init__(self, address: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.connection: Connection = self._run(Connection.open(address)).result(30)
        self.id = 0

    def _run(self, work: Coroutine[Any, Any, Any]) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(work, self.loop)

    def send(self, message: Message) -> Future[Any]:
        async def request() -> tuple[Message, Any]:
            return await self.connection.request(message)

        return self._run(request())

    def call(self, message: Message) -> tuple[Message, Any]:
        reply: tuple[Message, Any] = self.send(message).result(60)  # a bound against hanging
        return reply

    def join(self, name: str, mode: str) -> int:
        """Join (WrongBroker, asked again: the broker is still taking the container)."""
        deadline = time.monotonic() + 30
        while True:
            try:
                joined, _ = self.call(JoinGroup(STREAM, name, mode, "member", SESSION_MS))
                break
            except WrongBroker:
                assert time.monotonic() < deadline, "the broker never coordinated the group"
                time.sleep(0.1)
        assert isinstance(joined, GroupJoined)
        self.id = joined.member_id
        return joined.generation

    def close(self) -> None:
        async def shut() -> None:
            self.connection.close()
            await asyncio.sleep(0.05)  # the transport closes its socket on a later turn

        self._run(shut()).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def _stored(cluster: Cluster, name: str) -> SubscriptionRecord:
    """The subscription as the catalog has it now (read directly, not through a broker)."""
    meta = PostgresMetaStore(cluster.dsn)
    try:
        (stream,) = [r for r in meta.streams() if r.name == STREAM]
        (record,) = [r for r in meta.subscriptions(stream.id) if r.name == name]
    finally:
        meta.close()
    return record


def _setup(cluster: Cluster, name: str) -> tuple[int, int]:
    """(index of the broker coordinating subscription ``name``, the other's), once both know
    the subscription."""
    for broker in cluster.brokers:
        with slipstream.connect(broker.address) as one:
            deadline = time.monotonic() + 30
            while name not in {s.name for s in one.list_subscriptions(STREAM)}:
                assert time.monotonic() < deadline, f"{broker.address} does not know {name}"
                time.sleep(0.05)
    holders = cluster.wait_until_all_containers_served()
    home = int(holders[coordinator(f"{STREAM}/{name}", cluster.containers)][1:])
    return home, 1 - home


def _take_over(cluster: Cluster, paused: int, other: int) -> None:
    """Wait until broker ``other`` holds every container (``paused``'s lease expired)."""
    holders = cluster.wait_until_all_containers_served()
    assert set(holders.values()) == {f"b{other}"}, holders
    assert paused in cluster.paused


def _answer(pending: Future[Any]) -> Message | SlipstreamError:
    """The paused broker's answer to the waiting request: the reply, or the error."""
    try:
        reply, _ = pending.result(60)
    except SlipstreamError as exc:
        return exc
    assert isinstance(reply, Message)
    return reply


def _queue_consumer(client: slipstream.Client, name: str) -> QueueConsumer:
    consumer = client.consumer(STREAM, name, max_in_flight=64)
    assert isinstance(consumer, QueueConsumer)
    return consumer


@pytest.mark.parametrize("late", ["ack", "fetch"])
def test_a_paused_queue_coordinators_late_ack_is_refused_and_nothing_acked_comes_again(
    cluster: Cluster, late: str
) -> None:
    """A member fetches events from the queue's coordinator, which is paused before the
    member's ack (or its next fetch) arrives. The other broker takes the queue over from the
    catalog and delivers everything (those events again: their ack was never answered), each
    acked once. On resume the paused broker handles the old request: refused (WrongBroker;
    an ack stores nothing, a fetch hands out nothing of the old state, where every event is
    still unacknowledged). History check over every delivery and answered ack: no event is
    delivered after an ack of it was answered, at the new coordinator, by the old one as it
    wakes, nor at the old one once it serves the queue again from the catalog (the other
    broker stopped)."""
    count, name = 400, "work"
    history: list[tuple[str, int, int]] = []  # ("delivered" | "acked", segment, offset)
    with slipstream.connect(cluster.addresses(), reconnect_timeout=60) as client:
        client.create_stream(STREAM, SEGMENTS)
        client.create_subscription(STREAM, name, mode="queue", ack_timeout=SESSION_MS / 1000)
        with client.producer(STREAM, linger_ms=2) as producer:
            for i in range(count):
                producer.send(b"%d" % i, key=f"k{i}")
    home, other = _setup(cluster, name)

    stale = Member(cluster.brokers[home].address)
    try:
        stale.join(name, "queue")
        delivered, _ = stale.call(FetchEvents(stale.id, 50, wait_ms=5_000))
        assert isinstance(delivered, EventsDelivered) and delivered.deliveries
        held = [[segment, offset] for segment, offset, _ in delivered.deliveries]
        history.extend(("delivered", s, o) for s, o in held)
        time.sleep(1.5)  # (its delivery counts are written meanwhile: not what is tested)
        cluster.pause(home)
        pending = stale.send(
            SettleEvents(stale.id, acks=held)
            if late == "ack"
            else FetchEvents(stale.id, 50, wait_ms=5_000)
        )
        _take_over(cluster, home, other)

        ends: dict[int, int] = {}
        with (
            slipstream.connect(cluster.brokers[other].address, reconnect_timeout=60) as at_new,
            _queue_consumer(at_new, name) as consumer,
        ):
            settled: set[int] = set()
            deadline = time.monotonic() + 120
            while len(settled) < count:
                assert time.monotonic() < deadline, f"{len(settled)} of {count} acked"
                events = consumer.poll(0.2)
                history.extend(("delivered", e.segment, e.offset) for e in events)
                for event in events:
                    event.ack()
                consumer.flush_acks()  # answered: stored
                history.extend(("acked", e.segment, e.offset) for e in events)
                settled.update(int(e.value) for e in events)
                for e in events:
                    ends[e.segment] = max(ends.get(e.segment, 0), e.offset + 1)
        assert len(ends) == SEGMENTS

        cluster.resume(home)
        answer = _answer(pending)
        if isinstance(answer, Settled):
            history.extend(("acked", s, o) for s, o in held if [s, o] not in answer.unknown)
        if isinstance(answer, EventsDelivered):
            history.extend(("delivered", s, o) for s, o, _ in answer.deliveries)
        assert isinstance(answer, WrongBroker), f"the late {late} was answered {answer!r}"
    finally:
        stale.close()
    assert _stored(cluster, name).positions == ends  # not back to the old floors

    # the old broker serves the queue again, from the catalog alone
    cluster.wait_until_all_containers_served()  # (balanced: it took its share back)
    assert cluster.stop(other) == 0
    cluster.wait_until_all_containers_served()
    with (
        slipstream.connect(cluster.brokers[home].address, reconnect_timeout=60) as at_old,
        _queue_consumer(at_old, name) as consumer,
    ):
        for _ in range(4):
            events = consumer.poll(0.5)
            history.extend(("delivered", e.segment, e.offset) for e in events)
    acked: set[tuple[int, int]] = set()
    again = []
    for what, segment, offset in history:
        if what == "acked":
            acked.add((segment, offset))
        elif (segment, offset) in acked:
            again.append((segment, offset))
    assert again == [], f"{len(again)} deliveries of events whose ack was answered: {again[:5]}"


def test_a_paused_group_coordinators_late_commit_is_refused_and_positions_never_go_back(
    cluster: Cluster,
) -> None:
    """An ordered group's member commits at its coordinator, which is paused before the
    member's next (older-than-what-follows) commit arrives. The other broker takes the group
    over and a member there commits further. On resume the paused broker handles the old
    commit: refused (WrongBroker), and the catalog's positions stay where the new coordinator
    committed them; the old broker, coordinating the group again from the catalog, grants
    from there."""
    name = "positions"
    with slipstream.connect(cluster.addresses(), reconnect_timeout=60) as client:
        client.create_stream(STREAM, SEGMENTS)
        client.create_subscription(STREAM, name, mode="ordered")
        with client.producer(STREAM, linger_ms=2) as producer:
            for i in range(400):
                producer.send(b"%d" % i, key=f"k{i}")
    home, other = _setup(cluster, name)
    answered: list[dict[int, int]] = []  # commits answered Done, in order

    def assigned(member: Member) -> dict[int, int]:
        reply, _ = member.call(PollGroup(member.id, wait_ms=0))
        assert isinstance(reply, GroupAssignment)
        assert sorted(reply.assigned) == list(range(SEGMENTS)), reply
        return reply.assigned

    def commit(member: Member, generation: int, positions: dict[int, int]) -> None:
        member.call(CommitPositions(STREAM, name, member.id, generation, positions))
        answered.append(positions)

    stale = Member(cluster.brokers[home].address)
    try:
        generation = stale.join(name, "ordered")
        assert assigned(stale) == {0: 0, 1: 0}
        commit(stale, generation, {0: 10, 1: 10})
        cluster.pause(home)
        pending = stale.send(CommitPositions(STREAM, name, stale.id, generation, {0: 20, 1: 20}))
        _take_over(cluster, home, other)

        new = Member(cluster.brokers[other].address)
        try:
            generation = new.join(name, "ordered")
            assert assigned(new) == {0: 10, 1: 10}  # the catalog's, as committed
            commit(new, generation, {0: 40, 1: 40})
        finally:
            new.close()

        cluster.resume(home)
        answer = _answer(pending)
        if not isinstance(answer, SlipstreamError):
            answered.append({0: 20, 1: 20})
        assert isinstance(answer, WrongBroker), f"the late commit was answered {answer!r}"
    finally:
        stale.close()
    assert _stored(cluster, name).positions == answered[-1] == {0: 40, 1: 40}

    cluster.wait_until_all_containers_served()
    assert cluster.stop(other) == 0
    cluster.wait_until_all_containers_served()
    again = Member(cluster.brokers[home].address)
    try:
        again.join(name, "ordered")
        assert assigned(again) == {0: 40, 1: 40}  # never back to 20
    finally:
        again.close()

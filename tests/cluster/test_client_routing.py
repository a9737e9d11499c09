"""The cluster-aware client against real brokers in cluster mode (issue 20): it bootstraps from
a list with a dead address, maps every container to the broker serving it, sends each segment's
appends and follows to that broker, and when one is killed -9 mid-stream, resends what was not
acknowledged to the broker that takes its containers over (exactly once, in order per key) and
follows again there from the next offset not received (no loss, no duplicate)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import free_port
from harness import Cluster
from objectstores import SeaweedFS
from pg import PgCluster

import slipstream
from slipstream import Position
from slipstream.client._cluster import Cluster as ClientCluster
from slipstream.cluster import coordinator

STREAM = "routing/orders"
SEGMENTS = 6
KEYS = 64  # enough that every segment gets some


@pytest.fixture
def cluster(tmp_path: Path, postgres: PgCluster, seaweedfs: SeaweedFS) -> Iterator[Cluster]:
    base = tmp_path / "cluster"
    base.mkdir()
    with Cluster(base, postgres, seaweedfs, brokers=3, containers=4).start() as started:
        yield started


def _owners_by_address(cluster: Cluster) -> dict[int, str]:
    """Container -> the address of the broker holding its lease (the catalog's view)."""
    served = cluster.wait_until_all_containers_served()
    return {c: cluster.brokers[int(owner[1:])].address for c, owner in served.items()}


def test_the_client_maps_each_container_to_the_broker_serving_it(cluster: Cluster) -> None:
    dead = f"127.0.0.1:{free_port()}"
    with slipstream.connect(f"{dead},{cluster.addresses()}", timeout=2) as client:
        state = client._async.cluster
        assert not state.standalone
        assert state.containers == cluster.containers
        assert dict(enumerate(state.owners)) == _owners_by_address(cluster)


def _key_order(events: list[tuple[str, int]]) -> dict[str, list[int]]:
    by_key: dict[str, list[int]] = {}
    for key, value in events:
        by_key.setdefault(key, []).append(value)
    return by_key


def test_a_producer_and_a_reader_span_containers_of_different_brokers(cluster: Cluster) -> None:
    with slipstream.connect(cluster.addresses()) as client:
        info = client.create_stream(STREAM, SEGMENTS)
        owners = _owners_by_address(cluster)
        assert len({owners[s.container] for s in info.segments}) >= 2, info.segments
        with client.producer(STREAM) as producer:
            receipts = [producer.send(b"%d" % i, key=f"k{i % KEYS}") for i in range(600)]
        positions = [r.result() for r in receipts]
        assert len({p.segment for p in positions}) == SEGMENTS
        events = list(client.reader(STREAM, end=client.tail(STREAM)))
        assert sorted(int(e.value) for e in events) == list(range(600))
        for values in _key_order([(e.key.decode(), int(e.value)) for e in events]).values():
            assert values == sorted(values)
        used = {c.address for c in client._async.cluster.live()}
        assert len(used & {owners[s.container] for s in info.segments}) >= 2


def test_a_broker_killed_mid_stream_loses_and_repeats_nothing(cluster: Cluster) -> None:
    """kill -9 of the broker serving some of the stream's segments while a producer sends and
    a reader follows: afterwards every acknowledged event is in the stream once, at its
    acknowledged position, each key's in send order; the reader saw every one of them once,
    each key's in order, following the moved segments at their new owner."""

    def kill(victim: int) -> Callable[[], bool]:
        cluster.kill(victim)
        return lambda: True

    _produce_and_read_through(cluster, kill)


def test_containers_handed_back_to_a_restarted_broker_are_followed(cluster: Cluster) -> None:
    """The same, then the killed broker starts again and the others hand containers over to
    it (balanced assignment): appends and follows refused with WrongBroker go to it, still
    without loss or duplicate."""

    def kill_and_restart(victim: int) -> Callable[[], bool]:
        cluster.kill(victim)
        cluster.wait_until_all_containers_served()
        cluster.restart(victim)
        return lambda: any(
            owner == f"b{victim}" and live for owner, _, live in cluster.leases().values()
        )

    state = _produce_and_read_through(cluster, kill_and_restart)
    assert state.moves > 0  # WrongBroker answers named the new owners


def _produce_and_read_through(
    cluster: Cluster, fault: Callable[[int], Callable[[], bool]]
) -> ClientCluster:
    """Produce keyed events (idempotent) and follow the stream with a reader while ``fault``
    hits the broker serving segment 0's container (mid-stream: a batch in flight, earlier ones
    being read); production goes on until the condition ``fault`` returns holds, then a while
    more. Checks the stream and the reader's view; returns the client's cluster state."""
    with slipstream.connect(cluster.addresses(), reconnect_timeout=60) as client:
        info = client.create_stream(STREAM, SEGMENTS)
        owners = _owners_by_address(cluster)
        victim_address = owners[info.segments[0].container]
        victim = next(i for i, b in enumerate(cluster.brokers) if b.address == victim_address)

        reader = client.reader(STREAM)
        seen: list[tuple[str, int, int, int]] = []  # key, value, segment, offset
        failed: list[BaseException] = []

        def read() -> None:
            try:
                for event in reader:
                    assert event.key is not None
                    seen.append((event.key.decode(), int(event.value), event.segment, event.offset))
            except BaseException as exc:
                failed.append(exc)

        reading = threading.Thread(target=read, daemon=True)
        reading.start()
        acknowledged: dict[int, Position] = {}
        settled: Callable[[], bool] | None = None
        rounds_after = 0
        deadline = time.monotonic() + 180  # a bound against hanging
        with client.producer(STREAM, linger_ms=2) as producer:
            start = 0
            while rounds_after < 5 and time.monotonic() < deadline:
                receipts = [
                    (n, producer.send(b"%d" % n, key=f"k{n % KEYS}"))
                    for n in range(start, start + 200)
                ]
                if start == 2000:  # mid-stream: these are in flight, earlier ones being read
                    _wait(lambda: len(seen) >= 1000 or bool(failed), "the reader to start")
                    settled = fault(victim)
                for n, receipt in receipts:
                    acknowledged[n] = receipt.result(timeout=120)
                if settled is not None and start >= 4000 and (rounds_after or settled()):
                    rounds_after += 1
                start += 200
        assert rounds_after == 5, "the fault did not settle"
        _wait(lambda: {v for _, v, _, _ in seen} >= acknowledged.keys() or bool(failed),
              "the reader to see every acknowledged event")  # fmt: skip
        reader_saw = list(seen)
        assert not failed, failed

        tail = client.tail(STREAM)
        stored = list(client.reader(STREAM, end=tail))
        at = {int(e.value): Position(e.segment, e.offset) for e in stored}
        assert len(at) == len(stored), "an event is stored twice"
        for n, position in acknowledged.items():
            assert at.get(n) == position, (n, position, at.get(n))
        for values in _key_order([(e.key.decode(), int(e.value)) for e in stored]).values():
            assert values == sorted(values)

        positions = [(s, o) for _, _, s, o in reader_saw]
        assert len(set(positions)) == len(positions), "the reader saw an event twice"
        assert all(at[v] == Position(s, o) for _, v, s, o in reader_saw)
        for values in _key_order([(k, v) for k, v, _, _ in reader_saw]).values():
            assert values == sorted(values)
        moved = {s.number for s in info.segments if owners[s.container] == victim_address}
        after_fault = {s for _, v, s, _ in reader_saw if v >= 2200}
        assert moved & after_fault, (moved, after_fault)
        reader.close()
        return client._async.cluster


def _wait(condition: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    """A bound against hanging, not a timing assertion."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_consumer_group_rejoins_where_its_coordinator_moved(cluster: Cluster) -> None:
    """kill -9 of the broker coordinating a subscription's group while a consumer reads: the
    consumer joins again at the broker that took the coordinator's container over and reads
    on; every event is delivered (at least once: what was not committed comes again), each
    segment's in offset order within a grant."""
    with slipstream.connect(cluster.addresses(), reconnect_timeout=60) as client:
        client.create_stream(STREAM, 4)
        client.create_subscription(STREAM, "workers")
        owners = _owners_by_address(cluster)
        coordinating = owners[coordinator(f"{STREAM}/workers", cluster.containers)]
        victim = next(i for i, b in enumerate(cluster.brokers) if b.address == coordinating)
        with client.producer(STREAM) as producer:
            for n in range(400):
                producer.send(b"%d" % n, key=f"k{n % KEYS}")
        seen: set[int] = set()
        deliveries: list[tuple[int, int]] = []  # segment, offset
        with client.consumer(STREAM, "workers", name="c1", session_timeout=6) as consumer:
            deadline = time.monotonic() + 180  # a bound against hanging
            while len(seen) < 800 and time.monotonic() < deadline:
                for event in consumer.poll(timeout=1.0):
                    seen.add(int(event.value))
                    deliveries.append((event.segment, event.offset))
                if len(seen) >= 200 and cluster.running(victim):
                    cluster.kill(victim)
                    with client.producer(STREAM) as producer:
                        for n in range(400, 800):
                            producer.send(b"%d" % n, key=f"k{n % KEYS}")
            group = consumer.core.connection
            assert group is not None and group.address != coordinating  # it rejoined elsewhere
        assert not cluster.running(victim)
        assert seen == set(range(800))
        last: dict[int, int] = {}
        for segment, offset in deliveries:  # the next, or back to a commit; never a gap
            assert offset <= last.get(segment, -1) + 1, (segment, offset, last.get(segment))
            last[segment] = offset

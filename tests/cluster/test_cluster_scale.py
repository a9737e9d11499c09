"""Scaling across the brokers of a cluster (issue 20; docs/cluster.md, "Scaling across
brokers"), on real brokers in cluster mode over PostgreSQL and SeaweedFS:

- neighbours served by different brokers merge, under load from idempotent producers, and the
  whole history holds (no acknowledged event lost, none stored twice, every key in order
  across the scale); any broker describes the merged successor;
- the coordinating broker killed -9 after the other prepared its segment (crash point
  ``scale.prepared``) leaves the stream as it was and appendable: the prepared segment takes
  appends again once its deadline passed and the catalog has no record of the merge;
- a transaction coordinated by one broker that staged into a segment another broker seals
  aborts cleanly (nothing visible) or commits wholly before the seal, never half."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from checker import Sent, check_history, encode
from harness import Cluster, Raw, ask
from objectstores import SeaweedFS
from pg import PgCluster
from raw import batch

import slipstream
from slipstream import Position
from slipstream.cluster import coordinator
from slipstream.protocol import (
    Append,
    AppendAck,
    BeginTxn,
    Cut,
    DescribeStream,
    EndTxn,
    Error,
    GetCut,
    InitProducer,
    ProducerGrant,
    ScaleStream,
    SegmentInfo,
    StreamInfo,
    TxnBegun,
    TxnEnded,
)
from slipstream.streams import ScalingDecision, key_hash

STREAM = "scale/orders"
CONTAINERS = 4
KEYS = 12  # per producer


def _cluster(tmp_path: Path, postgres: PgCluster, seaweedfs: SeaweedFS, fault: str = "") -> Cluster:
    base = tmp_path / "cluster"
    base.mkdir()
    cluster = Cluster(base, postgres, seaweedfs, brokers=2, containers=CONTAINERS)
    for broker in cluster.brokers:
        if fault:
            broker.env["SLIPSTREAM_FAULT"] = fault
    cluster.start()
    deadline = time.monotonic() + 60  # both brokers serve containers (a bound, not a timing)
    while len(set(cluster.wait_until_all_containers_served().values())) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    return cluster


@pytest.fixture
def cluster(tmp_path: Path, postgres: PgCluster, seaweedfs: SeaweedFS) -> Iterator[Cluster]:
    with _cluster(tmp_path, postgres, seaweedfs) as started:
        yield started


def _address(cluster: Cluster, broker_id: str) -> str:
    return cluster.brokers[int(broker_id[1:])].address


def _describe(cluster: Cluster, via: int = 0) -> StreamInfo:
    deadline = time.monotonic() + 60
    while True:
        try:
            info = ask(cluster.brokers[via].address, DescribeStream(STREAM))
            assert isinstance(info, StreamInfo), info
            return info
        except (slipstream.WrongBroker, slipstream.BrokerUnavailable):
            assert time.monotonic() < deadline  # a container moving: ask again (a bound)
            time.sleep(0.2)


def _cross_pair(cluster: Cluster) -> tuple[SegmentInfo, SegmentInfo, str, str]:
    """Two open neighbours served by different brokers: (first, second, the first's broker
    (the merge's coordinator), the second's)."""
    owners = cluster.wait_until_all_containers_served()
    segments = sorted(
        (s for s in _describe(cluster).segments if not s.sealed), key=lambda s: s.key_lo
    )
    for a, b in itertools.pairwise(segments):
        if owners[a.container] != owners[b.container]:
            first, second = sorted((a, b), key=lambda s: s.number)
            return first, second, owners[first.container], owners[second.container]
    raise AssertionError(f"no neighbours on different brokers: {segments} {owners}")


class Load:
    """Idempotent producers in threads, each recording every acknowledged position and every
    failure (a failed event is never sent again: in doubt, at most once)."""

    def __init__(self, cluster: Cluster, producers: int = 3) -> None:
        self.acknowledged: dict[bytes, Position] = {}
        self.failures: list[str] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._run, args=(cluster.addresses(), p), daemon=True)
            for p in range(producers)
        ]
        for thread in self.threads:
            thread.start()

    def _run(self, addresses: str, producer_id: int) -> None:
        client = slipstream.connect(addresses, reconnect_timeout=60)
        try:
            producer = client.producer(STREAM, linger_ms=2, batch_bytes=16 * 1024)
            seq = 0
            pending: list[tuple[bytes, slipstream.Receipt]] = []
            while not self.stop.is_set() or pending:
                if not self.stop.is_set() and len(pending) < 500:
                    for _ in range(10):
                        key = f"p{producer_id}-k{seq % KEYS}"
                        value = encode(Sent(producer_id, key, seq))
                        pending.append((value, producer.send(value, key=key)))
                        seq += 1
                done = [(v, r) for v, r in pending if r.done()]
                pending = [(v, r) for v, r in pending if not r.done()]
                for value, receipt in done:
                    try:
                        position = receipt.result()
                    except slipstream.SlipstreamError as exc:
                        with self.lock:
                            self.failures.append(f"{value!r}: {exc}")
                        continue
                    with self.lock:
                        self.acknowledged[value] = position
                time.sleep(0.003)
            producer.close()
        finally:
            client.close()

    def count(self) -> int:
        with self.lock:
            return len(self.acknowledged)

    def landed_in(self, segments: set[int]) -> int:
        with self.lock:
            return sum(p.segment in segments for p in self.acknowledged.values())

    def wait_for(self, condition: Callable[[], bool], what: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, f"{what}: {self.failures[:5]}"  # a bound
            assert all(t.is_alive() for t in self.threads), f"a producer died: {self.failures[:5]}"
            time.sleep(0.05)

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(240)
            assert not thread.is_alive(), "a producer did not finish"


def _history(cluster: Cluster, load: Load) -> list[str]:
    with slipstream.connect(cluster.addresses()) as client:
        events = list(client.reader(STREAM, end=client.tail(STREAM)))
    return check_history(load.acknowledged, events)


def test_neighbours_on_two_brokers_merge_under_load_and_keep_the_whole_history(
    cluster: Cluster,
) -> None:
    with slipstream.connect(cluster.addresses()) as client:
        client.create_stream(STREAM, 4)
    load = Load(cluster)
    try:
        load.wait_for(lambda: load.count() > 1500, "load before the merge")
        first, second, leader, other = _cross_pair(cluster)
        # the broker not serving the first segment sends the client to the one that does
        with pytest.raises(slipstream.WrongBroker):
            ask(_address(cluster, other), ScaleStream(STREAM, [first.number, second.number], 1))
        merged = ask(
            _address(cluster, leader), ScaleStream(STREAM, [first.number, second.number], 1)
        )
        assert isinstance(merged, StreamInfo), merged
        (successor,) = [
            s for s in merged.segments if s.predecessors == [first.number, second.number]
        ]
        before = load.count()
        load.wait_for(
            lambda: load.landed_in({successor.number}) > 300 and load.count() > before + 1500,
            "load after the merge, in the successor",
        )
    finally:
        load.finish()
    assert load.failures == [], load.failures[:10]
    # every broker describes the merge: old segments sealed at their ends, the successor open
    for via in range(len(cluster.brokers)):
        info = _describe(cluster, via)
        by_number = {s.number: s for s in info.segments}
        assert by_number[first.number].sealed and by_number[second.number].sealed
        assert not by_number[successor.number].sealed
        assert by_number[successor.number].predecessors == [first.number, second.number]
    problems = _history(cluster, load)
    assert not problems, "\n".join(problems[:30])
    # the ends the catalog recorded hold every acknowledged event of the old segments, and are
    # the ends their brokers describe (a broker that took appends past them would lose those
    # at its next restart, when the segment is rebuilt from the catalog)
    with slipstream.connect(cluster.addresses()) as client:
        (scale,) = client.scale_history(STREAM)
    assert set(scale.sealed) == {first.number, second.number}
    for via in range(len(cluster.brokers)):
        described = {s.number: s.end_offset for s in _describe(cluster, via).segments if s.sealed}
        assert described == scale.sealed, (via, described, scale.sealed)
    for number, end in scale.sealed.items():
        stored = [p.offset for p in load.acknowledged.values() if p.segment == number]
        assert stored and max(stored) < end, (number, max(stored), end)


def test_a_coordinator_killed_after_the_prepare_leaves_the_stream_whole_and_appendable(
    tmp_path: Path, postgres: PgCluster, seaweedfs: SeaweedFS
) -> None:
    with _cluster(tmp_path, postgres, seaweedfs, fault="scale.prepared") as cluster:
        with slipstream.connect(cluster.addresses()) as client:
            client.create_stream(STREAM, 4)
        load = Load(cluster)
        try:
            load.wait_for(lambda: load.count() > 1000, "load before the merge")
            first, second, leader, other = _cross_pair(cluster)
            leader_index, other_index = int(leader[1:]), int(other[1:])
            with pytest.raises(slipstream.SlipstreamError):  # the connection drops: killed
                ask(cluster.brokers[leader_index].address,
                    ScaleStream(STREAM, [first.number, second.number], 1))  # fmt: skip
            deadline = time.monotonic() + 30
            while cluster.running(leader_index):
                assert time.monotonic() < deadline, "the crash point was not reached"
                time.sleep(0.05)
            assert "prepared segments" in cluster.brokers[other_index].log()
            # the prepared segment takes appends again once its deadline passed unheard
            before = load.landed_in({second.number})
            load.wait_for(
                lambda: load.landed_in({second.number}) > before + 200,
                "appends to the prepared segment after the coordinator died",
            )
            assert "take appends again" in cluster.brokers[other_index].log()
            cluster.brokers[leader_index].env.pop("SLIPSTREAM_FAULT")
            cluster.restart(leader_index)
            cluster.wait_until_all_containers_served()
            before = load.count()
            load.wait_for(lambda: load.count() > before + 1000, "load after the restart")
        finally:
            load.finish()
        info = _describe(cluster)
        assert all(not s.sealed for s in info.segments), "no merge was recorded"
        assert len(info.segments) == 4
        problems = _history(cluster, load)
        assert not problems, "\n".join(problems[:30])
        assert load.landed_in({first.number}) and load.landed_in({second.number})


# --- transactions against scales on other brokers ----------------------------------------------


def _staged(cluster: Cluster, via: str, tid: str, segment: int, batches: int) -> tuple[Raw, int]:
    """A transaction of ``tid`` begun at ``via`` (its coordinator) with ``batches`` batches of
    3 events staged into ``segment``: the connection and the transaction id."""
    raw = Raw(_address(cluster, via))
    grant = raw.ask(InitProducer(tid))
    assert isinstance(grant, ProducerGrant), grant
    begun = raw.ask(BeginTxn(grant.producer_id, grant.epoch, 60_000))
    assert isinstance(begun, TxnBegun), begun
    for i in range(batches):
        ack = raw.ask(Append(STREAM, segment, begun.txn_id), batch(3, b"t%d" % i))
        assert isinstance(ack, AppendAck) and ack.base_offset == -1, ack
    return raw, begun.txn_id


def _ends(cluster: Cluster) -> dict[int, int]:
    deadline = time.monotonic() + 30
    while True:
        cut = Raw(cluster.brokers[0].address)
        try:
            answer = cut.ask(GetCut(STREAM, "latest"))
        finally:
            cut.close()
        if isinstance(answer, Cut):
            return dict(answer.positions)
        assert time.monotonic() < deadline, answer  # a container moving: a bound
        time.sleep(0.2)


def _commit(raw: Raw, txn_id: int, outcome: dict[str, object]) -> None:
    outcome["commit"] = raw.ask(EndTxn(txn_id, True))


def test_a_transaction_staged_into_a_segment_another_broker_seals_aborts_or_commits_whole(
    cluster: Cluster,
) -> None:
    owners = cluster.wait_until_all_containers_served()
    with slipstream.connect(cluster.addresses()) as client:
        info = client.create_stream(STREAM, 4)
    # the transaction's coordinator is C; each segment it stages into is served by B != C
    c_containers = {cid for cid, owner in owners.items() if owner == "b0"}
    tid = next(
        f"tid-{i}" for i in range(1000) if coordinator(f"tid-{i}", CONTAINERS) in c_containers
    )
    elsewhere = sorted(s.number for s in info.segments if owners[s.container] == "b1")
    assert elsewhere, owners

    # 1. staged, then sealed by B (B's scale does not wait for C's transaction), then the
    #    commit: refused by the catalog, nothing of it visible
    target = elsewhere[0]
    raw, txn_id = _staged(cluster, "b0", tid, target, 5)
    try:
        split = ask(_address(cluster, "b1"), ScaleStream(STREAM, [target], 2))
        assert isinstance(split, StreamInfo), split
        ended = raw.ask(EndTxn(txn_id, True))
        assert isinstance(ended, Error) and ended.code == "transaction_aborted", ended
    finally:
        raw.close()
    assert _ends(cluster)[target] == 0, "nothing of the aborted transaction is in the segment"
    sealed = {s.number: s for s in _describe(cluster).segments}
    assert sealed[target].sealed and sealed[target].end_offset == 0

    # 2. committed first, then sealed: the whole transaction is in the segment, before its end
    info = _describe(cluster)
    owners = cluster.wait_until_all_containers_served()
    target = next(s.number for s in info.segments if not s.sealed and owners[s.container] == "b1")
    raw, txn_id = _staged(cluster, "b0", tid, target, 5)
    try:
        ended = raw.ask(EndTxn(txn_id, True))
        assert isinstance(ended, TxnEnded) and ended.committed, ended
    finally:
        raw.close()
    split = ask(_address(cluster, "b1"), ScaleStream(STREAM, [target], 2))
    assert isinstance(split, StreamInfo), split
    assert {s.number: s.end_offset for s in split.segments}[target] == 15

    # 3. commit and seal racing: each round ends with all of it or none of it before the end
    for round_ in range(4):
        info = _describe(cluster)
        owners = cluster.wait_until_all_containers_served()
        target = next(
            s.number for s in info.segments if not s.sealed and owners[s.container] == "b1"
        )
        raw, txn_id = _staged(cluster, "b0", tid, target, 8)
        outcome: dict[str, object] = {}
        committing = threading.Thread(target=_commit, args=(raw, txn_id, outcome))
        committing.start()
        scaled = ask(_address(cluster, "b1"), ScaleStream(STREAM, [target], 2))
        committing.join(60)
        raw.close()
        assert isinstance(scaled, StreamInfo), scaled
        end = {s.number: s.end_offset for s in scaled.segments}[target]
        answer = outcome["commit"]
        if isinstance(answer, TxnEnded) and answer.committed:
            assert end == 24, (round_, end, answer)
        else:
            assert isinstance(answer, Error) and answer.code == "transaction_aborted", answer
            assert end == 0, (round_, end, answer)


# --- the autoscaler merges cold neighbours across brokers ---------------------------------------


def _scaling_lines(cluster: Cluster) -> str:
    return "\n".join(
        f"b{i}: {line}"
        for i, broker in enumerate(cluster.brokers)
        for line in broker.log().splitlines()
        if "DEBUG" not in line and any(w in line for w in ("scal", "prepar", "merge", "rror"))
    )[-6000:]


def _scaled_by(cluster: Cluster, name: str) -> list[str]:
    return [
        f"b{i}"
        for i, broker in enumerate(cluster.brokers)
        if f"scaled {name} automatically" in broker.log()
    ]


SPEEDUP = 20  # the scaling clock: the merge rule's 300 s window passes in 15 s
TARGET = 1000  # events/s per segment: a pair below 500 at its 10 s peak is cold


def test_the_autoscaler_merges_cold_neighbours_on_two_brokers_and_not_a_busy_one(
    tmp_path: Path, postgres: PgCluster, seaweedfs: SeaweedFS
) -> None:
    base = tmp_path / "cluster"
    base.mkdir()
    cluster = Cluster(base, postgres, seaweedfs, brokers=2, containers=CONTAINERS)
    for broker in cluster.brokers:
        broker.env["SLIPSTREAM_SCALING_SPEEDUP"] = str(SPEEDUP)
    with cluster.start():
        deadline = time.monotonic() + 60
        while len(set((owners := cluster.wait_until_all_containers_served()).values())) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        policy = slipstream.ScalingPolicy.by_event_rate(TARGET, min_segments=1, max_segments=2)
        with slipstream.connect(cluster.addresses()) as client:
            # a name whose two segments two brokers serve (the only merge is across them)
            for i in itertools.count():
                name = f"scale/auto-{i}"
                info = client.create_stream(name, 2)
                first, second = sorted(info.segments, key=lambda s: s.number)
                if owners[first.container] != owners[second.container]:
                    break
            client.update_stream(name, scaling=policy)
            leader = owners[first.container]
            # 1. the second segment busy (700/s: not hot, but not cold either): the first's
            #    broker, which sees no appends to it, plans the merge, and the other refuses it
            keys = [
                k
                for i in range(5000)
                if second.key_lo <= key_hash(k := b"k%d" % i) <= second.key_hi
            ]
            stop, slow = threading.Event(), threading.Event()

            def produce() -> None:
                with slipstream.connect(cluster.addresses()) as own, own.producer(name) as producer:
                    n = 0
                    while not stop.is_set():
                        for _ in range(5 if slow.is_set() else 35):
                            producer.send(b"x", key=keys[n % len(keys)])
                            n += 1
                        time.sleep(0.05)

            busy = threading.Thread(target=produce, daemon=True)
            busy.start()
            try:
                coordinating = cluster.brokers[int(leader[1:])]  # logs the other's refusal
                deadline = time.monotonic() + 90
                while "not cold, no merge" not in coordinating.log():
                    assert time.monotonic() < deadline, _scaling_lines(cluster)  # a bound
                    time.sleep(0.2)
                assert client.scale_history(name) == []
                # 2. cold (100/s): the pair merges, coordinated by the first segment's broker
                slow.set()
                deadline = time.monotonic() + 120
                while not (history := client.scale_history(name)):
                    assert time.monotonic() < deadline, _scaling_lines(cluster)  # a bound
                    time.sleep(0.2)
            finally:
                stop.set()
                busy.join(30)
        (merge,) = history
        assert set(merge.sealed) == {first.number, second.number}
        assert '"cold_300s"' in merge.reason
        # the decision records the rates the other broker measured, not the zero the
        # coordinator sees of a segment whose appends land elsewhere
        decision = ScalingDecision.from_json(merge.reason)
        peaks = {load.segment: load.rates.events.peak_10s for load in decision.inputs}
        assert peaks[second.number] > 0, decision
        assert f"together carried at most {sum(peaks.values()):,.0f} events/s" in decision.reason
        deadline = time.monotonic() + 30  # its log line follows the record (a bound)
        while not (done_by := _scaled_by(cluster, name)):
            assert time.monotonic() < deadline, _scaling_lines(cluster)
            time.sleep(0.2)
        assert done_by == [leader], (leader, done_by, _scaling_lines(cluster))


def test_a_container_handed_over_during_a_prepare_fences_the_merge(
    tmp_path: Path, postgres: PgCluster, seaweedfs: SeaweedFS
) -> None:
    """The other segment's broker stops cleanly (hands its containers over) while the merge
    waits between the prepares and its record (``scale.prepared_pause``): the new holder's
    lease refuses the record (``lease_lost``), or, if the record came first, the new holder
    serves the segment sealed. Either way nothing acknowledged is lost or reordered."""
    with _cluster(tmp_path, postgres, seaweedfs, fault="scale.prepared_pause") as cluster:
        with slipstream.connect(cluster.addresses()) as client:
            client.create_stream(STREAM, 4)
        load = Load(cluster)
        outcome: dict[str, object] = {}
        try:
            load.wait_for(lambda: load.count() > 1000, "load before the merge")
            first, second, leader, other = _cross_pair(cluster)
            other_index = int(other[1:])

            def merge() -> None:
                try:
                    outcome["merge"] = ask(
                        _address(cluster, leader),
                        ScaleStream(STREAM, [first.number, second.number], 1),
                    )
                except slipstream.SlipstreamError as exc:
                    outcome["merge"] = exc

            merging = threading.Thread(target=merge)
            merging.start()
            deadline = time.monotonic() + 30
            while "prepared segments" not in cluster.brokers[other_index].log():
                assert time.monotonic() < deadline, _scaling_lines(cluster)  # a bound
                time.sleep(0.05)
            assert cluster.stop(other_index) == 0, cluster.brokers[other_index].log()[-3000:]
            merging.join(60)
            cluster.wait_until_all_containers_served()  # all on the leader now
            before = load.count()
            load.wait_for(lambda: load.count() > before + 500, "load after the hand-over")
            cluster.start_broker(other_index)
            cluster.wait_until_all_containers_served()
            before = load.count()
            load.wait_for(lambda: load.count() > before + 500, "load after the restart")
        finally:
            load.finish()
        answer = outcome["merge"]
        print("the merge:", answer)
        with slipstream.connect(cluster.addresses()) as client:
            history = client.scale_history(STREAM)
        if isinstance(answer, StreamInfo):
            (scale,) = history
            assert set(scale.sealed) == {first.number, second.number}
        else:
            assert isinstance(answer, slipstream.LeaseLost), answer
            assert history == []
            assert all(not s.sealed for s in _describe(cluster).segments)
        for via in range(len(cluster.brokers)):
            described = {
                s.number: s.end_offset for s in _describe(cluster, via).segments if s.sealed
            }
            assert described == (history[0].sealed if history else {}), (via, described)
        problems = _history(cluster, load)
        assert not problems, "\n".join(problems[:30])
        assert load.failures == [], load.failures[:10]

"""Transactions across brokers (issue 20; docs/cluster.md, "Transactions"), on real brokers in
cluster mode: a transaction whose segments two brokers serve is staged by its coordinator (the
broker serving its transactional id's container), commits atomically (nothing visible before
the commit, all of it after), aborts leaving nothing, and when the coordinator is killed -9
after its commit record (before, during or after applying it) the broker that takes its
container applies it exactly once.

Frames are sent by hand (tests/raw.py) to the broker each test means, so what is checked is
the brokers' routing, not a client's."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import Cluster, Raw
from objectstores import SeaweedFS
from pg import PgCluster
from raw import batch

import slipstream
from slipstream.cluster import coordinator
from slipstream.protocol import (
    Append,
    AppendAck,
    BeginTxn,
    CreateStream,
    Cut,
    EndTxn,
    Error,
    GetCut,
    GetIdentity,
    IdentityInfo,
    IdentityList,
    InitProducer,
    ListIdentities,
    ProducerGrant,
    StreamInfo,
    TxnBegun,
    TxnEnded,
)

STREAM = "txns/orders"
SEGMENTS = 4
CONTAINERS = 4
#: batches per segment: more than an idempotence window (16), so a re-apply after a takeover
#: must skip what the segment holds by its sequence, not by the remembered recent batches
BATCHES = 20
EVENTS = 3  # per batch
ANONYMOUS = 2  # batches per segment of an anonymous transaction merged into the commit


def _cluster(
    tmp_path: Path, postgres: PgCluster, seaweedfs: SeaweedFS, fault: str = "", brokers: int = 2
) -> Cluster:
    base = tmp_path / "cluster"
    base.mkdir()
    cluster = Cluster(base, postgres, seaweedfs, brokers=brokers, containers=CONTAINERS)
    if fault:
        cluster.brokers[0].env["SLIPSTREAM_FAULT"] = fault
    return cluster.start()


@pytest.fixture
def cluster(tmp_path: Path, postgres: PgCluster, seaweedfs: SeaweedFS) -> Iterator[Cluster]:
    with _cluster(tmp_path, postgres, seaweedfs) as started:
        yield started


def _setup(cluster: Cluster, coordinated_by: str) -> tuple[str, dict[int, str]]:
    """Create the stream (its segments on every broker) and pick a transactional id whose
    coordinating container is the highest ``coordinated_by`` serves (so that an anonymous
    transaction begun there, at its lowest, has another home when it has two); returns it and
    segment -> its broker."""
    everyone = {f"b{i}" for i in range(len(cluster.brokers))}
    deadline = time.monotonic() + 60
    while set((owners := cluster.wait_until_all_containers_served()).values()) != everyone:
        assert time.monotonic() < deadline, owners  # the last joined: it gets its share
        time.sleep(0.2)
    raw = Raw(cluster.brokers[0].address)
    try:
        info = raw.ask(CreateStream(STREAM, SEGMENTS))
        assert isinstance(info, StreamInfo), info
        by_segment = {s.number: owners[s.container] for s in info.segments}
    finally:
        raw.close()
    assert set(by_segment.values()) == everyone, by_segment
    highest = max(c for c, owner in owners.items() if owner == coordinated_by)
    tid = next(f"tid-{i}" for i in range(1000) if coordinator(f"tid-{i}", CONTAINERS) == highest)
    return tid, by_segment


def _tails(cluster: Cluster, via: int) -> dict[int, int]:
    """Every segment's end, as the cluster answers GetCut (asking the brokers serving them)."""
    deadline = time.monotonic() + 30
    while True:
        raw = Raw(cluster.brokers[via].address)
        try:
            cut = raw.ask(GetCut(STREAM, "latest"))
        finally:
            raw.close()
        if isinstance(cut, Cut):
            return dict(cut.positions)
        assert time.monotonic() < deadline, cut  # a bound against hanging, not a timing test
        time.sleep(0.2)  # a container moving: ask again


def _stage(raw: Raw, tid: str) -> int:
    """InitProducer, BeginTxn and BATCHES batches into every segment; the transaction id."""
    grant = raw.ask(InitProducer(tid))
    assert isinstance(grant, ProducerGrant), grant
    begun = raw.ask(BeginTxn(grant.producer_id, grant.epoch, 60_000))
    assert isinstance(begun, TxnBegun), begun
    for number in range(SEGMENTS):
        for i in range(BATCHES):
            ack = raw.ask(Append(STREAM, number, begun.txn_id), batch(EVENTS, b"%d" % i))
            assert isinstance(ack, AppendAck) and ack.base_offset == -1, ack
    return begun.txn_id


def _stage_anonymous(raw: Raw) -> int:
    """An anonymous transaction (a Spark task's) with ANONYMOUS batches in every segment."""
    begun = raw.ask(BeginTxn(-1, -1, 60_000))
    assert isinstance(begun, TxnBegun), begun
    for number in range(SEGMENTS):
        for _ in range(ANONYMOUS):
            ack = raw.ask(Append(STREAM, number, begun.txn_id), batch(EVENTS, b"anonymous"))
            assert isinstance(ack, AppendAck) and ack.base_offset == -1, ack
    return begun.txn_id


def test_a_transaction_over_two_brokers_commits_all_or_nothing(cluster: Cluster) -> None:
    tid, by_segment = _setup(cluster, "b0")
    raw = Raw(cluster.brokers[0].address)
    first = (BATCHES + ANONYMOUS) * EVENTS
    try:
        anonymous = _stage_anonymous(raw)
        txn_id = _stage(raw, tid)
        # staged on b0, whichever broker serves the segment: nothing readable anywhere yet
        assert _tails(cluster, 0) == dict.fromkeys(range(SEGMENTS), 0)
        assert _tails(cluster, 1) == dict.fromkeys(range(SEGMENTS), 0)
        ended = raw.ask(EndTxn(txn_id, True, b"batch-1", [anonymous]))
        assert isinstance(ended, TxnEnded) and ended.committed, ended
        assert {r.segment: (r.start, r.end) for r in ended.ranges} == {
            n: (0, first) for n in range(SEGMENTS)
        }
        identity = raw.ask(GetIdentity(tid))
        assert isinstance(identity, IdentityInfo)
        assert (identity.last_txn_id, identity.last_metadata) == (txn_id, b"batch-1")
    finally:
        raw.close()
    assert _tails(cluster, 1) == dict.fromkeys(range(SEGMENTS), first)
    # the other broker lists the id's last commit too (read from the catalog, within seconds)
    raw = Raw(cluster.brokers[1].address)
    try:
        deadline = time.monotonic() + 30
        while True:
            listed = raw.ask(ListIdentities(tid))
            assert isinstance(listed, IdentityList), listed
            if [i.last_txn_id for i in listed.identities] == [txn_id]:
                break
            assert time.monotonic() < deadline, listed
            time.sleep(0.2)
    finally:
        raw.close()
    # a second transaction of the same producer continues each segment's sequence
    raw = Raw(cluster.brokers[0].address)
    try:
        grant = raw.ask(InitProducer(tid))
        begun = raw.ask(BeginTxn(grant.producer_id, grant.epoch, 60_000))
        for number in range(SEGMENTS):
            raw.ask(Append(STREAM, number, begun.txn_id), batch(EVENTS))
        ended = raw.ask(EndTxn(begun.txn_id, True))
        assert isinstance(ended, TxnEnded) and ended.committed, ended
    finally:
        raw.close()
    assert _tails(cluster, 0) == dict.fromkeys(range(SEGMENTS), first + EVENTS)
    assert "b1" in by_segment.values()  # the other broker's segments got their share


def test_an_aborted_transaction_over_two_brokers_leaves_nothing(cluster: Cluster) -> None:
    tid, _ = _setup(cluster, "b1")
    raw = Raw(cluster.brokers[1].address)
    try:
        txn_id = _stage(raw, tid)
        ended = raw.ask(EndTxn(txn_id, False))
        assert isinstance(ended, TxnEnded) and not ended.committed, ended
        again = raw.ask(EndTxn(txn_id, True))
        assert isinstance(again, Error) and again.code == "transaction_aborted", again
    finally:
        raw.close()
    assert _tails(cluster, 0) == dict.fromkeys(range(SEGMENTS), 0)


def test_transaction_requests_for_another_coordinator_get_wrong_broker(cluster: Cluster) -> None:
    tid, _ = _setup(cluster, "b0")
    raw = Raw(cluster.brokers[1].address)
    try:
        for message in (InitProducer(tid), GetIdentity(tid)):
            answer = raw.ask(message)
            assert isinstance(answer, Error) and answer.code == "wrong_broker", answer
            assert answer.details["owner"] == "b0"
            assert answer.details["container"] == coordinator(tid, CONTAINERS)
    finally:
        raw.close()


@pytest.mark.parametrize("fault", ["txn.after_commit_record", "txn.mid_apply", "txn.after_apply"])
def test_a_coordinator_killed_after_its_commit_record_is_applied_once_by_the_next(
    tmp_path: Path, postgres: PgCluster, seaweedfs: SeaweedFS, fault: str
) -> None:
    """b0 coordinates and dies (SIGKILL at ``fault``) once the commit record is stored: b1
    and b2 take its containers; the one taking the transactional id's finds the record and the
    staged batches in the object store and applies them, those of the other's segments over
    ApplyBatch, each once: every segment ends at exactly the transaction's events, also
    where b0 had applied some or all of them (more batches than the idempotence window, so
    the receiver skips by sequence, not by its recent batches)."""
    with _cluster(tmp_path, postgres, seaweedfs, fault, brokers=3) as cluster:
        tid, by_segment = _setup(cluster, "b0")
        raw = Raw(cluster.brokers[0].address)
        try:
            anonymous = _stage_anonymous(raw)
            txn_id = _stage(raw, tid)
            try:
                answer = raw.ask(EndTxn(txn_id, True, b"m", [anonymous]))
            except ConnectionError:
                answer = None  # b0 died answering
            assert answer is None, f"b0 answered {answer}, not dying at {fault}{cluster.logs()}"
        finally:
            raw.close()
        cluster.brokers[0].proc.wait(10)  # type: ignore[union-attr]
        assert f"killing the broker at {fault}" in cluster.brokers[0].log()
        deadline = time.monotonic() + 60
        while set((owners := cluster.wait_until_all_containers_served()).values()) != {"b1", "b2"}:
            assert time.monotonic() < deadline, owners
            time.sleep(0.2)
        home = owners[coordinator(tid, CONTAINERS)]
        new_home = int(home[1:])
        assert {owners[c] for c in range(CONTAINERS)} - {home}, owners  # some segments remote
        first = (BATCHES + ANONYMOUS) * EVENTS
        expected = dict.fromkeys(range(SEGMENTS), first)
        deadline = time.monotonic() + 60
        while (tails := _tails(cluster, new_home)) != expected:
            assert all(t <= first for t in tails.values()), tails  # no duplicate
            assert time.monotonic() < deadline, (tails, cluster.logs())
            time.sleep(0.2)
        raw = Raw(cluster.brokers[new_home].address)
        try:
            identity = raw.ask(GetIdentity(tid))
            assert isinstance(identity, IdentityInfo), identity
            assert (identity.last_txn_id, identity.last_metadata) == (txn_id, b"m")
            ended = raw.ask(EndTxn(txn_id, True, b"m"))  # the client's retry: committed
            assert isinstance(ended, TxnEnded) and ended.committed, ended
            # the id goes on at its new home: the next epoch, a new transaction
            grant = raw.ask(InitProducer(tid))
            assert isinstance(grant, ProducerGrant) and grant.epoch == 1, grant
            begun = raw.ask(BeginTxn(grant.producer_id, grant.epoch, 60_000))
            for number in range(SEGMENTS):
                raw.ask(Append(STREAM, number, begun.txn_id), batch(EVENTS))
            ended = raw.ask(EndTxn(begun.txn_id, True))
            assert isinstance(ended, TxnEnded) and ended.committed, ended
        finally:
            raw.close()
        time.sleep(1)  # a late duplicate (a second apply) would land now
        assert _tails(cluster, 1) == dict.fromkeys(range(SEGMENTS), first + EVENTS)
        assert len(set(by_segment.values())) == 3


def test_anonymous_transactions_begun_through_any_broker_merge_into_a_commit(
    cluster: Cluster,
) -> None:
    """The Spark sink's pattern through the public client: tasks begin anonymous
    transactions (``merge_into`` the query's id) on clients whose first broker is NOT the
    id's coordinator; the driver's commit of the id merges them all, across brokers."""
    tid, by_segment = _setup(cluster, "b1")
    first_b0 = f"{cluster.brokers[0].address},{cluster.brokers[1].address}"
    staged = []
    with slipstream.connect(first_b0) as client:
        for task in range(3):
            txn = client.transaction(None, label=f"task-{task}", merge_into=tid)
            txn.send_many(
                STREAM,
                values=[b"%d-%d" % (task, i) for i in range(40)],
                keys=[f"k{i}" for i in range(40)],
            )
            txn.flush()
            staged.append(txn.txn_id)
        assert {t.txn_id for t in client.transactions(at=tid)} >= set(staged)
        assert _tails(cluster, via=0) == dict.fromkeys(by_segment, 0), "staged: invisible"
        client.transaction(tid).commit(metadata={"batch": 1}, merge=staged)
        last = client.last_commit(tid)
        assert last is not None and last.metadata == {"batch": 1}
        events = list(client.reader(STREAM, end=client.tail(STREAM)))
    assert sorted(e.value for e in events) == sorted(
        b"%d-%d" % (t, i) for t in range(3) for i in range(40)
    )
    assert {e.segment for e in events} == set(by_segment), "every segment, both brokers"

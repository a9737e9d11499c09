"""Consume-transform-produce across brokers: a transaction coordinator paused between its
deadline check and its commit record, past its hold on the group (docs/cluster.md,
"Consume-transform-produce"; fault point ``txn.held_pause``).

- The hold expires, the group goes on (its member commits further positions), then the
  record's write starts: the catalog refuses it (its hold's row was removed when the hold
  expired), so the transaction aborts and the positions never go back.
- The group's broker stops cleanly while the hold stands (a planned hand-over): the broker
  taking the group removes its holds' rows before it reads the positions, the member goes on
  there, and the late record is refused the same way.

Without the holds' rows in the catalog the late record stored its older positions over the
group's newer ones (the inputs between them processed twice).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import Cluster
from objectstores import SeaweedFS
from pg import PgCluster
from test_cluster_ctp import CONTAINERS, SINK, SOURCE, SUBSCRIPTION, _layout, _outputs, _take

import slipstream
from slipstream import TransactionAborted
from slipstream.cluster import assign, coordinator
from slipstream.storage._meta_pg import PostgresMetaStore


@pytest.fixture
def cluster(tmp_path: Path, postgres: PgCluster, seaweedfs: SeaweedFS) -> Iterator[Cluster]:
    base = tmp_path / "cluster"
    base.mkdir()
    made = Cluster(base, postgres, seaweedfs, brokers=2, containers=CONTAINERS)
    for broker in made.brokers:  # only a commit holding groups elsewhere pauses (20 s)
        broker.env["SLIPSTREAM_FAULT"] = "txn.held_pause"
    with made.start() as started:
        yield started


def test_a_record_stored_after_its_hold_expired_aborts_and_positions_never_go_back(
    cluster: Cluster,
) -> None:
    group, (txn_id,), txn_broker = _layout(cluster, 1)
    with slipstream.connect(cluster.addresses(), reconnect_timeout=60) as client:
        client.create_stream(SOURCE, segments=1)
        client.create_stream(SINK, segments=1)
        client.create_subscription(SOURCE, SUBSCRIPTION)
        with client.producer(SOURCE) as producer:
            for i in range(10):
                producer.send(b"%d" % i)
        consumer = client.consumer(SOURCE, SUBSCRIPTION, commit="manual", session_timeout=90.0)
        events = _take(consumer, 10)
        txn = client.transaction(txn_id)
        for event in events:
            txn.send(SINK, b"out:" + event.value)
        txn.commit_position(consumer)  # {0: 10}, held on the group's broker for the commit

        outcome: list[BaseException | None] = []

        def commit() -> None:
            try:
                txn.commit()  # its coordinator pauses 20 s after its deadline check
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        committing = threading.Thread(target=commit, daemon=True)
        committing.start()
        deadline = time.monotonic() + 60
        while "expired: reading its positions" not in cluster.brokers[group].log():
            assert committing.is_alive(), f"the commit ended before its hold expired: {outcome}"
            assert time.monotonic() < deadline, cluster.logs()
            time.sleep(0.1)
        # the group goes on without the paused commit: its member commits past it
        with (
            slipstream.connect(cluster.addresses(), reconnect_timeout=60) as other,
            other.producer(SOURCE) as producer,
        ):
            for i in range(10, 15):
                producer.send(b"%d" % i)
        _take(consumer, 5)
        consumer.commit()  # {0: 15}
        assert committing.is_alive(), "the group went on only after the late commit ended"
        committing.join(90)
        assert not committing.is_alive()

        meta = PostgresMetaStore(cluster.dsn)
        try:
            (record,) = [r for r in meta.subscriptions() if r.name == SUBSCRIPTION]
        finally:
            meta.close()
        assert record.positions == {0: 15}, "the late record moved the positions back"
        assert not _outputs(client), "the late transaction's outputs are visible"
        (error,) = outcome
        assert isinstance(error, TransactionAborted), error
        assert f"b{txn_broker}" != f"b{group}"
        consumer.close()


THREE = 3  # containers of the three-broker cluster: one each


@pytest.fixture
def three(tmp_path: Path, postgres: PgCluster, seaweedfs: SeaweedFS) -> Iterator[Cluster]:
    base = tmp_path / "three"
    base.mkdir()
    made = Cluster(base, postgres, seaweedfs, brokers=3, containers=THREE)
    for broker in made.brokers:
        broker.env["SLIPSTREAM_FAULT"] = "txn.held_pause"
    with made.start() as started:
        yield started


def test_a_record_stored_after_its_group_was_handed_over_aborts(three: Cluster) -> None:
    """The group's broker stops cleanly while the hold stands; the broker that takes the
    group is not the paused commit's, nor does that one take anything (a broker taking a
    container adopts its transactions on the thread the pause holds): one container each."""
    cluster = three
    served = cluster.wait_until_all_containers_served()
    group_cid = coordinator(f"{SOURCE}/{SUBSCRIPTION}", THREE)
    group_owner = served[group_cid]
    rest = sorted({f"b{i}" for i in range(3)} - {group_owner})
    after = assign(THREE, rest, {c: o for c, o in served.items() if o != group_owner})
    (txn_owner,) = set(rest) - {after[group_cid]}
    txn_id = next(
        t for t in (f"ctp-tx-{i}" for i in range(500)) if served[coordinator(t, THREE)] == txn_owner
    )
    group, txn_broker = int(group_owner[1:]), int(txn_owner[1:])
    with slipstream.connect(cluster.addresses(), reconnect_timeout=60) as client:
        client.create_stream(SOURCE, segments=1)
        client.create_stream(SINK, segments=1)
        client.create_subscription(SOURCE, SUBSCRIPTION)
        with client.producer(SOURCE) as producer:
            for i in range(10):
                producer.send(b"%d" % i)
        consumer = client.consumer(SOURCE, SUBSCRIPTION, commit="manual", session_timeout=90.0)
        events = _take(consumer, 10)
        txn = client.transaction(txn_id)
        for event in events:
            txn.send(SINK, b"out:" + event.value)
        txn.commit_position(consumer)  # {0: 10}

        outcome: list[BaseException | None] = []

        def commit() -> None:
            try:
                txn.commit()
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        committing = threading.Thread(target=commit, daemon=True)
        committing.start()
        deadline = time.monotonic() + 60
        while "fault injection: pausing" not in cluster.brokers[txn_broker].log():
            assert committing.is_alive(), f"the commit ended before it paused: {outcome}"
            assert time.monotonic() < deadline, cluster.logs()
            time.sleep(0.1)
        # the group's broker hands its container over while the hold stands: the third
        # broker takes the group from the catalog
        assert cluster.stop(group) == 0
        with (
            slipstream.connect(cluster.addresses(), reconnect_timeout=60) as other,
            other.producer(SOURCE) as producer,
        ):
            for i in range(10, 15):
                producer.send(b"%d" % i)
        again = _take(consumer, 15)  # rejoined there: from the catalog's positions
        assert sorted(e.value for e in again) == sorted(b"%d" % i for i in range(15))
        consumer.commit()  # {0: 15}
        assert committing.is_alive(), "the group went on only after the late commit ended"
        committing.join(90)
        assert not committing.is_alive()

        meta = PostgresMetaStore(cluster.dsn)
        try:
            (record,) = [r for r in meta.subscriptions() if r.name == SUBSCRIPTION]
        finally:
            meta.close()
        assert record.positions == {0: 15}, "the late record moved the positions back"
        assert not _outputs(client), "the late transaction's outputs are visible"
        (error,) = outcome
        assert isinstance(error, TransactionAborted), error
        consumer.close()


@pytest.fixture
def alone(tmp_path: Path, postgres: PgCluster, seaweedfs: SeaweedFS) -> Iterator[Cluster]:
    base = tmp_path / "alone"
    base.mkdir()
    made = Cluster(base, postgres, seaweedfs, brokers=1, containers=CONTAINERS)
    made.brokers[0].env["SLIPSTREAM_FAULT"] = "txn.held_pause"
    with made.start() as started:
        yield started


def test_a_group_of_another_container_of_the_same_broker_is_held_by_its_row(
    alone: Cluster,
) -> None:
    """The transaction's container and the group's are different containers of one broker:
    the record carries only the transaction container's lease, and the group's container may
    be handed over meanwhile, so the group is held through its catalog row as another
    broker's would be. Paused past that hold, the record is refused and the positions the
    group committed since stay."""
    cluster = alone
    cluster.wait_until_all_containers_served()
    group_cid = coordinator(f"{SOURCE}/{SUBSCRIPTION}", CONTAINERS)
    txn_id = next(
        t for t in (f"ctp-tx-{i}" for i in range(200)) if coordinator(t, CONTAINERS) != group_cid
    )
    with slipstream.connect(cluster.addresses(), reconnect_timeout=60) as client:
        client.create_stream(SOURCE, segments=1)
        client.create_stream(SINK, segments=1)
        client.create_subscription(SOURCE, SUBSCRIPTION)
        with client.producer(SOURCE) as producer:
            for i in range(10):
                producer.send(b"%d" % i)
        consumer = client.consumer(SOURCE, SUBSCRIPTION, commit="manual", session_timeout=90.0)
        events = _take(consumer, 10)
        txn = client.transaction(txn_id)
        for event in events:
            txn.send(SINK, b"out:" + event.value)
        txn.commit_position(consumer)  # {0: 10}, held by its row for the commit

        outcome: list[BaseException | None] = []

        def commit() -> None:
            try:
                txn.commit()  # pauses 20 s after its deadline check: only a held commit does
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        committing = threading.Thread(target=commit, daemon=True)
        committing.start()
        deadline = time.monotonic() + 60
        while "expired: reading its positions" not in cluster.brokers[0].log():
            assert committing.is_alive(), f"the commit ended without a hold: {outcome}"
            assert time.monotonic() < deadline, cluster.logs()
            time.sleep(0.1)
        with (
            slipstream.connect(cluster.addresses(), reconnect_timeout=60) as other,
            other.producer(SOURCE) as producer,
        ):
            for i in range(10, 15):
                producer.send(b"%d" % i)
        _take(consumer, 5)
        consumer.commit()  # {0: 15}
        committing.join(90)
        assert not committing.is_alive()

        meta = PostgresMetaStore(cluster.dsn)
        try:
            (record,) = [r for r in meta.subscriptions() if r.name == SUBSCRIPTION]
        finally:
            meta.close()
        assert record.positions == {0: 15}, "the late record moved the positions back"
        assert not _outputs(client), "the late transaction's outputs are visible"
        (error,) = outcome
        assert isinstance(error, TransactionAborted), error
        consumer.close()

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


def _paused_cluster(
    tmp_path: Path, postgres: PgCluster, seaweedfs: SeaweedFS, brokers: int, containers: int
) -> Cluster:
    """Only a commit holding groups through their catalog rows pauses (20 s)."""
    base = tmp_path / f"cluster{brokers}"
    base.mkdir()
    made = Cluster(base, postgres, seaweedfs, brokers=brokers, containers=containers)
    for broker in made.brokers:
        broker.env["SLIPSTREAM_FAULT"] = "txn.held_pause"
    return made


@pytest.fixture
def cluster(tmp_path: Path, postgres: PgCluster, seaweedfs: SeaweedFS) -> Iterator[Cluster]:
    with _paused_cluster(tmp_path, postgres, seaweedfs, 2, CONTAINERS).start() as started:
        yield started


THREE = 3  # containers of the three-broker cluster: one each


@pytest.fixture
def three(tmp_path: Path, postgres: PgCluster, seaweedfs: SeaweedFS) -> Iterator[Cluster]:
    with _paused_cluster(tmp_path, postgres, seaweedfs, 3, THREE).start() as started:
        yield started


@pytest.fixture
def alone(tmp_path: Path, postgres: PgCluster, seaweedfs: SeaweedFS) -> Iterator[Cluster]:
    with _paused_cluster(tmp_path, postgres, seaweedfs, 1, CONTAINERS).start() as started:
        yield started


class LateCommit:
    """Ten events consumed and transformed in transaction ``txn_id``, whose commit (storing
    position 10) runs in a thread and pauses before its record."""

    def __init__(self, client: slipstream.Client, txn_id: str) -> None:
        client.create_stream(SOURCE, segments=1)
        client.create_stream(SINK, segments=1)
        client.create_subscription(SOURCE, SUBSCRIPTION)
        with client.producer(SOURCE) as producer:
            for i in range(10):
                producer.send(b"%d" % i)
        self.client = client
        self.consumer = client.consumer(SOURCE, SUBSCRIPTION, commit="manual", session_timeout=90.0)
        txn = client.transaction(txn_id)
        for event in _take(self.consumer, 10):
            txn.send(SINK, b"out:" + event.value)
        txn.commit_position(self.consumer)  # {0: 10}, held for the commit
        self.outcome: list[BaseException | None] = []

        def commit() -> None:
            try:
                txn.commit()  # its coordinator pauses 20 s after its deadline check
                self.outcome.append(None)
            except BaseException as exc:
                self.outcome.append(exc)

        self.committing = threading.Thread(target=commit, daemon=True)
        self.committing.start()

    def wait_for(self, cluster: Cluster, broker: int, line: str) -> None:
        deadline = time.monotonic() + 60
        while line not in cluster.brokers[broker].log():
            assert self.committing.is_alive(), f"the commit ended first: {self.outcome}"
            assert time.monotonic() < deadline, cluster.logs()
            time.sleep(0.1)

    def go_on(self, cluster: Cluster, take: int = 5) -> list[slipstream.Event]:
        """Five more events; the group's member takes ``take`` and commits {0: 15}."""
        with (
            slipstream.connect(cluster.addresses(), reconnect_timeout=60) as other,
            other.producer(SOURCE) as producer,
        ):
            for i in range(10, 15):
                producer.send(b"%d" % i)
        got = _take(self.consumer, take)
        self.consumer.commit()  # {0: 15}
        return got

    def check_paused(self) -> None:
        assert self.committing.is_alive(), "the group went on only after the late commit ended"

    def check_refused(self, cluster: Cluster) -> None:
        self.committing.join(90)
        assert not self.committing.is_alive()
        meta = PostgresMetaStore(cluster.dsn)
        try:
            (record,) = [r for r in meta.subscriptions() if r.name == SUBSCRIPTION]
        finally:
            meta.close()
        assert record.positions == {0: 15}, "the late record moved the positions back"
        assert not _outputs(self.client), "the late transaction's outputs are visible"
        (error,) = self.outcome
        assert isinstance(error, TransactionAborted), error
        self.consumer.close()


def test_a_record_stored_after_its_hold_expired_aborts_and_positions_never_go_back(
    cluster: Cluster,
) -> None:
    group, (txn_id,), txn_broker = _layout(cluster, 1)
    assert txn_broker != group
    with slipstream.connect(cluster.addresses(), reconnect_timeout=60) as client:
        late = LateCommit(client, txn_id)
        late.wait_for(cluster, group, "expired: reading its positions")
        late.go_on(cluster)  # the group goes on without the paused commit
        late.check_paused()
        late.check_refused(cluster)


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
        late = LateCommit(client, txn_id)
        late.wait_for(cluster, txn_broker, "fault injection: pausing")
        # the group's broker hands its container over while the hold stands: the third
        # broker takes the group from the catalog
        assert cluster.stop(group) == 0
        again = late.go_on(cluster, take=15)  # rejoined there: from the catalog's positions
        assert sorted(e.value for e in again) == sorted(b"%d" % i for i in range(15))
        late.check_paused()
        late.check_refused(cluster)


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
        late = LateCommit(client, txn_id)
        late.wait_for(cluster, 0, "expired: reading its positions")
        # the group goes on (its commit may wait for the paused record's catalog thread,
        # then the record is refused)
        late.go_on(cluster)
        late.check_refused(cluster)

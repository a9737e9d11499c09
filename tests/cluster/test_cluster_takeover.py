"""A takeover whose recovery outlasts the lease ttl (issue 20): the broker taking a dead
broker's container replays its journal objects from a slow store for longer than a lease
lasts. Its renewals go on meanwhile (its own containers' and the one it is taking), so it
loses no lease, then serves every acknowledged event. (Takeovers once ran inside the
membership turn, which then renewed nothing until the replay ended: every lease of the
broker expired, and the taken container was lost and taken again.)"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import Cluster
from objectstores import SeaweedFS
from pg import PgCluster

import slipstream

STREAM = "takeover/orders"
OBJECTS = 80  # acknowledged one at a time: about one journal object each
DELAY_S = 1.0  # per store request while the takeover replays (8 in flight at a time)


@pytest.fixture
def cluster(tmp_path: Path, postgres: PgCluster, seaweedfs: SeaweedFS) -> Iterator[Cluster]:
    with Cluster(tmp_path, postgres, seaweedfs, brokers=2, containers=2).start() as cluster:
        yield cluster


def test_a_takeover_longer_than_the_lease_keeps_every_lease_and_every_event(
    cluster: Cluster,
) -> None:
    owners = cluster.wait_until_all_containers_served()
    assert sorted(owners.values()) == ["b0", "b1"], owners
    with slipstream.connect(cluster.addresses()) as client:
        info = client.create_stream(STREAM, 2)
        on_b1 = [s.number for s in info.segments if owners[s.container] == "b1"]
        assert on_b1, info.segments
        with client.producer(STREAM) as producer:
            for i in range(OBJECTS):  # one acknowledged append per group commit
                producer.send(b"%d" % i, key=f"k{i}").result(timeout=30)
    taken_again = re.compile(r"container \d+ taken \(lease epoch [2-9]")
    cluster.store_slow(DELAY_S)
    try:
        cluster.kill(1)
        deadline = time.monotonic() + 180  # a bound against hanging, not a timing
        while not taken_again.search(cluster.brokers[0].log()):
            assert time.monotonic() < deadline, cluster.logs()
            time.sleep(0.2)
    finally:
        cluster.store_slow(0)
    assert set(cluster.wait_until_all_containers_served().values()) == {"b0"}
    log = cluster.brokers[0].log()
    assert "lease lost" not in log, cluster.logs()
    assert "not taken" not in log, cluster.logs()
    # the replay took longer than a lease lasts (else this test shows nothing)
    took = [int(ms) for ms in re.findall(r"journal batches recovered in (\d+) ms", log)]
    assert max(took) > cluster.lease_ttl * 1000, took
    with slipstream.connect(cluster.brokers[0].address) as client:
        values = sorted(int(e.value) for e in client.reader(STREAM, end=client.tail(STREAM)))
    assert values == list(range(OBJECTS))

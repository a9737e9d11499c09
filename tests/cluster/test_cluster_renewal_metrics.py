"""How late lease renewals land (``slipstream_lease_renewal_lateness_seconds``, docs/metrics.md):
a broker in cluster mode exports the histogram at /metrics for its member registration and
its containers' leases, and a broker held still (SIGSTOP) for longer than a third of the ttl
observes its next renewals that much later than their schedule. bench/takeover.py reads the
same values from the debug log line each renewal writes. And the default ``--lease-ttl``: 5 s
in a cluster (a dead broker's containers served again within seconds), 10 s standalone."""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import BrokerProcess
from harness import Cluster
from objectstores import ACCESS_KEY, SECRET_KEY, SeaweedFS
from pg import PgCluster
from prometheus_client.parser import text_string_to_metric_families

TTL_S = 3.0
PAUSE_S = 1.6  # longer than ttl / 3 (every renewal due meanwhile lands >= 0.6 s late), < 2 ttl / 3
LATE_S = 0.5  # a histogram bucket bound below PAUSE_S - TTL_S / 3
NAME = "slipstream_lease_renewal_lateness_seconds"


@pytest.fixture
def cluster(tmp_path: Path, postgres: PgCluster, seaweedfs: SeaweedFS) -> Iterator[Cluster]:
    with Cluster(
        tmp_path, postgres, seaweedfs, brokers=1, containers=2, lease_ttl=TTL_S
    ).start() as cluster:
        yield cluster


def lateness(cluster: Cluster) -> dict[str, tuple[float, float]]:
    """renewal label -> (observations, observations later than LATE_S), from /metrics."""
    url = f"{cluster.brokers[0].http_url}/metrics"
    with urllib.request.urlopen(url, timeout=10) as answer:
        text = answer.read().decode()
    out: dict[str, tuple[float, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != NAME:
            continue
        counts = {
            (s.labels["renewal"], s.name, s.labels.get("le")): s.value for s in family.samples
        }
        for renewal in {r for r, _, _ in counts}:
            total = counts[(renewal, f"{NAME}_count", None)]
            on_time = counts[(renewal, f"{NAME}_bucket", str(LATE_S))]
            out[renewal] = (total, total - on_time)
    return out


def wait_for(
    cluster: Cluster, check: Callable[[dict[str, tuple[float, float]]], bool], what: str
) -> dict[str, tuple[float, float]]:
    deadline = time.monotonic() + 60  # a bound against hanging, not a timing
    while True:
        seen = lateness(cluster)
        if check(seen):
            return seen
        assert time.monotonic() < deadline, f"{what}: {seen}\n{cluster.logs()}"
        time.sleep(0.2)


def test_renewals_are_observed_and_a_held_broker_lands_them_late(cluster: Cluster) -> None:
    before = wait_for(
        cluster,
        lambda seen: all(seen.get(r, (0, 0))[0] >= 2 for r in ("member", "lease")),
        "renewals observed",
    )
    cluster.pause(0)
    time.sleep(PAUSE_S)
    cluster.resume(0)
    after = wait_for(
        cluster,
        lambda seen: all(seen[r][0] > before[r][0] for r in ("member", "lease")),
        "renewals after the pause",
    )
    # the renewals due during the pause landed after it: later than their schedule
    assert after["member"][1] > before["member"][1], (before, after)
    assert after["lease"][1] > before["lease"][1], (before, after)
    log = cluster.brokers[0].log()
    assert re.search(r"member renewal -1 landed \+\d+\.\d{3} s from its schedule", log), log
    assert re.search(r"lease renewal [01] landed [-+]\d+\.\d{3} s from its schedule", log), log


def test_the_default_lease_ttl_is_5_s_in_a_cluster_and_10_s_standalone(
    broker_factory: type[BrokerProcess], pg_dsn: str, seaweedfs: SeaweedFS
) -> None:
    bucket = seaweedfs.create_bucket()
    clustered = broker_factory(
        *("--meta", pg_dsn, "--objects", f"s3://{bucket}/c", "--journal", "objects"),
        *("--s3-endpoint", seaweedfs.endpoint, "--broker-id", "b0"),
    )
    clustered.env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    clustered.start(60)
    wait_for_log(clustered, "cluster member 'b0': lease ttl 5000 ms, renewed every 1666 ms")
    clustered.kill()
    # the same catalog without shared journals and chunks: a standalone broker
    standalone = broker_factory("--meta", pg_dsn, "--broker-id", "b0").start(60)
    wait_for_log(standalone, ", ttl 10000 ms)")


def wait_for_log(broker: BrokerProcess, line: str) -> None:
    deadline = time.monotonic() + 60  # a bound against hanging, not a timing
    while line not in broker.log():
        assert time.monotonic() < deadline, broker.log()
        time.sleep(0.1)

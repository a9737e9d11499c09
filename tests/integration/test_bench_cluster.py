"""bench/cluster.py's arithmetic, without its servers (the full bench is run by hand): the model
recovers a broker's CPU per MB and its idle rate from runs made of them, and the CPU readers count
a child process the parent reaped (PostgreSQL's exited backends)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    saved = list(sys.path)  # the bench puts bench/ and tests/ first: bench/spark.py and
    sys.path.insert(0, str(BENCH))  # the like must not shadow anything after this module
    try:
        spec = importlib.util.spec_from_file_location("bench_cluster", BENCH / "cluster.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path[:] = saved


def _run(brokers: int, mb: float, seconds: float, *, idle: float, per_mb: float) -> dict:
    """A cluster run whose processes spent ``idle`` cores each per second plus ``per_mb`` CPU
    seconds per MB (split evenly over the brokers); PostgreSQL a tenth of the brokers'."""
    per_broker = idle * seconds + per_mb * mb / brokers
    cpu = {f"broker b{i}": per_broker for i in range(brokers)}
    cpu["seaweedfs"] = 2 * per_mb * mb
    cpu["postgresql"] = 0.1 * per_mb * mb + 0.01 * brokers * seconds
    cpu["client"] = 0.5
    return {
        "brokers": brokers,
        "produce": {"events": int(mb * 1000), "size": 1000, "seconds": seconds},
        "produce_cpu_s": cpu,
        "idle_cpu_s_per_s": {
            **{f"broker b{i}": idle for i in range(brokers)},
            "seaweedfs": 0.0,
            "postgresql": 0.01 * brokers,
            "client": 0.0,
        },
        "produce_counters": {"group_commits": int(mb / 4), "write_transactions": int(mb / 4) + 2},
        "idle_counters_per_s": {"group_commits": 0.0, "write_transactions": 0.0},
    }


def test_the_model_recovers_cpu_per_mb_and_the_idle_rate(bench: ModuleType) -> None:
    clusters = {
        "cluster 1": _run(1, 200.0, 4.0, idle=0.02, per_mb=0.004),
        "cluster 2": _run(2, 200.0, 5.0, idle=0.02, per_mb=0.004),
        "cluster 3": _run(3, 200.0, 8.0, idle=0.02, per_mb=0.004),
    }
    m = bench.model(clusters, projections=(1, 10))
    assert m["per_mb"]["broker"] == pytest.approx(0.004)
    assert m["idle_per_broker"]["broker"] == pytest.approx(0.02)
    assert m["per_broker_mb_s"] == pytest.approx((1 - 0.02) / 0.004)
    ten = m["projection"][1]
    assert ten["mb_s"] == pytest.approx(10 * m["per_broker_mb_s"])
    # PostgreSQL: 0.01 cores idle per broker, 0.0004 s per MB
    assert ten["postgresql_cores"] == pytest.approx(10 * 0.01 + ten["mb_s"] * 0.0004)
    assert ten["seaweedfs_cores"] == pytest.approx(ten["mb_s"] * 0.008)
    assert m["mb_per_group_commit"] == pytest.approx(4.0)
    one = m["measured"]["cluster 1"]
    assert one["commit_cycle_ms"] == pytest.approx(bench.CONTAINERS * 4000 / 50)


def test_cpu_of_tree_counts_a_reaped_child(bench: ModuleType) -> None:
    before = bench.cpu_of_tree(os.getpid())
    busy = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass"
    subprocess.run([sys.executable, "-c", busy], check=True)  # run and reaped
    assert bench.cpu_of_tree(os.getpid()) - before >= 0.25
    assert bench.cpu_of(os.getpid()) < bench.cpu_of_tree(os.getpid())

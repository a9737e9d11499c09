"""What the broker's metrics cost produce throughput (issue 18: under 5%).

    python bench/metrics_cost.py [--quick] [--rounds N] [--dir DIR] [--json out.json]

Runs the produce workloads of bench/run.py (one ``send()`` per 1 KiB event; ``send_many()``
of 100 B events) against two brokers in the same run, on the same machine: one as shipped
(metrics on), one whose hot-path metric calls are no-ops (its ``Metrics`` methods replaced
before it starts; see ``_NO_METRICS``). Each round starts one broker of each kind, in
alternating order, warms it with a first produce (a fresh broker's first run pays for
untouched memory, see bench/README.md), then measures. The table shows each workload's median
events/s per kind and the ratio; ``cost`` is how much slower the broker with metrics is.

What it does not count: the no-op broker still makes the calls (a Python call each, per batch
or per Append), and scrapes (none run here; they cost the broker's loop a walk over its
streams, not the produce path).
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import slipstream_peer
from slipstream_peer import SlipstreamPeer

#: started as ``python <this file's text> -m slipstream up ...``: the broker with its metric
#: calls made no-ops, then the CLI as ``python -m slipstream`` would run it
_NO_METRICS = """\
import runpy, sys
from slipstream.broker import _metrics as m
m.Metrics.produced = lambda self, *args: None
m.Metrics.consumed = lambda self, *args: None
m.Metrics.appended = lambda self, *args: None
m.Metrics.rejected = lambda self, *args: None
m.Metrics.transaction_ended = lambda self, *args: None
m.Metrics.timed_fsync = lambda self, container, sync: sync()
assert sys.argv[1] == "-m"
sys.argv = [sys.argv[2], *sys.argv[3:]]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def _no_metrics_python(directory: Path) -> str:
    """An executable that runs ``python -m slipstream ...`` with the metric calls no-ops."""
    script = directory / "no_metrics.py"
    script.write_text(_NO_METRICS)
    wrapper = directory / "python-no-metrics"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{script}" "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return str(wrapper)


def _small_batches(peer: SlipstreamPeer, stream: str, count: int) -> float:
    """100 B events in batches of at most 4 KiB (about 35 events), 16 in flight, no linger:
    the most appends per event, where a per-batch cost shows most."""
    peer.client.create_stream(stream, segments=1)
    pool = [os.urandom(100) for _ in range(8192)]
    options = {"batch_bytes": 4096, "linger_ms": 0, "max_in_flight": 16}
    with peer._producer(stream, **options) as producer:
        send = producer.send
        start = time.perf_counter()
        for i in range(count):
            send(pool[i & 8191])
        producer.flush()
        seconds = time.perf_counter() - start
    peer._check(stream, count)
    return count / seconds


def _run(peer: SlipstreamPeer, workload: str, stream: str, sizes: dict[str, int]) -> float:
    if workload == "produce_1k_send":
        return float(peer.produce(stream, 1024, sizes["p1k"])["events_s"])
    if workload == "produce_100b_small":
        return _small_batches(peer, stream, sizes["p100_small"])
    return float(peer.produce_bulk(stream, 100, sizes["p100_bulk"])["events_s"])


WORKLOADS = ("produce_1k_send", "produce_100b_bulk", "produce_100b_small")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller runs")
    parser.add_argument("--rounds", type=int, default=3, help="brokers of each kind (median)")
    parser.add_argument("--dir", type=Path, default=None, help="where data directories go")
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = parser.parse_args(argv)
    sizes = (
        {"p1k": 50_000, "p100_bulk": 1_000_000, "p100_small": 100_000}
        if args.quick
        else {"p1k": 200_000, "p100_bulk": 4_000_000, "p100_small": 400_000}
    )
    shipped_python = slipstream_peer.PYTHON
    results: dict[str, dict[str, list[float]]] = {
        kind: {w: [] for w in WORKLOADS} for kind in ("metrics", "no_metrics")
    }
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="metrics-cost-") as root:
        no_metrics_python = _no_metrics_python(Path(root))
        for round_number in range(args.rounds):
            kinds = ["metrics", "no_metrics"]
            if round_number % 2:
                kinds.reverse()
            for kind in kinds:
                slipstream_peer.PYTHON = shipped_python if kind == "metrics" else no_metrics_python
                peer = SlipstreamPeer(Path(root) / f"{kind}-{round_number}")
                peer.start()
                try:
                    for workload in WORKLOADS:
                        _run(peer, workload, f"bench/warm-{workload}", sizes)
                        os.sync()
                        time.sleep(0.5)
                        rate = _run(peer, workload, f"bench/{workload}", sizes)
                        results[kind][workload].append(rate)
                        print(
                            f"  round {round_number + 1} {kind:<10} {workload:<18} {rate:>12,.0f}/s"
                        )
                finally:
                    peer.stop()
                    slipstream_peer.PYTHON = shipped_python
    print()
    print(f"{'workload':<18} {'metrics':>14} {'no metrics':>14} {'ratio':>7} {'cost':>7}")
    summary = {}
    for workload in WORKLOADS:
        with_metrics = statistics.median(results["metrics"][workload])
        without = statistics.median(results["no_metrics"][workload])
        ratio = with_metrics / without
        summary[workload] = {
            "metrics_events_s": with_metrics,
            "no_metrics_events_s": without,
            "ratio": ratio,
            "runs": {kind: results[kind][workload] for kind in results},
        }
        print(
            f"{workload:<18} {with_metrics:>12,.0f}/s {without:>12,.0f}/s "
            f"{ratio:>7.3f} {100 * (1 - ratio):>6.1f}%"
        )
    if args.json is not None:
        args.json.write_text(json.dumps({"sizes": sizes, "results": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark slipstream against NATS JetStream on this machine, in one run.

    python bench/run.py [--quick] [--json out.json] [--only produce_1k,replay,...]

Measures the disk first, then runs each workload against JetStream and then against slipstream
(one peer at a time, never both at once), and prints one table: both results, the ratio
slipstream / JetStream, and each target of issue 2 as PASS or MISS. See bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import machine
from nats_peer import NatsPeer

WORKLOADS = [
    "machine",
    "produce_1k",
    "produce_100b",
    "replay",
    "latency",
    "transactions",
    "streams",
    "storage",
    "consumers",
    "scaling",
]
#: not run unless named: bench/consumers.py loads gigabytes and takes 5 to 10 minutes;
#: bench/scaling.py ramps to 192,000 events/s, waits 300 s for merges and takes about 14 minutes
OPT_IN = {"consumers", "scaling"}
SIZES = {
    "full": {
        "p1k": 200_000,
        "js_p100": 400_000,
        "send_p100": 1_000_000,
        "bulk_p100": 4_000_000,
        "lat_rate": 5000,
        "lat_seconds": 10.0,
        "lat_warmup": 1.0,
        "streams": 10_000,
        "tx_events": 200_000,
        "disk_bytes": 256 * machine.MiB,
        "fsync_iterations": 500,
    },
    "quick": {
        "p1k": 50_000,
        "js_p100": 100_000,
        "send_p100": 300_000,
        "bulk_p100": 1_000_000,
        "lat_rate": 5000,
        "lat_seconds": 3.0,
        "lat_warmup": 0.5,
        "streams": 1_000,
        "tx_events": 50_000,
        "disk_bytes": 256 * machine.MiB,
        "fsync_iterations": 200,
    },
}


# -- running ---------------------------------------------------------------------------------


def attempt(results: dict, key: str, fn, *args, **kwargs) -> None:
    """Run one measurement; a failure is recorded (and shown in the table), not fatal.

    Each workload starts on a quiet disk: the gigabytes the previous one wrote are flushed
    first (``os.sync``), so that background writeback does not land in the next workload's
    numbers (it inflates fsync tails, and with them latency percentiles, by 10x here).
    """
    label = f"  {key} ..."
    print(label, end="", flush=True)
    os.sync()
    time.sleep(0.5)
    start = time.monotonic()
    try:
        results[key] = fn(*args, **kwargs)
        print(f" {time.monotonic() - start:.2f} s", flush=True)
    except Exception as exc:
        results[key] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f" FAILED: {type(exc).__name__}: {exc}", flush=True)
        if os.environ.get("BENCH_DEBUG"):
            traceback.print_exc()


#: produce workloads run this many times per peer, each into a stream of its own; the table
#: shows the median run (and, for 1 KiB events, the first)
PRODUCE_RUNS = 3


def attempt_runs(results: dict, key: str, fn, stream: str, *args) -> None:
    """``attempt`` a produce workload PRODUCE_RUNS times and keep the median run, with every
    run's rate under ``runs`` and the first run under ``<key>_first``.

    The first run in a fresh broker or server pays for memory the process has not touched yet,
    which on this VM costs up to ten times a warm touch (bench/README.md): the median is what a
    producer that keeps going sees, and both peers are measured the same way. The first run
    keeps the stream name, so the replays read what it wrote.
    """
    runs = []
    for number in range(PRODUCE_RUNS):
        attempt(results, key, fn, stream if number == 0 else f"{stream}-{number + 1}", *args)
        if "error" in results[key]:
            return
        runs.append(results[key])
    median = sorted(runs, key=lambda run: run["events_s"])[len(runs) // 2]
    results[key] = {**median, "runs": [run["events_s"] for run in runs]}
    results[f"{key}_first"] = runs[0]


def run_jetstream(root: Path, s: dict, only: set[str], args: argparse.Namespace) -> dict:
    out: dict = {}
    peer = NatsPeer(root / "jetstream", window=args.nats_window, fetch=args.nats_fetch)
    try:
        peer.start()
    except Exception as exc:
        print(f"JetStream: cannot start: {type(exc).__name__}: {exc}")
        return {"error": f"{type(exc).__name__}: {exc}"}
    out["version"] = peer.version
    print(f"JetStream ({peer.version}, window {peer.window}, fetch {peer.fetch})")
    try:
        if "produce_1k" in only:
            attempt_runs(out, "produce_1k", peer.produce, "P1K", 1024, s["p1k"])
        if "produce_100b" in only:
            attempt_runs(out, "produce_100b", peer.produce, "P100", 100, s["js_p100"])
        if "replay" in only:
            attempt(out, "replay_1k", peer.replay, "P1K", 1024, s["p1k"])
            attempt(out, "replay_1k_again", peer.replay, "P1K", 1024, s["p1k"])
            attempt(out, "replay_100b", peer.replay, "P100", 100, s["js_p100"])
        if "latency" in only:
            lat = (s["lat_rate"], s["lat_seconds"])
            attempt(out, "latency", peer.latency, *lat, warmup=s["lat_warmup"])
    finally:
        peer.stop()
    return out


def start_slipstream(data_dir: Path, args: argparse.Namespace, out: dict):
    try:
        from slipstream_peer import SlipstreamPeer

        compression = None if args.compression == "none" else args.compression
        peer = SlipstreamPeer(data_dir, linger_ms=args.linger_ms, compression=compression)
        peer.start()
        return peer
    except Exception as exc:
        print(f"slipstream: cannot start: {type(exc).__name__}: {exc}")
        out["error"] = f"{type(exc).__name__}: {exc}"
        return None


def run_slipstream(root: Path, s: dict, only: set[str], args: argparse.Namespace) -> dict:
    out: dict = {}
    peer = start_slipstream(root / "slipstream", args, out)
    if peer is None:
        return out
    out["version"] = peer.version
    print(
        f"slipstream ({peer.version}, fsync={peer.fsync}, linger {peer.linger_ms} ms, "
        f"batch {peer.batch_bytes >> 10} KiB, compression {peer.compression})"
    )
    try:
        if "produce_1k" in only:
            attempt_runs(out, "produce_1k", peer.produce, "bench/p1k", 1024, s["p1k"])
            bulk_1k = ("bench/p1kbulk", 1024, s["p1k"])
            attempt_runs(out, "produce_1k_bulk", peer.produce_bulk, *bulk_1k)
        if "produce_100b" in only:
            send_100 = ("bench/p100", 100, s["send_p100"])
            attempt_runs(out, "produce_100b_send", peer.produce, *send_100)
            bulk = ("bench/p100bulk", 100, s["bulk_p100"])
            attempt_runs(out, "produce_100b_bulk", peer.produce_bulk, *bulk)
        if "replay" in only:
            attempt(out, "replay_1k", peer.replay_batches, "bench/p1k", 1024, s["p1k"])
            attempt(out, "replay_1k_again", peer.replay_batches, "bench/p1k", 1024, s["p1k"])
            attempt(out, "replay_100b", peer.replay_events, "bench/p100bulk", 100, s["bulk_p100"])
        if "latency" in only:
            lat = (s["lat_rate"], s["lat_seconds"])
            attempt(out, "latency", peer.latency, *lat, warmup=s["lat_warmup"])
        if "transactions" in only:
            tx = (1024, s["tx_events"], (1, 100, 10_000))
            attempt(out, "transactions", peer.transactions, *tx)
    finally:
        peer.stop()
    if "streams" in only:  # a fresh broker: memory freed by earlier workloads would hide growth
        peer = start_slipstream(root / "slipstream-streams", args, out)
        if peer is not None:
            try:
                attempt(out, "streams", peer.many_streams, s["streams"])
            finally:
                peer.stop()
    return out


# -- reporting -------------------------------------------------------------------------------


def get(results: dict, key: str, field: str):
    value = results.get(key, {})
    return value.get(field) if isinstance(value, dict) else None


def error_of(results: dict, key: str) -> str | None:
    if "error" in results:
        return results["error"]
    value = results.get(key)
    return value.get("error") if isinstance(value, dict) else None


def build_rows(r: dict, only: set[str]) -> list[dict]:
    """One row per metric: slipstream, JetStream, ratio (slipstream / JetStream), target."""
    ss, js, mach = r["slipstream"], r["jetstream"], r.get("machine", {})
    disk = (mach.get("seq_write") or {}).get("mb_s")
    disk_read = (mach.get("seq_read") or {}).get("mb_s")
    rows: list[dict] = []

    def row(workload, metric, ss_key, field, js_key=None, target=None, check=None, unit=""):
        a = get(ss, ss_key, field) if ss_key else None
        b = get(js, js_key, field) if js_key else None
        ratio = a / b if a is not None and b else None
        verdict = None
        if check is not None:
            verdict = check(a, ratio)
        rows.append(
            {
                "workload": workload,
                "metric": metric,
                "unit": unit,
                "slipstream": a,
                "jetstream": b,
                "ratio": ratio,
                "target": target,
                "result": None if verdict is None else ("PASS" if verdict else "MISS"),
                "slipstream_error": error_of(ss, ss_key) if ss_key and a is None else None,
                "jetstream_error": error_of(js, js_key) if js_key and b is None else None,
            }
        )

    def at_least(limit, on_ratio=False):
        return lambda a, ratio: (
            None if (ratio if on_ratio else a) is None else (ratio if on_ratio else a) >= limit
        )

    def share_of(workload, ss_key, bandwidth, metric, js_key=None, least=None):
        """slipstream's (and JetStream's) MB/s as a % of a disk bandwidth; PASS at ``least``."""
        a = get(ss, ss_key, "mb_s")
        b = get(js, js_key, "mb_s") if js_key else None
        rows.append(
            {
                "workload": workload,
                "metric": metric,
                "unit": "%",
                "slipstream": 100 * a / bandwidth if a and bandwidth else None,
                "jetstream": 100 * b / bandwidth if b and bandwidth else None,
                "ratio": None,
                "target": f"≥ {least:.0%}" if least else "report",
                "result": None
                if not (least and a and bandwidth)
                else ("PASS" if a >= least * bandwidth else "MISS"),
                "slipstream_error": error_of(ss, ss_key) if a is None else None,
                "jetstream_error": error_of(js, js_key) if js_key and b is None else None,
            }
        )

    median = f"median of {PRODUCE_RUNS}"
    if "produce_1k" in only:
        for label, key in (
            ("produce 1 KiB, send()", "produce_1k"),
            ("produce 1 KiB, send_many()", "produce_1k_bulk"),
        ):
            row(
                label,
                f"MB/s, {median}",
                key,
                "mb_s",
                "produce_1k",
                "≥ 2x JetStream",
                at_least(2, on_ratio=True),
            )
            share_of(label, key, disk, "% of disk write", "produce_1k", 0.7)
            row(label, "MB/s, first run", f"{key}_first", "mb_s", "produce_1k_first", "report")
    if "produce_100b" in only:
        row(
            "produce 100 B, send()",
            f"events/s, {median}",
            "produce_100b_send",
            "events_s",
            "produce_100b",
            "≥ 500,000/s",
            at_least(500_000),
        )
        row(
            "produce 100 B, send_many()",
            f"events/s, {median}",
            "produce_100b_bulk",
            "events_s",
            "produce_100b",
            "≥ 2,000,000/s",
            at_least(2_000_000),
        )
    if "replay" in only:
        row(
            "replay 1 KiB, batches()",
            "MB/s",
            "replay_1k",
            "mb_s",
            "replay_1k",
            "≥ 5x JetStream",
            at_least(5, on_ratio=True),
        )
        share_of("replay 1 KiB, batches()", "replay_1k", disk_read, "% of disk read")
        row(
            "replay 1 KiB again, batches()",
            "MB/s",
            "replay_1k_again",
            "mb_s",
            "replay_1k_again",
            "report",
        )
        row(
            "replay 100 B, per event",
            "events/s",
            "replay_100b",
            "events_s",
            "replay_100b",
            "≥ 1,000,000/s",
            at_least(1_000_000),
        )
    if "latency" in only:
        name = f"latency @ {get(ss, 'latency', 'rate') or get(js, 'latency', 'rate')}/s"
        row(name, "p50 ms", "latency", "p50_ms", "latency")
        row(
            name,
            "p99 ms",
            "latency",
            "p99_ms",
            "latency",
            "≤ 5 ms",
            lambda a, ratio: None if a is None else a <= 5,
        )
        row(name, "max ms", "latency", "max_ms", "latency")
    if "transactions" in only:
        tx = ss.get("transactions") if isinstance(ss.get("transactions"), dict) else {}
        plain = (tx.get("plain") or {}).get("events_s")
        for part, label in (
            ("plain", "produce 1 KiB, 4 segments"),
            ("txn_1", "transactions of 1 event"),
            ("txn_100", "transactions of 100 events"),
            ("txn_10000", "transactions of 10,000 events"),
        ):
            value = (tx.get(part) or {}).get("events_s")
            rows.append(
                {
                    "workload": label,
                    "metric": "events/s (ratio: vs plain)",
                    "unit": "",
                    "slipstream": value,
                    "jetstream": None,
                    "ratio": value / plain if value and plain else None,
                    "target": "report",
                    "result": None,
                    "slipstream_error": error_of(ss, "transactions") if value is None else None,
                    "jetstream_error": None,
                }
            )
        committed = (tx.get("read_committed") or {}).get("mb_s")
        plain_read = (tx.get("read_plain") or {}).get("mb_s")
        ratio = committed / plain_read if committed and plain_read else None
        rows.append(
            {
                "workload": "read committed data, batches()",
                "metric": "MB/s (ratio: vs plain read)",
                "unit": "",
                "slipstream": committed,
                "jetstream": None,
                "ratio": ratio,
                # ratios within 10% are the noise of this machine, not a difference
                "target": "≥ plain read",
                "result": None if ratio is None else ("PASS" if ratio >= 0.9 else "MISS"),
                "slipstream_error": error_of(ss, "transactions") if committed is None else None,
                "jetstream_error": None,
            }
        )
    if "streams" in only:
        name = f"{get(ss, 'streams', 'streams') or 'many'} streams"
        row(name, "KiB RSS per idle stream", "streams", "rss_per_stream_kib")
        row(name, "events/s, 1 to each", "streams", "events_s")
        row(name, "creates/s", "streams", "creates_s")
    return rows


def fmt(value, metric: str = "") -> str:
    if value is None:
        return "—"
    if "ms" in metric or "KiB" in metric or "%" in metric:
        return f"{value:,.2f}" if value < 100 else f"{value:,.0f}"
    return f"{value:,.0f}" if value >= 100 else f"{value:,.1f}"


def print_report(r: dict, rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 120)
    mach = r.get("machine", {})
    limits = Table(title="machine limits", show_header=True)
    for col in ("limit", "value"):
        limits.add_column(col)
    if "seq_write" in mach:
        w, f = mach["seq_write"], mach["fsync"]
        limits.add_row(
            f"seq write {w['bytes'] >> 20} MiB, fdatasync every {w['sync_every'] >> 20} MiB",
            f"{w['mb_s']:,.0f} MB/s (median of {w['runs']}: {w['min_mb_s']:,.0f} to "
            f"{w['max_mb_s']:,.0f})",
        )
        if "seq_read" in mach:
            rd = mach["seq_read"]
            how = "O_DIRECT" if rd["direct"] else "page cache dropped"
            limits.add_row(
                f"seq read {rd['bytes'] >> 20} MiB, {rd['block'] >> 20} MiB reads, {how}",
                f"{rd['mb_s']:,.0f} MB/s (median of {rd['runs']}: {rd['min_mb_s']:,.0f} to "
                f"{rd['max_mb_s']:,.0f})",
            )
        limits.add_row(
            f"append {f['size'] >> 10} KiB + fdatasync, p50 / p99 / max",
            f"{f['p50_ms']:.2f} / {f['p99_ms']:.2f} / {f['max_ms']:.2f} ms",
        )
    elif "error" in mach:
        limits.add_row("disk", f"[red]{mach['error']}")
    meta = r["meta"]
    limits.add_row(
        "CPUs / load average before → after",
        f"{meta['cpus']} / {meta['load_before']} → {meta.get('load_after', '?')}",
    )
    console.print(limits)
    if not rows:
        return

    table = Table(title=f"slipstream vs NATS JetStream ({meta['mode']} run)", show_lines=False)
    for col, justify in (
        ("workload", "left"),
        ("metric", "left"),
        ("slipstream", "right"),
        ("JetStream", "right"),
        ("ratio", "right"),
        ("target", "left"),
        ("", "left"),
    ):
        table.add_column(col, justify=justify)
    for row in rows:
        ss = fmt(row["slipstream"], row["metric"])
        js = fmt(row["jetstream"], row["metric"])
        if row.get("slipstream_error"):
            ss = "[red]error[/red]"
        if row.get("jetstream_error"):
            js = "[red]error[/red]"
        verdict = {"PASS": "[green]PASS", "MISS": "[red]MISS", None: ""}[row["result"]]
        table.add_row(
            row["workload"],
            row["metric"],
            ss,
            js,
            f"{row['ratio']:.2f}x" if row["ratio"] else "—",
            row["target"] or "",
            verdict,
        )
    console.print(table)
    errors = {
        f"{peer}: {row['workload']}": row[f"{peer}_error"]
        for row in rows
        for peer in ("slipstream", "jetstream")
        if row.get(f"{peer}_error")
    }
    for where, message in errors.items():
        console.print(f"[red]error[/red] {where}: {message}", highlight=False)
    for peer in ("slipstream", "jetstream"):
        lost = get(r[peer], "latency", "lost")
        if lost:
            console.print(f"[red]warning[/red] {peer}: the latency follower missed {lost} events")
    console.print(
        "ratio = slipstream / JetStream (for latency lower is better). JetStream 2.9 acknowledges "
        "a publish before the message is fsynced; slipstream with fsync=always acknowledges after "
        "fdatasync, so throughput and latency ratios favour JetStream's weaker guarantee. "
        "Rates in MB/s are 10^6 payload bytes per second.",
        style="dim",
    )


# -- main ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke test < 1 min")
    parser.add_argument("--json", metavar="FILE", help="also write all results as JSON")
    parser.add_argument(
        "--only", metavar="NAMES", help=f"comma-separated subset of: {', '.join(WORKLOADS)}"
    )
    parser.add_argument(
        "--peers",
        default="jetstream,slipstream",
        help="comma-separated subset of: jetstream, slipstream",
    )
    parser.add_argument(
        "--dir",
        metavar="DIR",
        default=None,
        help="where data directories go (default: the system temp dir); the "
        "disk limits are measured there too",
    )
    parser.add_argument(
        "--nats-window", type=int, default=4096, help="JetStream: unacknowledged publishes"
    )
    parser.add_argument(
        "--nats-fetch", type=int, default=10_000, help="JetStream: messages per pull fetch"
    )
    parser.add_argument(
        "--linger-ms", type=float, default=5.0, help="slipstream: producer linger (ms)"
    )
    parser.add_argument(
        "--compression",
        choices=("default", "none", "lz4", "zstd"),
        default="default",
        help="slipstream: producer compression (default: the client's default)",
    )
    args = parser.parse_args(argv)

    only = set(WORKLOADS) - OPT_IN if not args.only else {w.strip() for w in args.only.split(",")}
    unknown = only - set(WORKLOADS)
    if unknown:
        parser.error(f"unknown workload(s): {', '.join(sorted(unknown))}")
    peers = {p.strip() for p in args.peers.split(",")}
    mode = "quick" if args.quick else "full"
    sizes = SIZES[mode]
    root = Path(tempfile.mkdtemp(prefix="slipstream-bench-", dir=args.dir))
    results: dict = {
        "meta": {
            "mode": mode,
            "sizes": sizes,
            "workloads": sorted(only),
            "root": str(root),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_before": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
        "machine": {},
        "jetstream": {},
        "slipstream": {},
    }
    try:
        if "machine" in only:
            print(f"machine: disk limits in {root}")
            attempt(
                results,
                "machine",
                machine.measure,
                root / "machine",
                sizes["disk_bytes"],
                sizes["fsync_iterations"],
            )
        timed = only - {"machine", "streams", "transactions", "storage", "consumers", "scaling"}
        if "jetstream" in peers and timed:
            results["jetstream"] = run_jetstream(root, sizes, only, args)
        if "slipstream" in peers and only - {"machine", "storage", "consumers", "scaling"}:
            results["slipstream"] = run_slipstream(root, sizes, only, args)
        if "storage" in only:  # bytes on disk per event, both peers (bench/storage.py)
            import storage

            print("storage: bytes on disk per event (bench/storage.py)")
            chosen = tuple(p for p in storage.PEERS if p in peers)
            attempt(results, "storage", storage.measure, root / "storage", args.quick, chosen)
        if "consumers" in only:  # subscriptions, groups, queues (bench/consumers.py)
            import consumers

            print("consumers: subscriptions, groups and queues (bench/consumers.py)")
            attempt(results, "consumers", consumers.measure, root / "consumers", args.quick, peers)
        if "scaling" in only and "slipstream" in peers:  # elastic streams (bench/scaling.py)
            import scaling

            print("scaling: a rate ramp on an elastic stream (bench/scaling.py)")
            attempt(results, "scaling", scaling.measure, root / "scaling", args.quick)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results["meta"]["load_after"] = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    rows = build_rows(results, only)
    results["rows"] = rows
    print()
    print_report(results, rows)
    if "slipstream" in results.get("storage", {}):
        import storage

        storage.print_results(results["storage"])
    if "rows" in results.get("consumers", {}):
        import consumers

        consumers.print_report(results["consumers"], results["consumers"]["rows"])
    if "rows" in results.get("scaling", {}):
        import scaling

        scaling.print_report(results["scaling"])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
        print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

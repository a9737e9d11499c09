"""The README's main job, as a user runs it: ``python -m auctions live`` with its own embedded
broker, then ``python -m auctions replay`` over what it recorded. Real processes end to end.
And job 1 on the elastic bids stream: every bid counted once while the stream splits and
merges under the running query."""

from __future__ import annotations

import collections
import datetime as dt
import json
import os
import random
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from auctions import pipeline
from conftest import BrokerProcess
from pyspark.sql import SparkSession
from pyspark.sql.streaming import StreamingQuery

import slipstream

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
#: what ./run.sh used to print besides the job's own output
NOISE = ("Traceback", "NativeCodeLoader", "Setting default log level", "log4j profile")


def auctions(*args: str, timeout: float) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "auctions", *args, "--json"],
        cwd=EXAMPLES,
        env={**os.environ, "PYTHONPATH": str(EXAMPLES)},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for noise in NOISE:  # the run is quiet: errors only
        assert noise not in done.stderr, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_live_pipeline_runs_stops_cleanly_and_replays(tmp_path: Path) -> None:
    data_dir = str(tmp_path / "auctions")
    # a short rush hour: 20 s at 3 x the bids stream's target of 1000/s per segment
    cycle = "45:300,20:3000,60:300"
    live = auctions(
        "live", "--duration", "100", "--cycle", cycle, "--data-dir", data_dir, timeout=360
    )
    # the first micro-batch of a cold Spark takes 10-40 s; windows close 15 s into the data
    assert live["bids"] >= 45 * 300 + 20 * 3000
    # the live view names the embedded broker's web console (7071, or any free port)
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/", live["console"]), live["console"]
    # the bids stream split by itself in the rush (above 2 x the target over 10 s); it
    # cannot merge yet (that takes five quiet minutes)
    bids_stream = live["bids_stream"]
    assert bids_stream["policy"] == "events 1000/s factor 2 min 1 max 8"
    assert bids_stream["splits"] >= 1 and bids_stream["merges"] == 0
    assert bids_stream["open_segments"] == 1 + bids_stream["splits"]
    first = bids_stream["scales"][0]
    assert (first["action"], first["sealed"], first["rule"]) == ("split", [0], "hot_10s")
    assert live["windows"] > 0 and live["moves"] > 0
    assert live["window_bids"] <= live["bids"]
    assert live["jobs"]["job 1 windows"]["batch"] >= 1
    # the notifier group handled every price move, then left with nothing in its backlog; the
    # jobs recorded their progress in their subscriptions (the source's "subscription" option)
    consumers = live["consumers"]
    assert consumers["notifier group"] == {
        "members": 0,
        "position": live["price_moves_stored"],
        "backlog_events": 0,
        "lag_ms": 0,
        "started": True,
    }
    assert live["moves"] == live["price_moves_stored"] > 0
    assert consumers["job 1 windows"]["position"] > 0
    assert consumers["job 2 prices"]["position"] > 0

    # the live job stopped its broker: replay starts one on the same data directory
    replay = auctions("replay", "--data-dir", data_dir, timeout=240)
    assert replay["compared"] > 0
    assert replay["bids_v2"] >= replay["bids_v1"] > 0
    assert replay["same"] + len(replay["differ"]) == replay["compared"]


T0 = 1_795_000_000_000  # ms; a multiple of 10 s, so windows start at T0 + k * 10 s
AUCTIONS = 12


def wait_until(check: Callable[[], bool], what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.05)


def rows_read(query: StreamingQuery) -> int:
    return sum(p["numInputRows"] for p in query.recentProgress)


def test_job_1_counts_every_bid_once_while_the_bids_stream_splits_and_merges(
    spark: SparkSession, broker: BrokerProcess, client: slipstream.Client, tmp_path: Path
) -> None:
    """Job 1 as the live job runs it (its subscription, 1 s micro-batches; 100 bids a batch so
    that each phase takes several) while the bids stream is split and merged under it, by hand
    (the policy does the same, only later): bids of window [0, 10) go to segment 0; once the
    job has read part of them, 0 splits and bids of window [30, 40) go to its successors; then
    those merge, the job restarts from its checkpoint, and bids of [60, 70) go to the merged
    segment. Each phase's bids span 4 s, less than the 5 s watermark, so in a correct read
    order nothing is late: every window must hold exactly the bids sent to it. A successor read
    before its predecessor's rest would move the watermark 30 s ahead and drop that rest as
    late; a segment read twice would count bids twice."""
    pipeline.create_streams(client)  # the elastic bids stream: one segment
    rnd = random.Random(17)
    sent: list[tuple[str, float, int]] = []

    def send(phase: int, count: int = 300) -> None:
        with client.producer(pipeline.BIDS) as producer:
            for i in range(count):
                auction, price = f"a{i % AUCTIONS:03d}", round(rnd.uniform(10, 100), 2)
                at = T0 + phase * 30_000 + i * 4_000 // count
                body = {"auction": auction, "bidder": "u1", "price": price}
                producer.send(json.dumps(body).encode(), key=auction, timestamp=at)
                sent.append((auction, price, at))

    def start() -> StreamingQuery:
        return pipeline.start_windows(
            spark,
            broker.address,
            str(tmp_path / "windows"),
            source={"maxEventsPerTrigger": "100", "subscription": pipeline.WINDOWS_JOB},
        )

    query = start()
    send(0)
    wait_until(lambda: rows_read(query) > 0, "the job reads the first bids")
    client.scale_stream(pipeline.BIDS, split=0)  # -> 1, 2
    read_at_split = rows_read(query)
    send(1)
    wait_until(lambda: rows_read(query) > 300, "the job reads past the split")
    client.scale_stream(pipeline.BIDS, merge=[1, 2])  # -> 3
    query.stop()
    read_before_restart = rows_read(query)
    query = start()
    send(2)
    wait_until(lambda: rows_read(query) + read_before_restart >= 600, "the job reads on")
    # one more bid, 60 s later, moves the watermark past the three windows: they close
    with client.producer(pipeline.BIDS) as producer:
        producer.send(
            b'{"auction": "z", "bidder": "u1", "price": 1.0}', key="z", timestamp=T0 + 120_000
        )

    def windows() -> list[dict]:
        with client.reader(pipeline.WINDOWS, "earliest", end=client.tail(pipeline.WINDOWS)) as r:
            return [json.loads(e.value) for e in r]

    wait_until(lambda: len(windows()) >= 3 * AUCTIONS, "the three windows of each auction close")
    query.stop()
    assert query.exception() is None
    assert 0 < read_at_split < 300  # the split came while segment 0 was being read

    expected: dict[tuple[str, int], list[float]] = collections.defaultdict(list)
    for auction, price, at in sent:
        expected[(auction, (at - T0) // 10_000 * 10)].append(price)
    got = {}
    for w in windows():
        start_s = dt.datetime.fromisoformat(w["start"]).timestamp() * 1000 - T0
        key = (w["auction"], int(start_s) // 1000)
        assert key not in got, f"window {key} written twice"
        got[key] = w
    assert sorted(got) == sorted(expected)
    for key, prices in expected.items():
        w = got[key]
        assert (w["bids"], w["max_price"]) == (len(prices), max(prices)), key
        assert abs(w["mean_price"] - sum(prices) / len(prices)) < 0.006, key
    scales = client.scale_history(pipeline.BIDS)
    assert [(sorted(e.sealed), e.created) for e in scales] == [([0], [1, 2]), ([1, 2], [3])]

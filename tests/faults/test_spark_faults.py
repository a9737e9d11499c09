"""Exactly-once end to end through Spark: the auctions pipeline (examples/auctions: bids ->
10 s windows -> price moves, two chained jobs with the slipstream source and transactional sink)
runs as its own driver process (spark_job.py) while the tests kill -9 the driver at random
points, kill -9 the broker under it, and crash the driver inside the sink's commit, before and
after the broker commit. After restarts from the checkpoints, every window and every price move
must be in the output streams exactly once, with the values a batch recomputation gives, and
nothing else.

The input is built so that the right output does not depend on where micro-batches are cut:
one bids segment read in order, every bid at most 3 s behind any earlier one (the watermark
allows 5 s, so none is dropped as late), and prices that are multiples of 0.25 (sums are exact,
so a window's mean is the same whatever order Spark adds its bids in). Random delays come from
SEED (printed; set SLIPSTREAM_FAULT_SEED to replay another schedule).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

import pytest
from auctions import pipeline
from conftest import BrokerProcess
from pyspark.sql import SparkSession

import slipstream

pytestmark = pytest.mark.slow

SEED = int(os.environ.get("SLIPSTREAM_FAULT_SEED", "4"))
T0 = 1_795_000_000_000  # ms; a multiple of 10 s, so windows start at T0 + k * 10 s
AUCTIONS = 8
BIDS = 1200
STEP_MS = 50  # 60 s of bids; 120 per micro-batch (6 s): a window per auction closes at a time
MAX_LATE_MS = 3000
WINDOW_MS = 10_000
WATERMARK_MS = 5_000  # pipeline.WindowJob's
MOVES = pipeline.PRICE_MOVES
JOB = Path(__file__).with_name("spark_job.py")
ROOT = Path(__file__).resolve().parents[2]


Bid = tuple[str, float, int]  # auction, price, event time (ms)


def make_bids(seed: int = 1) -> list[Bid]:
    rnd = random.Random(seed)
    names = [f"a{i}" for i in range(AUCTIONS)]
    weights = [1 / (i + 1) for i in range(AUCTIONS)]
    prices = {name: 10.0 + 5 * i for i, name in enumerate(names)}
    bids = []
    for i in range(BIDS):
        auction = rnd.choices(names, weights)[0]
        if rnd.random() < 0.02:  # a bidding war: job 2 raises an alert
            prices[auction] += 0.25 * round(prices[auction] * 0.4 / 0.25)
        else:
            prices[auction] += 0.25 * rnd.randint(1, 8)
        late = rnd.randint(100, MAX_LATE_MS) if rnd.random() < 0.15 and i < BIDS - 1 else 0
        bids.append((auction, prices[auction], T0 + i * STEP_MS - late))
    return bids


def load_bids(client: slipstream.Client, bids: list[Bid]) -> None:
    client.create_stream(pipeline.BIDS, segments=1)  # read in order: lateness stays bounded
    client.create_stream(pipeline.WINDOWS, segments=2)
    client.create_stream(pipeline.PRICE_MOVES, segments=2)
    with client.producer(pipeline.BIDS) as producer:
        for auction, price, ts in bids:
            value = json.dumps({"auction": auction, "bidder": "u1", "price": price}).encode()
            producer.send(value, key=auction, timestamp=ts)


def iso(ms: int) -> str:
    """A timestamp as Spark's to_json writes it in UTC."""
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.000Z")


def final_watermark(bids: list[Bid]) -> int:
    return max(ts for _, _, ts in bids) - WATERMARK_MS


def expected_windows(bids: list[Bid]) -> dict[tuple[str, str], dict[str, Any]]:
    """Every window the pipeline closes by the end: its end is behind the final watermark
    (no window ends exactly on it: the last bid is at ...950 ms)."""
    groups: dict[tuple[str, int], list[float]] = defaultdict(list)
    for auction, price, ts in bids:
        groups[(auction, ts - ts % WINDOW_MS)].append(price)
    windows = {}
    for (auction, start), prices in groups.items():
        if start + WINDOW_MS > final_watermark(bids):
            continue
        mean = Decimal(repr(sum(prices) / len(prices))).quantize(Decimal("0.01"), ROUND_HALF_UP)
        windows[(auction, iso(start))] = {
            "auction": auction,
            "start": iso(start),
            "end": iso(start + WINDOW_MS),
            "bids": len(prices),
            "max_price": max(prices),
            "mean_price": float(mean),
        }
    return windows


def expected_moves(windows: dict[tuple[str, str], dict[str, Any]]) -> dict[tuple[str, str], Any]:
    """Job 2's output for these windows, computed as track_prices does (previous None: none)."""
    moves = {}
    for auction in {a for a, _ in windows}:
        previous = math.nan
        for window in sorted((w for w in windows.values() if w["auction"] == auction), key=end):
            first = math.isnan(previous)
            change = 0.0 if first else (window["max_price"] - previous) / previous * 100
            moves[(auction, window["end"])] = {
                "auction": auction,
                "end": window["end"],
                "max_price": window["max_price"],
                "previous": None if first else previous,
                "change_pct": round(change, 1),
                "alert": change >= pipeline.JUMP * 100,
            }
            previous = window["max_price"]
    return moves


def end(row: dict[str, Any]) -> str:
    return str(row["end"])


def read_all(client: slipstream.Client, stream: str) -> list[dict[str, Any]]:
    with client.reader(stream, "earliest", end=client.tail(stream)) as reader:
        return [json.loads(e.value) for e in reader]


def output_problems(
    windows: list[dict[str, Any]],
    moves: list[dict[str, Any]],
    expected: dict[tuple[str, str], dict[str, Any]],
    *,
    complete: bool,
) -> list[str]:
    """What is wrong with the output: duplicates, extras, wrong values, and (when the pipeline
    is done) anything missing. Before then every window and move must still be written at most
    once and be right: a duplicate committed before a crash would be there for good."""
    problems = []
    for name, rows, want_rows, key in (
        ("window", windows, expected, ("auction", "start")),
        ("price move", moves, expected_moves(expected), ("auction", "end")),
    ):
        counts = Counter(tuple(row[k] for k in key) for row in rows)
        problems += [f"{name} {k} written {n} times" for k, n in sorted(counts.items()) if n > 1]
        problems += [f"{name} {k} not expected" for k in sorted(counts.keys() - want_rows.keys())]
        if complete:
            problems += [f"{name} {k} missing" for k in sorted(want_rows.keys() - counts.keys())]
        for row in rows:
            want = want_rows.get((row[key[0]], row[key[1]]))
            # a first window's previous is NaN in pandas, null on the way out: to_json omits it
            got = {"previous": None, **row} if name == "price move" else row
            if want is not None and got != want:
                problems.append(f"{name} {row} should be {want}")
    return problems


def check_output_so_far(address: str, bids: list[Bid]) -> None:
    with slipstream.connect(address) as client:
        windows = read_all(client, pipeline.WINDOWS)
        moves = read_all(client, pipeline.PRICE_MOVES)
    problems = output_problems(windows, moves, expected_windows(bids), complete=False)
    assert not problems, "\n".join(problems[:30])


def check_exactly_once(spark: SparkSession, address: str, bids: list[Bid]) -> None:
    """Every expected window and price move exactly once, equal to what it should be, nothing
    else, and nothing left staged."""
    expected = expected_windows(bids)
    with slipstream.connect(address) as client:
        assert len(read_all(client, pipeline.BIDS)) == BIDS
        windows = read_all(client, pipeline.WINDOWS)
        moves = read_all(client, pipeline.PRICE_MOVES)
        open_txns = client.transactions()

    # the expectation is the pipeline's own definition, recomputed in one batch over the bids
    history = (
        spark.read.format("slipstream")
        .option("broker", address)
        .option("stream", pipeline.BIDS)
        .option("schema", pipeline.BID_SCHEMA)
        .load()
    )
    recomputed = [json.loads(r.value) for r in pipeline.window_stats(history).collect()]
    watermark = iso(final_watermark(bids))
    assert {(w["auction"], w["start"]): w for w in recomputed if w["end"] <= watermark} == expected
    assert len(expected) >= 5 * AUCTIONS

    problems = output_problems(windows, moves, expected, complete=True)
    assert not problems, "\n".join(problems[:30])
    assert any(m["alert"] for m in moves), "the data should make job 2 raise alerts"
    assert open_txns == [], f"staged data left behind: {open_txns}"


class Job:
    """spark_job.py as a process group of its own (the Python driver and its JVM; pyspark's
    daemons end when the JVM does), killed the way kill -9 would."""

    def __init__(self, address: str, checkpoints: Path, log_path: Path) -> None:
        self.address = address
        self.checkpoints = checkpoints
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.offset = 0  # where this life's output starts in the log
        self.lives = 0

    def start(self, fault: str | None = None) -> None:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT / "examples"), str(ROOT)]),
            "PYTHONWARNINGS": "ignore",  # pandas' FutureWarnings from the Python workers
        }
        env.pop("SLIPSTREAM_FAULT", None)
        if fault is not None:
            env["SLIPSTREAM_FAULT"] = fault
        with open(self.log_path, "ab") as log:
            log.write(f"--- life {self.lives} (fault: {fault}) ---\n".encode())
            self.offset = log.tell()
            self.proc = subprocess.Popen(
                [sys.executable, str(JOB), self.address, str(self.checkpoints)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self.lives += 1

    def lines(self) -> list[str]:
        with open(self.log_path, "rb") as log:
            log.seek(self.offset)
            return log.read().decode(errors="replace").splitlines()

    def batches(self) -> int:
        """Micro-batches completed in this life (either query)."""
        return sum(1 for line in self.lines() if line.split()[1:2] == ["batch"])

    def wait_for_batches(self, count: int, timeout: float = 120) -> bool:
        """True once ``count`` batches completed in this life; False if the job ended first."""
        deadline = time.monotonic() + timeout
        while self.batches() < count:
            assert self.proc is not None
            if self.proc.poll() is not None:
                return False
            assert time.monotonic() < deadline, f"no progress:\n{self.tail()}"
            time.sleep(0.05)
        return True

    def sleep(self, seconds: float) -> None:
        """Sleep, or less if the job ends."""
        assert self.proc is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(seconds)

    def kill(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the job did not finish within {timeout} s:\n{self.tail()}")

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


@pytest.fixture
def job(broker: BrokerProcess, tmp_path: Path) -> Any:
    job = Job(broker.address, tmp_path / "checkpoints", tmp_path / "job.log")
    yield job
    if job.proc is not None:
        job.kill()


def progress(client: slipstream.Client) -> str:
    windows = sum(client.tail(pipeline.WINDOWS).positions.values())
    moves = sum(client.tail(pipeline.PRICE_MOVES).positions.values())
    return f"{windows} windows and {moves} price moves committed"


def batch_ids(directory: Path) -> list[int]:
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def crash_traces(client: slipstream.Client, checkpoints: Path, fault: str) -> list[str]:
    """Where a crash inside the sink's commit left the queries: the batch Spark planned but did
    not log as committed, and what the broker has of it (staged only, or committed)."""
    traces = []
    for name in ("windows", "prices"):
        checkpoint = checkpoints / name
        query_id = json.loads((checkpoint / "metadata").read_text())["id"]
        planned, logged = batch_ids(checkpoint / "offsets"), batch_ids(checkpoint / "commits")
        if not planned or planned[-1] in logged:
            continue
        batch = planned[-1]
        last = client.last_commit(f"spark:{query_id}")
        committed = -1 if last is None else last.metadata["batch"]
        prefix = f"spark:{query_id}:{batch}:"
        staged = [t for t in client.transactions() if t.label.startswith(prefix)]
        if fault.startswith("spark.sink.before_commit") and committed < batch and staged:
            traces.append(f"{name} batch {batch}: staged in {len(staged)} transactions only")
        if fault.startswith("spark.sink.after_commit") and committed == batch:
            traces.append(f"{name} batch {batch}: committed by the broker, not logged by Spark")
    return traces


@pytest.mark.timeout(600)
def test_kill_9_of_the_driver_at_random_points_and_inside_the_sink_commit(
    spark: SparkSession, broker: BrokerProcess, client: slipstream.Client, job: Job
) -> None:
    """Five lives of the driver: killed by the sink's crash point in job 2 just after the
    broker commit, before Spark logs the batch; killed with SIGKILL at a random moment; killed
    by the crash point just before the broker commit (in whichever job commits data first);
    killed at random again; then left to finish. After every death the output must hold no
    duplicate and no wrong value."""
    bids = make_bids()
    load_bids(client, bids)
    rnd = random.Random(SEED)
    print(f"seed {SEED}")
    faults = (f"spark.sink.after_commit@{MOVES}", None, "spark.sink.before_commit", None)
    for life, fault in enumerate(faults):
        if fault is None:
            delay = rnd.uniform(0, 8)  # in the replay of the last batch, or in later ones
            job.start()
            if job.wait_for_batches(1):
                job.sleep(delay)
            job.kill()
            death = f"kill -9 {delay:.1f} s after the first batch, {job.batches()} batches in"
        else:
            job.start(fault=fault)
            code = job.wait(240)
            assert code == -signal.SIGKILL, f"no crash at {fault} ({code}):\n{job.tail()}"
            traces = crash_traces(client, job.checkpoints, fault)
            assert traces, f"the crash at {fault} left no trace in the checkpoints or the broker"
            death = f"{fault}: {'; '.join(traces)}"
        print(f"life {life}: {death}; {progress(client)}")
        check_output_so_far(broker.address, bids)
    job.start()
    code = job.wait(300)
    assert code == 0, f"the job failed ({code}):\n{job.tail()}"
    check_exactly_once(spark, broker.address, bids)


def wait_for_staging(address: str, timeout: float = 30) -> list[str]:
    """Labels of the transactions open on the broker, once there are some: a micro-batch is
    being staged or committed."""
    deadline = time.monotonic() + timeout
    with slipstream.connect(address) as client:
        while not (open_txns := client.transactions()) and time.monotonic() < deadline:
            time.sleep(0.005)
    return [t.label for t in open_txns]


@pytest.mark.timeout(420)
def test_kill_9_of_the_broker_under_the_running_pipeline(
    spark: SparkSession, broker: BrokerProcess, client: slipstream.Client, job: Job
) -> None:
    """Three kills of the broker while the driver runs, each after a random number of
    micro-batches, once a batch is being staged, plus a random delay (0-100 ms: in the middle of
    staging or of the commit, or just after it); the broker is down for a random while and
    restarted on the same data directory and port. Queries that fail are restarted from their
    checkpoints."""
    bids = make_bids()
    load_bids(client, bids)
    rnd = random.Random(SEED)
    print(f"seed {SEED}")
    job.start()
    batches = 0
    for kill in range(3):
        batches += rnd.randint(1, 4)
        delay, down = rnd.uniform(0, 0.1), rnd.uniform(0.1, 2.0)
        assert job.wait_for_batches(batches, timeout=180), f"the job ended:\n{job.tail()}"
        staged = wait_for_staging(broker.address)
        time.sleep(delay)
        broker.kill()
        time.sleep(down)
        broker.start()
        print(
            f"kill {kill}: after batch {batches}, {delay:.3f} s after {staged}, down {down:.2f} s"
        )
        check_output_so_far(broker.address, bids)
    code = job.wait(300)
    assert code == 0, f"the job failed ({code}):\n{job.tail()}"
    print(*(line for line in job.lines() if " failed " in line or " done " in line), sep="\n")
    check_exactly_once(spark, broker.address, bids)

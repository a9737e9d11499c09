"""The auctions pipeline (examples/auctions) as a Spark driver for test_spark_faults.py: both
jobs run continuously from fixed checkpoints, in small micro-batches, until every input has been
read to its end and both queries are idle; then the driver exits 0.

    PYTHONPATH=examples python tests/faults/spark_job.py BROKER CHECKPOINTS \\
        [--bids-per-trigger N] [--windows-per-trigger N]

The tests kill it with SIGKILL (its whole process group: this process and its JVM) and start it
again on the same checkpoints. A query that fails (the broker died under it) is started again
from its checkpoint, as a supervisor would. Progress goes to stdout, one line per event:
``started``, ``batch <query> <batch id> <input rows>`` (a progress report), ``failed``, ``done``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from auctions import pipeline
from pyspark.sql.streaming.query import StreamingQuery

import slipstream
from slipstream.spark import session

IDLE_FOR = 2.0  # seconds both queries must stay caught up, running no batch, before done
MAX_RESTARTS = 30
INPUTS = {"windows": pipeline.BIDS, "prices": pipeline.WINDOWS}


def say(*words: object) -> None:
    print(f"{time.monotonic():.2f}", *words, flush=True)


def caught_up(query: StreamingQuery, stream: str, client: slipstream.Client) -> bool:
    """The query found nothing new at its last trigger, and its last batch ended at the
    stream's current tail."""
    progress = query.lastProgress
    if not query.isActive or query.status["isDataAvailable"] or progress is None:
        return False
    end = json.loads(progress.sources[0].endOffset)["positions"]
    tail = client.tail(stream).positions
    return all(end.get(str(segment), 0) == offset for segment, offset in tail.items())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("broker")
    parser.add_argument("checkpoints", type=Path)
    parser.add_argument("--bids-per-trigger", default="120")
    parser.add_argument("--windows-per-trigger", default="6")
    args = parser.parse_args()

    # The sink's crash points run in pyspark's Python workers, which the pyspark daemon keeps in
    # a process group of its own: tell them the driver's (ours; the tests start a new session).
    os.environ["SLIPSTREAM_FAULT_GROUP"] = str(os.getpgid(0))
    spark = session("spark-faults", conf={"spark.sql.streaming.pollingDelay": "50ms"})
    trigger = {"processingTime": "200 milliseconds"}
    starters: dict[str, Callable[[], StreamingQuery]] = {
        "windows": lambda: pipeline.start_windows(
            spark,
            args.broker,
            str(args.checkpoints / "windows"),
            source={"maxEventsPerTrigger": args.bids_per_trigger},
            trigger=trigger,
        ),
        "prices": lambda: pipeline.start_prices(
            spark,
            args.broker,
            str(args.checkpoints / "prices"),
            # a limit on job 2 is safe only because job 1's batches (120 bids, 6 s of event
            # time) close at most one window per auction: see pipeline.start_prices
            source={"maxEventsPerTrigger": args.windows_per_trigger},
            trigger=trigger,
        ),
    }
    queries = {name: start() for name, start in starters.items()}
    say("started", os.getpid())
    reported = dict.fromkeys(queries, -1)
    restarts = 0
    quiet_since = time.monotonic()
    with slipstream.connect(args.broker, reconnect_timeout=2) as client:
        while True:
            time.sleep(0.1)
            for name, query in list(queries.items()):
                progress = query.lastProgress
                if progress is not None and progress.batchId != reported[name]:
                    reported[name] = progress.batchId
                    quiet_since = time.monotonic()
                    say("batch", name, progress.batchId, progress.numInputRows)
                if query.isActive:
                    continue
                say("failed", name, str(query.exception()).splitlines()[:1])
                restarts += 1
                if restarts > MAX_RESTARTS:
                    return 3
                time.sleep(0.5)
                queries[name] = starters[name]()
            try:
                done = all(caught_up(q, INPUTS[n], client) for n, q in queries.items())
            except slipstream.SlipstreamError:  # the broker is away: not done
                done = False
            if not done:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= IDLE_FOR and not any(
                q.status["isTriggerActive"] for q in queries.values()
            ):
                break
    for query in queries.values():
        query.stop()
    spark.stop()
    say("done", restarts)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A load ramp on an elastic stream, read by a consumer group and a Spark query at once.

The broker runs its scaling clock 20 times faster (``SLIPSTREAM_SCALING_SPEEDUP=20``, see
docs/scaling.md: the 10/60/300 s windows take 0.5/3/15 s, rates stay in real events/s), so a
``by_event_rate(100)`` stream splits twice by itself under a burst of over a thousand events
a second and merges by itself after some fifteen quiet seconds. Meanwhile a group of three
members (joining after the first split, so that they start behind) and a Spark query (small
micro-batches, so that it lags) read the stream, and the query writes what it reads through
the exactly-once sink to another stream. One history, what the producers had acknowledged,
is checked at both ends:

* the Spark result (checker.py): every acknowledged event exactly once, at its acknowledged
  position, and per key in send order when ordered by micro-batch, then ``(segment, offset)``;
* the group (group_checker.py): every acknowledged event at least once, contiguous within
  each grant, and per key first handed out in send order across the splits and the merge.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from checker import Sent, check_history, encode, produce_and_record
from conftest import BrokerProcess
from group_checker import Delivery, Record, check_group
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

import slipstream
from slipstream import Event, Position, ScalingPolicy
from slipstream.format import events_of
from slipstream.streams import ScalingDecision

STREAM, OUT, SUBSCRIPTION = "ramp/in", "ramp/out", "group"
SPEEDUP = 20
TARGET = 100  # events/s per segment: > 200 splits within 0.5 s, a pair below 50 merges
MEMBERS = 3


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        time.sleep(0.1)


def decisions(client: slipstream.Client) -> list[ScalingDecision]:
    """The stream's scale history; raises for a manual scale (its reason is not a decision)."""
    return [ScalingDecision.from_json(e.reason) for e in client.scale_history(STREAM)]


def count(client: slipstream.Client, action: str) -> int:
    return sum(d.action == action for d in decisions(client))


class Member(threading.Thread):
    """One group member (its own client) writing down every event it is handed, with its
    grant, before it asks for more (which is when ``auto`` commits what it had)."""

    def __init__(self, address: str, run: str, records: list[Record], lock: threading.Lock):
        super().__init__(name=run, daemon=True)
        self.address, self.run_name, self.records, self.lock = address, run, records, lock
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with slipstream.connect(self.address) as client:
                consumer = client.consumer(STREAM, SUBSCRIPTION, name=self.run_name)
                grants: dict[object, int] = {}
                while not self.stop.is_set():
                    items = consumer._next_records(0.2)
                    assert items is not None, "closed"
                    for lease, base, batch in items:
                        grant = grants.setdefault(lease, len(grants) + 1)
                        handed = [
                            Delivery(
                                self.run_name,
                                grant,
                                lease.start,
                                e.segment,
                                e.offset,
                                (e.key or b"").decode(),
                                e.value.decode(),
                                time.time(),
                            )
                            for e in events_of(batch, lease.segment, base)
                        ]
                        with self.lock:
                            self.records.extend(handed)
                consumer.close()
        except BaseException as exc:
            self.error = exc


def spark_result(client: slipstream.Client) -> list[Event]:
    """The query's output as the input events it carried (the ``at`` header names the input
    position and the micro-batch), in micro-batch, then ``(segment, offset)`` order."""
    with client.reader(OUT, "earliest", end=client.tail(OUT)) as reader:
        written = list(reader)
    carried = []
    for event in written:
        segment, offset, batch = (int(x) for x in event.headers["at"].split(b":"))
        carried.append((batch, Event(event.key, event.value, {}, 0, segment, offset)))
    carried.sort(key=lambda c: (c[0], c[1].segment, c[1].offset))
    return [e for _, e in carried]


@pytest.mark.slow
def test_a_ramp_splits_and_merges_by_itself_while_a_group_and_spark_read(
    spark: SparkSession, broker_factory: type[BrokerProcess], tmp_path: Path
) -> None:
    broker = broker_factory()
    broker.env["SLIPSTREAM_SCALING_SPEEDUP"] = str(SPEEDUP)
    broker.start()
    client = broker.client()
    policy = ScalingPolicy.by_event_rate(TARGET, scale_factor=2, min_segments=1, max_segments=4)
    client.create_stream(STREAM, scaling=policy)
    client.create_stream(OUT, segments=1)
    client.create_subscription(STREAM, SUBSCRIPTION)

    source = (
        spark.readStream.format("slipstream")
        .option("broker", broker.address)
        .option("stream", STREAM)
        .option("startingPosition", "earliest")
        .option("maxEventsPerTrigger", "400")  # small batches: the query lags behind the scales
        .load()
    )
    # current_timestamp() is the micro-batch's timestamp (the same on a replay of it)
    at = F.concat_ws(":", "segment", "offset", F.unix_millis(F.current_timestamp()))
    query = (
        source.select("key", "value", F.create_map(F.lit("at"), at.cast("binary")).alias("headers"))
        .writeStream.format("slipstream")
        .option("broker", broker.address)
        .option("stream", OUT)
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .start()
    )

    acknowledged: dict[bytes, Position] = {}
    lock = threading.Lock()
    records: list[Record] = []
    members = [Member(broker.address, f"m{i}", records, lock) for i in range(MEMBERS)]
    trickle, burst = threading.Event(), threading.Event()

    def producer(number: int, stop: threading.Event, **pace: int | float) -> threading.Thread:
        thread = threading.Thread(
            target=produce_and_record,
            args=(broker.address, STREAM, number, acknowledged, lock, stop),
            kwargs=pace,
            daemon=True,
        )
        thread.start()
        return thread

    try:
        # about 20 events/s all along, far below the target; about 1500/s during the burst
        producers = [producer(0, trickle, keys=8, per_round=2, pause=0.1)]
        time.sleep(1)
        burst_started = time.monotonic()
        producers += [producer(n, burst, keys=16, per_round=10, pause=0.01) for n in (1, 2)]
        wait_until(lambda: count(client, "split") >= 1, 30, "the first split")
        for member in members:  # behind from the start: segment 0 holds a backlog
            member.start()
        wait_until(lambda: count(client, "split") >= 2, 30, "the second split")
        time.sleep(1)
        burst.set()
        burst_seconds = time.monotonic() - burst_started
        with lock:
            burst_rate = sum(1 for v in acknowledged if b'"producer":0' not in v) / burst_seconds
        wait_until(lambda: count(client, "merge") >= 1, 60, "a merge")
        time.sleep(1.5)  # keys cross the merge too
        trickle.set()
        for thread in producers:
            thread.join(10)

        def group_has_all() -> bool:
            with lock:
                delivered = {r.value for r in records if isinstance(r, Delivery)}
            return all(v.decode() in delivered for v in acknowledged)

        def spark_has_all() -> bool:
            assert query.exception() is None
            written = {e.value for e in spark_result(client)}
            return all(v in written for v in acknowledged)

        wait_until(group_has_all, 60, "the group's delivery of every acknowledged event")
        wait_until(spark_has_all, 90, "the query's output of every acknowledged event")
        time.sleep(1)  # a duplicate would come in a later batch
        assert query.exception() is None
        result = spark_result(client)
        history = decisions(client)  # automatic decisions only: a manual scale fails to decode
        merged = {n for e in client.scale_history(STREAM) if len(e.sealed) > 1 for n in e.created}
    finally:
        query.stop()
        for member in members:
            member.stop.set()
        for member in members:
            if member.ident is not None:
                member.join(10)
        client.close()
    assert [m.error for m in members] == [None] * MEMBERS

    splits = [d for d in history if d.action == "split"]
    merges = [d for d in history if d.action == "merge"]
    assert len(splits) >= 2 and len(merges) >= 1, history
    assert all(d.rule.startswith("hot_") for d in splits), splits
    assert all(d.rule == "cold_300s" for d in merges), merges
    # rates are recorded in real events per second, not per dilated second
    first = splits[0].inputs[0].rates.events.last_10s
    assert 2 * TARGET < first < 8 * burst_rate, (first, burst_rate)
    assert any(p.segment in merged for p in acknowledged.values())  # written after a merge
    at_spark = check_history(acknowledged, result)
    report = check_group(acknowledged, records)
    assert at_spark[:20] == [] and report.problems == [], (len(at_spark), at_spark[:20], report)
    assert report.counts["runs"] == MEMBERS


def test_the_key_order_rule_catches_a_successor_handed_out_early() -> None:
    """The group checker's cross-segment rule can fail: a key's event in a successor handed
    out before that key's earlier event in its predecessor."""
    sent = [encode(Sent(0, "p0-k0", seq)).decode() for seq in range(3)]
    acknowledged = {
        sent[0].encode(): Position(0, 0),
        sent[1].encode(): Position(0, 1),
        sent[2].encode(): Position(1, 0),
    }

    def got(run: str, segment: int, offset: int, value: str, t: float) -> Delivery:
        return Delivery(run, 1, offset if segment == 1 else 0, segment, offset, "p0-k0", value, t)

    fine = [got("a", 0, 0, sent[0], 1.0), got("a", 0, 1, sent[1], 1.1), got("b", 1, 0, sent[2], 2)]
    assert check_group(acknowledged, fine).problems == []
    early = [got("a", 0, 0, sent[0], 1.0), got("b", 1, 0, sent[2], 1.5)]
    early.append(got("a", 0, 1, sent[1], 2.0))
    problems = check_group(acknowledged, early).problems
    assert len(problems) == 1 and problems[0].startswith("key order"), problems

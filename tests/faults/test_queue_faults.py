"""Work queues under faults, each run checked as a whole history.

Three members (processes: queue_worker.py) are killed -9 and restarted at random while the
broker is killed -9 and restarted once; some events always fail (nacked until they are
dead-lettered). At the end every produced event was acknowledged exactly once (acks that took
effect, counted by the members), or is in the dead-letter stream, or had an ack whose outcome
the member could not learn (the broker died while answering); never both acknowledged and
dead-lettered. For ``key_ordered_queue`` also: no two events of one key were ever in flight at
once (each acknowledged delivery's interval, received to acked, lies inside the broker's, so
two of one key must not overlap), and the acks of each key came in offset order.
"""

from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import BrokerProcess

import slipstream

WORKER = Path(__file__).with_name("queue_worker.py")
SEGMENTS = 2
MEMBERS = 3
KEYS = 12
EVENTS = 1200
POISON_EVERY = 101
CHAOS_S = 16.0
SETTLE_S = 60.0  # after the chaos, everything must be settled within this


@dataclass
class History:
    """What the members recorded, and what the streams hold."""

    produced: dict[tuple[int, int], bytes | None] = field(default_factory=dict)  # -> key
    poison: set[tuple[int, int]] = field(default_factory=set)
    dead: Counter[tuple[int, int]] = field(default_factory=Counter)
    acked: Counter[tuple[int, int]] = field(default_factory=Counter)
    unknown_outcome: set[tuple[int, int]] = field(default_factory=set)
    # per key: (received, acked, offset) of each ack that took effect
    intervals: dict[str, list[tuple[float, float, int]]] = field(
        default_factory=lambda: defaultdict(list)
    )


def check(history: History, *, key_ordered: bool, settled: bool) -> list[str]:
    """Every violation found (empty: the run is correct). ``settled``: the broker says
    every event is settled (acknowledged or dead-lettered)."""
    problems = [] if settled else ["the broker did not settle every event"]
    for event in history.produced:
        acks, dead = history.acked[event], history.dead[event]
        if acks > 1:
            problems.append(f"{event} acknowledged {acks} times")
        if acks and dead:
            problems.append(f"{event} acknowledged and dead-lettered")
        if not acks and not dead and event not in history.unknown_outcome:
            problems.append(f"{event} neither acknowledged nor dead-lettered (lost)")
        if event in history.poison and not dead:
            problems.append(f"{event} always failed but is not in the dead-letter stream")
    strays = set(history.dead) - set(history.produced)
    if strays:
        problems.append(f"dead letters of events never produced: {sorted(strays)[:5]}")
    if key_ordered:
        for key, intervals in history.intervals.items():
            intervals.sort()
            end, offset = float("-inf"), -1  # of the interval that ends last so far
            for later_start, later_end, later in intervals:
                if later_start < end:
                    problems.append(f"key {key}: offsets {offset} and {later} in flight at once")
                if later < offset:
                    problems.append(f"key {key}: offset {later} acknowledged after {offset}")
                if later_end > end:
                    end, offset = later_end, later
    return problems


def read_history(client: slipstream.Client, stream: str, records: Path) -> History:
    history = History()
    for event in client.reader(stream, "earliest", client.tail(stream)):
        history.produced[(event.segment, event.offset)] = event.key
        if event.value.startswith(b"poison"):
            history.poison.add((event.segment, event.offset))
    dead_letters = f"{stream}.dlq"
    if dead_letters in [s.name for s in client.list_streams()]:
        for event in client.reader(dead_letters, "earliest", client.tail(dead_letters)):
            source = (int(event.headers["x-source-segment"]), int(event.headers["x-source-offset"]))
            history.dead[source] += 1
    for path in records.glob("*.records"):
        tried: set[tuple[int, int]] = set()
        for line in path.read_text().splitlines():
            kind, *fields = line.split()
            if len(fields) < 2 or not line.endswith(fields[-1]):
                continue
            event = (int(fields[0]), int(fields[1]))
            if kind == "T":
                tried.add(event)
            elif kind == "A" and len(fields) == 5:
                tried.discard(event)
                history.acked[event] += 1
                history.intervals[fields[2]].append(
                    (float(fields[3]), float(fields[4]), int(fields[1]))
                )
            elif kind in "U?":
                tried.discard(event)
                if kind == "?":
                    history.unknown_outcome.add(event)
        history.unknown_outcome |= tried  # killed while flushing them
    return history


class Members:
    def __init__(self, broker: BrokerProcess, stream: str, directory: Path) -> None:
        self.broker = broker
        self.stream = stream
        self.directory = directory
        directory.mkdir()
        self.runs = itertools.count()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.env = {**os.environ, "PYTHONPATH": str(WORKER.parents[1])}

    def start(self) -> subprocess.Popen[bytes]:
        run = next(self.runs)
        with open(self.directory / f"{run}.log", "wb") as log:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    str(WORKER),
                    self.broker.address,
                    self.stream,
                    "work",
                    str(self.directory / f"{run}.records"),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
            )
        self.procs.append(proc)
        return proc

    def kill(self, proc: subprocess.Popen[bytes]) -> None:
        proc.kill()
        proc.wait()
        self.procs.remove(proc)

    def kill_all(self) -> None:
        for proc in list(self.procs):
            self.kill(proc)


def settled(client: slipstream.Client, stream: str) -> bool:
    info = client.describe_subscription(stream, "work")
    return all(s.backlog_events == 0 for s in info.segments)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["queue", "key_ordered_queue"])
def test_queue_under_member_kills_and_a_broker_restart(
    broker_factory: type[BrokerProcess], tmp_path: Path, mode: str
) -> None:
    broker = broker_factory().start()
    stream = "qf/work"
    rng = random.Random(16)
    with broker.client() as client:
        client.create_stream(stream, segments=SEGMENTS)
        client.create_subscription(
            stream,
            "work",
            mode=mode,
            ack_timeout=2.0,
            backoff=0.05,
            max_backoff=0.4,
            max_deliveries=6,
        )
        with client.producer(stream, linger_ms=2) as producer:
            for i in range(EVENTS):
                value = b"poison %d" % i if i % POISON_EVERY == 7 else b"%d" % i
                producer.send(value, key=f"k{i % KEYS}")
    members = Members(broker, stream, tmp_path / "members")
    try:
        for _ in range(MEMBERS):
            members.start()
        start = time.monotonic()
        restarted = False
        while time.monotonic() - start < CHAOS_S:
            time.sleep(rng.uniform(0.5, 1.5))
            members.kill(rng.choice(members.procs))
            members.start()
            if not restarted and time.monotonic() - start > CHAOS_S / 2:
                broker.restart()
                restarted = True
        deadline = time.monotonic() + SETTLE_S
        with broker.client() as client:
            while not (done := settled(client, stream)) and time.monotonic() < deadline:
                time.sleep(0.5)
            members.kill_all()
            history = read_history(client, stream, tmp_path / "members")
    finally:
        members.kill_all()
    assert len(history.produced) == EVENTS
    assert history.poison and sum(history.acked.values()) > EVENTS // 2
    print(
        f"{sum(history.acked.values())} acks took effect, {sum(history.dead.values())} dead "
        f"letters, {len(history.unknown_outcome)} acks of unknown outcome"
    )
    problems = check(history, key_ordered=mode == "key_ordered_queue", settled=done)
    assert not problems, f"{len(problems)} problems, the first: {problems[:10]}"

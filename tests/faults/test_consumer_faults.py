"""Consumer groups under faults, each run checked as a whole history.

A group of three members (processes: consumer_worker.py) is killed -9 member by member and
through two broker kill -9 restarts while producers write: every acknowledged event reaches the
group at least once, in order within each grant, never from before a commit (group_checker.py),
and once a final member has committed everything a fresh member receives nothing, also after
one more restart. A consume-transform-produce loop that commits its positions inside its
transactions is killed -9 and its broker restarted: its output holds every input's result
exactly once.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from checker import Sent, encode, produce_and_record
from conftest import BrokerProcess
from group_checker import Committed, Delivery, check_group, read_records

import slipstream

WORKER = Path(__file__).with_name("consumer_worker.py")
SEGMENTS = 4
MEMBERS = 3
PRODUCERS = 3
KEYS = 5
CHAOS_S = 24.0  # faults for this long; the whole test stays well under a minute on 2 cores


class Workers:
    """consumer_worker.py processes, each with its own run name, record file and log."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir()
        self.runs = itertools.count()
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(WORKER.parents[1]), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
        }

    def start(self, command: str, *args: str, final: bool = False) -> subprocess.Popen[bytes]:
        """Start ``consumer_worker.py command args``; ``{run}`` and ``{records}`` in ``args``
        become the run's name and record file."""
        run = f"{command}{next(self.runs)}"
        records = str(self.directory / f"{run}.jsonl")
        arguments = [a.replace("{run}", run).replace("{records}", records) for a in args]
        with open(self.directory / f"{run}.log", "wb") as log:
            return subprocess.Popen(
                [sys.executable, str(WORKER), command, *arguments, *(["--final"] * final)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
            )

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.directory.glob("*.log"))
        )


def kill(process: subprocess.Popen[bytes]) -> None:
    process.kill()
    process.wait(10)


def alive(processes: list[subprocess.Popen[bytes]], workers: Workers) -> None:
    """A worker that exited by itself failed (the faults here are all survivable)."""
    for process in processes:
        assert process.poll() is None, f"a worker exited with {process.returncode}:\n" + (
            workers.logs()
        )


def test_a_group_delivers_every_event_through_member_and_broker_kills(
    broker_factory: type[BrokerProcess], tmp_path: Path
) -> None:
    rng = random.Random(16)
    stream = "faults/group"
    broker = broker_factory("--roll", "256KiB", "--roll-seconds", "0.5").start()
    with broker.client() as client:
        client.create_stream(stream, segments=SEGMENTS)
        client.create_subscription(stream, "workers")
    workers = Workers(tmp_path / "workers")

    def member(commit: str, final: bool = False) -> subprocess.Popen[bytes]:
        return workers.start(
            "member", broker.address, stream, "workers", "{run}", commit, "{records}", final=final
        )

    acknowledged: dict[bytes, slipstream.Position] = {}
    lock = threading.Lock()
    lives = itertools.count()

    def producers() -> tuple[threading.Event, list[threading.Thread]]:
        """Idempotent producers recording what was acknowledged; they give up at the first
        failure (a broker kill), and new ones start after the restart."""
        life, stop = next(lives), threading.Event()
        threads = [
            threading.Thread(
                target=produce_and_record,
                args=(broker.address, stream, life * 10 + p, acknowledged, lock, stop),
                kwargs={"keys": KEYS, "per_round": 10, "pause": 0.02},
                daemon=True,
            )
            for p in range(PRODUCERS)
        ]
        for thread in threads:
            thread.start()
        return stop, threads

    def stop_producers() -> None:
        stop.set()
        for thread in threads:
            thread.join(60)
            assert not thread.is_alive()

    members = [member(rng.choice(["auto", "manual"])) for _ in range(MEMBERS)]
    stop, threads = producers()
    member_kills = broker_restarts = 0
    started = time.monotonic()
    while (elapsed := time.monotonic() - started) < CHAOS_S:
        time.sleep(rng.uniform(0.4, 1.6))
        alive(members, workers)
        if elapsed > (broker_restarts + 1) * CHAOS_S / 3:
            broker.restart()  # kill -9; the members ride through it and join again
            broker_restarts += 1
            stop_producers()
            stop, threads = producers()
        else:
            victim = rng.randrange(MEMBERS)
            kill(members[victim])
            members[victim] = member(rng.choice(["auto", "manual"]))
            member_kills += 1
    stop_producers()
    alive(members, workers)
    for process in members:
        kill(process)
    final = member("manual", final=True)
    try:
        final_exit: int | str = final.wait(90)
    except subprocess.TimeoutExpired:
        kill(final)
        final_exit = "none: it never saw the backlog drained"
    report = check_group(acknowledged, read_records(workers.directory.glob("*.jsonl")))
    print(
        f"\ngroup history: {report.counts}, {member_kills} member kills, {broker_restarts} "
        f"broker restarts, duplicate rate {report.duplicate_rate:.2%}"
    )
    assert not report.problems, "\n".join(report.problems)
    assert final_exit == 0, f"the final member's exit: {final_exit}\n{workers.logs()}"
    broker.restart()  # what the final member committed is on disk, not only in the broker
    with broker.client() as client:
        described = client.describe_subscription(stream, "workers")
        assert sum(s.backlog_events for s in described.segments) == 0
        with client.consumer(stream, "workers", commit="manual") as fresh:
            deadline = time.monotonic() + 20
            while fresh.assignment != set(range(SEGMENTS)):
                assert time.monotonic() < deadline, "the fresh member got no assignment"
                time.sleep(0.05)
            received = [e for _ in range(20) for e in fresh.poll(0.1)]
        assert received == [], f"a fresh member received {len(received)} committed events"
    assert broker_restarts == 2 and member_kills >= 5
    assert report.counts["acknowledged"] > 2000, "the load was too light to mean anything"
    assert report.counts["commits"] > 0, "no manual member committed"


def test_consume_transform_produce_is_exactly_once_through_kills(
    broker_factory: type[BrokerProcess], tmp_path: Path
) -> None:
    rng = random.Random(17)
    source, sink = "faults/ctp-in", "faults/ctp-out"
    broker = broker_factory().start()
    with broker.client() as client:
        client.create_stream(source, segments=3)
        client.create_stream(sink, segments=2)
        client.create_subscription(source, "transform")
    workers = Workers(tmp_path / "workers")

    def transformer(final: bool = False) -> subprocess.Popen[bytes]:
        return workers.start(
            "transform", broker.address, source, sink, "transform", "{run}", final=final
        )

    sent: list[bytes] = []
    stop = threading.Event()

    def produce() -> None:
        """Input all along, through the broker restarts (idempotent: resent, never twice)."""
        with slipstream.connect(broker.address, reconnect_timeout=60) as client:
            producer = client.producer(source, linger_ms=2)
            while not stop.is_set():
                for _ in range(10):
                    sent.append(b"in-%d" % len(sent))
                    producer.send(sent[-1], key=f"k{len(sent) % 10}")
                time.sleep(0.02)
            producer.flush(120)

    input_thread = threading.Thread(target=produce, daemon=True)
    input_thread.start()
    running = transformer()
    kills = broker_restarts = 0
    started = time.monotonic()
    while (elapsed := time.monotonic() - started) < CHAOS_S * 0.75:
        time.sleep(rng.uniform(0.3, 1.2))
        alive([running], workers)
        if elapsed > (broker_restarts + 1) * CHAOS_S * 0.75 / 3:
            broker.restart()
            broker_restarts += 1
        else:
            kill(running)
            running = transformer()
            kills += 1
    stop.set()
    input_thread.join(150)
    assert not input_thread.is_alive()
    kill(running)
    final = transformer(final=True)
    assert final.wait(120) == 0, workers.logs()

    with broker.client() as client:
        inputs = [e.value for e in client.reader(source, end=client.tail(source))]
        outputs = Counter(e.value for e in client.reader(sink, end=client.tail(sink)))
    assert sorted(inputs) == sorted(sent), "the input is not what was sent"
    lost = [v for v in inputs if outputs[b"out:" + v] == 0]
    duplicated = sorted(v for v, n in outputs.items() if n > 1)
    unknown = sorted(set(outputs) - {b"out:" + v for v in inputs})
    logs = "".join(p.read_text() for p in workers.directory.glob("*.log"))
    print(
        f"\ntransform: {len(inputs)} inputs, {sum(outputs.values())} outputs, {kills} kills, "
        f"{broker_restarts} broker restarts, {logs.count('committed ')} transactions committed, "
        f"{logs.count('abandoned:')} abandoned"
    )
    assert not lost, f"{len(lost)} inputs have no output, e.g. {lost[:5]}"
    assert not duplicated, f"{len(duplicated)} outputs are there twice, e.g. {duplicated[:5]}"
    assert not unknown, f"outputs of no input: {unknown[:5]}"
    assert kills >= 5 and broker_restarts >= 1


def test_the_group_checker_reports_each_kind_of_anomaly() -> None:
    """The checker itself must be able to fail."""
    sent = [encode(Sent(0, "p0-k0", seq)).decode() for seq in range(4)]

    def got(run: str, grant: int, start: int, offset: int, value: str, t: float) -> Delivery:
        return Delivery(run, grant, start, 0, offset, "p0-k0", value, t)

    acknowledged = {v.encode(): slipstream.Position(0, i) for i, v in enumerate(sent)}
    fine = [got("a", 1, 0, 0, sent[0], 1.0), got("a", 1, 0, 1, sent[1], 1.0)]
    fine += [got("b", 1, 1, 1, sent[1], 2.0), got("b", 1, 1, 2, sent[2], 2.0)]
    fine += [got("b", 1, 1, 3, sent[3], 2.0), Committed("b", {0: 4}, 3.0)]
    report = check_group(acknowledged, fine)
    assert report.problems == [] and report.duplicate_rate == 0.25
    broken = [
        got("a", 1, 0, 0, sent[0], 1.0),
        got("a", 1, 0, 2, sent[2], 1.0),  # offset 1 skipped within the grant
        got("a", 2, 1, 1, sent[1], 1.0),
        got("a", 1, 0, 3, sent[3], 1.0),  # an event of an earlier grant after a later one
        Committed("a", {0: 3}, 1.5),
        got("c", 1, 0, 0, sent[0], 9.0),  # granted from 0 long after 3 was committed
        got("c", 1, 0, 1, "not json", 9.0),  # and a value nobody sent, at a known position
    ]
    problems = check_group({**acknowledged, b"lost": slipstream.Position(0, 9)}, broken).problems
    for kind in ("order", "rewind", "phantom", "inconsistent", "lost"):
        assert any(p.startswith(kind) for p in problems), (kind, problems)


def test_a_batch_read_before_a_rejoin_is_not_committed_without_its_position(
    broker: BrokerProcess,
) -> None:
    source, sink = "faults/rejoin-in", "faults/rejoin-out"
    with slipstream.connect(broker.address, reconnect_timeout=30) as client:
        client.create_stream(source, segments=1)
        client.create_stream(sink, segments=1)
        client.create_subscription(source, "transform")
        with client.producer(source) as producer:
            for i in range(5):
                producer.send(b"%d" % i)
        consumer = client.consumer(source, "transform", commit="manual")
        batch: list[slipstream.Event] = []
        while len(batch) < 5:
            batch += consumer.poll(0.5)
        broker.restart()  # the consumer joins again and is granted segment 0 anew
        deadline = time.monotonic() + 30
        while not (consumer.core.member_id and consumer.assignment == {0}):
            assert time.monotonic() < deadline, "the consumer did not join again"
            time.sleep(0.05)
        for _ in range(3):  # the application's loop: this batch, then whatever comes again
            with contextlib.suppress(slipstream.SlipstreamError), client.transaction("t") as txn:
                for event in batch:
                    txn.send(sink, b"out:" + event.value)
                txn.commit_position(consumer)
            batch = [e for _ in range(10) for e in consumer.poll(0.2)]
        consumer.close()
        outputs = sorted(e.value for e in client.reader(sink, end=client.tail(sink)))
    assert outputs == [b"out:%d" % i for i in range(5)]

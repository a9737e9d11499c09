"""Consumer groups under faults, each run checked as a whole history.

A group of three members (processes: consumer_worker.py) is killed -9 member by member and
through two broker kill -9 restarts while producers write: every acknowledged event reaches the
group at least once, in order within each grant, never from before a commit (group_checker.py),
and once a final member has committed everything a fresh member receives nothing. A
consume-transform-produce loop that commits its positions inside its transactions is killed
-9 and its broker restarted: its output holds every input's result exactly once.
"""

from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from checker import produce_and_record
from conftest import BrokerProcess
from group_checker import check_group, read_records

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
    assert final.wait(120) == 0, workers.logs()

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

    report = check_group(acknowledged, read_records(workers.directory.glob("*.jsonl")))
    print(
        f"\ngroup history: {report.counts}, {member_kills} member kills, {broker_restarts} "
        f"broker restarts, duplicate rate {report.duplicate_rate:.2%}"
    )
    assert not report.problems, "\n".join(report.problems)
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

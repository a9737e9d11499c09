"""Three brokers on one catalog (PostgreSQL) and one bucket (SeaweedFS) under faults, each run
checked as a whole history (issue 20, Tests).

Idempotent producers (processes: producer_worker.py) and a consumer group (processes:
group_worker.py) work through the bootstrap list while brokers are killed -9, stopped (SIGSTOP)
past their leases and resumed, stopped cleanly, restarted and cut off PostgreSQL at random
(seeded: the seed is printed and in every failure message; ``SLIPSTREAM_CHAOS_SEED`` replays
one), then PostgreSQL is restarted under load, then the object store answers 503 and slowly.
Afterwards: every acknowledged event is read back exactly once at its acknowledged position,
offsets are contiguous, each key's events in the order they were sent (checker.py); the group
delivered every acknowledged event, in order within each grant, never from before a commit
(group_checker.py). Transactional producers through the same broker faults and a PostgreSQL
restart: every committed transaction visible whole and once, none partially, none out of
order (checker.check_transactions), with one container (a transaction local to the broker
holding it, which moves) and with four (transactions across brokers).

The checkers are shown to catch broken histories first (hand-made: an event dropped,
duplicated, moved, reordered; a transaction partially visible), and the harness's faults
to take effect (a frozen or reset catalog connection, an object store answering 503 or
slowly).
"""

from __future__ import annotations

import importlib.util
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import psycopg
import pytest
from checker import (
    Ack,
    Sent,
    TxnOutcome,
    TxnPart,
    check_history,
    check_transactions,
    encode,
    encode_record,
    read_acks,
    read_outcomes,
)
from group_checker import Committed, Delivery, check_group, read_records
from harness import Cluster, FaultProxy
from objectstores import SeaweedFS
from pg import PgCluster

import slipstream
from slipstream import Event, Position

HERE = Path(__file__).parent
PRODUCER = HERE / "producer_worker.py"
CONSUMER = HERE / "group_worker.py"
STREAM = "cluster/orders"
TXN_STREAM = "cluster/txns"
SEGMENTS = 6
PRODUCERS = 3
MEMBERS = 2
CHAOS_S = 40.0  # random broker faults for this long, then PostgreSQL, then the store

CLUSTER_MODE = pytest.mark.skipif(
    importlib.util.find_spec("slipstream.broker._cluster") is None,
    reason="cluster mode (slipstream/broker/_cluster.py) is not in this build yet",
)


# --- the checkers catch broken histories -------------------------------------------------------


def make_event(value: bytes, segment: int, offset: int, key: bytes) -> Event:
    return Event(key=key, value=value, headers={}, timestamp=0, segment=segment, offset=offset)


def event(value: bytes, segment: int, offset: int) -> Event:
    """A ``Sent`` value as read at ``segment``/``offset``, with the key it was sent with."""
    return make_event(value, segment, offset, key_of(value).encode())


def key_of(value: bytes) -> str:
    return msgspec.json.decode(value, type=Sent).key


def history() -> tuple[dict[bytes, Position], list[Event]]:
    """A correct history: producer 1 sent seq 0-5 over keys k0/k1, all acknowledged, at
    segment 0 offsets 0-5, read back in that order."""
    values = [encode(Sent(1, f"k{seq % 2}", seq)) for seq in range(6)]
    acknowledged = {v: Position(0, i) for i, v in enumerate(values)}
    return acknowledged, [event(v, 0, i) for i, v in enumerate(values)]


def test_the_history_checker_passes_a_correct_history() -> None:
    acknowledged, events = history()
    assert check_history(acknowledged, events) == []


def test_the_history_checker_catches_a_dropped_acknowledged_event() -> None:
    acknowledged, events = history()
    kept = [e for e in events if e.offset != 5]  # the last: offsets stay contiguous
    problems = check_history(acknowledged, kept)
    assert len(problems) == 1 and "is lost" in problems[0]


def test_the_history_checker_catches_a_duplicate() -> None:
    acknowledged, events = history()
    again = event(events[2].value, 0, 6)  # stored twice (a retry the broker did not dedupe)
    problems = check_history(acknowledged, [*events, again])
    assert any("duplicate" in p for p in problems), problems


def test_the_history_checker_catches_a_reordered_key() -> None:
    acknowledged, events = history()
    # seq 0 and seq 2 (both k0) swapped: each read at the other's position
    swapped = [event(events[2].value, 0, 0), events[1], event(events[0].value, 0, 2), *events[3:]]
    problems = check_history(acknowledged, swapped)
    assert any("seq 0 after 2" in p for p in problems), problems
    assert any("was read at" in p for p in problems), problems


def test_the_history_checker_catches_a_hole_and_a_value_at_another_position() -> None:
    acknowledged, events = history()
    moved = [*events[:3], *(event(e.value, 0, e.offset + 1) for e in events[3:])]
    problems = check_history(acknowledged, moved)
    assert any("not contiguous" in p for p in problems), problems
    assert any("was read at" in p for p in problems), problems


def transactions() -> tuple[list[TxnOutcome], list[Event]]:
    """Producer 7 committed transactions 0 and 1 (3 parts each), transaction 2 is in doubt
    and invisible; read back over two segments, in commit order per key."""
    outcomes = [TxnOutcome("7-0", True), TxnOutcome("7-1", True), TxnOutcome("7-2", False, "x")]
    events, offsets = [], [0, 0]
    for txn in ("7-0", "7-1"):
        for part in range(3):
            segment = part % 2
            value = encode_record(TxnPart(txn, part, 3))
            events.append(make_event(value, segment, offsets[segment], f"k{part}".encode()))
            offsets[segment] += 1
    return outcomes, events


def test_the_transaction_checker_passes_a_correct_history() -> None:
    assert check_transactions(*transactions()) == []


def test_the_transaction_checker_catches_a_partially_visible_transaction() -> None:
    outcomes, events = transactions()
    problems = check_transactions(outcomes, [e for e in events if e.value != events[4].value])
    assert problems == ["transaction 7-1 (committed) is partially visible or repeated: parts "
                        "[0, 2] of 3"]  # fmt: skip


def test_the_transaction_checker_catches_a_lost_a_repeated_and_a_phantom_transaction() -> None:
    outcomes, events = transactions()
    assert check_transactions(outcomes, events[3:]) == ["committed transaction 7-0 is lost"]
    problems = check_transactions(outcomes, [*events, events[0]])
    assert any("7-0 (committed) is partially visible or repeated" in p for p in problems)
    assert "no producer recorded it" in check_transactions(outcomes[1:], events)[0]
    partial_in_doubt = make_event(encode_record(TxnPart("7-2", 0, 3)), 0, 9, b"k0")
    assert "(in doubt) is partially" in check_transactions(outcomes, [*events, partial_in_doubt])[0]


def test_the_transaction_checker_catches_transactions_out_of_order() -> None:
    outcomes, events = transactions()
    first, second = events[:3], events[3:]
    problems = check_transactions(outcomes, [*second, *first])
    assert any("transaction 0" in p and "after its transaction 1" in p for p in problems)


def test_the_group_checker_catches_a_lost_event_and_a_skip(tmp_path: Path) -> None:
    acknowledged, events = history()
    deliveries = [
        Delivery("m0", 1, 0, e.segment, e.offset, key_of(e.value), e.value.decode(), 1.0)
        for e in events
    ]
    assert check_group(acknowledged, deliveries).problems == []
    skipped = [d for d in deliveries if d.offset != 3]
    problems = check_group(acknowledged, skipped).problems
    assert any(p.startswith("lost:") for p in problems), problems
    assert any(p.startswith("order:") for p in problems), problems
    rewound = [*deliveries, Committed("m0", {0: 6}, 2.0)] + [
        Delivery("m1", 1, 0, d.segment, d.offset, d.key, d.value, 9.0) for d in deliveries
    ]
    assert any(p.startswith("rewind:") for p in check_group(acknowledged, rewound).problems)


def test_acks_files_are_read_with_a_torn_last_line_skipped(tmp_path: Path) -> None:
    path = tmp_path / "acks.jsonl"
    path.write_bytes(
        encode_record(Ack("a", 0, 1)) + b"\n" + encode_record(Ack("b", error="E")) + b"\n"
        + encode_record(Ack("c", 0, 2))[:5]
    )  # fmt: skip
    assert read_acks([path]) == ({b"a": Position(0, 1)}, {b"b"})


# --- the harness's faults take effect ---------------------------------------------------------


def test_a_frozen_proxy_hangs_catalog_connections_and_a_reset_one_refuses_them(
    postgres: PgCluster, pg_dsn: str
) -> None:
    port = pg_dsn.rsplit(":", 1)[1].split("/")[0]
    proxy = FaultProxy(int(port))
    try:
        dsn = pg_dsn.replace(f":{port}/", f":{proxy.port}/")
        with psycopg.connect(dsn, autocommit=True) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
            proxy.freeze()
            with pytest.raises(psycopg.OperationalError):
                psycopg.connect(dsn, connect_timeout=2).close()
            proxy.heal()
            assert conn.execute("SELECT 2").fetchone() == (2,), "the frozen one resumes"
            proxy.reset()
            with pytest.raises(psycopg.OperationalError):
                conn.execute("SELECT 3")
            with pytest.raises(psycopg.OperationalError):
                psycopg.connect(dsn, connect_timeout=2).close()
        proxy.heal()
        with psycopg.connect(dsn) as conn:
            assert conn.execute("SELECT 4").fetchone() == (4,)
    finally:
        proxy.close()


def test_a_fault_proxy_answers_s3_requests_503_or_slowly(seaweedfs: SeaweedFS) -> None:
    import botocore.exceptions

    bucket = seaweedfs.create_bucket()
    proxy = FaultProxy(int(seaweedfs.endpoint.rsplit(":", 1)[1]))
    endpoint = seaweedfs.endpoint
    try:
        seaweedfs.endpoint = f"http://127.0.0.1:{proxy.port}"
        s3 = seaweedfs.client()  # signs for the proxy's host, which it forwards as it is
        s3.put_object(Bucket=bucket, Key="one", Body=b"1")
        proxy.http_errors(True)
        with pytest.raises(botocore.exceptions.ClientError, match="SlowDown"):
            s3.put_object(Bucket=bucket, Key="two", Body=b"2" * 100_000)
        proxy.http_errors(False)
        assert s3.get_object(Bucket=bucket, Key="one")["Body"].read() == b"1"
        assert seaweedfs.objects(bucket) == ["one"], "the refused put never reached the store"
        proxy.delay(12.0)  # longer than the client's read timeout (10 s)
        with pytest.raises(botocore.exceptions.ReadTimeoutError):
            s3.get_object(Bucket=bucket, Key="one")
    finally:
        seaweedfs.endpoint = endpoint
        proxy.close()


# --- the cluster under faults -----------------------------------------------------------------


class Workers:
    """Worker processes, each with its own name, record file and log under ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir()
        self.count = 0
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(HERE.parent), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
        }
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, script: Path, kind: str, *args: str, final: bool = False) -> str:
        """Start ``script kind args``; ``{run}`` and ``{records}`` in ``args`` become the
        worker's name and record file. Returns its name."""
        run = f"{kind}{self.count}"
        self.count += 1
        records = str(self.directory / f"{run}.jsonl")
        arguments = [a.replace("{run}", run).replace("{records}", records) for a in args]
        with open(self.directory / f"{run}.log", "wb") as log:
            self.processes[run] = subprocess.Popen(
                [sys.executable, str(script), kind, *arguments, *(["--final"] * final)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
            )
        return run

    def records(self, prefix: str) -> list[Path]:
        return sorted(self.directory.glob(f"{prefix}*.jsonl"))

    def exited(self) -> dict[str, int]:
        return {
            run: code
            for run, process in self.processes.items()
            if (code := process.poll()) is not None
        }

    def logs(self, prefix: str = "") -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.directory.glob(f"{prefix}*.log"))
        )

    def stop(self, run: str, timeout: float) -> int:
        process = self.processes[run]
        process.send_signal(signal.SIGTERM)
        try:
            return process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise

    def kill_all(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()


@pytest.fixture
def cluster(tmp_path: Path, postgres: PgCluster, seaweedfs: SeaweedFS) -> Iterator[Cluster]:
    base = tmp_path / "cluster"
    base.mkdir()
    with Cluster(
        base, postgres, seaweedfs, brokers=3, containers=4,
        extra=("--roll", "256KiB", "--roll-seconds", "1"),
    ).start() as started:  # fmt: skip
        yield started


# --- the group bugs the chaos test found, each on its own ------------------------------------


def consume_all(consumer: slipstream.Consumer, count: int) -> list[Event]:
    events: list[Event] = []
    deadline = time.monotonic() + 60  # a bound against hanging
    while len(events) < count and time.monotonic() < deadline:
        events += consumer.poll(timeout=1.0)
    return events


@CLUSTER_MODE
def test_a_member_commits_segments_another_broker_serves(cluster: Cluster) -> None:
    with slipstream.connect(cluster.addresses()) as client:
        client.create_stream(STREAM, segments=4)  # over four containers, three brokers
        client.create_subscription(STREAM, "workers")
        with client.producer(STREAM) as producer:
            for n in range(200):
                producer.send(b"%d" % n, key=f"k{n}")
        with client.consumer(STREAM, "workers", commit="manual", name="m") as consumer:
            assert len(consume_all(consumer, 200)) == 200
            consumer.commit()
            assert sum(consumer.committed.values()) == 200


def chaos(cluster: Cluster, rng: random.Random, seconds: float, say: Callable[[str], None]) -> None:
    """One broker fault at a time, for ``seconds``: kill -9, SIGSTOP (often past its lease),
    a kill -9 and start at once, a clean stop (SIGTERM: it hands its containers over, exit 0),
    or a cut from PostgreSQL (hung connections); each held a little, repaired, and the cluster
    left to settle a little before the next."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        i = rng.randrange(len(cluster.brokers))
        fault = rng.choice(["kill", "pause", "restart", "stop", "cut_pg"])
        hold = rng.uniform(0.5, 2.5 * cluster.lease_ttl)
        say(f"{fault} b{i}, held {hold:.1f} s")
        if fault == "kill":
            cluster.kill(i)
            time.sleep(hold)
            cluster.restart(i)
        elif fault == "pause":
            cluster.pause(i)
            time.sleep(hold)
            cluster.resume(i)
        elif fault == "restart":
            cluster.restart(i)
        elif fault == "stop":
            code = cluster.stop(i)
            assert code == 0, f"b{i} stopped with {code}{cluster.logs()}"
            time.sleep(hold)
            cluster.start_broker(i)
        else:
            cluster.cut_pg(i)
            time.sleep(hold)
            cluster.heal_pg(i)
        time.sleep(rng.uniform(0.2, cluster.lease_ttl))


@CLUSTER_MODE
def test_acknowledged_events_survive_random_broker_catalog_and_store_faults(
    cluster: Cluster, tmp_path: Path
) -> None:
    seed = int(os.environ.get("SLIPSTREAM_CHAOS_SEED") or random.randrange(2**32))
    rng = random.Random(seed)
    journal: list[str] = [f"seed {seed} (SLIPSTREAM_CHAOS_SEED={seed} replays it)"]

    def say(what: str) -> None:
        journal.append(f"{time.monotonic():.1f} {what}")
        print(journal[-1], flush=True)

    say(journal[0])
    with slipstream.connect(cluster.addresses()) as client:
        client.create_stream(STREAM, segments=SEGMENTS)
        client.create_subscription(STREAM, "workers")
    workers = Workers(tmp_path / "workers")
    producers = [
        workers.start(PRODUCER, "idempotent", cluster.addresses(), STREAM, str(p), "{records}")
        for p in range(PRODUCERS)
    ]

    def member(final: bool = False) -> str:
        return workers.start(
            CONSUMER, "member", cluster.addresses(), STREAM, "workers", "{run}", "manual",
            "{records}", final=final,
        )  # fmt: skip

    members = [member() for _ in range(MEMBERS)]

    def context() -> str:
        return "\n".join(journal) + cluster.logs() + "\n" + workers.logs()

    try:
        time.sleep(2)
        chaos(cluster, rng, CHAOS_S, say)
        say("restart PostgreSQL")
        cluster.restart_pg()
        time.sleep(3)
        say("object store: 503 for every request")
        cluster.store_errors(True)
        time.sleep(rng.uniform(1, 4))
        cluster.store_errors(False)
        say("object store: every request 0.5 s late")
        cluster.store_slow(0.5)
        time.sleep(rng.uniform(3, 6))
        cluster.store_slow(0)
        say("faults over")
        cluster.wait_until_all_containers_served(60)
        # the full read is checked first: a worker that died of a broker bug says less
        early = workers.exited()
        for run in producers:
            if run not in early:
                workers.stop(run, 180)
        say(f"producers stopped; exited during the faults: {early}")
        acknowledged, in_doubt = read_acks(workers.records("idempotent"))
        say(f"{len(acknowledged)} acknowledged, {len(in_doubt)} in doubt")
        with slipstream.connect(cluster.addresses()) as client:
            events = list(client.reader(STREAM, end=client.tail(STREAM)))
        problems = check_history(acknowledged, events)
        assert not problems, "\n".join(problems[:30]) + "\n" + context()
        assert len(acknowledged) > 2000, f"the load was too light\n{context()}"
        assert not early, f"workers exited during the faults: {early}\n{context()}"
        assert all(workers.processes[run].returncode == 0 for run in producers), context()

        for run in members:
            workers.processes[run].kill()
        final = member(final=True)
        workers.processes[final].wait(180)
        assert workers.processes[final].returncode == 0, f"the final member\n{context()}"
        say("the group drained")
        report = check_group(acknowledged, read_records(workers.records("member")))
        say(f"group: {report.counts}, duplicate rate {report.duplicate_rate:.3f}")
        assert not report.problems, "\n".join(report.problems) + "\n" + context()
    finally:
        workers.kill_all()
        print("\n".join(journal))


@pytest.mark.parametrize(
    "containers",
    [pytest.param(1, id="one-container"), pytest.param(4, id="across-brokers")],
)
@CLUSTER_MODE
def test_transactions_are_all_or_nothing_through_broker_faults(
    containers: int, tmp_path: Path, postgres: PgCluster, seaweedfs: SeaweedFS
) -> None:
    """Transactional producers through the random broker faults. With one container every
    transaction's segments and its coordinator live on the one broker that holds it, which
    moves from broker to broker with the faults; with four they span brokers."""
    seed = int(os.environ.get("SLIPSTREAM_CHAOS_SEED") or random.randrange(2**32))
    rng = random.Random(seed)
    journal = [f"seed {seed} (SLIPSTREAM_CHAOS_SEED={seed} replays it)"]
    base = tmp_path / "cluster"
    base.mkdir()
    cluster = Cluster(base, postgres, seaweedfs, brokers=3, containers=containers).start()
    workers = Workers(tmp_path / "workers")
    try:
        with slipstream.connect(cluster.addresses()) as client:
            client.create_stream(TXN_STREAM, segments=3)
        runs = [
            workers.start(
                PRODUCER, "transactional", cluster.addresses(), TXN_STREAM, str(p), "{records}"
            )
            for p in range(2)
        ]
        time.sleep(2)
        chaos(cluster, rng, CHAOS_S / 2, journal.append)
        cluster.restart_pg()
        journal.append("restart PostgreSQL")
        time.sleep(3)
        cluster.wait_until_all_containers_served(60)
        for run in runs:
            assert workers.stop(run, 180) == 0, workers.logs()
        outcomes = read_outcomes(workers.records("transactional"))
        journal.append(
            f"{sum(o.committed for o in outcomes)} committed, "
            f"{sum(not o.committed for o in outcomes)} in doubt"
        )
        assert sum(o.committed for o in outcomes) > 20, workers.logs()
        with slipstream.connect(cluster.addresses()) as client:
            events = list(client.reader(TXN_STREAM, end=client.tail(TXN_STREAM)))
        problems = check_transactions(outcomes, events)
        assert not problems, "\n".join([*journal, *problems[:30]]) + cluster.logs()
    finally:
        workers.kill_all()
        cluster.close()
        print("\n".join(journal))

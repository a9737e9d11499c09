"""Consume-transform-produce across brokers (issue 20; docs/cluster.md,
"Consume-transform-produce"): a transaction coordinated by one broker commits the positions of
a group another broker coordinates, exactly once. The names are picked so that the
transactional ids and the group are coordinated by different brokers (asserted).

- a whole-history check: two transforming processes, the group coordinator and then the
  transaction coordinator killed -9 mid-run, a member fenced (paused past its session), a
  worker killed -9: every input has exactly one output;
- a zombie (fenced member, moved generation) aborts with the typed errors of one broker;
- a hold the transaction coordinator never releases expires, the group reads its positions
  from the catalog, and while it stands the group commits nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import Cluster, ask
from objectstores import SeaweedFS
from pg import PgCluster
from raw import RawConnection

import slipstream
from slipstream import NotAssigned, StaleGeneration, UnknownMember
from slipstream.cluster import coordinator
from slipstream.protocol import (
    CommitPositions,
    DescribeSubscription,
    Done,
    Error,
    GroupAssignment,
    GroupJoined,
    HoldPositions,
    JoinGroup,
    Message,
    PollGroup,
    PositionsHeld,
    ReleasePositions,
    SubscriptionInfo,
    TxnPositions,
)
from slipstream.storage._meta_pg import PostgresMetaStore

WORKER = Path(__file__).with_name("ctp_worker.py")
SOURCE, SINK, SUBSCRIPTION = "ctp/in", "ctp/out", "transform"
CONTAINERS = 4


@pytest.fixture
def cluster(tmp_path: Path, postgres: PgCluster, seaweedfs: SeaweedFS) -> Iterator[Cluster]:
    base = tmp_path / "cluster"
    base.mkdir()
    with Cluster(base, postgres, seaweedfs, brokers=2, containers=CONTAINERS).start() as started:
        yield started


def _layout(cluster: Cluster, count: int = 2) -> tuple[int, list[str], int]:
    """(the index of the broker coordinating the group, ``count`` transactional ids all
    coordinated by the other broker, that broker's index), asserted different."""
    served = cluster.wait_until_all_containers_served()
    group = served[coordinator(f"{SOURCE}/{SUBSCRIPTION}", CONTAINERS)]
    ids = [
        t
        for t in (f"ctp-tx-{i}" for i in range(200))
        if served[coordinator(t, CONTAINERS)] != group
    ][:count]
    assert len(ids) == count
    (txn,) = {served[coordinator(t, CONTAINERS)] for t in ids}
    assert txn != group, "the transactions and the group must be coordinated apart"
    return int(group[1:]), ids, int(txn[1:])


def _take(consumer: slipstream.Consumer, count: int) -> list[slipstream.Event]:
    got: list[slipstream.Event] = []
    deadline = time.monotonic() + 60
    while len(got) < count:
        assert time.monotonic() < deadline, f"{len(got)} of {count} events"
        got.extend(consumer.poll(0.5))
    return got


def _outputs(client: slipstream.Client) -> Counter[bytes]:
    return Counter(e.value for e in client.reader(SINK, end=client.tail(SINK)))


# --- a whole history through kills ------------------------------------------------------------


class Workers:
    """ctp_worker.py processes, each with its own log."""

    def __init__(self, directory: Path, addresses: str) -> None:
        self.directory = directory
        directory.mkdir()
        self.addresses = addresses
        self.runs = 0
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(WORKER.parent), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
        }

    def start(self, txn_id: str, session_s: float, final: bool = False) -> subprocess.Popen[bytes]:
        self.runs += 1
        run = f"w{self.runs}"
        args = [self.addresses, SOURCE, SINK, SUBSCRIPTION, txn_id, run, str(session_s)]
        with open(self.directory / f"{run}.log", "wb") as log:
            return subprocess.Popen(
                [sys.executable, str(WORKER), *args, *(["--final"] if final else [])],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
            )

    def logs(self) -> str:
        return "".join(p.read_text() for p in sorted(self.directory.glob("*.log")))

    def committed(self) -> int:
        return self.logs().count("committed ")


def _kill(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signal.SIGCONT)
        process.kill()
    process.wait(10)


def test_consume_transform_produce_across_brokers_is_exactly_once_through_kills(
    cluster: Cluster, tmp_path: Path
) -> None:
    group, txn_ids, txn = _layout(cluster)
    with slipstream.connect(cluster.addresses(), reconnect_timeout=60) as client:
        client.create_stream(SOURCE, segments=4)
        client.create_stream(SINK, segments=2)
        client.create_subscription(SOURCE, SUBSCRIPTION)
    sent: list[bytes] = []
    stop = threading.Event()

    def produce() -> None:
        """Input all along, through the kills (idempotent: resent, never twice)."""
        with slipstream.connect(cluster.addresses(), reconnect_timeout=60) as client:
            producer = client.producer(SOURCE, linger_ms=2)
            while not stop.is_set():
                for _ in range(10):
                    sent.append(b"in-%d" % len(sent))
                    producer.send(sent[-1], key=f"k{len(sent) % 16}")
                time.sleep(0.03)
            producer.flush(120)

    workers = Workers(tmp_path / "workers", cluster.addresses())
    running = [workers.start(txn_ids[0], 4.0), workers.start(txn_ids[1], 4.0)]
    input_thread = threading.Thread(target=produce, daemon=True)
    input_thread.start()

    def progress(more: int) -> None:
        """Wait until the workers committed ``more`` transactions more (a bound, no timing)."""
        target = workers.committed() + more
        deadline = time.monotonic() + 90
        while workers.committed() < target:
            assert all(p.poll() is None for p in running), workers.logs()
            assert time.monotonic() < deadline, workers.logs()[-5000:]
            time.sleep(0.2)

    try:
        progress(10)  # committed across brokers: the layout of _layout still holds
        assert (
            cluster.wait_until_all_containers_served()[
                coordinator(f"{SOURCE}/{SUBSCRIPTION}", CONTAINERS)
            ]
            == f"b{group}"
        )
        cluster.restart(group)  # kill -9 the group's coordinator mid-run
        progress(10)
        running[0].send_signal(signal.SIGSTOP)  # fenced: its session (4 s) expires
        progress(5)  # the other member took its segments and goes on
        time.sleep(2)
        running[0].send_signal(signal.SIGCONT)  # a zombie now: its commit must abort
        progress(10)
        cluster.wait_until_all_containers_served()
        cluster.restart(txn)  # kill -9 the transactions' coordinator mid-run
        progress(10)
        _kill(running[1])  # a worker killed -9 mid-transaction
        running[1] = workers.start(txn_ids[1], 4.0)
        progress(10)
    finally:
        stop.set()
        input_thread.join(150)
        for process in running:
            _kill(process)
    assert not input_thread.is_alive()
    final = workers.start(txn_ids[0], 4.0, final=True)
    try:
        assert final.wait(180) == 0, workers.logs()[-5000:]
    finally:
        _kill(final)

    with slipstream.connect(cluster.addresses(), reconnect_timeout=60) as client:
        inputs = [e.value for e in client.reader(SOURCE, end=client.tail(SOURCE))]
        outputs = _outputs(client)
    logs = workers.logs()
    assert sorted(inputs) == sorted(sent), "the input is not what was sent"
    lost = [v for v in inputs if outputs[b"out:" + v] == 0]
    duplicated = sorted(v for v, n in outputs.items() if n > 1)
    unknown = sorted(set(outputs) - {b"out:" + v for v in inputs})
    print(
        f"\nctp across brokers: {len(inputs)} inputs, {sum(outputs.values())} outputs, "
        f"{logs.count('committed ')} transactions committed, {logs.count('abandoned:')} "
        f"abandoned ({logs.count('abandoned: NotAssigned')} not_assigned, "
        f"{logs.count('abandoned: UnknownMember')} unknown_member)"
    )
    assert not lost, f"{len(lost)} inputs have no output, e.g. {lost[:5]}"
    assert not duplicated, f"{len(duplicated)} outputs are there twice, e.g. {duplicated[:5]}"
    assert not unknown, f"outputs of no input: {unknown[:5]}"


# --- zombies ----------------------------------------------------------------------------------


def test_positions_of_a_group_on_another_broker_commit_and_zombies_abort(
    cluster: Cluster,
) -> None:
    _, (txn_id,), _ = _layout(cluster, 1)
    with slipstream.connect(cluster.addresses(), reconnect_timeout=60) as client:
        client.create_stream(SOURCE, segments=2)
        client.create_stream(SINK, segments=1)
        client.create_subscription(SOURCE, SUBSCRIPTION)
        with client.producer(SOURCE) as producer:
            for i in range(20):
                producer.send(b"%d" % i, key=f"k{i}")
        consumer = client.consumer(SOURCE, SUBSCRIPTION, commit="manual", session_timeout=1.0)
        events = _take(consumer, 20)
        with client.transaction(txn_id) as txn:
            for event in events:
                txn.send(SINK, event.value)
            txn.commit_position(consumer)
        # the group's coordinator took the positions (its members joined: from memory)
        info = client.describe_subscription(SOURCE, SUBSCRIPTION)  # (where it is now)
        assert sum(s.position for s in info.segments) == 20
        assert sorted(_outputs(client)) == sorted(e.value for e in events)

        # a reset after the events were read: the transaction aborts with StaleGeneration
        with client.producer(SOURCE) as producer:
            for i in range(20, 25):
                producer.send(b"%d" % i, key=f"k{i}")
        assert _take(consumer, 5)
        txn = client.transaction(txn_id)
        txn.send(SINK, b"stale")
        txn.commit_position(consumer)
        poll = consumer.core._poll
        assert poll is not None
        client._loop.call(poll.cancel)  # it does not hear of the reset
        client.reset_subscription(SOURCE, SUBSCRIPTION, "latest")
        with pytest.raises(StaleGeneration):
            txn.commit()
        assert b"stale" not in _outputs(client)
        consumer.close()

        # a member fenced (its session expired, its segments granted again): it aborts
        with client.producer(SOURCE) as producer:
            for i in range(25, 30):
                producer.send(b"%d" % i, key=f"k{i}")
        zombie = client.consumer(SOURCE, SUBSCRIPTION, commit="manual", session_timeout=1.0)
        _take(zombie, 5)
        txn = client.transaction(txn_id)
        txn.send(SINK, b"zombie")
        txn.commit_position(zombie)
        poll = zombie.core._poll
        assert poll is not None
        client._loop.call(poll.cancel)  # the process stalls: no more polls
        with slipstream.connect(cluster.addresses(), reconnect_timeout=60) as other:
            successor = other.consumer(SOURCE, SUBSCRIPTION, commit="manual")
            deadline = time.monotonic() + 30
            again: list[slipstream.Event] = []
            while successor.assignment != {0, 1}:
                assert time.monotonic() < deadline, successor.assignment
                again.extend(successor.poll(0.2))
            with pytest.raises((NotAssigned, UnknownMember)):
                txn.commit()
            assert b"zombie" not in _outputs(client)
            again.extend(_take(successor, 5 - len(again)))  # from before the zombie's
            assert sorted(e.value for e in again) == [b"%d" % i for i in range(25, 30)]
            successor.close()
        zombie.close()


# --- a hold that is never released ------------------------------------------------------------


class Raw:
    """One hand-driven connection (a group member's: commits come from its connection)."""

    def __init__(self, address: str) -> None:
        self.connection = RawConnection(address)
        self.connection.receive()  # Welcome
        self._cid = 100

    def send(self, message: Message) -> int:
        self._cid += 1
        self.connection.send_frame(message, self._cid)
        return self._cid

    def answer(self, cid: int) -> Any:
        while True:
            frame = self.connection.receive()
            if frame.correlation_id == cid:
                return frame.message

    def ask(self, message: Message) -> Any:
        return self.answer(self.send(message))


class Moved(Exception):
    """The group's container moved mid-attempt (a loaded machine's late lease renewal): its
    members were released; the attempt is run again on a fresh subscription."""


def _position(address: str, name: str) -> int:
    info = ask(address, DescribeSubscription(SOURCE, name))
    if isinstance(info, Error) and info.code == "wrong_broker":
        raise Moved(info)
    assert isinstance(info, SubscriptionInfo), info
    return info.segments[0].position


def test_a_hold_never_released_expires_and_the_group_reads_the_catalog(cluster: Cluster) -> None:
    with slipstream.connect(cluster.addresses(), reconnect_timeout=60) as client:
        client.create_stream(SOURCE, segments=1)
        with client.producer(SOURCE) as producer:
            for i in range(10):
                producer.send(b"%d" % i)
        for attempt in range(3):
            name = f"held{attempt}"
            client.create_subscription(SOURCE, name)
            try:
                _hold_expires(cluster, name)
                return
            except Moved as exc:
                print(f"attempt {attempt}: the group moved ({exc}); again")
        pytest.fail("the group moved in every attempt")


def _hold_expires(cluster: Cluster, name: str) -> None:
    served = cluster.wait_until_all_containers_served()
    address = cluster.brokers[int(served[coordinator(f"{SOURCE}/{name}", CONTAINERS)][1:])].address
    member = Raw(address)
    broker = Raw(address)  # the transaction coordinator, played by hand (no auth: no token)
    meta = PostgresMetaStore(cluster.dsn)

    def expect(answer: Any, kind: type[Message]) -> Any:
        if isinstance(answer, Error) and answer.code in ("wrong_broker", "unknown_member"):
            raise Moved(answer)  # (an unknown member here: released by a hand-over)
        assert isinstance(answer, kind), answer
        return answer

    def hold(hold_id: int, member_id: int, generation: int, offset: int) -> Any:
        consumed = TxnPositions(SOURCE, name, member_id, generation, {0: offset})
        return broker.ask(HoldPositions(hold_id, 1, "", 1500, consumed))

    try:
        joined = expect(member.ask(JoinGroup(SOURCE, name, "ordered", "m", 30_000)), GroupJoined)
        assigned = expect(member.ask(PollGroup(joined.member_id, [], 0)), GroupAssignment)
        assert assigned.assigned == {0: 0}, assigned
        generation = assigned.generation

        # checked as a member's commit: the same typed errors (and nothing held after them)
        stale = hold(2, joined.member_id, generation + 1, 4)
        assert isinstance(stale, Error) and stale.code == "stale_generation", stale
        wrong = hold(1, joined.member_id + 1, generation, 4)
        assert isinstance(wrong, Error) and wrong.code == "unknown_member", wrong

        # held and never released: the record was stored meanwhile (here: written by hand),
        # so once the hold expires the group must take the catalog's positions
        held = expect(hold(3, joined.member_id, generation, 4), PositionsHeld)
        assert held.valid_ms > 0, held
        meta.commit_positions(held.stream_id, name, generation, {0: 4})
        deadline = time.monotonic() + 30
        while _position(address, name) != 4:  # described from memory (a member is joined)
            assert time.monotonic() < deadline, "the expired hold did not read the catalog"
            time.sleep(0.1)
        late = expect(broker.ask(ReleasePositions(3, 1)), PositionsHeld)
        assert not late.held, late

        # while a hold stands the group commits nothing: the member's commit (sent first)
        # lands after the expiry's read of the catalog, not before it
        held = expect(hold(4, joined.member_id, generation, 8), PositionsHeld)
        commit = member.send(CommitPositions(SOURCE, name, joined.member_id, generation, {0: 6}))
        time.sleep(0.5)  # (ordering slack: the commit reaches the broker first)
        meta.commit_positions(held.stream_id, name, generation, {0: 8})
        expect(member.answer(commit), Done)
        assert _position(address, name) == 6
        (record,) = [r for r in meta.subscriptions(held.stream_id) if r.name == name]
        assert record.positions == {0: 6}
    finally:
        meta.close()
        member.connection.close()
        broker.connection.close()


# --- with authentication: a member is its subject's ---------------------------------------------


def _token(cluster: Cluster, subject: str) -> str:
    """An admin token of ``subject``, signed with the cluster's keys."""
    made = subprocess.run(
        [
            *(sys.executable, "-m", "slipstream", "token", "create"),
            *("--data-dir", str(cluster.brokers[0].data_dir)),
            *("--subject", subject, "--role", "admin", "--json"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert made.returncode == 0, made.stderr
    return str(json.loads(made.stdout)["token"])


def test_with_auth_only_the_members_subject_commits_its_positions(
    tmp_path: Path, postgres: PgCluster, seaweedfs: SeaweedFS
) -> None:
    base = tmp_path / "cluster"
    base.mkdir()
    with Cluster(
        base, postgres, seaweedfs, brokers=2, containers=CONTAINERS, extra=("--auth",)
    ).start() as cluster:
        _, (alices, mallorys), _ = _layout(cluster)
        addresses = cluster.addresses()
        with (
            slipstream.connect(addresses, token=_token(cluster, "alice")) as alice,
            slipstream.connect(addresses, token=_token(cluster, "mallory")) as mallory,
        ):
            alice.create_stream(SOURCE, segments=1)
            alice.create_stream(SINK, segments=1)
            alice.create_subscription(SOURCE, SUBSCRIPTION)
            with alice.producer(SOURCE) as producer:
                for i in range(5):
                    producer.send(b"%d" % i)
            consumer = alice.consumer(SOURCE, SUBSCRIPTION, commit="manual")
            events = _take(consumer, 5)
            core = consumer.core
            # another subject names alice's member (its id and generation) in its commit
            forged = TxnPositions(SOURCE, SUBSCRIPTION, core.member_id, core.generation, {0: 5})
            txn = mallory.transaction(mallorys)
            txn.send(SINK, b"mallory")
            mallory._loop.run(txn._async.flush())
            with pytest.raises(UnknownMember):
                mallory._loop.run(
                    mallory._async._end(txn.txn_id, True, b"", (), [forged], txn._async.home)
                )
            assert alice.describe_subscription(SOURCE, SUBSCRIPTION).segments[0].position == 0
            # alice's own commit of the same positions, from another broker, goes through
            with alice.transaction(alices) as mine:
                for event in events:
                    mine.send(SINK, event.value)
                mine.commit_position(consumer)
            assert alice.describe_subscription(SOURCE, SUBSCRIPTION).segments[0].position == 5
            assert sorted(e.value for e in alice.reader(SINK, end=alice.tail(SINK))) == sorted(
                e.value for e in events
            )
            consumer.close()

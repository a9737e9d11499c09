"""Power loss, for real: the broker's data directory on PowerFS, a filesystem that forgets at a
power failure everything not made durable (file data not fsynced, directory entries whose
directory was not fsynced). A kill -9 cannot show these bugs: the page cache outlives the
process.

Each run: producers (idempotent, and one transactional) send under load and record what the
broker acknowledged; the broker is killed and the power fails at a random moment (seeded,
printed); the broker restarts on what was durable; a checker reads everything back and reports
every acknowledged event lost, duplicated, moved or out of order.

The check must be able to fail: the same history from a broker whose fsyncs do nothing (a
``sitecustomize`` that makes ``os.fsync``/``os.fdatasync`` no-ops: it acknowledges before
anything is durable) is reported as lost events; so is ``--fsync never``.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from checker import Sent, check_history, encode, produce_and_record
from conftest import BrokerProcess, chunk_files, needs_fuse

import slipstream
from slipstream.torture._powerfs import PowerFS

STREAM = "power/loss"
TXN_STREAM = "power/txns"
KEYS = 4
SEED = int(os.environ.get("SLIPSTREAM_POWER_SEED", random.randrange(1 << 30)))

pytestmark = needs_fuse


class Machine:
    """A broker whose data directory lives on a PowerFS: start, power failure, restart."""

    def __init__(self, fs: PowerFS, log_dir: Path, *extra: str) -> None:
        self.fs = fs
        self.broker = BrokerProcess(fs.mountpoint / "data", *extra)
        self.broker.log_path = log_dir / "broker.log"  # not on the disk that loses power

    def power_failure(self) -> None:
        self.broker.kill()  # every process dies with the power
        self.fs.power_fail()
        self.fs.mount()

    def shut_down(self) -> None:
        self.broker.kill()


@pytest.fixture
def machine(powerfs: PowerFS, tmp_path: Path) -> Iterator[Machine]:
    m = Machine(powerfs, tmp_path, "--roll", "256KiB", "--roll-seconds", "0.5")
    yield m
    m.shut_down()


def _produce(
    address: str,
    producer_id: int,
    acknowledged: dict[bytes, slipstream.Position],
    lock: threading.Lock,
    stop: threading.Event,
) -> None:
    """An idempotent producer that records every acknowledgement until the broker dies."""
    produce_and_record(address, STREAM, producer_id, acknowledged, lock, stop, keys=KEYS)


def _transact(address: str, committed: list[int], stop: threading.Event, first: int) -> None:
    """Transactions of 10 events each; a transaction's number is recorded once its commit was
    acknowledged."""
    try:
        client = slipstream.connect(address, reconnect_timeout=0.5)
    except slipstream.BrokerUnavailable:
        return
    number = first
    try:
        while not stop.is_set():
            with client.transaction(f"power-{first}", timeout=30) as txn:
                for item in range(10):
                    txn.send(TXN_STREAM, f"{number}:{item}".encode(), key=f"k{item % KEYS}")
            committed.append(number)
            number += 1
    except slipstream.SlipstreamError:
        return
    finally:
        client.close()


def _read_all(broker: BrokerProcess, stream: str) -> list[slipstream.Event]:
    with broker.client() as client:
        try:
            return list(client.reader(stream, end=client.tail(stream)))
        except slipstream.StreamNotFound:
            return []  # the whole stream was lost: every acknowledged event is reported


def _load_until_power_fails(
    machine: Machine,
    acknowledged: dict[bytes, slipstream.Position],
    committed: list[int],
    life: int,
    seconds: float,
) -> None:
    lock, stop = threading.Lock(), threading.Event()
    address = machine.broker.address
    threads = [
        threading.Thread(target=_produce, args=(address, life * 10 + p, acknowledged, lock, stop))
        for p in range(3)
    ]
    threads.append(threading.Thread(target=_transact, args=(address, committed, stop, life * 1000)))
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    machine.power_failure()
    stop.set()
    for thread in threads:
        thread.join(30)
        assert not thread.is_alive()


def _transaction_problems(events: list[slipstream.Event], committed: list[int]) -> list[str]:
    items: dict[int, list[int]] = {}
    for event in events:
        number, item = map(int, event.value.split(b":"))
        items.setdefault(number, []).append(item)
    problems = [f"committed transaction {n} is lost" for n in committed if n not in items]
    problems += [
        f"transaction {n} is partial or duplicated: {sorted(got)}"
        for n, got in items.items()
        if sorted(got) != list(range(10))
    ]
    return problems


@pytest.mark.parametrize("tear", [False, True], ids=["whole-writes", "torn-writes"])
def test_power_failures_under_load_lose_nothing_acknowledged(machine: Machine, tear: bool) -> None:
    rng = random.Random(SEED + tear)
    print(f"SLIPSTREAM_POWER_SEED={SEED}")
    machine.fs.unmount()
    machine.fs.tear = tear  # each file's last unsynced write lands cut short
    machine.fs.seed = SEED
    machine.fs.mount()
    broker = machine.broker.start()
    with broker.client() as client:
        client.create_stream(STREAM, segments=3)
        client.create_stream(TXN_STREAM, segments=2)
    acknowledged: dict[bytes, slipstream.Position] = {}
    committed: list[int] = []
    for life in range(2):
        # the first power failure may come before the catalog or the journals were ever synced
        _load_until_power_fails(machine, acknowledged, committed, life, rng.uniform(0.5, 2.5))
        broker.start()
    assert len(acknowledged) > 500, "the load was too light to mean anything"
    print(f"{len(acknowledged)} events and {len(committed)} transactions acknowledged")
    problems = check_history(acknowledged, _read_all(broker, STREAM))
    problems += _transaction_problems(_read_all(broker, TXN_STREAM), committed)
    assert not problems, "\n".join(problems[:20])


def _acknowledged_then_power_fails(
    machine: Machine, count: int
) -> dict[bytes, slipstream.Position]:
    """``count`` events acknowledged, then (deterministically, after every acknowledgement)
    the power fails; the broker restarts."""
    with machine.broker.client() as client, client.producer(STREAM, linger_ms=1) as producer:
        receipts = []
        for seq in range(count):
            key = f"p0-k{seq % KEYS}"
            value = encode(Sent(0, key, seq))
            receipts.append((value, producer.send(value, key=key)))
        producer.flush(30)
        acknowledged = {value: receipt.result() for value, receipt in receipts}
    machine.power_failure()
    machine.broker.start()
    return acknowledged


def _with_stream(machine: Machine) -> None:
    """The stream created, and the broker stopped cleanly, by a real broker: what follows loses
    only what the broker under test acknowledged."""
    machine.broker.start()
    with machine.broker.client() as client:
        client.create_stream(STREAM, segments=2)
    assert machine.broker.stop() == 0


def test_acknowledged_events_survive_a_power_failure(machine: Machine) -> None:
    _with_stream(machine)
    machine.broker.start()
    acknowledged = _acknowledged_then_power_fails(machine, 300)
    assert check_history(acknowledged, _read_all(machine.broker, STREAM)) == []


def test_the_check_catches_a_broker_that_acknowledges_before_fsync(
    machine: Machine, tmp_path: Path
) -> None:
    _with_stream(machine)
    no_fsync = tmp_path / "no-fsync"
    no_fsync.mkdir()
    (no_fsync / "sitecustomize.py").write_text(
        "import os\nos.fsync = os.fdatasync = lambda fd: None\n"
    )
    machine.broker.env = {"PYTHONPATH": str(no_fsync)}
    machine.broker.start()
    acknowledged = _acknowledged_then_power_fails(machine, 300)
    machine.broker.env = {}
    problems = check_history(acknowledged, _read_all(machine.broker, STREAM))
    assert sum("is lost" in p for p in problems) == len(acknowledged), problems[:5]


def test_fsync_never_loses_what_was_acknowledged_since_the_last_roll(machine: Machine) -> None:
    """Documented in docs/operations.md: ``never`` leaves durability to the kernel's writeback,
    so a power failure loses acknowledged events (here: all of them, none was written back)."""
    _with_stream(machine)
    machine.broker.extra += ["--fsync", "never"]
    machine.broker.start()
    acknowledged = _acknowledged_then_power_fails(machine, 300)
    problems = check_history(acknowledged, _read_all(machine.broker, STREAM))
    assert sum("is lost" in p for p in problems) == len(acknowledged), problems[:5]


def test_files_the_broker_writes_once_survive_a_power_failure(machine: Machine) -> None:
    """broker.json, producer.key and broker-id are written once, at the first start: a power
    failure any time after that start must leave them as they were (a lost key invalidates
    every producer's token)."""
    _with_stream(machine)
    data_dir = machine.broker.data_dir
    written = {
        name: (data_dir / name).read_bytes()
        for name in ("broker.json", "producer.key", "broker-id")
    }
    machine.power_failure()
    assert {name: (data_dir / name).read_bytes() for name in written} == written


def test_events_moved_to_chunks_survive_a_power_failure(machine: Machine) -> None:
    """The mover links sealed journal files into ``chunks/<stream>/<segment>/`` and then
    deletes them from the journal: the chunk directories must be durable before that."""
    _with_stream(machine)
    machine.broker.start()
    data = machine.broker.data_dir
    with machine.broker.client() as client, client.producer(STREAM, linger_ms=1) as producer:
        receipts = []
        for seq in range(300):
            value = encode(Sent(0, f"p0-k{seq % KEYS}", seq))
            receipts.append((value, producer.send(value, key=f"p0-k{seq % KEYS}")))
        producer.flush(30)
        acknowledged = {value: receipt.result() for value, receipt in receipts}

    def moved() -> bool:  # both segments have chunks, and no journal holds a sealed file
        segments = {p.parent for p in chunk_files(data, STREAM)}
        journals = [len(list(d.glob("*.journal"))) for d in (data / "journal").iterdir()]
        return len(segments) == 2 and all(n <= 1 for n in journals)

    deadline = time.monotonic() + 60
    while not moved():  # --roll-seconds 0.5 seals the files; the mover moves them
        assert time.monotonic() < deadline, "the mover never moved the data"
        time.sleep(0.1)
    machine.power_failure()
    machine.broker.start()
    assert check_history(acknowledged, _read_all(machine.broker, STREAM)) == []

"""Exactly-once under faults: kill -9 of the broker, cut connections, producer retries, and a
crash at every step of a transaction commit. A checker verifies each whole history."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import msgspec
import pytest
from checker import Sent, check_history, encode
from conftest import BrokerProcess
from proxy import CuttingProxy

import slipstream

PRODUCERS = 3
KEYS = 5


@pytest.fixture
def proxied(broker_factory: type[BrokerProcess]) -> Iterator[tuple[BrokerProcess, CuttingProxy]]:
    broker = broker_factory("--roll", "256KiB", "--roll-seconds", "0.5").start()
    proxy = CuttingProxy(broker.port)
    yield broker, proxy
    proxy.close()


def _produce(
    address: str,
    producer_id: int,
    sent: list[bytes],
    acknowledged: dict[bytes, slipstream.Position],
    lock: threading.Lock,
    stop: threading.Event,
) -> None:
    with slipstream.connect(address, reconnect_timeout=60) as client:
        producer = client.producer("faults/eo", linger_ms=2, batch_bytes=32 * 1024)
        receipts: list[tuple[bytes, slipstream.Receipt]] = []
        seq = 0
        while not stop.is_set():
            for _ in range(20):
                key = f"p{producer_id}-k{seq % KEYS}"
                value = encode(Sent(producer_id, key, seq))
                receipts.append((value, producer.send(value, key=key)))
                sent.append(value)
                seq += 1
            time.sleep(0.002)
        producer.flush(120)  # every event is acknowledged in the end: retries ride through
        with lock:
            for value, receipt in receipts:
                acknowledged[value] = receipt.result()


def test_idempotent_producers_through_kills_and_cut_connections(
    proxied: tuple[BrokerProcess, CuttingProxy],
) -> None:
    broker, proxy = proxied
    with broker.client() as client:
        client.create_stream("faults/eo", segments=3)
    sent: list[bytes] = []
    acknowledged: dict[bytes, slipstream.Position] = {}
    lock, stop = threading.Lock(), threading.Event()
    threads = [
        threading.Thread(
            target=_produce, args=(proxy.address, p, sent, acknowledged, lock, stop), daemon=True
        )
        for p in range(PRODUCERS)
    ]
    for thread in threads:
        thread.start()
    for fault in ("cut", "kill", "cut", "cut", "kill"):
        time.sleep(0.6)
        if fault == "cut":
            proxy.cut()  # the broker lives on with appends of the dead connections in flight
        else:
            broker.restart()
    time.sleep(0.6)
    stop.set()
    for thread in threads:
        thread.join(150)
        assert not thread.is_alive()
    assert len(acknowledged) == len(sent) > 2000
    with broker.client() as client:
        events = list(client.reader("faults/eo", end=client.tail("faults/eo")))
    problems = check_history(acknowledged, events)
    assert not problems, "\n".join(problems[:20])
    assert len(events) == len(sent), "an event is stored twice or missing"


def test_a_hung_connection_is_dropped_and_its_batches_resent(
    proxied: tuple[BrokerProcess, CuttingProxy],
) -> None:
    _, proxy = proxied
    with slipstream.connect(proxy.address, reconnect_timeout=10) as client:
        client.create_stream("faults/hung", segments=2)
        producer = client.producer("faults/hung", request_timeout=1.0, linger_ms=1)
        receipts = [producer.send(b"%d" % i, key=f"k{i % 3}") for i in range(500)]
        producer.flush(10)
        proxy.freeze()  # the broker may still get these; its answers never come back
        receipts += [producer.send(b"%d" % i, key=f"k{i % 3}") for i in range(500, 1000)]
        started = time.monotonic()
        producer.flush(30)
        assert time.monotonic() - started >= 0.9, "the hang was not noticed by the timeout"
        positions = [r.result() for r in receipts]
        values = [e.value for e in client.reader("faults/hung", end=client.tail("faults/hung"))]
    assert len(set(positions)) == 1000
    assert sorted(values) == sorted(b"%d" % i for i in range(1000)), "lost or duplicated"


class Batch(msgspec.Struct, frozen=True):
    txn: int
    item: int


def _transaction_history(
    client: slipstream.Client, streams: tuple[str, ...]
) -> dict[int, dict[str, list[int]]]:
    """Per transaction number, the items read from each stream."""
    seen: dict[int, dict[str, list[int]]] = {}
    for stream in streams:
        for event in client.reader(stream, end=client.tail(stream)):
            b = msgspec.json.decode(event.value, type=Batch)
            seen.setdefault(b.txn, {}).setdefault(stream, []).append(b.item)
    return seen


def _run_transaction(client: slipstream.Client, number: int, items: int) -> bool:
    """Run transaction ``number`` until it is known to be committed, whatever fails."""
    for _ in range(50):
        try:
            with client.transaction("faults-txn", timeout=30) as txn:
                for item in range(items):
                    value = msgspec.json.encode(Batch(number, item))
                    txn.send("faults/txa", value, key=f"k{item % 4}")
                    txn.send("faults/txb", value, key=f"k{item % 4}")
                txn.metadata = {"txn": number}
            return True
        except slipstream.SlipstreamError:
            # the outcome is unknown: the commit's metadata says whether it happened
            try:
                last = client.last_commit("faults-txn")
            except slipstream.SlipstreamError:
                time.sleep(0.2)
                continue
            if last is not None and last.metadata == {"txn": number}:
                return True
            time.sleep(0.1)
    return False


def test_transactions_are_all_or_nothing_through_kills(
    broker_factory: type[BrokerProcess],
) -> None:
    broker = broker_factory().start()
    streams = ("faults/txa", "faults/txb")
    with broker.client() as client:
        client.create_stream(streams[0], segments=3)
        client.create_stream(streams[1], segments=2)
    committed: list[int] = []
    stop = threading.Event()
    restarts = 0

    def killer() -> None:
        nonlocal restarts
        while not stop.wait(0.4):
            broker.restart()
            restarts += 1

    chaos = threading.Thread(target=killer, daemon=True)
    with slipstream.connect(broker.address, reconnect_timeout=30) as client:
        chaos.start()
        number = 0
        while restarts < 5 or number < 40:
            assert _run_transaction(client, number, items=30), f"txn {number} never committed"
            committed.append(number)
            number += 1
        stop.set()
        chaos.join(30)
    with broker.client() as client:
        seen = _transaction_history(client, streams)
    assert sorted(seen) == committed, "a committed transaction is missing, or an aborted one shows"
    for number, by_stream in seen.items():
        for stream in streams:
            assert sorted(by_stream.get(stream, [])) == list(range(30)), (
                f"transaction {number} is partial or duplicated in {stream}"
            )
    assert broker.log().count("recovered") >= 6


@pytest.mark.parametrize(
    "step",
    [
        "txn.before_commit_record",
        "txn.after_commit_record",
        "txn.mid_apply",
        "txn.after_apply",
    ],
)
def test_a_crash_at_each_step_of_a_commit_leaves_it_whole_or_gone(
    broker_factory: type[BrokerProcess], step: str
) -> None:
    broker = broker_factory()
    broker.env["SLIPSTREAM_FAULT"] = step
    broker.start()
    streams = ("faults/txa", "faults/txb")
    with slipstream.connect(broker.address, reconnect_timeout=0.5) as client:
        client.create_stream(streams[0], segments=3)
        client.create_stream(streams[1], segments=2)
        txn = client.transaction("crashing", timeout=60)
        for item in range(60):
            value = msgspec.json.encode(Batch(1, item))
            txn.send(streams[0], value, key=f"k{item}")
            txn.send(streams[1], value, key=f"k{item}")
        with pytest.raises(slipstream.BrokerUnavailable):
            txn.commit(metadata={"txn": 1})
    assert broker.proc is not None and broker.proc.wait(10) == -9, "the fault did not fire"
    broker.env.clear()
    broker.start()
    with broker.client() as client:
        seen = _transaction_history(client, streams)
        last = client.last_commit("crashing")
    if step == "txn.before_commit_record":
        assert seen == {} and last is None
        assert "ignored the staged entries of 1 transactions" in broker.log()
    else:
        assert last is not None and last.metadata == {"txn": 1}
        assert {s: sorted(items) for s, items in seen[1].items()} == {
            s: list(range(60)) for s in streams
        }
        assert "applied transaction" in broker.log() or step == "txn.after_apply"


@pytest.mark.parametrize("step", ["txn.after_commit_record", "txn.mid_apply"])
def test_a_crash_inside_a_merged_commit_applies_every_part(
    broker_factory: type[BrokerProcess], step: str
) -> None:
    broker = broker_factory()
    broker.env["SLIPSTREAM_FAULT"] = step
    broker.start()
    with slipstream.connect(broker.address, reconnect_timeout=0.5) as client:
        client.create_stream("faults/merge", segments=3)
        parts = []
        for task in range(3):
            part = client.transaction(None, label=f"task-{task}")
            for item in range(40):
                part.send("faults/merge", msgspec.json.encode(Batch(task, item)), key=f"k{item}")
            part.flush()
            parts.append(part.txn_id)
        with pytest.raises(slipstream.BrokerUnavailable):
            client.transaction("merging-owner").commit(metadata={"batch": 9}, merge=parts)
    assert broker.proc is not None and broker.proc.wait(10) == -9
    broker.env.clear()
    broker.start()
    with broker.client() as client:
        seen = _transaction_history(client, ("faults/merge",))
        assert client.last_commit("merging-owner").metadata == {"batch": 9}  # type: ignore[union-attr]
    assert {task: sorted(by["faults/merge"]) for task, by in seen.items()} == {
        task: list(range(40)) for task in range(3)
    }

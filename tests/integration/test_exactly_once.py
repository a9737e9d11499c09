"""Idempotent producers and transactions against a real broker process."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from conftest import BrokerProcess, chunk_files
from raw import RawConnection, batch

import slipstream
from slipstream.protocol import (
    Append,
    AppendAck,
    BeginTxn,
    ClaimProducer,
    Done,
    EndTxn,
    Error,
    InitProducer,
    ProducerGrant,
)


def _values(client: slipstream.Client, stream: str) -> list[bytes]:
    return [e.value for e in client.reader(stream, end=client.tail(stream))]


@pytest.fixture
def raw(broker: BrokerProcess, client: slipstream.Client) -> Iterator[RawConnection]:
    client.create_stream("eo/raw", segments=1)
    connection = RawConnection(broker.address)
    connection.receive()
    yield connection
    connection.close()


def _grant(raw: RawConnection, transactional_id: str | None = None) -> tuple[int, int]:
    raw.send_frame(InitProducer(transactional_id), 2)
    grant = raw.receive().message
    assert isinstance(grant, ProducerGrant)
    _tokens[grant.producer_id] = grant.token
    return grant.producer_id, grant.epoch


_tokens: dict[int, bytes] = {}


def _claim(raw: RawConnection, pid: int, epoch: int) -> None:
    """Claim a producer id granted on an earlier connection (the broker binds ids to one)."""
    raw.send_frame(ClaimProducer(pid, epoch, _tokens[pid]), 9)
    assert isinstance(raw.receive().message, Done)


def _append(raw: RawConnection, cid: int, payload: bytes) -> AppendAck | Error:
    raw.send_frame(Append("eo/raw", 0), cid, payload)
    frame = raw.receive()
    assert frame.correlation_id == cid
    assert isinstance(frame.message, AppendAck | Error)
    return frame.message


def test_a_retried_batch_is_stored_once_and_answered_with_its_first_offset(
    raw: RawConnection, client: slipstream.Client, broker: BrokerProcess
) -> None:
    pid, epoch = _grant(raw)
    first = batch(3, b"a", producer_id=pid, producer_epoch=epoch, sequence=0)
    second = batch(2, b"b", producer_id=pid, producer_epoch=epoch, sequence=3)
    assert _append(raw, 3, first) == AppendAck(0, 3)
    assert _append(raw, 4, second) == AppendAck(3, 2)
    assert _append(raw, 5, first) == AppendAck(0, 3)  # a retry
    assert _append(raw, 6, second) == AppendAck(3, 2)
    assert _values(client, "eo/raw") == [b"a"] * 3 + [b"b"] * 2

    # the dedup state survives a kill -9 and restart (rebuilt from the journal) ...
    raw.close()
    broker.restart()
    again = RawConnection(broker.address)
    again.receive()
    _claim(again, pid, epoch)
    assert _append(again, 7, second) == AppendAck(3, 2)
    # ... and a gap is a clear error that names both sequence numbers
    error = _append(again, 8, batch(1, b"c", producer_id=pid, producer_epoch=epoch, sequence=9))
    assert isinstance(error, Error) and error.code == "out_of_order_sequence"
    assert error.details == {"producer_id": pid, "expected": 5, "received": 9}
    again.close()
    with broker.client() as fresh:
        assert _values(fresh, "eo/raw") == [b"a"] * 3 + [b"b"] * 2


def test_dedup_state_survives_the_move_to_chunks(broker_factory: type[BrokerProcess]) -> None:
    broker = broker_factory("--roll", "64KiB", "--roll-seconds", "0.2").start()
    with broker.client() as client:
        client.create_stream("eo/raw", segments=1)
    raw = RawConnection(broker.address)
    raw.receive()
    pid, epoch = _grant(raw)
    batches = [
        batch(1, bytes([i]) * 20_000, producer_id=pid, producer_epoch=epoch, sequence=i)
        for i in range(8)
    ]
    for i, payload in enumerate(batches):
        assert _append(raw, 10 + i, payload) == AppendAck(i, 1)
    deadline = time.monotonic() + 10
    while not chunk_files(broker.data_dir, "eo/raw") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert chunk_files(broker.data_dir, "eo/raw"), "the journal was never moved to chunks"
    raw.close()
    broker.restart()
    raw = RawConnection(broker.address)
    raw.receive()
    _claim(raw, pid, epoch)
    assert _append(raw, 30, batches[7]) == AppendAck(7, 1)
    assert _append(raw, 31, batches[6]) == AppendAck(6, 1)
    raw.close()


def test_a_new_producer_with_the_same_transactional_id_fences_the_old_one(
    client: slipstream.Client, broker: BrokerProcess
) -> None:
    client.create_stream("eo/fence", segments=2)
    old = client.producer("eo/fence", transactional_id="writer-1")
    old.send(b"1", key="k").result()
    with broker.client() as other:
        new = other.producer("eo/fence", transactional_id="writer-1")
        new.send(b"2", key="k").result()
        with pytest.raises(slipstream.ProducerFenced, match="fenced"):
            old.send(b"zombie", key="k").result(10)
        new.close()
    assert _values(client, "eo/fence") == [b"1", b"2"]


def test_idempotent_producer_resends_after_a_broker_restart(
    client: slipstream.Client, broker: BrokerProcess
) -> None:
    client.create_stream("eo/restart", segments=2)
    producer = client.producer("eo/restart", linger_ms=1)
    receipts = [producer.send(b"%d" % i, key=f"k{i % 5}") for i in range(2000)]
    broker.restart()  # kill -9 while batches may be in flight
    receipts += [producer.send(b"%d" % i, key=f"k{i % 5}") for i in range(2000, 4000)]
    producer.flush(60)
    positions = [r.result() for r in receipts]
    assert len(set(positions)) == 4000
    values = _values(client, "eo/restart")
    assert sorted(values) == sorted(b"%d" % i for i in range(4000)), "lost or duplicated"
    by_key: dict[int, list[int]] = {}
    for v in values:
        by_key.setdefault(int(v) % 5, []).append(int(v))
    assert all(seq == sorted(seq) for seq in by_key.values()), "per-key order broken"


# --- transactions ---------------------------------------------------------------------------


def test_committed_transaction_is_visible_across_streams_with_its_metadata(
    client: slipstream.Client,
) -> None:
    client.create_stream("eo/orders", segments=3)
    client.create_stream("eo/audit", segments=1)
    assert client.last_commit("enricher-1") is None
    with client.transaction("enricher-1") as txn:
        for i in range(100):
            txn.send("eo/orders", b"o%d" % i, key=f"k{i % 7}")
            txn.send("eo/audit", b"a%d" % i, key=f"k{i % 7}")
        # nothing is visible before the commit
        assert _values(client, "eo/orders") == [] and _values(client, "eo/audit") == []
        listed = client.transactions()
        assert [t.txn_id for t in listed] == [txn.txn_id]
        assert listed[0].transactional_id == "enricher-1" and listed[0].state == "open"
        txn.metadata = {"input": {"segment": 0, "offset": 42}}
    orders = _values(client, "eo/orders")
    assert sorted(orders) == sorted(b"o%d" % i for i in range(100))
    assert _values(client, "eo/audit") == [b"a%d" % i for i in range(100)]  # in order
    last = client.last_commit("enricher-1")
    assert last is not None and last.metadata == {"input": {"segment": 0, "offset": 42}}
    assert last.txn_id == txn.txn_id
    assert client.transactions() == []


def test_aborted_transaction_leaves_nothing(client: slipstream.Client) -> None:
    client.create_stream("eo/abort", segments=2)
    with pytest.raises(RuntimeError), client.transaction("t-abort") as txn:
        txn.send("eo/abort", b"never")
        raise RuntimeError("the application failed mid-transaction")
    with client.producer("eo/abort") as producer:
        producer.send(b"plain")
    assert _values(client, "eo/abort") == [b"plain"]
    assert client.last_commit("t-abort") is None


def test_a_forgotten_transaction_times_out(client: slipstream.Client) -> None:
    client.create_stream("eo/timeout", segments=1)
    txn = client.transaction("t-slow", timeout=0.5)
    txn.send("eo/timeout", b"late")
    deadline = time.monotonic() + 10
    while client.transactions() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert client.transactions() == []
    with pytest.raises(slipstream.TransactionAborted):
        txn.commit()
    assert _values(client, "eo/timeout") == []


def test_operator_abort_and_fencing_abort_open_transactions(
    client: slipstream.Client, broker: BrokerProcess
) -> None:
    client.create_stream("eo/ops", segments=1)
    txn = client.transaction("t-ops")
    txn.send("eo/ops", b"x")
    with broker.client() as operator:
        operator.abort_transaction(txn.txn_id)
    with pytest.raises(slipstream.TransactionAborted):
        txn.commit()
    # a second client with the same transactional id fences the first one's open transaction
    first = client.transaction("t-ops")
    first.send("eo/ops", b"y")
    with broker.client() as other, other.transaction("t-ops") as second:
        second.send("eo/ops", b"z")
    with pytest.raises((slipstream.TransactionAborted, slipstream.ProducerFenced)):
        first.commit()
    assert _values(client, "eo/ops") == [b"z"]


def test_a_repeated_commit_answers_the_first_outcome(
    client: slipstream.Client, raw: RawConnection
) -> None:
    txn = client.transaction("t-repeat")
    txn.send("eo/raw", b"once")
    ended = txn.commit()
    assert ended.committed and [r.stream for r in ended.ranges] == ["eo/raw"]
    raw.send_frame(EndTxn(txn.txn_id, True), 40)  # a client retrying after a lost answer
    again = raw.receive().message
    assert getattr(again, "committed", None) is True
    raw.send_frame(EndTxn(123456789, True), 41)
    error = raw.receive().message
    assert isinstance(error, Error) and error.code == "transaction_not_found"
    assert _values(client, "eo/raw") == [b"once"]


def test_transactions_and_plain_appends_interleave_in_one_segment(
    client: slipstream.Client,
) -> None:
    client.create_stream("eo/mixed", segments=1)
    with client.producer("eo/mixed") as producer:
        producer.send(b"p1")
        with client.transaction("t-mixed") as txn:
            txn.send("eo/mixed", b"t1")
            producer.send(b"p2").result()
            txn.send("eo/mixed", b"t2")
        producer.send(b"p3")
    assert _values(client, "eo/mixed") == [b"p1", b"p2", b"t1", b"t2", b"p3"]


def test_asyncio_transactions_and_fencing(broker: BrokerProcess) -> None:
    async def main() -> tuple[list[bytes], object]:
        async with await slipstream.connect_async(broker.address) as client:
            await client.create_stream("eo/async", segments=2)
            async with await client.transaction("async-app") as txn:
                for i in range(10):
                    await txn.send("eo/async", b"%d" % i, key=f"k{i % 2}")
                txn.metadata = {"done": 10}
            with pytest.raises(ValueError):
                async with await client.transaction("async-app") as failed:
                    await failed.send("eo/async", b"aborted")
                    raise ValueError("abort me")
            producer = await client.producer("eo/async", transactional_id="async-writer")
            await (await producer.send(b"fenced soon"))
            await client.producer("eo/async", transactional_id="async-writer")  # fences it
            with pytest.raises(slipstream.ProducerFenced):
                await (await producer.send(b"zombie"))
            reader = client.reader("eo/async", end=await client.tail("eo/async"))
            values = [event.value async for event in reader]
            return values, await client.last_commit("async-app")

    values, last = asyncio.run(main())
    assert sorted(values) == sorted([b"%d" % i for i in range(10)] + [b"fenced soon"])
    assert getattr(last, "metadata", None) == {"done": 10}


def test_bad_transaction_requests_get_typed_errors(raw: RawConnection) -> None:
    def error(message: object, payload: bytes = b"") -> Error:
        raw.send_frame(message, 50, payload)
        reply = raw.receive().message
        assert isinstance(reply, Error), reply
        return reply

    plain_pid, _ = _grant(raw)
    assert error(BeginTxn(plain_pid, 0, 1000)).code == "invalid_argument"  # no transactional id
    pid, epoch = _grant(raw, "bad-requests")
    assert error(BeginTxn(pid, epoch, 0)).code == "invalid_argument"  # timeout out of range
    assert error(BeginTxn(pid, epoch - 1, 1000)).code == "producer_fenced"
    assert error(InitProducer("")).code == "invalid_argument"
    assert error(InitProducer("x" * 256)).code == "invalid_argument"
    unknown = error(Append("eo/raw", 0, 424242), batch())
    assert unknown.code == "transaction_not_found" and "424242" in unknown.message
    assert error(EndTxn(424242, False)).code == "transaction_not_found"


def test_anonymous_transactions_commit_merged_into_an_owned_one(
    client: slipstream.Client, broker: BrokerProcess
) -> None:
    client.create_stream("eo/merge", segments=3)
    parts = []
    with broker.client() as worker_a, broker.client() as worker_b:
        for number, worker in enumerate((worker_a, worker_b)):
            part = worker.transaction(None, label=f"task-{number}")
            part.send_many("eo/merge", [b"%d-%d" % (number, i) for i in range(50)])
            part.flush()
            parts.append(part.txn_id)
        listed = {t.txn_id: t for t in client.transactions()}
        assert {listed[p].label for p in parts} == {"task-0", "task-1"}
        stray = worker_a.transaction(None)
        with pytest.raises(slipstream.InvalidArgument, match="merged"):
            stray.commit()
        stray.abort()
        assert _values(client, "eo/merge") == []
        owner = client.transaction("merger")
        owner.send("eo/merge", b"owner")
        ended = owner.commit(metadata={"batch": 1}, merge=parts)
    assert ended.committed
    values = _values(client, "eo/merge")
    assert sorted(values) == sorted(
        [b"owner"] + [b"%d-%d" % (n, i) for n in range(2) for i in range(50)]
    )
    assert client.transactions() == []
    with pytest.raises(slipstream.SlipstreamError):  # merged ones are committed, not abortable
        client.abort_transaction(parts[0])
    other = client.transaction("merger-2")
    with pytest.raises(slipstream.InvalidArgument, match="cannot be merged"):
        client.transaction("merger").commit(merge=[other.txn_id])

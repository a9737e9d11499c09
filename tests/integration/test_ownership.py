"""Producer ids and transactions belong to the connection that was granted them, over the wire.

A second connection (the raw test connection, sending exactly the frames it means) cannot
append with another connection's producer id, reset its sequence, or write to, commit or abort
its transaction; the owner, reconnected, claims the id with its token and carries on; the
Python client does that by itself after a cut connection.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from conftest import BrokerProcess
from proxy import CuttingProxy
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
    Message,
    ProducerGrant,
    TxnBegun,
    TxnEnded,
)


@pytest.fixture
def connections(broker: BrokerProcess) -> Iterator[tuple[RawConnection, RawConnection]]:
    with broker.client() as client:
        client.create_stream("own/raw", segments=1)
    owner, other = RawConnection(broker.address), RawConnection(broker.address)
    owner.receive()
    other.receive()
    yield owner, other
    owner.close()
    other.close()


def ask(raw: RawConnection, message: Message, payload: bytes = b"") -> Message:
    raw.send_frame(message, 7, payload)
    frame = raw.receive()
    assert frame.correlation_id == 7
    return frame.message


def refused(reply: Message) -> bool:
    return isinstance(reply, Error) and reply.code == "not_owner"


def test_another_connection_cannot_use_a_producer_id(
    connections: tuple[RawConnection, RawConnection], broker: BrokerProcess
) -> None:
    owner, other = connections
    grant = ask(owner, InitProducer())
    assert isinstance(grant, ProducerGrant) and len(grant.token) == 16
    pid, epoch = grant.producer_id, grant.epoch

    def idempotent(sequence: int, value: bytes = b"v") -> bytes:
        return batch(1, value, producer_id=pid, producer_epoch=epoch, sequence=sequence)

    assert ask(owner, Append("own/raw", 0), idempotent(0)) == AppendAck(0, 1)
    # not as a retry, not from sequence 0 (which would reset the producer's state), not ahead
    for sequence in (0, 1, 5):
        reply = ask(other, Append("own/raw", 0), idempotent(sequence, b"evil"))
        assert refused(reply), reply
    assert refused(ask(other, ClaimProducer(pid, epoch, bytes(16))))
    assert ask(owner, Append("own/raw", 0), idempotent(1)) == AppendAck(1, 1)

    # the owner, reconnected, claims its id with the token and carries on where it was
    owner.close()
    again = RawConnection(broker.address)
    again.receive()
    assert refused(ask(again, Append("own/raw", 0), idempotent(2)))
    assert isinstance(ask(again, ClaimProducer(pid, epoch, grant.token)), Done)
    assert ask(again, Append("own/raw", 0), idempotent(1)) == AppendAck(1, 1)  # a retry
    assert ask(again, Append("own/raw", 0), idempotent(2)) == AppendAck(2, 1)
    again.close()
    with broker.client() as client:
        events = list(client.reader("own/raw", end=client.tail("own/raw")))
    assert [e.value for e in events] == [b"v"] * 3


def test_another_connection_cannot_write_to_commit_or_abort_a_transaction(
    connections: tuple[RawConnection, RawConnection], broker: BrokerProcess
) -> None:
    owner, other = connections
    grant = ask(owner, InitProducer("own-app"))
    assert isinstance(grant, ProducerGrant)
    assert refused(ask(other, BeginTxn(grant.producer_id, grant.epoch, 60_000)))
    begun = ask(owner, BeginTxn(grant.producer_id, grant.epoch, 60_000))
    assert isinstance(begun, TxnBegun)
    txn = begun.txn_id
    assert ask(owner, Append("own/raw", 0, txn), batch(1, b"in")) == AppendAck(-1, 1)
    assert refused(ask(other, Append("own/raw", 0, txn), batch(1, b"evil")))
    assert refused(ask(other, EndTxn(txn, False)))
    assert refused(ask(other, EndTxn(txn, True)))

    # the owner's reconnection claims the id and commits the transaction it had open
    owner.close()
    again = RawConnection(broker.address)
    again.receive()
    assert refused(ask(again, EndTxn(txn, True)))
    assert isinstance(ask(again, ClaimProducer(grant.producer_id, grant.epoch, grant.token)), Done)
    ended = ask(again, EndTxn(txn, True))
    assert isinstance(ended, TxnEnded) and ended.committed
    again.close()
    with broker.client() as client:
        assert [e.value for e in client.reader("own/raw", end=client.tail("own/raw"))] == [b"in"]


def test_an_operator_aborts_any_transaction(
    connections: tuple[RawConnection, RawConnection],
) -> None:
    owner, operator = connections
    grant = ask(owner, InitProducer("own-ops"))
    assert isinstance(grant, ProducerGrant)
    begun = ask(owner, BeginTxn(grant.producer_id, grant.epoch, 60_000))
    assert isinstance(begun, TxnBegun)
    reply = ask(operator, EndTxn(begun.txn_id, True, operator=True))
    assert isinstance(reply, Error) and reply.code == "invalid_argument"
    assert ask(operator, EndTxn(begun.txn_id, False, operator=True)) == TxnEnded(
        begun.txn_id, False
    )
    reply = ask(owner, EndTxn(begun.txn_id, True))
    assert isinstance(reply, Error) and reply.code == "transaction_aborted"


def test_the_client_claims_its_ids_again_after_a_cut_connection(broker: BrokerProcess) -> None:
    proxy = CuttingProxy(broker.port)
    try:
        with slipstream.connect(proxy.address) as client:
            client.create_stream("own/cut", segments=1)
            producer = client.producer("own/cut")
            producer.send(b"before").result(10)
            txn = client.transaction("own-cut")
            txn.send("own/cut", b"staged")
            txn.flush()
            proxy.cut()
            # the commit's first try dies with the connection; the retry runs on a new one,
            # which must own the transaction's producer id
            assert txn.commit().committed
            producer.send(b"after").result(10)  # the idempotent producer, on the new one
            producer.close()
            values = [e.value for e in client.reader("own/cut", end=client.tail("own/cut"))]
        assert values == [b"before", b"staged", b"after"]
        assert proxy.cuts == 1
    finally:
        proxy.close()

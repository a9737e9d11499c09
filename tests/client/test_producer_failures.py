"""A producer never reports success for events it lost, sync and asyncio, on a real broker."""

from __future__ import annotations

import asyncio

import pytest
from conftest import BrokerProcess

import slipstream


def test_leaving_the_block_raises_when_the_stream_is_deleted_under_it(
    client: slipstream.Client,
) -> None:
    client.create_stream("gone/sync")
    with (
        pytest.raises(slipstream.StreamNotFound, match="not acknowledged") as raised,
        client.producer("gone/sync") as producer,
    ):
        for i in range(10):
            producer.send(b"%d" % i)
        producer.flush()
        client.delete_stream("gone/sync")
        for i in range(10, 30):
            receipt = producer.send(b"%d" % i)
            with pytest.raises(slipstream.StreamNotFound):
                receipt.result()  # failed before the block ends: nobody else looks
    assert producer.acknowledged == 10
    assert raised.value.details["unacknowledged"] == 20
    assert raised.value.details["acknowledged"] == 10


def test_flush_raises_each_failure_once_and_close_after_it_succeeds(
    client: slipstream.Client,
) -> None:
    client.create_stream("gone/once")
    producer = client.producer("gone/once")
    client.delete_stream("gone/once")
    producer.send(b"lost")
    with pytest.raises(slipstream.StreamNotFound, match="1 event sent to gone/once was not"):
        producer.flush()
    client.create_stream("gone/once")
    producer.close()  # nothing failed since: no error repeated
    assert producer.acknowledged == 0


def test_the_block_s_own_exception_wins_with_the_loss_noted(client: slipstream.Client) -> None:
    client.create_stream("gone/noted")
    with pytest.raises(KeyError) as raised, client.producer("gone/noted") as producer:
        client.delete_stream("gone/noted")
        producer.send(b"lost").done()
        raise KeyError("the application's own error")
    assert any("StreamNotFound" in note for note in raised.value.__notes__)


def test_a_transaction_with_a_failed_batch_aborts_instead_of_committing(
    client: slipstream.Client,
) -> None:
    client.create_stream("gone/kept")
    client.create_stream("gone/txn")
    with pytest.raises(slipstream.StreamNotFound), client.transaction("gone-app") as txn:
        txn.send("gone/kept", b"half")
        txn.send("gone/txn", b"other half")
        txn.flush()
        client.delete_stream("gone/txn")
        txn.send("gone/txn", b"lost")
    client.create_stream("gone/txn2")
    with (
        pytest.raises(slipstream.TransactionAborted, match="failed earlier"),
        client.transaction("gone-app") as txn,
    ):
        txn.send("gone/kept", b"half")
        txn.send("gone/txn2", b"other half")
        client.delete_stream("gone/txn2")
        txn.send("gone/txn2", b"lost")
        with pytest.raises(slipstream.StreamNotFound):
            txn.flush()  # the failure is raised once; the commit must not forget it
    assert list(client.reader("gone/kept", end=client.tail("gone/kept"))) == []


def test_asyncio_producer_raises_on_leaving_the_block(broker: BrokerProcess) -> None:
    async def main() -> tuple[int, dict[str, object]]:
        async with await slipstream.connect_async(broker.address) as client:
            await client.create_stream("gone/async")
            with pytest.raises(slipstream.StreamNotFound) as raised:
                async with await client.producer("gone/async") as producer:
                    await producer.send(b"kept")
                    await producer.flush()
                    await client.delete_stream("gone/async")
                    for _ in range(5):
                        await producer.send(b"lost")
            return producer.acknowledged, raised.value.details

    acknowledged, details = asyncio.run(main())
    assert acknowledged == 1
    assert details["unacknowledged"] == 5


def test_create_stream_exist_ok(client: slipstream.Client, broker: BrokerProcess) -> None:
    created = client.create_stream("again/s", segments=3)
    with pytest.raises(slipstream.StreamExists):
        client.create_stream("again/s")
    existing = client.create_stream("again/s", segments=1, exist_ok=True)
    assert existing.name == created.name
    assert len(existing.segments) == 3  # returned as it is, not changed

    async def main() -> int:
        async with await slipstream.connect_async(broker.address) as aclient:
            info = await aclient.create_stream("again/s", exist_ok=True)
            with pytest.raises(slipstream.StreamExists):
                await aclient.create_stream("again/s")
            return len(info.segments)

    assert asyncio.run(main()) == 3


def test_a_broker_that_stays_down_is_raised_with_the_counts(broker: BrokerProcess) -> None:
    with slipstream.connect(broker.address, reconnect_timeout=1) as client:
        client.create_stream("gone/down")
        with (
            pytest.raises(
                slipstream.BrokerUnavailable, match="50 events sent to gone/down"
            ) as raised,
            client.producer("gone/down", delivery_timeout=2) as producer,
        ):
            for i in range(100):
                producer.send(b"%d" % i)
            producer.flush()
            broker.kill()
            for i in range(50):
                producer.send(b"%d" % i)
        assert producer.acknowledged == 100
        assert raised.value.details["acknowledged"] == 100

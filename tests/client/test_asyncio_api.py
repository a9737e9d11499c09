"""The asyncio API has the shape of the blocking one, with ``await`` and ``async``: the forms
the docs show work, and nothing blocks the event loop forever."""

from __future__ import annotations

import asyncio
import inspect

import pytest
from conftest import BrokerProcess

import slipstream

PAIRS = [
    (slipstream.Client, slipstream.AsyncClient),
    (slipstream.Producer, slipstream.AsyncProducer),
    (slipstream.Transaction, slipstream.AsyncTransaction),
    (slipstream.Reader, slipstream.AsyncReader),
]
#: what only one side has, and why
ASYNC_ONLY = {"connect": "the classmethod behind connect_async", "live_connection": "internal"}


def _public(cls: type) -> set[str]:
    return {name for name in dir(cls) if not name.startswith("_")}


@pytest.mark.parametrize(("sync", "async_"), PAIRS, ids=lambda cls: cls.__name__)
def test_every_blocking_method_has_an_asyncio_twin(sync: type, async_: type) -> None:
    assert _public(sync) - _public(async_) <= {"metadata"}  # an instance attribute there
    assert _public(async_) - _public(sync) <= set(ASYNC_ONLY)
    for name in _public(sync) & _public(async_):
        blocking, awaited = getattr(sync, name), getattr(async_, name)
        if callable(blocking) and not isinstance(blocking, type):
            blocking_args = set(inspect.signature(blocking).parameters) - {"timeout", "options"}
            async_args = set(inspect.signature(awaited).parameters) - {"timeout", "options"}
            assert async_args >= blocking_args or "options" in inspect.signature(awaited).parameters
    assert hasattr(sync, "__enter__") and hasattr(async_, "__aenter__")


def test_the_documented_async_with_forms(broker: BrokerProcess) -> None:
    async def main() -> tuple[list[bytes], object, object, object]:
        async with slipstream.connect_async(broker.address) as client:
            await client.create_stream("aio/forms", segments=2, exist_ok=True)
            async with client.producer("aio/forms") as producer:
                receipt = await producer.send(b"one", key="k")
                bulk = await producer.send_many([b"two", b"three"])
                position = await receipt  # the acknowledgement, without blocking the loop
                positions = await bulk
            assert receipt.result() == position  # done: a plain result() is fine now
            async with client.transaction("aio-app") as txn:
                await txn.send("aio/forms", b"four", key="k")
                txn.metadata = {"done": 4}
            end = await client.tail("aio/forms")
            async with client.reader("aio/forms", end=end) as reader:
                values = [event.value async for event in reader]
            last = await client.last_commit("aio-app")
            assert last is not None
            return values, position, positions, last.metadata

    values, position, positions, metadata = asyncio.run(main())
    assert sorted(values) == [b"four", b"one", b"three", b"two"]
    assert isinstance(position, slipstream.Position)
    assert isinstance(positions, list) and len(positions) == 2
    assert metadata == {"done": 4}


def test_await_forms_still_work(broker: BrokerProcess) -> None:
    async def main() -> int:
        client = await slipstream.connect_async(broker.address)
        try:
            await client.create_stream("aio/await")
            producer = await client.producer("aio/await")
            await (await producer.send(b"x"))
            await producer.close()
            txn = await client.transaction("aio-await")
            await txn.send("aio/await", b"y")
            await txn.commit()
            return producer.acknowledged
        finally:
            await client.close()

    assert asyncio.run(main()) == 1


def test_a_blocking_result_on_the_loop_raises_instead_of_hanging(broker: BrokerProcess) -> None:
    async def main() -> None:
        async with (
            slipstream.connect_async(broker.address) as client,
            client.producer("aio/hang") as producer,
        ):
            receipt = await producer.send(b"x")  # nothing ran on the loop since: not acked
            with pytest.raises(slipstream.InvalidArgument, match="await receipt"):
                receipt.result()
            bulk = await producer.send_many([b"y"])
            with pytest.raises(slipstream.InvalidArgument, match="await receipt"):
                bulk.result()
            await receipt

    async def create() -> None:
        async with slipstream.connect_async(broker.address) as client:
            await client.create_stream("aio/hang")

    asyncio.run(create())
    asyncio.run(main())


def test_a_blocking_receipt_waits_in_a_thread_that_runs_another_loop(
    client: slipstream.Client,
) -> None:
    """Only the loop that delivers acknowledgements is guarded: a blocking client used from
    async code (a notebook) still gets its result."""
    client.create_stream("aio/other")

    async def main() -> slipstream.Position:
        with client.producer("aio/other") as producer:
            return producer.send(b"x").result(timeout=30)

    assert asyncio.run(main()) == slipstream.Position(0, 0)


def test_an_async_reader_is_iterated_once_like_the_blocking_one(broker: BrokerProcess) -> None:
    async def main() -> None:
        async with slipstream.connect_async(broker.address) as client:
            await client.create_stream("aio/once")
            reader = client.reader("aio/once", end=await client.tail("aio/once"))
            assert [event async for event in reader] == []
            with pytest.raises(slipstream.InvalidArgument, match="iterated once"):
                [event async for event in reader]

    asyncio.run(main())

"""The service layer called directly, as every protocol calls it: an in-process broker (data
directory, containers, coordinator), no sockets in the calls under test.

What is checked: the operations answer with domain values; a producer id and the
transactions begun with it belong to the caller that was granted it (appends, commits and
aborts by another caller raise NotOwner and change nothing), a caller re-claims an id with
its token, also after a broker restart, and a wrong token is refused; anonymous transactions
stay shared; an operator may abort, never commit.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from raw import batch

from slipstream import InvalidArgument, NotOwner, ProducerFenced, StreamNotFound, TransactionAborted
from slipstream.broker import Broker, BrokerConfig, ContainerConfig
from slipstream.broker._service import PRODUCER_KEY_FILE, Caller, Service
from slipstream.format import decode_header, read_body
from slipstream.protocol import StreamInfo


@asynccontextmanager
async def running(data_dir: Path) -> AsyncIterator[Service]:
    """A broker serving in this process (on an ephemeral port nobody uses here); its service."""
    broker = Broker(
        BrokerConfig(
            data_dir=data_dir, port=0, containers=2, container=ContainerConfig(roll_ms=600_000)
        )
    )
    ready = asyncio.Event()
    serving = asyncio.create_task(broker.serve(lambda _: ready.set()))
    waiting = asyncio.create_task(ready.wait())
    await asyncio.wait({serving, waiting}, return_when="FIRST_COMPLETED")
    if serving.done():
        waiting.cancel()
        serving.result()  # raises what stopped it
    try:
        yield broker.service
    finally:
        broker.stop()
        await serving


def run(data_dir: Path, body: Callable[[Service], Awaitable[None]]) -> None:
    async def main() -> None:
        async with running(data_dir) as service:
            await body(service)

    asyncio.run(main())


async def append(
    service: Service, caller: Caller, payload: bytes, txn: int | None = None, stream: str = "s/a"
) -> int | None:
    future, header = service.append(caller, stream, 0, txn, bytearray(payload))
    assert header.batch_length == len(payload)
    return await future


async def values(service: Service, caller: Caller, stream: str = "s/a") -> list[bytes]:
    segment = service.segment(caller, stream, 0)
    out: list[bytes] = []
    offset = 0
    while batches := await service.read(caller, segment, offset, 1 << 20):
        for data in batches:
            out.extend(read_body(data).column(1).to_pylist())
            offset = decode_header(data).next_offset
    return out


def test_stream_operations_answer_with_values(tmp_path: Path) -> None:
    async def body(service: Service) -> None:
        caller = service.connect("test")
        info = await service.create_stream(caller, "s/a", 2, retention_ms=60_000)
        assert isinstance(info, StreamInfo) and len(info.segments) == 2
        assert [s.name for s in service.list_streams(caller, "s")] == ["s/a"]
        assert service.describe_stream(caller, "s/a").retention_ms == 60_000
        assert await append(service, caller, batch(3, b"x")) == 0
        assert await service.cut(caller, "s/a", "latest") == {0: 3, 1: 0}
        assert await values(service, caller) == [b"x"] * 3
        await service.delete_stream(caller, "s/a")
        with pytest.raises(StreamNotFound):
            service.describe_stream(caller, "s/a")

    run(tmp_path, body)


def test_a_producer_id_belongs_to_the_caller_it_was_granted_to(tmp_path: Path) -> None:
    async def body(service: Service) -> None:
        owner, other = service.connect("owner"), service.connect("other")
        await service.create_stream(owner, "s/a", 1)
        pid, epoch, token = await service.init_producer(owner)

        def idempotent(sequence: int, value: bytes) -> bytes:
            return batch(1, value, producer_id=pid, producer_epoch=epoch, sequence=sequence)

        assert await append(service, owner, idempotent(0, b"a")) == 0
        # another caller may not use it: not as a retry, not to reset the sequence
        for sequence in (0, 1, 7):
            with pytest.raises(NotOwner, match=f"producer {pid}"):
                await append(service, other, idempotent(sequence, b"evil"))
        with pytest.raises(NotOwner, match="token"):
            service.claim_producer(other, pid, epoch, bytes(16))
        with pytest.raises(NotOwner, match="token"):
            service.claim_producer(other, pid, epoch + 1, token)  # a token names its epoch
        # the owner's dedup state is untouched: a retry is answered, the next batch follows
        assert await append(service, owner, idempotent(0, b"a")) == 0
        assert await append(service, owner, idempotent(1, b"b")) == 1

        # a new connection of the owner claims it with the token; the old one loses it
        again = service.connect("owner, reconnected")
        service.claim_producer(again, pid, epoch, token)
        assert await append(service, again, idempotent(2, b"c")) == 2
        with pytest.raises(NotOwner):
            await append(service, owner, idempotent(3, b"stale"))
        service.disconnect(again)
        with pytest.raises(NotOwner):
            await append(service, again, idempotent(3, b"gone"))
        assert await values(service, owner) == [b"a", b"b", b"c"]

    run(tmp_path, body)


def test_a_token_still_claims_after_a_restart(tmp_path: Path) -> None:
    granted: list[tuple[int, int, bytes]] = []

    async def first(service: Service) -> None:
        caller = service.connect("first")
        await service.create_stream(caller, "s/a", 1)
        granted.append(await service.init_producer(caller))
        pid, epoch, _ = granted[0]
        assert await append(service, caller, batch(2, producer_id=pid, producer_epoch=epoch)) == 0

    async def second(service: Service) -> None:
        pid, epoch, token = granted[0]
        caller = service.connect("after restart")
        retry = batch(2, producer_id=pid, producer_epoch=epoch)
        with pytest.raises(NotOwner):  # nobody owns it after a restart until it is claimed
            await append(service, caller, retry)
        service.claim_producer(caller, pid, epoch, token)
        assert await append(service, caller, retry) == 0  # the retry, deduplicated
        assert await values(service, caller) == [b"v", b"v"]

    run(tmp_path, first)
    key = (tmp_path / PRODUCER_KEY_FILE).read_bytes()
    run(tmp_path, second)
    assert (tmp_path / PRODUCER_KEY_FILE).read_bytes() == key


def test_a_transaction_belongs_to_its_producers_owner(tmp_path: Path) -> None:
    async def body(service: Service) -> None:
        owner, other = service.connect("owner"), service.connect("other")
        await service.create_stream(owner, "s/a", 1)
        pid, epoch, token = await service.init_producer(owner, "app")
        with pytest.raises(NotOwner):
            await service.begin_txn(other, pid, epoch, 10_000)
        txn = await service.begin_txn(owner, pid, epoch, 10_000)
        assert await append(service, owner, batch(1, b"in"), txn) is None
        with pytest.raises(NotOwner, match=f"transaction {txn}"):
            await append(service, other, batch(1, b"evil"), txn)
        for commit in (False, True):
            with pytest.raises(NotOwner, match=f"transaction {txn}"):
                await service.end_txn(other, txn, commit)
        with pytest.raises(InvalidArgument, match="operator"):
            await service.end_txn(other, txn, True, operator=True)
        assert [t.events for t in service.list_txns(other)] == [1]

        # the owner, reconnected, claims the id and commits; anyone may ask about the outcome
        again = service.connect("owner, reconnected")
        service.claim_producer(again, pid, epoch, token)
        ended = await service.end_txn(again, txn, True, b'{"n": 1}')
        assert ended.committed
        assert (await service.end_txn(other, txn, True)).committed
        assert await values(service, other) == [b"in"]

        # an operator may abort any open transaction
        txn = await service.begin_txn(again, pid, epoch, 10_000)
        assert not (await service.end_txn(other, txn, False, operator=True)).committed
        with pytest.raises(TransactionAborted):
            await service.end_txn(again, txn, True)

        # a newer producer of the transactional id fences the old token
        await service.init_producer(other, "app")
        with pytest.raises(ProducerFenced):
            service.claim_producer(owner, pid, epoch, token)

    run(tmp_path, body)


def test_anonymous_transactions_are_shared_by_id(tmp_path: Path) -> None:
    async def body(service: Service) -> None:
        driver, task = service.connect("driver"), service.connect("task")
        await service.create_stream(driver, "s/a", 1)
        part = await service.begin_txn(task, -1, -1, 10_000)
        await append(service, task, batch(1, b"task"), part)
        await append(service, driver, batch(1, b"driver"), part)  # any holder of the id
        pid, epoch, _ = await service.init_producer(driver, "job")
        owned = await service.begin_txn(driver, pid, epoch, 10_000)
        assert (await service.end_txn(driver, owned, True, merge=[part])).committed
        assert await values(service, task) == [b"task", b"driver"]

    run(tmp_path, body)


def test_a_caller_owns_a_bounded_number_of_producer_ids(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("slipstream.broker._service.MAX_PRODUCERS_PER_CALLER", 2)

    async def body(service: Service) -> None:
        caller = service.connect("many producers")
        await service.create_stream(caller, "s/a", 1)
        grants = [await service.init_producer(caller) for _ in range(3)]
        assert list(caller.producers) == [g[0] for g in grants[1:]]
        oldest = grants[0]
        with pytest.raises(NotOwner):
            await append(service, caller, batch(1, producer_id=oldest[0], producer_epoch=0))
        service.claim_producer(caller, *oldest)  # its token brings it back
        assert await append(service, caller, batch(1, producer_id=oldest[0], producer_epoch=0)) == 0

    run(tmp_path, body)

"""The work-queue dispatcher through the service layer, in-process (no sockets in the calls).

What is checked: concurrent settles share catalog writes (group commit: 200 single-event acks
from four members are not 200 SQLite transactions), and the state a restart finds (settled
events stay settled, delivery counts carry on towards ``max_deliveries``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from raw import batch

from slipstream.broker import Broker, BrokerConfig, ContainerConfig
from slipstream.broker._service import Service


@asynccontextmanager
async def running(data_dir: Path) -> AsyncIterator[Service]:
    broker = Broker(
        BrokerConfig(
            data_dir=data_dir, port=0, containers=1, container=ContainerConfig(roll_ms=600_000)
        )
    )
    ready = asyncio.Event()
    serving = asyncio.create_task(broker.serve(lambda _: ready.set()))
    waiting = asyncio.create_task(ready.wait())
    await asyncio.wait({serving, waiting}, return_when="FIRST_COMPLETED")
    if serving.done():
        waiting.cancel()
        serving.result()
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


def test_concurrent_acks_share_catalog_writes(tmp_path: Path) -> None:
    async def body(service: Service) -> None:
        caller = service.connect("test")
        await service.create_stream(caller, "q/a", 1)
        future, _ = service.append(caller, "q/a", 0, None, bytearray(batch(200)))
        await future
        await service.create_subscription(caller, "q/a", "work", "queue", "earliest")
        members = [
            service.join_group(caller, "q/a", "work", "queue", f"m{i}", 10_000)[0] for i in range(4)
        ]
        held: list[tuple[int, list[int]]] = []
        for member in members:
            deliveries, batches = await service.fetch_events(caller, member, 50, 0)
            assert len(deliveries) == 50 and batches
            held.extend((member, [s, o]) for s, o, _ in deliveries)
        assert len({tuple(d) for _, d in held}) == 200

        meta = service.controller.meta
        writes = 0
        store = meta.commit_positions

        def counted(*args: Any) -> None:  # the real write, counted
            nonlocal writes
            writes += 1
            store(*args)

        meta.commit_positions = counted  # type: ignore[method-assign]
        unknown = await asyncio.gather(
            *(service.settle_events(caller, m, [d], [], 0) for m, d in held)
        )
        assert all(u == [] for u in unknown)
        assert 1 <= writes <= 5, f"{writes} catalog writes for 200 acks"
        info = await service.describe_subscription(caller, "q/a", "work")
        assert info.segments[0].position == 200
        assert info.segments[0].in_flight == 0
        # a second ack of each: unknown, and nothing written
        before = writes
        again = await service.settle_events(caller, members[0], [held[0][1]], [], 0)
        assert again == [held[0][1]] and writes == before

    run(tmp_path / "data", body)


def test_a_restart_keeps_settled_events_and_delivery_counts(tmp_path: Path) -> None:
    async def first(service: Service) -> None:
        caller = service.connect("test")
        await service.create_stream(caller, "q/a", 1)
        future, _ = service.append(caller, "q/a", 0, None, bytearray(batch(3)))
        await future
        await service.create_subscription(
            caller, "q/a", "work", "queue", "earliest", options={"max_deliveries": 3}
        )
        member = service.join_group(caller, "q/a", "work", "queue", "m", 10_000)[0]
        deliveries, _ = await service.fetch_events(caller, member, 10, 0)
        assert sorted(deliveries) == [[0, 0, 1], [0, 1, 1], [0, 2, 1]]
        assert await service.settle_events(caller, member, [[0, 0]], [[0, 1], [0, 2]], 0) == []
        deliveries, _ = await service.fetch_events(caller, member, 10, 0)
        assert sorted(deliveries) == [[0, 1, 2], [0, 2, 2]]
        assert await service.settle_events(caller, member, [], [[0, 1], [0, 2]], 0) == []

    async def second(service: Service) -> None:
        caller = service.connect("test")
        member = service.join_group(caller, "q/a", "work", "queue", "m", 10_000)[0]
        deliveries, _ = await service.fetch_events(caller, member, 10, 0)
        assert sorted(deliveries) == [[0, 1, 3], [0, 2, 3]]  # 0 stays acked; counts go on
        assert await service.settle_events(caller, member, [], [[0, 1]], 0) == []
        for _ in range(200):  # the third failure: dead-lettered (by the broker's timer task)
            info = await service.describe_subscription(caller, "q/a", "work")
            if info.segments[0].dead_lettered:
                break
            await asyncio.sleep(0.02)
        assert info.segments[0].dead_lettered == 1
        dead = service.segment(caller, "q/a.dlq", 0)
        assert dead.next_offset == 1

    run(tmp_path / "data", first)
    run(tmp_path / "data", second)

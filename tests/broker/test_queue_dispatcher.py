"""The work-queue dispatcher through the service layer, in-process (no sockets in the calls).

What is checked: concurrent settles share catalog writes (group commit: 200 single-event acks
from four members are not 200 SQLite transactions), and the state a restart finds (settled
events stay settled, delivery counts carry on towards ``max_deliveries``).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from raw import batch

from slipstream.broker import Broker, BrokerConfig, ContainerConfig
from slipstream.broker._service import Service
from slipstream.format import (
    binary_array,
    encode_body_parts,
    encode_header,
    make_record_batch,
    timestamp_array,
)
from slipstream.streams import key_hash


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

        def counted(*args: Any, **kwargs: Any) -> None:  # the real write, counted
            nonlocal writes
            writes += 1
            store(*args, **kwargs)

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


def keyed_batch(keys: list[bytes | None]) -> bytearray:
    record = make_record_batch(
        binary_array(keys), binary_array([b"v"] * len(keys)), timestamp_array([1] * len(keys))
    )
    body = encode_body_parts(record)
    head = encode_header(body, event_count=len(keys), min_timestamp=1, max_timestamp=1)
    return bytearray(b"".join([head, *(bytes(p) for p in body)]))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("mode", ["queue", "key_ordered_queue"])
def test_random_fetches_settles_and_leaves_against_a_model(
    tmp_path: Path, mode: str, seed: int
) -> None:
    """Members fetch, ack, nack and leave at random; a model of what each holds checks every
    answer: an event is held by one member at a time, with a delivery count one above the
    last; acks and nacks of what a member does not hold are unknown; in key_ordered_queue no
    two held events share a key and each key's events go out in offset order; at the end
    everything is settled."""
    rng = random.Random(seed)
    picks = [rng.choice([0, 1, 2, 3, None]) for _ in range(120)]
    # each segment's events carry four keys of its own key range (the broker refuses others)
    halves: list[list[bytes]] = [[], []]
    for candidate in (b"k%d" % i for i in range(100)):
        halves[key_hash(candidate) >> 63].append(candidate)
    keys = [[None if p is None else half[p] for p in picks] for half in halves]
    key_ordered = mode == "key_ordered_queue"

    async def body(service: Service) -> None:
        caller = service.connect("test")
        await service.create_stream(caller, "q/m", 2)
        for segment in (0, 1):
            for start in range(0, 120, 40):
                payload = keyed_batch(keys[segment][start : start + 40])
                future, _ = service.append(caller, "q/m", segment, None, payload)
                await future
        await service.create_subscription(
            caller, "q/m", "work", mode, "earliest", options={"max_deliveries": 1000}
        )
        members: dict[int, set[tuple[int, int]]] = {}  # member -> what it holds
        counts: dict[tuple[int, int], int] = {}
        settled: set[tuple[int, int]] = set()

        def key(event: tuple[int, int]) -> bytes | None:
            return keys[event[0]][event[1]]

        def join() -> None:
            member = service.join_group(caller, "q/m", "work", mode, "m", 60_000)[0]
            members[member] = set()

        for _ in range(3):
            join()
        for _ in range(400):
            action = rng.random()
            member = rng.choice(list(members))
            held = members[member]
            if action < 0.4:
                deliveries, _ = await service.fetch_events(caller, member, rng.randint(1, 8), 0)
                for segment, offset, count in deliveries:
                    event = (segment, offset)
                    assert event not in settled
                    assert all(event not in h for h in members.values()), "held twice"
                    assert count == counts.get(event, 0) + 1
                    counts[event] = count
                    if key_ordered and key(event) is not None:
                        busy = {(e[0], key(e)) for h in members.values() for e in h}
                        assert (segment, key(event)) not in busy, f"two of {key(event)!r}"
                        earlier = [
                            o
                            for o in range(offset)
                            if (segment, o) not in settled and keys[segment][o] == key(event)
                        ]
                        assert not earlier, f"{event} before {earlier[:3]} of its key"
                    held.add(event)
            elif action < 0.7 and held:
                event = rng.choice(sorted(held))
                assert await service.settle_events(caller, member, [list(event)], [], 0) == []
                held.discard(event)
                settled.add(event)
            elif action < 0.85 and held:
                event = rng.choice(sorted(held))
                assert await service.settle_events(caller, member, [], [list(event)], 0) == []
                held.discard(event)
            elif action < 0.92:
                stranger = (rng.randint(0, 1), rng.randint(0, 119))
                if stranger not in held:
                    unknown = await service.settle_events(caller, member, [list(stranger)], [], 0)
                    assert unknown == [list(stranger)]
            elif len(members) > 1:
                service.leave_group(caller, member)
                del members[member]
                join()
        for member, held in members.items():  # settle the rest
            for event in sorted(held):
                assert await service.settle_events(caller, member, [list(event)], [], 0) == []
                settled.add(event)
            held.clear()
        member = next(iter(members))
        while len(settled) < 240:
            deliveries, _ = await service.fetch_events(caller, member, 50, 0)
            assert deliveries, f"{240 - len(settled)} events never came back"
            acks = [[s, o] for s, o, _ in deliveries]
            assert await service.settle_events(caller, member, acks, [], 0) == []
            settled.update((s, o) for s, o in acks)
        info = await service.describe_subscription(caller, "q/m", "work")
        assert [s.position for s in info.segments] == [120, 120]

    run(tmp_path / "data", body)

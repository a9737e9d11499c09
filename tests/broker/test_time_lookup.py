"""Positions by time (``Controller.cut(at="time")``): the first offset whose event timestamp is
at or after the time, with holes (offsets lost to damaged storage) in the way.

A hole's events are unknown, so a time lookup steps over it: the answer is the first readable
event at or after the time. It never fails because a hole lies between it and that event.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from test_container import Node, chunks_of, closing, damaged_node, make_batch, run


def damage(root: Path, file_id: int, tag: str) -> None:
    """Flip a byte in the body of batch ``tag`` in journal file ``file_id`` (sealed)."""
    path = root / "journal" / f"{file_id:016d}.journal"
    data = bytearray(path.read_bytes())
    data[data.index(f"{tag}-value0".encode()) + 3] ^= 0x40
    path.write_bytes(bytes(data))


async def roll(node: Node) -> int:
    container = node.containers[0]
    sealed = await asyncio.get_running_loop().run_in_executor(container._io, container.journal.roll)
    assert sealed is not None
    return sealed


async def cut_at(node: Node, timestamp: int) -> int:
    return (await node.controller.cut("p/s", "time", timestamp))[0]


@pytest.mark.parametrize("moved", [False, True], ids=["journal", "chunks"])
def test_a_time_lookup_steps_over_a_hole_in_the_middle(tmp_path: Path, moved: bool) -> None:
    # Batches at times 1000, 2000 and 3000 (3 events each, 1 ms apart); the middle one is
    # lost to a damaged journal file.
    async def write(node: Node) -> None:
        await node.controller.create_stream("p/s", 1, None, None)
        node.start()
        for i, tag in enumerate(["a", "b", "c"]):
            assert await node.append("p/s", 0, make_batch(3, tag, ts=1000 * (i + 1))) == 3 * i
        assert await roll(node) == 0

    run(closing(damaged_node(tmp_path), write))
    damage(tmp_path, 0, "b")

    async def check(node: Node) -> None:
        if moved:
            await node.containers[0]._move_file(0)
            assert node.segment("p/s").last_chunk and not node.segment("p/s").journal
        assert await cut_at(node, 0) == 0
        assert await cut_at(node, 1001) == 1
        assert await cut_at(node, 1003) == 6, "in the hole's time: the next readable event"
        assert await cut_at(node, 2000) == 6
        assert await cut_at(node, 2500) == 6
        assert await cut_at(node, 3002) == 8
        assert await cut_at(node, 3003) == 9, "past every event: the end"

    run(closing(damaged_node(tmp_path), check))


def test_a_time_lookup_steps_over_a_chunk_that_is_only_a_hole(tmp_path: Path) -> None:
    # File 0 holds batch a (time 1000), file 1 batch b (time 2000, then damaged: the last
    # batch of its segment, so its hole is all its chunk holds). Batch c (time 3000) comes
    # after the restart. Once every file is a chunk, a lookup must find c past the empty one.
    async def write(node: Node) -> None:
        await node.controller.create_stream("p/s", 1, None, None)
        node.start()
        assert await node.append("p/s", 0, make_batch(3, "a", ts=1000)) == 0
        assert await roll(node) == 0
        assert await node.append("p/s", 0, make_batch(3, "b", ts=2000)) == 3
        assert await roll(node) == 1

    run(closing(damaged_node(tmp_path), write))
    damage(tmp_path, 1, "b")

    async def check(node: Node) -> None:
        segment = node.segment("p/s")
        assert segment.next_offset == 6, "the damaged batch's offsets stay taken"
        node.start()
        assert await node.append("p/s", 0, make_batch(3, "c", ts=3000)) == 6
        container = node.containers[0]
        container._rolled(await roll(node))  # the container's mover takes every file
        while segment.chunk_count < 3 or container.journal.sealed_files():
            await asyncio.sleep(0.001)
        assert [len(c.index) // 24 for c in chunks_of(node.meta, segment)] == [1, 0, 1]
        assert await cut_at(node, 1001) == 1
        assert await cut_at(node, 1500) == 6
        assert await cut_at(node, 3001) == 7
        assert await cut_at(node, 9999) == 9

    run(closing(damaged_node(tmp_path), check))

"""Memory does not grow with retained history: a segment keeps only its newest chunk in
memory, reads of older chunks look them up in the catalog through a bounded cache, recovery
loads no chunk list, and retention reads the history a page at a time.

The catalog here refuses ``chunks()`` (the whole history): any path that still loads it fails.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_container import Node, closing, make_batch, run, values_of

from slipstream.broker import _controller
from slipstream.broker._container import ContainerConfig
from slipstream.storage import ChunkRecord, MemoryChunkStore, MemoryJournal, SqliteMetaStore

NOW = 1_700_000_100_000
CHUNKS = 12


class NoHistoryScan(SqliteMetaStore):
    """A catalog that fails any caller that loads every chunk record."""

    scanning_allowed = False

    def chunks(self) -> list[ChunkRecord]:
        if not self.scanning_allowed:
            raise AssertionError("the broker loaded the whole chunk history")
        return super().chunks()


def open_node(root: Path, store: MemoryChunkStore, cache_bytes: int) -> Node:
    config = ContainerConfig(roll_ms=600_000, chunk_cache_bytes=cache_bytes)
    return Node([MemoryJournal()], NoHistoryScan(root / "meta.db"), store, config)


async def fill(node: Node) -> list[bytearray]:
    """``CHUNKS`` chunks of one batch each, a minute of event time apart."""
    await node.controller.create_stream("h/s", 1, None, None)
    node.start()
    batches = []
    for i in range(CHUNKS):
        batch = make_batch(2, f"c{i}", ts=NOW + i * 60_000)
        await node.append("h/s", 0, batch)
        await node.roll_and_move(node.containers[0])
        batches.append(batch)
    return batches


def test_reads_time_lookups_and_a_restart_use_a_bounded_chunk_cache(tmp_path: Path) -> None:
    store = MemoryChunkStore()
    one_index = 3 * 8 + 512  # Chunk.size of a one-batch chunk
    made: list[bytearray] = []

    async def body(node: Node) -> None:
        made.extend(await fill(node))
        await check(node)

    async def check(node: Node) -> None:
        segment = node.segment("h/s")
        cache = node.containers[0].chunk_cache
        assert segment.chunk_count == CHUNKS
        assert segment.last_chunk is not None and segment.last_chunk.record.base_offset == 22
        for _ in range(2):  # every chunk, twice: the cache holds 3, the rest come again
            for i in reversed(range(CHUNKS)):
                (got,) = await node.container_of(segment).read(segment, 2 * i + 1, 1 << 20)
                assert values_of(got) == values_of(made[i])
                assert len(cache) <= 3
        assert cache.misses >= 2 * (CHUNKS - 1) - 3
        for i in range(CHUNKS):
            offset = (await node.controller.cut("h/s", "time", NOW + i * 60_000 + 1))[0]
            assert offset == 2 * i + 1

    async def after_restart(node: Node) -> None:
        node.start()
        assert node.segment("h/s").next_offset == 2 * CHUNKS
        await check(node)

    run(closing(open_node(tmp_path, store, 3 * one_index), body))
    run(closing(open_node(tmp_path, store, 3 * one_index), after_restart))


@pytest.mark.parametrize(("page", "batch"), [(2, 3), (512, 10_000)])
def test_retention_reads_the_history_a_page_at_a_time(
    tmp_path: Path, page: int, batch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (2, 3): pages of 2 chunks, and at most 3 chunks removed a step (the pass repeats)
    monkeypatch.setattr(_controller._ChunkFront, "PAGE", page)
    monkeypatch.setattr(_controller, "RETENTION_BATCH", batch)
    store = MemoryChunkStore()

    async def body(node: Node) -> None:
        made = await fill(node)
        stream = node.controller.stream("h/s")
        stream.retention_ms = 4 * 60_000  # chunks 0..6 end before the horizon, 7.. after
        newest = NOW + (CHUNKS - 1) * 60_000
        assert await node.controller.enforce_retention(newest) == 7
        segment = node.segment("h/s")
        assert segment.start_offset == 14 and segment.chunk_count == CHUNKS - 7
        assert segment.first_timestamp == NOW + 7 * 60_000
        # then size: keep what fits of the rest, oldest out first
        stream.retention_ms = None
        stream.retention_bytes = segment.bytes - 1
        assert await node.controller.enforce_retention(newest) == 1
        assert segment.start_offset == 16
        kept = [values_of(b) for b in await node.read_all("h/s", 0, 16)]
        assert kept == [values_of(b) for b in made[8:]]
        node.meta.scanning_allowed = True  # type: ignore[attr-defined]
        assert [c.base_offset for c in node.meta.chunks()] == [16, 18, 20, 22]
        assert sorted(store.list_chunks()) == sorted(c.name for c in node.meta.chunks())

    run(closing(open_node(tmp_path, store, 1 << 20), body))

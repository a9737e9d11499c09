"""Retention (``Controller.enforce_retention``): exactly the chunks past a stream's limits go,
oldest first, a prefix of each segment; the start offset moves to the first kept chunk; what
is kept reads back, also after a restart.

Chunks are made one per journal file (append, roll, move), each with its own event times, and
retention runs at a chosen ``now``: no clock, no sleeping.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_container import Node, chunks_of, closing, make_batch, run, values_of

from slipstream import OffsetOutOfRange
from slipstream.format import HEADER_LENGTH, decode_header, encode_header
from slipstream.storage import LocalChunkStore, MemoryJournal, SqliteMetaStore

NOW = 1_700_000_100_000
MINUTE = 60_000


class RecordingChunkStore(LocalChunkStore):
    """A local chunk store that records the order chunks are deleted in."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory, fsync=False)
        self.deleted: list[str] = []

    def delete_chunk(self, name: str) -> None:
        self.deleted.append(name)
        super().delete_chunk(name)


def open_node(root: Path) -> tuple[Node, RecordingChunkStore]:
    store = RecordingChunkStore(root / "chunks")
    return Node([MemoryJournal()], SqliteMetaStore(root / "meta.db"), store), store


async def add_chunk(node: Node, stream: str, number: int, tag: str, newest: int) -> bytearray:
    """Append one batch of 3 events whose newest is at ``newest`` and make it a chunk."""
    batch = make_batch(3, tag, ts=newest - 2)
    await node.append(stream, number, batch)
    await node.roll_and_move(node.containers[0])
    return batch


async def read_from_start(node: Node, stream: str, number: int = 0) -> list[list[bytes]]:
    segment = node.segment(stream, number)
    return [values_of(b) for b in await node.read_all(stream, number, segment.start_offset)]


def test_time_retention_removes_exactly_the_expired_chunks_oldest_first(tmp_path: Path) -> None:
    # Five chunks whose newest events are 10, 6 and 5 minutes + 1 ms old (expired: the limit
    # is 5 minutes), then exactly 5 minutes old (kept: at the limit), then 4 minutes old; and
    # a young batch still in the journal.
    ages = [10 * MINUTE, 6 * MINUTE, 5 * MINUTE + 1, 5 * MINUTE, 4 * MINUTE]
    expired = 3

    async def body(node: Node) -> None:
        await node.controller.create_stream("r/aged", 1, 5 * MINUTE, None)
        node.start()
        batches = [
            await add_chunk(node, "r/aged", 0, f"c{i}", NOW - age) for i, age in enumerate(ages)
        ]
        young = make_batch(2, "journal", ts=NOW - 1000)
        await node.append("r/aged", 0, young)
        segment = node.segment("r/aged")
        names = [c.name for c in chunks_of(node.meta, segment)]
        bases = [c.base_offset for c in chunks_of(node.meta, segment)]

        assert await node.controller.enforce_retention(NOW) == expired
        assert store.deleted == names[:expired], "exactly the expired ones, oldest first"
        assert [c.name for c in chunks_of(node.meta, segment)] == names[expired:]
        assert segment.chunk_count == len(ages) - expired
        assert segment.start_offset == bases[expired]
        assert segment.bytes == sum(decode_header(b).batch_length for b in batches[expired:]) + (
            decode_header(young).batch_length
        )
        assert segment.first_timestamp == NOW - ages[expired] - 2
        assert await read_from_start(node, "r/aged") == [
            values_of(b) for b in [*batches[expired:], young]
        ]
        with pytest.raises(OffsetOutOfRange):
            await node.container_of(segment).read(segment, bases[expired] - 1, 1 << 20)
        assert [c.name for c in node.meta.chunks()] == names[expired:]
        assert store.list_chunks() == sorted(names[expired:])
        (record,) = node.meta.streams()
        assert record.segments[0].start_offset == bases[expired]
        # nothing else has expired: a second pass removes nothing
        assert await node.controller.enforce_retention(NOW) == 0
        assert len(store.deleted) == expired

    node, store = open_node(tmp_path)
    run(closing(node, body))

    async def after_restart(node: Node) -> None:
        segment = node.segment("r/aged")
        assert segment.start_offset == 3 * expired
        assert len(chunks_of(node.meta, segment)) == segment.chunk_count == len(ages) - expired
        assert len(await read_from_start(node, "r/aged")) == len(ages) - expired

    node, store = open_node(tmp_path)
    run(closing(node, after_restart))


def test_time_retention_cuts_only_a_prefix(tmp_path: Path) -> None:
    # Event times need not grow with offsets: an old chunk behind a young one stays (a
    # segment only ever loses a prefix, or readers would meet a gap).
    async def body(node: Node) -> None:
        await node.controller.create_stream("r/mixed", 1, MINUTE, None)
        node.start()
        old = await add_chunk(node, "r/mixed", 0, "old", NOW - 10 * MINUTE)
        young = await add_chunk(node, "r/mixed", 0, "young", NOW)
        older = await add_chunk(node, "r/mixed", 0, "older", NOW - 20 * MINUTE)
        assert await node.controller.enforce_retention(NOW) == 1
        assert node.segment("r/mixed").start_offset == 3
        assert await read_from_start(node, "r/mixed") == [values_of(young), values_of(older)]
        assert values_of(old) not in await read_from_start(node, "r/mixed")

    node, _ = open_node(tmp_path)
    run(closing(node, body))


def test_size_retention_keeps_as_much_as_fits_taking_the_oldest_first(tmp_path: Path) -> None:
    # Two segments, chunks interleaved in time. Size retention removes the oldest chunk of
    # the stream (whichever segment holds it) while the total is over the limit, and not one
    # more: what remains fits, and the last removed chunk would not have.
    async def body(node: Node) -> None:
        await node.controller.create_stream("r/sized", 2, None, 1)  # the limit is set below
        node.start()
        plan = [(0, 9), (1, 8), (0, 7), (1, 6), (0, 5), (1, 4), (0, 3)]  # (segment, age)
        made = [
            (number, await add_chunk(node, "r/sized", number, f"s{i}", NOW - age * MINUTE))
            for i, (number, age) in enumerate(plan)
        ]
        sizes = [decode_header(b).batch_length for _, b in made]
        stream = node.controller.stream("r/sized")
        stream.retention_bytes = sum(sizes[3:]) + sizes[2] // 2  # the 3 oldest must go
        assert await node.controller.enforce_retention(NOW) == 3
        kept = sum(s.bytes for s in stream.segments.values())
        assert kept <= stream.retention_bytes, "upper bound"
        assert kept + sizes[2] > stream.retention_bytes, "lower bound: no chunk too many"
        assert kept == sum(sizes[3:])
        for number in (0, 1):
            assert await read_from_start(node, "r/sized", number) == [
                values_of(b) for i, (n, b) in enumerate(made) if n == number and i >= 3
            ]
        assert node.segment("r/sized", 0).start_offset == 6
        assert node.segment("r/sized", 1).start_offset == 3

    node, _ = open_node(tmp_path)
    run(closing(node, body))


def idempotent_batch(tag: str, producer_id: int, sequence: int, ts: int) -> bytearray:
    """One batch of 3 events of an idempotent producer (epoch 0) starting at ``sequence``."""
    plain = make_batch(3, tag, ts=ts)
    header, body = decode_header(plain), bytes(plain[HEADER_LENGTH:])
    return bytearray(
        encode_header(
            body,
            event_count=3,
            min_timestamp=header.min_timestamp,
            max_timestamp=header.max_timestamp,
            flags=header.flags,
            producer_id=producer_id,
            producer_epoch=0,
            sequence=sequence,
        )
        + body
    )


@pytest.mark.parametrize("later_chunk", [False, True], ids=["restart", "next-chunk-then-restart"])
def test_retention_of_every_chunk_keeps_the_segments_producer_state(
    tmp_path: Path, later_chunk: bool
) -> None:
    # A producer's batch becomes a chunk, and time retention removes that chunk (every chunk
    # of the segment). Its retry, after a restart, and after the mover made another chunk
    # from another producer's batch, is still recognised: answered with the original
    # offset, never stored a second time.
    first = idempotent_batch("p7", producer_id=7, sequence=0, ts=NOW - 10 * MINUTE)

    async def body(node: Node) -> None:
        await node.controller.create_stream("r/dedup", 1, 5 * MINUTE, None)
        node.start()
        assert await node.append("r/dedup", 0, bytearray(first)) == 0
        await node.roll_and_move(node.containers[0])
        assert await node.controller.enforce_retention(NOW) == 1
        assert not chunks_of(node.meta, node.segment("r/dedup"))
        if later_chunk:
            other = idempotent_batch("p8", producer_id=8, sequence=0, ts=NOW)
            assert await node.append("r/dedup", 0, other) == 3
            await node.roll_and_move(node.containers[0])

    node, _ = open_node(tmp_path)
    run(closing(node, body))

    async def retry(node: Node) -> None:
        node.start()
        segment = node.segment("r/dedup")
        end = segment.next_offset
        assert await node.append("r/dedup", 0, bytearray(first)) == 0, "the original offset"
        assert segment.next_offset == end, "the retry was stored again"

    node, _ = open_node(tmp_path)
    run(closing(node, retry))

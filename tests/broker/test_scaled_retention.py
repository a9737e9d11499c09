"""Retention across epochs: a sealed segment's expired chunks go like any other segment's, its
start moves up to its end (the segment itself stays: the graph and StreamCuts name it), a cut
at "earliest" starts every epoch at what is kept, and deleting the stream removes every
epoch's chunks."""

from __future__ import annotations

from pathlib import Path

from test_container import Node, chunks_of, closing, run, values_of
from test_retention import MINUTE, NOW, add_chunk, open_node


def test_retention_and_deletion_work_across_epochs(tmp_path: Path) -> None:
    async def body(node: Node) -> None:
        await node.controller.create_stream("r/scaled", 1, 5 * MINUTE, None)
        node.start()
        await add_chunk(node, "r/scaled", 0, "old", NOW - 10 * MINUTE)
        await add_chunk(node, "r/scaled", 0, "older", NOW - 9 * MINUTE)
        await node.controller.scale("r/scaled", [0], 2, lambda _: False)
        sealed = node.segment("r/scaled", 0)
        assert sealed.sealed and sealed.next_offset == 6
        expired = await add_chunk(node, "r/scaled", 1, "stale", NOW - 8 * MINUTE)
        kept = await add_chunk(node, "r/scaled", 1, "fresh", NOW - MINUTE)
        await add_chunk(node, "r/scaled", 2, "fresh2", NOW - MINUTE)
        assert expired and await node.controller.enforce_retention(NOW) == 3
        assert chunks_of(node.meta, sealed) == [] and sealed.start_offset == sealed.next_offset
        assert node.segment("r/scaled", 1).start_offset == 3
        assert await node.controller.cut("r/scaled", "earliest", None) == {0: 6, 1: 3, 2: 0}
        successor = node.segment("r/scaled", 1)
        batches = await node.read_all("r/scaled", 1, successor.start_offset)
        assert [values_of(b) for b in batches] == [values_of(kept)]
        (record,) = node.meta.streams()
        assert [(s.number, s.sealed, s.end_offset) for s in record.segments] == [
            (0, True, 6),
            (1, False, -1),
            (2, False, -1),
        ]
        await node.controller.delete_stream("r/scaled")
        assert node.meta.chunks() == [] and store.list_chunks() == []
        assert node.meta.scalings() == []

    node, store = open_node(tmp_path)
    run(closing(node, body))

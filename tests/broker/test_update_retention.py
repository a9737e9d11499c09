"""Changing a stream's retention (``Controller.update_retention``): the change is in the
catalog before the call returns, the next retention pass uses it, a restart keeps it; 0
removes a limit, None leaves it; bad limits and unknown streams are refused and change
nothing.

Chunks are made one per journal file, each with its own event times, and retention runs at a
chosen ``now``: no clock, no sleeping.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_container import Node, closing, run
from test_retention import MINUTE, NOW, add_chunk, open_node

from slipstream import InvalidArgument, InvalidName, StreamNotFound

KIB = 1024


def test_shrinking_retention_applies_at_the_next_pass_and_outlives_a_restart(
    tmp_path: Path,
) -> None:
    # Three chunks of 3 events whose newest are 10, 6 and 4 minutes old, in a stream created
    # to keep everything; then the limit becomes 5 minutes.
    ages = [10 * MINUTE, 6 * MINUTE, 4 * MINUTE]

    async def body(node: Node) -> None:
        await node.controller.create_stream("u/orders", 1, None, None)
        node.start()
        for i, age in enumerate(ages):
            await add_chunk(node, "u/orders", 0, f"c{i}", NOW - age)
        assert await node.controller.enforce_retention(NOW) == 0, "kept forever so far"

        stream = await node.controller.update_retention("u/orders", 5 * MINUTE, None)
        assert (stream.retention_ms, stream.retention_bytes) == (5 * MINUTE, None)
        assert stream.info().retention_ms == 5 * MINUTE
        (record,) = node.meta.streams()
        assert (record.retention_ms, record.retention_bytes) == (5 * MINUTE, None)

        assert await node.controller.enforce_retention(NOW) == 2, "the two older chunks"
        assert node.segment("u/orders").start_offset == 6
        assert len(store.deleted) == 2

    node, store = open_node(tmp_path)
    run(closing(node, body))

    async def after_restart(node: Node) -> None:
        stream = node.controller.stream("u/orders")
        assert (stream.retention_ms, stream.retention_bytes) == (5 * MINUTE, None)
        assert node.segment("u/orders").start_offset == 6
        # 0 removes the limit: nothing more goes, however late the pass runs
        stream = await node.controller.update_retention("u/orders", 0, None)
        assert (stream.retention_ms, stream.retention_bytes) == (None, None)
        assert await node.controller.enforce_retention(NOW + 365 * 24 * 60 * MINUTE) == 0

    node, _ = open_node(tmp_path)
    run(closing(node, after_restart))

    async def after_second_restart(node: Node) -> None:
        stream = node.controller.stream("u/orders")
        assert (stream.retention_ms, stream.retention_bytes) == (None, None)

    node, _ = open_node(tmp_path)
    run(closing(node, after_second_restart))


def test_a_size_limit_added_later_keeps_the_time_limit_and_applies_oldest_first(
    tmp_path: Path,
) -> None:
    async def body(node: Node) -> None:
        await node.controller.create_stream("u/sized", 1, 60 * MINUTE, None)
        node.start()
        batches = [
            await add_chunk(node, "u/sized", 0, f"c{i}", NOW - (5 - i) * MINUTE) for i in range(4)
        ]
        assert await node.controller.enforce_retention(NOW) == 0
        newest_two = sum(len(b) for b in batches[2:])
        stream = await node.controller.update_retention("u/sized", None, newest_two)
        assert (stream.retention_ms, stream.retention_bytes) == (60 * MINUTE, newest_two)
        assert await node.controller.enforce_retention(NOW) == 2
        assert node.segment("u/sized").start_offset == 6
        assert node.segment("u/sized").bytes == newest_two

    node, _ = open_node(tmp_path)
    run(closing(node, body))


@pytest.mark.parametrize(
    ("retention_ms", "retention_bytes"),
    [(-1, None), (None, -KIB), (2**63, None), (None, 2**63), (MINUTE, -1)],
)
def test_bad_limits_are_refused_and_change_nothing(
    tmp_path: Path, retention_ms: int | None, retention_bytes: int | None
) -> None:
    async def body(node: Node) -> None:
        await node.controller.create_stream("u/bad", 1, MINUTE, 4 * KIB)
        with pytest.raises(InvalidArgument, match="must be positive"):
            await node.controller.update_retention("u/bad", retention_ms, retention_bytes)
        stream = node.controller.stream("u/bad")
        assert (stream.retention_ms, stream.retention_bytes) == (MINUTE, 4 * KIB)
        (record,) = node.meta.streams()
        assert (record.retention_ms, record.retention_bytes) == (MINUTE, 4 * KIB)

    node, _ = open_node(tmp_path)
    run(closing(node, body))


def test_unknown_and_badly_named_streams_are_refused(tmp_path: Path) -> None:
    async def body(node: Node) -> None:
        with pytest.raises(StreamNotFound, match="slipstream stream create u/missing"):
            await node.controller.update_retention("u/missing", MINUTE, None)
        with pytest.raises(InvalidName):
            await node.controller.update_retention("no-scope", MINUTE, None)
        await node.controller.create_stream("u/gone", 1, None, None)
        await node.controller.delete_stream("u/gone")
        with pytest.raises(StreamNotFound):
            await node.controller.update_retention("u/gone", MINUTE, None)
        assert node.meta.streams() == []

    node, _ = open_node(tmp_path)
    run(closing(node, body))

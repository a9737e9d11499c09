"""A committed transaction whose apply meets a full disk: it is visible whole, exactly once, in
order, and its commit reply names every segment it wrote, however the failure cuts its batches.

The coordinator runs in process over the containers of ``test_container`` (file journals, a
catalog file, local chunks), so "fail this fdatasync" hits exactly one group of one container.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from test_container import Disk, Faults, Node, closing, make_batch, run, values_of

from slipstream import StorageFull
from slipstream.broker import _transactions
from slipstream.broker._transactions import Coordinator
from slipstream.format import decode_header, restamp, verify
from slipstream.protocol import TxnRange
from slipstream.storage import (
    FileJournal,
    JournalAddress,
    LocalChunkStore,
    MemoryJournal,
    SqliteMetaStore,
)

STREAM = "t/txn"


def staged_values(tag: str, count: int) -> list[bytes]:
    return [f"{tag}-value{i}".encode() * 3 for i in range(count)]


async def read_values(node: Node, number: int) -> list[bytes]:
    return [v for batch in await node.read_all(STREAM, number) for v in values_of(batch)]


@pytest.mark.parametrize("mode", ["one-group", "groups-apart", "queued-after-the-failure"])
def test_a_sync_failure_during_the_apply_loses_no_event_and_no_range(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, mode: str
) -> None:
    """one-group: the segment's two batches fail together while the other segment's batch is
    stored; the retry must still report that segment's range. Otherwise batches are not held
    in memory but read back from staging one by one, so the apply queues them with awaits in
    between and the first can fail in a group of its own, with the second queued behind it
    (groups-apart) or only once the failure is known (queued-after-the-failure); either way
    the second must not be stored past the lost first."""
    held = mode == "one-group"
    if not held:
        monkeypatch.setattr(_transactions, "_HOLD_BYTES", 0)
    disk = Disk(tmp_path / "data")
    faults = [Faults(), Faults()]
    expected: dict[int, list[bytes]] = {}

    async def commit(node: Node) -> list[TxnRange]:
        await node.controller.create_stream(STREAM, 2, None, None)
        segments = [node.segment(STREAM, n) for n in (0, 1)]
        assert {s.container for s in segments} == {0, 1}
        node.start()
        for number in (0, 1):  # something before the transaction, so offsets do not start at 0
            await node.append(STREAM, number, make_batch(2, f"plain{number}"))
        coordinator = Coordinator(tmp_path / "data", node.meta, node.controller)
        try:
            coordinator.recover()
            await coordinator.apply_pending()
            producer_id, epoch = await coordinator.init_producer("tx")
            txn_id = await coordinator.begin(producer_id, epoch, 60_000)
            # nine events: two batches in segment 0, one in segment 1 (another container)
            for tag, number in [("a1", 0), ("b1", 1), ("a2", 0)]:
                batch = make_batch(3, tag)
                await coordinator.stage(txn_id, segments[number], batch, verify(batch))
            expected[0] = [*staged_values("a1", 3), *staged_values("a2", 3)]
            expected[1] = staged_values("b1", 3)
            # the first group of segment 0's container fails its fdatasync (groups-apart: a1
            # alone, failing only once a2 waits in the queue behind it)
            segment_0 = node.containers[segments[0].container]
            faults[segments[0].container].block_next("sync")
            faults[segments[0].container].fail_next("sync")
            read, reads, third_read = coordinator.staging.read, [0], threading.Event()

            def read_third_late(address: JournalAddress) -> bytes:  # a2's, on the txn-io thread
                reads[0] += 1
                if reads[0] == 3 and mode == "queued-after-the-failure":
                    third_read.wait(5)
                return read(address)

            monkeypatch.setattr(coordinator.staging, "read", read_third_late)
            ending = asyncio.ensure_future(coordinator.end(txn_id, True, b"meta"))
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, faults[segments[0].container].entered.wait, 5)
            while mode == "groups-apart" and not segment_0._queue:
                await asyncio.sleep(0.001)
            faults[segments[0].container].release()
            while not any("appends failed" in r.getMessage() for r in caplog.records):
                await asyncio.sleep(0.001)
            third_read.set()
            ended = await ending
            assert ended.committed
            for number in (0, 1):
                got = await read_values(node, number)
                assert got == staged_values(f"plain{number}", 2) + expected[number]
            return ended.ranges
        finally:
            await coordinator.close()

    def open_with_faults() -> Node:
        journals = [
            FileJournal(disk.root / "journal" / str(cid), fault=faults[cid])
            for cid in range(disk.containers)
        ]
        meta = SqliteMetaStore(disk.root / "meta.db")
        return Node(journals, meta, LocalChunkStore(disk.root / "chunks"))

    ranges = run(closing(open_with_faults(), commit))
    # the reply names each segment's range: after the two plain events, 6 and 3 events
    assert sorted((r.stream, r.segment, r.start, r.end) for r in ranges) == [
        (STREAM, 0, 2, 8),
        (STREAM, 1, 2, 5),
    ]

    async def after_restart(node: Node) -> None:
        node.start()
        coordinator = Coordinator(tmp_path / "data", node.meta, node.controller)
        try:
            coordinator.recover()
            await coordinator.apply_pending()
            for number in (0, 1):
                stored = await node.read_all(STREAM, number)
                got = [v for batch in stored for v in values_of(batch)]
                assert got == staged_values(f"plain{number}", 2) + expected[number]
                offsets = [decode_header(b).base_offset for b in stored]
                assert offsets == sorted(set(offsets))
        finally:
            await coordinator.close()

    run(closing(disk.open(), after_restart))


def test_a_failed_group_fails_its_producers_batches_queued_behind_it(tmp_path: Path) -> None:
    """The container's side of the contract the apply relies on: once a producer's batch fails
    to be stored, its batches to that segment queued behind it fail too (they would land past
    a gap); other producers' batches, and other segments', are stored."""
    faults = Faults()
    node = Node(
        [MemoryJournal(fault=faults)], SqliteMetaStore(":memory:"), LocalChunkStore(tmp_path)
    )

    def idempotent(count: int, tag: str, producer_id: int, sequence: int) -> bytearray:
        batch = make_batch(count, tag)
        restamp(batch, flags=0, producer_id=producer_id, producer_epoch=0, sequence=sequence)
        return batch

    async def body(node: Node) -> None:
        await node.controller.create_stream(STREAM, 2, None, None)
        node.start()
        faults.block_next("sync")
        faults.fail_next("sync")
        first = node.append(STREAM, 0, idempotent(2, "first", 7, 0))
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, faults.entered.wait, 5)
        behind = node.append(STREAM, 0, idempotent(3, "behind", 7, 2))
        other_producer = node.append(STREAM, 0, idempotent(1, "other", 8, 0))
        other_segment = node.append(STREAM, 1, idempotent(1, "elsewhere", 7, 0))
        plain = node.append(STREAM, 0, make_batch(1, "plain"))
        faults.release()
        for future in (first, behind):
            with pytest.raises(StorageFull):
                await future
        assert await other_producer == 0
        assert await plain == 1
        assert await other_segment == 0
        # the producer starts again where its lost batches began, gap-free
        assert await node.append(STREAM, 0, idempotent(2, "first", 7, 0)) == 2
        assert await node.append(STREAM, 0, idempotent(3, "behind", 7, 2)) == 4
        stored = [v for batch in await node.read_all(STREAM, 0) for v in values_of(batch)]
        assert stored == [
            *staged_values("other", 1),
            *staged_values("plain", 1),
            *staged_values("first", 2),
            *staged_values("behind", 3),
        ]

    run(closing(node, body))

"""Races between the event loop and the broker's worker threads, reproduced deterministically.

Each test holds a worker thread (or the loop itself) at a chosen point through the same
interfaces the broker uses (an executor job that waits on a ``threading.Event``, a storage
wrapper that blocks one call), makes the other side act, then lets go: the interleaving that
once broke something happens every run, never by sleeping and hoping.

The bodies run with asyncio's debug mode on: a worker thread that touches a loop object
(``Event.set``, ``Future.set_result``) then fails with "Non-thread-safe operation" instead of
passing silently.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest
from test_container import FAST, Node, chunks_of, make_batch, values_of

from slipstream import StreamNotFound
from slipstream.broker import _transactions
from slipstream.broker._container import ContainerConfig
from slipstream.broker._transactions import Coordinator
from slipstream.format import verify
from slipstream.storage import (
    ChunkRecord,
    MemoryChunkStore,
    MemoryJournal,
    SqliteMetaStore,
    StreamRecord,
)
from slipstream.storage._journal import Buffer

T = TypeVar("T")


def run_checked(coro: Coroutine[Any, Any, T]) -> T:
    """Run a test body on a fresh loop in debug mode (cross-thread loop use raises), failing
    (not hanging) after 10 s. The loop runs in a thread of its own, so that a body stuck for
    good (a task waiting for a wake-up that a worker thread lost) fails the test as well."""
    outcome: list[Any] = []

    def target() -> None:
        try:
            outcome.append(asyncio.run(asyncio.wait_for(coro, 10), debug=True))
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=target, name="test-loop", daemon=True)
    thread.start()
    thread.join(30)
    if not outcome:
        pytest.fail("the test body hung: a task waits for a wake-up that never came")
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]  # type: ignore[no-any-return]


def hold(executor_submit: Any) -> threading.Event:
    """Occupy a single-thread executor until the returned event is set: jobs submitted after
    this one queue up behind it, in order."""
    gate = threading.Event()
    executor_submit(gate.wait, 10)
    return gate


def memory_node(containers: int = 1, config: ContainerConfig = FAST) -> Node:
    journals = [MemoryJournal() for _ in range(containers)]
    return Node(journals, SqliteMetaStore(":memory:"), MemoryChunkStore(), config)


# --- transaction staging -------------------------------------------------------------------------


def test_a_staging_file_rolled_under_a_write_outlives_the_cleanup_queued_behind_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A staged write rolls the staging file it wrote to. Another transaction's end queues a
    # cleanup of sealed, unused staging files right behind that write on the txn-io thread.
    # The cleanup must see the writer as a user of the file: if it deleted it, the commit
    # could not read the batch back (and a crash mid-commit would lose it on restart).
    monkeypatch.setattr(_transactions, "_HOLD_BYTES", 0)  # applying reads the batches back
    node = memory_node()

    async def body() -> None:
        coordinator = Coordinator(tmp_path, node.meta, node.controller, fsync=False)
        coordinator.recover()
        await node.controller.create_stream("t/txn", 1, None, None)
        node.start()
        try:
            await coordinator.apply_pending()
            segment = node.segment("t/txn")
            producer_id, epoch = await coordinator.init_producer("writer")
            owner = await coordinator.begin(producer_id, epoch, 60_000)
            other = await coordinator.begin(-1, -1, 60_000)
            other_batch = make_batch(1, "other")
            await coordinator.stage(other, segment, other_batch, verify(other_batch))

            monkeypatch.setattr(_transactions, "_STAGING_ROLL_BYTES", 1)  # the next write rolls
            gate = hold(coordinator._io.submit)
            batch = make_batch(2, "owner")
            staged = coordinator.stage(owner, segment, batch, verify(batch))
            await coordinator.end(other, False, b"")  # frees the file: a cleanup is queued
            gate.set()
            # The loop stands still while the txn-io thread writes, rolls and cleans up, so
            # nothing the loop does after the write can come before the cleanup.
            coordinator._io.submit(lambda: None).result(10)
            await staged
            ended = await coordinator.end(owner, True, b"")
            assert ended.committed
            assert [values_of(b) for b in await node.read_all("t/txn")] == [values_of(batch)]
        finally:
            await coordinator.close()
            await node.close()

    run_checked(body())


# --- the journal thread and the loop's objects ---------------------------------------------------


def test_a_group_that_rolls_the_journal_wakes_the_mover_through_the_loop() -> None:
    # The group's write seals the journal file on the journal thread; the mover, waiting on
    # the loop, must learn of it through the loop (debug mode raises on a cross-thread wake).
    node = memory_node(config=ContainerConfig(roll_ms=600_000, roll_bytes=1))

    async def body() -> None:
        await node.controller.create_stream("t/roll", 1, None, None)
        node.start()
        try:
            container = node.containers[0]
            while not container._sealed._waiters:  # type: ignore[attr-defined]
                await asyncio.sleep(0)  # until the mover waits for a sealed file
            batch = make_batch(3, "rolled")
            assert await node.append("t/roll", 0, batch) == 0
            segment = node.segment("t/roll")
            while segment.last_chunk is None:  # moved by the container's own mover
                await asyncio.sleep(0.001)
            assert [values_of(b) for b in await node.read_all("t/roll")] == [values_of(batch)]
        finally:
            await node.close()

    run_checked(body())


# --- the mover and the loop ------------------------------------------------------------------


class GatedChunkStore(MemoryChunkStore):
    """A chunk store whose first chunk write waits (in the mover's thread) until released."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.released = threading.Event()
        self._gated = True

    def write_chunk(self, name: str, buffers: Sequence[Buffer]) -> None:
        if self._gated:
            self._gated = False
            self.entered.set()
            self.released.wait(10)
        super().write_chunk(name, buffers)


async def wait_for_thread_count(catalog: Any, count: int) -> None:
    """Wait on the loop until ``catalog.held`` (counted by worker threads) reaches ``count``."""
    while catalog.held < count:
        await asyncio.sleep(0.001)


async def wait_for_thread(event: threading.Event) -> None:
    """Wait on the loop for another thread to set ``event``."""
    while not event.is_set():
        await asyncio.sleep(0.001)


def test_a_stream_deleted_while_the_mover_writes_its_file_leaves_the_container_running() -> None:
    # Two streams share a journal file. The mover writes the first one's chunk; meanwhile the
    # second stream is deleted. The move completes without the deleted stream (no KeyError
    # stopping the container), the first stream reads back from its chunk, and no chunk of
    # the deleted stream is left behind.
    store = GatedChunkStore()
    node = Node([MemoryJournal()], SqliteMetaStore(":memory:"), store)

    async def body() -> None:
        await node.controller.create_stream("t/kept", 1, None, None)
        await node.controller.create_stream("t/gone", 1, None, None)
        node.start()
        try:
            kept = make_batch(2, "kept")
            await node.append("t/kept", 0, kept)
            await node.append("t/gone", 0, make_batch(3, "gone"))
            container = node.containers[0]
            move = asyncio.create_task(node.roll_and_move(container))
            await wait_for_thread(store.entered)
            await node.controller.delete_stream("t/gone")
            store.released.set()
            await move
            segment = node.segment("t/kept")
            assert [c.next_offset for c in chunks_of(node.meta, segment)] == [2]
            assert segment.journal == []
            assert [values_of(b) for b in await node.read_all("t/kept")] == [values_of(kept)]
            assert [c.stream_id for c in node.meta.chunks()] == [segment.stream_id]
            assert store.list_chunks() == [chunks_of(node.meta, segment)[0].name]
            assert container.journal.sealed_files() == []
        finally:
            store.released.set()
            await node.close()

    run_checked(body())


# --- the controller: deleting and creating the same name -----------------------------------------


class GatedMetaStore(SqliteMetaStore):
    """A catalog that, once ``gated``, holds its deletions in the calling worker thread: the
    first one after it is stored, every later one before it starts, until ``released``."""

    def __init__(self) -> None:
        super().__init__(":memory:")
        self.gated = False
        self.deletes = 0
        self.deleted = threading.Event()
        self.released = threading.Event()
        self._count = threading.Lock()

    def delete_stream(self, *args: Any) -> tuple[StreamRecord, list[ChunkRecord]]:
        with self._count:
            self.deletes += 1
            first = self.deletes == 1
        if self.gated and not first:
            self.released.wait(10)
        result = super().delete_stream(*args)
        if self.gated and first:
            self.deleted.set()
            self.released.wait(10)
        return result


def gated_node() -> tuple[Node, GatedMetaStore]:
    meta = GatedMetaStore()
    return Node([MemoryJournal()], meta, MemoryChunkStore()), meta


def test_a_delete_meant_for_an_old_stream_never_deletes_its_successor() -> None:
    # A delete of "t/again" is held in the catalog; the name is created again, and a second
    # delete of the old stream (it is still in the controller's map) queues behind that create
    # on the catalog thread. The second delete finds the name taken by the new stream: it must
    # fail, not delete the new stream, which stays served and stored.
    node, meta = gated_node()

    async def body() -> None:
        await node.controller.create_stream("t/again", 1, None, None)
        node.start()
        try:
            old = node.controller.stream("t/again")
            meta.gated = True
            first = asyncio.create_task(node.controller.delete_stream("t/again"))
            await wait_for_thread(meta.deleted)
            # both start in this order on the loop's next turn, so the catalog thread runs
            # the create before the second delete
            creating = asyncio.create_task(node.controller.create_stream("t/again", 2, None, None))
            second = asyncio.create_task(node.controller.delete_stream("t/again"))
            await asyncio.sleep(0)
            meta.released.set()
            results = await asyncio.gather(first, creating, second, return_exceptions=True)
            assert results[0] is None
            new = results[1]
            assert isinstance(results[2], StreamNotFound), results[2]
            assert old.segments[0].deleted
            assert node.controller.stream("t/again") is new
            assert [s.name for s in node.controller.list_streams(None)] == ["t/again"]
            assert await node.append("t/again", 1, make_batch(2, "new")) == 0
            assert [r.id for r in meta.streams()] == [new.id]
        finally:
            meta.released.set()
            await node.close()

    run_checked(body())


# --- catalog writes off the loop and off the readers' threads ------------------------------------


class HeldCatalog(SqliteMetaStore):
    """A catalog whose ``create_stream`` and ``delete_stream`` calls wait in their worker
    thread until released. ``held`` counts the calls waiting; ``timed_out`` records a call
    that was never released (what a blocked event loop looks like from here)."""

    def __init__(self) -> None:
        super().__init__(":memory:")
        self.holding = False
        self.held = 0
        self.timed_out = False
        self.released = threading.Event()
        self._count = threading.Lock()

    def _hold(self) -> None:
        if not self.holding:
            return
        with self._count:
            self.held += 1
        if not self.released.wait(5):  # within the test body's 10 s
            self.timed_out = True

    def create_stream(self, *args: Any) -> StreamRecord:
        self._hold()
        return super().create_stream(*args)

    def delete_stream(self, *args: Any) -> tuple[StreamRecord, list[ChunkRecord]]:
        self._hold()
        return super().delete_stream(*args)


async def create(node: Node, name: str, segments: int = 1) -> Any:
    created = await node.controller.create_stream(name, segments, None, None)
    return await created if asyncio.iscoroutine(created) else created


def test_creating_a_stream_does_not_block_the_loop() -> None:
    # The catalog write of a CreateStream is held; meanwhile the loop goes on serving (here:
    # an append to another stream is acknowledged), and the stream exists once it is stored.
    meta = HeldCatalog()
    node = Node([MemoryJournal()], meta, MemoryChunkStore())

    async def body() -> None:
        await create(node, "t/busy")
        node.start()
        try:
            meta.holding = True
            creating = asyncio.create_task(create(node, "t/new", 2))
            await wait_for_thread_count(meta, 1)
            assert await node.append("t/busy", 0, make_batch(1, "meanwhile")) == 0
            meta.released.set()
            new = await creating
            assert node.controller.stream("t/new") is new and len(new.segments) == 2
            assert not meta.timed_out, "the catalog write blocked the loop"
        finally:
            meta.released.set()
            await node.close()

    run_checked(body())


def test_catalog_writes_leave_the_readers_threads_free() -> None:
    # As many stream deletions as there are reader threads are held in the catalog; a read
    # from a chunk (a reader thread's work) still completes.
    meta = HeldCatalog()
    node = Node([MemoryJournal()], meta, MemoryChunkStore())
    readers = node.read_pool._max_workers

    async def body() -> None:
        for i in range(readers):
            await create(node, f"t/doomed{i}")
        await create(node, "t/read")
        node.start()
        try:
            batch = make_batch(2, "chunked")
            await node.append("t/read", 0, batch)
            await node.roll_and_move(node.containers[0])
            meta.holding = True
            deletes = [
                asyncio.create_task(node.controller.delete_stream(f"t/doomed{i}"))
                for i in range(readers)
            ]
            await wait_for_thread_count(meta, 1)
            assert [values_of(b) for b in await node.read_all("t/read")] == [values_of(batch)]
            assert not meta.timed_out, "the read waited for catalog writes"
            meta.released.set()
            await asyncio.gather(*deletes)
            assert [s.name for s in node.controller.list_streams(None)] == ["t/read"]
        finally:
            meta.released.set()
            await node.close()

    run_checked(body())

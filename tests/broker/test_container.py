"""The segment container: group commit, offsets, reads, the mover and recovery.

Containers run over the storage interfaces with the in-memory and file journals, an in-memory
(or local) chunk store and SQLite metadata, inside ``asyncio.run``: no broker process, no
sockets. Faults go through the journal's ``fault`` hook, so "fail the next fsync" hits exactly
one group.
"""

from __future__ import annotations

import asyncio
import errno
import os
import tempfile
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slipstream import CorruptData, OffsetOutOfRange, StorageError, StorageFull
from slipstream.broker._container import (
    JOURNAL_RESYNC,
    Container,
    ContainerConfig,
    batch_checks_out,
)
from slipstream.broker._controller import Controller
from slipstream.broker._segment import Segment
from slipstream.format import (
    binary_array,
    decode_header,
    encode_body,
    encode_header,
    make_record_batch,
    read_body,
    timestamp_array,
    verify,
)
from slipstream.storage import (
    ChunkRecord,
    FileJournal,
    Journal,
    JournalAddress,
    LocalChunkStore,
    LongTermStore,
    MemoryChunkStore,
    MemoryJournal,
    MetaStore,
    SqliteMetaStore,
)

T = TypeVar("T")
FAST = ContainerConfig(roll_ms=600_000)  # no timed roll during a test
NO_TAIL_CACHE = ContainerConfig(roll_ms=600_000, tail_cache_bytes=0)


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a test body on a fresh event loop, failing (not hanging) after 10 s."""
    return asyncio.run(asyncio.wait_for(coro, 10))


class Faults:
    """The journal's fault hook: counts calls and fails chosen ones, deterministically.

    ``fail_next("sync")`` fails the next fsync; ``block_next("sync")`` holds the next one in
    the journal's IO thread until ``release()``, so a test can act while a group is in flight.
    """

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self._fail: dict[tuple[str, int], int] = {}
        self._block: set[tuple[str, int]] = set()
        self.entered = threading.Event()
        self._release = threading.Event()

    def fail_next(self, op: str, code: int = errno.ENOSPC) -> None:
        self._fail[op, self.calls[op] + 1] = code

    def block_next(self, op: str) -> None:
        self._block.add((op, self.calls[op] + 1))

    def release(self) -> None:
        self._release.set()

    def __call__(self, op: str) -> None:
        self.calls[op] += 1
        key = (op, self.calls[op])
        if key in self._block:
            self.entered.set()
            if not self._release.wait(5):
                raise OSError(errno.ETIMEDOUT, "test never released the blocked call")
        code = self._fail.pop(key, None)
        if code is not None:
            raise OSError(code, f"injected failure of {op} #{self.calls[op]}")


async def until(condition: Callable[[], bool]) -> None:
    """Wait (on the loop) for something another thread does."""
    while not condition():
        await asyncio.sleep(0.001)


def make_batch(count: int, tag: str, ts: int = 1_700_000_000_000) -> bytearray:
    """One record batch of ``count`` events, as a producer sends it (base offset 0)."""
    keys = [f"{tag}-key{i}".encode() for i in range(count)]
    values = [f"{tag}-value{i}".encode() * 3 for i in range(count)]
    stamps = [ts + i for i in range(count)]
    body = encode_body(
        make_record_batch(binary_array(keys), binary_array(values), timestamp_array(stamps))
    )
    header = encode_header(
        body, event_count=count, min_timestamp=min(stamps), max_timestamp=max(stamps)
    )
    return bytearray(header + body.to_pybytes())


def chunks_of(meta: MetaStore, segment: Segment) -> list[ChunkRecord]:
    """A segment's chunks as the catalog has them (the segment keeps only its newest)."""
    return [
        c for c in meta.chunks() if (c.stream_id, c.segment) == (segment.stream_id, segment.number)
    ]


def values_of(batch: bytes | bytearray | memoryview) -> list[bytes]:
    return [bytes(v) for v in read_body(batch).column(1).to_pylist()]


class Node:
    """A controller with its containers: what the broker builds on open, minus the network.

    ``recover()`` runs at once (the broker does it before serving, and a FileJournal must
    recover before it appends); ``start()`` starts the containers' background work, which
    ``close()`` cancels before closing the containers.
    """

    def __init__(
        self,
        journals: Sequence[Journal],
        meta: MetaStore,
        long_term: LongTermStore,
        config: ContainerConfig = FAST,
    ) -> None:
        self.journals = list(journals)
        self.meta = meta
        self.long_term = long_term
        self.read_pool = ThreadPoolExecutor(2, thread_name_prefix="test-reader")
        self.containers = [
            Container(cid, journal, long_term, meta, self.read_pool, config)
            for cid, journal in enumerate(journals)
        ]
        self.controller = Controller(meta, long_term, self.containers, self.read_pool)
        self.recovered = self.controller.recover()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(c.run()) for c in self.containers]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        results = await asyncio.gather(*self._tasks, return_exceptions=True)
        for container in self.containers:
            await container.close()
        self.controller.close()
        self.read_pool.shutdown(wait=True)
        for result in results:
            if not isinstance(result, asyncio.CancelledError):
                raise AssertionError(f"a container's background work ended early: {result!r}")

    def segment(self, stream: str, number: int = 0) -> Segment:
        return self.controller.stream(stream).segment(number)

    def container_of(self, segment: Segment) -> Container:
        return self.containers[segment.container]

    def append(self, stream: str, number: int, batch: bytearray) -> asyncio.Future[int]:
        """Queue a batch the way a session does: verify it, hand it to its container."""
        segment = self.segment(stream, number)
        return self.container_of(segment).append(segment, batch, verify(batch))

    async def read_all(self, stream: str, number: int = 0, offset: int = 0) -> list[bytes]:
        """Every batch from ``offset`` to the durable end, as bytes."""
        segment = self.segment(stream, number)
        out: list[bytes] = []
        while True:
            batches = await self.container_of(segment).read(segment, offset, 64 * 1024)
            if not batches:
                return out
            out += [bytes(b) for b in batches]
            offset = decode_header(batches[-1]).next_offset

    async def roll_and_move(self, container: Container) -> int:
        """Seal the active journal file (on the journal's IO thread) and move it to chunks."""
        loop = asyncio.get_running_loop()
        sealed = await loop.run_in_executor(container._io, container.journal.roll)
        assert sealed is not None
        await container._move_file(sealed)
        return sealed


@dataclass
class Kit:
    """Storage for one test: builds journals of one kind and a node over them."""

    kind: str
    tmp_path: Path
    faults: Faults

    def journal(self, cid: int = 0) -> Journal:
        if self.kind == "file":
            return FileJournal(self.tmp_path / "journal" / str(cid), fsync=False, fault=self.faults)
        return MemoryJournal(fault=self.faults)

    def node(self, containers: int = 1, config: ContainerConfig = FAST) -> Node:
        journals = [self.journal(cid) for cid in range(containers)]
        return Node(journals, SqliteMetaStore(":memory:"), MemoryChunkStore(), config)


@pytest.fixture(params=["memory", "file"])
def kit(request: pytest.FixtureRequest, tmp_path: Path) -> Kit:
    return Kit(request.param, tmp_path, Faults())


async def closing(node: Node, body: Callable[[Node], Awaitable[T]]) -> T:
    try:
        return await body(node)
    finally:
        await node.close()


# --- appends: offsets and group commit -----------------------------------------------------------


def test_offsets_are_assigned_in_order_and_acks_are_contiguous(kit: Kit) -> None:
    counts = [3, 1, 5, 2, 4]

    async def body(node: Node) -> None:
        await node.controller.create_stream("t/orders", 2, None, None)
        node.start()
        acked = [
            await node.append("t/orders", 0, make_batch(n, f"a{i}")) for i, n in enumerate(counts)
        ]
        # the same again, all queued at once
        queued = [node.append("t/orders", 0, make_batch(n, f"b{i}")) for i, n in enumerate(counts)]
        acked += await asyncio.gather(*queued)
        sizes = counts + counts
        assert acked == [sum(sizes[:i]) for i in range(len(sizes))]
        segment = node.segment("t/orders", 0)
        assert segment.next_offset == segment.pending_offset == sum(sizes)
        stored = await node.read_all("t/orders", 0)
        assert [decode_header(b).base_offset for b in stored] == acked
        assert [decode_header(b).event_count for b in stored] == sizes
        # the other segment is untouched and numbers its own offsets from 0
        assert node.segment("t/orders", 1).next_offset == 0
        assert await node.append("t/orders", 1, make_batch(2, "other")) == 0

    run(closing(kit.node(), body))


def test_appends_queued_before_the_loop_runs_are_one_group(
    kit: Kit, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Counts the syscalls on journal files, not only the fault hook (which is called whether
    # or not a write or an fdatasync follows): the file journal here syncs for real.
    syscalls: Counter[str] = Counter()

    def counting(name: str, op: str) -> None:
        real = getattr(os, name)

        def call(fd: int, *args: Any) -> Any:
            if os.readlink(f"/proc/self/fd/{fd}").endswith(".journal"):
                syscalls[op] += 1
            return real(fd, *args)

        monkeypatch.setattr(os, name, call)

    for name, op in [("writev", "write"), ("pwritev", "write"), ("fdatasync", "sync")]:
        counting(name, op)
    journals: list[Journal] = [
        FileJournal(kit.tmp_path / "journal" / "0", fsync=True, fault=kit.faults)
        if kit.kind == "file"
        else MemoryJournal(fault=kit.faults)
    ]
    # what one group costs: the fault hook's calls, and on files the syscalls themselves
    expected = Counter({"write": 1, "sync": 1})
    observed = (lambda: syscalls) if kit.kind == "file" else (lambda: kit.faults.calls)

    async def body(node: Node) -> None:
        await node.controller.create_stream("t/group", 2, None, None)
        queued = [node.append("t/group", i % 2, make_batch(2, f"g{i}")) for i in range(10)]
        assert kit.faults.calls == {} and syscalls == {}
        node.start()
        acked = await asyncio.gather(*queued)
        assert acked == [0, 0, 2, 2, 4, 4, 6, 6, 8, 8]
        assert kit.faults.calls == expected
        assert observed() == expected, "one writev and one fsync per group"
        assert node.containers[0].appended_batches == 10
        await node.append("t/group", 0, make_batch(1, "alone"))
        assert kit.faults.calls == observed() == expected + expected

    node = Node(journals, SqliteMetaStore(":memory:"), MemoryChunkStore())
    run(closing(node, body))


def test_appends_arriving_during_an_fsync_form_the_next_group(kit: Kit) -> None:
    async def body(node: Node) -> None:
        await node.controller.create_stream("t/load", 1, None, None)
        node.start()
        kit.faults.block_next("sync")
        first = node.append("t/load", 0, make_batch(1, "first"))
        await until(kit.faults.entered.is_set)
        later = [node.append("t/load", 0, make_batch(1, f"later{i}")) for i in range(6)]
        kit.faults.release()
        assert await first == 0
        assert await asyncio.gather(*later) == [1, 2, 3, 4, 5, 6]
        assert kit.faults.calls["sync"] == 2

    run(closing(kit.node(), body))


def test_readers_never_see_past_the_durable_end(kit: Kit) -> None:
    async def body(node: Node) -> None:
        await node.controller.create_stream("t/durable", 1, None, None)
        node.start()
        await node.append("t/durable", 0, make_batch(2, "synced"))
        kit.faults.block_next("sync")
        pending = node.append("t/durable", 0, make_batch(3, "in flight"))
        await until(kit.faults.entered.is_set)
        segment = node.segment("t/durable")
        container = node.container_of(segment)
        assert segment.next_offset == 2
        assert await container.read(segment, 2, 1 << 20) == []
        with pytest.raises(OffsetOutOfRange):
            await container.read(segment, 3, 1 << 20)
        kit.faults.release()
        assert await pending == 2
        assert len(await container.read(segment, 2, 1 << 20)) == 1

    run(closing(kit.node(), body))


@pytest.mark.parametrize(
    ("op", "code", "error"),
    [
        ("sync", errno.ENOSPC, StorageFull),
        ("write", errno.ENOSPC, StorageFull),
        ("sync", errno.EIO, StorageError),
    ],
)
def test_failed_group_is_not_acknowledged_and_its_offsets_are_taken_back(
    kit: Kit, op: str, code: int, error: type[Exception]
) -> None:
    async def body(node: Node) -> None:
        await node.controller.create_stream("t/full", 2, None, None)
        node.start()
        a = make_batch(3, "a")
        x = make_batch(2, "x")
        assert await node.append("t/full", 0, a) == 0
        assert await node.append("t/full", 1, x) == 0

        kit.faults.fail_next(op, code)
        group = [
            node.append("t/full", 0, make_batch(2, "lost1")),
            node.append("t/full", 0, make_batch(4, "lost2")),
            node.append("t/full", 1, make_batch(1, "lost3")),
        ]
        outcomes = await asyncio.gather(*group, return_exceptions=True)
        assert all(isinstance(o, error) for o in outcomes), outcomes
        seg0, seg1 = node.segment("t/full", 0), node.segment("t/full", 1)
        assert (seg0.next_offset, seg0.pending_offset) == (3, 3)
        assert (seg1.next_offset, seg1.pending_offset) == (2, 2)

        # the next append gets the offset the first failed one would have had
        c = make_batch(2, "c")
        d = make_batch(1, "d")
        assert await node.append("t/full", 0, c) == 3
        assert await node.append("t/full", 1, d) == 2
        assert await node.read_all("t/full", 0) == [bytes(a), bytes(c)]
        assert await node.read_all("t/full", 1) == [bytes(x), bytes(d)]
        read_values = [v for b in await node.read_all("t/full", 0) for v in values_of(b)]
        assert not any(v.startswith(b"lost") for v in read_values)
        assert node.containers[0].appended_batches == 4

    run(closing(kit.node(), body))


@pytest.mark.parametrize("fsync", ["never", "interval"])
def test_failed_append_keeps_groups_acknowledged_before_their_sync(kit: Kit, fsync: str) -> None:
    # without fsync=always a group is acknowledged once written: a later failure must not cut it
    config = ContainerConfig(fsync=fsync, fsync_interval_ms=600_000, roll_ms=600_000)

    async def body(node: Node) -> None:
        await node.controller.create_stream("t/lazy", 1, None, None)
        node.start()
        a = make_batch(2, "acked before any sync")
        assert await node.append("t/lazy", 0, a) == 0
        assert kit.faults.calls["sync"] == 0
        kit.faults.fail_next("write")
        with pytest.raises(StorageFull):
            await node.append("t/lazy", 0, make_batch(3, "lost"))
        c = make_batch(1, "c")
        assert await node.append("t/lazy", 0, c) == 2
        assert await node.read_all("t/lazy") == [bytes(a), bytes(c)]
        if kit.kind == "file":  # what a restart would find
            journal = FileJournal(kit.tmp_path / "journal" / "0")
            payloads = [bytes(p[8:]) for _, p in journal.recover()]
            journal.close()
            assert payloads == [bytes(a), bytes(c)]

    run(closing(kit.node(config=config), body))


def test_failed_periodic_sync_keeps_acknowledged_groups(kit: Kit) -> None:
    config = ContainerConfig(fsync="interval", fsync_interval_ms=2, roll_ms=600_000)

    async def body(node: Node) -> None:
        await node.controller.create_stream("t/interval", 1, None, None)
        kit.faults.fail_next("sync")
        node.start()
        a = make_batch(2, "a")
        assert await node.append("t/interval", 0, a) == 0
        await until(lambda: kit.faults.calls["sync"] >= 3)  # one failed, then good ones
        b = make_batch(2, "b")
        assert await node.append("t/interval", 0, b) == 2
        assert await node.read_all("t/interval") == [bytes(a), bytes(b)]

    run(closing(kit.node(config=config), body))


def test_nothing_of_a_failed_group_survives_a_restart(tmp_path: Path) -> None:
    faults = Faults()

    def open_node() -> Node:
        journal = FileJournal(tmp_path / "journal", fault=faults)
        return Node([journal], SqliteMetaStore(tmp_path / "meta.db"), MemoryChunkStore())

    async def first(node: Node) -> list[bytes]:
        await node.controller.create_stream("t/restart", 1, None, None)
        node.start()
        await node.append("t/restart", 0, make_batch(2, "kept"))
        faults.fail_next("sync")
        with pytest.raises(StorageFull):
            await node.append("t/restart", 0, make_batch(2, "lost"))
        await node.append("t/restart", 0, make_batch(1, "kept too"))
        return await node.read_all("t/restart")

    async def second(node: Node) -> list[bytes]:
        return await node.read_all("t/restart")

    before = run(closing(open_node(), first))
    again = open_node()
    assert again.recovered == {"streams": 1, "batches": 2, "skipped": 0}
    assert run(closing(again, second)) == before


# --- reads -------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", [FAST, NO_TAIL_CACHE], ids=["tail-cache", "journal-reads"])
def test_read_returns_whole_batches_from_an_offset(kit: Kit, config: ContainerConfig) -> None:
    async def body(node: Node) -> None:
        await node.controller.create_stream("t/read", 1, None, None)
        node.start()
        batches = [make_batch(n, f"r{i}") for i, n in enumerate([3, 2, 4])]
        for batch in batches:
            await node.append("t/read", 0, batch)
        whole = [bytes(b) for b in batches]
        segment = node.segment("t/read")
        container = node.container_of(segment)

        async def read(offset: int, max_bytes: int = 1 << 20) -> list[bytes]:
            return [bytes(b) for b in await container.read(segment, offset, max_bytes)]

        assert await read(0) == whole
        assert await read(2) == whole, "an offset inside a batch returns the whole batch"
        assert await read(3) == whole[1:]
        assert await read(4) == whole[1:]
        assert await read(8) == whole[2:]
        assert await read(0, 1) == whole[:1], "at least one batch, whatever max_bytes says"
        assert await read(0, len(whole[0]) + 1) == whole[:2]
        assert await read(9) == []
        with pytest.raises(OffsetOutOfRange) as raised:
            await read(10)
        assert raised.value.details["end"] == 9

    run(closing(kit.node(config=config), body))


def test_read_of_an_empty_segment(kit: Kit) -> None:
    async def body(node: Node) -> None:
        await node.controller.create_stream("t/empty", 1, None, None)
        segment = node.segment("t/empty")
        assert await node.container_of(segment).read(segment, 0, 1024) == []
        with pytest.raises(OffsetOutOfRange):
            await node.container_of(segment).read(segment, 1, 1024)

    run(closing(kit.node(), body))


# --- the mover: sealed journal files become per-segment chunks ----------------------------------


@pytest.fixture(params=["memory-chunks", "local-chunks"])
def chunk_store(request: pytest.FixtureRequest, tmp_path: Path) -> LongTermStore:
    if request.param == "local-chunks":
        return LocalChunkStore(tmp_path / "chunks", fsync=False)
    return MemoryChunkStore()


@pytest.mark.parametrize("config", [FAST, NO_TAIL_CACHE], ids=["tail-cache", "journal-reads"])
def test_mover_turns_a_sealed_file_into_chunks_with_identical_reads(
    kit: Kit, chunk_store: LongTermStore, config: ContainerConfig
) -> None:
    meta = SqliteMetaStore(":memory:")
    node = Node([kit.journal()], meta, chunk_store, config)

    async def body(node: Node) -> None:
        await node.controller.create_stream("t/move", 2, None, None)
        node.start()
        for i in range(4):
            await node.append("t/move", 0, make_batch(i + 1, f"s0-{i}"))
            await node.append("t/move", 1, make_batch(2, f"s1-{i}"))
        container = node.containers[0]
        seg0, seg1 = node.segment("t/move", 0), node.segment("t/move", 1)
        before = {s.number: await node.read_all("t/move", s.number) for s in (seg0, seg1)}
        by_offset = {
            (s.number, o): [bytes(b) for b in await container.read(s, o, 1)]
            for s in (seg0, seg1)
            for o in range(s.next_offset)
        }

        sealed = await node.roll_and_move(container)
        assert container.journal.sealed_files() == []
        assert meta.moved_file(0) == sealed
        assert seg0.journal == [] and seg1.journal == []
        assert [c.base_offset for c in chunks_of(meta, seg0)] == [0]
        assert chunks_of(meta, seg0)[0].next_offset == seg0.next_offset == 10
        assert [(c.segment, c.base_offset, c.next_offset) for c in meta.chunks()] == [
            (0, 0, 10),
            (1, 0, 8),
        ]
        assert meta.chunks()[0].bytes == sum(len(b) for b in before[0])
        for (number, offset), expected in by_offset.items():
            segment = node.segment("t/move", number)
            got = [bytes(b) for b in await container.read(segment, offset, 1)]
            assert got == expected, (number, offset)
        for s in (seg0, seg1):
            assert await node.read_all("t/move", s.number) == before[s.number]

        # appends go on after the move; reads cross from the chunk into the journal
        assert await node.append("t/move", 0, make_batch(2, "after")) == 10
        after = await node.read_all("t/move", 0)
        assert after[:-1] == before[0]
        assert values_of(after[-1]) == [b"after-value0" * 3, b"after-value1" * 3]
        await node.roll_and_move(container)
        assert [c.base_offset for c in chunks_of(meta, seg0)] == [0, 10]
        assert await node.read_all("t/move", 0) == after
        assert await node.read_all("t/move", 0, 11) == after[-1:]

    run(closing(node, body))


@pytest.mark.parametrize(
    ("counts", "linked"),
    [((12, 3, 2), "t/a"), ((4, 4, 4), None)],
    ids=["one-owns-most", "none-owns-half"],
)
def test_mover_links_a_file_only_to_a_segment_owning_half_of_it(
    tmp_path: Path, counts: tuple[int, ...], linked: str | None
) -> None:
    # A hard link keeps the whole journal file alive as long as that one chunk lives; other
    # segments get copies, so their retention or deletion frees their bytes.
    store = LocalChunkStore(tmp_path / "chunks", fsync=False)
    node = Node(
        [FileJournal(tmp_path / "journal", fsync=False)], SqliteMetaStore(":memory:"), store
    )
    names = ["t/a", "t/b", "t/c"]

    async def body(node: Node) -> None:
        for name in names:
            await node.controller.create_stream(name, 1, None, None)
        node.start()
        for name, count in zip(names, counts, strict=True):
            for i in range(count):
                await node.append(name, 0, make_batch(20, f"{name}-{i}"))
        before = {name: await node.read_all(name) for name in names}
        container = node.containers[0]
        file_size = container.journal.active_bytes
        await node.roll_and_move(container)
        files = {
            name: store._path(chunks_of(node.meta, node.segment(name))[0].name) for name in names
        }
        for name in names:
            own = sum(len(b) for b in before[name])
            size = files[name].stat().st_size
            assert size == (file_size if name == linked else own), name
            assert await node.read_all(name) == before[name]
        inodes = {files[name].stat().st_ino for name in names}
        assert len(inodes) == len(names), "no two chunks share a file"
        await node.controller.delete_stream("t/b")
        assert not files["t/b"].exists()
        assert await node.read_all("t/a") == before["t/a"]

    run(closing(node, body))


def test_mover_skips_batches_of_deleted_streams(kit: Kit) -> None:
    async def body(node: Node) -> None:
        await node.controller.create_stream("t/keep", 1, None, None)
        await node.controller.create_stream("t/drop", 1, None, None)
        node.start()
        await node.append("t/keep", 0, make_batch(2, "keep"))
        await node.append("t/drop", 0, make_batch(2, "drop"))
        kept = await node.read_all("t/keep")
        await node.controller.delete_stream("t/drop")
        await node.roll_and_move(node.containers[0])
        assert [c.stream_id for c in node.meta.chunks()] == [node.controller.stream("t/keep").id]
        assert node.long_term.list_chunks() == [node.meta.chunks()[0].name]
        assert await node.read_all("t/keep") == kept

    run(closing(kit.node(), body))


def test_read_racing_the_mover_still_returns_the_batches(kit: Kit) -> None:
    # the journal read fails with FileNotFoundError once the file is gone; the reader retries

    async def body(node: Node) -> None:
        await node.controller.create_stream("t/race", 1, None, None)
        node.start()
        for i in range(3):
            await node.append("t/race", 0, make_batch(2, f"race{i}"))
        expected = await node.read_all("t/race")
        container = node.containers[0]
        segment = node.segment("t/race")

        # hold the reader inside journal.read while the mover moves and deletes the file
        entered, release = threading.Event(), threading.Event()
        journal_read = container.journal.read

        def held_read(address: JournalAddress) -> bytes:
            entered.set()
            release.wait(5)
            return journal_read(address)

        container.journal.read = held_read  # type: ignore[method-assign]
        reader = asyncio.create_task(container.read(segment, 0, 1 << 20))
        try:
            await until(entered.is_set)
            await node.roll_and_move(container)
        finally:
            release.set()
        assert [bytes(b) for b in await reader] == expected

    run(closing(kit.node(config=NO_TAIL_CACHE), body))


class FailingOnce:
    """A MetaStore proxy whose first ``add_chunks`` fails as on a full disk."""

    def __init__(self, meta: MetaStore) -> None:
        self._meta = meta
        self.failed = False

    def add_chunks(self, *args: Any, **kwargs: Any) -> None:
        if not self.failed:
            self.failed = True
            raise StorageFull("disk full while updating the catalog (injected)")
        self._meta.add_chunks(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._meta, name)


def test_move_retried_after_a_catalog_failure(tmp_path: Path) -> None:
    meta = FailingOnce(SqliteMetaStore(":memory:"))
    store = LocalChunkStore(tmp_path / "chunks", fsync=False)
    journal = FileJournal(tmp_path / "journal", fsync=False)
    node = Node([journal], meta, store)  # type: ignore[arg-type]

    async def body(node: Node) -> None:
        await node.controller.create_stream("t/retry", 1, None, None)
        node.start()
        await node.append("t/retry", 0, make_batch(3, "retry"))
        expected = await node.read_all("t/retry")
        container = node.containers[0]
        loop = asyncio.get_running_loop()
        sealed = await loop.run_in_executor(container._io, journal.roll)
        assert sealed is not None
        with pytest.raises(StorageFull):
            await container._move_file(sealed)
        assert journal.sealed_files() == [sealed], "a failed move keeps the journal file"
        assert chunks_of(node.meta, node.segment("t/retry")) == []
        assert await node.read_all("t/retry") == expected
        await container._move_file(sealed)
        assert journal.sealed_files() == []
        assert await node.read_all("t/retry") == expected

    run(closing(node, body))
    # the retry adopted the same journal file under the same chunk name: no stray link is left
    stray = [p for p in (tmp_path / "chunks").rglob("*") if p.is_file() and p.suffix != ".chunk"]
    assert stray == []


# --- recovery: a new controller over the same journal directory and catalog ---------------------


@dataclass
class Disk:
    """A broker's data directory: journals per container, the catalog file, the chunks."""

    root: Path
    containers: int = 2

    def open(self, faults: Faults | None = None) -> Node:
        journals = [
            FileJournal(self.root / "journal" / str(cid), fault=faults)
            for cid in range(self.containers)
        ]
        meta = SqliteMetaStore(self.root / "meta.db")
        return Node(journals, meta, LocalChunkStore(self.root / "chunks"))


async def snapshot(node: Node) -> dict[tuple[str, int], tuple[int, list[bytes]]]:
    """Every segment's durable end and batches."""
    return {
        (stream.name, segment.number): (
            segment.next_offset,
            await node.read_all(stream.name, segment.number),
        )
        for stream in node.controller.streams.values()
        for segment in stream.segments.values()
    }


async def streams_in_both_containers(node: Node) -> list[tuple[str, int]]:
    for name in ("r/alpha", "r/beta", "r/gamma"):
        await node.controller.create_stream(name, 2, None, None)
    used = {s.container for st in node.controller.streams.values() for s in st.segments.values()}
    assert used == {0, 1}
    return [(name, n) for name in ("r/alpha", "r/beta", "r/gamma") for n in (0, 1)]


def test_restart_rebuilds_offsets_and_reads(tmp_path: Path) -> None:
    disk = Disk(tmp_path / "data")
    faults = Faults()

    async def write(node: Node) -> dict[tuple[str, int], tuple[int, list[bytes]]]:
        segments = await streams_in_both_containers(node)
        node.start()
        for round_ in range(3):
            for i, (name, number) in enumerate(segments):
                await node.append(name, number, make_batch(1 + (i + round_) % 3, f"{round_}-{i}"))
            if round_ == 0:  # the first round moves to chunks, the rest stays in the journals
                for container in node.containers:
                    await node.roll_and_move(container)
        faults.fail_next("sync")
        with pytest.raises(StorageFull):
            await node.append("r/alpha", 0, make_batch(5, "never acknowledged"))
        await node.append("r/alpha", 0, make_batch(1, "last"))
        return await snapshot(node)

    before = run(closing(disk.open(faults), write))
    node = disk.open()
    assert node.recovered["streams"] == 3
    assert node.recovered["skipped"] == 0
    assert all(j.report.cut_bytes == 0 for j in node.journals)

    async def check(node: Node) -> None:
        assert await snapshot(node) == before
        node.start()
        for (name, number), (end, _) in before.items():
            assert await node.append(name, number, make_batch(1, "after restart")) == end

    run(closing(node, check))


def test_restart_after_a_torn_write_keeps_every_acknowledged_batch(tmp_path: Path) -> None:
    disk = Disk(tmp_path / "data", containers=1)

    async def write(node: Node) -> dict[tuple[str, int], tuple[int, list[bytes]]]:
        await node.controller.create_stream("r/torn", 1, None, None)
        node.start()
        for i in range(3):
            await node.append("r/torn", 0, make_batch(2, f"acked{i}"))
        return await snapshot(node)

    before = run(closing(disk.open(), write))
    # a crash in the middle of the next group's writev: half an entry at the journal's tail
    (active,) = sorted((disk.root / "journal" / "0").glob("*.journal"))
    torn = bytes(active.read_bytes()[:40])
    with open(active, "ab") as f:
        f.write(torn)
    node = disk.open()
    assert node.journals[0].report.cut_bytes == len(torn)
    assert run(closing(node, snapshot)) == before


def test_restart_after_a_crash_between_catalog_and_journal_delete(tmp_path: Path) -> None:
    disk = Disk(tmp_path / "data", containers=1)

    async def write(node: Node) -> dict[tuple[str, int], tuple[int, list[bytes]]]:
        await node.controller.create_stream("r/crash", 2, None, None)
        node.start()
        for i in range(4):
            await node.append("r/crash", i % 2, make_batch(2, f"moved{i}"))
        journal = node.journals[0]
        # the crash: the chunks are recorded as moved, the journal file is not deleted yet
        journal.delete_file = lambda file_id: None  # type: ignore[method-assign]
        sealed = await node.roll_and_move(node.containers[0])
        assert (disk.root / "journal" / "0" / f"{sealed:016d}.journal").exists()
        await node.append("r/crash", 0, make_batch(1, "in the journal"))
        return await snapshot(node)

    before = run(closing(disk.open(), write))
    node = disk.open()
    assert node.journals[0].sealed_files() == [], "recovery deletes the moved file"
    assert node.recovered["batches"] == 1
    after = run(closing(node, snapshot))
    assert after == before, "no batch twice, none lost"


# --- damage in a sealed journal file: holes ------------------------------------------------------


def damaged_node(root: Path) -> Node:
    journal = FileJournal(
        root / "journal", fsync=False, check=batch_checks_out, resync=JOURNAL_RESYNC
    )
    return Node([journal], SqliteMetaStore(root / "meta.db"), LocalChunkStore(root / "chunks"))


async def read_around_holes(node: Node, number: int) -> tuple[list[list[bytes]], list[tuple]]:
    """A segment's batches (as their values) from offset 0 to its end, and each hole met as
    (offset, resume)."""
    segment = node.segment("p/s", number)
    container = node.container_of(segment)
    batches: list[list[bytes]] = []
    holes: list[tuple[int, int]] = []
    offset = 0
    while offset < segment.next_offset:
        try:
            read = await container.read(segment, offset, 1 << 20)
        except CorruptData as exc:
            holes.append((offset, exc.details["resume"]))
            offset = exc.details["resume"]
            continue
        batches += [values_of(b) for b in read]
        offset = decode_header(read[-1]).next_offset
    return batches, holes


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    plan=st.lists(
        st.tuples(st.integers(0, 2), st.integers(1, 4)), min_size=1, max_size=10
    ),  # (segment, events) per batch, in append order
    victim=st.integers(min_value=0),
    move=st.booleans(),
)
def test_a_damaged_batch_in_a_sealed_file_is_exactly_one_hole(
    plan: list[tuple[int, int]], victim: int, move: bool
) -> None:
    # Three segments interleave in one journal file; one batch's body is damaged after the
    # file was sealed. Every other batch reads back, the damaged one is a hole of exactly its
    # offsets (whether a later batch of its segment reveals the gap or its own header names
    # it), no offset is handed out twice, and all of it holds after the mover and a restart.
    victim %= len(plan)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        expected: dict[int, list[list[bytes]]] = {0: [], 1: [], 2: []}
        ends = dict.fromkeys(range(3), 0)
        lost = (0, 0, 0)

        async def write(node: Node) -> None:
            nonlocal lost
            await node.controller.create_stream("p/s", 3, None, None)
            node.start()
            for i, (number, events) in enumerate(plan):
                base = await node.append("p/s", number, make_batch(events, f"b{i:02d}"))
                ends[number] = base + events
                if i == victim:
                    lost = (number, base, base + events)
                else:
                    expected[number].append(values_of(make_batch(events, f"b{i:02d}")))

        run(closing(damaged_node(root), write))
        (journal,) = sorted((root / "journal").glob("*.journal"))
        (root / "journal" / f"{int(journal.stem) + 1:016d}.journal").touch()  # sealed
        data = bytearray(journal.read_bytes())
        data[data.index(f"b{victim:02d}-value0".encode()) + 3] ^= 0x40
        journal.write_bytes(bytes(data))

        async def check(node: Node, then_move: bool) -> None:
            if then_move:
                await node.containers[0]._move_file(int(journal.stem))
            for number in range(3):
                assert node.segment("p/s", number).next_offset == ends[number]
                batches, holes = await read_around_holes(node, number)
                assert batches == expected[number]
                assert holes == ([lost[1:]] if number == lost[0] else [])

        run(closing(damaged_node(root), lambda node: check(node, move)))
        run(closing(damaged_node(root), lambda node: check(node, False)))

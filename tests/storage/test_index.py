"""Find indexes (storage/_index.py) and finds over them (broker/_find.py).

The index's own codec is tested byte for byte; finds are tested against a full scan: for random
keys, times and batch layouts (some batches moved to chunks with an index, some to chunks
without one, as a broker before find indexes left them, some still in the journal), before and
after a restart, a find returns exactly what filtering every event would, and reads exactly the
batches whose index entries (or, without an index, whose chunk) can hold a match.
"""

from __future__ import annotations

import asyncio
import dataclasses
import struct
import tempfile
from collections.abc import Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slipstream.broker._container import Container, ContainerConfig
from slipstream.broker._controller import Controller
from slipstream.broker._find import Finder, FoundEvents
from slipstream.broker._segment import Segment
from slipstream.format import (
    HEADER_LENGTH,
    binary_array,
    decode_header,
    encode_body,
    encode_body_parts,
    encode_header,
    make_record_batch,
    timestamp_array,
    verify,
)
from slipstream.storage import (
    FileJournal,
    FindIndex,
    LocalChunkStore,
    SqliteMetaStore,
    batch_key_hashes,
    batches_key_hashes,
    build_find_index,
    column_key_hashes,
    key_hash32,
)

T = TypeVar("T")
Row = tuple[bytes | None, int]  # (key, timestamp) of one event


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(coro, 60))


def make_batch(rows: Sequence[Row], tag: str) -> bytearray:
    keys = [k for k, _ in rows]
    stamps = [t for _, t in rows]
    values = [f"{tag}-{i}".encode() for i in range(len(rows))]
    body = encode_body(
        make_record_batch(binary_array(keys), binary_array(values), timestamp_array(stamps))
    )
    header = encode_header(
        body, event_count=len(rows), min_timestamp=min(stamps), max_timestamp=max(stamps)
    )
    return bytearray(header + body.to_pybytes())


# --- the codec -------------------------------------------------------------------------------


def headers_of(batches: Sequence[bytearray]) -> list[Any]:
    return [decode_header(b) for b in batches]


def test_an_index_round_trips_and_names_the_batches_of_a_key_and_a_time() -> None:
    batches = [
        make_batch([(b"a", 100), (b"b", 101)], "x"),
        make_batch([(b"c", 200), (None, 201)], "y"),
        make_batch([(b"a", 300), (b"a", 301)], "z"),
    ]
    data = build_find_index(headers_of(batches), [batch_key_hashes(b) for b in batches])
    index = FindIndex.decode(data)
    assert index is not None and index.batch_count == 3
    assert index.batches_with(key_hash32(b"a")).tolist() == [0, 2]
    assert index.batches_with(key_hash32(b"c")).tolist() == [1]
    assert index.batches_with(key_hash32(b"nobody")).tolist() == []
    assert index.batches_with(None, 150, 250).tolist() == [1]
    assert index.batches_with(None, 101, 201).tolist() == [0, 1], "max >= start, min < end"
    assert index.batches_with(key_hash32(b"a"), 301).tolist() == [2]
    assert index.batches_with(None, None, 100).tolist() == [], "the end is exclusive"
    # the layout: header, times, pairs (a, b, c, a: four distinct keys per batch in all)
    magic, version, _, count, pairs, _ = struct.unpack_from("<4sB3xIIII", data)
    assert (magic, version, count, pairs) == (b"SLFX", 1, 3, 4)
    assert len(data) == 24 + 16 * 3 + 8 * 4
    assert np.frombuffer(data, "<i8", 3, 24).tolist() == [100, 200, 300]


def reference_hash(key: bytes) -> int:
    """The index hash as docs/format.md defines it, one key in plain Python."""
    mask = (1 << 64) - 1
    s = 0
    for byte in key:
        s = (s * 0x100000001B3 + byte) & mask
    x = s ^ ((len(key) * 0x9E3779B97F4A7C15) & mask)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return (x ^ (x >> 31)) & 0xFFFFFFFF


@settings(deadline=None)  # the first example imports pandas (pa.array): seconds under load
@given(st.lists(st.one_of(st.none(), st.binary(max_size=300)), max_size=40), st.integers(0, 5))
def test_column_key_hashes_are_the_documented_hash_of_each_key(
    keys: list[bytes | None], cut: int
) -> None:
    column = pa.array(keys, pa.binary()).slice(min(cut, len(keys)))  # a slice: offsets inside
    present = [k for k in keys[min(cut, len(keys)) :] if k is not None]
    assert column_key_hashes(column).tolist() == [reference_hash(k) for k in present]
    assert [key_hash32(k) for k in present] == [reference_hash(k) for k in present]
    strings = pa.array([k.hex() for k in present], pa.string())
    assert column_key_hashes(strings).tolist() == [
        reference_hash(k.hex().encode()) for k in present
    ]


def test_the_index_hash_tells_apart_lengths_and_has_a_golden_value() -> None:
    hashes = {key_hash32(k) for k in (b"", b"\0", b"\0\0", b"\0\0\0")}
    assert len(hashes) == 4
    assert key_hash32(b"user-42") == reference_hash(b"user-42") == 0xD627D82A


def test_batch_key_hashes_are_distinct_and_skip_null_keys() -> None:
    batch = make_batch([(b"k", 1), (None, 2), (b"k", 3), (b"j", 4)], "t")
    assert batch_key_hashes(batch).tolist() == sorted({key_hash32(b"k"), key_hash32(b"j")})
    assert batch_key_hashes(make_batch([(None, 1)], "n")).tolist() == []


def event_message(rows: Sequence[Row], tag: str, compression: str | None = None) -> bytearray:
    """A batch in the producers' form (an event message, keys left out when all null)."""
    keys = [k for k, _ in rows]
    stamps = [t for _, t in rows]
    values = [f"{tag}-{i}".encode() * 20 for i in range(len(rows))]
    body = encode_body_parts(
        make_record_batch(binary_array(keys), binary_array(values), timestamp_array(stamps)),
        compression,
    )
    header = encode_header(
        body, event_count=len(rows), min_timestamp=min(stamps), max_timestamp=max(stamps)
    )
    return bytearray(header + b"".join(bytes(part) for part in body))


@settings(deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(
                st.tuples(st.one_of(st.none(), st.binary(max_size=12)), st.integers(0, 60)),
                min_size=1,
                max_size=30,
            ),
            st.sampled_from(["stream", "message", "lz4", "damaged"]),
        ),
        max_size=8,
    )
)
def test_a_group_is_hashed_as_each_batch_alone(batches: list[tuple[list[Row], str]]) -> None:
    # what the append path and recovery compute for a whole group at once, against the
    # documented hash of each batch's distinct keys; a body that does not decode gets None
    made, want = [], []
    for n, (rows, form) in enumerate(batches):
        if form == "stream":
            batch = make_batch(rows, f"b{n}")
        else:
            batch = event_message(rows, f"b{n}", "lz4" if form == "lz4" else None)
        if form == "damaged":
            batch[HEADER_LENGTH + 3 :] = bytes(len(batch) - HEADER_LENGTH - 3)
            # an all-null key column is left out (FLAG_NO_KEYS): nothing to decode for it
            want.append(None if any(k is not None for k, _ in rows) else b"")
        else:
            hashes = sorted({reference_hash(k) for k, _ in rows if k is not None})
            want.append(np.array(hashes, dtype="<u4").tobytes())
            assert batch_key_hashes(batch).tolist() == hashes
        made.append(batch)
    assert batches_key_hashes(made) == want


@pytest.mark.parametrize(
    "damage",
    ["empty", "short", "magic", "version", "crc", "length"],
)
def test_an_index_that_cannot_be_trusted_decodes_to_none(damage: str) -> None:
    batches = [make_batch([(b"a", 1)], "a"), make_batch([(b"b", 2)], "b")]
    data = bytearray(build_find_index(headers_of(batches), [batch_key_hashes(b) for b in batches]))
    if damage == "empty":
        data = bytearray()
    elif damage == "short":
        data = data[:20]
    elif damage == "magic":
        data[0] ^= 1
    elif damage == "version":
        data[4] = 2  # a newer format: old brokers scan instead of misreading it
    elif damage == "crc":
        data[-1] ^= 0x10
    else:
        data += b"\0"
    assert FindIndex.decode(bytes(data)) is None


# --- finds against a full scan -----------------------------------------------------------------


class Node:
    """One container over file storage (journal, local chunks, SQLite catalog): what a broker
    builds, minus the network. A new Node over the same directory is a restart (recovery)."""

    def __init__(self, root: Path, tail_cache: bool = True) -> None:
        self.meta = SqliteMetaStore(root / "meta.db")
        self.long_term = LocalChunkStore(root / "chunks", fsync=False)
        journal = FileJournal(root / "journal", fsync=False)
        self.pool = ThreadPoolExecutor(2, thread_name_prefix="test-find")
        # without a tail cache the mover reads every batch back from the journal file
        self.config = ContainerConfig(
            roll_ms=600_000, tail_cache_bytes=64 << 20 if tail_cache else 0
        )
        self.container = Container(0, journal, self.long_term, self.meta, self.pool, self.config)
        self.controller = Controller(self.meta, self.long_term, [self.container], self.pool)
        self.controller.recover()
        self.finder = Finder(self.meta, [self.container], self.pool)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self.container.run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.container.close()
        self.controller.close()
        self.pool.shutdown(wait=True)
        self.meta.close()

    @property
    def segment(self) -> Segment:
        return self.controller.stream("p/s").segment(0)

    async def append(self, batch: bytearray) -> int:
        return await self.container.append(self.segment, batch, verify(batch))

    async def move(self, *, indexed: bool) -> None:
        """Seal the journal file and move it to chunks, with find indexes or without (as a
        broker before find indexes did)."""
        self.container.config = dataclasses.replace(self.config, find_index=indexed)
        loop = asyncio.get_running_loop()
        sealed = await loop.run_in_executor(self.container._io, self.container.journal.roll)
        assert sealed is not None
        await self.container._move_file(sealed)
        self.container.config = self.config  # later appends are indexed again

    async def find(self, **query: Any) -> FoundEvents:
        return await self.finder.find([self.segment], **query)


@dataclasses.dataclass
class Stored:
    """The model: every event as (offset, key, time, value), each batch as its rows, and how
    each batch is stored ("journal", "indexed" chunk, "plain" chunk)."""

    events: list[tuple[int, bytes | None, int, bytes]]
    batches: list[tuple[int, list[Row], str]]


def expected(stored: Stored, query: dict[str, Any]) -> list[tuple[int, bytes | None, int]]:
    """What a full scan finds: filter every event, order, limit."""
    key, start, end = query["key"], query["start_ms"], query["end_ms"]
    hits = [
        (offset, k, t)
        for offset, k, t, _ in stored.events
        if (key is None or k == key) and (start is None or t >= start) and (end is None or t < end)
    ]
    if key is None:
        hits.sort(key=lambda e: (e[2], e[0]))
    if query["newest_first"]:
        hits.reverse()
    return hits[: query["limit"]]


def reads_when_complete(stored: Stored, query: dict[str, Any], journal_known: bool) -> int:
    """How many batches a find reads when it must read all candidates (no early stop): those
    the indexes name (key hash, time bounds), every batch of a plain chunk overlapping the
    time (chunk-level bounds), journal batches overlapping the time (and, once finds have
    read them, ``journal_known``, only those holding the key's hash)."""
    key, start, end = query["key"], query["start_ms"], query["end_ms"]
    h32 = None if key is None else key_hash32(key)

    def overlaps(lo: int, hi: int) -> bool:
        return (start is None or hi >= start) and (end is None or lo < end)

    count = 0
    chunks: dict[int, list[list[Row]]] = {}
    for _, rows, where in stored.batches:
        if where.startswith("plain"):
            chunks.setdefault(int(where.split(":")[1]), []).append(rows)
    for _, rows, where in stored.batches:
        times = [t for _, t in rows]
        hashes = {key_hash32(k) for k, _ in rows if k is not None}
        holds = h32 is None or h32 in hashes
        if where == "journal":
            count += overlaps(min(times), max(times)) and (holds or not journal_known)
        elif where == "indexed":
            count += overlaps(min(times), max(times)) and holds
        else:
            whole = [t for r in chunks[int(where.split(":")[1])] for _, t in r]
            count += overlaps(min(whole), max(whole))
    return count


KEYS = [b"user-1", b"user-2", b"user-42", b"", None]
rows_strategy = st.lists(
    st.tuples(st.sampled_from(KEYS), st.integers(0, 60)), min_size=1, max_size=6
)
#: per journal file: its batches, and how it ends ("journal": stays; "indexed"/"plain": moved)
files_strategy = st.lists(
    st.tuples(
        st.lists(rows_strategy, min_size=1, max_size=4),
        st.sampled_from(["indexed", "plain", "journal"]),
    ),
    min_size=1,
    max_size=4,
)
query_strategy = st.fixed_dictionaries(
    {
        "key": st.sampled_from([*KEYS[:4], None, b"absent"]),
        "start_ms": st.one_of(st.none(), st.integers(0, 60)),
        "end_ms": st.one_of(st.none(), st.integers(1, 61)),
        "limit": st.integers(1, 30),
        "newest_first": st.booleans(),
    }
).filter(lambda q: q["start_ms"] is None or q["end_ms"] is None or q["end_ms"] > q["start_ms"])


async def store(node: Node, files: list[tuple[list[list[Row]], str]]) -> Stored:
    """Append the files' batches; a file that ends "indexed" or "plain" is sealed and moved
    to chunks (with or without find indexes); one that ends "journal" goes on in the next."""
    await node.controller.create_stream("p/s", 1, None, None)
    stored = Stored([], [])
    pending: list[tuple[int, list[Row]]] = []  # batches in the active journal file
    for f, (batches, ending) in enumerate(files):
        for b, rows in enumerate(batches):
            tag = f"f{f}b{b}"
            base = await node.append(make_batch(rows, tag))
            pending.append((base, rows))
            stored.events += [
                (base + i, k, t, f"{tag}-{i}".encode()) for i, (k, t) in enumerate(rows)
            ]
        if ending != "journal" and f != len(files) - 1:
            await node.move(indexed=ending == "indexed")
            where = "indexed" if ending == "indexed" else f"plain:{f}"
            stored.batches += [(base, rows, where) for base, rows in pending]
            pending = []
    stored.batches += [(base, rows, "journal") for base, rows in pending]
    return stored


def found_rows(result: FoundEvents) -> list[tuple[int, bytes | None, int]]:
    return [(e.offset, e.key, e.timestamp) for e in result.events]


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    files=files_strategy,
    queries=st.lists(query_strategy, min_size=1, max_size=4),
    tail_cache=st.booleans(),
)
def test_a_find_answers_exactly_what_a_full_scan_finds(
    files: list[tuple[list[list[Row]], str]], queries: list[dict[str, Any]], tail_cache: bool
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)

        async def before_restart() -> Stored:
            node = Node(root, tail_cache)
            node.start()
            try:
                stored = await store(node, files)
                for query in queries:
                    await check(node, stored, query)
                return stored
            finally:
                await node.close()

        async def after_restart(stored: Stored) -> None:
            node = Node(root)  # recovery: the journal's batches again, the chunks' indexes
            node.start()
            try:
                for query in queries:
                    await check(node, stored, query)
            finally:
                await node.close()

        run(after_restart(run(before_restart())))


async def check(node: Node, stored: Stored, query: dict[str, Any]) -> None:
    # Three times: with the journal batches' key hashes as the append (before the restart) or
    # recovery (after it) left them, which must name exactly the batches holding the key; then
    # without them (as a broker with indexing off at append leaves them): every journal batch
    # in the window is read; then with those the first find read.
    kept = [batch.keys for batch in node.segment.journal]
    for journal_known in (True, False, True):
        if not journal_known:
            for batch in node.segment.journal:
                batch.keys = None
        result = await node.find(**query)
        assert found_rows(result) == expected(stored, query), query
        values = {offset: value for offset, _, _, value in stored.events}
        assert all(e.value == values[e.offset] and e.segment == 0 for e in result.events)
        if query["limit"] > len(stored.events):  # no early stop: every candidate is read
            reads = reads_when_complete(stored, query, journal_known)
            assert result.batches_read == reads, (query, journal_known)
    for batch, keys in zip(node.segment.journal, kept, strict=True):
        batch.keys = keys  # a find that stopped early left some unknown: as before, for the next


def test_a_catalog_from_before_find_indexes_gets_the_column_and_its_chunks_are_scanned(
    tmp_path: Path,
) -> None:
    # a chunks table as catalogs had it before find indexes (no ``finds`` column)
    import sqlite3

    path = tmp_path / "meta.db"
    with sqlite3.connect(path) as db:
        db.execute(
            "CREATE TABLE chunks (stream_id INTEGER NOT NULL, segment INTEGER NOT NULL, "
            "base_offset INTEGER NOT NULL, next_offset INTEGER NOT NULL, bytes INTEGER NOT NULL, "
            "min_timestamp INTEGER NOT NULL, max_timestamp INTEGER NOT NULL, name TEXT NOT NULL, "
            "idx BLOB NOT NULL, producers BLOB NOT NULL DEFAULT x'', max_timestamp_so_far "
            "INTEGER, PRIMARY KEY (stream_id, segment, base_offset))"
        )
        db.execute("INSERT INTO chunks VALUES (1, 0, 0, 3, 10, 1, 2, '1/0/0', x'', x'', 2)")
    meta = SqliteMetaStore(path)
    try:
        assert meta.chunk_finds(1, 0, 0) == b"", "an old chunk has no index: finds scan it"
        assert FindIndex.decode(meta.chunk_finds(1, 0, 0)) is None
        assert meta.chunk_finds(1, 0, 99) == b"", "no such chunk"
    finally:
        meta.close()

"""One suite for every LongTermStore: LocalChunkStore on a temporary directory, MemoryChunkStore,
ObjectChunkStore on SeaweedFS (with and without its read cache) and on moto's S3 server.

The contract (slipstream/storage/_chunks.py): a chunk is written whole and atomically, read by
byte ranges, listed by name prefix and deleted whole; a missing chunk or a range past its end is
``CorruptData``; a failed write is ``StorageFull`` / ``StorageError`` and leaves nothing behind.
"""

from __future__ import annotations

import errno
import mmap
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from objectstores import S3Server

from slipstream import CorruptData, StorageError, StorageFull
from slipstream.storage import LocalChunkStore, LongTermStore, MemoryChunkStore, chunk_name
from slipstream.storage import _chunks as chunks_module
from slipstream.storage._objects import CACHE_PAGE


@pytest.fixture(params=["local", "local-pread", "memory", "seaweedfs", "seaweedfs-cached", "moto"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LongTermStore]:
    if request.param == "local":
        yield LocalChunkStore(tmp_path / "chunks")
    elif request.param == "local-pread":  # what a kernel before 5.14 gets
        yield LocalChunkStore(tmp_path / "chunks", map_reads=False)
    elif request.param == "memory":
        yield MemoryChunkStore()
    else:
        # ObjectChunkStore on a real server, a prefix of its own per test; "-cached": through
        # its block cache, with blocks small enough that ranges span several of them
        kind = request.param.removesuffix("-cached")
        server: S3Server = request.getfixturevalue({"moto": "moto_s3"}.get(kind, kind))
        bucket = request.getfixturevalue(f"{server.name}_bucket")
        url = f"s3://{bucket}/{uuid.uuid4().hex}"
        if request.param.endswith("-cached"):
            yield server.store(
                url, cache_dir=tmp_path / "cache", cache_bytes=1 << 20, block_bytes=CACHE_PAGE
            )
        else:
            yield server.store(url)


@pytest.fixture(scope="module")
def seaweedfs_bucket(seaweedfs: S3Server) -> str:
    return seaweedfs.create_bucket()


@pytest.fixture(scope="module")
def moto_bucket(moto_s3: S3Server) -> str:
    return moto_s3.create_bucket()


DATA = bytes(range(256)) * 3


def test_chunk_name_is_an_object_key() -> None:
    assert chunk_name(7, 2, 1234) == "7/2/00000000000000001234"
    # zero-padded so that names sort in offset order
    names = [chunk_name(1, 0, offset) for offset in (10, 9, 100, 2**40)]
    assert sorted(names) == [chunk_name(1, 0, o) for o in (9, 10, 100, 2**40)]


def test_write_then_read_whole_and_ranges(store: LongTermStore) -> None:
    name = chunk_name(1, 0, 0)
    store.write_chunk(name, [DATA[:100], bytearray(DATA[100:300]), memoryview(DATA)[300:]])
    assert store.read_chunk(name) == DATA
    assert store.read_chunk(name, 0, len(DATA)) == DATA
    assert store.read_chunk(name, 17) == DATA[17:]
    assert store.read_chunk(name, 17, 100) == DATA[17:117]
    assert store.read_chunk(name, len(DATA) - 1, 1) == DATA[-1:]
    assert store.read_chunk(name, 5, 0) == b""
    assert store.read_chunk(name, len(DATA)) == b""


# one store for all examples: each example overwrites the same chunk first
@settings(
    max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.binary(max_size=300), bounds=st.tuples(st.integers(0, 300), st.integers(0, 300)))
def test_any_range_inside_the_chunk_reads_back(
    store: LongTermStore, data: bytes, bounds: tuple[int, int]
) -> None:
    start, end = sorted(bounds)
    end += 1  # a non-empty range (zero-length reads past the end are not used, nor agreed on)
    store.write_chunk("p/0/0", [data])
    if end <= len(data):
        assert store.read_chunk("p/0/0", start, end - start) == data[start:end]
    else:
        with pytest.raises(CorruptData):
            store.read_chunk("p/0/0", start, end - start)


def test_empty_chunk(store: LongTermStore) -> None:
    store.write_chunk("e/0/0", [])
    assert store.read_chunk("e/0/0") == b""
    assert store.list_chunks() == ["e/0/0"]


def test_overwrite_replaces_the_whole_chunk(store: LongTermStore) -> None:
    store.write_chunk("o/0/0", [b"a much longer first version"])
    assert store.read_chunk("o/0/0", 2, 4) == b"much"
    store.write_chunk("o/0/0", [b"second"])
    assert store.read_chunk("o/0/0") == b"second"
    assert store.list_chunks() == ["o/0/0"]


def test_list_by_prefix_is_sorted_and_exact(store: LongTermStore) -> None:
    names = [
        chunk_name(1, 0, 100),
        chunk_name(1, 0, 0),
        chunk_name(1, 1, 0),
        chunk_name(10, 0, 0),
        chunk_name(2, 3, 5),
    ]
    for name in names:
        store.write_chunk(name, [name.encode()])
    assert store.list_chunks() == sorted(names)
    assert store.list_chunks("1/") == [
        chunk_name(1, 0, 0),
        chunk_name(1, 0, 100),
        chunk_name(1, 1, 0),
    ]
    assert store.list_chunks("1/0/") == [chunk_name(1, 0, 0), chunk_name(1, 0, 100)]
    assert store.list_chunks("10/") == [chunk_name(10, 0, 0)]
    assert store.list_chunks("3/") == []
    for name in names:
        assert store.read_chunk(name) == name.encode()


def test_delete_removes_only_that_chunk_and_is_idempotent(store: LongTermStore) -> None:
    store.write_chunk("d/0/0", [b"zero"])
    store.write_chunk("d/0/1", [b"one"])
    store.delete_chunk("d/0/0")
    store.delete_chunk("d/0/0")
    store.delete_chunk("never/written/0")
    assert store.list_chunks() == ["d/0/1"]
    assert store.read_chunk("d/0/1") == b"one"
    with pytest.raises(CorruptData, match="missing"):
        store.read_chunk("d/0/0")


def test_read_of_a_missing_chunk_is_corrupt_data(store: LongTermStore) -> None:
    with pytest.raises(CorruptData, match="missing") as raised:
        store.read_chunk("1/0/00000000000000000000", 0, 10)
    assert raised.value.details["chunk"] == "1/0/00000000000000000000"
    with pytest.raises(CorruptData):
        store.read_chunk("1/0/00000000000000000000")


@pytest.mark.parametrize(("start", "length"), [(0, 11), (5, 6), (10, 1), (11, 1), (50, 3)])
def test_short_read_is_corrupt_data(store: LongTermStore, start: int, length: int) -> None:
    store.write_chunk("s/0/0", [b"0123456789"])
    with pytest.raises(CorruptData, match="shorter") as raised:
        store.read_chunk("s/0/0", start, length)
    assert raised.value.details["chunk"] == "s/0/0"


def test_adopt_ranges_reads_back_each_range_where_it_says(
    store: LongTermStore, tmp_path: Path
) -> None:
    source = tmp_path / "sealed.journal"
    source.write_bytes(DATA)
    ranges = [(3, 10), (40, 1), (41, 100), (700, 68)]
    starts = store.adopt_ranges("a/0/3", source, ranges)
    assert len(starts) == len(ranges)
    for (position, length), start in zip(ranges, starts, strict=True):
        assert store.read_chunk("a/0/3", start, length) == DATA[position : position + length]
    # the chunk stays readable when the source file goes (the journal deletes moved files)
    source.unlink()
    for (position, length), start in zip(ranges, starts, strict=True):
        assert store.read_chunk("a/0/3", start, length) == DATA[position : position + length]
    assert store.list_chunks() == ["a/0/3"]


def test_copy_ranges_stores_only_those_ranges_back_to_back(
    store: LongTermStore, tmp_path: Path
) -> None:
    # the mover's copy for segments that do not get the journal file itself: the chunk holds
    # their bytes and nothing else, so deleting it frees exactly them
    source = tmp_path / "sealed.journal"
    source.write_bytes(DATA)
    ranges = [(3, 10), (41, 100), (700, 68)]
    assert store.copy_ranges("c/0/3", source, ranges) == [0, 10, 110]
    source.unlink()
    whole = bytes(store.read_chunk("c/0/3"))
    assert whole == b"".join(DATA[p : p + n] for p, n in ranges)
    store.delete_chunk("c/0/3")
    assert store.list_chunks() == []


# --- LocalChunkStore: atomic writes leave no temporary file -------------------------------------


def leftovers(directory: Path) -> list[Path]:
    return [p for p in directory.rglob("*") if p.is_file() and p.suffix != ".chunk"]


def test_local_write_leaves_no_temporary_file(tmp_path: Path) -> None:
    store = LocalChunkStore(tmp_path / "chunks")
    store.write_chunk("1/0/0", [b"x" * 1000])
    store.write_chunk("1/0/0", [b"y"])
    assert leftovers(tmp_path / "chunks") == []
    assert [p.name for p in (tmp_path / "chunks").rglob("*.chunk")] == ["0.chunk"]


def test_local_failed_fsync_is_storage_full_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalChunkStore(tmp_path / "chunks")
    store.write_chunk("1/0/0", [b"old"])

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    monkeypatch.setattr(os, "fdatasync", full)
    with pytest.raises(StorageFull, match="1/0/5"):
        store.write_chunk("1/0/5", [b"new chunk"])
    with pytest.raises(StorageFull):
        store.write_chunk("1/0/0", [b"replacement"])
    monkeypatch.undo()
    assert leftovers(tmp_path / "chunks") == []
    assert store.list_chunks() == ["1/0/0"]
    assert store.read_chunk("1/0/0") == b"old", "a failed overwrite keeps the old chunk"
    store.write_chunk("1/0/5", [b"new chunk"])
    assert store.read_chunk("1/0/5") == b"new chunk"


def test_local_failed_write_with_eio_is_storage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalChunkStore(tmp_path / "chunks")

    def broken(fd: int, buffers: object) -> int:
        raise OSError(errno.EIO, "Input/output error (injected)")

    monkeypatch.setattr(os, "writev", broken)
    with pytest.raises(StorageError) as raised:
        store.write_chunk("1/0/0", [b"data"])
    assert not isinstance(raised.value, StorageFull)
    monkeypatch.undo()
    assert leftovers(tmp_path / "chunks") == []
    assert store.list_chunks() == []


def test_local_write_under_a_file_is_storage_error_and_leaves_nothing(tmp_path: Path) -> None:
    # the parent "directory" is a file: the write and the cleanup of its .tmp both fail
    store = LocalChunkStore(tmp_path / "chunks")
    (tmp_path / "chunks" / "1").write_bytes(b"a file where a directory should be")
    with pytest.raises(StorageError):
        store.write_chunk("1/0/0", [b"data"])
    assert store.list_chunks() == []
    assert leftovers(tmp_path / "chunks") == [tmp_path / "chunks" / "1"]


def test_local_chunks_survive_a_new_store_instance(tmp_path: Path) -> None:
    LocalChunkStore(tmp_path / "chunks").write_chunk("9/1/2", [b"durable"])
    reopened = LocalChunkStore(tmp_path / "chunks")
    assert reopened.list_chunks() == ["9/1/2"]
    assert reopened.read_chunk("9/1/2") == b"durable"


def test_local_adopt_leaves_no_temporary_file(tmp_path: Path) -> None:
    store = LocalChunkStore(tmp_path / "chunks")
    source = tmp_path / "sealed.journal"
    source.write_bytes(DATA)
    assert store.adopt_ranges("1/0/0", source, [(5, 10)]) == [5]
    assert leftovers(tmp_path / "chunks") == []
    assert store.list_chunks() == ["1/0/0"]


def test_local_adopt_retried_leaves_no_temporary_file(tmp_path: Path) -> None:
    # a move retried after a failure or a restart adopts the same file under the same name: a
    # plain link-and-rename would leave the .tmp link (rename of two links to one inode is a
    # no-op) and pin the journal file's space for ever
    store = LocalChunkStore(tmp_path / "chunks")
    source = tmp_path / "sealed.journal"
    source.write_bytes(DATA)
    assert store.adopt_ranges("1/0/0", source, [(5, 10)]) == [5]
    assert store.adopt_ranges("1/0/0", source, [(5, 10)]) == [5]
    assert leftovers(tmp_path / "chunks") == []
    assert store.read_chunk("1/0/0", 5, 10) == DATA[5:15]


# --- LocalChunkStore reads through memory maps ---------------------------------------------------

PAGE = mmap.PAGESIZE


def test_local_read_views_outlive_delete_and_overwrite(tmp_path: Path) -> None:
    """The broker may still be sending a view when retention deletes its chunk."""
    store = LocalChunkStore(tmp_path / "chunks")
    store.write_chunk("v/0/0", [DATA])
    view = store.read_chunk("v/0/0", 10, 500)
    assert isinstance(view, memoryview) and view.readonly
    store.delete_chunk("v/0/0")
    assert view == DATA[10:510]
    store.write_chunk("v/0/0", [b"other bytes"])
    assert store.read_chunk("v/0/0") == b"other bytes", "the old map is not used again"
    assert view == DATA[10:510]


def test_local_evicted_maps_stay_valid_while_viewed(tmp_path: Path) -> None:
    store = LocalChunkStore(tmp_path / "chunks")
    store.MAX_MAPS = 2
    names = [chunk_name(1, 0, i) for i in range(6)]
    for name in names:
        store.write_chunk(name, [name.encode() * 100])
    views = [store.read_chunk(name, 0, 50) for name in names]  # maps 0-3 are dropped
    for _ in range(2):
        for name, view in zip(names, views, strict=True):
            assert view == (name.encode() * 100)[:50]
            assert store.read_chunk(name, 50, 10) == (name.encode() * 100)[50:60]


def test_local_file_cut_under_its_map_is_corrupt_data_not_sigbus(tmp_path: Path) -> None:
    """Touching a mapped page past the end of its file raises SIGBUS; the store loads every
    range with MADV_POPULATE_READ first, which fails instead, and then says what is wrong."""
    store = LocalChunkStore(tmp_path / "chunks")
    data = os.urandom(3 * PAGE)
    store.write_chunk("t/0/0", [data])
    assert store.read_chunk("t/0/0", 0, 100) == data[:100]  # mapped, all three pages
    os.truncate(tmp_path / "chunks" / "t" / "0" / "0.chunk", PAGE)  # damage behind its back
    with pytest.raises(CorruptData, match="shorter"):
        store.read_chunk("t/0/0", 2 * PAGE, 100)
    assert store.read_chunk("t/0/0", 10, 100) == data[10:110]


def test_local_unreadable_chunk_is_storage_error(tmp_path: Path) -> None:
    store = LocalChunkStore(tmp_path / "chunks")
    (tmp_path / "chunks" / "u" / "0" / "0.chunk").mkdir(parents=True)  # not a file
    with pytest.raises(StorageError, match="u/0/0"):
        store.read_chunk("u/0/0", 0, 10)


def test_local_reads_with_pread_where_the_kernel_cannot_populate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalChunkStore(tmp_path / "chunks")
    store.write_chunk("k/0/0", [DATA])
    monkeypatch.setattr(chunks_module, "MADV_POPULATE_READ", 0x7FFF)  # EINVAL, as before 5.14
    for _ in range(2):
        data = store.read_chunk("k/0/0", 5, 200)
        assert data == DATA[5:205]
        assert isinstance(data, bytes), "read with pread, not through a map"

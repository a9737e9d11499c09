"""ObjectChunkStore beyond the conformance suite: bad configuration, a store that stops or
hangs, the read cache's bound, damaged cache files, multipart uploads.

Real servers on 127.0.0.1 (tests/objectstores.py): the shared SeaweedFS and moto, and for the
tests that stop their server, a SeaweedFS of their own.
"""

from __future__ import annotations

import os
import random
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from conftest import free_port
from objectstores import ACCESS_KEY, SECRET_KEY, S3Server, SeaweedFS

from slipstream import CorruptData, InvalidArgument, StorageError
from slipstream.storage import (
    ChunkRecord,
    LocalChunkStore,
    MetaStore,
    ObjectChunkStore,
    SegmentRecord,
    SqliteMetaStore,
    chunk_name,
)
from slipstream.storage._chunks import ChunkSweep, writer_tag
from slipstream.storage._objects import CACHE_PAGE, MULTIPART_BYTES, PROBE_NAME

BLOCK = 2 * CACHE_PAGE


@pytest.fixture(params=["seaweedfs", "moto_s3"])
def server(request: pytest.FixtureRequest) -> S3Server:
    found: S3Server = request.getfixturevalue(request.param)
    return found


@pytest.fixture(scope="module")
def bucket(seaweedfs: SeaweedFS) -> str:
    return seaweedfs.create_bucket()


def url(bucket: str) -> str:
    return f"s3://{bucket}/{uuid.uuid4().hex}"


def cache_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.is_file())


# --- bad configuration: a StorageError that says the fix, nothing written -------------------


def test_unreachable_endpoint_is_a_storage_error_naming_it(tmp_path: Path) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    store = ObjectChunkStore(
        "s3://any/prefix",
        endpoint=endpoint,
        access_key_id="k",
        secret_access_key="s",
        cache_dir=tmp_path / "cache",
        max_retries=1,
        connect_timeout=1.0,
    )
    for attempt in (
        store.check_writable,
        lambda: store.write_chunk("1/0/0", [b"x"]),
        lambda: store.read_chunk("1/0/0", 0, 1),
        lambda: store.list_chunks(),
        lambda: store.delete_chunk("1/0/0"),
    ):
        with pytest.raises(StorageError, match="cannot reach") as raised:
            attempt()
        assert endpoint in raised.value.message
        assert not isinstance(raised.value, CorruptData)
    assert cache_files(tmp_path / "cache") == []


def test_missing_bucket_is_a_storage_error_not_a_missing_chunk(server: S3Server) -> None:
    store = server.store(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/p")
    for attempt in (
        store.check_writable,
        lambda: store.write_chunk("1/0/0", [b"x"]),
        lambda: store.read_chunk("1/0/0", 0, 1),
        lambda: store.read_chunk("1/0/0"),  # a HEAD first: its 404 has no body
        lambda: store.list_chunks(),
    ):
        with pytest.raises(StorageError, match=r"does not exist.*create it"):
            attempt()


def test_wrong_credentials_are_refused_with_the_fix(seaweedfs: SeaweedFS, bucket: str) -> None:
    store = ObjectChunkStore(
        url(bucket),
        endpoint=seaweedfs.endpoint,
        access_key_id=ACCESS_KEY,
        secret_access_key="not-the-secret",
        cache_bytes=0,
        max_retries=1,
    )
    for attempt in (
        store.check_writable,
        lambda: store.write_chunk("1/0/0", [b"x"]),
        lambda: store.read_chunk("1/0/0", 0, 1),
        lambda: store.list_chunks(),
    ):
        with pytest.raises(StorageError, match=r"refused the credentials.*AWS_SECRET_ACCESS_KEY"):
            attempt()
    assert seaweedfs.objects(bucket, store.prefix) == []


def test_missing_credentials_and_bad_urls_are_refused_before_any_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    with pytest.raises(InvalidArgument, match="AWS_ACCESS_KEY_ID"):
        ObjectChunkStore("s3://bucket/prefix", endpoint="http://127.0.0.1:1", cache_bytes=0)
    for bad in ("bucket/prefix", "s3:///prefix", "http://bucket/prefix"):
        with pytest.raises(InvalidArgument, match="s3://bucket/prefix"):
            ObjectChunkStore(bad, access_key_id="k", secret_access_key="s", cache_bytes=0)


def test_credentials_from_the_environment(
    seaweedfs: SeaweedFS, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    monkeypatch.setenv("AWS_ENDPOINT_URL", seaweedfs.endpoint)
    with pytest.raises(StorageError, match="refused the credentials"):
        ObjectChunkStore(url(bucket), cache_bytes=0, max_retries=0).check_writable()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    store = ObjectChunkStore(url(bucket), cache_bytes=0, max_retries=0)
    store.check_writable()
    store.write_chunk("1/0/0", [b"from the environment"])
    assert store.read_chunk("1/0/0") == b"from the environment"


def test_check_writable_leaves_nothing_in_the_bucket(server: S3Server) -> None:
    bucket = server.create_bucket()
    store = server.store(f"s3://{bucket}/prefix")
    store.check_writable()
    assert server.objects(bucket) == []
    store.write_chunk("1/0/0", [b"x"])
    assert server.objects(bucket) == ["prefix/1/0/0"]
    assert PROBE_NAME not in store.list_chunks()


@pytest.mark.parametrize("cache_bytes", [0, 8 * BLOCK])
def test_a_store_that_did_not_write_the_chunk_finds_its_end(
    server: S3Server, tmp_path: Path, cache_bytes: int
) -> None:
    # a broker restarted on a bucket knows no object's size: a range past the end is still
    # CorruptData "shorter", never fewer bytes than asked
    bucket = server.create_bucket()
    data = os.urandom(BLOCK + 100)
    server.store(f"s3://{bucket}/p").write_chunk("1/0/0", [data])
    for start, length in ((0, len(data) + 1), (BLOCK, 101), (len(data), 1), (len(data) + 5, 3)):
        fresh = server.store(
            f"s3://{bucket}/p", cache_dir=tmp_path / "c", cache_bytes=cache_bytes, block_bytes=BLOCK
        )
        with pytest.raises(CorruptData, match="shorter"):
            fresh.read_chunk("1/0/0", start, length)
    fresh = server.store(f"s3://{bucket}/p", cache_dir=tmp_path / "c", cache_bytes=cache_bytes)
    assert fresh.read_chunk("1/0/0", BLOCK, 100) == data[BLOCK:]
    assert bytes(server.store(f"s3://{bucket}/p").read_chunk("1/0/0", 7)) == data[7:]


# --- big chunks: multipart uploads -------------------------------------------------------------


def test_a_chunk_above_the_multipart_size_reads_back(server: S3Server) -> None:
    bucket = server.create_bucket()
    store = server.store(f"s3://{bucket}/big")
    data = os.urandom(MULTIPART_BYTES + MULTIPART_BYTES // 2 + 17)
    store.write_chunk("1/0/0", [data[:100], memoryview(data)[100:]])
    assert store.read_chunk("1/0/0", 0, 10) == data[:10]
    at = MULTIPART_BYTES - 5  # across the parts' border
    assert store.read_chunk("1/0/0", at, 1000) == data[at : at + 1000]
    assert bytes(store.read_chunk("1/0/0")) == data
    assert server.objects(bucket) == ["big/1/0/0"]


# --- the read cache -------------------------------------------------------------------------------


def test_cache_bound_holds_and_least_recently_used_blocks_go(
    seaweedfs: SeaweedFS, bucket: str, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    store = seaweedfs.store(url(bucket), cache_dir=cache, cache_bytes=3 * BLOCK, block_bytes=BLOCK)
    chunks = {chunk_name(1, 0, i): os.urandom(4 * BLOCK + 100) for i in range(3)}
    for name, data in chunks.items():
        store.write_chunk(name, [data])
    for name, data in chunks.items():
        for at in range(0, len(data), BLOCK // 2):  # every block, twice, in order
            assert (
                store.read_chunk(name, at, min(BLOCK // 2, len(data) - at))
                == data[at:][: BLOCK // 2]
            )
            assert store.cached_bytes <= 3 * BLOCK
            on_disk = cache_files(cache)
            assert len(on_disk) <= 3
            assert all(p.suffix == ".block" for p in on_disk)
    # the last three blocks read are cached: reading them again fetches nothing
    last = list(chunks.values())[-1]
    fetched = store.stats["fetches"]
    assert store.read_chunk(chunk_name(1, 0, 2), 2 * BLOCK, 2 * BLOCK + 100) == last[2 * BLOCK :]
    assert store.stats["fetches"] == fetched
    # and the first chunk's blocks are gone
    assert store.read_chunk(chunk_name(1, 0, 0), 0, 10) == chunks[chunk_name(1, 0, 0)][:10]
    assert store.stats["fetches"] == fetched + 1


def test_reader_threads_at_once_get_right_bytes_and_keep_the_bound(
    seaweedfs: SeaweedFS, bucket: str, tmp_path: Path
) -> None:
    # the broker reads with four threads; same blocks fetched twice at once, evictions racing
    cache = tmp_path / "cache"
    store = seaweedfs.store(url(bucket), cache_dir=cache, cache_bytes=3 * BLOCK, block_bytes=BLOCK)
    chunks = {chunk_name(1, 0, i): os.urandom(3 * BLOCK + 7) for i in range(3)}
    for name, data in chunks.items():
        store.write_chunk(name, [data])

    def read(seed: int) -> int:
        rng = random.Random(seed)
        for _ in range(40):
            name = rng.choice(list(chunks))
            data = chunks[name]
            at = rng.randrange(len(data))
            length = rng.randint(1, min(BLOCK + 100, len(data) - at))
            assert store.read_chunk(name, at, length) == data[at : at + length]
        return seed

    with ThreadPoolExecutor(4) as pool:
        assert sorted(pool.map(read, range(8))) == list(range(8))
    assert store.cached_bytes <= 3 * BLOCK
    on_disk = cache_files(cache)
    assert all(p.suffix == ".block" for p in on_disk), "no temporary file left"
    assert sum(p.stat().st_size for p in on_disk) <= 3 * BLOCK + len(on_disk) * 4 * (
        BLOCK // CACHE_PAGE
    )
    assert store.stats["damaged"] == 0


def test_a_block_larger_than_the_cache_is_served_but_not_cached(
    seaweedfs: SeaweedFS, bucket: str, tmp_path: Path
) -> None:
    store = seaweedfs.store(
        url(bucket), cache_dir=tmp_path / "c", cache_bytes=BLOCK - 1, block_bytes=BLOCK
    )
    data = os.urandom(3 * BLOCK)
    store.write_chunk("1/0/0", [data])
    assert store.read_chunk("1/0/0", 10, BLOCK) == data[10 : 10 + BLOCK]
    assert store.cached_bytes == 0
    assert cache_files(tmp_path / "c") == []


@pytest.mark.parametrize("where", ["page", "header", "cut"])
def test_a_damaged_cached_block_is_detected_and_fetched_again(
    seaweedfs: SeaweedFS, bucket: str, tmp_path: Path, where: str
) -> None:
    cache = tmp_path / "cache"
    store = seaweedfs.store(url(bucket), cache_dir=cache, cache_bytes=8 * BLOCK, block_bytes=BLOCK)
    data = os.urandom(BLOCK + 1000)
    store.write_chunk("1/0/0", [data])
    assert store.read_chunk("1/0/0", 100, BLOCK) == data[100 : 100 + BLOCK]  # two blocks
    assert store.stats == {"hits": 0, "fetches": 2, "damaged": 0}
    files = cache_files(cache)
    assert len(files) == 2
    block0 = next(p for p in files if p.name.endswith("-0.block"))
    raw = bytearray(block0.read_bytes())
    header = 4 * (BLOCK // CACHE_PAGE)
    if where == "page":
        raw[header + CACHE_PAGE + 7] ^= 0x01  # one bit of the block's second page
    elif where == "header":
        raw[4] ^= 0x80  # the CRC of that page
    else:
        del raw[header + CACHE_PAGE + 10 :]  # torn
    block0.write_bytes(raw)
    assert store.read_chunk("1/0/0", CACHE_PAGE, 100) == data[CACHE_PAGE : CACHE_PAGE + 100]
    assert store.stats["damaged"] == 1
    assert store.stats["fetches"] == 3, "fetched again"
    assert store.read_chunk("1/0/0", 0, len(data)) == data
    assert store.stats["damaged"] == 1, "the fetched block replaced the damaged file"
    # an undamaged page of a damaged file is not what decides: the first page read fine before
    assert store.read_chunk("1/0/0", 0, 50) == data[:50]


def test_cache_is_emptied_when_the_store_opens(
    seaweedfs: SeaweedFS, bucket: str, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    where = url(bucket)
    store = seaweedfs.store(where, cache_dir=cache, cache_bytes=8 * BLOCK, block_bytes=BLOCK)
    store.write_chunk("1/0/0", [b"a" * 100])
    assert store.read_chunk("1/0/0", 0, 10) == b"a" * 10
    (cache / "unrelated.txt").write_text("not the cache's")
    assert len(cache_files(cache)) == 2
    again = seaweedfs.store(where, cache_dir=cache, cache_bytes=8 * BLOCK, block_bytes=BLOCK)
    assert [p.name for p in cache_files(cache)] == ["unrelated.txt"]
    assert again.read_chunk("1/0/0", 0, 10) == b"a" * 10


# --- a store that stops or hangs ---------------------------------------------------------------


@pytest.fixture
def own_seaweedfs(tmp_path: Path) -> Iterator[SeaweedFS]:
    server = SeaweedFS(tmp_path / "seaweedfs")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_store_down_then_back_typed_errors_and_an_intact_cache(
    own_seaweedfs: SeaweedFS, tmp_path: Path
) -> None:
    server = own_seaweedfs
    bucket = server.create_bucket()
    cache = tmp_path / "cache"
    store = server.store(
        f"s3://{bucket}/p", cache_dir=cache, cache_bytes=16 * BLOCK, block_bytes=BLOCK, timeout=2.0
    )
    cached, other = os.urandom(2 * BLOCK), os.urandom(2 * BLOCK)
    store.write_chunk("1/0/0", [cached])
    store.write_chunk("1/0/1", [other])
    assert store.read_chunk("1/0/0") == cached
    assert store.read_chunk("1/0/1", 0, 100) == other[:100]
    before = {p.name: p.read_bytes() for p in cache_files(cache)}

    server.stop()
    # what is cached is served without the store
    assert store.read_chunk("1/0/0", 5, BLOCK) == cached[5 : 5 + BLOCK]
    # the rest is a StorageError (retriable), never CorruptData nor wrong bytes
    for attempt in (
        lambda: store.read_chunk("1/0/1", BLOCK, 100),
        lambda: store.write_chunk("1/0/2", [b"new"]),
        lambda: store.list_chunks(),
        lambda: store.delete_chunk("1/0/1"),
    ):
        with pytest.raises(StorageError, match="cannot reach") as raised:
            attempt()
        assert raised.value.retriable
        assert not isinstance(raised.value, CorruptData)
    assert {p.name: p.read_bytes() for p in cache_files(cache)} == before, "cache untouched"

    server.start()
    assert store.read_chunk("1/0/1", BLOCK, 100) == other[BLOCK : BLOCK + 100]
    assert store.read_chunk("1/0/0") == cached
    assert store.list_chunks() == ["1/0/0", "1/0/1"]
    assert store.stats["damaged"] == 0


def test_a_hung_store_times_out_with_a_storage_error(
    own_seaweedfs: SeaweedFS, tmp_path: Path
) -> None:
    server = own_seaweedfs
    bucket = server.create_bucket()
    store = server.store(
        f"s3://{bucket}/p",
        cache_dir=tmp_path / "cache",
        cache_bytes=16 * BLOCK,
        block_bytes=BLOCK,
        timeout=1.0,
        max_retries=1,
    )
    data = os.urandom(2 * BLOCK)
    store.write_chunk("1/0/0", [data])
    server.pause()  # SIGSTOP: connections are accepted by the kernel, nothing answers
    try:
        with pytest.raises(StorageError) as raised:
            store.read_chunk("1/0/0", 0, 100)
        assert not isinstance(raised.value, CorruptData)
        with pytest.raises(StorageError):
            store.write_chunk("1/0/1", [b"x"])
    finally:
        server.resume()
    assert store.cached_bytes == 0
    assert cache_files(tmp_path / "cache") == []
    assert store.read_chunk("1/0/0", 0, 100) == data[:100]
    assert store.read_chunk("1/0/0") == data


# --- orphaned chunks: the sweep (ChunkSweep) -------------------------------------------------


@pytest.fixture(params=["sqlite", "postgresql"])
def catalog(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[MetaStore]:
    if request.param == "sqlite":
        meta: MetaStore = SqliteMetaStore(tmp_path / "meta.db")
    else:
        from slipstream.storage._meta_pg import PostgresMetaStore

        meta = PostgresMetaStore(request.getfixturevalue("pg_dsn"))
    yield meta
    meta.close()


def record_of(stream_id: int, base: int, name: str, size: int) -> ChunkRecord:
    """The catalog record of a chunk of one batch of ``[base, base + 10)``."""
    index = np.array([(base, 0, size)], dtype="<i8")
    return ChunkRecord(stream_id, 0, base, base + 10, size, 1, 2, name, index.tobytes())


def listed_times(store: ObjectChunkStore) -> dict[str, float]:
    return dict(store.list_chunk_times())


def test_list_chunk_times_are_the_stores_and_leave_out_the_probe(server: S3Server) -> None:
    store = server.store(url(server.create_bucket()))
    store.check_writable()
    names = [chunk_name(1, 0, 0, writer_tag(3)), chunk_name(1, 0, 10), "journal/0/x"]
    for name in names:
        store.write_chunk(name, [b"x"])
    times = store.list_chunk_times()
    assert [name for name, _ in times] == sorted(names)
    assert [name for name, _ in store.list_chunk_times("1/")] == sorted(names[:2])
    for _, stored in times:  # seconds since 1970 by the store's clock: now, give or take
        assert abs(stored - time.time()) < 600


def test_the_sweep_deletes_a_chunk_whose_delete_failed_never_a_recorded_or_young_one(
    own_seaweedfs: SeaweedFS, catalog: MetaStore
) -> None:
    server = own_seaweedfs
    bucket = server.create_bucket()
    store = server.store(f"s3://{bucket}/p", timeout=2.0)
    stream_id = catalog.create_stream(
        "sweep/orders", [SegmentRecord(0, 0, 0, 2**64 - 1, 0)], None, None, 1
    ).id
    expired = chunk_name(stream_id, 0, 0, writer_tag(1))
    kept = chunk_name(stream_id, 0, 10)  # a name from before writers were named: still kept
    for moved, name in enumerate((expired, kept)):
        store.write_chunk(name, [b"batch" * 20])
        catalog.add_chunks(0, moved, [record_of(stream_id, 10 * moved, name, 100)])
    # retention: the record goes first, then the delete, which fails (the store is down)
    assert [r.name for r in catalog.remove_chunks_before(stream_id, {0: 10})] == [expired]
    server.stop()
    with pytest.raises(StorageError):
        store.delete_chunk(expired)
    server.start()
    # an upload whose record is not committed yet (a mover in flight), clearly younger
    in_flight = chunk_name(stream_id, 0, 20, writer_tag(1))
    store.write_chunk(in_flight, [b"new"])
    while listed_times(store)[in_flight] - listed_times(store)[expired] < 2:
        time.sleep(0.5)  # the store's clock has second steps: make the ages differ by two
        store.write_chunk(in_flight, [b"new"])
    store.write_chunk("journal/0/0000000000000000/0000000000000000", [b"j"])  # not a chunk
    times = listed_times(store)
    every = sorted(times)

    sweep = ChunkSweep(store, catalog, grace_s=600)
    assert sweep.sweep() == [], "nothing is older than the grace"
    assert store.list_chunks() == every
    # the failed delete's chunk is past the grace, the upload in flight is not
    assert sweep.sweep(now=times[in_flight] + 600 - 1) == [expired]
    assert store.list_chunks() == [n for n in every if n != expired]
    # much later, an upload never recorded is an orphan too; the recorded chunk never is
    assert sweep.sweep(now=time.time() + 10**6) == [in_flight]
    assert sorted(store.list_chunks()) == sorted(
        [kept, "journal/0/0000000000000000/0000000000000000"]
    )
    assert sweep.swept == 2
    assert bytes(store.read_chunk(kept)) == b"batch" * 20


def test_the_sweep_reads_a_segment_s_records_in_pages_and_ignores_deleted_streams(
    server: S3Server, tmp_path: Path
) -> None:
    store = server.store(url(server.create_bucket()))
    catalog = SqliteMetaStore(tmp_path / "meta.db")
    stream_id = catalog.create_stream(
        "sweep/paged", [SegmentRecord(0, 0, 0, 2**64 - 1, 0)], None, None, 1
    ).id
    recorded = [chunk_name(stream_id, 0, 10 * i, writer_tag(1)) for i in range(7)]
    for i, name in enumerate(recorded):
        store.write_chunk(name, [b"x"])
        catalog.add_chunks(0, i, [record_of(stream_id, 10 * i, name, 1)])
    # a chunk of the same segment that lost the race to another writer, and a deleted stream's
    stray = chunk_name(stream_id, 0, 30, writer_tag(2))
    gone = chunk_name(stream_id + 1, 0, 0)
    for name in (stray, gone):
        store.write_chunk(name, [b"y"])
    sweep = ChunkSweep(store, catalog, grace_s=600, page=3)
    assert sorted(sweep.sweep(now=time.time() + 10**6)) == sorted([stray, gone])
    assert store.list_chunks() == sorted(recorded)
    catalog.close()


def test_a_local_chunk_linked_now_from_an_old_journal_file_is_young(tmp_path: Path) -> None:
    """LocalChunkStore's time is the file's change time: a sealed journal file, old, adopted as
    a chunk now is as young as the link (else the sweep would delete it before its record)."""
    store = LocalChunkStore(tmp_path / "chunks", fsync=False)
    journal = tmp_path / "0000000000000000.journal"
    journal.write_bytes(b"batch")
    os.utime(journal, (time.time() - 10**6, time.time() - 10**6))
    name = chunk_name(1, 0, 0, writer_tag(1))
    store.adopt_ranges(name, journal, [(0, 5)])
    ((listed, stored),) = store.list_chunk_times()
    assert listed == name
    assert stored > time.time() - 600
    catalog = SqliteMetaStore(tmp_path / "meta.db")
    assert ChunkSweep(store, catalog, grace_s=600).sweep() == []
    assert store.list_chunks() == [name]
    catalog.close()

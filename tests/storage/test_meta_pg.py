"""PostgresMetaStore beyond the conformance suite: bad configuration is a clear StorageError at
open with nothing written (no server, wrong password or user, a schema from a newer version),
schema versions on both backends, brokers migrating one database at once, lookups that do not
wait for writes, and a server restart under an open store.
"""

from __future__ import annotations

import hashlib
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import free_port
from pg import PASSWORD, PgCluster

from slipstream import StorageError
from slipstream.storage import (
    ChunkRecord,
    SegmentRecord,
    SqliteMetaStore,
    SubscriptionRecord,
    _meta_pg,
)
from slipstream.storage import _meta as sqlite_meta
from slipstream.storage._meta_pg import PostgresMetaStore


def tables(dsn: str) -> list[tuple[str, Any]]:
    """Every table of the public schema with its rows, to compare before and after."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        names = [
            r[0]
            for r in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY tablename"
            )
        ]
        return [
            (name, conn.execute(f"SELECT * FROM {name} ORDER BY 1".encode()).fetchall())
            for name in names
        ]


@pytest.fixture
def store(pg_dsn: str) -> Iterator[PostgresMetaStore]:
    meta = PostgresMetaStore(pg_dsn)
    yield meta
    meta.close()


def test_no_server_is_a_storage_error_naming_where(pg_dsn: str) -> None:
    port = free_port()  # nothing listens there
    with pytest.raises(StorageError) as caught:
        PostgresMetaStore(f"postgresql://slipstream:x@127.0.0.1:{port}/catalog")
    message = str(caught.value)
    assert f"127.0.0.1:{port}/catalog" in message
    assert "Check that the server runs" in message
    assert caught.value.details["server"].startswith(f"127.0.0.1:{port}/catalog")


@pytest.mark.parametrize("who", ["password", "user"])
def test_wrong_credentials_are_a_storage_error_and_write_nothing(
    postgres: PgCluster, pg_dsn: str, who: str
) -> None:
    database = pg_dsn.rsplit("/", 1)[1]
    dsn = (
        postgres.dsn(database, password="not-" + PASSWORD)
        if who == "password"
        else postgres.dsn(database, user="nobody")
    )
    with pytest.raises(StorageError) as caught:
        PostgresMetaStore(dsn)
    assert "password authentication failed" in str(caught.value)
    assert PASSWORD not in str(caught.value), "the password is never shown"
    assert tables(pg_dsn) == [], "no table made"


def test_a_schema_newer_than_the_code_is_refused_and_left_as_it_was(pg_dsn: str) -> None:
    meta = PostgresMetaStore(pg_dsn)
    meta.create_stream("s/a", [SegmentRecord(0, 0, 0, 2**64 - 1, 0)], None, None, 1)
    meta.close()
    newer = _meta_pg.SCHEMA_VERSION + 1
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("UPDATE schema_version SET version = %s", (newer,))
    before = tables(pg_dsn)
    with pytest.raises(StorageError) as caught:
        PostgresMetaStore(pg_dsn)
    assert f"schema version {newer}" in str(caught.value)
    assert f"({_meta_pg.SCHEMA_VERSION})" in str(caught.value)
    assert caught.value.details == {"schema_version": newer, "supported": newer - 1}
    assert tables(pg_dsn) == before


def test_a_new_database_gets_the_current_schema_version(
    store: PostgresMetaStore, pg_dsn: str
) -> None:
    with psycopg.connect(pg_dsn) as conn:
        rows = conn.execute("SELECT version FROM schema_version").fetchall()
    assert rows == [(_meta_pg.SCHEMA_VERSION,)]


def test_brokers_opening_one_new_database_at_once_migrate_it_once(pg_dsn: str) -> None:
    opened: list[PostgresMetaStore] = []
    failed: list[BaseException] = []
    start = threading.Barrier(4)

    def open_one() -> None:
        start.wait()
        try:
            opened.append(PostgresMetaStore(pg_dsn))
        except BaseException as exc:
            failed.append(exc)

    threads = [threading.Thread(target=open_one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for meta in opened:
        meta.close()
    assert failed == []
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute("SELECT version FROM schema_version").fetchall() == [
            (_meta_pg.SCHEMA_VERSION,)
        ]


def test_lookups_do_not_wait_for_writes(pg_dsn: str) -> None:
    # every write connection held by a write waiting for a row lock: chunk lookups still answer
    meta = PostgresMetaStore(pg_dsn, pool_size=2)
    try:
        stream = meta.create_stream("s/a", [SegmentRecord(0, 0, 0, 2**64 - 1, 0)], None, None, 1).id
        chunk = ChunkRecord(stream, 0, 0, 10, 150, 1, 2, "c", b"idx")
        meta.add_chunks(0, 0, [chunk])
        meta.create_subscription(SubscriptionRecord(stream, "sub", "ordered", 1, {0: 0}))
        with psycopg.connect(pg_dsn) as holder:
            holder.execute("SELECT * FROM subscriptions FOR UPDATE")  # a transaction holds it
            writers = [
                threading.Thread(target=meta.commit_positions, args=(stream, "sub", 0, {0: n}))
                for n in range(2)
            ]
            for w in writers:
                w.start()
            with psycopg.connect(pg_dsn, autocommit=True) as conn:  # wait until both block
                for _ in range(6000):  # a bound against hanging, not a timing assertion
                    waiting = conn.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                    ).fetchone()
                    if waiting == (2,):
                        break
                    threading.Event().wait(0.01)
            assert waiting == (2,), "both writes wait for the row lock"
            try:
                assert meta.chunk_at(stream, 0, 5) == chunk
                assert meta.chunk_at_time(stream, 0, 2) == chunk
                assert [c.name for c in meta.chunks_from(stream, 0, 0, 10)] == ["c"]
            finally:
                holder.rollback()
                for w in writers:
                    w.join()
    finally:
        meta.close()


def test_an_open_store_goes_on_after_the_server_restarts(
    postgres: PgCluster, store: PostgresMetaStore
) -> None:
    stream = store.create_stream("s/a", [SegmentRecord(0, 0, 0, 2**64 - 1, 0)], None, None, 1)
    chunk = ChunkRecord(stream.id, 0, 0, 10, 150, 1, 2, "c", b"idx")
    store.add_chunks(0, 0, [chunk])
    assert store.chunk_at(stream.id, 0, 0) == chunk  # pooled connections now exist
    postgres.restart()
    store.put_setting("k", "a", b"1")  # a write first: its connection is checked
    assert store.chunk_at(stream.id, 0, 0) == chunk  # a lookup: tried again
    assert store.streams() == [stream]
    assert store.settings("k") == {"a": b"1"}


def pg_version(dsn: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute("SELECT version FROM schema_version").fetchall()


def test_an_older_schema_is_migrated_forward_and_a_failed_migration_changes_nothing(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    meta = PostgresMetaStore(pg_dsn)
    meta.create_stream("s/a", [SegmentRecord(0, 0, 0, 2**64 - 1, 0)], None, None, 1)
    streams = meta.streams()
    meta.close()
    # a build with one more migration opens this build's schema
    version = _meta_pg.SCHEMA_VERSION
    broken = "ALTER TABLE streams ADD COLUMN note TEXT; ALTER TABLE nothing ADD COLUMN x TEXT"
    monkeypatch.setattr(_meta_pg, "_MIGRATIONS", (*_meta_pg._MIGRATIONS, broken))
    monkeypatch.setattr(_meta_pg, "SCHEMA_VERSION", version + 1)
    before = tables(pg_dsn)
    with pytest.raises(StorageError, match=f"from schema version {version} to {version + 1}"):
        PostgresMetaStore(pg_dsn)
    assert tables(pg_dsn) == before, "not even the first statement of the migration"
    working = "ALTER TABLE streams ADD COLUMN note TEXT NOT NULL DEFAULT 'migrated'"
    monkeypatch.setattr(_meta_pg, "_MIGRATIONS", (*_meta_pg._MIGRATIONS[:-1], working))
    meta = PostgresMetaStore(pg_dsn)
    try:
        assert meta.streams() == streams
    finally:
        meta.close()
    assert pg_version(pg_dsn) == [(version + 1,)]
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute("SELECT note FROM streams").fetchall() == [("migrated",)]


# --- SQLite's schema versions ----------------------------------------------------------------


def sqlite_version(path: Path) -> list[tuple[Any, ...]]:
    with sqlite3.connect(path) as db:
        rows = db.execute("SELECT version FROM schema_version").fetchall()
    db.close()
    return rows


def test_an_older_sqlite_catalog_is_migrated_forward_one_step_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "meta.db"
    meta = SqliteMetaStore(path)
    meta.put_setting("k", "a", b"1")
    meta.close()
    version = sqlite_meta.SCHEMA_VERSION
    assert sqlite_version(path) == [(version,)]
    steps = (
        *sqlite_meta.SQLITE_MIGRATIONS,
        "ALTER TABLE streams ADD COLUMN note TEXT NOT NULL DEFAULT 'migrated'",
        "ALTER TABLE nothing ADD COLUMN x TEXT",  # fails: the one before stays
    )
    monkeypatch.setattr(sqlite_meta, "SQLITE_MIGRATIONS", steps)
    monkeypatch.setattr(sqlite_meta, "SCHEMA_VERSION", version + 2)
    with pytest.raises(StorageError, match=f"from schema version {version + 1} to {version + 2}"):
        SqliteMetaStore(path)
    assert sqlite_version(path) == [(version + 1,)]
    monkeypatch.setattr(sqlite_meta, "SQLITE_MIGRATIONS", steps[:-1])
    monkeypatch.setattr(sqlite_meta, "SCHEMA_VERSION", version + 1)
    meta = SqliteMetaStore(path)
    assert meta.settings("k") == {"a": b"1"}
    meta.close()
    assert sqlite_version(path) == [(version + 1,)]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_sqlite_catalog_newer_than_the_code_is_refused_and_left_as_it_was(
    tmp_path: Path,
) -> None:
    path = tmp_path / "meta.db"
    meta = SqliteMetaStore(path)
    meta.put_setting("k", "a", b"1")
    meta.close()
    newer = sqlite_meta.SCHEMA_VERSION + 1
    with sqlite3.connect(path) as db:
        db.execute("UPDATE schema_version SET version = ?", (newer,))
    db.close()
    before = digest(path)
    with pytest.raises(StorageError) as caught:
        SqliteMetaStore(path)
    assert f"schema version {newer}" in str(caught.value)
    assert f"({sqlite_meta.SCHEMA_VERSION})" in str(caught.value)
    assert str(path) in str(caught.value)
    assert caught.value.details == {"schema_version": newer, "supported": newer - 1}
    assert digest(path) == before


def test_a_sqlite_catalog_from_before_schema_versions_is_upgraded_and_keeps_its_data(
    tmp_path: Path,
) -> None:
    path = tmp_path / "meta.db"
    meta = SqliteMetaStore(path)
    meta.put_setting("k", "a", b"1")
    meta.close()
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT version FROM schema_version").fetchall() == [
            (sqlite_meta.SCHEMA_VERSION,)
        ]
        db.execute("DROP TABLE schema_version")  # as versions before schema versions left it
    db.close()
    meta = SqliteMetaStore(path)
    assert meta.settings("k") == {"a": b"1"}
    meta.close()
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT version FROM schema_version").fetchall() == [
            (sqlite_meta.SCHEMA_VERSION,)
        ]
    db.close()


def test_concurrent_writers_lose_nothing(store: PostgresMetaStore) -> None:
    # what SQLite's single writer gave for free, row locks give here: commits to different
    # segments of one subscription, and id reservations, from several threads at once
    stream = store.create_stream("s/a", [SegmentRecord(0, 0, 0, 2**64 - 1, 0)], None, None, 1)
    store.create_subscription(SubscriptionRecord(stream.id, "sub", "ordered", 1, {}))
    firsts: list[int] = []

    def work(segment: int) -> None:
        for n in range(1, 21):
            store.commit_positions(stream.id, "sub", 0, {segment: n})
            firsts.append(store.reserve_ids("ids", 10))

    threads = [threading.Thread(target=work, args=(segment,)) for segment in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (record,) = store.subscriptions(stream.id)
    assert record.positions == dict.fromkeys(range(6), 20)
    assert sorted(firsts) == list(range(0, 1200, 10)), "no block reserved twice"


# --- migration 4: cluster membership, the catalog's version, shared secrets ------------------

CLUSTER_TABLES = ("members", "catalog_version", "shared_secrets")
#: tables of the migrations after 4, dropped too to go back to version 3
LATER_TABLES = ("position_holds",)


def test_a_catalog_at_schema_version_3_gets_the_cluster_tables(tmp_path: Path, pg_dsn: str) -> None:
    """Both backends: a catalog written before migration 4 (its tables dropped, version 3)
    opens with its streams, no members, version 0, and secrets that work."""
    path = tmp_path / "meta.db"
    for open_store in (lambda: SqliteMetaStore(path), lambda: PostgresMetaStore(pg_dsn)):
        meta = open_store()
        stream = meta.create_stream("s/a", [SegmentRecord(0, 0, 0, 2**64 - 1, 0)], None, None, 1)
        meta.register_member("b1", "a:1", "a:2", 60_000)
        meta.close()
        if isinstance(meta, SqliteMetaStore):
            with sqlite3.connect(path) as db:
                for table in (*CLUSTER_TABLES, *LATER_TABLES):
                    db.execute(f"DROP TABLE {table}")
                db.execute("UPDATE schema_version SET version = 3")
            db.close()
        else:
            with psycopg.connect(pg_dsn) as conn:
                for table in (*CLUSTER_TABLES, *LATER_TABLES):
                    conn.execute(f"DROP TABLE {table}".encode())
                conn.execute("UPDATE schema_version SET version = 3")
        meta = open_store()
        try:
            assert meta.streams() == [stream]
            assert meta.members() == []
            assert meta.catalog_version() == 0
            assert meta.shared_secret("k", lambda: b"secret") == b"secret"
            meta.put_setting("k", "a", b"1")
            assert meta.catalog_version() == 1
        finally:
            meta.close()
    assert sqlite_version(path) == [(sqlite_meta.SCHEMA_VERSION,)] == [(5,)]
    assert pg_version(pg_dsn) == [(_meta_pg.SCHEMA_VERSION,)] == [(5,)]

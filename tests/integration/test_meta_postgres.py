"""A broker with its catalog on PostgreSQL (``slipstream up --meta postgresql://...``): streams,
chunks moved out of the journal, a scale event, subscriptions and their committed positions are
all in the database, and a broker restarted on it (kill -9, then a clean stop) reads everything
back. A bad --meta is a clear error at start.
"""

from __future__ import annotations

import time

import psycopg
import pytest
from conftest import BrokerProcess, free_port

EVENTS = 3000


def chunk_rows(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM chunks").fetchone()
    assert row is not None
    return int(row[0])


def test_a_broker_on_postgres_produces_restarts_and_reads_everything_back(
    broker_factory: type[BrokerProcess], pg_dsn: str
) -> None:
    broker = broker_factory("--meta", pg_dsn, "--roll", "64KiB", "--roll-seconds", "0.2").start()
    with broker.client() as client:
        client.create_stream("pg/orders", segments=2)
        client.create_subscription("pg/orders", "billing")
        with client.producer("pg/orders") as producer:
            for i in range(EVENTS // 2):
                producer.send(f"{i:06d}".encode() + b"x" * 200, key=f"k{i % 7}")
        client.scale_stream("pg/orders", split=0, into=2)
        with client.producer("pg/orders") as producer:
            for i in range(EVENTS // 2, EVENTS):
                producer.send(f"{i:06d}".encode() + b"x" * 200, key=f"k{i % 7}")
        cut = client.tail("pg/orders")
        client.commit_subscription("pg/orders", "billing", cut)
    for _ in range(600):  # the mover records chunks in PostgreSQL (a bound, not a timing)
        if chunk_rows(pg_dsn) > 0:
            break
        time.sleep(0.05)
    assert chunk_rows(pg_dsn) > 0, "journal files were moved to chunks"
    assert not (broker.data_dir / "meta.db").exists(), "no SQLite catalog beside it"

    for restart in (broker.kill, broker.stop):
        restart()
        broker.start()
        with broker.client() as client:
            info = client.describe_stream("pg/orders")
            assert len(info.segments) == 4 and info.epoch == 1
            events = list(client.reader("pg/orders", end=client.tail("pg/orders")))
            values = sorted(int(e.value[:6]) for e in events)
            assert values == list(range(EVENTS)), "every event, once"
            for k in range(7):  # per-key order across the split
                mine = [int(e.value[:6]) for e in events if e.key == f"k{k}".encode()]
                assert sorted(mine) == list(range(k, EVENTS, 7))
            positions = {
                s.segment: s.position
                for s in client.describe_subscription("pg/orders", "billing").segments
            }
            assert positions == dict(cut.positions)


def test_a_bad_meta_is_an_error_at_start(broker_factory: type[BrokerProcess], pg_dsn: str) -> None:
    nothing = f"postgresql://slipstream:x@127.0.0.1:{free_port()}/catalog"
    broker = broker_factory("--meta", nothing)
    with pytest.raises(RuntimeError, match="cannot open the catalog on PostgreSQL"):
        broker.start(timeout=30)
    with pytest.raises(RuntimeError, match="use a PostgreSQL URL"):
        broker_factory("--meta", "mysql://root@127.0.0.1/catalog").start(timeout=30)
    # a data directory with a SQLite catalog of its own is not silently left behind
    sqlite_broker = broker_factory().start()
    sqlite_broker.stop()
    moved = broker_factory("--meta", pg_dsn, data_dir=sqlite_broker.data_dir)
    with pytest.raises(RuntimeError, match="has a catalog of its own"):
        moved.start(timeout=30)

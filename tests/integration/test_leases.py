"""Container leases and fencing with brokers sharing a catalog on PostgreSQL (docs/operations.md,
"Leases and fencing"): a second broker is refused while the first holds the leases; after the
first is killed another takes them once they expire and reads every acknowledged event; a
broker paused past its lease and resumed after a takeover acknowledges nothing more and makes
no catalog write visible; a broker whose lease was taken stops acknowledging at its next
renewal. Real broker processes, a real PostgreSQL (tests/pg.py).
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
from conftest import BrokerProcess
from objectstores import ACCESS_KEY, SECRET_KEY, SeaweedFS
from proxy import CuttingProxy
from psycopg.conninfo import conninfo_to_dict

from slipstream import LeaseLost, WrongBroker

STREAM = "lease/orders"


def catalog(dsn: str, query: str) -> list[tuple[object, ...]]:
    with psycopg.connect(dsn) as conn:
        return [tuple(row) for row in conn.execute(query).fetchall()]


def leases(dsn: str) -> list[tuple[object, ...]]:
    """(container, owner, epoch, expired) of every leased container."""
    return catalog(
        dsn,
        "SELECT container, owner, epoch, expires_ms <= (extract(epoch FROM now()) * 1000) "
        "FROM leases WHERE epoch > 0 ORDER BY container",
    )


def wait_for(condition: Callable[[], bool], what: str, bound: float = 60.0) -> None:
    """Poll ``condition`` (a bound against hanging, not a timing assertion)."""
    deadline = time.monotonic() + bound
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)


def produce(broker: BrokerProcess, values: range) -> list[int]:
    """Append ``values`` one acknowledged event at a time; the values acknowledged."""
    acked = []
    with broker.client() as client, client.producer(STREAM, idempotent=False) as producer:
        for value in values:
            producer.send(f"{value:06d}".encode(), key=f"k{value % 5}").result(timeout=30)
            acked.append(value)
    return acked


def read_all(broker: BrokerProcess) -> list[int]:
    with broker.client() as client:
        events = client.reader(STREAM, end=client.tail(STREAM))
        return sorted(int(e.value) for e in events)


def test_a_second_broker_is_refused_until_the_first_is_killed_and_its_lease_expires(
    broker_factory: type[BrokerProcess], pg_dsn: str
) -> None:
    first = broker_factory("--meta", pg_dsn, "--lease-ttl", "3").start()
    with first.client() as client:
        client.create_stream(STREAM, segments=2)
    acked = produce(first, range(200))
    holders = {owner for _, owner, _, _ in leases(pg_dsn)}
    assert len(holders) == 1
    (holder,) = holders
    assert str(holder).startswith(f"127.0.0.1:{first.port}-")

    # another data directory, the same catalog: refused, naming the holder, while it lives
    second = broker_factory("--meta", pg_dsn)
    with pytest.raises(RuntimeError, match="is leased to broker") as refused:
        second.start(timeout=30)
    assert str(holder) in str(refused.value)
    assert "UTC by the catalog's clock" in str(refused.value)
    assert {owner for _, owner, _, _ in leases(pg_dsn)} == {holder}, "the refusal took nothing"

    first.kill()
    epochs = {c: e for c, _, e, _ in leases(pg_dsn)}
    # its data directory, another holder's name: starts once the leases expire (a start
    # before that is refused like the one above)
    successor = broker_factory(
        "--meta", pg_dsn, "--broker-id", "successor", data_dir=first.data_dir
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            successor.start(timeout=30)
            break
        except RuntimeError as exc:
            assert "is leased to broker" in str(exc) and str(holder) in str(exc)
            assert time.monotonic() < deadline, "the killed broker's leases never expired"
            successor.log_path.unlink()
    now = leases(pg_dsn)
    assert {owner for _, owner, _, _ in now} == {"successor"}
    assert all(epoch > epochs[c] for c, _, epoch, _ in now), "every takeover is a new epoch"
    assert read_all(successor) == acked, "every acknowledged event, once"
    acked += produce(successor, range(200, 300))
    assert read_all(successor) == acked
    assert successor.stop() == 0
    assert all(expired for *_, expired in leases(pg_dsn)), "a clean stop releases its leases"


def test_a_paused_broker_resumed_after_a_takeover_acknowledges_nothing_and_writes_nothing(
    broker_factory: type[BrokerProcess], pg_dsn: str
) -> None:
    paused = broker_factory("--meta", pg_dsn, "--lease-ttl", "2", "--roll-seconds", "0.3").start()
    with paused.client() as client:
        client.create_stream(STREAM, segments=2)
    produce(paused, range(100))
    # journal entries that the mover has yet to record in the catalog when it resumes
    client = paused.client()
    producer = client.producer(STREAM, idempotent=False)
    try:
        for value in range(100, 110):
            producer.send(f"{value:06d}".encode(), key=f"k{value % 5}").result(timeout=30)
        assert paused.proc is not None
        paused.proc.send_signal(signal.SIGSTOP)
        try:
            wait_for(lambda: all(expired for *_, expired in leases(pg_dsn)), "leases expired")
            # another data directory on the same chunks (as brokers sharing --objects would)
            taker = broker_factory("--meta", pg_dsn, "--broker-id", "taker")
            taker.data_dir.mkdir()
            (taker.data_dir / "chunks").symlink_to(paused.data_dir / "chunks")
            taker.start()
            assert {owner for _, owner, _, _ in leases(pg_dsn)} == {"taker"}
            chunks_at_takeover = catalog(pg_dsn, "SELECT name FROM chunks ORDER BY name")
            # sent while it is stopped, answered once it runs again
            in_flight = producer.send(b"999999", key="k0")
        finally:
            paused.proc.send_signal(signal.SIGCONT)
        with pytest.raises(LeaseLost):
            in_flight.result(timeout=30)
    finally:
        with contextlib.suppress(LeaseLost):  # closing reports the refused append again
            producer.close()
        client.close()
    for value in range(200, 205):  # and every later append, on fresh connections
        with pytest.raises(LeaseLost, match="lost the lease of container"):
            produce(paused, range(value, value + 1))
    # its mover tries to record the journal files it moved: the catalog's fence refuses
    wait_for(lambda: "is no longer leased to" in paused.log(), "the mover's fenced write")
    assert catalog(pg_dsn, "SELECT name FROM chunks ORDER BY name") == chunks_at_takeover
    assert "lease lost, appends to it are refused" in paused.log()
    assert {owner for _, owner, _, _ in leases(pg_dsn)} == {"taker"}
    assert taker.proc is not None and taker.proc.poll() is None


def test_a_broker_whose_lease_was_taken_stops_acknowledging_at_its_next_renewal(
    broker_factory: type[BrokerProcess], pg_dsn: str
) -> None:
    """Two processes given one --broker-id: the newer one's grant is a new epoch, and the older
    one's next renewal (a third of its ttl) finds it gone, long before the lease would expire."""
    older = broker_factory("--meta", pg_dsn, "--broker-id", "twin", "--lease-ttl", "3").start()
    with older.client() as client:
        client.create_stream(STREAM, segments=1)
    produce(older, range(10))
    newer = broker_factory("--meta", pg_dsn, "--broker-id", "twin").start()
    assert newer.proc is not None
    deadline = time.monotonic() + 60
    while True:
        try:
            produce(older, range(10, 11))
        except LeaseLost:
            break
        assert time.monotonic() < deadline, "the older broker kept acknowledging"
        time.sleep(0.05)
    assert "lease lost" in older.log()


def stopped(broker: BrokerProcess) -> bool:
    assert broker.proc is not None
    stat = Path(f"/proc/{broker.proc.pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"


def test_a_broker_paused_between_a_journal_upload_and_its_record_records_nothing_after_takeover(
    broker_factory: type[BrokerProcess], seaweedfs: SeaweedFS, pg_dsn: str, tmp_path: Path
) -> None:
    """An object journal's group is acknowledged only once its record commits in the catalog:
    a broker paused after the upload, whose lease passes to another broker meanwhile, has that
    record refused by the fence when it resumes, so the group is neither acknowledged nor
    visible, and the new holder reads every acknowledged event (from the bucket and the
    catalog alone)."""
    bucket = seaweedfs.create_bucket()
    arm = tmp_path / "pause-armed"

    def object_journal_broker(*extra: str) -> BrokerProcess:
        broker = broker_factory(
            *("--meta", pg_dsn, "--objects", f"s3://{bucket}/c"),
            *("--s3-endpoint", seaweedfs.endpoint, "--journal", "objects", "--containers", "1"),
            *extra,
        )
        broker.env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
        return broker

    paused = object_journal_broker("--lease-ttl", "2")
    paused.env.update(SLIPSTREAM_FAULT="journal.pause_before_record", SLIPSTREAM_FAULT_ARM=str(arm))
    paused.start(timeout=60)
    with paused.client() as client:
        client.create_stream(STREAM, segments=2)
    acked = produce(paused, range(150))
    arm.touch()  # the next group's upload stops the broker before its record
    client = paused.client()
    producer = client.producer(STREAM, idempotent=False)
    try:
        receipt = producer.send(b"999999", key="k0")
        wait_for(lambda: stopped(paused), "the broker paused itself before the record")
        wait_for(lambda: all(expired for *_, expired in leases(pg_dsn)), "leases expired")
        taker = object_journal_broker("--broker-id", "taker").start(timeout=60)
        records = catalog(pg_dsn, "SELECT name FROM journal_objects ORDER BY name")
        assert paused.proc is not None
        paused.proc.send_signal(signal.SIGCONT)
        try:  # the paused group's record is fenced: LeaseLost; an append that arrives after
            # the resumed broker handed the container over is WrongBroker, or is acknowledged
            # by the new holder if the client follows the move (docs/cluster.md)
            receipt.result(timeout=30)
            acked.append(999999)
        except (LeaseLost, WrongBroker):
            pass
    finally:
        if paused.proc is not None:
            paused.proc.send_signal(signal.SIGCONT)
        with contextlib.suppress(LeaseLost):
            producer.close()
        client.close()
    wait_for(lambda: "is no longer leased to" in paused.log(), "the fenced record")
    # nothing of the paused broker (lease epoch 1: names end "-1") was recorded after the
    # takeover; the new holder (epoch 2) records what it takes, a retried send included
    after = catalog(pg_dsn, "SELECT name FROM journal_objects ORDER BY name")
    new = [name for (name,) in after if (name,) not in records]
    assert not [name for name in new if name.endswith("-1")], new
    assert read_all(taker) == acked, "every acknowledged event, once; nothing unacknowledged"


def test_a_broker_cut_off_from_postgres_stops_acknowledging_when_its_lease_runs_out(
    broker_factory: type[BrokerProcess], pg_dsn: str
) -> None:
    """Renewals that cannot reach the catalog (every connection to it hangs) are no renewal:
    once the ttl has run from the last one sent, appends get LeaseLost, though the journal
    is local and the broker otherwise fine, and they keep failing."""
    port = conninfo_to_dict(pg_dsn)["port"]
    proxy = CuttingProxy(int(port))
    try:
        dsn = pg_dsn.replace(f"127.0.0.1:{port}/", f"127.0.0.1:{proxy.port}/")
        assert dsn != pg_dsn
        broker = broker_factory("--meta", dsn, "--lease-ttl", "2").start()
        with broker.client() as client:
            client.create_stream(STREAM, segments=1)
        produce(broker, range(10))
        proxy.freeze()  # a hung server: connections stay open, nothing comes back
        deadline = time.monotonic() + 60
        while True:
            try:
                produce(broker, range(10, 11))
            except LeaseLost as exc:
                assert "could not be renewed before it expired" in str(exc)
                break
            assert time.monotonic() < deadline, "it kept acknowledging without a renewal"
            time.sleep(0.05)
        for value in range(20, 23):
            with pytest.raises(LeaseLost):
                produce(broker, range(value, value + 1))
    finally:
        proxy.close()

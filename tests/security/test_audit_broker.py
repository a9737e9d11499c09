"""The audit trail on a real broker: a record for every change, the reserved ``_system``
scope, the chain across a kill -9, and ``slipstream audit verify | tail``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import msgspec
import pytest
from conftest import BrokerProcess, chunk_files

import slipstream
from slipstream.security._audit import AuditRecord, decode_record, verify_chain

AUDIT = "_system/audit"


def audit_records(client: slipstream.Client) -> list[AuditRecord]:
    end = client.tail(AUDIT)
    with client.reader(AUDIT, start="earliest", end=end) as reader:
        return [decode_record(e.value) for e in reader]


def wait_for_records(
    client: slipstream.Client, count: int, timeout: float = 15.0
) -> list[AuditRecord]:
    """The audit stream's records once it holds at least ``count`` (the writer appends a
    few milliseconds after the change)."""
    deadline = time.monotonic() + timeout
    while True:
        records = audit_records(client)
        if len(records) >= count or time.monotonic() > deadline:
            return records
        time.sleep(0.05)


def cli(broker: BrokerProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "slipstream", *args, "--broker", broker.address],
        capture_output=True,
        text=True,
        timeout=60,
    )


def logged_records(broker: BrokerProcess) -> list[dict[str, Any]]:
    """The audit records the broker wrote to its log (one JSON object per line)."""
    found = []
    for line in broker.log().splitlines():
        if "slipstream.audit" in line and '"prev_hash"' in line:
            found.append(json.loads(line[line.index("{") :]))
    return found


def test_every_change_of_streams_subscriptions_and_transactions_is_audited(
    client: slipstream.Client, broker: BrokerProcess
) -> None:
    client.create_stream("demo/orders", segments=1)
    client.update_stream("demo/orders", retention_time="7d")
    client.scale_stream("demo/orders", split=0)
    client.create_subscription("demo/orders", "billing")
    client.reset_subscription("demo/orders", "billing", "latest")
    client.delete_subscription("demo/orders", "billing")
    txn = client.transaction("t-audit")
    txn.send("demo/orders", b"x")
    with broker.client() as operator:
        operator.abort_transaction(txn.txn_id)
    client.delete_stream("demo/orders")

    records = wait_for_records(client, 8)
    assert [r.event for r in records] == [
        "stream_created",
        "stream_updated",
        "stream_scaled",
        "subscription_created",
        "subscription_reset",
        "subscription_deleted",
        "transaction_aborted",
        "stream_deleted",
    ]
    assert [r.seq for r in records] == list(range(1, 9))
    assert all(r.subject is None for r in records)  # authentication off
    assert all(r.peer.startswith("127.0.0.1:") for r in records)
    assert records[0].details == {
        "stream": "demo/orders",
        "segments": 1,
        "retention_ms": None,
        "retention_bytes": None,
        "scaling": "",
    }
    assert records[1].details["retention_ms"] == 7 * 86_400_000
    assert records[2].details == {"stream": "demo/orders", "segments": [0], "into": 2}
    assert records[3].details["subscription"] == "billing"
    assert records[6].details == {"txn_id": txn.txn_id}
    assert records[7].details == {"stream": "demo/orders"}

    values = [msgspec.json.encode(r) for r in records]
    assert verify_chain(values, trimmed=False).ok
    # the same records, hashes and all, are in the log
    logged = logged_records(broker)
    assert [entry["hash"] for entry in logged] == [r.hash for r in records]

    result = cli(broker, "audit", "verify", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] and report["records"] == 8 and report["last_seq"] == 8
    assert report["head"] == records[-1].hash and not report["mid_chain"]

    result = cli(broker, "audit", "verify")
    assert result.returncode == 0 and "audit chain OK: 8 records, seq 1..8" in result.stdout

    result = cli(broker, "audit", "tail", "-n", "2")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2
    assert "transaction_aborted" in lines[0] and "stream_deleted" in lines[1]
    assert 'stream="demo/orders"' in lines[1]

    result = cli(broker, "audit", "tail", "--json", "-n", "1")
    assert decode_record(result.stdout.strip().encode()).seq == 8


def test_the_system_scope_is_the_brokers_own(
    client: slipstream.Client, broker: BrokerProcess
) -> None:
    # listed only when its scope is asked for
    assert AUDIT not in [s.name for s in client.list_streams()]
    assert [s.name for s in client.list_streams("_system")] == [AUDIT]
    with pytest.raises(slipstream.InvalidName, match="reserved for the broker"):
        client.create_stream("_system/mine")
    with pytest.raises(slipstream.InvalidName, match="reserved for the broker"):
        client.create_stream(AUDIT)
    with pytest.raises(slipstream.PermissionDenied, match="only the broker may delete"):
        client.delete_stream(AUDIT)
    with pytest.raises(slipstream.PermissionDenied, match="only the broker may scale"):
        client.scale_stream(AUDIT, split=0)
    with pytest.raises(slipstream.PermissionDenied, match="only the broker may scale"):
        client.update_stream(AUDIT, scaling="fixed 4")
    with (
        pytest.raises(slipstream.PermissionDenied, match="only the broker may append"),
        client.producer(AUDIT) as producer,
    ):
        producer.send(b"forged")
        producer.flush()
    assert audit_records(client) == []  # nothing was written, and refusals are no changes
    # retention is the operator's to change (itself audited)
    client.update_stream(AUDIT, retention_time="365d")
    (record,) = wait_for_records(client, 1)
    assert record.event == "stream_updated" and record.details["stream"] == AUDIT


def test_the_chain_continues_after_a_kill_9(
    client: slipstream.Client, broker: BrokerProcess
) -> None:
    for n in range(5):
        client.create_stream(f"demo/s{n}")
    before = wait_for_records(client, 5)
    assert len(before) == 5
    client.close()
    broker.kill()
    broker.start()
    with broker.client() as again:
        again.create_stream("demo/after")
        again.delete_stream("demo/s0")
        records = wait_for_records(again, 7)
    assert records[:5] == before
    assert [r.seq for r in records] == list(range(1, 8))
    assert records[5].prev_hash == before[-1].hash  # recovered head: no fork
    assert verify_chain([msgspec.json.encode(r) for r in records], trimmed=False).ok
    assert f"audit chain continues after seq 5 (hash {before[-1].hash})" in broker.log()
    result = cli(broker, "audit", "verify", "--json")
    assert result.returncode == 0 and json.loads(result.stdout)["last_seq"] == 7


def test_a_clean_stop_writes_every_record_first(broker_factory: type[BrokerProcess]) -> None:
    broker = broker_factory().start()
    with broker.client() as client:
        for n in range(20):
            client.create_stream(f"demo/s{n}")
    assert broker.stop() == 0
    broker.start()
    with broker.client() as client:
        records = audit_records(client)
    assert [r.seq for r in records] == list(range(1, 21))


@pytest.mark.parametrize(
    ("tamper", "problem"),
    [
        ("edit", "seq 3 was edited"),
        ("delete", "seq 3 is missing (gap before seq 4)"),
        ("swap", "seq 3 is missing (gap before seq 4)"),
        ("forge", "seq 4 does not link to seq 3"),
    ],
)
def test_verify_reports_a_tampered_copy(
    client: slipstream.Client, broker: BrokerProcess, tamper: str, problem: str
) -> None:
    for n in range(5):
        client.create_stream(f"demo/s{n}")
    values = [msgspec.json.encode(r) for r in wait_for_records(client, 5)]
    fields = msgspec.json.decode(values[2])
    if tamper == "edit":
        fields["subject"] = "mallory"
        values[2] = msgspec.json.encode(fields)
    elif tamper == "delete":
        del values[2]
    elif tamper == "swap":
        values[2], values[3] = values[3], values[2]
    else:  # the forger recomputes the edited record's own hash
        from slipstream.security._audit import record_hash

        fields["subject"] = "mallory"
        forged = msgspec.convert(fields, AuditRecord)
        values[2] = msgspec.json.encode(msgspec.structs.replace(forged, hash=record_hash(forged)))
    client.create_stream("demo/audit-copy", segments=1)
    with client.producer("demo/audit-copy") as producer:
        for value in values:
            producer.send(value)
    result = cli(broker, "audit", "verify", "--stream", "demo/audit-copy")
    assert result.returncode == 1
    assert "audit chain BROKEN" in result.stderr and problem in result.stderr
    result = cli(broker, "audit", "verify", "--stream", "demo/audit-copy", "--json")
    assert result.returncode == 1 and not json.loads(result.stdout)["ok"]
    # the real trail is intact
    assert cli(broker, "audit", "verify").returncode == 0


def test_verify_starts_mid_chain_after_retention_trimmed_the_trail(
    broker_factory: type[BrokerProcess],
) -> None:
    broker = broker_factory(
        "--roll", "2KiB", "--roll-seconds", "0.2", "--retention-check-seconds", "0.2"
    ).start()
    with broker.client() as client:
        for n in range(40):
            client.create_stream(f"demo/s{n}")
        wait_for_records(client, 40)
        client.update_stream(AUDIT, retention_time=1)  # ms: every chunk moved out is old
        deadline = time.monotonic() + 30
        while client.describe_stream(AUDIT).segments[0].start_offset == 0:
            assert time.monotonic() < deadline, "retention never trimmed the audit stream"
            time.sleep(0.1)
        client.update_stream(AUDIT, retention_time=0)  # forever again: later records stay
        client.create_stream("demo/after")
        deadline = time.monotonic() + 15
        while (records := audit_records(client))[-1].details.get("stream") != "demo/after":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        first = client.describe_stream(AUDIT).segments[0].start_offset
        assert records[0].seq == first + 1  # offset n holds seq n + 1
    result = cli(broker, "audit", "verify", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] and report["mid_chain"]
    assert report["first_seq"] == first + 1 and report["last_seq"] == records[-1].seq
    result = cli(broker, "audit", "verify")
    assert f"started mid-chain at seq {first + 1}" in result.stdout


def test_damaged_audit_data_does_not_stop_the_broker_and_is_reported(
    broker_factory: type[BrokerProcess],
) -> None:
    broker = broker_factory("--roll", "4KiB", "--roll-seconds", "0.2").start()
    with broker.client() as client:
        for n in range(5):
            client.create_stream(f"demo/s{n}")
        wait_for_records(client, 5)
        deadline = time.monotonic() + 15
        while not chunk_files(broker.data_dir, AUDIT):  # the mover moved the records
            assert time.monotonic() < deadline, "the audit records never moved to a chunk"
            time.sleep(0.1)
    assert broker.stop() == 0
    (chunk,) = chunk_files(broker.data_dir, AUDIT)
    os.truncate(chunk, chunk.stat().st_size // 2)
    broker.start()  # a damaged audit trail must not take the platform down
    with broker.client() as client:
        client.create_stream("demo/after")
    assert "cannot be read" in broker.log()
    deadline = time.monotonic() + 15
    while not any(r["event"] == "stream_created" for r in logged_records(broker)[5:]):
        assert time.monotonic() < deadline, "no record after the restart"
        time.sleep(0.05)
    after = [(r["seq"], r["event"]) for r in logged_records(broker)[5:]]
    # numbered on past the 5 unreadable records; the first new one says what happened
    assert after[:2] == [(6, "audit_chain_damaged"), (7, "stream_created")]
    result = cli(broker, "audit", "verify")
    assert result.returncode != 0, result.stdout

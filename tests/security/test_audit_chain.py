"""The audit trail's hash chain and its verifier, pure: histories built with AuditLog, then
tampered with (an edit, a gap, a reordered pair, a forged link, a trimmed start)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Sequence

import msgspec
import pytest

from slipstream.security import AuditLog
from slipstream.security._audit import (
    GENESIS_HASH,
    AuditRecord,
    canonical,
    decode_record,
    record_hash,
    verify_chain,
)


def history(count: int, log: AuditLog | None = None) -> list[bytes]:
    """``count`` records as the audit stream would hold them (their JSON values)."""
    audit = log or AuditLog()
    audit.resume(0, GENESIS_HASH)
    for n in range(count):
        audit.record(
            "stream_created" if n % 2 else "denied",
            subject=f"user{n % 3}",
            peer="127.0.0.1:5000",
            stream=f"demo/s{n}",
            positions={n: n * 10},
        )
    return [line for _, line in audit._pending]


def rewrite(value: bytes, **changes: object) -> bytes:
    fields = msgspec.json.decode(value)
    fields.update(changes)
    return msgspec.json.encode(fields)


def rehash(value: bytes, **changes: object) -> bytes:
    """The record with ``changes`` and its own hash computed again (a careful forger)."""
    fields = msgspec.json.decode(rewrite(value, **changes))
    del fields["hash"]
    fields["hash"] = hashlib.sha256(canonical(fields)).hexdigest()
    return msgspec.json.encode(fields)


def test_an_untouched_history_verifies() -> None:
    records = history(10)
    report = verify_chain(records, trimmed=False)
    assert report.ok, report.problem
    assert (report.records, report.first_seq, report.last_seq) == (10, 1, 10)
    assert report.head == decode_record(records[-1]).hash
    assert not report.mid_chain


def test_records_link_and_hash_as_documented() -> None:
    records = [decode_record(v) for v in history(3)]
    assert [r.seq for r in records] == [1, 2, 3]
    assert records[0].prev_hash == GENESIS_HASH
    assert records[1].prev_hash == records[0].hash
    assert records[2].prev_hash == records[1].hash
    # the hash covers the canonical JSON of every other field, keys sorted
    fields = msgspec.structs.asdict(records[1])
    del fields["hash"]
    expected = hashlib.sha256(msgspec.json.encode(fields, order="sorted")).hexdigest()
    assert records[1].hash == expected == record_hash(records[1])
    # details went through JSON before hashing: an int key is a string in the record
    assert records[1].details["positions"] == {"1": 10}


def test_an_empty_history_verifies() -> None:
    report = verify_chain([], trimmed=False)
    assert report.ok and report.records == 0 and report.last_seq is None


@pytest.mark.parametrize("field", ["event", "subject", "details", "time_ms", "peer"])
def test_an_edited_record_is_caught(field: str) -> None:
    records = history(6)
    changed = {
        "event": "nothing",
        "subject": "mallory",
        "details": {"stream": "demo/other"},
        "time_ms": 1,
        "peer": "10.0.0.1:1",
    }[field]
    records[3] = rewrite(records[3], **{field: changed})
    report = verify_chain(records, trimmed=False)
    assert not report.ok
    assert report.problem_seq == 4 and report.problem_index == 3
    assert "seq 4 was edited" in (report.problem or "")
    assert report.last_seq == 3 and report.records == 3


def test_a_deleted_record_is_a_gap() -> None:
    records = history(6)
    del records[2]
    report = verify_chain(records, trimmed=False)
    assert not report.ok and report.problem_seq == 4
    assert report.problem == "seq 3 is missing (gap before seq 4)"


def test_several_deleted_records_are_named() -> None:
    records = history(8)
    del records[2:5]
    report = verify_chain(records)
    assert report.problem == "seqs 3..5 are missing (gap before seq 6)"


def test_a_reordered_pair_is_caught() -> None:
    records = history(6)
    records[2], records[3] = records[3], records[2]
    report = verify_chain(records, trimmed=False)
    assert not report.ok
    # seq 4 arrives where seq 3 belongs
    assert report.problem_seq == 4 and report.problem_index == 2
    assert "seq 3 is missing" in (report.problem or "")


def test_a_repeated_record_is_caught() -> None:
    records = history(4)
    records.insert(2, records[1])
    report = verify_chain(records, trimmed=False)
    assert not report.ok and report.problem_seq == 2
    assert "out of order or repeated" in (report.problem or "")


def test_a_forged_record_with_its_own_hash_recomputed_breaks_the_link() -> None:
    records = history(6)
    records[3] = rehash(records[3], subject="mallory")
    assert record_hash(decode_record(records[3])) == decode_record(records[3]).hash
    report = verify_chain(records, trimmed=False)
    assert not report.ok
    # the forged record itself still links back; the next one no longer links to it
    assert report.problem_seq == 5
    assert "does not link to seq 4" in (report.problem or "")


def test_an_inserted_record_with_a_wrong_prev_link_is_caught() -> None:
    records = history(4)
    forged = rehash(records[3], seq=5, prev_hash="ab" * 32)
    report = verify_chain([*records, forged], trimmed=False)
    assert not report.ok and report.problem_seq == 5
    assert "does not link to seq 4" in (report.problem or "")


def test_a_damaged_value_is_caught() -> None:
    records = history(3)
    records[1] = b"{not json"
    report = verify_chain(records)
    assert not report.ok and report.problem_seq is None and report.problem_index == 1
    assert "after seq 1 is not an audit record" in (report.problem or "")


def test_a_trimmed_history_starts_mid_chain() -> None:
    records = history(8)[3:]
    report = verify_chain(records, trimmed=True)
    assert report.ok and report.mid_chain
    assert (report.first_seq, report.last_seq, report.records) == (4, 8, 5)
    # unknown whether trimmed: accepted, said
    assert verify_chain(records).mid_chain
    # not trimmed, yet the first records are gone: that is a deletion
    refused = verify_chain(records, trimmed=False)
    assert not refused.ok and refused.problem_seq == 4
    assert "records 1..3 are missing" in (refused.problem or "")


def test_a_first_record_with_a_forged_genesis_is_caught() -> None:
    records = history(3)
    records[0] = rehash(records[0], prev_hash="ff" * 32)
    report = verify_chain(records, trimmed=False)
    assert not report.ok and report.problem_seq == 1


# --- AuditLog: chaining, log lines, the writer -----------------------------------------


def test_records_before_resume_are_chained_after_the_recovered_head() -> None:
    audit = AuditLog()
    audit.record("denied", subject="a", peer="p")
    assert audit.pending == 0  # waits for the head
    head = "cd" * 32
    audit.resume(41, head)
    audit.record("stream_deleted", subject=None, peer="p", stream="demo/x")
    records = [decode_record(line) for _, line in audit._pending]
    assert [r.seq for r in records] == [42, 43]
    assert records[0].prev_hash == head and records[1].prev_hash == records[0].hash
    assert verify_chain([line for _, line in audit._pending], trimmed=True).ok


def test_each_record_is_one_json_log_line(caplog: pytest.LogCaptureFixture) -> None:
    audit = AuditLog()
    audit.resume(0, GENESIS_HASH)
    with caplog.at_level(logging.INFO, logger="slipstream.audit"):
        audit.record("stream_created", subject="ops", peer="127.0.0.1:1", stream="demo/a")
    (line,) = [r.getMessage() for r in caplog.records if r.name == "slipstream.audit"]
    record = msgspec.json.decode(line, type=AuditRecord)
    assert record.event == "stream_created" and record.seq == 1
    assert record.details == {"stream": "demo/a"}


def test_the_writer_appends_in_order_and_keeps_records_a_failed_append_held() -> None:
    asyncio.run(asyncio.wait_for(_writer_run(), 30))


async def _writer_run() -> None:
    audit = AuditLog()
    audit.resume(0, GENESIS_HASH)
    stored: list[bytes] = []
    failures = [OSError("No space left on device")]

    async def append(values: Sequence[bytes]) -> None:
        if failures:
            raise failures.pop()
        stored.extend(values)

    writer = asyncio.create_task(audit.run(append, linger_s=0.001, retry_s=0.01))
    try:
        for n in range(5):
            audit.record("denied", subject="x", peer="p", n=n)
        await asyncio.wait_for(audit.drained(), 10)
        for n in range(5, 2500):  # more than one append holds
            audit.record("denied", subject="x", peer="p", n=n)
        await asyncio.wait_for(audit.drained(), 10)
    finally:
        writer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await writer
    assert audit.pending == 0 and audit.appended == 2500
    report = verify_chain(stored, trimmed=False)
    assert report.ok and report.last_seq == 2500


def test_a_full_queue_drops_the_oldest_from_the_stream_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    audit = AuditLog(max_pending=3)
    audit.resume(0, GENESIS_HASH)
    with caplog.at_level(logging.ERROR, logger="slipstream.audit"):
        for n in range(5):
            audit.record("denied", subject="x", peer="p", n=n)
    assert audit.dropped == 2 and audit.pending == 3
    assert [seq for seq, _ in audit._pending] == [3, 4, 5]
    assert any("dropped record seq 1" in r.getMessage() for r in caplog.records)
    # the gap is what verify then reports
    report = verify_chain([line for _, line in audit._pending], trimmed=False)
    assert not report.ok and report.problem_seq == 3

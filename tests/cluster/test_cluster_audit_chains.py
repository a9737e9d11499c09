"""A cluster's audit trail without brokers (the pure parts): several chains in one history,
each verified on its own and named; a standalone record's hash unchanged by the new field;
the writer chaining its queued records again after a conflict, saying so first."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import msgspec
import pytest

from slipstream.security._audit import (
    GENESIS_HASH,
    AuditLog,
    ChainConflict,
    broker_of,
    content_hash,
    decode_record,
    record_hash,
    verify_chains,
)


def chain_of(broker: str | None, count: int) -> list[bytes]:
    audit = AuditLog()
    audit.broker = broker
    audit.resume(0, GENESIS_HASH)
    for n in range(count):
        audit.record("stream_created", subject="ops", peer="p", stream=f"s{n}")
    return [line for _, line in audit._pending]


def interleave(*chains: list[bytes]) -> list[bytes]:
    merged: list[bytes] = []
    for row in range(max(len(c) for c in chains)):
        merged += [c[row] for c in chains if row < len(c)]
    return merged


def test_records_name_their_broker_and_the_hash_covers_it() -> None:
    (standalone,) = chain_of(None, 1)
    (clustered,) = chain_of("b1", 1)
    assert b'"broker"' not in standalone  # a standalone record is what it always was
    assert record_hash(decode_record(standalone)) == decode_record(standalone).hash
    fields = msgspec.json.decode(clustered)
    assert fields["broker"] == "b1" and broker_of(clustered) == "b1"
    assert content_hash(fields) == fields["hash"]
    fields["broker"] = "b2"  # moved to another broker's chain: an edit
    assert content_hash(fields) != fields["hash"]


def test_each_chain_is_verified_on_its_own_and_a_break_names_its_broker() -> None:
    b1 = chain_of("b1", 4)
    history = interleave(chain_of("b0", 4), b1, chain_of("b2", 3))
    reports = verify_chains(history, trimmed=False)
    assert list(reports) == ["b0", "b1", "b2"]
    assert all(r.ok for r in reports.values())
    assert [reports[b].last_seq for b in reports] == [4, 4, 3]

    # b1's seq 3 removed: b1 alone is broken, at its seq 4, whose place is named
    del history[7]  # rows: b0 b1 b2 | b0 b1 b2 | b0 [b1] b2 | b0 b1
    reports = verify_chains(history, trimmed=False)
    assert reports["b0"].ok and reports["b2"].ok
    assert not reports["b1"].ok and reports["b1"].problem_seq == 4
    assert "seq 3 is missing" in (reports["b1"].problem or "")
    assert reports["b1"].problem_index == history.index(b1[3])

    # one chain's records are not another's: a b0 record put into b2's place breaks b2
    forged = msgspec.json.decode(chain_of("b0", 4)[3])
    forged["broker"] = "b2"
    reports = verify_chains([*chain_of("b2", 3), msgspec.json.encode(forged)], trimmed=False)
    assert not reports["b2"].ok and "was edited" in (reports["b2"].problem or "")


def test_a_conflict_rechains_the_queued_records_after_the_streams_head() -> None:
    asyncio.run(asyncio.wait_for(_conflict(), 30))


async def _conflict() -> None:
    audit = AuditLog()
    audit.broker = "b1"
    audit.resume(5, "a" * 64)
    stored: list[bytes] = []
    conflicts = [ChainConflict(7, "b" * 64)]

    async def append(values: Sequence[bytes]) -> None:
        if conflicts:
            raise conflicts.pop()
        stored.extend(values)

    for n in range(3):
        audit.record("denied", subject="x", peer="p", n=n)
    writer = asyncio.create_task(audit.run(append, linger_s=0.001, retry_s=0.01))
    try:
        await asyncio.wait_for(audit.drained(), 10)
    finally:
        writer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await writer
    records = [msgspec.json.decode(v) for v in stored]
    assert [r["seq"] for r in records] == [8, 9, 10, 11]
    assert records[0]["event"] == "audit_chain_conflict"
    assert records[0]["prev_hash"] == "b" * 64
    assert records[0]["details"] == {"stream_seq": 7, "stream_head": "b" * 64, "expected_seq": 5}
    assert [r["details"].get("n") for r in records[1:]] == [0, 1, 2]
    # linked after the stream's head; verify names the conflict record as the break
    history = [msgspec.json.encode(dict(r)) for r in records]
    (report,) = verify_chains(history, trimmed=True).values()
    assert not report.ok and report.problem_seq == 8
    assert "did not write" in (report.problem or "")


def test_records_waiting_for_the_head_are_bounded_and_the_dropped_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    audit = AuditLog(max_pending=3)
    audit.broker = "b1"
    with caplog.at_level(logging.ERROR, logger="slipstream.audit"):
        for n in range(5):
            audit.record("denied", subject="x", peer="p", n=n)
    assert audit.dropped == 2
    dropped = [r.getMessage() for r in caplog.records if "before it was chained" in r.getMessage()]
    assert len(dropped) == 2 and '"n":0' in dropped[0] and '"n":1' in dropped[1]
    audit.resume(7, "c" * 64)  # the head, read at last: the three left are chained after it
    records = [msgspec.json.decode(line) for _, line in audit._pending]
    assert [(r["seq"], r["details"]["n"]) for r in records] == [(8, 2), (9, 3), (10, 4)]
    assert records[0]["prev_hash"] == "c" * 64

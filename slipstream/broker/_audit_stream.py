"""The audit stream ``_system/audit``: made by the broker at start, one segment, no retention
(kept forever unless an operator sets one), one event per audit record, appended only by the
broker's audit writer (``AuditLog.run``). See slipstream/security/_audit.py for the records and
their hash chain."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from .._errors import CorruptData, StreamExists
from ..format import (
    binary_array,
    encode_body_parts,
    encode_header,
    events_of,
    make_record_batch,
    read_body,
    timestamp_array,
    verify,
)
from ..security import AuditLog
from ..security._audit import GENESIS_HASH, decode_record
from ..streams import AUDIT_STREAM

if TYPE_CHECKING:
    from ._controller import Controller, Stream

log = logging.getLogger("slipstream.audit")


#: How many records back from the end the broker looks for a readable one when the last is
#: damaged (each is one read of one batch).
_LOOK_BACK = 1000


async def open_audit_stream(controller: Controller, audit: AuditLog) -> Stream:
    """The audit stream, created if missing; ``audit`` resumes the chain after its last
    record. A damaged last record does not stop the broker (the audit trail must not take the
    platform down): it resumes after the last readable record, numbering on as if the damaged
    ones were there, so ``audit verify`` reports them as missing, and the first new record
    (``audit_chain_damaged``) says where and why. Raises StorageError / StorageFull."""
    stream = controller.streams.get(AUDIT_STREAM)
    if stream is None:
        try:
            stream = await controller.create_stream(AUDIT_STREAM, 1, None, None, system=True)
        except StreamExists:
            stream = controller.stream(AUDIT_STREAM)
    segment = stream.segments[0]
    end = segment.next_offset
    if end == 0 or end <= segment.start_offset:
        if end:  # retention removed every record: the chain's head is gone with them
            log.warning(
                "%s holds no record (retention removed them): the audit chain starts again "
                "at seq 1",
                AUDIT_STREAM,
            )
        audit.resume(0, GENESIS_HASH)
        return stream
    damage = ""
    for offset in range(end - 1, max(segment.start_offset, end - _LOOK_BACK) - 1, -1):
        try:
            seq, head = await _record_at(controller, stream, offset)
        except CorruptData as exc:
            damage = damage or exc.message
            continue
        if damage:  # the records after ``offset`` are unreadable: number on past them
            seq += end - 1 - offset
        break
    else:  # nothing readable near the end: number on from the offsets, link to nothing
        seq, head = end, GENESIS_HASH
    audit.resume(seq, head)
    if damage:
        log.error(
            "the last records of %s cannot be read (%s): the audit chain continues after seq "
            "%d; audit verify will report the damaged records as missing",
            AUDIT_STREAM,
            damage,
            seq,
        )
        audit.record(
            "audit_chain_damaged", subject=None, peer="broker", before_seq=seq + 1, reason=damage
        )
    else:
        log.info("audit chain continues after seq %d (hash %s) in %s", seq, head, AUDIT_STREAM)
    return stream


async def _record_at(controller: Controller, stream: Stream, offset: int) -> tuple[int, str]:
    """The seq and hash of the record at ``offset``; CorruptData if it cannot be read."""
    segment = stream.segments[0]
    container = controller.containers[segment.container]
    found = None
    try:
        for batch in await container.read(segment, offset, 1):
            header = verify(batch)
            for event in events_of(read_body(batch), 0, header.base_offset):
                if event.offset == offset:
                    found = event
        if found is None or found.value is None:
            raise CorruptData(f"the record at offset {offset} cannot be read")
        record = decode_record(found.value)
    except CorruptData:
        raise
    except Exception as exc:  # a damaged body decodes into anything, or fails any way
        raise CorruptData(f"the record at offset {offset} is not an audit record: {exc}") from None
    return record.seq, record.hash


def audit_appender(
    controller: Controller, stream: Stream
) -> Callable[[Sequence[bytes]], Awaitable[None]]:
    """``append(values)``: the values as one batch of events (no key, the time of the append)
    appended to the audit stream's segment; returns once durable, raises what the append
    raised (StorageFull, StorageError: nothing of it was acknowledged)."""
    segment = stream.segments[0]
    container = controller.containers[segment.container]

    async def append(values: Sequence[bytes]) -> None:
        now = time.time_ns() // 1_000_000
        record = make_record_batch(
            binary_array([None] * len(values)),
            binary_array(list(values)),
            timestamp_array([now] * len(values)),
        )
        body = encode_body_parts(record)
        head = encode_header(body, event_count=len(values), min_timestamp=now, max_timestamp=now)
        batch = bytearray(b"".join([head, *(bytes(p) for p in body)]))
        await container.append(segment, batch, verify(batch))

    return append

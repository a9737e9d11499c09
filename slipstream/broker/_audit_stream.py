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


async def open_audit_stream(controller: Controller, audit: AuditLog) -> Stream:
    """The audit stream, created if missing; ``audit`` resumes the chain after its last
    record. Raises CorruptData if the last record cannot be read or decoded (the broker must
    not start a second chain beside a damaged one), StorageError / StorageFull."""
    stream = controller.streams.get(AUDIT_STREAM)
    if stream is None:
        try:
            stream = await controller.create_stream(AUDIT_STREAM, 1, None, None, system=True)
        except StreamExists:
            stream = controller.stream(AUDIT_STREAM)
    seq, head = await _last_record(controller, stream)
    audit.resume(seq, head)
    log.info("audit chain continues after seq %d (hash %s) in %s", seq, head, AUDIT_STREAM)
    return stream


async def _last_record(controller: Controller, stream: Stream) -> tuple[int, str]:
    segment = stream.segments[0]
    end = segment.next_offset
    if end == 0 or end <= segment.start_offset:
        if end:  # retention removed every record: the chain's head is gone with them
            log.warning(
                "%s holds no record (retention removed them): the audit chain starts again "
                "at seq 1",
                AUDIT_STREAM,
            )
        return 0, GENESIS_HASH
    container = controller.containers[segment.container]
    batches = await container.read(segment, end - 1, 1)
    last = None
    base = 0
    for batch in batches:
        header = verify(batch)
        base = header.base_offset
        for event in events_of(read_body(batch), 0, base):
            if event.offset == end - 1:
                last = event
    if last is None or last.value is None:
        raise CorruptData(
            f"the last record of {AUDIT_STREAM} (offset {end - 1}) cannot be read",
            stream=AUDIT_STREAM,
        )
    try:
        record = decode_record(last.value)
    except Exception as exc:
        raise CorruptData(
            f"the last record of {AUDIT_STREAM} (offset {end - 1}) is not an audit record: {exc}",
            stream=AUDIT_STREAM,
        ) from None
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

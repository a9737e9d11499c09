"""The audit stream ``_system/audit``: made by the broker at start, one segment, no retention
(kept forever unless an operator sets one), one event per audit record, appended only by the
broker's audit writer (``AuditLog.run``). See slipstream/security/_audit.py for the records and
their hash chain.

In a cluster (docs/cluster.md, "Audit") the stream is still one stream with one segment, in
the cluster's stores like any other, and each broker writes its own chain into it: its records
name it (``broker``) and link to its own previous record. ``ClusterAudit`` does both halves:

- every broker's writer (``run``) learns its chain's head from the stream at start (the
  broker's last record there), then hands its records to the broker serving the segment:
  itself, or another through ``Peers`` (``AppendAudit``, kind 52 -> ``AuditHead``, 99). Until the
  head is known records wait, and while the segment cannot be reached they stay queued
  (bounded, the oldest dropped past ``MAX_PENDING``, as on a standalone broker); the append is
  tried again every second.
- the broker serving the segment (``accept``) is its only writer and appends, one request at a
  time, only records that continue the sender's chain there: records it holds already (a retry
  after a lost answer or a takeover) are skipped, so nothing is stored twice; records that would
  fork the chain (the stream holds others under that id: forged, or a second process with the
  same id) are refused with the head, and the sender chains its records again after it (first
  an ``audit_chain_conflict`` record, which ``audit verify`` reports). A gap (records the sender
  dropped from a full queue) is appended: ``audit verify`` reports it. The heads are kept in
  memory while the broker serves the segment; after it takes the segment they are found by
  reading the segment backwards from its end until the asked broker's last record (the whole
  segment for a broker that never wrote).

An acknowledged record is durable in the segment's journal objects, so losing a broker's
machine loses none; a record not yet acknowledged is in that broker's log.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from .._errors import (
    BrokerUnavailable,
    CorruptData,
    InvalidArgument,
    PermissionDenied,
    SlipstreamError,
    StreamExists,
)
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
from ..protocol import AppendAudit, AuditHead
from ..security import Action, AuditLog
from ..security._audit import GENESIS_HASH, RETRY_S, ChainConflict, content_hash, decode_record
from ..streams import AUDIT_STREAM

if TYPE_CHECKING:
    from ._broker import Broker
    from ._controller import Controller, Stream
    from ._segment import Segment
    from ._service import Caller

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

    async def append(values: Sequence[bytes]) -> None:
        await _append_values(controller, segment, values)

    return append


async def _append_values(controller: Controller, segment: Segment, values: Sequence[bytes]) -> None:
    """The values as one batch of events (no key, the time of the append) appended to
    ``segment``; returns once durable."""
    now = time.time_ns() // 1_000_000
    record = make_record_batch(
        binary_array([None] * len(values)),
        binary_array(list(values)),
        timestamp_array([now] * len(values)),
    )
    body = encode_body_parts(record)
    head = encode_header(body, event_count=len(values), min_timestamp=now, max_timestamp=now)
    batch = bytearray(b"".join([head, *(bytes(p) for p in body)]))
    await controller.containers[segment.container].append(segment, batch, verify(batch))


#: (seq, hash) of the records each broker appended lately, kept by the broker serving the
#: audit segment to tell a late retry of a stored batch from a fork
_RECENT = 10_000


class ClusterAudit:
    """The audit trail of a broker in a cluster (module docstring): ``run`` writes this
    broker's chain, ``accept`` appends every broker's records while this broker serves the
    audit segment. Threads: the loop only."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.controller = broker.controller
        self.service = broker.service
        self.cluster = broker.cluster
        self.audit = broker.service.audit
        self._lock = asyncio.Lock()  # one accept at a time: the segment's writes are in order
        self._segment: Segment | None = None  # the live segment object the heads below are of
        self._heads: dict[str, tuple[int, str]] = {}
        self._recent: dict[str, OrderedDict[int, str]] = {}
        self._unscanned = 0  # offsets below this were not read yet for heads

    # --- this broker's writer --------------------------------------------------------------

    async def run(self) -> None:
        """Find this broker's head in the stream, then append its records forever (see
        ``AuditLog.run``). Never raises but CancelledError: an unreachable stream is waited
        out with the records queued."""
        broker_id = self.cluster.broker_id
        self.audit.broker = broker_id
        failing = 0
        while True:
            try:
                await self._audit_stream()
                answer = await self._send([])
                break
            except (SlipstreamError, OSError, TimeoutError) as exc:
                failing += 1
                if failing == 1 or failing % 60 == 0:
                    log.warning(
                        "the head of broker %s's audit chain cannot be read yet (%s); its "
                        "records wait, trying again every %gs",
                        broker_id,
                        exc,
                        RETRY_S,
                    )
                await asyncio.sleep(RETRY_S)
        self.audit.resume(answer.seq, answer.hash)
        log.info(
            "audit chain of broker %s continues after seq %d (hash %s) in %s",
            broker_id,
            answer.seq,
            answer.hash,
            AUDIT_STREAM,
        )
        await self.audit.run(self._append)

    async def _audit_stream(self) -> Stream:
        """The audit stream, made if no broker made it yet."""
        stream = self.controller.streams.get(AUDIT_STREAM)
        if stream is not None:
            return stream
        try:
            return await self.controller.create_stream(AUDIT_STREAM, 1, None, None, system=True)
        except StreamExists:  # made by another broker a moment ago
            await self.broker.refresh_catalog()
            return self.controller.stream(AUDIT_STREAM)

    async def _append(self, values: Sequence[bytes]) -> None:
        """``AuditLog.run``'s append: durable once it returns; ChainConflict if the stream's
        chain of this broker is not the one the values continue."""
        last = msgspec.json.decode(values[-1])
        answer = await self._send(values)
        if (answer.seq, answer.hash) != (last["seq"], last["hash"]):
            raise ChainConflict(answer.seq, answer.hash)

    async def _send(self, values: Sequence[bytes]) -> AuditHead:
        """``values`` to the broker serving the audit segment (here or another); its head of
        this broker's chain after them."""
        broker_id = self.cluster.broker_id
        segment = (await self._audit_stream()).segments[0]
        owner = ""
        try:
            if self._serves(segment):
                return await self.accept(None, broker_id, list(values))
            owner = self.cluster.owners[segment.container]
            if not owner or owner == broker_id:  # nobody serves it right now
                raise self.cluster.wrong_broker(segment.container, f"segment 0 of {AUDIT_STREAM}")
            answer = await self.service.peers.ask(owner, AppendAudit(broker_id, list(values)))
        except InvalidArgument as exc:
            if "head_seq" not in exc.details:
                raise
            raise ChainConflict(
                int(exc.details["head_seq"]), str(exc.details["head_hash"])
            ) from None
        except TimeoutError:
            raise BrokerUnavailable(f"broker {owner!r} did not answer in time") from None
        if not isinstance(answer, AuditHead):
            raise BrokerUnavailable(f"broker {owner!r} answered {type(answer).__name__}")
        return answer

    def _serves(self, segment: Segment) -> bool:
        container = self.controller.containers[segment.container]
        return self.service.is_served(segment) and container.lease_lost is None

    # --- the broker serving the audit segment -------------------------------------------------

    async def accept(self, caller: Caller | None, broker_id: str, values: list[bytes]) -> AuditHead:
        """Append ``values``, records of broker ``broker_id``'s chain, to the audit segment
        served here, if they continue that chain (``AppendAudit``; ``caller`` None: this
        broker's own writer). Returns the chain's head after them. Raises WrongBroker (not
        served here), InvalidArgument (not records of that broker, or not one run of linked
        records; with details ``head_seq`` and ``head_hash`` when they would fork the chain),
        PermissionDenied (with authentication on, a caller other than broker ``broker_id``),
        StorageError / StorageFull (nothing appended)."""
        if caller is not None:
            self.service._authorize(caller, Action.ADMIN, None)
            principal = caller.principal
            if principal is not None and principal.subject != f"broker:{broker_id}":
                raise PermissionDenied(
                    f"only broker {broker_id!r} writes its audit chain, not {principal.subject!r}"
                )
        records = [_checked(broker_id, value) for value in values]
        for before, after in itertools.pairwise(records):
            if after["seq"] != before["seq"] + 1 or after["prev_hash"] != before["hash"]:
                raise InvalidArgument(
                    f"audit records of {broker_id!r} must be one run of linked records: seq "
                    f"{after['seq']} does not follow seq {before['seq']}"
                )
        async with self._lock:
            segment = self.controller.stream(AUDIT_STREAM).segments[0]
            if not self._serves(segment):
                raise self.cluster.wrong_broker(segment.container, f"segment 0 of {AUDIT_STREAM}")
            head_seq, head_hash = await self._head(segment, broker_id)
            if not records:
                return AuditHead(broker_id, head_seq, head_hash)
            recent = self._recent.setdefault(broker_id, OrderedDict())
            last = records[-1]
            if last["seq"] <= head_seq:  # nothing new: a retry of what is stored, or a fork
                known = head_hash if last["seq"] == head_seq else recent.get(last["seq"])
                if known != last["hash"]:
                    raise _fork(broker_id, last["seq"], head_seq, head_hash)
                return AuditHead(broker_id, head_seq, head_hash)
            new = [i for i, r in enumerate(records) if r["seq"] > head_seq]
            first = records[new[0]]
            if new[0] > 0:  # the records before it are stored: the one just before is the head
                if records[new[0] - 1]["hash"] != head_hash:
                    raise _fork(broker_id, head_seq, head_seq, head_hash)
            elif first["seq"] == head_seq + 1 and first["prev_hash"] != head_hash:
                raise _fork(broker_id, first["seq"], head_seq, head_hash)
            elif first["seq"] > head_seq + 1:
                log.warning(
                    "audit chain of broker %s: records seq %d..%d never reached %s (dropped "
                    "from its full queue); audit verify will report the gap",
                    broker_id,
                    head_seq + 1,
                    first["seq"] - 1,
                    AUDIT_STREAM,
                )
            await _append_values(self.controller, segment, values[new[0] :])
            if self._segment is segment:  # (not taken from here meanwhile)
                self._heads[broker_id] = (last["seq"], last["hash"])
                for record in records[new[0] :]:
                    recent[record["seq"]] = record["hash"]
                while len(recent) > _RECENT:
                    recent.popitem(last=False)
            return AuditHead(broker_id, last["seq"], last["hash"])

    async def _head(self, segment: Segment, broker_id: str) -> tuple[int, str]:
        """Broker ``broker_id``'s last record in ``segment``: from memory, else read from the
        segment backwards (every other broker's last record met on the way is kept too)."""
        if self._segment is not segment:  # taken here since: nothing known of it
            self._segment = segment
            self._heads.clear()
            self._recent.clear()
            self._unscanned = segment.next_offset
        head = self._heads.get(broker_id)
        if head is not None:
            return head
        container = self.controller.containers[segment.container]
        below = self._unscanned
        damaged = 0
        while below > segment.start_offset and broker_id not in self._heads:
            try:
                batches = await container.read(segment, below - 1, 1)
                header = verify(batches[0])
                events = list(events_of(read_body(batches[0]), 0, header.base_offset))
            except CorruptData as exc:
                damaged += 1
                if damaged == 1:
                    log.error(
                        "%s: the batch holding offset %d cannot be read (%s): looking for the "
                        "audit chains' heads below it",
                        AUDIT_STREAM,
                        below - 1,
                        exc.message,
                    )
                below -= 1
                self._unscanned = below
                continue
            for event in reversed(events):
                if event.offset >= below or event.value is None:
                    continue
                try:
                    fields = msgspec.json.decode(event.value)
                    name, seq, digest = fields.get("broker"), fields["seq"], fields["hash"]
                except (msgspec.DecodeError, AttributeError, KeyError, TypeError):
                    continue
                known = not isinstance(name, str) or name in self._heads
                if not known and isinstance(seq, int) and isinstance(digest, str):
                    self._heads[name] = (seq, digest)
            below = min(below, header.base_offset)
            self._unscanned = below
        return self._heads.setdefault(broker_id, (0, GENESIS_HASH))


def _checked(broker_id: str, value: bytes) -> dict[str, Any]:
    """An audit record of ``broker_id`` whose hash matches its content, as a dict; else
    InvalidArgument."""
    try:
        fields = msgspec.json.decode(value)
        decode_record(value)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise InvalidArgument(f"not an audit record: {exc}") from None
    if fields.get("broker") != broker_id:
        raise InvalidArgument(
            f"an audit record of broker {fields.get('broker')!r} sent as {broker_id!r}'s"
        )
    if content_hash(fields) != fields["hash"]:
        raise InvalidArgument(f"audit record seq {fields['seq']}: its hash does not match it")
    return fields  # type: ignore[no-any-return]


def _fork(broker_id: str, seq: int, head_seq: int, head_hash: str) -> InvalidArgument:
    return InvalidArgument(
        f"audit record seq {seq} of broker {broker_id!r} does not continue its chain in "
        f"{AUDIT_STREAM}, which ends at seq {head_seq} ({head_hash}): refused, it would fork it",
        broker=broker_id,
        head_seq=head_seq,
        head_hash=head_hash,
    )

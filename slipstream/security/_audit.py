"""The audit trail: one structured, hash-chained record per authentication failure, refused
request and change of streams, subscriptions, rules and tokens.

Every record goes to the ``slipstream.audit`` logger as one JSON line, and (in a broker) to the
stream ``_system/audit``, one event per record (its value the record's JSON, its timestamp the
time of the append, no key). Records never hold secrets: no token, key or password, only token
ids and subjects.

Record layout (``AuditRecord``, JSON):

    seq        int     1, 2, 3, ... with no gap: the record's place in the chain
    time_ms    int     when ``record`` was called, milliseconds since the epoch
    event      str     what happened: authentication_failed, denied, stream_created, ...
    subject    str?    who did it (null: not authenticated, or authentication off)
    peer       str     from where (host:port)
    details    object  facts of the event (the stream, the rule, the token id, the reason)
    prev_hash  str     ``hash`` of record seq-1, 64 hex digits; 64 zeros for seq 1
    hash       str     sha256 (hex) of the canonical encoding of the other fields
    broker     str     only in a cluster: the id of the broker that wrote the record. Each
                       broker of a cluster has its own chain (its own ``seq`` from 1, its
                       ``prev_hash`` its own previous record's) in the one audit stream; a
                       standalone broker's records have no ``broker`` (absent, not null), so
                       their canonical encoding and hashes are what they always were

Canonical encoding (``canonical``): the record as a JSON object without ``hash``, keys sorted
at every level, no whitespace, as ``msgspec.json.encode(..., order="sorted")`` writes it. A
changed byte anywhere in a record changes its hash; a removed record leaves a gap in ``seq``
and a ``prev_hash`` that names no record; a record put in another place breaks the ``seq``
order and the links around it. What a chain cannot show alone is a rewrite of every record from
some point on to its end with all hashes computed again: for that, keep the head ``hash`` that
``slipstream audit verify`` prints somewhere else and compare later.

A history may hold several chains (a cluster's): ``verify_chains`` checks each one, the
records of one broker in the order they appear, as ``verify_chain`` checks one.

Write path: ``record`` runs on the event loop and never waits. It assigns the next ``seq``,
links and hashes the record (so the chain's order is the order of the calls), logs it, and
queues it; ``run`` (a broker background task) appends what is queued to the stream, batching
the records of a few milliseconds into one append, and drops them from the queue only once the
append is durable. When an append fails (a full disk) the records stay queued, an error is
logged, and the append is tried again every second: nothing is dropped silently. The queue is
bounded (``MAX_PENDING``); past it the oldest queued records are dropped from the stream's
future (an error says how many and which ``seq``), ``audit verify`` then reports the gap, and
the records themselves remain in the log. A ``kill -9`` loses the records of the last few
milliseconds that were not yet appended (they are in the log); the restarted broker continues
the chain from the last record in the stream, so the stream has no fork.

In a cluster (slipstream/broker/_audit_stream.py) ``append`` hands the records to the broker
serving the audit stream, which appends only records that continue the sender's chain there;
one that does not (the stream holds records under this broker's id that it did not write:
forged, or another process running with its id) fails the append with ``ChainConflict``.
``run`` then chains its queued records again after the stream's head for it, first an
``audit_chain_conflict`` record naming both heads, which ``verify`` reports as a break (it
says that records under this broker's name were not written by it), and appends on. Until
the broker knows its head, records wait unchained, bounded by ``MAX_PENDING`` too: past it the
oldest are dropped before they are chained, each logged whole with an error.

Cost on the event loop (2-core VM, 2026-11-24): about 10 µs a record to normalise, hash and
encode it, plus its log line (about 20 µs to a file handler). Records are control-plane events
(changes, refusals), so even a client hammering refused requests costs the loop little more
than the refusals themselves.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

log = logging.getLogger("slipstream.audit")

#: ``prev_hash`` of the first record (seq 1)
GENESIS_HASH = "0" * 64
#: records queued for the stream at most; past it the oldest are dropped (logged, and a gap
#: that ``audit verify`` reports), so a broker whose disk is full does not run out of memory
MAX_PENDING = 100_000
#: records in one append at most
MAX_RECORDS_PER_APPEND = 1000
#: how long ``run`` gathers records before an append (one append, one fsync, for a burst)
LINGER_S = 0.005
#: wait between tries of a failed append
RETRY_S = 1.0


class AuditRecord(msgspec.Struct, frozen=True):
    """One record of the audit trail (see the module docstring for the fields)."""

    seq: int
    time_ms: int
    event: str
    subject: str | None
    peer: str
    details: dict[str, Any]
    prev_hash: str
    hash: str


class ChainConflict(Exception):
    """Raised by a cluster's ``append``: the audit stream's last record of this broker is
    ``seq`` with hash ``head``, and the records sent do not continue it (nothing of them was
    appended)."""

    def __init__(self, seq: int, head: str) -> None:
        super().__init__(f"the audit stream's chain of this broker ends at seq {seq} ({head})")
        self.seq = seq
        self.head = head


def canonical(fields: dict[str, Any]) -> bytes:
    """The bytes a record's hash covers: ``fields`` (every field but ``hash``) as JSON with
    sorted keys at every level."""
    return msgspec.json.encode(fields, order="sorted")


def record_hash(record: AuditRecord) -> str:
    """The hash ``record`` should carry: sha256 of the canonical encoding of its fields other
    than ``hash``."""
    fields = msgspec.structs.asdict(record)
    del fields["hash"]
    return hashlib.sha256(canonical(fields)).hexdigest()


def content_hash(fields: dict[str, Any]) -> str:
    """The hash a record decoded as a plain object (every field it holds, ``broker`` and
    anything added included) should carry: what ``verify`` checks, so a field added to a
    record is an edit too."""
    return hashlib.sha256(canonical({k: v for k, v in fields.items() if k != "hash"})).hexdigest()


def broker_of(value: bytes) -> str:
    """The ``broker`` a record's value names ("" if none: a standalone broker's, or not a
    record)."""
    try:
        fields = msgspec.json.decode(value)
    except msgspec.DecodeError:
        return ""
    broker = fields.get("broker") if isinstance(fields, dict) else None
    return broker if isinstance(broker, str) else ""


def decode_record(value: bytes) -> AuditRecord:
    """A record from a stream event's value; raises msgspec.DecodeError /
    msgspec.ValidationError for anything else."""
    return msgspec.json.decode(value, type=AuditRecord)


class AuditLog:
    """Where the service writes audit records (``record``), and the writer that appends them
    to the audit stream (``run``).

    Until ``resume`` gives it the chain's head (the broker reads it from the stream at start),
    records wait unchained; without a stream (``run`` never called) the chain starts at seq 1
    and records only go to the log."""

    def __init__(self, *, max_pending: int = MAX_PENDING) -> None:
        self.seq = 0  # of the last record chained
        self.head = GENESIS_HASH  # its hash
        self._resumed = False
        #: records made before ``resume`` (a cluster's broker reads its head from another
        #: broker, which may take a takeover's time), bounded like the queue
        self._early: deque[tuple[int, str, str | None, str, dict[str, Any]]] = deque()
        self._pending: deque[tuple[int, bytes]] = deque()  # (seq, JSON) not yet appended
        self._max_pending = max_pending
        self._wake = asyncio.Event()
        self._drained = asyncio.Event()
        self._drained.set()
        #: records dropped from the stream because the queue was full (they were logged)
        self.dropped = 0
        #: records appended to the stream by ``run``
        self.appended = 0
        #: in a cluster: this broker's id, written into every record (its chain's name)
        self.broker: str | None = None
        self._to_stream = True  # False: ``log_only``

    def record(self, event: str, *, subject: str | None, peer: str, **details: Any) -> None:
        """Write one record: ``event`` says what happened (``authentication_failed``,
        ``denied``, ``stream_created``, ...), ``subject`` who did it (None: not
        authenticated), ``peer`` from where; ``details`` are JSON-able facts, never secrets.
        Never blocks: the record is chained and logged now, appended to the stream soon."""
        # through JSON and back: the hash must cover what a verifier decodes (int dict keys
        # become strings, tuples lists, enums their values)
        facts = msgspec.json.decode(msgspec.json.encode(details))
        entry = (time.time_ns() // 1_000_000, event, subject, peer, facts)
        if not self._resumed:
            if len(self._early) >= self._max_pending:  # never chained: logged as they were
                lost = self._early.popleft()
                self.dropped += 1
                log.error(
                    "audit queue full while the chain's head is not known yet: record dropped "
                    "before it was chained (%d dropped in all): %s",
                    self.dropped,
                    msgspec.json.encode(lost).decode(),
                )
            self._early.append(entry)
            return
        self._chain(*entry)

    def log_only(self) -> None:
        """No audit stream (a service without a broker's writer): the records are chained
        from seq 1 and go to the log only."""
        self._to_stream = False
        self.resume(0, GENESIS_HASH)

    def resume(self, seq: int, head: str) -> None:
        """Continue the chain after record ``seq`` whose hash is ``head`` (0 and GENESIS_HASH
        for an empty trail); the records made before this call are chained now, in order."""
        self.seq, self.head = seq, head
        self._resumed = True
        early, self._early = self._early, deque()
        for entry in early:
            self._chain(*entry)

    def _chain(
        self, time_ms: int, event: str, subject: str | None, peer: str, details: dict[str, Any]
    ) -> None:
        fields = {
            "seq": self.seq + 1,
            "time_ms": time_ms,
            "event": event,
            "subject": subject,
            "peer": peer,
            "details": details,
            "prev_hash": self.head,
        }
        if self.broker is not None:
            fields["broker"] = self.broker
        digest = hashlib.sha256(canonical(fields)).hexdigest()
        fields["hash"] = digest
        line = msgspec.json.encode(fields)
        self.seq += 1
        self.head = digest
        log.info("%s", line.decode())
        if not self._to_stream:
            return
        if len(self._pending) >= self._max_pending:
            lost, _ = self._pending.popleft()
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.error(
                    "audit queue full (%d records not yet in the audit stream): dropped record "
                    "seq %d from the stream (it is in this log; %d dropped in all); "
                    "'slipstream audit verify' will report the gap",
                    len(self._pending) + 1,
                    lost,
                    self.dropped,
                )
        self._pending.append((self.seq, line))
        self._drained.clear()
        self._wake.set()

    def rebase(self, seq: int, head: str) -> None:
        """Chain the queued records again after record ``seq`` with hash ``head`` (the
        stream's head for this broker, which they did not continue: ``ChainConflict``): first
        an ``audit_chain_conflict`` record naming both heads, then the queued records with
        their new seq and hashes (logged again: the log then holds both forms)."""
        queued = [msgspec.json.decode(line) for _, line in self._pending]
        self._pending.clear()
        expected = queued[0]["seq"] - 1 if queued else self.seq
        log.error(
            "the audit stream's chain of broker %s ends at seq %d (hash %s), not at seq %d "
            "where this broker left it: records under its name were written by someone else; "
            "%d queued records are chained again after it",
            self.broker,
            seq,
            head,
            expected,
            len(queued),
        )
        self.seq, self.head = seq, head
        self._chain(
            time.time_ns() // 1_000_000,
            "audit_chain_conflict",
            None,
            "broker",
            {"stream_seq": seq, "stream_head": head, "expected_seq": expected},
        )
        for fields in queued:
            self._chain(
                fields["time_ms"],
                fields["event"],
                fields["subject"],
                fields["peer"],
                fields["details"],
            )

    @property
    def pending(self) -> int:
        """Records chained but not yet durable in the audit stream."""
        return len(self._pending)

    async def drained(self) -> None:
        """Return once every record made before the call is in the stream (or dropped)."""
        await self._drained.wait()

    async def run(
        self,
        append: Callable[[Sequence[bytes]], Awaitable[None]],
        *,
        linger_s: float = LINGER_S,
        retry_s: float = RETRY_S,
    ) -> None:
        """Append queued records to the stream forever, in ``seq`` order: ``append(values)``
        must make them durable in that order or raise (nothing of them acknowledged). A
        failed append is logged and tried again after ``retry_s``, with the records that
        arrived meanwhile; the records stay queued until an append holding them succeeds."""
        failing = conflicts = 0
        while True:
            await self._wake.wait()
            await asyncio.sleep(linger_s)  # gather a burst into one append
            self._wake.clear()
            while self._pending:
                batch = [line for _, line in _first(self._pending, MAX_RECORDS_PER_APPEND)]
                first = self._pending[0][0]
                try:
                    await append(batch)
                except asyncio.CancelledError:
                    raise
                except ChainConflict as conflict:
                    conflicts += 1
                    if conflicts > 1:  # refused again at once: do not spin on the owner
                        await asyncio.sleep(retry_s)
                    self.rebase(conflict.seq, conflict.head)
                    continue
                except Exception as exc:
                    failing += 1
                    if failing == 1 or failing % 60 == 0:
                        log.error(
                            "audit records seq %d.. (%d queued) not yet in the audit stream, "
                            "retrying every %gs: %s",
                            first,
                            len(self._pending),
                            retry_s,
                            exc,
                        )
                    await asyncio.sleep(retry_s)
                    continue
                conflicts = 0
                if failing:
                    log.warning("audit stream writable again after %d failed appends", failing)
                    failing = 0
                # the queue may have dropped its oldest records while the append ran
                while self._pending and self._pending[0][0] <= first + len(batch) - 1:
                    self._pending.popleft()
                self.appended += len(batch)
            self._drained.set()


def _first(items: deque[tuple[int, bytes]], count: int) -> Iterable[tuple[int, bytes]]:
    for index, item in enumerate(items):
        if index >= count:
            return
        yield item


# --- verification -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ChainReport:
    """What ``verify_chain`` found. ``ok``: every record decodes, hashes to its ``hash`` and
    links to the one before. ``records``: how many it checked (up to the problem);
    ``first_seq`` / ``last_seq`` / ``head``: the first and last good record's seq and the
    last good hash; ``mid_chain``: the history starts after seq 1 (retention trimmed it), so
    the first record's ``prev_hash`` was taken on trust. ``problem``: what is wrong, at
    ``problem_seq`` (None if ok, or if the bad record has no readable seq) and
    ``problem_index`` (0-based position in the history)."""

    ok: bool
    records: int
    first_seq: int | None
    last_seq: int | None
    head: str | None
    mid_chain: bool
    problem: str | None = None
    problem_seq: int | None = None
    problem_index: int | None = None


def verify_chain(values: Iterable[bytes], *, trimmed: bool | None = None) -> ChainReport:
    """Check a history of audit records (event values, oldest first): each decodes, its
    ``hash`` is the hash of its content (else: edited), its ``seq`` is one more than the
    previous one's (else: missing records, or out of order), its ``prev_hash`` is the previous
    record's ``hash`` (else: forged or inserted). Stops at the first problem. A record
    ``audit_chain_conflict`` (a cluster's broker found records under its name that it did not
    write) is a problem too.

    The first record must be seq 1 with the genesis ``prev_hash``, unless the history was
    trimmed by retention: ``trimmed`` True (the stream no longer starts at offset 0) or None
    (unknown) accepts a later first record and reports ``mid_chain``; False refuses it (records
    at the start were removed). Pure: no I/O."""
    check = _ChainCheck(trimmed)
    for value in values:
        if not check.feed(value):
            break
    return check.report()


def verify_chains(
    values: Iterable[bytes], *, trimmed: bool | None = None
) -> dict[str, ChainReport]:
    """Check a history that may hold several chains (a cluster's audit stream: one per
    broker, told apart by ``broker``; "" names the records without one, a standalone
    broker's): each chain as ``verify_chain`` checks it, its records in the order they
    appear. A record that does not decode counts against the chain its ``broker`` names, if
    it can be read, else against "". ``problem_index`` is the bad record's position in the
    whole history (not in its chain). Chains sorted by name; {} for an empty history. Pure."""
    checks: dict[str, _ChainCheck] = {}
    for index, value in enumerate(values):
        name = broker_of(value)
        check = checks.get(name)
        if check is None:
            check = checks[name] = _ChainCheck(trimmed)
        check.feed(value, index)
    return {name: checks[name].report() for name in sorted(checks)}


class _ChainCheck:
    """``verify_chain`` one record at a time: ``feed`` each (False once the chain broke;
    later records are then ignored), ``report`` at the end."""

    def __init__(self, trimmed: bool | None) -> None:
        self.trimmed = trimmed
        self.count = 0
        self.first_seq: int | None = None
        self.last: AuditRecord | None = None
        self.mid_chain = False
        self.broken: ChainReport | None = None

    def _bad(self, problem: str, seq: int | None, index: int | None) -> bool:
        last = self.last
        self.broken = ChainReport(
            False,
            self.count,
            self.first_seq,
            None if last is None else last.seq,
            None if last is None else last.hash,
            self.mid_chain,
            problem,
            seq,
            self.count if index is None else index,
        )
        return False

    def feed(self, value: bytes, index: int | None = None) -> bool:
        if self.broken is not None:
            return False
        last = self.last
        try:
            fields = msgspec.json.decode(value)
            record = msgspec.convert(fields, AuditRecord)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            after = "at the start" if last is None else f"after seq {last.seq}"
            return self._bad(f"the record {after} is not an audit record ({exc})", None, index)
        if content_hash(fields) != record.hash:
            return self._bad(
                f"seq {record.seq} was edited: its hash does not match its content",
                record.seq,
                index,
            )
        if last is None:
            if record.seq == 1 and record.prev_hash != GENESIS_HASH:
                return self._bad(
                    "seq 1 does not start the chain (its prev_hash is not the genesis)", 1, index
                )
            if record.seq != 1:
                if self.trimmed is False:
                    return self._bad(
                        f"the history starts at seq {record.seq}, not 1, though nothing was "
                        f"trimmed: records 1..{record.seq - 1} are missing",
                        record.seq,
                        index,
                    )
                self.mid_chain = True
            self.first_seq = record.seq
        else:
            if record.seq <= last.seq:
                return self._bad(
                    f"seq {record.seq} comes after seq {last.seq}: records out of order or "
                    "repeated",
                    record.seq,
                    index,
                )
            if record.seq != last.seq + 1:
                missing = (
                    f"seq {last.seq + 1} is"
                    if record.seq == last.seq + 2
                    else f"seqs {last.seq + 1}..{record.seq - 1} are"
                )
                return self._bad(
                    f"{missing} missing (gap before seq {record.seq})", record.seq, index
                )
            if record.prev_hash != last.hash:
                return self._bad(
                    f"seq {record.seq} does not link to seq {last.seq} (its prev_hash is not "
                    "that record's hash): forged, or an edited record's hash recomputed",
                    record.seq,
                    index,
                )
        if record.event == "audit_chain_conflict":
            facts = record.details
            return self._bad(
                f"seq {record.seq} says the stream held records under broker "
                f"{fields.get('broker')!r}'s name up to seq {facts.get('stream_seq')} that "
                f"it did not write (it had reached seq {facts.get('expected_seq')}): forged, "
                "or another process running with its id",
                record.seq,
                index,
            )
        self.last = record
        self.count += 1
        return True

    def report(self) -> ChainReport:
        if self.broken is not None:
            return self.broken
        last = self.last
        return ChainReport(
            True,
            self.count,
            self.first_seq,
            None if last is None else last.seq,
            None if last is None else last.hash,
            self.mid_chain,
        )

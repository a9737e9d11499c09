"""The history checker: reads what every producer and reader wrote down and reports anomalies.

Inputs (see ``_records.py``): producer records (what was sent, what was acknowledged where,
which transactions committed, aborted or ended unknown), the records of readers that ran during
the faults, and the records of one *verifying* read of the whole stream, made after the last
fault and a final kill -9 and restart of the broker. The rules:

``lost``
    An acknowledged event (a plain or idempotent producer's acknowledgement, or an event of a
    transaction whose commit returned) is missing from the verifying read, and no CorruptData
    report covers where it was stored. Losses inside reported damage are counted apart, as
    ``lost_to_damage``: a deliberate bit flip destroys data, which the broker must report, not
    serve; that is not a durability failure. Without a flipped byte, damage excuses nothing.
``duplicate``
    One event read at two positions. The harness never sends an event twice and the client
    resends only batches of idempotent producers (which the broker must deduplicate), so any
    duplicate is the broker's; duplicates of idempotent and transactional events break
    exactly-once.
``order``
    Per producer and key: an event read before an acknowledged event that was sent earlier.
    (An event whose send failed may land late, after a reconnect: nothing promised otherwise.)
``aborted_read``
    An event of an aborted transaction was read.
``uncommitted_read``
    An event of a transaction was read before its commit was asked for, or of one whose commit
    was never asked for.
``partial_txn``
    A transaction of unknown outcome (its commit's answer was lost) visible in part.
``damaged_served``
    A reader got a value that is not byte for byte what its producer sent: damage served as
    valid data.
``inconsistent``
    Two reads disagree on which event a position holds, or an acknowledged event was read at
    another position than the acknowledgement named.
``phantom``
    An intact event that no producer recorded sending.
``unexpected_damage``
    CorruptData reported although no byte was flipped, more damaged ranges than flipped bytes,
    or a damaged range wider than one batch can be (a flip damages one batch); where the
    harness knows which batch each flip hit (it parses the file), damage anywhere else, or reported
    for part of a flipped batch only.

Memory grows with the number of events (a few dozen bytes each), not with their size.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

import msgspec

from ._records import (
    MAX_ROUND,
    Ack,
    Damage,
    Read,
    Record,
    Round,
    TxnBegin,
    TxnEnd,
    parse_id,
    read_records,
)

ANOMALIES = (
    "lost",
    "duplicate",
    "order",
    "aborted_read",
    "uncommitted_read",
    "partial_txn",
    "damaged_served",
    "inconsistent",
    "phantom",
    "unexpected_damage",
)
EXAMPLES = 10  # examples kept per anomaly kind

EventKey = tuple[int, int]  # (worker, sequence number)
Position = tuple[int, int]  # (segment, offset)


class Report(msgspec.Struct, kw_only=True):
    """The checker's verdict. ``ok`` is True when every anomaly count is zero."""

    ok: bool
    anomalies: dict[str, int]
    examples: dict[str, list[str]]
    counts: dict[str, int]

    def text(self) -> str:
        """A human summary: counts, then up to ``EXAMPLES`` examples of each anomaly."""
        lines = ["history: " + ("OK, no anomalies" if self.ok else "ANOMALIES FOUND")]
        lines.append("  " + ", ".join(f"{k} {v}" for k, v in self.counts.items()))
        for kind in [*ANOMALIES, *sorted(set(self.anomalies) - set(ANOMALIES))]:
            count = self.anomalies.get(kind, 0)
            if count:
                lines.append(f"  {kind}: {count}")
                lines.extend(f"    {example}" for example in self.examples.get(kind, []))
        return "\n".join(lines)


class _Txn(msgspec.Struct):
    first: int
    n: int
    abort: bool
    outcome: str = "unknown"
    commit_ts: float | None = None
    ranges: list[tuple[int, int, int]] = []


class _Checker:
    def __init__(self) -> None:
        self.counts: dict[str, int] = defaultdict(int)
        self.anomalies: dict[str, int] = dict.fromkeys(ANOMALIES, 0)
        self.examples: dict[str, list[str]] = defaultdict(list)
        self.kind: dict[int, str] = {}  # worker -> plain / idempotent / transactional
        self.sent: dict[EventKey, int] = {}  # event -> txn number (-1: not in a transaction)
        self.acked: dict[EventKey, Position] = {}
        self.txns: dict[tuple[int, int], _Txn] = {}
        self.at: dict[Position, str] = {}  # what reads found at each position
        self.where: dict[EventKey, Position] = {}  # where reads found each event
        self.key_of: dict[EventKey, int] = {}
        self.verified: dict[EventKey, Position] = {}
        self.damaged: dict[int, set[int]] = defaultdict(set)  # segment -> damaged offsets
        self.verify_damaged: dict[int, set[int]] = defaultdict(set)  # as the verifying read saw
        self.damage_ranges: set[tuple[int, int, int]] = set()
        self.excused = True  # losses inside reported damage are the flips' doing

    def report(self, kind: str, detail: str) -> None:
        self.anomalies[kind] += 1
        if len(self.examples[kind]) < EXAMPLES:
            self.examples[kind].append(detail)

    # --- inputs ------------------------------------------------------------------------------

    def producer(self, records: Iterable[Record]) -> None:
        for record in records:
            if isinstance(record, Round):
                self.kind[record.w] = record.kind
                for seq in range(record.first, record.first + record.n):
                    self.sent[(record.w, seq)] = -1
                self.counts["sent"] += record.n
            elif isinstance(record, Ack):
                for i, position in enumerate(record.pos):
                    if position is None:
                        self.counts["failed"] += 1
                    else:
                        self.acked[(record.w, record.first + i)] = (position[0], position[1])
                        self.counts["acknowledged"] += 1
            elif isinstance(record, TxnBegin):
                self.kind[record.w] = "transactional"
                self.txns[(record.w, record.txn)] = _Txn(record.first, record.n, record.abort)
                for seq in range(record.first, record.first + record.n):
                    self.sent[(record.w, seq)] = record.txn
                self.counts["sent"] += record.n
            elif isinstance(record, TxnEnd):
                txn = self.txns.get((record.w, record.txn))
                if txn is not None:
                    txn.outcome = record.outcome
                    txn.commit_ts = record.commit_ts
                    txn.ranges = record.ranges

    def reads(self, records: Iterable[Record], *, verify: bool = False) -> None:
        for record in records:
            if isinstance(record, Damage):
                end = record.resume if record.resume is not None else record.off + 1
                offsets = range(record.off, max(end, record.off + 1))
                self.damaged[record.seg].update(offsets)
                if verify:
                    self.verify_damaged[record.seg].update(offsets)
                self.damage_ranges.add((record.seg, record.off, end))
            elif isinstance(record, Read):
                self._read(record, verify)

    def _read(self, record: Read, verify: bool) -> None:
        self.counts["events_read_final" if verify else "events_read_live"] += len(record.ids)
        for i, text in enumerate(record.ids):
            position = (record.seg, record.off + i)
            if text.startswith("!"):
                self.report("damaged_served", f"at {position}: {text[1:41]}...")
                continue
            previous = self.at.setdefault(position, text)
            if previous != text:
                self.report("inconsistent", f"{position} read as {previous} and as {text}")
            worker, seq, key = parse_id(text)
            event = (worker, seq)
            self.key_of[event] = key
            first = self.where.setdefault(event, position)
            if first != position:
                self.report(
                    "duplicate",
                    f"{text} ({self.kind.get(worker, '?')}) at {first} and at {position}",
                )
            if verify:
                self.verified.setdefault(event, position)
            self._read_of_txn(event, text, record.ts)

    def _read_of_txn(self, event: EventKey, text: str, ts: float) -> None:
        txn_number = self.sent.get(event)
        if txn_number is None:
            self.report("phantom", f"{text} was read but never sent")
            return
        if txn_number < 0:
            return
        txn = self.txns[(event[0], txn_number)]
        if txn.abort or txn.outcome == "aborted":
            self.report("aborted_read", f"{text} of aborted transaction {event[0]}/{txn_number}")
        elif txn.commit_ts is None or ts < txn.commit_ts:
            self.report(
                "uncommitted_read",
                f"{text} of transaction {event[0]}/{txn_number} read before its commit",
            )

    # --- rules over the whole history ------------------------------------------------------------

    def finish(self, flips: int, flipped: Sequence[tuple[int, int, int] | None]) -> Report:
        if not flips:  # damage nobody caused is a loss like any other (e.g. an unsynced write)
            self.excused = False
        self._durability()
        self._transactions()
        self._order()
        self._damage(flips)
        if flipped and None not in flipped:
            self._damage_where_flipped([r for r in flipped if r is not None])
        self.counts["damaged_offsets"] = sum(len(s) for s in self.damaged.values())
        ok = not any(self.anomalies.values())
        return Report(
            ok=ok,
            anomalies=dict(self.anomalies),
            examples={k: v for k, v in self.examples.items() if v},
            counts=dict(self.counts),
        )

    def _in_damage(self, position: Position) -> bool:
        return self.excused and position[1] in self.damaged.get(position[0], ())

    def _durability(self) -> None:
        for event, position in self.acked.items():
            found = self.verified.get(event)
            if found is None:
                if self._in_damage(position):
                    self.counts["lost_to_damage"] += 1
                else:
                    self.report("lost", f"{event[0]}.{event[1]} acknowledged at {position}")
            elif found != position:
                self.report(
                    "inconsistent",
                    f"{event[0]}.{event[1]} acknowledged at {position}, read at {found}",
                )
        self.counts["stored_without_ack"] = sum(
            1 for e, t in self.sent.items() if t < 0 and e not in self.acked and e in self.verified
        )

    def _txn_damaged(self, txn: _Txn) -> bool:
        return self.excused and any(
            self.damaged.get(segment, set()).intersection(range(start, end))
            for segment, start, end in txn.ranges
        )

    def _transactions(self) -> None:
        for (worker, number), txn in self.txns.items():
            self.counts[f"txns_{'aborted' if txn.abort else txn.outcome}"] += 1
            events = [(worker, seq) for seq in range(txn.first, txn.first + txn.n)]
            visible = sum(1 for e in events if e in self.verified)
            name = f"transaction {worker}/{number}"
            if txn.outcome == "committed" and not txn.abort:
                self.counts["acknowledged"] += txn.n
                missing = txn.n - visible
                if not missing:
                    continue
                if self._txn_damaged(txn):
                    self.counts["lost_to_damage"] += missing
                elif visible:
                    self.report("partial_txn", f"{name}: {visible} of {txn.n} events visible")
                else:
                    self.report("lost", f"{name} committed, none of its {txn.n} events read")
            elif txn.outcome == "unknown" and 0 < visible < txn.n and not self._txn_damaged(txn):
                self.report("partial_txn", f"{name} (outcome unknown): {visible} of {txn.n}")

    def _acknowledged(self, event: EventKey) -> bool:
        txn_number = self.sent.get(event, -1)
        if txn_number < 0:
            return event in self.acked
        txn = self.txns[(event[0], txn_number)]
        return txn.outcome == "committed" and not txn.abort

    def _order(self) -> None:
        by_key: dict[tuple[int, int], list[tuple[int, Position]]] = defaultdict(list)
        for event, position in self.where.items():
            key = self.key_of.get(event)
            if key is not None:
                by_key[(event[0], key)].append((event[1], position))
        for (worker, key), events in by_key.items():
            events.sort()
            floor: Position | None = None
            floor_seq = -1
            for seq, position in events:
                if floor is not None and position[0] == floor[0] and position[1] < floor[1]:
                    self.report(
                        "order",
                        f"producer {worker} key {key}: event {seq} at {position} before "
                        f"acknowledged event {floor_seq} at {floor}",
                    )
                if self._acknowledged((worker, seq)) and (floor is None or position > floor):
                    floor, floor_seq = position, seq

    def _damage(self, flips: int) -> None:
        ranges = 0
        for segment, offsets in self.damaged.items():
            run_start = previous = None
            for offset in sorted(offsets):
                if previous is None or offset != previous + 1:
                    if run_start is not None and previous is not None:
                        self._one_range(segment, run_start, previous)
                    ranges += 1
                    run_start = offset
                previous = offset
            if run_start is not None and previous is not None:
                self._one_range(segment, run_start, previous)
        self.counts["damaged_ranges"] = ranges
        if ranges and not flips:
            self.report("unexpected_damage", f"{ranges} damaged ranges reported, no byte flipped")
        elif ranges > flips:
            self.report("unexpected_damage", f"{ranges} damaged ranges from {flips} flipped bytes")

    def _damage_where_flipped(self, flipped: list[tuple[int, int, int]]) -> None:
        """Every flip hit a known batch: damage is reported exactly there, nowhere else, and
        the verifying read (which reads every offset) names the whole batch or none of it."""
        expected: dict[int, set[int]] = defaultdict(set)
        for segment, start, end in flipped:
            expected[segment].update(range(start, end))
        for segment, offsets in self.damaged.items():
            outside = sorted(offsets - expected[segment])
            if outside:
                self.report(
                    "unexpected_damage",
                    f"segment {segment} offsets {outside[0]}..{outside[-1]} reported damaged, "
                    "outside every flipped batch",
                )
        for segment, start, end in flipped:
            batch = set(range(start, end))
            found = self.verify_damaged.get(segment, set()) & batch
            if found and found != batch:
                self.report(
                    "unexpected_damage",
                    f"segment {segment}: the flipped batch holds offsets {start}..{end - 1}, "
                    f"damage reported for {len(found)} of them",
                )

    def _one_range(self, segment: int, first: int, last: int) -> None:
        if last - first + 1 > MAX_ROUND:
            self.report(
                "unexpected_damage",
                f"segment {segment} offsets {first}..{last} damaged: wider than one batch",
            )


def check_history(
    producers: Iterable[Iterable[Record]],
    readers: Iterable[Iterable[Record]],
    verify: Iterable[Record],
    *,
    flips: int = 0,
    flipped: Sequence[tuple[int, int, int] | None] = (),
) -> Report:
    """Check one run: every producer's records, the live readers' and the verifying read's.

    ``flips``: how many bytes the harness flipped in stored files (0: any CorruptData report is
    an anomaly). ``flipped``: per flip, the batch it hit as (segment, first offset, end
    offset), or None where unknown (a journal file); when every flip's batch is known, damage
    must be reported exactly for those batches. Producer records must all be given before reads
    are judged, as they are here.
    """
    checker = _Checker()
    for records in producers:
        checker.producer(records)
    checker.reads(verify, verify=True)
    for records in readers:
        checker.reads(records)
    return checker.finish(max(flips, len(flipped)), flipped)


def check_directory(
    directory: Path, *, flips: int = 0, flipped: Sequence[tuple[int, int, int] | None] = ()
) -> Report:
    """``check_history`` over a records directory: ``producer-*.jsonl``, ``reader-*.jsonl``
    and ``verify.jsonl`` as the harness writes them."""
    return check_history(
        (read_records(p) for p in sorted(directory.glob("producer-*.jsonl"))),
        (read_records(p) for p in sorted(directory.glob("reader-*.jsonl"))),
        read_records(directory / "verify.jsonl"),
        flips=flips,
        flipped=flipped,
    )

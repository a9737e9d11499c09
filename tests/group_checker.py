"""A history checker for consumer groups (ordered mode): what every member run received.

A *run* is one process lifetime of one member. Each run writes one JSON line per event it was
handed (``Delivery``: which grant of the segment it came from, where that grant started, the
segment, offset, key and value), flushed before the next event is handed out, and one line per
commit the broker acknowledged (``Committed``). A *grant* is one assignment of a segment to a
run, from the subscription's committed position until the segment is revoked or the member
leaves (the consumer's lease: a member that rejoins after a broker restart gets new grants).

The checker, given what the producers had acknowledged and every run's records:

``lost``
    An acknowledged event that no run received: the group must deliver every event at least
    once, whatever crashed.
``phantom``
    A received value that no producer sent (it does not decode, or its key is not the key it
    was sent with).
``inconsistent``
    An acknowledged event received at another position than its acknowledgement named, one
    position received with two values, or one value received at two positions.
``order``
    Within a run, a segment's events arrive grant by grant (never an event of an earlier grant
    after one of a later grant), and within a grant they run contiguously from the grant's
    start: no skip, no repeat, no reordering. Segments written only by idempotent producers
    have no holes, which is what makes contiguity a valid demand.
``key order``
    Across segments: for each producer and key, the first deliveries (by ``time``, over all
    runs) follow the order the producer sent them (``Sent.seq``). Within a segment this
    follows from ``order``; across a split or merge, a key's later events are in a successor,
    which the group hands out only once every predecessor is committed to its end, and a
    member commits only what it was handed (and wrote down) before. So a successor's first
    event of a key is handed out after the last of that key's events in its predecessors.
``rewind``
    A grant started below a position some run had committed, with the broker's
    acknowledgement, at least ``SLACK_S`` before that grant's first event was handed out:
    committed positions only move forward (no reset here), so a grant from an older position
    means a commit was lost or ignored. The slack covers a member process that took an item
    of a grant just before it was revoked and was descheduled before writing it down; beyond
    that this assumes no zombie members (removed from the group while the process read on):
    the faults here are kill -9 and broker restarts, never a paused process.

The duplicate rate is what at-least-once costs: deliveries beyond the first of each event,
over the events delivered.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from itertools import pairwise
from pathlib import Path

import msgspec
from checker import Sent

from slipstream import Position


class Delivery(msgspec.Struct, frozen=True, tag="d"):
    """One event handed to a member run."""

    run: str
    grant: int  # which grant of the run (numbered in the order the run first saw them)
    start: int  # the offset the grant started at
    segment: int
    offset: int
    key: str
    value: str
    time: float  # time.time() when it was handed out


class Committed(msgspec.Struct, frozen=True, tag="c"):
    """Positions a member run committed, acknowledged by the broker at ``time``."""

    run: str
    positions: dict[int, int]
    time: float


Record = Delivery | Committed
#: see ``rewind``
SLACK_S = 1.0
_decode_record = msgspec.json.Decoder(Record).decode
_decode_sent = msgspec.json.Decoder(Sent).decode
encode = msgspec.json.encode


def read_records(paths: Iterable[Path]) -> Iterator[Record]:
    """Every record of every file; a line cut by kill -9 (the last of its file) is skipped."""
    for path in paths:
        lines = path.read_bytes().split(b"\n")
        for number, line in enumerate(lines):
            if not line:
                continue
            try:
                yield _decode_record(line)
            except msgspec.DecodeError:
                if number != len(lines) - 1:  # only the last line may be torn
                    raise


class GroupReport(msgspec.Struct):
    problems: list[str]
    counts: dict[str, int]

    @property
    def duplicate_rate(self) -> float:
        distinct = self.counts["distinct"]
        return (self.counts["deliveries"] - distinct) / distinct if distinct else 0.0


def check_group(
    acknowledged: Mapping[bytes, Position], records: Iterable[Record], limit: int = 20
) -> GroupReport:
    """Check a whole group history (see the module docstring); ``problems`` is empty when it
    is correct (at most ``limit`` examples of each kind)."""
    found: dict[str, list[str]] = defaultdict(list)

    def problem(kind: str, text: str) -> None:
        if len(found[kind]) < limit:
            found[kind].append(f"{kind}: {text}")

    value_at: dict[Position, str] = {}
    position_of: dict[str, Position] = {}
    deliveries = 0
    runs: set[str] = set()
    grants: dict[tuple[str, int, int], tuple[int, float]] = {}  # -> (start, first handed out)
    last: dict[tuple[str, int], tuple[int, int]] = {}  # (run, segment) -> (grant, offset)
    commits: list[tuple[float, int, int]] = []  # (time, segment, position)
    first_seen: dict[str, tuple[float, Sent]] = {}  # value -> (first handed out, what it is)
    for record in records:
        if isinstance(record, Committed):
            commits.extend((record.time, s, p) for s, p in record.positions.items())
            continue
        deliveries += 1
        runs.add(record.run)
        here = Position(record.segment, record.offset)
        try:
            sent = _decode_sent(record.value)
        except msgspec.DecodeError:
            problem("phantom", f"{record.value!r} at {here} is not a value any producer sent")
        else:
            if sent.key != record.key:
                problem("phantom", f"{record.value!r} at {here} came with key {record.key!r}")
            seen = first_seen.get(record.value)
            if seen is None or record.time < seen[0]:
                first_seen[record.value] = (record.time, sent)
        if value_at.setdefault(here, record.value) != record.value:
            problem("inconsistent", f"{here} held {value_at[here]!r}, then {record.value!r}")
        if position_of.setdefault(record.value, here) != here:
            problem("inconsistent", f"{record.value!r} at {position_of[record.value]} and {here}")
        grant = (record.run, record.segment, record.grant)
        grants.setdefault(grant, (record.start, record.time))
        previous = last.get((record.run, record.segment))
        if previous is None or previous[0] != record.grant:
            if previous is not None and previous[0] > record.grant:
                problem(
                    "order",
                    f"run {record.run}: {here} of grant {record.grant} after grant {previous[0]}",
                )
            if record.offset != record.start:
                problem(
                    "order",
                    f"run {record.run}: grant {record.grant} of segment {record.segment} "
                    f"started at {record.start} but its first event is {record.offset}",
                )
        elif record.offset != previous[1] + 1:
            problem(
                "order",
                f"run {record.run}: {here} came after offset {previous[1]} (grant {record.grant})",
            )
        last[(record.run, record.segment)] = (record.grant, record.offset)
    for value, position in acknowledged.items():
        text = value.decode()
        if text not in position_of:
            problem("lost", f"acknowledged {text} at {position} was never delivered")
        elif position_of[text] != position:
            problem(
                "inconsistent", f"acknowledged {text} at {position}, read at {position_of[text]}"
            )
    per_key: dict[tuple[int, str], list[tuple[int, float, str]]] = defaultdict(list)
    for value, (handed, sent) in first_seen.items():
        per_key[(sent.producer, sent.key)].append((sent.seq, handed, value))
    for (producer, key), firsts in per_key.items():
        firsts.sort()
        for (_, before, earlier), (_, after, later) in pairwise(firsts):
            if after < before:
                problem(
                    "key order",
                    f"producer {producer} key {key}: {later} at {position_of[later]} was first "
                    f"handed out {before - after:.3f} s before {earlier} at "
                    f"{position_of[earlier]}",
                )
    commits.sort()
    for (run, segment, grant), (start, first) in grants.items():
        before = [p for t, s, p in commits if s == segment and t < first - SLACK_S]
        if before and max(before) > start:
            problem(
                "rewind",
                f"run {run}: grant {grant} of segment {segment} started at {start}, below "
                f"position {max(before)} committed before it",
            )
    return GroupReport(
        [line for kind in sorted(found) for line in found[kind]],
        {
            "acknowledged": len(acknowledged),
            "deliveries": deliveries,
            "distinct": len(value_at),
            "runs": len(runs),
            "grants": len(grants),
            "commits": len(commits),
        },
    )

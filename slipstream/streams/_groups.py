"""Consumer groups, the pure part: which member reads which segment.

``assign`` is balanced and sticky: every member gets ``n // m`` or ``n // m + 1`` of the ``n``
segments, and a segment stays with the member that has it whenever balance allows, so a member
joining or leaving moves only the segments that must move (an incremental rebalance: the others
never pause). Members and segments are ordered deterministically, so the same inputs give the
same assignment on any broker.

On an elastic stream only some segments may be assigned at a time (``assignable``): a
successor waits until the subscription has committed every predecessor to its end, so each
key's events are delivered in append order across splits and merges.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NamedTuple

from ._graph import read_order


def assign(
    segments: Iterable[int], members: Iterable[str], current: Mapping[int, str]
) -> dict[int, str]:
    """The target owner of every segment among ``members``, keeping ``current`` owners
    (segment -> member) where balance allows. Empty when there are no members."""
    segments, members = sorted(set(segments)), sorted(set(members))
    if not members:
        return {}
    base, extra = divmod(len(segments), len(members))
    kept: dict[str, list[int]] = {m: [] for m in members}
    for segment in segments:
        owner = current.get(segment)
        if owner in kept:
            kept[owner].append(segment)
    # members that already hold the most keep the extra slots: fewer moves
    by_holding = sorted(members, key=lambda m: (-len(kept[m]), m))
    quota = {m: base + (1 if i < extra else 0) for i, m in enumerate(by_holding)}
    target: dict[int, str] = {}
    free: list[int] = []
    for member in members:
        keep, spill = kept[member][: quota[member]], kept[member][quota[member] :]
        target.update(dict.fromkeys(keep, member))
        free.extend(spill)
    free.extend(s for s in segments if current.get(s) not in kept)
    free.sort(reverse=True)  # handed out from the lowest
    for member in members:
        for _ in range(quota[member] - len(kept[member][: quota[member]])):
            target[free.pop()] = member
    return target


class SegmentProgress(NamedTuple):
    """What the read-order rule needs to know of one segment for one subscription: the
    segments it succeeded, whether a scale sealed it, where the subscription's committed
    position is (never below the first retained event) and where the segment ends (its final
    end once sealed)."""

    predecessors: tuple[int, ...]
    sealed: bool
    position: int
    end: int


def assignable(progress: Mapping[int, SegmentProgress]) -> list[int]:
    """The segments (by number) an ordered group may hand to its members now: those not
    complete whose predecessors are all complete.

    A segment is complete when it is sealed, the subscription's position is at (or past) its
    end (committed there, or its data is gone), and its predecessors are complete: an empty
    sealed segment does not let its successors overtake its own predecessors. A predecessor
    missing from ``progress`` (its record deleted with its data) counts as complete.
    Predecessors have lower numbers than their successors (a scale numbers successors after
    the highest segment so far).

    This is the per-key order rule of :meth:`SegmentGraph.readable` for a subscription: a key's
    events before a scale are in a predecessor and those after it in a successor, so a member
    may read a successor only once every predecessor has been committed to its end, whoever
    read it. A complete segment is no longer assigned (its holder is told to revoke it).
    """

    def complete(number: int) -> bool:
        one = progress[number]
        return one.sealed and one.position >= one.end

    return read_order({n: one.predecessors for n, one in progress.items()}, complete)[1]

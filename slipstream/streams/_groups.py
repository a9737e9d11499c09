"""Consumer groups, the pure part: which member reads which segment.

``assign`` is balanced and sticky: every member gets ``n // m`` or ``n // m + 1`` of the ``n``
segments, and a segment stays with the member that has it whenever balance allows, so a member
joining or leaving moves only the segments that must move (an incremental rebalance: the others
never pause). Members and segments are ordered deterministically, so the same inputs give the
same assignment on any broker.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


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

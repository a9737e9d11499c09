"""Assignment of containers to the live brokers of a cluster.

Pure functions: no clock, no I/O, no randomness. Every broker computes the same answer from the
same inputs (the live members and the current lease holders, both read from the catalog), so no
broker has to tell another what to do; a broker only takes the containers ``assign`` gives it and
hands over the ones it gives to someone else.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence


def assign(containers: int, members: Sequence[str], holders: Mapping[int, str]) -> dict[int, str]:
    """Map every container ``0..containers-1`` to one of ``members`` (the live broker ids).

    Guarantees:

    * balanced: the members' counts differ by at most one;
    * sticky: a container stays with its live holder unless that holder is above its share, so a
      member joining or leaving moves only the containers that must move (the fewest possible);
    * deterministic: the answer depends only on the set of members and on ``holders``, not on
      their order; a holder above its share gives up its lowest-numbered containers first, and
      free containers go, lowest first, to the members in sorted order.

    ``holders`` maps containers to the broker holding them now; holders that are not in
    ``members`` (dead brokers) count as no holder, and entries outside ``0..containers-1`` are
    ignored. With no members the answer is ``{}``: nobody can serve anything. Applying ``assign``
    to its own answer gives the same answer back. Raises ValueError if ``containers`` < 0.
    """
    if containers < 0:
        raise ValueError(f"containers must be >= 0, got {containers}")
    live = sorted(set(members))
    if not live:
        return {}
    held: dict[str, list[int]] = {member: [] for member in live}
    for container in range(containers):
        holder = holders.get(container)
        if holder in held:
            held[holder].append(container)
    # Shares are floor or floor+1; the +1 goes to the members holding the most, which keeps the
    # most containers where they are (ties: sorted member order, for determinism).
    base, extra = divmod(containers, len(live))
    by_holding = sorted(live, key=lambda member: (-len(held[member]), member))
    share = {member: base + (1 if rank < extra else 0) for rank, member in enumerate(by_holding)}
    result: dict[int, str] = {}
    missing: dict[str, int] = {}
    for member in live:
        kept = held[member][max(0, len(held[member]) - share[member]) :]
        result.update((container, member) for container in kept)
        missing[member] = share[member] - len(kept)
    free = iter([container for container in range(containers) if container not in result])
    for member in live:
        result.update((next(free), member) for _ in range(missing[member]))
    return dict(sorted(result.items()))


def coordinator(key: str, containers: int) -> int:
    """The container that coordinates ``key``: a subscription's group (key ``"stream/name"``) or
    a transactional id. ``crc32(key) % containers``: stable across processes and versions, unlike
    ``hash()``. Raises ValueError if ``containers`` < 1."""
    if containers < 1:
        raise ValueError(f"containers must be >= 1, got {containers}")
    return zlib.crc32(key.encode()) % containers

"""Tenant quotas: per scope, produce and consume bytes per second, requests per second and
open connections. Pure accounting (the clock is passed in); the broker's Session applies what
it computes as delays, and the Service owns one ``Quotas`` and stores its settings.

Each rate is a token bucket kept as a GCRA ("theoretical arrival time", ``_Bucket``): a charge
of ``n`` units is always accepted and answered with how long its caller must wait before it
counts as admitted (0 while the bucket holds tokens). The bucket may go into debt, so a single
batch larger than the bucket is not refused, only delayed. What this guarantees (and
tests/security/test_quotas_accounting.py checks with hypothesis): if each charge is admitted at
``now + delay``, then over any window of ``w`` seconds the units admitted are at most ``rate *
w + max(burst, largest single charge)``; delays are never negative; a scope with no quota
(the default) is never delayed; a quota set, changed or removed applies to the next charge
(a change starts the scope's buckets afresh: debt under the old rate is forgiven, delays
already handed out stay).

The burst is one second of the rate. Connections are a count, not a rate: a connection over
its scope's limit is refused (the only quota that refuses; every other one delays).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import msgspec

from .._errors import InvalidArgument, LimitExceeded

#: what each rate quota counts, as the Quota field and the metric label
PRODUCE = "produce"
CONSUME = "consume"
REQUESTS = "requests"


class Quota(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One scope's limits; None for no limit. ``produce_bytes`` / ``consume_bytes``: bytes of
    record batches per second appended to / sent from the scope's streams; ``requests``:
    requests per second (an Append counts as one); ``connections``: open connections of
    principals whose token is limited to the scope (authentication on)."""

    produce_bytes: int | None = None
    consume_bytes: int | None = None
    requests: int | None = None
    connections: int | None = None

    def __post_init__(self) -> None:
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise InvalidArgument(
                    f"quota {name} must be positive, not {value} (leave it out for no limit)",
                    parameter=name,
                )

    @property
    def empty(self) -> bool:
        return all(getattr(self, name) is None for name in self.__struct_fields__)


@dataclass(slots=True)
class _Bucket:
    """A token bucket of ``rate`` units per second holding up to ``burst`` units, as GCRA:
    ``tat`` is when the bucket would be full again with no more charges."""

    rate: float
    burst: float
    tat: float = float("-inf")

    def charge(self, units: float, now: float) -> float:
        """Take ``units``; the seconds (>= 0) to wait until they count as admitted."""
        self.tat = max(self.tat, now) + units / self.rate
        wait = self.tat - self.burst / self.rate - now
        return wait if wait > 1e-9 else 0.0  # below a nanosecond: rounding, not debt


class Quotas:
    """The quotas of every scope, the buckets that enforce them, and open connections per
    scope. Single-threaded: the broker's event loop owns it."""

    def __init__(
        self, quotas: Mapping[str, Quota] | None = None, *, clock: Callable[[], float]
    ) -> None:
        self._clock = clock
        self._quotas: dict[str, Quota] = {}
        self._buckets: dict[tuple[str, str], _Bucket] = {}
        self._connections: dict[str, int] = {}
        for scope, quota in (quotas or {}).items():
            self.set(scope, quota)

    # --- settings ------------------------------------------------------------------------------

    def set(self, scope: str, quota: Quota) -> None:
        """Set (or replace) the scope's quota; from the next charge on it applies."""
        if quota.empty:
            self.delete(scope)
            return
        self._quotas[scope] = quota
        self._forget_buckets(scope)

    def delete(self, scope: str) -> bool:
        """No quota for the scope any more (False if it had none)."""
        self._forget_buckets(scope)
        return self._quotas.pop(scope, None) is not None

    def get(self, scope: str) -> Quota | None:
        return self._quotas.get(scope)

    def items(self) -> Iterator[tuple[str, Quota]]:
        return iter(sorted(self._quotas.items()))

    def _forget_buckets(self, scope: str) -> None:
        for kind in (PRODUCE, CONSUME, REQUESTS):
            self._buckets.pop((scope, kind), None)

    # --- rates ---------------------------------------------------------------------------------

    def charge(self, scope: str | None, kind: str, units: int) -> float:
        """Count ``units`` of ``kind`` (PRODUCE / CONSUME bytes, REQUESTS) for ``scope``: the
        seconds the caller must wait (0.0 without a quota, or within it)."""
        if scope is None:
            return 0.0
        quota = self._quotas.get(scope)
        if quota is None:
            return 0.0
        rate = _RATE_OF[kind](quota)
        if rate is None:
            return 0.0
        bucket = self._buckets.get((scope, kind))
        if bucket is None:
            bucket = self._buckets[(scope, kind)] = _Bucket(float(rate), float(rate))
        return bucket.charge(units, self._clock())

    def burst(self, scope: str | None, kind: str) -> int | None:
        """The most units one charge of ``kind`` should carry for ``scope`` (one second of its
        rate), None without a limit: the Session sends consumed data in frames of at most
        this, so that a small quota gets a steady flow, not a large frame and a long pause."""
        quota = self._quotas.get(scope) if scope is not None else None
        return _RATE_OF[kind](quota) if quota is not None else None

    # --- connections ---------------------------------------------------------------------------

    def open_connection(self, scope: str | None) -> None:
        """Count one more connection of ``scope``. Raises LimitExceeded (nothing counted) when
        the scope has its quota's number open already. An unscoped connection always passes
        and is not counted."""
        if scope is None:
            return
        quota = self._quotas.get(scope)
        count = self._connections.get(scope, 0)
        if quota is not None and quota.connections is not None and count >= quota.connections:
            raise LimitExceeded(
                f"scope {scope!r} has {count} connections open, its quota's limit; close one "
                "first, or ask an administrator to raise it (slipstream quota set "
                f"{scope} --connections N)",
                limit=quota.connections,
                scope=scope,
            )
        self._connections[scope] = count + 1

    def close_connection(self, scope: str | None) -> None:
        """One connection counted by ``open_connection`` closed."""
        if scope is None:
            return
        count = self._connections.get(scope, 0) - 1
        if count > 0:
            self._connections[scope] = count
        else:
            self._connections.pop(scope, None)

    def connections(self, scope: str) -> int:
        return self._connections.get(scope, 0)


_RATE_OF: dict[str, Callable[[Quota], int | None]] = {
    PRODUCE: lambda q: q.produce_bytes,
    CONSUME: lambda q: q.consume_bytes,
    REQUESTS: lambda q: q.requests,
}


def encode_quota(quota: Quota) -> bytes:
    """A quota as stored (MetaStore settings kind ``quotas``, keyed by scope)."""
    return msgspec.msgpack.encode(quota)


def decode_quota(raw: bytes) -> Quota:
    return msgspec.msgpack.decode(raw, type=Quota)

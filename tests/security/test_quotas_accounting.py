"""The quota accounting (slipstream/security/_quotas.py), pure: a fake clock, no broker."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream import InvalidArgument, LimitExceeded
from slipstream.security._quotas import (
    CONSUME,
    PRODUCE,
    REQUESTS,
    Quota,
    Quotas,
    decode_quota,
    encode_quota,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# a charge: (seconds since the previous one, units)
charges = st.lists(
    st.tuples(st.floats(0, 2, allow_nan=False), st.integers(1, 5000)), min_size=1, max_size=60
)


def _admitted(rate: int, steps: list[tuple[float, int]], wait: bool) -> list[tuple[float, int]]:
    """Admission times of each charge; with ``wait`` the caller waits out each delay before
    its next charge (a producer with one batch in flight), else it keeps charging."""
    clock = Clock()
    quotas = Quotas({"a": Quota(produce_bytes=rate)}, clock=clock)
    admitted = []
    for gap, units in steps:
        clock.now += gap
        delay = quotas.charge("a", PRODUCE, units)
        assert delay >= 0
        admitted.append((clock.now + delay, units))
        if wait:
            clock.now += delay
    return admitted


@settings(max_examples=300)
@given(st.integers(1, 10_000), charges, st.booleans())
def test_admitted_units_stay_within_rate_times_window_plus_burst(
    rate: int, steps: list[tuple[float, int]], wait: bool
) -> None:
    admitted = _admitted(rate, steps, wait)
    slack = max(rate, max(units for _, units in steps))  # the burst, or one big charge
    times = sorted(t for t, _ in admitted)
    for start in times:
        for end in times:
            if end < start:
                continue
            inside = sum(u for t, u in admitted if start <= t <= end)
            assert inside <= rate * (end - start) + slack + 1e-6 * rate


@given(charges)
def test_no_quota_never_delays(steps: list[tuple[float, int]]) -> None:
    clock = Clock()
    quotas = Quotas({"a": Quota(consume_bytes=10)}, clock=clock)
    for gap, units in steps:
        clock.now += gap
        assert quotas.charge("b", PRODUCE, units) == 0.0  # another scope
        assert quotas.charge("a", PRODUCE, units) == 0.0  # a kind without a limit
        assert quotas.charge(None, CONSUME, units) == 0.0  # no scope
    assert quotas.burst("a", CONSUME) == 10
    assert quotas.burst("a", PRODUCE) is None
    assert quotas.burst("b", CONSUME) is None


def test_within_the_burst_nothing_waits_and_past_it_the_wait_is_the_debt() -> None:
    clock = Clock()
    quotas = Quotas({"a": Quota(requests=10)}, clock=clock)
    assert [quotas.charge("a", REQUESTS, 1) for _ in range(10)] == [0.0] * 10
    assert quotas.charge("a", REQUESTS, 1) == pytest.approx(0.1)
    assert quotas.charge("a", REQUESTS, 5) == pytest.approx(0.6)
    clock.now += 0.6  # paid back
    assert quotas.charge("a", REQUESTS, 1) == pytest.approx(0.1)


@given(st.integers(1, 1000), st.integers(1, 1000), st.integers(1, 20_000))
def test_a_changed_quota_applies_to_the_next_charge(old: int, new: int, debt: int) -> None:
    clock = Clock()
    quotas = Quotas({"a": Quota(produce_bytes=old)}, clock=clock)
    quotas.charge("a", PRODUCE, debt)
    quotas.set("a", Quota(produce_bytes=new))
    fresh = Quotas({"a": Quota(produce_bytes=new)}, clock=clock)
    assert quotas.charge("a", PRODUCE, new + 1) == fresh.charge("a", PRODUCE, new + 1)
    assert quotas.delete("a")
    assert quotas.charge("a", PRODUCE, debt) == 0.0
    assert not quotas.delete("a")


def test_connections_are_counted_per_scope_and_refused_past_the_limit() -> None:
    quotas = Quotas({"a": Quota(connections=2)}, clock=Clock())
    quotas.open_connection("a")
    quotas.open_connection("a")
    with pytest.raises(LimitExceeded, match="'a' has 2 connections open"):
        quotas.open_connection("a")
    quotas.open_connection("b")  # no quota
    quotas.open_connection(None)  # unscoped: not counted
    assert quotas.connections("a") == 2
    quotas.close_connection("a")
    quotas.open_connection("a")
    quotas.set("a", Quota(connections=1))  # lowered below what is open: new ones refused
    with pytest.raises(LimitExceeded):
        quotas.open_connection("a")
    quotas.delete("a")
    quotas.open_connection("a")
    assert quotas.connections("a") == 3


def test_quotas_are_positive_and_round_trip_as_stored() -> None:
    with pytest.raises(InvalidArgument, match="positive"):
        Quota(produce_bytes=0)
    quota = Quota(produce_bytes=10_000_000, requests=1000, connections=50)
    assert decode_quota(encode_quota(quota)) == quota
    quotas = Quotas({"a": Quota()}, clock=Clock())  # an empty quota is none
    assert list(quotas.items()) == []

"""The console's rate sampler (pure: a fake clock) and its public names."""

from __future__ import annotations

import slipstream.console
from slipstream.console._sampler import MAX_STREAMS, MIN_INTERVAL_S, RateSampler


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_rates_from_successive_samples() -> None:
    clock = Clock()
    sampler = RateSampler(clock)
    sampler.observe("demo/a", 1, {0: 100, 1: 50}, consumed=10)
    assert sampler.rates("demo/a", 1).produce is None  # one sample: no rate yet
    clock.now += 2
    sampler.observe("demo/a", 1, {0: 300, 1: 50, 2: 40}, consumed=110)
    rates = sampler.rates("demo/a", 1)
    assert rates.produce == (390 - 150) / 2
    assert rates.consume == 50
    assert rates.segments == {0: 100, 1: 0, 2: 20}
    assert [p for _, p, _ in sampler.history("demo/a", 1)] == [120.0]


def test_samples_closer_than_the_interval_are_not_kept() -> None:
    clock = Clock()
    sampler = RateSampler(clock)
    sampler.observe("demo/a", 1, {0: 0})
    clock.now += MIN_INTERVAL_S / 2
    assert not sampler.wants("demo/a", 1)
    sampler.observe("demo/a", 1, {0: 1000})
    assert sampler.rates("demo/a", 1).produce is None
    clock.now += MIN_INTERVAL_S
    assert sampler.wants("demo/a", 1)


def test_a_stream_created_again_starts_over() -> None:
    clock = Clock()
    sampler = RateSampler(clock)
    sampler.observe("demo/a", 1, {0: 1000})
    clock.now += 2
    sampler.observe("demo/a", 2, {0: 5})  # deleted and created again: a new created_ms
    assert sampler.rates("demo/a", 2).produce is None
    clock.now += 2
    sampler.observe("demo/a", 2, {0: 25})
    assert sampler.rates("demo/a", 2).produce == 10


def test_memory_is_bounded_by_streams() -> None:
    clock = Clock()
    sampler = RateSampler(clock)
    for n in range(MAX_STREAMS + 10):
        sampler.observe(f"demo/s{n}", 1, {0: n})
    assert not sampler.wants("demo/s10", 1)  # kept
    assert sampler.wants("demo/s0", 1)  # the least recently observed were forgotten


def test_public_names() -> None:
    assert slipstream.console.__all__ == ["routes"]

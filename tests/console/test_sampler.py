"""The console's rate sampler (pure: a fake clock) and its public names."""

from __future__ import annotations

import slipstream.console
from slipstream.console._sampler import (
    MAX_STREAMS,
    MIN_INTERVAL_S,
    Commit,
    CommitSampler,
    RateSampler,
)


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


def test_a_spark_query_rate_is_between_its_last_two_commits_seen() -> None:
    commits = CommitSampler()
    commits.observe("spark:q", Commit(batch=3, events=10, committed_ms=1_000))
    assert commits.rate("spark:q") is None  # one commit: no rate yet
    commits.observe("spark:q", Commit(batch=3, events=10, committed_ms=1_000))  # seen again
    assert commits.rate("spark:q") is None
    commits.observe("spark:q", Commit(batch=4, events=50, committed_ms=3_000))
    assert commits.rate("spark:q") == 50 / 2
    # batch 5 not seen: assumed the size of batch 6
    commits.observe("spark:q", Commit(batch=6, events=40, committed_ms=4_000))
    assert commits.rate("spark:q") == 2 * 40 / 1
    # the query restarted from an older checkpoint: no rate until the next commit
    commits.observe("spark:q", Commit(batch=2, events=5, committed_ms=5_000))
    assert commits.rate("spark:q") is None
    commits.observe("spark:q", Commit(batch=3, events=5, committed_ms=5_500))
    assert commits.rate("spark:q") == 10
    assert commits.rate("spark:other") is None


def test_commit_memory_is_bounded_by_queries() -> None:
    commits = CommitSampler()
    for n in range(MAX_STREAMS + 5):
        commits.observe(f"spark:q{n}", Commit(0, 1, 1))
    assert len(commits._commits) == MAX_STREAMS
    assert "spark:q0" not in commits._commits


def test_public_names() -> None:
    assert slipstream.console.__all__ == ["routes"]

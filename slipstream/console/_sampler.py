"""Produce and consume rates for the console, from successive samples of per-stream counters.

The counters are what the service layer already answers: a stream's produced events are the
sum of its segments' end offsets (sealed segments included, so a scale does not move it), its
consumed events the sum of its subscriptions' positions. A rate is the difference between the
newest sample and the oldest one within ``RATE_WINDOW_S``, over the time between them.

Ownership: one ``RateSampler`` per console (per broker), touched only by the console's async
request handlers, which Starlette runs on the broker's event loop. No thread and no background
task touches it, so it needs no lock and has nothing to stop: a page or a partial that shows
rates records a sample of the streams it shows (at most one per stream every
``MIN_INTERVAL_S``) and reads the rates back. Rates therefore move while someone looks: a
stream nobody has looked at for ``RATE_WINDOW_S`` shows no rate (a dash) on its first view, and
a number from the next refresh on (the pages refresh every 2 s).

Memory is bounded: at most ``MAX_SAMPLES`` samples for each of at most ``MAX_STREAMS`` streams;
the stream observed longest ago is forgotten first.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

#: rates on the streams list: over the samples of the last 10 s
RATE_WINDOW_S = 10.0
#: samples closer together than this are not kept (a page and its partials share them)
MIN_INTERVAL_S = 1.0
#: samples kept per stream: the stream page's rate chart covers MAX_SAMPLES * the refresh
MAX_SAMPLES = 120
MAX_STREAMS = 2000


@dataclass(frozen=True, slots=True)
class Sample:
    """One look at a stream: ``at`` (monotonic seconds), ``wall_ms`` (for charts), each
    segment's end offset, and the events its subscriptions consumed (None: not sampled)."""

    at: float
    wall_ms: int
    ends: Mapping[int, int]
    consumed: int | None

    @property
    def produced(self) -> int:
        return sum(self.ends.values())


@dataclass(frozen=True, slots=True)
class Rates:
    """Events per second over ``seconds``; None where there are not two samples yet."""

    produce: float | None
    consume: float | None
    segments: Mapping[int, float]
    seconds: float


NO_RATES = Rates(None, None, {}, 0.0)


class RateSampler:
    """Samples per stream, keyed by (name, created_ms): a stream deleted and created again
    under its name starts over instead of showing a negative rate."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._samples: OrderedDict[tuple[str, int], deque[Sample]] = OrderedDict()

    def observe(
        self, name: str, created_ms: int, ends: Mapping[int, int], consumed: int | None = None
    ) -> None:
        """Record a sample of one stream now, unless its last one is younger than
        ``MIN_INTERVAL_S``."""
        key = (name, created_ms)
        now = self._clock()
        samples = self._samples.get(key)
        if samples is None:
            samples = self._samples[key] = deque(maxlen=MAX_SAMPLES)
            while len(self._samples) > MAX_STREAMS:
                self._samples.popitem(last=False)
        else:
            self._samples.move_to_end(key)
            if now - samples[-1].at < MIN_INTERVAL_S:
                return
        samples.append(Sample(now, int(time.time() * 1000), dict(ends), consumed))

    def wants(self, name: str, created_ms: int) -> bool:
        """Whether a new sample of this stream would be kept now (callers skip the work of
        counting consumed events otherwise)."""
        samples = self._samples.get((name, created_ms))
        return not samples or self._clock() - samples[-1].at >= MIN_INTERVAL_S

    def rates(self, name: str, created_ms: int, window_s: float = RATE_WINDOW_S) -> Rates:
        samples = self._samples.get((name, created_ms))
        if not samples or len(samples) < 2:
            return NO_RATES
        newest = samples[-1]
        oldest = next((s for s in samples if newest.at - s.at <= window_s), newest)
        seconds = newest.at - oldest.at
        if seconds <= 0:
            return NO_RATES
        consume = None
        if newest.consumed is not None and oldest.consumed is not None:
            consume = max(0.0, (newest.consumed - oldest.consumed) / seconds)
        segments = {
            number: max(0.0, (end - oldest.ends.get(number, 0)) / seconds)
            for number, end in newest.ends.items()
        }
        produce = max(0.0, (newest.produced - oldest.produced) / seconds)
        return Rates(produce, consume, segments, seconds)

    def history(self, name: str, created_ms: int) -> list[tuple[int, float, float | None]]:
        """(wall ms, produce rate, consume rate) between successive samples, oldest first:
        the stream page's chart."""
        samples = list(self._samples.get((name, created_ms), ()))
        points = []
        for before, after in itertools.pairwise(samples):
            seconds = after.at - before.at
            produce = max(0.0, (after.produced - before.produced) / seconds)
            consume = None
            if after.consumed is not None and before.consumed is not None:
                consume = max(0.0, (after.consumed - before.consumed) / seconds)
            points.append((after.wall_ms, produce, consume))
        return points


@dataclass(frozen=True, slots=True)
class Commit:
    """One committed batch of a Spark sink query as a look at its transactional id saw it:
    the batch id, the events in it and when it committed (the broker's wall clock, ms)."""

    batch: int
    events: int
    committed_ms: int


class CommitSampler:
    """The last two distinct commits seen per Spark sink query, for a rate: the events of the
    newest batch, times the batches between the two (a batch not seen is assumed the newest
    one's size), over the time between the two commits. The sink stores only each batch's own
    count (not a running total), so this is the best a look at the last commit can do; it is
    exact when every batch is seen (a refresh per trigger interval or faster).

    Same ownership as ``RateSampler``: the console's handlers on the broker's loop, no lock;
    bounded to ``MAX_STREAMS`` queries, the one looked at longest ago forgotten first."""

    def __init__(self) -> None:
        self._commits: OrderedDict[str, deque[Commit]] = OrderedDict()

    def observe(self, query: str, commit: Commit) -> None:
        commits = self._commits.get(query)
        if commits is None:
            commits = self._commits[query] = deque(maxlen=2)
            while len(self._commits) > MAX_STREAMS:
                self._commits.popitem(last=False)
        else:
            self._commits.move_to_end(query)
        if commits and commits[-1] == commit:
            return
        if commits and commit.batch <= commits[-1].batch:
            commits.clear()  # the query restarted from an older checkpoint: start over
        commits.append(commit)

    def rate(self, query: str) -> float | None:
        """Events per second between the last two commits seen; None before two."""
        commits = self._commits.get(query)
        if not commits or len(commits) < 2:
            return None
        older, newer = commits
        seconds = (newer.committed_ms - older.committed_ms) / 1000
        if seconds <= 0:
            return None
        return newer.events * (newer.batch - older.batch) / seconds

"""Scaling policies, per-segment rate tracking and the split/merge decision rule.

Pure: no IO and no clock. Times are milliseconds that the caller passes (the broker uses its
monotonic clock); rates are per second. docs/scaling.md explains the rule to operators; the
numbers live here, in one place:

=========================  ============================================================
split "hot_10s"            the 10 s rate is above 2 x target (a step up; answered in ~1 s)
split "hot_60s"            the 60 s rate is above 1.5 x target
split "hot_300s"           the 300 s rate is above 1 x target (a small lasting overload)
merge "cold_300s"          two neighbours together stayed below 0.5 x target in every 10 s
                           of the last 300 s, and are below it now
cool-down                  a rule over a window W applies to a segment only once it has been
                           open and measured for W (a split's successors wait 10 s before
                           they split again, 300 s before they merge)
bounds                     never fewer than min_segments or more than max_segments open
=========================  ============================================================

Why no flapping: a split fires above the target and makes successors whose neighbouring pairs
still carry more than the target together (pieces = ceil(rate / target), at most
scale_factor), while a merge needs a pair below half the target on every 10 s of five minutes.
The 2x band between the two thresholds is wider than the noise of a steady load; after a merge
the rate must double and last 300 s (or quadruple for 10 s) before the successor splits again.
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Mapping, Sequence
from itertools import pairwise
from typing import Literal

import msgspec

from .._errors import InvalidArgument
from ._graph import KeyRange, merge_ranges, split_range
from ._routing import MAX_SEGMENTS
from ._units import parse_size_bytes

Metric = Literal["events", "bytes"]
PolicyKind = Literal["fixed", "events", "bytes"]

#: rates are measured over these windows (ms); docs/scaling.md says why these
SHORT_WINDOW_MS = 10_000
MEDIUM_WINDOW_MS = 60_000
LONG_WINDOW_MS = 300_000
#: the short window is summed from 1 s buckets, the others from 10 s buckets
FINE_BUCKET_MS = 1_000
COARSE_BUCKET_MS = 10_000


class SplitRule(msgspec.Struct, frozen=True):
    """Split a segment whose rate over ``window_ms`` is above ``multiple`` x target."""

    name: str
    window_ms: int
    multiple: float


#: checked in this order; the first that fires is the one recorded
SPLIT_RULES = (
    SplitRule("hot_10s", SHORT_WINDOW_MS, 2.0),
    SplitRule("hot_60s", MEDIUM_WINDOW_MS, 1.5),
    SplitRule("hot_300s", LONG_WINDOW_MS, 1.0),
)
#: two neighbours merge when together below this fraction of the target (see ``_is_cold``)
MERGE_FRACTION = 0.5
#: the least time a segment is open before the bounds rules (min/max segments) touch it
BOUNDS_COOL_DOWN_MS = SHORT_WINDOW_MS


# --- policies ---------------------------------------------------------------------------------


class ScalingPolicy(msgspec.Struct, frozen=True):
    """How a stream's segment count follows its load. Build with :meth:`fixed`,
    :meth:`by_event_rate` or :meth:`by_byte_rate`; construction and decoding validate and raise
    :class:`InvalidArgument` naming the bad value and the fix.

    ``fixed(n)`` keeps exactly ``n`` segments (min = max = n); the rate policies split a segment
    that carries more than ``target`` events (or bytes) per second into at most
    ``scale_factor`` successors and merge cold neighbours, between ``min_segments`` and
    ``max_segments`` (None: the stream limit, 1024). ``str(policy)`` is its compact form, e.g.
    ``events 5000/s factor 2 min 1 max 64``, which :meth:`from_text` reads back: the form the
    MetaStore stores, the wire carries and ``describe`` shows.
    """

    kind: PolicyKind
    target: int = 0
    scale_factor: int = 2
    min_segments: int = 1
    max_segments: int | None = None

    def __post_init__(self) -> None:
        for name in ("target", "scale_factor", "min_segments"):
            _check_int(name, getattr(self, name))
        if self.max_segments is not None:
            _check_int("max_segments", self.max_segments)
        if self.kind == "fixed":
            n = self.min_segments
            if n < 1 or n > MAX_SEGMENTS:
                raise InvalidArgument(
                    f"fixed(n) needs 1 <= n <= {MAX_SEGMENTS} segments, got {n}", segments=n
                )
            if self.max_segments != n or self.target != 0:
                raise InvalidArgument(
                    "a fixed policy has no target and min_segments == max_segments == n: "
                    "build it with ScalingPolicy.fixed(n)"
                )
            return
        unit = "events/s" if self.kind == "events" else "bytes/s"
        if self.target <= 0:
            raise InvalidArgument(
                f"the target rate per segment must be > 0 {unit}, got {self.target}: it is "
                "what one segment should carry, e.g. 5000 events/s or 2MiB/s",
                target=self.target,
            )
        if self.scale_factor < 2:
            raise InvalidArgument(
                f"scale_factor must be >= 2 (a split makes 2 to scale_factor successors), "
                f"got {self.scale_factor}",
                scale_factor=self.scale_factor,
            )
        if self.min_segments < 1:
            raise InvalidArgument(
                f"min_segments must be >= 1, got {self.min_segments}: a stream always has a "
                "segment",
                min_segments=self.min_segments,
            )
        if self.min_segments > MAX_SEGMENTS:
            raise InvalidArgument(
                f"min_segments must be <= {MAX_SEGMENTS} (the stream limit), "
                f"got {self.min_segments}",
                min_segments=self.min_segments,
            )
        if self.max_segments is not None and not (
            self.min_segments <= self.max_segments <= MAX_SEGMENTS
        ):
            raise InvalidArgument(
                f"max_segments must be between min_segments ({self.min_segments}) and "
                f"{MAX_SEGMENTS}, got {self.max_segments}: raise it, or lower min_segments",
                max_segments=self.max_segments,
            )

    @classmethod
    def fixed(cls, n: int) -> ScalingPolicy:
        """Exactly ``n`` segments, whatever the load."""
        _check_int("n", n)
        return cls("fixed", 0, 2, n, n)

    @classmethod
    def by_event_rate(
        cls,
        target_per_segment: int,
        scale_factor: int = 2,
        min_segments: int = 1,
        max_segments: int | None = None,
    ) -> ScalingPolicy:
        """Aim at ``target_per_segment`` events per second in each segment."""
        return cls("events", target_per_segment, scale_factor, min_segments, max_segments)

    @classmethod
    def by_byte_rate(
        cls,
        target_bytes_per_segment: int,
        scale_factor: int = 2,
        min_segments: int = 1,
        max_segments: int | None = None,
    ) -> ScalingPolicy:
        """Aim at ``target_bytes_per_segment`` stored bytes per second in each segment."""
        return cls("bytes", target_bytes_per_segment, scale_factor, min_segments, max_segments)

    @property
    def metric(self) -> Metric:
        """The rate the policy watches (a fixed policy watches events, to pick whom to merge)."""
        return "bytes" if self.kind == "bytes" else "events"

    @property
    def segment_limit(self) -> int:
        """The most open segments the policy allows."""
        return MAX_SEGMENTS if self.max_segments is None else self.max_segments

    @property
    def initial_segments(self) -> int:
        """How many segments a new stream with this policy starts with."""
        return self.min_segments

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed {self.min_segments}"
        text = f"{self.kind} {self.target}/s factor {self.scale_factor} min {self.min_segments}"
        return text if self.max_segments is None else f"{text} max {self.max_segments}"

    @classmethod
    def from_text(cls, text: str) -> ScalingPolicy:
        """Read back ``str(policy)``; raises :class:`InvalidArgument` for anything else."""
        match = _POLICY_TEXT.fullmatch(text.strip())
        if match is None:
            raise InvalidArgument(
                f"bad scaling policy {text!r}: expected e.g. 'fixed 4' or "
                "'events 5000/s factor 2 min 1 max 64'"
            )
        if match["n"] is not None:
            return cls.fixed(int(match["n"]))
        kind: PolicyKind = "events" if match["kind"] == "events" else "bytes"
        maximum = None if match["max"] is None else int(match["max"])
        return cls(kind, int(match["target"]), int(match["factor"]), int(match["min"]), maximum)


_POLICY_TEXT = re.compile(
    r"fixed (?P<n>\d+)"
    r"|(?P<kind>events|bytes) (?P<target>\d+)/s factor (?P<factor>\d+) min (?P<min>\d+)"
    r"(?: max (?P<max>\d+))?"
)
_EVENT_RATE = re.compile(r"(\d+)\s*([kKM]?)\s*(?:/\s*s)?")
_EVENT_MULTIPLES = {"": 1, "k": 10**3, "K": 10**3, "M": 10**6}


def _check_int(name: str, value: object) -> None:
    if type(value) is not int:
        raise InvalidArgument(f"{name} must be an integer, got {value!r}")


def parse_rate(text: str, metric: Metric) -> int:
    """A per-second rate as the CLI writes it: events ``5000/s``, ``5000`` or ``5k/s``; bytes
    ``2MiB/s``, ``500KB/s`` or ``1048576`` (sizes as :func:`parse_size_bytes`). Raises
    :class:`InvalidArgument` with an example for anything else, zero included."""
    stripped = text.strip()
    if metric == "events":
        match = _EVENT_RATE.fullmatch(stripped)
        rate = (
            0
            if match is None
            else int(match[1]) * {"": 1, "k": 10**3, "K": 10**3, "M": 10**6}[match[2]]
        )
        if rate <= 0:
            raise InvalidArgument(
                f"bad event rate {text!r}: use events per second, e.g. 5000/s or 5k/s"
            )
        return rate
    size = stripped.removesuffix("/s").rstrip()
    try:
        return parse_size_bytes(size)
    except InvalidArgument:
        raise InvalidArgument(
            f"bad byte rate {text!r}: use a size per second, e.g. 2MiB/s or 500KB/s"
        ) from None


def policy_from_options(
    *,
    segments: int | None = None,
    scale_by_events: str | None = None,
    scale_by_bytes: str | None = None,
    scale_factor: int | None = None,
    min_segments: int | None = None,
    max_segments: int | None = None,
) -> ScalingPolicy | None:
    """The policy the CLI options ``--segments N``, ``--scale-by-events 5000/s``,
    ``--scale-by-bytes 2MiB/s``, ``--scale-factor``, ``--min-segments`` and ``--max-segments``
    describe; None when none is given (keep the stream's policy). Raises
    :class:`InvalidArgument` for contradicting options (two kinds of policy, or a rate option
    without a rate) and for the values the policy rejects."""
    rate_options = (scale_factor, min_segments, max_segments)
    if scale_by_events is not None and scale_by_bytes is not None:
        raise InvalidArgument("give --scale-by-events or --scale-by-bytes, not both")
    if scale_by_events is None and scale_by_bytes is None:
        if any(option is not None for option in rate_options):
            raise InvalidArgument(
                "--scale-factor, --min-segments and --max-segments need --scale-by-events "
                "or --scale-by-bytes"
            )
        return None if segments is None else ScalingPolicy.fixed(segments)
    if segments is not None:
        raise InvalidArgument(
            "--segments fixes the segment count; with --scale-by-events or --scale-by-bytes "
            "use --min-segments instead"
        )
    kind: Metric = "events" if scale_by_events is not None else "bytes"
    rate = parse_rate(scale_by_events or scale_by_bytes or "", kind)
    return ScalingPolicy(
        kind,
        rate,
        2 if scale_factor is None else scale_factor,
        1 if min_segments is None else min_segments,
        max_segments,
    )


# --- rates ------------------------------------------------------------------------------------


class WindowRates(msgspec.Struct, frozen=True):
    """One metric's rates per second: averages over the last 10 s, 60 s and 300 s, and the
    highest 10 s average (aligned 10 s buckets) seen in the last 300 s."""

    last_10s: float = 0.0
    last_60s: float = 0.0
    last_300s: float = 0.0
    peak_10s: float = 0.0

    def over(self, window_ms: int) -> float:
        if window_ms == SHORT_WINDOW_MS:
            return self.last_10s
        if window_ms == MEDIUM_WINDOW_MS:
            return self.last_60s
        if window_ms == LONG_WINDOW_MS:
            return self.last_300s
        raise InvalidArgument(f"no rate is kept over {window_ms} ms")


class Rates(msgspec.Struct, frozen=True):
    """What a :class:`RateTracker` saw of a segment, as of one moment. ``measured_ms`` is how
    long it has been watching: a window longer than that is not full yet."""

    measured_ms: int
    events: WindowRates = WindowRates()
    bytes: WindowRates = WindowRates()

    def of(self, metric: Metric) -> WindowRates:
        return self.events if metric == "events" else self.bytes


class RateTracker:
    """Counts one open segment's appended events and bytes in aligned time buckets: 1 s buckets
    for the last 10 s and 10 s buckets for the last 300 s, at most 41 buckets, kept only for
    seconds in which something was appended (a quiet segment holds none).

    Feed it ``observe(now_ms, events, bytes)`` per stored batch (or per group of them) and read
    :meth:`rates`. Time must not go backwards: an observation older than the newest bucket is
    counted in the newest bucket. A broker that restarts starts new trackers; their windows
    fill again before the rules that need them apply (``Rates.measured_ms``), so a restart
    delays scaling, never causes it.

    Use a monotonic clock here and in :func:`decide`: a wall clock that steps forward reads as
    a silent gap, after which cold-looking neighbours would merge (and split again).
    """

    __slots__ = ("_coarse", "_fine", "started_ms")

    def __init__(self, started_ms: int) -> None:
        self.started_ms = started_ms
        # [bucket index, events, bytes], oldest first
        self._fine: deque[list[int]] = deque()
        self._coarse: deque[list[int]] = deque()

    def observe(self, now_ms: int, events: int, bytes: int) -> None:
        if events < 0 or bytes < 0:
            raise InvalidArgument(f"cannot observe {events} events and {bytes} bytes")
        _add(self._fine, now_ms // FINE_BUCKET_MS, events, bytes)
        _add(self._coarse, now_ms // COARSE_BUCKET_MS, events, bytes)
        _trim(self._fine, (now_ms - SHORT_WINDOW_MS) // FINE_BUCKET_MS)
        _trim(self._coarse, (now_ms - LONG_WINDOW_MS) // COARSE_BUCKET_MS)

    def rates(self, now_ms: int) -> Rates:
        """The rates as of ``now_ms``. A window spans whole buckets back from the one holding
        ``now_ms`` (whose elapsed part counts), never more than the time since ``started_ms``;
        rates are events (bytes) in it divided by its length."""
        measured = max(0, now_ms - self.started_ms)
        fine = _window(self._fine, now_ms, FINE_BUCKET_MS, SHORT_WINDOW_MS, measured)
        medium = _window(self._coarse, now_ms, COARSE_BUCKET_MS, MEDIUM_WINDOW_MS, measured)
        long = _window(self._coarse, now_ms, COARSE_BUCKET_MS, LONG_WINDOW_MS, measured)
        first = (now_ms - LONG_WINDOW_MS) // COARSE_BUCKET_MS
        peak = [0, 0]
        for index, events, size in self._coarse:
            if first <= index <= now_ms // COARSE_BUCKET_MS:
                peak = [max(peak[0], events), max(peak[1], size)]
        per_bucket = 1000 / COARSE_BUCKET_MS
        return Rates(
            measured,
            WindowRates(fine[0], medium[0], long[0], max(fine[0], peak[0] * per_bucket)),
            WindowRates(fine[1], medium[1], long[1], max(fine[1], peak[1] * per_bucket)),
        )


def _add(buckets: deque[list[int]], index: int, events: int, size: int) -> None:
    if buckets and buckets[-1][0] >= index:
        buckets[-1][1] += events
        buckets[-1][2] += size
    else:
        buckets.append([index, events, size])


def _trim(buckets: deque[list[int]], first: int) -> None:
    while buckets and buckets[0][0] < first:
        buckets.popleft()


def _window(
    buckets: deque[list[int]], now_ms: int, width: int, window: int, measured: int
) -> tuple[float, float]:
    newest = now_ms // width
    first = newest - window // width + 1
    span = min((newest - first) * width + now_ms - newest * width, measured)
    if span <= 0:
        return 0.0, 0.0
    events = sum(b[1] for b in buckets if first <= b[0] <= newest)
    size = sum(b[2] for b in buckets if first <= b[0] <= newest)
    return events * 1000 / span, size * 1000 / span


# --- decisions --------------------------------------------------------------------------------


class SegmentLoad(msgspec.Struct, frozen=True):
    """An open segment as the decision rule sees it: its key range, when it was opened (the
    last scaling that touched its keys; on the rule's clock, so for a segment opened before
    the broker started, its tracker's start) and its rates. A segment counts as old enough
    for a window only when both ``now_ms - opened_ms`` and ``rates.measured_ms`` cover it."""

    segment: int
    key_range: KeyRange
    opened_ms: int
    rates: Rates

    def age_ms(self, now_ms: int) -> int:
        """How long the segment has been both open and measured."""
        return min(now_ms - self.opened_ms, self.rates.measured_ms)


class ScalingDecision(msgspec.Struct, frozen=True):
    """One scaling action and why: seal ``segments`` (in key order) and open successors with
    ``ranges`` (in key order). ``rule`` names what fired (``hot_10s``, ``hot_60s``,
    ``hot_300s``, ``cold_300s``, ``below_min``, ``above_max`` or ``manual``), ``reason`` says
    it in a sentence, ``threshold`` is the per-second rate the rule compared with (None when
    no rate was compared), ``inputs`` are the sealed segments' loads as the rule saw them, and
    ``policy`` is the policy's compact form at the time. Stored as JSON (:meth:`to_json`) next
    to the scale event, and shown by ``describe --history``."""

    at_ms: int
    action: Literal["split", "merge"]
    segments: tuple[int, ...]
    ranges: tuple[KeyRange, ...]
    rule: str
    reason: str
    policy: str
    threshold: float | None = None
    inputs: tuple[SegmentLoad, ...] = ()

    def to_json(self) -> bytes:
        return msgspec.json.encode(self)

    def with_rates(self, rates: Mapping[int, Rates]) -> ScalingDecision:
        """This decision with the inputs of the segments in ``rates`` measured so, and a cold
        merge's reason summed again from them. In a cluster the deciding broker sees no
        appends to the segments other brokers serve (their rates look zero to it): the merge
        records the rates those brokers measured (``SealPrepared.rates``)."""
        inputs = tuple(
            msgspec.structs.replace(s, rates=rates[s.segment]) if s.segment in rates else s
            for s in self.inputs
        )
        reason = self.reason
        if self.rule == "cold_300s" and len(inputs) == 2:
            policy = ScalingPolicy.from_text(self.policy)
            rate = sum(s.rates.of(policy.metric).peak_10s for s in inputs)
            reason = _cold_reason(policy, inputs[0].segment, inputs[1].segment, rate)
        return msgspec.structs.replace(self, inputs=inputs, reason=reason)

    @classmethod
    def from_json(cls, data: bytes | str) -> ScalingDecision:
        """Raises :class:`InvalidArgument` for anything :meth:`to_json` did not write."""
        try:
            return msgspec.json.decode(data, type=cls)
        except msgspec.DecodeError as exc:
            raise InvalidArgument(f"not a scaling decision: {exc}") from exc


def decide(
    policy: ScalingPolicy, segments: Sequence[SegmentLoad], now_ms: int
) -> tuple[ScalingDecision, ...]:
    """The scaling actions for a stream's open ``segments`` at ``now_ms`` under ``policy``,
    each segment in at most one action. First the bounds (``above_max``: merge the coldest
    neighbours; ``below_min``: split the widest segments), then, for rate policies, splits of
    hot segments (hottest first) and merges of cold neighbours (coldest first), never past
    ``min_segments`` or ``max_segments``. See the module docstring and docs/scaling.md for the
    thresholds and cool-downs. Raises :class:`InvalidArgument` when two loads name one
    segment or their key ranges overlap."""
    ordered = sorted(segments, key=lambda s: s.key_range.lo)
    if len({s.segment for s in ordered}) != len(ordered):
        raise InvalidArgument("each open segment may appear once in the loads")
    for left, right in pairwise(ordered):
        if left.key_range.overlaps(right.key_range):
            raise InvalidArgument(
                f"segments {left.segment} and {right.segment} have overlapping key ranges"
            )
    plan = _Plan(policy, ordered, now_ms)
    plan.enforce_bounds()
    if policy.kind != "fixed":
        plan.split_hot()
        plan.merge_cold()
    return tuple(plan.decisions)


def manual_split(
    policy: ScalingPolicy, load: SegmentLoad, parts: int, open_count: int, now_ms: int
) -> ScalingDecision:
    """An operator's ``--split S --into N``: checks that the policy allows ``open_count - 1 +
    parts`` segments (else :class:`InvalidArgument` saying which option to change) and that
    the range can be split (:func:`split_range`)."""
    ranges = split_range(load.key_range, parts)
    after = open_count - 1 + parts
    if after > policy.segment_limit:
        raise InvalidArgument(
            f"splitting segment {load.segment} into {parts} makes {after} segments, above the "
            f"policy's {policy.segment_limit} ({policy}): "
            + _bounds_fix(policy, "raise --max-segments"),
        )
    return ScalingDecision(
        now_ms,
        "split",
        (load.segment,),
        ranges,
        "manual",
        f"split segment {load.segment} into {parts} by hand",
        str(policy),
        None,
        (load,),
    )


def manual_merge(
    policy: ScalingPolicy, loads: Sequence[SegmentLoad], open_count: int, now_ms: int
) -> ScalingDecision:
    """An operator's ``--merge S1 S2``: the segments must be neighbours (:func:`merge_ranges`)
    and the policy must allow one segment fewer (else :class:`InvalidArgument`)."""
    ordered = sorted(loads, key=lambda s: s.key_range.lo)
    merged = merge_ranges([s.key_range for s in ordered])
    after = open_count - len(ordered) + 1
    if after < policy.min_segments:
        raise InvalidArgument(
            f"merging makes {after} segments, below the policy's {policy.min_segments} "
            f"({policy}): " + _bounds_fix(policy, "lower --min-segments"),
        )
    names = " and ".join(str(s.segment) for s in ordered)
    return ScalingDecision(
        now_ms,
        "merge",
        tuple(s.segment for s in ordered),
        (merged,),
        "manual",
        f"merge segments {names} by hand",
        str(policy),
        None,
        tuple(ordered),
    )


def _bounds_fix(policy: ScalingPolicy, option: str) -> str:
    if policy.kind == "fixed":
        return "update the policy to fixed(n) with another n, or to a rate policy"
    return f"{option} first"


class _Plan:
    """The actions of one decision as they are chosen: which segments are taken, and how many
    will be open after them."""

    def __init__(self, policy: ScalingPolicy, ordered: list[SegmentLoad], now_ms: int) -> None:
        self.policy = policy
        self.ordered = ordered
        self.now_ms = now_ms
        self.count = len(ordered)
        self.taken: set[int] = set()
        self.decisions: list[ScalingDecision] = []
        self.metric = policy.metric
        self.unit = "events/s" if self.metric == "events" else "bytes/s"

    def free(self, load: SegmentLoad, cool_down_ms: int) -> bool:
        return load.segment not in self.taken and load.age_ms(self.now_ms) >= cool_down_ms

    def neighbours(self) -> list[tuple[SegmentLoad, SegmentLoad]]:
        return [(a, b) for a, b in pairwise(self.ordered) if a.key_range.precedes(b.key_range)]

    def add_split(
        self, load: SegmentLoad, parts: int, rule: str, reason: str, threshold: float | None
    ) -> None:
        self.taken.add(load.segment)
        self.count += parts - 1
        self.decisions.append(
            ScalingDecision(
                self.now_ms,
                "split",
                (load.segment,),
                split_range(load.key_range, parts),
                rule,
                reason,
                str(self.policy),
                threshold,
                (load,),
            )
        )

    def add_merge(
        self, pair: tuple[SegmentLoad, SegmentLoad], rule: str, reason: str, threshold: float | None
    ) -> None:
        a, b = pair
        self.taken.update((a.segment, b.segment))
        self.count -= 1
        self.decisions.append(
            ScalingDecision(
                self.now_ms,
                "merge",
                (a.segment, b.segment),
                (merge_ranges([a.key_range, b.key_range]),),
                rule,
                reason,
                str(self.policy),
                threshold,
                pair,
            )
        )

    def enforce_bounds(self) -> None:
        limit = self.policy.segment_limit
        pairs = sorted(
            self.neighbours(),
            key=lambda p: (
                p[0].rates.of(self.metric).last_300s + p[1].rates.of(self.metric).last_300s,
                p[0].key_range.width + p[1].key_range.width,
            ),
        )
        for pair in pairs:
            if self.count <= limit:
                break
            if all(self.free(s, BOUNDS_COOL_DOWN_MS) for s in pair):
                self.add_merge(
                    pair,
                    "above_max",
                    f"{self.count} segments are more than the policy's {limit} ({self.policy}):"
                    f" merge the coldest neighbours, {pair[0].segment} and {pair[1].segment}",
                    None,
                )
        widest = sorted(
            self.ordered,
            key=lambda s: (-s.key_range.width, -s.rates.of(self.metric).last_300s, s.segment),
        )
        for load in widest:
            missing = self.policy.min_segments - self.count
            if missing <= 0:
                break
            parts = min(self.policy.scale_factor, missing + 1, load.key_range.width)
            if parts >= 2 and self.free(load, BOUNDS_COOL_DOWN_MS):
                self.add_split(
                    load,
                    parts,
                    "below_min",
                    f"{self.count} segments are fewer than the policy's "
                    f"{self.policy.min_segments} ({self.policy}): split the widest, "
                    f"{load.segment}, into {parts}",
                    None,
                )

    def split_hot(self) -> None:
        target = self.policy.target
        hot: list[tuple[float, SegmentLoad, SplitRule, float]] = []
        for load in self.ordered:
            rates = load.rates.of(self.metric)
            for rule in SPLIT_RULES:
                rate = rates.over(rule.window_ms)
                if self.free(load, rule.window_ms) and rate > rule.multiple * target:
                    hot.append((rate / (rule.multiple * target), load, rule, rate))
                    break
        hot.sort(key=lambda h: (-h[0], h[1].segment))
        for _, load, rule, rate in hot:
            headroom = self.policy.segment_limit - self.count + 1
            parts = min(
                max(2, math.ceil(rate / target)),
                self.policy.scale_factor,
                headroom,
                load.key_range.width,
            )
            if parts < 2:
                continue
            threshold = rule.multiple * target
            self.add_split(
                load,
                parts,
                rule.name,
                f"segment {load.segment} carried {rate:,.0f} {self.unit} over the last "
                f"{rule.window_ms // 1000} s, above {rule.multiple:g} x the target of "
                f"{target:,} {self.unit} ({threshold:,.0f}): split into {parts}",
                threshold,
            )

    def merge_cold(self) -> None:
        threshold = MERGE_FRACTION * self.policy.target
        cold: list[tuple[float, tuple[SegmentLoad, SegmentLoad]]] = []
        for pair in self.neighbours():
            if all(self.free(s, LONG_WINDOW_MS) for s in pair):
                rate = _is_cold(pair, self.metric, threshold)
                if rate is not None:
                    cold.append((rate, pair))
        cold.sort(key=lambda c: (c[0], c[1][0].key_range.lo))
        for rate, pair in cold:
            if self.count - 1 < self.policy.min_segments:
                break
            if all(s.segment not in self.taken for s in pair):
                self.add_merge(
                    pair,
                    "cold_300s",
                    _cold_reason(self.policy, pair[0].segment, pair[1].segment, rate),
                    threshold,
                )


def _cold_reason(policy: ScalingPolicy, first: int, second: int, rate: float) -> str:
    unit = "events/s" if policy.metric == "events" else "bytes/s"
    return (
        f"segments {first} and {second} together carried at most {rate:,.0f} {unit} in every "
        f"10 s of the last 300 s, below {MERGE_FRACTION:g} x the target of "
        f"{policy.target:,} {unit} ({MERGE_FRACTION * policy.target:,.0f}): merge them"
    )


def _is_cold(
    pair: tuple[SegmentLoad, SegmentLoad], metric: Metric, threshold: float
) -> float | None:
    """The pair's highest 10 s rate of the last 300 s (an upper bound: the sum of each one's
    peak) when it is below ``threshold``, else None."""
    rate = sum(s.rates.of(metric).peak_10s for s in pair)
    return rate if rate < threshold else None

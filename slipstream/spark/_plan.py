"""Pure planning for the Spark connector: options, offsets, admission control, partitions.

No Spark and no IO here, so that all of it is unit-tested quickly. Spark offsets are StreamCuts
in their JSON form (``{"stream": "demo/orders", "positions": {"0": 12, "1": 40}}``), which is a
dict of primitives as Spark requires.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .._errors import InvalidArgument
from ..client import DEFAULT_ADDRESS, split_addresses
from ..streams import (
    StreamCut,
    preceding,
    read_order,
    validate_stream_name,
    validate_subscription_name,
)

#: a partition reads at most this many events of one segment (more: the range is split)
DEFAULT_EVENTS_PER_PARTITION = 1_000_000
MODES = ("PERMISSIVE", "FAILFAST")


@dataclass(frozen=True)
class SourceOptions:
    broker: str
    stream: str
    starting_position: str
    max_events_per_trigger: int | None
    max_bytes_per_trigger: int | None
    events_per_partition: int
    schema: str | None
    mode: str
    start: str  # batch reads: "from"
    end: str  # batch reads: "to"
    subscription: str | None = None  # streaming: record committed progress in it
    tls: TlsOptions | None = None


def _positive(options: Mapping[str, str], key: str) -> int | None:
    raw = options.get(key.lower())
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise InvalidArgument(f"option {key} must be a positive integer, not {raw!r}")
    return value


@dataclass(frozen=True)
class TlsOptions:
    """``.option("tls", "true")``, ``tls_ca``, ``tls_cert``, ``tls_key`` and ``token``: what
    ``slipstream.connect`` takes (docs/security.md); a CA or certificate implies TLS. ``tls``
    None (only a token given): the workers' SLIPSTREAM_TLS_* variables decide. Spark redacts
    an option named ``token`` in its UI and plans (``spark.redaction.regex``)."""

    tls: bool | None
    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    token: str | None = None


def tls_option(options: Mapping[str, str]) -> TlsOptions | None:
    """None when no TLS or token option is given: the workers' SLIPSTREAM_TLS_* and
    SLIPSTREAM_TOKEN variables apply."""
    ca, cert, key = (options.get(k) or None for k in ("tls_ca", "tls_cert", "tls_key"))
    token = options.get("token") or None
    flag = options.get("tls")
    if flag is None and not (ca or cert or key or token):
        return None
    if flag is not None and flag.lower() not in ("true", "false"):
        raise InvalidArgument(f'option tls must be "true" or "false", not {flag!r}')
    tls = flag.lower() == "true" if flag else (True if ca or cert or key else None)
    return TlsOptions(tls, ca, cert, key, token)


def broker_option(options: Mapping[str, str]) -> str:
    broker = options.get("broker") or os.environ.get("SLIPSTREAM_BROKER") or DEFAULT_ADDRESS
    split_addresses(broker)  # host:port, or a cluster's list h1:7070,h2:7070
    return broker


def stream_option(options: Mapping[str, str]) -> str:
    stream = options.get("stream")
    if not stream:
        raise InvalidArgument('option "stream" is required, e.g. .option("stream", "demo/orders")')
    validate_stream_name(stream)
    return stream


def source_options(options: Mapping[str, str]) -> SourceOptions:
    """Parse a read's options (Spark hands them over with lower-cased keys)."""
    mode = options.get("mode", "PERMISSIVE").upper()
    if mode not in MODES:
        raise InvalidArgument(f"option mode must be one of {', '.join(MODES)}, not {mode!r}")
    return SourceOptions(
        broker=broker_option(options),
        stream=stream_option(options),
        starting_position=options.get("startingposition", "latest"),
        max_events_per_trigger=_positive(options, "maxEventsPerTrigger"),
        max_bytes_per_trigger=_positive(options, "maxBytesPerTrigger"),
        events_per_partition=_positive(options, "maxEventsPerPartition")
        or DEFAULT_EVENTS_PER_PARTITION,
        schema=options.get("schema"),
        mode=mode,
        start=options.get("from", "earliest"),
        end=options.get("to", "latest"),
        subscription=subscription_option(options),
        tls=tls_option(options),
    )


def subscription_option(options: Mapping[str, str]) -> str | None:
    name = options.get("subscription")
    return None if not name else validate_subscription_name(name)


def cut_to_offset(cut: StreamCut) -> dict[str, object]:
    return {
        "stream": cut.stream,
        "positions": {str(s): o for s, o in sorted(cut.positions.items())},
    }


def offset_to_cut(offset: Mapping[str, object]) -> StreamCut:
    try:
        positions = offset["positions"]
        assert isinstance(positions, Mapping)
        return StreamCut(str(offset["stream"]), {int(s): int(o) for s, o in positions.items()})
    except (KeyError, AssertionError, TypeError, ValueError) as exc:
        raise InvalidArgument(f"not a slipstream offset: {offset!r}") from exc


def limit_cut(
    start: Mapping[int, int],
    tail: Mapping[int, int],
    max_events: int | None,
    max_bytes: int | None = None,
    bytes_per_event: Mapping[int, float] | None = None,
) -> dict[int, int]:
    """How far to read from ``start`` toward ``tail`` so that at most ``max_events`` events and
    about ``max_bytes`` bytes are taken, split between segments in proportion to what each has
    waiting (as Spark's Kafka source splits ``maxOffsetsPerTrigger``). Proportional, not equal,
    shares matter for event time: segments that cover the same span of time advance through it
    together, so a busy segment does not fall behind a quiet one and see its events dropped as
    late by a watermark. At least one event is admitted whenever any is available."""
    available = {s: max(0, tail.get(s, o) - o) for s, o in start.items()}
    budget = float("inf") if max_events is None else float(max_events)
    if max_bytes is not None:
        sizes = bytes_per_event or {}
        mean = sum(sizes.values()) / len(sizes) if sizes else 1.0
        per_event = max(1.0, mean)
        budget = min(budget, max_bytes / per_event)
    total = sum(available.values())
    if total <= budget:
        return {s: start[s] + available[s] for s in start}
    budget = max(1, int(budget))
    shares = {s: budget * available[s] / total for s in start}
    taken = {s: int(share) for s, share in shares.items()}
    # the events lost to rounding down go to the largest remainders (ties: lowest segment)
    by_remainder = sorted(start, key=lambda s: (taken[s] - shares[s], s))
    for s in by_remainder[: budget - sum(taken.values())]:
        taken[s] += 1
    return {s: start[s] + taken[s] for s in start}


def split_ranges(
    start: Mapping[int, int], end: Mapping[int, int], per_partition: int
) -> list[tuple[int, int, int]]:
    """``(segment, first offset, end offset)`` ranges of at most ``per_partition`` events."""
    ranges = []
    for segment in sorted(start):
        lo, hi = start[segment], end.get(segment, start[segment])
        while lo < hi:
            ranges.append((segment, lo, min(hi, lo + per_partition)))
            lo += per_partition
    return ranges


# --- scaled streams: the segment graph ------------------------------------------------------


@dataclass(frozen=True)
class SegmentSpan:
    """What planning needs of one segment of any epoch (from DescribeStream): its first
    retained offset, its final end if sealed (None while open) and its predecessors."""

    first: int
    sealed_end: int | None
    predecessors: tuple[int, ...] = ()


def ancestors(segments: Mapping[int, SegmentSpan], numbers: Iterable[int]) -> set[int]:
    """Every described segment that precedes one of ``numbers``, transitively."""
    return preceding({n: span.predecessors for n, span in segments.items()}, numbers)


def resolve_start(start: Mapping[int, int], segments: Mapping[int, SegmentSpan]) -> dict[int, int]:
    """A start position for every segment, from a cut that may name only some (one taken
    before a scale, or written by hand): a segment the cut names starts there; one that
    precedes a named segment is finished (starts at its end); any other starts at its first
    offset. The same rule as the client's readers."""
    finished = ancestors(segments, start.keys()) - start.keys()
    resolved = dict(start)
    for number, span in segments.items():
        if number not in resolved:
            ended = span.sealed_end if number in finished else None
            resolved[number] = span.first if ended is None else ended
    return resolved


def resolve_end(
    start: Mapping[int, int], end: Mapping[int, int], segments: Mapping[int, SegmentSpan]
) -> dict[int, int]:
    """Where a bounded read from ``start`` (resolved) stops in each segment for an end cut
    that may name only some: at the cut's position; a segment preceding a named one at its
    own end; any other at its start (it came after the cut: nothing to read)."""
    before = ancestors(segments, end.keys())
    resolved = {}
    for number, first in start.items():
        span = segments.get(number)
        if number in end:
            stop = end[number]
        elif number in before and span is not None and span.sealed_end is not None:
            stop = span.sealed_end
        else:
            stop = first
        resolved[number] = max(first, stop)
    return resolved


def _read_order(
    cut: Mapping[int, int], segments: Mapping[int, SegmentSpan]
) -> tuple[set[int], list[int]]:
    """The read-order rule (``streams.read_order``) at ``cut``: a segment ended there is
    sealed with ``cut`` at its end. A segment the stream no longer lists (deleted with its
    data) counts as finished: it holds nothing back."""

    def ended(number: int) -> bool:
        span = segments[number]
        return span.sealed_end is not None and cut.get(number, span.first) >= span.sealed_end

    return read_order({n: span.predecessors for n, span in segments.items()}, ended)


def finished_at(cut: Mapping[int, int], segments: Mapping[int, SegmentSpan]) -> set[int]:
    """The segments read to their ends at ``cut``: sealed, ``cut`` at the end, and every
    predecessor finished too (an empty sealed segment must not let its successors overtake
    what its own predecessors still hold)."""
    return _read_order(cut, segments)[0]


def readable_at(cut: Mapping[int, int], segments: Mapping[int, SegmentSpan]) -> list[int]:
    """The segments a batch ending at ``cut`` may read into: not finished there, and every
    predecessor finished there (``SegmentGraph.readable`` for positions)."""
    return _read_order(cut, segments)[1]


def plan_end(
    start: Mapping[int, int],
    tail: Mapping[int, int],
    segments: Mapping[int, SegmentSpan],
    max_events: int | None,
    max_bytes: int | None = None,
    bytes_per_event: Mapping[int, float] | None = None,
) -> dict[int, int]:
    """The end cut of a micro-batch starting at ``start`` (every segment resolved), reading
    toward ``tail`` within the limits, in the order the segment graph allows.

    A segment advances in a batch only if every predecessor's end is within the batch's end
    cut: first the segments readable at ``start`` share the budget (:func:`limit_cut`); when
    that takes all they have and some of them reach their ends, the successors that became
    readable share what is left, and so on. A successor whose predecessors do not reach their
    ends in the batch stays at its start: nothing of it is read. So for every key, everything
    a batch holds comes after everything earlier batches held (a key's events in a batch may
    span a predecessor's end and its successor: order them by ``(segment, offset)``)."""
    end = dict(start)
    sizes = bytes_per_event or {}
    per_event = max(1.0, sum(sizes.values()) / len(sizes)) if sizes else 1.0
    events_left = None if max_events is None else float(max_events)
    bytes_left = None if max_bytes is None else float(max_bytes)
    advanced: set[int] = set()
    while events_left is None or events_left >= 1:
        if bytes_left is not None and bytes_left < per_event and advanced:
            break
        frontier = [s for s in readable_at(end, segments) if s not in advanced]
        if not frontier:
            break
        advanced.update(frontier)
        ceiling = {s: _ceiling(s, end, tail, segments) for s in frontier}
        budget_events = None if events_left is None else int(events_left)
        budget_bytes = None if bytes_left is None else max(1, int(bytes_left))
        taken = limit_cut(
            {s: end[s] for s in frontier}, ceiling, budget_events, budget_bytes, sizes
        )
        count = sum(taken[s] - end[s] for s in frontier)
        end.update(taken)
        if any(taken[s] < ceiling[s] for s in frontier):
            break  # the budget is spent
        if events_left is not None:
            events_left -= count
        if bytes_left is not None:
            bytes_left -= count * per_event
    return end


def _ceiling(
    number: int,
    cut: Mapping[int, int],
    tail: Mapping[int, int],
    segments: Mapping[int, SegmentSpan],
) -> int:
    """How far ``number`` can be read now: its tail, never past a sealed end. A segment the
    tail does not name (one newer than a Trigger.AvailableNow target) has nothing to read."""
    at = cut[number]
    span = segments[number]
    top = tail.get(number, at)
    if span.sealed_end is not None:
        top = min(top, span.sealed_end)
    return max(at, top)

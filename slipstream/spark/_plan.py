"""Pure planning for the Spark connector: options, offsets, admission control, partitions.

No Spark and no IO here, so that all of it is unit-tested quickly. Spark offsets are StreamCuts
in their JSON form (``{"stream": "demo/orders", "positions": {"0": 12, "1": 40}}``), which is a
dict of primitives as Spark requires.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from .._errors import InvalidArgument
from ..client import DEFAULT_ADDRESS, parse_address
from ..streams import StreamCut, validate_stream_name, validate_subscription_name

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


def broker_option(options: Mapping[str, str]) -> str:
    broker = options.get("broker") or os.environ.get("SLIPSTREAM_BROKER") or DEFAULT_ADDRESS
    parse_address(broker)
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

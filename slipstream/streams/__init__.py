"""The stream domain: names, routing, positions, units. Pure decisions, no IO."""

from ._cuts import Position, StreamCut, format_positions, parse_positions
from ._graph import (
    FULL_KEY_RANGE,
    KeyRange,
    ScaleEvent,
    SegmentGraph,
    SegmentNode,
    merge_ranges,
    split_range,
)
from ._groups import SegmentProgress, assign, assignable
from ._idempotence import (
    SEQUENCE_MODULUS,
    WINDOW,
    ProducerState,
    ProducerTable,
    next_sequence,
)
from ._names import (
    MAX_NAME_LENGTH,
    validate_scope,
    validate_stream_name,
    validate_subscription_name,
)
from ._routing import KEY_SPACE, MAX_KEY_HASH, MAX_SEGMENTS, Router, key_hash, split_key_space
from ._scaling import (
    Rates,
    RateTracker,
    ScalingDecision,
    ScalingPolicy,
    SegmentLoad,
    WindowRates,
    decide,
    manual_merge,
    manual_split,
    parse_rate,
    policy_from_options,
)
from ._units import human_bytes, parse_duration_ms, parse_size_bytes, relative_time_ms

__all__ = [
    "FULL_KEY_RANGE",
    "KEY_SPACE",
    "MAX_KEY_HASH",
    "MAX_NAME_LENGTH",
    "MAX_SEGMENTS",
    "SEQUENCE_MODULUS",
    "WINDOW",
    "KeyRange",
    "Position",
    "ProducerState",
    "ProducerTable",
    "RateTracker",
    "Rates",
    "Router",
    "ScaleEvent",
    "ScalingDecision",
    "ScalingPolicy",
    "SegmentGraph",
    "SegmentLoad",
    "SegmentNode",
    "SegmentProgress",
    "StreamCut",
    "WindowRates",
    "assign",
    "assignable",
    "decide",
    "format_positions",
    "human_bytes",
    "key_hash",
    "manual_merge",
    "manual_split",
    "merge_ranges",
    "next_sequence",
    "parse_duration_ms",
    "parse_positions",
    "parse_rate",
    "parse_size_bytes",
    "policy_from_options",
    "relative_time_ms",
    "split_key_space",
    "split_range",
    "validate_scope",
    "validate_stream_name",
    "validate_subscription_name",
]

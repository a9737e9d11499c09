"""The stream domain: names, routing, positions, units. Pure decisions, no IO."""

from ._cuts import Position, StreamCut
from ._groups import assign
from ._idempotence import (
    SEQUENCE_MODULUS,
    WINDOW,
    ProducerState,
    ProducerTable,
    next_sequence,
)
from ._names import MAX_NAME_LENGTH, validate_scope, validate_stream_name
from ._routing import KEY_SPACE, MAX_KEY_HASH, MAX_SEGMENTS, Router, key_hash, split_key_space
from ._units import parse_duration_ms, parse_size_bytes, relative_time_ms

__all__ = [
    "KEY_SPACE",
    "MAX_KEY_HASH",
    "MAX_NAME_LENGTH",
    "MAX_SEGMENTS",
    "SEQUENCE_MODULUS",
    "WINDOW",
    "Position",
    "ProducerState",
    "ProducerTable",
    "Router",
    "StreamCut",
    "assign",
    "key_hash",
    "next_sequence",
    "parse_duration_ms",
    "parse_size_bytes",
    "relative_time_ms",
    "split_key_space",
    "validate_scope",
    "validate_stream_name",
]

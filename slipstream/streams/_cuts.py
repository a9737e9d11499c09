"""Positions in a stream: one event (Position) and a consistent cut across segments (StreamCut),
and the short text form of a cut's positions (``segment:offset,...``) that page links carry."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from .._errors import InvalidArgument


class Position(msgspec.Struct, frozen=True):
    """Where one event is stored: its segment and its offset in that segment."""

    segment: int
    offset: int


class StreamCut(msgspec.Struct, frozen=True):
    """A consistent position in a whole stream: for each segment, the offset of the next event.

    Readers start at a StreamCut or stop before one (bounded reads). Its JSON form,
    ``{"stream": "demo/orders", "positions": {"0": 12, "1": 40}}``, is what the CLI accepts.
    """

    stream: str
    positions: Mapping[int, int]

    def to_json(self) -> str:
        return msgspec.json.encode(
            {"stream": self.stream, "positions": {str(k): v for k, v in self.positions.items()}}
        ).decode()

    @classmethod
    def from_json(cls, text: str | bytes) -> StreamCut:
        """Parse the JSON form; raises :class:`InvalidArgument` with the expected shape."""
        try:
            raw: Any = msgspec.json.decode(text)
            stream = raw["stream"]
            positions = {int(k): v for k, v in raw["positions"].items()}
        except (msgspec.DecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
            raise InvalidArgument(
                'a StreamCut is JSON like {"stream": "demo/orders", "positions": {"0": 12}}',
                error=str(exc),
            ) from exc
        if not isinstance(stream, str) or not all(
            type(o) is int and 0 <= o < 2**63 for o in positions.values()
        ):
            raise InvalidArgument(
                "a StreamCut needs a stream name and non-negative integer offsets"
            )
        return cls(stream, positions)


def parse_positions(text: str) -> dict[int, int]:
    """``"0:12,1:40"`` (segment:offset, comma separated; blanks ignored) -> ``{0: 12, 1: 40}``;
    ``""`` -> ``{}``. Raises :class:`InvalidArgument` for anything else, also for a negative
    segment or offset."""
    try:
        pairs = (item.split(":") for item in text.split(",") if item.strip())
        positions = {int(segment): int(offset) for segment, offset in pairs}
    except ValueError:
        raise InvalidArgument(
            f"a position list is segment:offset pairs like 0:12,1:40, not {text!r}"
        ) from None
    if any(offset < 0 or segment < 0 for segment, offset in positions.items()):
        raise InvalidArgument("segments and offsets are not negative")
    return positions


def format_positions(positions: Mapping[int, int]) -> str:
    """The text form :func:`parse_positions` reads, segments in ascending order."""
    return ",".join(f"{segment}:{offset}" for segment, offset in sorted(positions.items()))

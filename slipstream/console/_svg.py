"""The stream page's picture of segments over time: key range (vertical) by time (horizontal).

Each segment is a rectangle from the scale that opened it (the stream's creation for epoch 0)
to the scale that sealed it (now, if it is open), over its key range: a split shows as one
rectangle followed by several thinner ones, a merge as the reverse. Rendered on the server as
plain SVG (no script): light, and it prints.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from html import escape

from ..protocol import ScaleEventInfo, StreamInfo

WIDTH = 760
HEIGHT = 220
LEFT = 44  # room for the key-range labels
BOTTOM = 20  # room for the time labels
KEY_SPACE = 1 << 64


@dataclass(frozen=True, slots=True)
class Bar:
    segment: int
    epoch: int
    start_ms: int
    end_ms: int
    key_lo: int
    key_hi: int
    sealed: bool


def segment_bars(
    info: StreamInfo, history: Sequence[ScaleEventInfo], now_ms: int | None = None
) -> list[Bar]:
    """One bar per segment: when it was opened and sealed (now if open)."""
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    opened: dict[int, int] = {}
    sealed_at: dict[int, int] = {}
    for event in history:
        for number in event.created:
            opened[number] = event.at_ms
        for number in event.sealed:
            sealed_at[number] = event.at_ms
    bars = []
    for segment in info.segments:
        start = opened.get(segment.number, info.created_ms)
        end = sealed_at.get(segment.number, now_ms) if segment.sealed else now_ms
        bars.append(
            Bar(
                segment.number,
                segment.epoch,
                start,
                max(start, end),
                segment.key_lo,
                segment.key_hi,
                segment.sealed,
            )
        )
    return bars


def segments_svg(
    info: StreamInfo, history: Sequence[ScaleEventInfo], now_ms: int | None = None
) -> str:
    """The picture as an ``<svg>`` element (text, already escaped)."""
    bars = segment_bars(info, history, now_ms)
    if not bars:
        return '<svg class="segments" width="0" height="0"></svg>'
    t0 = min(b.start_ms for b in bars)
    t1 = max(max(b.end_ms for b in bars), t0 + 1)
    plot_w = WIDTH - LEFT - 4
    plot_h = HEIGHT - BOTTOM - 4

    def x(ms: int) -> float:
        return LEFT + (ms - t0) * plot_w / (t1 - t0)

    def y(key: int) -> float:
        return 2 + key * plot_h / KEY_SPACE

    parts = [
        f'<svg class="segments" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" '
        f'height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        f'aria-label="segments of {escape(info.name)} over time">',
        f'<text x="2" y="12" class="axis">0x00</text>'
        f'<text x="2" y="{plot_h}" class="axis">0xff</text>',
    ]
    for bar in sorted(bars, key=lambda b: (b.start_ms, b.key_lo)):
        left, right = x(bar.start_ms), max(x(bar.end_ms), x(bar.start_ms) + 2)
        top, bottom = y(bar.key_lo), y(bar.key_hi + 1)
        state = "sealed" if bar.sealed else "open"
        title = (
            f"segment {bar.segment} (epoch {bar.epoch}, {state}): keys "
            f"{bar.key_lo:#018x}..{bar.key_hi:#018x}, {_when(bar.start_ms)} to "
            f"{_when(bar.end_ms) if bar.sealed else 'now'}"
        )
        parts.append(
            f'<g class="bar {state}" data-segment="{bar.segment}">'
            f'<rect x="{left:.1f}" y="{top:.1f}" width="{right - left:.1f}" '
            f'height="{max(bottom - top, 1):.1f}"><title>{escape(title)}</title></rect>'
        )
        if right - left > 18 and bottom - top > 12:
            parts.append(
                f'<text x="{left + 3:.1f}" y="{(top + bottom) / 2 + 4:.1f}">{bar.segment}</text>'
            )
        parts.append("</g>")
    parts.append(
        f'<text x="{LEFT}" y="{HEIGHT - 4}" class="axis">{_when(t0)}</text>'
        f'<text x="{WIDTH - 4}" y="{HEIGHT - 4}" class="axis" text-anchor="end">'
        f"{_when(t1)}</text></svg>"
    )
    return "".join(parts)


def _when(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S")

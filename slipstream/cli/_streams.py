"""``slipstream stream create | list | describe | delete``: rendering stream metadata."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.table import Table
from rich.text import Text

from slipstream import SegmentInfo, StreamInfo

from ._common import human_bytes, human_duration_ms, iso_ms


def stream_dict(info: StreamInfo) -> dict[str, Any]:
    """The ``--json`` form of a stream: the API's fields plus per-segment and total event
    counts (``end_offset - start_offset``: events retained, not ever written)."""
    segments = [segment_dict(s) for s in info.segments]
    return {
        "name": info.name,
        "segments": segments,
        "events": sum(s["events"] for s in segments),
        "bytes": sum(s["bytes"] for s in segments),
        "retention_ms": info.retention_ms,
        "retention_bytes": info.retention_bytes,
        "created_ms": info.created_ms,
        "created": iso_ms(info.created_ms),
    }


def segment_dict(segment: SegmentInfo) -> dict[str, Any]:
    return {
        "number": segment.number,
        "epoch": segment.epoch,
        "key_lo": segment.key_lo,
        "key_hi": segment.key_hi,
        "sealed": segment.sealed,
        "start_offset": segment.start_offset,
        "end_offset": segment.end_offset,
        "events": segment.end_offset - segment.start_offset,
        "bytes": segment.bytes,
        "first_timestamp": segment.first_timestamp,
        "last_timestamp": segment.last_timestamp,
    }


def retention_text(info: StreamInfo) -> str:
    limits = []
    if info.retention_ms is not None:
        limits.append(human_duration_ms(info.retention_ms))
    if info.retention_bytes is not None:
        limits.append(human_bytes(info.retention_bytes))
    return " or ".join(limits) if limits else "forever"


def _last_event_ms(info: StreamInfo) -> int | None:
    stamps = [s.last_timestamp for s in info.segments if s.last_timestamp is not None]
    return max(stamps) if stamps else None


def streams_table(infos: list[StreamInfo]) -> Table:
    table = Table(
        title=f"{len(infos)} stream{'s' if len(infos) != 1 else ''}",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    table.add_column("Stream", style="bold cyan", no_wrap=True)
    table.add_column("Segments", justify="right")
    table.add_column("Events", justify="right")
    table.add_column("Bytes", justify="right")
    table.add_column("Retention")
    table.add_column("Created")
    table.add_column("Last event")
    for info in infos:
        table.add_row(
            info.name,
            str(sum(not s.sealed for s in info.segments)),
            f"{sum(s.end_offset - s.start_offset for s in info.segments):,}",
            human_bytes(sum(s.bytes for s in info.segments)),
            retention_text(info),
            iso_ms(info.created_ms),
            iso_ms(_last_event_ms(info)) or "-",
        )
    return table


def describe_table(info: StreamInfo) -> Table:
    """One row per segment: its key-hash range in hex (both ends inclusive), the events and
    bytes it retains, its offsets and the times of its first and last retained events. Epoch
    and state columns appear once a stream has scaled (an epoch above 0, a sealed segment)."""
    scaled = any(s.epoch or s.sealed for s in info.segments)
    title = Text.assemble(
        (info.name, "bold cyan"),
        f"  created {iso_ms(info.created_ms)}, retention {retention_text(info)}",
    )
    table = Table(title=title, title_justify="left", show_footer=True, box=box.SIMPLE_HEAD)
    table.add_column("Segment", "total", justify="right")
    if scaled:
        table.add_column("Epoch", justify="right")
        table.add_column("State")
    table.add_column("Key hashes (hex)", no_wrap=True)
    table.add_column(
        "Events",
        f"{sum(s.end_offset - s.start_offset for s in info.segments):,}",
        justify="right",
    )
    table.add_column("Start", justify="right")
    table.add_column("End", justify="right")
    table.add_column(
        "Bytes", human_bytes(sum(s.bytes for s in info.segments)), justify="right", no_wrap=True
    )
    table.add_column("First event", no_wrap=True)
    table.add_column("Last event", no_wrap=True)
    for s in info.segments:
        scaling = [str(s.epoch), "sealed" if s.sealed else "open"] if scaled else []
        table.add_row(
            str(s.number),
            *scaling,
            f"{s.key_lo:016x}-{s.key_hi:016x}",
            f"{s.end_offset - s.start_offset:,}",
            str(s.start_offset),
            str(s.end_offset),
            human_bytes(s.bytes),
            iso_ms(s.first_timestamp) or "-",
            iso_ms(s.last_timestamp) or "-",
        )
    return table

"""``slipstream stream create | list | describe | scale | delete``: rendering stream metadata
and its scale history."""

from __future__ import annotations

from typing import Any

import msgspec
from rich import box
from rich.table import Table
from rich.text import Text

from slipstream import SegmentInfo, StreamInfo

from .._errors import InvalidArgument
from ..protocol import ScaleEventInfo
from ..streams import ScalingDecision, human_bytes
from ._common import human_duration_ms, iso_ms


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
        "epoch": info.epoch,
        "scaling": info.scaling,
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
        "predecessors": segment.predecessors,
        "container": segment.container,  # in a cluster: 'slipstream cluster' says who serves it
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


def _successors(info: StreamInfo) -> dict[int, list[int]]:
    successors: dict[int, list[int]] = {}
    for segment in info.segments:
        for predecessor in segment.predecessors:
            successors.setdefault(predecessor, []).append(segment.number)
    return successors


def _numbers(numbers: list[int]) -> str:
    return ", ".join(str(n) for n in numbers)


def describe_table(info: StreamInfo) -> Table:
    """One row per segment: its key-hash range in hex (both ends inclusive), the events and
    bytes it retains, its offsets and the times of its first and last retained events. Once a
    stream has scaled (an epoch above 0, a sealed segment) each row also says its epoch, whether
    it is open or sealed (a sealed segment's End is its final end) and the segments it came
    from (``<- 0``) or went to (``-> 2, 3``)."""
    scaled = info.epoch > 0 or any(s.epoch or s.sealed for s in info.segments)
    successors = _successors(info)
    policy = f", scaling {info.scaling}" if info.scaling else ""
    title = Text.assemble(
        (info.name, "bold cyan"),
        f"  created {iso_ms(info.created_ms)}, retention {retention_text(info)}",
        f", epoch {info.epoch}{policy}" if scaled or info.scaling else policy,
    )
    table = Table(title=title, title_justify="left", show_footer=True, box=box.SIMPLE_HEAD)
    table.add_column("Segment", "total", justify="right")
    if scaled:
        table.add_column("Epoch", justify="right")
        table.add_column("State")
        table.add_column("From/to", no_wrap=True)
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
        scaling: list[str | Text] = []
        if scaled:
            links = []
            if s.predecessors:
                links.append(f"<- {_numbers(s.predecessors)}")
            if s.number in successors:
                links.append(f"-> {_numbers(successors[s.number])}")
            state = Text("sealed", "dim") if s.sealed else Text("open", "green")
            scaling = [str(s.epoch), state, "  ".join(links) or "-"]
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


# --- scale history ------------------------------------------------------------------------------


def _key_range(segment: SegmentInfo) -> str:
    return f"{segment.key_lo:016x}-{segment.key_hi:016x}"


def _reason_dict(reason: str) -> dict[str, Any]:
    """A scale event's stored reason as data: ``{"rule": "manual"}`` for one by hand, the
    decoded :class:`ScalingDecision` for one the broker decided, and ``{"rule": "unknown",
    "text": ...}`` for text that is neither (a newer broker's form), shown as it is."""
    if reason in ("", "manual"):
        return {"rule": "manual", "reason": "scaled by hand"}
    try:
        decision = ScalingDecision.from_json(reason)
    except InvalidArgument:
        return {"rule": "unknown", "reason": reason}
    document: dict[str, Any] = msgspec.to_builtins(decision)
    return document


def history_dict(info: StreamInfo, events: list[ScaleEventInfo]) -> dict[str, Any]:
    """The ``describe --history`` document: one entry per epoch, oldest first, each with when
    it began, what it did (``create``, ``split``, ``merge``), the segments it sealed (with their
    end offsets, in key order) and opened, every segment that owned keys in it (in key order,
    with its range) and why (``reason``: the decoded decision, or ``{"rule": "manual"}``)."""
    segments = {s.number: s for s in info.segments}
    sealed_in: dict[int, int] = {}
    for event in events:
        for number in event.sealed:
            sealed_in[number] = event.epoch

    def owners(epoch: int) -> list[dict[str, int]]:
        """The segments that owned keys in ``epoch``, in key order."""
        owning = [
            s
            for s in segments.values()
            if s.epoch <= epoch and sealed_in.get(s.number, epoch + 1) > epoch
        ]
        return [
            {"segment": s.number, "key_lo": s.key_lo, "key_hi": s.key_hi}
            for s in sorted(owning, key=lambda s: s.key_lo)
        ]

    def by_key(item: tuple[int, int]) -> int:
        segment = segments.get(item[0])
        return item[0] if segment is None else segment.key_lo

    epochs: list[dict[str, Any]] = [
        {
            "epoch": 0,
            "at_ms": info.created_ms,
            "at": iso_ms(info.created_ms),
            "action": "create",
            "sealed": [],
            "opened": sorted(s.number for s in info.segments if s.epoch == 0),
            "reason": None,
            "owners": owners(0),
        }
    ]
    for event in events:
        epochs.append(
            {
                "epoch": event.epoch,
                "at_ms": event.at_ms,
                "at": iso_ms(event.at_ms),
                "action": "split" if len(event.sealed) == 1 else "merge",
                "sealed": [
                    {"segment": number, "end_offset": end}
                    for number, end in sorted(event.sealed.items(), key=by_key)
                ],
                "opened": list(event.created),
                "reason": _reason_dict(event.reason),
                "owners": owners(event.epoch),
            }
        )
    return {"name": info.name, "epoch": info.epoch, "scaling": info.scaling, "epochs": epochs}


def _rates_line(load: dict[str, Any], metric: str) -> str:
    rates = load["rates"][metric]
    unit = "events/s" if metric == "events" else "bytes/s"
    windows = "  ".join(
        f"{name} {rates[key]:,.1f}"
        for name, key in (
            ("10s", "last_10s"),
            ("60s", "last_60s"),
            ("300s", "last_300s"),
            ("peak 10s", "peak_10s"),
        )
    )
    measured = load["rates"]["measured_ms"] / 1000
    return f"segment {load['segment']} {unit}: {windows} (measured {measured:,.0f} s)"


def history_text(document: dict[str, Any]) -> Text:
    """``describe --history`` for people: per epoch a heading (number, time, what happened),
    the sealed segments with their end offsets, the segments that owned the key space then in
    key order (new ones marked with where they came from) and why."""
    out = Text()
    policy = document["scaling"] or "none (scaled by hand only)"
    out.append(document["name"], "bold cyan")
    out.append(f"  epoch {document['epoch']}, scaling policy {policy}\n")
    ranges = {}
    for entry in document["epochs"]:
        for owner in entry["owners"]:
            ranges[owner["segment"]] = f"{owner['key_lo']:016x}-{owner['key_hi']:016x}"
    for entry in document["epochs"]:
        out.append("\n")
        out.append(f"epoch {entry['epoch']}", "bold")
        out.append(f"  {entry['at']}  ")
        sealed = [s["segment"] for s in entry["sealed"]]
        if entry["action"] == "create":
            out.append(f"created with {len(entry['opened'])} segment")
            out.append("s" if len(entry["opened"]) != 1 else "")
        elif entry["action"] == "split":
            out.append(f"split {sealed[0]} into {_numbers(entry['opened'])}")
        else:
            out.append(f"merged {_numbers(sealed)} into {_numbers(entry['opened'])}")
        reason = entry["reason"]
        if reason is not None:
            out.append(f" ({reason['rule']})", "yellow" if reason["rule"] != "manual" else "")
        out.append("\n")
        for seal in entry["sealed"]:
            out.append(f"  sealed {seal['segment']} ({ranges.get(seal['segment'], '?')})")
            out.append(f" at end offset {seal['end_offset']:,}\n", "dim")
        opened = set(entry["opened"])
        for owner in entry["owners"]:
            number = owner["segment"]
            out.append(f"  {ranges[number]}  {number:>4}")
            if number in opened and entry["action"] != "create":
                out.append(f"  new, from {_numbers(sealed)}", "green")
            out.append("\n")
        if reason is not None:
            out.append("  why: ", "bold")
            out.append(f"{reason['reason']}\n")
            if reason.get("threshold") is not None:
                out.append(f"  threshold {reason['threshold']:,.1f}/s, policy {reason['policy']}\n")
            elif "policy" in reason:
                out.append(f"  policy {reason['policy']}\n")
            metric = "bytes" if reason.get("policy", "").startswith("bytes") else "events"
            for load in reason.get("inputs", ()):
                out.append(f"  {_rates_line(load, metric)}\n", "dim")
    return out

"""Parsing human durations (``7d``) and sizes (``10GiB``) for retention settings, and relative
start times (``-1h``: an hour before now) for readers, the CLI and the Spark source; sizes
written for people (the CLI and the console)."""

from __future__ import annotations

import re

from .._errors import InvalidArgument

_DURATION = re.compile(r"(\d+)(ms|s|m|h|d|w)")
_DURATION_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 604_800_000}
_SIZE = re.compile(r"(\d+)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)?", re.IGNORECASE)
_SIZE_BYTES = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_duration_ms(text: str) -> int:
    """``"90s"``, ``"15m"``, ``"7d"``, ``"1h30m"`` -> milliseconds (> 0)."""
    compact = text.strip().replace(" ", "")
    pos, total = 0, 0
    for match in _DURATION.finditer(compact):
        if match.start() != pos:
            break
        total += int(match.group(1)) * _DURATION_MS[match.group(2)]
        pos = match.end()
    if pos != len(compact) or not compact or total <= 0:
        raise InvalidArgument(f"bad duration {text!r}: use e.g. 90s, 15m, 12h, 7d or 1h30m")
    return total


def parse_size_bytes(text: str) -> int:
    """``"10GiB"``, ``"500MB"``, ``"4096"`` -> bytes (> 0)."""
    match = _SIZE.fullmatch(text.strip())
    if not match or int(match.group(1)) <= 0:
        raise InvalidArgument(f"bad size {text!r}: use e.g. 512MiB, 10GiB or 1TB")
    return int(match.group(1)) * _SIZE_BYTES[(match.group(2) or "b").lower()]


def relative_time_ms(text: str, now_ms: int) -> int | None:
    """``"-1h"``, ``"-15m"``, ``"-2d"``, ``"-30s"``, ``"-1h30m"`` -> ``now_ms`` minus that
    duration, in milliseconds since the epoch (not below 0); None for text that does not start
    with ``-`` (so callers try their other forms). A ``-`` followed by anything but a duration
    raises :class:`InvalidArgument`. The caller passes the clock: this layer has none."""
    stripped = text.strip()
    if not stripped.startswith("-"):
        return None
    try:
        ago = parse_duration_ms(stripped[1:])
    except InvalidArgument:
        raise InvalidArgument(
            f"bad relative time {text!r}: use a minus and a duration, e.g. -30s, -15m, -1h, "
            "-2d or -1h30m"
        ) from None
    return max(0, now_ms - ago)


def human_bytes(count: int) -> str:
    """1536 -> ``1.5 KiB``."""
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{count} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")

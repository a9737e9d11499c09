"""Stream names: ``scope/name``, each part of ``[a-z0-9._-]``, at most 255 characters in all."""

from __future__ import annotations

import re

from .._errors import InvalidName

MAX_NAME_LENGTH = 255
_PART = re.compile(r"[a-z0-9._-]+")


def validate_stream_name(name: str) -> tuple[str, str]:
    """Return ``(scope, name)`` or raise :class:`InvalidName` saying what is wrong."""
    if not isinstance(name, str):
        raise InvalidName(f"stream name must be a string, got {type(name).__name__}")
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidName(
            f"stream name is {len(name)} characters; the limit is {MAX_NAME_LENGTH}", name=name[:64]
        )
    parts = name.split("/")
    if len(parts) != 2:
        raise InvalidName(
            f"stream name {name!r} must be 'scope/name', for example 'demo/orders'", name=name
        )
    for part in parts:
        if not _PART.fullmatch(part) or part in {".", ".."}:
            raise InvalidName(
                f"stream name {name!r}: each part must be non-empty and use only lowercase "
                "letters, digits, '.', '_' and '-' (not '.' or '..' alone)",
                name=name,
            )
    return parts[0], parts[1]


def validate_scope(scope: str) -> str:
    """Return ``scope`` or raise :class:`InvalidName`."""
    if not _PART.fullmatch(scope) or scope in {".", ".."} or len(scope) >= MAX_NAME_LENGTH:
        raise InvalidName(f"scope {scope!r} must use only lowercase letters, digits, '.', '_', '-'")
    return scope

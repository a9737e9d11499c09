"""Stream names: ``scope/name``; each part starts with a lowercase letter or a digit and goes
on with ``[a-z0-9._-]``; at most 255 characters in all.

A part may not start with ``-`` (``-x/y`` would read as an option on every command line), nor
with ``.`` or ``_`` (hidden or reserved-looking names, and ``.``/``..`` as path parts). Streams
created before this rule keep working: the broker checks names only when it creates a stream or
does not know one.

The scope ``_system`` is reserved for the broker's own streams (``_system/audit``, the audit
trail): its names fail the rule above, so no user can create a stream there, and the service
refuses appends, deletes and scaling of the streams the broker made in it
(``is_system_stream``).
"""

from __future__ import annotations

import re

from .._errors import InvalidName

MAX_NAME_LENGTH = 255
_PART = re.compile(r"[a-z0-9][a-z0-9._-]*")
#: the broker's own streams: created by the broker, written only by it, read by admins
SYSTEM_SCOPE = "_system"
#: the audit trail (slipstream/security/_audit.py)
AUDIT_STREAM = f"{SYSTEM_SCOPE}/audit"
_RULE = (
    "each part must be non-empty, start with a lowercase letter or a digit, and use only "
    "lowercase letters, digits, '.', '_' and '-'"
)


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
    if parts[0] == SYSTEM_SCOPE:
        raise InvalidName(
            f"stream name {name!r}: the scope {SYSTEM_SCOPE!r} is reserved for the broker's own "
            "streams (the audit trail); use another scope",
            name=name,
        )
    for part in parts:
        if not _PART.fullmatch(part):
            raise InvalidName(f"stream name {name!r}: {_RULE}", name=name)
    return parts[0], parts[1]


def is_system_stream(name: str) -> bool:
    """Whether ``name`` is in the reserved scope ``_system``: made and written only by the
    broker, readable only with the admin role."""
    return name.startswith(SYSTEM_SCOPE + "/")


def validate_scope(scope: str) -> str:
    """Return ``scope`` or raise :class:`InvalidName` (``_system``, the broker's own scope,
    passes: it may be listed)."""
    if scope == SYSTEM_SCOPE:
        return scope
    if not _PART.fullmatch(scope) or len(scope) >= MAX_NAME_LENGTH:
        raise InvalidName(
            f"scope {scope!r} must start with a lowercase letter or a digit and use only "
            "lowercase letters, digits, '.', '_', '-'"
        )
    return scope


def validate_subscription_name(name: str) -> str:
    """Return ``name`` or raise :class:`InvalidName`: one part of the rules above (a
    lowercase letter or a digit, then ``[a-z0-9._-]``), at most 255 characters."""
    if not isinstance(name, str) or len(name) > MAX_NAME_LENGTH or not _PART.fullmatch(name):
        raise InvalidName(
            f"subscription name {str(name)[:64]!r} must start with a lowercase letter or a "
            "digit and use only lowercase letters, digits, '.', '_' and '-' (at most "
            f"{MAX_NAME_LENGTH} characters), for example 'billing'",
            name=str(name)[:64],
        )
    return name

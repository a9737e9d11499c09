"""Who a request runs for, and what it may ask: the identity model every protocol shares."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Action(enum.StrEnum):
    """What an access rule allows, on streams matched by the rule's pattern.

    ``produce``: append (also in transactions). ``consume``: read, follow, find, browse,
    join groups and commit positions of existing subscriptions. ``manage``: create, update,
    delete and scale streams, create, delete and reset subscriptions. ``admin``: rules,
    tokens, quotas, the audit stream, and other callers' transactions; a principal with the
    admin role holds every action on every stream."""

    PRODUCE = "produce"
    CONSUME = "consume"
    MANAGE = "manage"
    ADMIN = "admin"


class Role(enum.StrEnum):
    """``admin`` may do everything; ``user`` what the access rules grant its subject."""

    ADMIN = "admin"
    USER = "user"


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated identity.

    ``subject``: the name rules are granted to (a token's ``sub``, a client certificate's
    subject common name). ``scope``: a token limited to one scope acts only on streams of
    that scope, whatever the rules say; None for no such limit. ``token_id``: the token's
    id (``jti``), to revoke it; None for a certificate. ``method``: how it authenticated
    (``token`` or ``certificate``). ``expires_at``: a token's expiry (seconds since the
    epoch; the broker closes the connection then), None for a certificate."""

    subject: str
    role: Role = Role.USER
    scope: str | None = None
    token_id: str | None = None
    method: str = "token"
    expires_at: int | None = None

    def __str__(self) -> str:
        return f"{self.subject} ({self.method})"

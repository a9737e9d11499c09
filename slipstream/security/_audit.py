"""The audit trail: one structured record per authentication failure, refused request and
change of streams, subscriptions, rules and tokens.

Every record goes to the ``slipstream.audit`` logger as one JSON object. Records never hold
secrets: no token, key or password, only token ids and subjects."""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec

log = logging.getLogger("slipstream.audit")


class AuditLog:
    """Where the service writes audit records (``record``)."""

    def record(self, event: str, *, subject: str | None, peer: str, **details: Any) -> None:
        """Write one record: ``event`` says what happened (``authentication_failed``,
        ``denied``, ``stream_created``, ...), ``subject`` who did it (None: not
        authenticated), ``peer`` from where; ``details`` are JSON-able facts."""
        entry = {"time_ms": time.time_ns() // 1_000_000, "event": event, "subject": subject}
        entry["peer"] = peer
        entry.update(details)
        log.info("%s", msgspec.json.encode(entry).decode())

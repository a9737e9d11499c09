"""JSON shapes of the admin API: request bodies, and object views of the protocol's answers.

The binary protocol's messages (``StreamInfo``, ``SubscriptionInfo`` ...) are msgpack arrays
(``array_like``); the HTTP API answers with JSON objects of the same fields. ``object_view``
derives an object-shaped ``msgspec.Struct`` from a message type once, so the API has no second
hand-kept copy of any field list, and the OpenAPI components come from the same types
(``msgspec.json.schema_components``).
"""

from __future__ import annotations

import functools
import operator
import types
import typing
from typing import Any

import msgspec

from ..protocol import (
    ScaleEventInfo,
    StreamInfo,
    SubscriptionInfo,
    TxnEnded,
    TxnInfo,
)


@functools.cache
def object_view(message: type[msgspec.Struct]) -> type[msgspec.Struct]:
    """An object-shaped (JSON object, not array) frozen Struct with ``message``'s fields,
    types and defaults; nested message types become their views too."""
    hints = typing.get_type_hints(message)
    names = message.__struct_fields__
    defaults = message.__struct_defaults__
    first_default = len(names) - len(defaults)
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    for index, name in enumerate(names):
        kind = _mirror(hints[name])
        if index < first_default:
            fields.append((name, kind))
        else:
            fields.append((name, kind, defaults[index - first_default]))
    return msgspec.defstruct(message.__name__, fields, frozen=True, module=__name__)


def _mirror(kind: Any) -> Any:
    if isinstance(kind, type) and issubclass(kind, msgspec.Struct):
        return object_view(kind)
    args = typing.get_args(kind)
    if not args:
        return kind
    mirrored = tuple(_mirror(a) for a in args)
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        return functools.reduce(operator.or_, mirrored)
    origin = typing.get_origin(kind)
    return origin[mirrored if len(mirrored) > 1 else mirrored[0]]


def view(value: msgspec.Struct) -> msgspec.Struct:
    """``value`` (a protocol message) as its object view."""
    return msgspec.convert(value, object_view(type(value)), from_attributes=True)


# --- request bodies: unknown fields are refused, so a typo is a 400, not a silent no-op ------


class CreateStream(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A new stream ``scope/name``. ``segments``: how many it starts with (with a scaling
    policy, the policy's minimum wins); ``retention_ms`` / ``retention_bytes``: null keeps
    forever / no size limit; ``scaling``: a policy's text ("fixed 2",
    "events 5000/s factor 2 min 1", "bytes 1048576/s factor 2 min 1 max 8"), "" for none."""

    name: str
    segments: int = 1
    retention_ms: int | None = None
    retention_bytes: int | None = None
    scaling: str = ""


class UpdateStream(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """For each retention limit: absent or null leaves it, 0 removes it, a positive value
    replaces it. ``scaling``: a policy's text, "" for none, absent or null to leave it."""

    retention_ms: int | None = None
    retention_bytes: int | None = None
    scaling: str | None = None


class ScaleStream(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One open segment and ``into`` (split into that many), or adjacent open segments
    (merged into one)."""

    segments: list[int]
    into: int = 2


class CreateSubscription(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A durable cursor on the stream. ``mode``: ordered, queue or key_ordered_queue; ``at``:
    earliest, latest, time (with ``timestamp_ms``) or cut (with ``positions``,
    ``{segment: offset}``); ``options``: a queue's options (ack_timeout_ms, max_deliveries,
    ...)."""

    name: str
    mode: str = "ordered"
    at: str = "earliest"
    timestamp_ms: int | None = None
    positions: dict[int, int] | None = None
    options: dict[str, Any] | None = None


class ResetSubscription(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Move every position to ``at`` (as for create); live members restart from there."""

    at: str
    timestamp_ms: int | None = None
    positions: dict[int, int] | None = None


# --- answers that are the API's own ----------------------------------------------------------


class ErrorBody(msgspec.Struct, frozen=True):
    """Every error: ``error`` is a stable code (the binary protocol's where there is one),
    ``message`` says what went wrong and the fix, ``details`` name the things involved."""

    error: str
    message: str
    details: dict[str, Any] = {}


class BrowsedEvent(msgspec.Struct, frozen=True):
    """One event. ``key``: UTF-8 text, or base64 when ``key_format`` is "base64" (null for
    none). ``value``: the decoded JSON when it parses (``value_format`` "json"), else base64
    ("base64"). ``headers``: UTF-8 text values, base64 for the names in ``headers_base64``."""

    segment: int
    offset: int
    timestamp: int
    key: str | None
    key_format: str
    value: Any
    value_format: str
    headers: dict[str, str]
    headers_base64: list[str] = []


class EventPage(msgspec.Struct, frozen=True):
    """A page of events, oldest first by (timestamp, segment, offset). ``older``: the cut to
    pass as ``before`` for the previous page (null at the start); ``newer``: the cut to pass
    as ``after`` for the next page (null at the tail); cuts are ``segment:offset`` lists.
    For a find: ``batches_read`` (what the index saved is the rest) and ``truncated`` (it
    stopped at its byte budget before ``limit``)."""

    stream: str
    events: list[BrowsedEvent]
    older: str | None = None
    newer: str | None = None
    batches_read: int | None = None
    truncated: bool = False


class IdentityView(msgspec.Struct, frozen=True):
    """A transactional id: its producer id and epoch, its last committed transaction
    (``last_txn_id`` -1 if none), that commit's ``committed_ms`` and ``metadata`` (the JSON
    the committer stored, e.g. the Spark sink's ``{"query", "batch", "events"}``; null if
    none or not JSON, with the raw bytes in ``metadata_base64``)."""

    transactional_id: str
    producer_id: int
    epoch: int
    last_txn_id: int
    committed_ms: int
    metadata: Any = None
    metadata_base64: str = ""


class StreamCutBody(msgspec.Struct, frozen=True):
    stream: str
    positions: dict[int, int]


class ContainerUse(msgspec.Struct, frozen=True):
    """One container: its segments, journal bytes (all files, the active one) and files not
    yet moved to chunks."""

    id: int
    segments: int
    journal_bytes: int
    journal_active_bytes: int
    journal_sealed_files: int
    appended_batches: int


class DiskUse(msgspec.Struct, frozen=True):
    """The data directory's filesystem (``total_bytes``, ``free_bytes``), the journals'
    bytes and the bytes stored in segments (their chunks and journal entries)."""

    data_dir: str
    total_bytes: int
    free_bytes: int
    journal_bytes: int
    segment_bytes: int


class BrokerInfo(msgspec.Struct, frozen=True):
    """``started_ms``: when it started serving; ``config``: what the broker runs with;
    ``recovery``: what its last start recovered (counts, torn and damaged bytes,
    milliseconds; see ``Broker.open``)."""

    version: str
    started_ms: int
    address: str
    http_address: str
    config: dict[str, Any]
    containers: list[ContainerUse]
    disk: DiskUse
    recovery: dict[str, int]
    streams: int
    open_transactions: int


StreamView = object_view(StreamInfo)
SubscriptionView = object_view(SubscriptionInfo)
ScaleEventView = object_view(ScaleEventInfo)
TxnView = object_view(TxnInfo)
TxnEndedView = object_view(TxnEnded)

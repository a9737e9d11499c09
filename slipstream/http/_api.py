"""The admin API's operations: one table (``OPERATIONS``) that the Starlette routes and the
OpenAPI description are both built from, so neither can drift from the other.

Every operation calls ``Service`` methods (slipstream/broker/_service.py) with a ``Caller`` of
its own, made for the request and disconnected after it: the same checks, catalog writes and
errors as the binary protocol, no second copy. A request runs to its end once its handler
started, also if the client goes away (uvicorn marks the connection gone, it does not cancel
the handler, and no middleware here does).
"""

from __future__ import annotations

import base64
import dataclasses
import re
import shutil
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import msgspec
from starlette.requests import Request

from .. import __version__
from .._errors import InvalidArgument
from ..broker._service import decision_message, rule_message
from ..format import Event
from ..protocol import AccessDecision, AccessRule, IdentityInfo, QuotaInfo, TokenInfo, TokenIssued
from ..streams import format_positions
from ._schemas import (
    BrokerInfo,
    BrowsedEvent,
    ContainerUse,
    CreateStream,
    CreateSubscription,
    DiskUse,
    EventPage,
    IdentityView,
    ResetSubscription,
    ScaleEventView,
    ScaleStream,
    StreamCutBody,
    StreamView,
    SubscriptionView,
    TxnEndedView,
    TxnView,
    UpdateStream,
    object_view,
    view,
)

if TYPE_CHECKING:
    from ..broker import Broker, Caller, Service


def _list_of(kind: Any) -> Any:
    """``list[kind]`` for a type made at run time (the OpenAPI schema of a list answer)."""
    return cast(Any, list)[kind]


#: the most events one page or find returns
MAX_EVENTS = 500


@dataclass(frozen=True, slots=True)
class Param:
    """A query parameter, for the OpenAPI description (handlers parse their own)."""

    name: str
    kind: str  # "string" or "integer"
    description: str
    enum: tuple[str, ...] = ()


@dataclass(slots=True)
class Call:
    """One request as an operation sees it: the broker, its service, the request's own
    caller and its decoded body (None for operations without one)."""

    request: Request
    broker: Broker
    caller: Caller
    body: Any

    @property
    def service(self) -> Service:
        return self.broker.service

    @property
    def stream(self) -> str:
        params = self.request.path_params
        return f"{params['scope']}/{params['name']}"

    def query_int(self, name: str, default: int | None, low: int, high: int) -> int | None:
        text = self.request.query_params.get(name)
        if text is None or text == "":
            return default
        try:
            value = int(text)
        except ValueError:
            raise InvalidArgument(f"{name} is an integer, not {text!r}", parameter=name) from None
        if not low <= value <= high:
            raise InvalidArgument(f"{name} is {low} to {high}, not {value}", parameter=name)
        return value


Handler = Callable[[Call], Awaitable[Any]]


@dataclass(frozen=True, slots=True)
class Operation:
    method: str
    path: str
    handler: Handler
    answer: Any  # a type for the 2xx body's schema, None for no body (204)
    body: type[msgspec.Struct] | None = None
    query: tuple[Param, ...] = ()
    errors: tuple[int, ...] = (400,)
    status: int = 200

    @property
    def summary(self) -> str:
        return (self.handler.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")


OPERATIONS: list[Operation] = []

STREAM = "/api/streams/{scope}/{name}"
SUBSCRIPTION = STREAM + "/subscriptions/{subscription}"


def operation(
    method: str,
    path: str,
    answer: Any,
    *,
    body: type[msgspec.Struct] | None = None,
    query: Sequence[Param] = (),
    errors: Sequence[int] = (400,),
    status: int = 200,
) -> Callable[[Handler], Handler]:
    def register(handler: Handler) -> Handler:
        OPERATIONS.append(
            Operation(method, path, handler, answer, body, tuple(query), tuple(errors), status)
        )
        return handler

    return register


# --- streams ---------------------------------------------------------------------------------


@operation(
    "GET",
    "/api/streams",
    _list_of(StreamView),
    query=[Param("scope", "string", "only the streams of this scope")],
)
async def list_streams(call: Call) -> Any:
    """The streams, each with its segments of every epoch."""
    scope = call.request.query_params.get("scope") or None
    return [view(s) for s in await call.service.list_streams_live(call.caller, scope)]


@operation("POST", "/api/streams", StreamView, body=CreateStream, errors=(400, 409), status=201)
async def create_stream(call: Call) -> Any:
    """Create a stream.

    409 stream_exists if the name is taken; 400 invalid_name / invalid_argument."""
    body: CreateStream = call.body
    info = await call.service.create_stream(
        call.caller,
        body.name,
        body.segments,
        body.retention_ms,
        body.retention_bytes,
        body.scaling,
    )
    return view(info)


@operation("GET", STREAM, StreamView, errors=(400, 404))
async def describe_stream(call: Call) -> Any:
    """A stream: retention, scaling policy, epoch, and its segments of every epoch (key
    range, sealed or open, offsets, bytes, time range, predecessors)."""
    return view(await call.service.stream_info(call.caller, call.stream))


@operation("PATCH", STREAM, StreamView, body=UpdateStream, errors=(400, 404))
async def update_stream(call: Call) -> Any:
    """Change a stream's retention and/or scaling policy; stored before it answers."""
    body: UpdateStream = call.body
    info = await call.service.update_stream(
        call.caller, call.stream, body.retention_ms, body.retention_bytes, body.scaling
    )
    return view(info)


@operation("DELETE", STREAM, None, errors=(400, 404), status=204)
async def delete_stream(call: Call) -> Any:
    """Delete a stream, its data and its subscriptions."""
    await call.service.delete_stream(call.caller, call.stream)


@operation("GET", STREAM + "/history", _list_of(ScaleEventView), errors=(400, 404))
async def scale_history(call: Call) -> Any:
    """The stream's scales over time: per epoch, the segments sealed (with their end
    offsets) and created, and why (a rule's decision, or "manual")."""
    return [view(e) for e in call.service.scale_history(call.caller, call.stream)]


@operation("POST", STREAM + "/scale", StreamView, body=ScaleStream, errors=(400, 404, 409))
async def scale_stream(call: Call) -> Any:
    """Split one open segment into ``into``, or merge adjacent open segments, in a new epoch.

    Waits for transactions that staged into them to end."""
    body: ScaleStream = call.body
    info = await call.service.scale_stream(call.caller, call.stream, body.segments, body.into)
    return view(info)


_AT = Param("at", "string", "where: earliest, latest, or time (with timestamp_ms)")
_TIMESTAMP = Param("timestamp_ms", "integer", "with at=time: milliseconds since the Unix epoch")


@operation("GET", STREAM + "/cut", StreamCutBody, query=[_AT, _TIMESTAMP], errors=(400, 404))
async def stream_cut(call: Call) -> Any:
    """A StreamCut (segment -> offset) at the earliest, the latest, or a time."""
    at = call.request.query_params.get("at", "latest")
    timestamp_ms = call.query_int("timestamp_ms", None, 0, 2**63 - 1)
    positions = await call.service.cut(call.caller, call.stream, at, timestamp_ms)
    return StreamCutBody(call.stream, positions)


# --- events ----------------------------------------------------------------------------------


@operation(
    "GET",
    STREAM + "/events",
    EventPage,
    query=[
        Param("limit", "integer", f"events per page, 1 to {MAX_EVENTS} (default 50)"),
        Param("before", "string", "browse: the page before this cut (segment:offset,...)"),
        Param("after", "string", "browse: the page from this cut on (segment:offset,...)"),
        Param(
            "at",
            "string",
            "browse: earliest, latest (default: the newest page) or time (with timestamp_ms)",
        ),
        _TIMESTAMP,
        Param("key", "string", "find: events of this routing key (UTF-8), newest first"),
        Param("start_ms", "integer", "find: events at or after this time (ms)"),
        Param("end_ms", "integer", "find: events before this time (ms)"),
    ],
    errors=(400, 404),
)
async def events(call: Call) -> Any:
    """Browse a stream's events page by page, or find them by key and time.

    Browsing reads at most ``limit`` events per segment (Service.browse_events); a find (any of
    key, start_ms, end_ms) reads only the batches the find index names (Service.find_events)."""
    query = call.request.query_params
    limit = call.query_int("limit", 50, 1, MAX_EVENTS)
    assert limit is not None
    if any(name in query for name in ("key", "start_ms", "end_ms")):
        return await _find_events(call, limit)
    if "before" in query:
        page = await call.service.browse_events(
            call.caller, call.stream, before=query["before"], limit=limit
        )
    elif "after" in query:
        page = await call.service.browse_events(
            call.caller, call.stream, after=query["after"], limit=limit
        )
    else:
        at = query.get("at", "latest")
        timestamp_ms = (
            None if at == "latest" else call.query_int("timestamp_ms", None, 0, 2**63 - 1)
        )
        page = await call.service.browse_events(
            call.caller, call.stream, at=at, timestamp_ms=timestamp_ms, limit=limit
        )
    return EventPage(
        call.stream,
        [_browsed(event) for event in page.events],
        format_positions(page.older) if page.older is not None else None,
        format_positions(page.newer) if page.newer is not None else None,
    )


async def _find_events(call: Call, limit: int) -> EventPage:
    """Find by key and/or time through ``Service.find_events`` (the per-segment index)."""
    query = call.request.query_params
    start_ms = call.query_int("start_ms", None, -(2**63), 2**63 - 1)
    end_ms = call.query_int("end_ms", None, -(2**63), 2**63 - 1)
    find = getattr(call.service, "find_events", None)
    if find is None:  # a build without the find index (broker/_find.py)
        raise InvalidArgument("find by key or time is not available in this broker build")
    found = await find(
        call.caller,
        call.stream,
        key=query.get("key"),
        start_ms=start_ms,
        end_ms=end_ms,
        limit=limit,
    )
    return EventPage(
        call.stream,
        [_browsed(e) for e in found.events],
        batches_read=found.batches_read,
        truncated=found.truncated,
    )


def _browsed(event: Event) -> BrowsedEvent:
    key, key_format = _text_or_base64(event.key)
    try:
        value: Any = msgspec.json.decode(event.value)
        value_format = "json"
    except msgspec.DecodeError:
        value, value_format = base64.b64encode(event.value).decode(), "base64"
    headers: dict[str, str] = {}
    binary: list[str] = []
    for name, raw in event.headers.items():
        text, kind = _text_or_base64(raw)
        headers[name] = text or ""
        if kind == "base64":
            binary.append(name)
    return BrowsedEvent(
        event.segment,
        event.offset,
        event.timestamp,
        key,
        key_format,
        value,
        value_format,
        headers,
        binary,
    )


def _text_or_base64(raw: bytes | None) -> tuple[str | None, str]:
    if raw is None:
        return None, "text"
    try:
        return raw.decode(), "text"
    except UnicodeDecodeError:
        return base64.b64encode(raw).decode(), "base64"


# --- subscriptions ---------------------------------------------------------------------------


@operation("GET", STREAM + "/subscriptions", _list_of(SubscriptionView), errors=(400, 404))
async def list_subscriptions(call: Call) -> Any:
    """The stream's subscriptions."""
    call.service.describe_stream(call.caller, call.stream)  # 404 for an unknown stream
    return [view(s) for s in call.service.list_subscriptions(call.caller, call.stream)]


@operation(
    "POST",
    STREAM + "/subscriptions",
    SubscriptionView,
    body=CreateSubscription,
    errors=(400, 404, 409),
    status=201,
)
async def create_subscription(call: Call) -> Any:
    """Create a subscription (a durable cursor shared by a group of consumers).

    409 subscription_exists if the name is taken on the stream."""
    body: CreateSubscription = call.body
    info = await call.service.create_subscription(
        call.caller,
        call.stream,
        body.name,
        body.mode,
        body.at,
        body.timestamp_ms,
        body.positions,
        body.options,
    )
    return view(info)


@operation("GET", SUBSCRIPTION, SubscriptionView, errors=(400, 404))
async def describe_subscription(call: Call) -> Any:
    """A subscription: per segment its position, backlog in events and bytes, lag (age of
    the oldest unconsumed event), the member reading it; and the group's members."""
    info = await call.service.describe_subscription(
        call.caller, call.stream, call.request.path_params["subscription"]
    )
    return view(info)


@operation("DELETE", SUBSCRIPTION, None, errors=(400, 404), status=204)
async def delete_subscription(call: Call) -> Any:
    """Delete a subscription; its members get subscription_not_found on their next poll."""
    await call.service.delete_subscription(
        call.caller, call.stream, call.request.path_params["subscription"]
    )


@operation(
    "POST",
    SUBSCRIPTION + "/reset",
    SubscriptionView,
    body=ResetSubscription,
    errors=(400, 404),
)
async def reset_subscription(call: Call) -> Any:
    """Move every position of a subscription (a new generation); live members restart
    from there."""
    body: ResetSubscription = call.body
    info = await call.service.reset_subscription(
        call.caller,
        call.stream,
        call.request.path_params["subscription"],
        body.at,
        body.timestamp_ms,
        body.positions,
    )
    return view(info)


# --- transactions ----------------------------------------------------------------------------


@operation("GET", "/api/transactions", _list_of(TxnView), errors=())
async def list_transactions(call: Call) -> Any:
    """Open (and committing) transactions: id, producer, state, age, size."""
    return [view(t) for t in call.service.list_txns(call.caller)]


@operation(
    "GET",
    "/api/transactions/identities",
    _list_of(IdentityView),
    query=[Param("prefix", "string", 'only the transactional ids starting with this ("spark:")')],
    errors=(),
)
async def list_identities(call: Call) -> Any:
    """Transactional ids, sorted, with each one's last committed transaction and its
    metadata (a Spark sink query's is ``spark:<query id>`` with its last batch)."""
    prefix = call.request.query_params.get("prefix", "")
    return [_identity_view(i) for i in call.service.list_identities(call.caller, prefix)]


def _identity_view(info: IdentityInfo) -> IdentityView:
    metadata: Any = None
    if info.last_metadata:
        try:
            metadata = msgspec.json.decode(info.last_metadata)
        except msgspec.DecodeError:
            metadata = None
    return IdentityView(
        info.transactional_id,
        info.producer_id,
        info.epoch,
        info.last_txn_id,
        info.committed_ms,
        metadata,
        base64.b64encode(info.last_metadata).decode(),
    )


@operation("POST", "/api/transactions/{txn_id}/abort", TxnEndedView, errors=(400, 404, 409))
async def abort_transaction(call: Call) -> Any:
    """Abort an open transaction as an operator (logged): none of its events become
    visible. Asking about one that already ended answers how it ended."""
    text = call.request.path_params["txn_id"]
    try:
        txn_id = int(text)
    except ValueError:
        raise InvalidArgument(f"a transaction id is an integer, not {text!r}") from None
    if not 0 <= txn_id < 2**63:
        raise InvalidArgument(f"a transaction id is 0 to 2**63-1, not {txn_id}")
    ended = await call.service.end_txn(call.caller, txn_id, False, operator=True)
    return view(ended)


# --- access rules (docs/security.md, "Authorization") -----------------------------------------

RuleView = object_view(AccessRule)
AccessDecisionView = object_view(AccessDecision)


class RuleBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An access rule: ``subject`` (``*``: everyone authenticated), ``action`` (produce,
    consume, manage, admin), ``pattern`` (``*``, ``demo/*``, ``*/orders``, ``demo/orders``)."""

    subject: str
    action: str
    pattern: str


class RevokedView(msgspec.Struct, frozen=True):
    revoked: bool


@operation("GET", "/api/rules", _list_of(RuleView), errors=(403,))
async def list_rules(call: Call) -> Any:
    """Every access rule, sorted by subject, action, pattern (admin only)."""
    return [view(rule_message(r)) for r in call.service.list_rules(call.caller)]


@operation("POST", "/api/rules", RuleView, body=RuleBody, errors=(400, 403), status=201)
async def grant_rule(call: Call) -> Any:
    """Add an access rule (admin only); stored before the answer, in force at once."""
    body: RuleBody = call.body
    rule = await call.service.grant(call.caller, body.subject, body.action, body.pattern)
    return view(rule_message(rule))


@operation("POST", "/api/rules/revoke", RevokedView, body=RuleBody, errors=(400, 403))
async def revoke_rule(call: Call) -> Any:
    """Remove an access rule (admin only): ``revoked`` false if there was none."""
    body: RuleBody = call.body
    removed = await call.service.revoke(call.caller, body.subject, body.action, body.pattern)
    return RevokedView(removed)


@operation(
    "GET",
    "/api/rules/check",
    AccessDecisionView,
    query=[
        Param("subject", "string", "who (required)"),
        Param("action", "string", "what (required)", ("produce", "consume", "manage", "admin")),
        Param("stream", "string", "on which stream, or * for broker-wide (required)"),
        Param("role", "string", "the subject's role (default user)", ("user", "admin")),
        Param("scope", "string", "as for a token limited to this scope"),
    ],
    errors=(400, 403),
)
async def check_access(call: Call) -> Any:
    """A dry run (admin only): would the subject be allowed the action on the stream, and
    which rule decides?"""
    query = call.request.query_params
    missing = [name for name in ("subject", "action", "stream") if not query.get(name)]
    if missing:
        raise InvalidArgument(f"missing query parameter(s): {', '.join(missing)}")
    decision = call.service.check_access(
        call.caller,
        query["subject"],
        query["action"],
        query["stream"],
        query.get("role") or "user",
        query.get("scope") or None,
    )
    return view(decision_message(decision))


# --- quotas (docs/security.md, "Quotas") ------------------------------------------------------

QuotaView = object_view(QuotaInfo)


class QuotaBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A scope's quota; absent or null: no limit (all absent removes the quota).
    ``produce_bytes`` / ``consume_bytes``: bytes per second appended to / read from the
    scope's streams; ``requests``: requests per second; ``connections``: open connections of
    tokens limited to the scope."""

    produce_bytes: int | None = None
    consume_bytes: int | None = None
    requests: int | None = None
    connections: int | None = None


@operation("GET", "/api/quotas", _list_of(QuotaView), errors=(403,))
async def list_quotas(call: Call) -> Any:
    """Every scope's quota, by scope (admin only with authentication on)."""
    return [view(q) for q in call.service.list_quotas(call.caller)]


@operation("PUT", "/api/quotas/{scope}", _list_of(QuotaView), body=QuotaBody, errors=(400, 403))
async def set_quota(call: Call) -> Any:
    """Set (replace) a scope's quota; stored before the answer, in force at once. A tenant
    over a rate is slowed down, not refused. Answers every quota."""
    body: QuotaBody = call.body
    scope = call.request.path_params["scope"]
    quota = QuotaInfo(
        scope, body.produce_bytes, body.consume_bytes, body.requests, body.connections
    )
    return [view(q) for q in await call.service.set_quota(call.caller, quota)]


@operation("DELETE", "/api/quotas/{scope}", None, errors=(400, 403), status=204)
async def delete_quota(call: Call) -> Any:
    """Remove a scope's quota: no limits from now on."""
    await call.service.set_quota(call.caller, QuotaInfo(call.request.path_params["scope"]))


# --- tokens (authentication on; admin only) ---------------------------------------------------


class CreateTokenBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A token for ``subject``: ``role`` admin or user, ``scope`` (null: every scope),
    ``expires_s`` its lifetime in seconds (0: 30 days), ``algorithm`` EdDSA or HS256."""

    subject: str
    role: str = "user"
    scope: str | None = None
    expires_s: int = 0
    algorithm: str = "EdDSA"


TokenView = object_view(TokenInfo)
TokenIssuedView = object_view(TokenIssued)


@operation(
    "POST", "/api/tokens", TokenIssuedView, body=CreateTokenBody, errors=(400, 403), status=201
)
async def create_token(call: Call) -> Any:
    """Create a token: the answer holds it, once (the broker keeps only its id and claims)."""
    body: CreateTokenBody = call.body
    issued = await call.service.create_token(
        call.caller, body.subject, body.role, body.scope, body.expires_s, body.algorithm
    )
    return view(issued)


@operation("GET", "/api/tokens", _list_of(TokenView), errors=(400, 403))
async def list_tokens(call: Call) -> Any:
    """Tokens issued through the API (ids and claims, never tokens) and revoked ids."""
    return [view(t) for t in call.service.list_tokens(call.caller)]


@operation("DELETE", "/api/tokens/{token_id}", None, errors=(400, 403), status=204)
async def revoke_token(call: Call) -> Any:
    """Revoke a token by id: refused from now on, its open connections closed."""
    await call.service.revoke_token(call.caller, call.request.path_params["token_id"])


# --- broker ----------------------------------------------------------------------------------

_URL_PASSWORD = re.compile(r"(://[^:/@?#]*):[^@/?#]*@")
_PARAM_PASSWORD = re.compile(r"(?i)(\bpassword=)[^&\s]*")


def redact_dsn(dsn: str) -> str:
    """``dsn`` (the ``--meta`` catalog URL) with its password, in the URL's user part or as a
    ``password=`` parameter, replaced by ``***``; the rest (user, host, database) kept."""
    return _PARAM_PASSWORD.sub(r"\1***", _URL_PASSWORD.sub(r"\1:***@", dsn))


@operation("GET", "/api/broker", BrokerInfo, errors=())
async def broker_info(call: Call) -> Any:
    """The broker: version, configuration, containers, journal and disk use, and what its
    last start recovered."""
    broker = call.broker
    data_dir = Path(broker.config.data_dir)
    disk = shutil.disk_usage(data_dir)
    journals = [c.journal.total_bytes for c in broker.containers]
    streams = call.service.list_streams(call.caller)
    containers = [
        ContainerUse(
            c.id,
            len(c.segments),
            c.journal.total_bytes,
            c.journal.active_bytes,
            len(c.journal.sealed_files()),
            c.appended_batches,
        )
        for c in broker.containers
    ]
    config = msgspec.to_builtins(dataclasses.asdict(broker.config), enc_hook=str)
    if config.get("meta"):  # any authenticated caller reads this: never the catalog's password
        config["meta"] = redact_dsn(config["meta"])
    host, port = broker.address or ("", 0)
    http_host, http_port = broker.http_address or ("", 0)
    return BrokerInfo(
        version=__version__,
        started_ms=call.request.app.state.started_ms,
        address=f"{host}:{port}",
        http_address=f"{http_host}:{http_port}",
        config=config,
        containers=containers,
        disk=DiskUse(
            str(data_dir),
            disk.total,
            disk.free,
            sum(journals),
            sum(seg.bytes for s in streams for seg in s.segments),
        ),
        recovery=dict(broker.recovery),
        streams=len(streams),
        open_transactions=len(call.service.list_txns(call.caller)),
    )

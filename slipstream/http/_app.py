"""The broker's HTTP application: the admin API under ``/api``, ``/metrics``, the console.

Errors are JSON objects ``{"error": code, "message": ..., "details": {...}}`` with a status
that follows the code (``STATUS_BY_CODE``): the ``SlipstreamError`` codes of the binary
protocol, plus the HTTP layer's own: ``malformed_json`` (400), ``request_too_large`` (413),
``not_found`` (404, no such route), ``method_not_allowed`` (405) and ``internal`` (500, a bug:
logged with its traceback). A request body is read up to ``MAX_BODY_BYTES``; past that the
answer is 413 without reading the rest. Every error answer counts into
``slipstream_rejected_requests_total`` by its code, and every request into
``slipstream_http_requests_total`` by route and status (``CountRequests``, http/_metrics.py).

Authentication (a broker with ``--auth``): every API request and ``/metrics`` carries
``Authorization: Bearer <token>``; without one, or with a bad one, the answer is 401 with the
typed body (``authentication_failed``, the reason in ``details``) and ``WWW-Authenticate:
Bearer``. The API never takes the console's cookie, so a page of another site cannot act
through a logged-in browser. ``/api/openapi.json`` stays public.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from .._errors import SlipstreamError
from ..security import Action
from ._api import OPERATIONS, Call, Operation
from ._metrics import CountRequests
from ._openapi import openapi_document

if TYPE_CHECKING:
    from ..broker import Broker

log = logging.getLogger("slipstream.http")

#: the largest request body read (every body of the API is a small JSON object)
MAX_BODY_BYTES = 1 << 20

STATUS_BY_CODE: dict[str, int] = {
    "invalid_argument": 400,
    "invalid_name": 400,
    "protocol": 400,
    "corrupt_batch": 400,
    "offset_out_of_range": 400,
    "malformed_json": 400,
    "authentication_failed": 401,
    "not_owner": 403,
    "permission_denied": 403,
    "stream_not_found": 404,
    "subscription_not_found": 404,
    "segment_not_found": 404,
    "transaction_not_found": 404,
    "not_found": 404,
    "method_not_allowed": 405,
    "stream_exists": 409,
    "subscription_exists": 409,
    "segment_sealed": 409,
    "group_active": 409,
    "transaction_aborted": 409,
    "producer_fenced": 409,
    "stale_generation": 409,
    "not_assigned": 409,
    "unknown_member": 409,
    "unknown_delivery": 409,
    "batch_too_large": 413,
    "request_too_large": 413,
    "limit_exceeded": 429,
    "shutting_down": 503,
    "broker_unavailable": 503,
    "wrong_broker": 503,  # a cluster container moving: ask again shortly
    "storage_error": 503,
    "storage_full": 507,
}


class ApiError(Exception):
    """An error of the HTTP layer itself (not the service's): code, message, details."""

    def __init__(self, code: str, message: str, **details: Any) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.details = details


def status_of(exc: SlipstreamError) -> int:
    """The HTTP status for a service error: its code's, else its nearest base class's, else
    500 (an error the API does not expect)."""
    for cls in type(exc).__mro__:
        status = STATUS_BY_CODE.get(getattr(cls, "code", ""))
        if status is not None:
            return status
    return 500


def error_response(status: int, code: str, message: str, details: dict[str, Any]) -> Response:
    body = msgspec.json.encode({"error": code, "message": message, "details": details})
    return Response(body, status_code=status, media_type="application/json")


def json_response(value: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(value), status_code=status, media_type="application/json")


async def read_body(request: Request, kind: type[msgspec.Struct]) -> Any:
    """The request's JSON body as ``kind``: 413 past MAX_BODY_BYTES (by Content-Length, or
    while reading a body sent without one), 400 malformed_json or invalid_argument."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ApiError(
            "request_too_large",
            f"the body is {declared} bytes; the limit is {MAX_BODY_BYTES}",
            limit=MAX_BODY_BYTES,
        )
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise ApiError(
                "request_too_large",
                f"the body is over the limit of {MAX_BODY_BYTES} bytes",
                limit=MAX_BODY_BYTES,
            )
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        wrong_type = exc
    except msgspec.DecodeError as exc:
        raise _malformed(body, exc) from None
    try:  # a typed decode may stop at a wrong type before it reaches broken syntax
        msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise _malformed(body, exc) from None
    raise ApiError("invalid_argument", f"bad request body: {wrong_type}")


def _malformed(body: bytearray, exc: msgspec.DecodeError) -> ApiError:
    what = "empty" if not body.strip() else f"not JSON ({exc})"
    return ApiError("malformed_json", f"the request body is {what}; send a JSON object")


def _endpoint(op: Operation) -> Any:
    async def endpoint(request: Request) -> Response:
        broker: Broker = request.app.state.broker
        body = await read_body(request, op.body) if op.body is not None else None
        peer = f"http {request.client.host}:{request.client.port}" if request.client else "http"
        caller = broker.service.connect(peer)
        try:
            broker.service.authenticate(caller, bearer_credentials(request))
            result = await op.handler(Call(request, broker, caller, body))
        finally:
            broker.service.disconnect(caller)
        if op.answer is None:
            return Response(status_code=op.status)
        return json_response(result, op.status)

    endpoint.__name__ = op.handler.__name__
    return endpoint


def bearer_credentials(request: Request) -> dict[str, str] | None:
    """``{"token": T}`` from ``Authorization: Bearer T`` (None without one)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return {"token": token.strip()}


def count_rejected(request: Request, code: str) -> None:
    """Count an error answer into ``slipstream_rejected_requests_total`` (by ``code``), as the
    binary protocol counts its Error replies."""
    metrics = getattr(request.app.state.broker, "metrics", None)
    if metrics is not None:
        metrics.rejected(code)


async def _slipstream_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, SlipstreamError)
    count_rejected(request, exc.code)
    status = status_of(exc)
    if status >= 500:
        log.error("%s %s failed: %s", request.method, request.url.path, exc, exc_info=exc)
    details = msgspec.to_builtins(exc.details, enc_hook=str)
    response = error_response(status, exc.code, exc.message, details)
    if status == 401:
        response.headers["WWW-Authenticate"] = 'Bearer realm="slipstream"'
    return response


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    count_rejected(request, exc.code)
    return error_response(STATUS_BY_CODE[exc.code], exc.code, exc.message, exc.details)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    count_rejected(request, code)
    message = {
        404: f"no such resource: {request.url.path} (the API is described at /api/openapi.json)",
        405: f"{request.method} is not allowed on {request.url.path}",
    }.get(exc.status_code, str(exc.detail))
    response = error_response(exc.status_code, code, message, {})
    response.headers.update(exc.headers or {})
    return response


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    count_rejected(request, "internal")
    return error_response(500, "internal", f"internal error: {type(exc).__name__}", {})


class _AsgiEndpoint:
    """An ASGI app as a Route's endpoint (a plain function would be taken for a handler)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


def _authenticated(broker: Broker, app: ASGIApp) -> ASGIApp:
    """``app`` behind the bearer token check (when the broker's authentication is on)."""

    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        service = broker.service
        if service.auth:
            request = Request(scope)
            peer = f"http {request.client.host}:{request.client.port}" if request.client else "http"
            caller = service.connect(peer)
            try:
                service.authenticate(caller, bearer_credentials(request))
                service.authorize(caller, Action.ADMIN, None)  # every stream's numbers
            except SlipstreamError as exc:
                response = await _slipstream_error(request, exc)
                await response(scope, receive, send)
                return
            finally:
                service.disconnect(caller)
        await app(scope, receive, send)

    return guarded


def create_app(broker: Broker) -> Starlette:
    """The admin API (``/api/...``, described at ``/api/openapi.json``), ``/metrics`` where
    the broker has metrics, and the console at ``/`` where ``slipstream.console`` is
    installed. ``broker.service`` is read per request: it exists once the broker is open."""
    routes: list[BaseRoute] = [
        Route(op.path, _endpoint(op), methods=[op.method]) for op in OPERATIONS
    ]
    document = msgspec.json.encode(openapi_document(OPERATIONS))

    async def openapi(request: Request) -> Response:
        return Response(document, media_type="application/json")

    routes.append(Route("/api/openapi.json", openapi, methods=["GET"]))
    metrics = getattr(broker, "metrics", None)
    if metrics is not None:
        # a Route, not a Mount: /metrics itself, without a redirect to /metrics/. Not
        # prometheus_client.make_asgi_app: Metrics.asgi_app formats the text off the loop
        routes.append(Route("/metrics", _AsgiEndpoint(_authenticated(broker, metrics.asgi_app()))))
    try:
        from ..console import routes as console_routes
    except ImportError:
        log.debug("no console: slipstream.console is not installed")
    else:
        routes.extend(console_routes(broker))
    app = Starlette(
        routes=routes,
        # every request counted by route and status (http/_metrics.py)
        middleware=[Middleware(CountRequests, metrics=metrics)] if metrics is not None else [],
        exception_handlers={
            SlipstreamError: _slipstream_error,
            ApiError: _api_error,
            HTTPException: _http_error,
            Exception: _internal_error,
        },
    )
    app.state.broker = broker
    app.state.started_ms = int(time.time() * 1000)  # made as the broker starts serving
    return app

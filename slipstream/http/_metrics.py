"""Counting the admin HTTP server's requests (``slipstream_http_requests_total`` and
``slipstream_http_request_seconds``, docs/metrics.md).

``CountRequests`` wraps the whole application (API, console, ``/metrics``) as ASGI
middleware, inside Starlette's error middleware: the route label is the matched route's
template (``/api/streams/{name}``, never the path, whose values are unbounded), or
``unmatched`` for a path no route takes; the method is one of the usual ones or ``other``
(a client picks it). A request whose handler raised past the error handlers is counted as a
500, the answer the error middleware then sends. The error handlers themselves count typed
error answers into ``slipstream_rejected_requests_total`` by code (http/_app.py).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..broker._metrics import UNMATCHED_ROUTE

if TYPE_CHECKING:
    from ..broker._metrics import Metrics

#: methods counted by name; any other is counted as "other"
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class CountRequests:
    """ASGI middleware: each HTTP request, once answered (or failed), is counted by route
    template, method and status, and its time from arrival to the end of the handler
    observed. Runs on the broker's loop, like the counters' other updates."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # what the error middleware answers if the app raises

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = getattr(scope.get("route"), "path", None) or UNMATCHED_ROUTE
            method = scope["method"] if scope["method"] in METHODS else "other"
            self.metrics.http_requested(route, method, status, time.perf_counter() - started)

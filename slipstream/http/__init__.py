"""The broker's HTTP side: the admin API (JSON, OpenAPI at ``/api/openapi.json``),
``/metrics`` and the console, served on the broker's event loop (docs/http-api.md)."""

from ._app import MAX_BODY_BYTES, create_app
from ._server import HttpServer, start_http

__all__ = ["MAX_BODY_BYTES", "HttpServer", "create_app", "start_http"]

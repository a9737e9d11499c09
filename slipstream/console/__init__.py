"""The operations console: server-rendered pages over the service layer, served by the
broker's HTTP server at ``/`` (see docs/console.md)."""

from ._app import routes

__all__ = ["routes"]

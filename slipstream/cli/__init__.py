"""The ``slipstream`` command line, built on the public client API."""

from ._app import app, main

__all__ = ["app", "main"]

"""The admin HTTP server: uvicorn, on the broker's own event loop, as one of its tasks.

Why uvicorn (and not hypercorn): it takes sockets that are already listening
(``Server.serve(sockets=...)``), so the broker binds the port itself, reports a port in use
with the same clear error as the binary port, and learns the port ``--http-port 0`` picked
before anything is served; and it is the most used ASGI server, kept up with Starlette.
Its one side effect on a host program is ``Server.capture_signals``, which swaps the
process's SIGINT/SIGTERM handlers while it serves: ``_EmbeddedServer`` turns that off, so
the broker's own handlers (slipstream/cli/_up.py) stay in charge, and ``stop()`` ends the
server instead. Nothing here creates or replaces an event loop (``Config.loop`` is used only
by ``uvicorn.run``), and logging stays the broker's (``log_config=None``).

Shutdown: ``stop()`` closes the listener, closes idle keep-alive connections and waits up to
``SHUTDOWN_GRACE_S`` for requests in flight to end (they run to their end: see _api.py);
past that uvicorn cancels them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Generator
from typing import TYPE_CHECKING

import uvicorn

from .._errors import InvalidArgument
from ._app import create_app

if TYPE_CHECKING:
    from ..broker import Broker

log = logging.getLogger("slipstream.http")

#: how long a stopping broker waits for HTTP requests in flight
SHUTDOWN_GRACE_S = 10.0


class _EmbeddedServer(uvicorn.Server):
    """A uvicorn server that leaves the process's signal handlers alone."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class HttpServer:
    """The admin HTTP server of one broker: ``task`` serves until ``stop()``; ``address`` is
    where it listens."""

    def __init__(self, server: _EmbeddedServer, listener: socket.socket) -> None:
        self._server = server
        self._listener = listener
        name = listener.getsockname()
        self.address: tuple[str, int] = (name[0], name[1])
        self.task = asyncio.get_running_loop().create_task(
            server.serve(sockets=[listener]), name="http"
        )

    async def stop(self) -> None:
        """Stop serving: waits for requests in flight (up to SHUTDOWN_GRACE_S)."""
        self._server.should_exit = True
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.shield(self.task)
        self._listener.close()


async def start_http(broker: Broker) -> HttpServer | None:
    """Listen on the broker's ``http_port`` (None: no HTTP server; 0: any free port) on its
    host and serve the admin API. Raises InvalidArgument if the port cannot be bound."""
    config = broker.config
    port = config.http_port
    if port is None:
        return None
    try:
        listener = socket.create_server((config.host, port), backlog=128)
    except OSError as exc:
        raise InvalidArgument(
            f"cannot listen for HTTP on {config.host}:{port} ({exc.strerror}); is another "
            "broker running? Pass a different --http-port, or --http-port -1 for none",
            host=config.host,
            http_port=port,
        ) from exc
    listener.setblocking(False)
    server = _EmbeddedServer(
        uvicorn.Config(
            create_app(broker),
            lifespan="off",
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=int(SHUTDOWN_GRACE_S),
            server_header=False,
        )
    )
    if broker.http_tls is not None:
        # the broker's context, not uvicorn's own from file names: SIGHUP reloads it in place
        server.config.load()
        server.config.ssl = broker.http_tls
    http = HttpServer(server, listener)
    scheme = "https" if broker.http_tls is not None else "http"
    log.info("admin HTTP API on %s://%s:%d/api (console at /)", scheme, *http.address)
    return http

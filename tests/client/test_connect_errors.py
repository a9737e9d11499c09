"""Connecting to something that is not a broker: a typed one-line error naming what answered,
within the connect timeout, never a bare TimeoutError."""

from __future__ import annotations

import asyncio
import http.server
import socket
import threading
from collections.abc import Callable, Iterator

import pytest

import slipstream


@pytest.fixture
def http_address() -> Iterator[str]:
    """Python's own HTTP server: it waits for a line end, so it answers only when the client
    half-closes (as many servers do)."""

    class Quiet(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


def _tcp_server(handle: Callable[[socket.socket], None]) -> Iterator[str]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def serve() -> None:
        while True:
            try:
                peer, _ = listener.accept()
            except OSError:
                return
            with peer:
                handle(peer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"127.0.0.1:{listener.getsockname()[1]}"
    listener.shutdown(socket.SHUT_RDWR)
    listener.close()
    thread.join()


@pytest.fixture
def eager_http_address() -> Iterator[str]:
    """A server that rejects the first bytes at once with an HTTP status line (as h11 does)."""

    def handle(peer: socket.socket) -> None:
        peer.recv(100)
        peer.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
        peer.recv(100)

    yield from _tcp_server(handle)


@pytest.fixture
def closing_address() -> Iterator[str]:
    yield from _tcp_server(lambda peer: None)


@pytest.fixture
def silent_address() -> Iterator[str]:
    """A listener that never accepts: the kernel completes the TCP handshake, nobody talks."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield f"127.0.0.1:{listener.getsockname()[1]}"


def test_an_http_server_is_named(http_address: str) -> None:
    with pytest.raises(slipstream.BrokerUnavailable) as raised:
        slipstream.connect(http_address, timeout=2)
    message = str(raised.value)
    assert message.startswith(f"{http_address} answered with '")
    assert "not a slipstream broker" in message
    assert "\n" not in message


def test_an_http_status_line_is_quoted(eager_http_address: str) -> None:
    with pytest.raises(slipstream.BrokerUnavailable) as raised:
        slipstream.connect(eager_http_address, timeout=30)
    assert str(raised.value).startswith(
        f"{eager_http_address} answered with 'HTTP/1.1 400 Bad Request...', not a slipstream"
    )


def test_a_silent_listener_is_reported_within_the_timeout(silent_address: str) -> None:
    with pytest.raises(slipstream.BrokerUnavailable, match="did not answer the slipstream hands"):
        slipstream.connect(silent_address, timeout=1)


def test_a_listener_that_hangs_up_is_reported(closing_address: str) -> None:
    with pytest.raises(slipstream.BrokerUnavailable, match="closed the connection during the"):
        slipstream.connect(closing_address, timeout=30)


def test_the_asyncio_client_says_the_same(eager_http_address: str, silent_address: str) -> None:
    async def main() -> list[str]:
        messages = []
        for address, timeout in ((eager_http_address, 30.0), (silent_address, 1.0)):
            with pytest.raises(slipstream.BrokerUnavailable) as raised:
                await slipstream.connect_async(address, timeout=timeout)
            messages.append(str(raised.value))
        return messages

    http, silent = asyncio.run(main())
    assert "answered with 'HTTP/1.1 400" in http
    assert "did not answer" in silent

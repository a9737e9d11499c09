"""Sending stored batches with sendfile: bytes leave in order whatever the socket accepts.

A real server socket on loopback (with uvloop, as the broker runs, and with asyncio's own loop)
and a receiver that reads only after the sender's buffers are full, so the sender meets a
full socket halfway through a frame and must finish it through the transport.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
import uvloop

from slipstream.broker._container import FileSpans
from slipstream.broker._session import send_file_frame


def _counting_sendfile(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    calls: Counter[str] = Counter()
    real = os.sendfile

    def sendfile(out_fd: int, in_fd: int, offset: int, count: int) -> int:
        calls["calls"] += 1
        try:
            sent = real(out_fd, in_fd, offset, count)
        except BlockingIOError:
            calls["full"] += 1
            raise
        calls["bytes"] += sent
        return sent

    monkeypatch.setattr(os, "sendfile", sendfile)
    return calls


def _serve(
    path: Path, spans: list[tuple[int, int]], run: Callable[[Any], Any]
) -> tuple[bytes, list[BaseException]]:
    """Send HEAD, the spans of ``path`` and TAIL to a receiver that starts late; return what
    the receiver got and any error of the sender."""
    errors: list[BaseException] = []
    senders: list[asyncio.BaseTransport] = []

    class Sender(asyncio.Protocol):
        def connection_made(self, base: asyncio.BaseTransport) -> None:
            transport = cast(asyncio.Transport, base)  # uvloop's is no subclass of it
            senders.append(transport)
            sock = transport.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
            fd = os.open(path, os.O_RDONLY)
            try:
                send_file_frame(transport, sock.fileno(), b"HEAD", FileSpans(fd, spans, [], 0))
                transport.write(b"TAIL")  # the next frame queues behind the spans
            except BaseException as exc:
                errors.append(exc)
                transport.abort()  # as the session does: the frame is cut
            finally:
                os.close(fd)

    async def main() -> bytes:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(Sender, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        receiver = socket.socket()
        receiver.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        receiver.setblocking(False)
        await loop.sock_connect(receiver, ("127.0.0.1", port))
        await asyncio.sleep(0.2)  # the sender fills both buffers before anyone reads
        got = bytearray()
        while not got.endswith(b"TAIL"):
            chunk = await asyncio.wait_for(loop.sock_recv(receiver, 1 << 20), 5)
            if not chunk:
                break
            got += chunk
        receiver.close()
        for transport in senders:
            transport.close()
        server.close()
        return bytes(got)

    return run(main()), errors


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_spans_arrive_whole_and_in_order_through_a_full_socket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, loop: str
) -> None:
    data = os.urandom(6 << 20)
    path = tmp_path / "chunk"
    path.write_bytes(data)
    spans = [(100, 1 << 20), (2 << 20, 3 << 20), ((5 << 20) + 7, 500_000)]
    calls = _counting_sendfile(monkeypatch)
    got, errors = _serve(path, spans, uvloop.run if loop == "uvloop" else asyncio.run)
    assert errors == []
    assert got == b"HEAD" + b"".join(data[at : at + n] for at, n in spans) + b"TAIL"
    assert calls["bytes"] > 0  # some went by sendfile ...
    assert calls["full"] == 1  # ... until the socket was full; the rest through the transport
    assert calls["bytes"] < sum(n for _, n in spans)


def test_a_file_shorter_than_its_spans_is_an_error_not_a_short_frame(tmp_path: Path) -> None:
    path = tmp_path / "chunk"
    path.write_bytes(os.urandom(100_000))
    got, errors = _serve(path, [(0, 50_000), (60_000, 80_000)], uvloop.run)
    assert len(errors) == 1 and isinstance(errors[0], EOFError)
    assert not got.endswith(b"TAIL")
    assert "ends before byte 140000" in str(errors[0])

"""The binary port's first look at a connection when TLS is on: TLS, or a plaintext client?

A TLS client's first byte is 0x16 (a handshake record: its ClientHello); a slipstream client's
first bytes are a Hello frame (frame length, kind). Letting asyncio's TLS layer meet a
plaintext Hello ends in a handshake failure that asyncio drops silently and a bare close the
client can only call "not a broker". The gate instead answers a plaintext client with an Error
frame (code ``tls_error``, saying to connect with TLS), logs it once with the peer address at
warning level, and closes; a TLS client's bytes go, first chunk included, to asyncio's TLS
protocol wrapping the Session, exactly as ``create_server(ssl=...)`` would have done.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from asyncio.sslproto import SSLProtocol
from collections.abc import Callable
from functools import partial
from typing import cast

from .._tls import TLS_HANDSHAKE_BYTE
from ..protocol import Error, encode_frame

log = logging.getLogger("slipstream.broker")

#: seconds a client has to send its first bytes, and then to finish its TLS handshake
HANDSHAKE_TIMEOUT_S = 10


def _ssl_protocol_class(loop: asyncio.AbstractEventLoop) -> type[SSLProtocol]:
    """uvloop's TLS protocol on its loop (Cython: what ``create_server(ssl=...)`` would use
    there; asyncio's pure-Python one cost a third of produce throughput), else asyncio's."""
    try:
        import uvloop
        from uvloop.loop import SSLProtocol as UvSSLProtocol  # type: ignore[attr-defined]
    except ImportError:  # pragma: no cover
        return SSLProtocol
    return UvSSLProtocol if isinstance(loop, uvloop.Loop) else SSLProtocol


class TlsGate(asyncio.Protocol):
    """One accepted connection until its first bytes tell TLS from plaintext."""

    def __init__(
        self,
        context: ssl.SSLContext,
        accept: Callable[[], asyncio.BaseProtocol],
        refused: Callable[[str, str], None],
    ) -> None:
        """``refused(peer, reason)`` is told of every connection the gate or the TLS
        handshake turns away (the broker audits them)."""
        self._context = context
        self._accept = accept
        self._refused = refused
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = tcp = cast(asyncio.Transport, transport)  # uvloop's: no subclass
        # a connection that never says anything holds no Session, so no idle timeout: this one
        self._silent = asyncio.get_running_loop().call_later(HANDSHAKE_TIMEOUT_S, tcp.abort)

    def data_received(self, data: bytes) -> None:
        self._silent.cancel()
        transport = self._transport
        assert transport is not None
        if data[0] != TLS_HANDSHAKE_BYTE:
            self._refuse_plaintext(transport)
            return
        loop = asyncio.get_running_loop()
        # told when the handshake ends: a failed one (a client certificate from an unknown CA,
        # a client that does not trust ours) reaches no Session, so it is reported from here
        handshake: asyncio.Future[None] = loop.create_future()
        handshake.add_done_callback(partial(self._handshake_done, _peer(transport)))
        tls = _ssl_protocol_class(loop)(
            loop,
            self._accept(),
            self._context,
            handshake,
            server_side=True,
            ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S,
        )
        transport.set_protocol(tls)
        tls.connection_made(transport)
        view = memoryview(data)
        while view:  # the bytes the gate read are the start of the ClientHello: hand them on
            buffer = tls.get_buffer(len(view))
            n = min(len(buffer), len(view))
            buffer[:n] = view[:n]
            tls.buffer_updated(n)
            view = view[n:]

    def _handshake_done(self, peer: str, handshake: asyncio.Future[None]) -> None:
        exc = None if handshake.cancelled() else handshake.exception()
        if exc is not None:
            reason = getattr(exc, "reason", None) or type(exc).__name__
            log.warning("TLS handshake with %s failed: %s", peer, reason)
            self._refused(peer, f"tls_handshake_failed: {reason}")

    def _refuse_plaintext(self, transport: asyncio.Transport) -> None:
        where = _peer(transport)
        log.warning(
            "refused a plaintext connection from %s: this broker requires TLS (--tls-cert)", where
        )
        self._refused(where, "plaintext_on_tls_port")
        error = Error(
            "tls_error",
            "this broker requires TLS; connect with tls=True and ca=..., --tls --tls-ca FILE, "
            "or SLIPSTREAM_TLS_CA=FILE (the CA that signed the broker's certificate)",
        )
        transport.write(encode_frame(error, 0))
        transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._silent.cancel()
        self._transport = None


def _peer(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    return f"{peer[0]}:{peer[1]}" if peer else "?"

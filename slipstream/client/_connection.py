"""One TCP connection to a broker: requests with correlation ids, and follow pushes.

Runs on an asyncio loop; the sync client runs that loop in a background thread.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import ssl
import struct
from collections.abc import Callable, Sequence
from typing import Any, cast

import pyarrow as pa

from .. import __version__
from .._errors import (
    BrokerUnavailable,
    InvalidArgument,
    ProtocolError,
    SlipstreamError,
    TlsError,
    error_from_wire,
)
from .._tls import TLS_ALERT_BYTE
from ..protocol import (
    KIND_OF,
    PROTOCOL_VERSION,
    Data,
    Error,
    FollowEnded,
    FollowFailed,
    Frame,
    FrameDecoder,
    Hello,
    Malformed,
    Message,
    Oversized,
    Payload,
    Welcome,
    encode_frame,
)

DEFAULT_ADDRESS = "127.0.0.1:7070"
#: Seconds a broker has to answer the handshake (it takes milliseconds): within ``timeout``.
HANDSHAKE_TIMEOUT = 5.0
#: Called with a pushed message (Data, FollowEnded, FollowFailed) and its payload, or with the
#: error that ended the connection.
FollowHandler = Callable[[Message | SlipstreamError, Payload], None]


def _pooled(size: int) -> memoryview:
    """Memory for one large received frame, from Arrow's pool, uninitialised.

    ``bytearray(size)`` of a 4 MiB Data frame gets fresh pages from the OS each time, which the
    kernel zero-fills on first touch (and on a VM that hands idle memory back to its host, that
    touch costs about ten times a warm one). The pool (mimalloc or jemalloc) hands the memory of
    frames the application has dropped out again, warm: a replay of 1 KiB events took 0.07
    instead of 0.10 s of client CPU per 200 MB. The broker takes plain malloc memory instead
    (``broker/_session.py::_unzeroed``): it holds the batches it receives (tail cache,
    transactions), so a pool would have to grow, and its new pages cost more than glibc's
    reused heap (a first produce run: broker CPU 0.21 -> 0.26-0.42 s). The memory is freed
    when the last view of it (payload, record batch) is gone.
    """
    return memoryview(pa.allocate_buffer(size)).cast("B")


#: The first frame a broker sends is one of these, and small: anything else is another service.
_GREETING_KINDS = frozenset((KIND_OF[Welcome], KIND_OF[Error]))
_GREETING_MAX_BYTES = 1 << 20
_FIRST_BYTES = struct.Struct("<IH")  # frame_length, kind: the start of every frame


def _preview(data: bytes | bytearray) -> str:
    """The first line of what a peer sent, quoted and cut short, for an error message."""
    line = bytes(data[:60]).split(b"\n", 1)[0].rstrip(b"\r")
    more = "..." if len(line) < len(data) else ""
    return repr(line.decode("ascii", "backslashreplace") + more)


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``; raises InvalidArgument with the expected form."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(f"broker address {address!r} must look like 127.0.0.1:7070")
    return host.strip("[]"), int(port)


def _tls_failure(address: str, exc: ssl.SSLError) -> TlsError:
    """The TlsError, with its fix, for what failed in a TLS handshake with ``address``."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        if exc.verify_code in (62, 64):  # X509_V_ERR_HOSTNAME_MISMATCH, _IP_ADDRESS_MISMATCH
            why = (
                "the broker's certificate is not issued for the host dialled "
                f"({exc.verify_message}); connect by a name or address in its "
                "subjectAltName, or reissue it"
            )
        elif exc.verify_code == 10:  # X509_V_ERR_CERT_HAS_EXPIRED
            why = "the broker's certificate has expired; renew it and send the broker SIGHUP"
        else:
            why = (
                f"the broker's certificate is not signed by a CA this client trusts "
                f"({exc.verify_message}); pass the CA that signed it with ca=..., --tls-ca or "
                "SLIPSTREAM_TLS_CA"
            )
    elif exc.reason in ("TLSV13_ALERT_CERTIFICATE_REQUIRED", "SSLV3_ALERT_HANDSHAKE_FAILURE"):
        why = (
            "the broker requires a client certificate signed by its --tls-client-ca; pass "
            "cert= and key= (--tls-cert/--tls-key, SLIPSTREAM_TLS_CERT/SLIPSTREAM_TLS_KEY)"
        )
    elif exc.reason in ("SSLV3_ALERT_BAD_CERTIFICATE", "TLSV1_ALERT_UNKNOWN_CA"):
        why = (
            "the broker refused this client's certificate: it is not signed by the broker's "
            "--tls-client-ca"
        )
    elif exc.reason in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG"):
        why = (
            "the broker answered without TLS (started without --tls-cert); connect without "
            "--tls / SLIPSTREAM_TLS_CA"
        )
    else:
        why = f"{exc}; check the broker's --tls-* options against this client's"
    return TlsError(f"TLS handshake with {address} failed: {why}", address=address)


async def _answers_tcp(host: str, port: int, loop: asyncio.AbstractEventLoop) -> bool:
    """Whether something accepts a plain TCP connection there (to tell a broker without TLS
    from nobody, after a TLS handshake timed out)."""
    try:
        async with asyncio.timeout(1.0):
            transport, _ = await loop.create_connection(asyncio.Protocol, host, port)
    except (OSError, TimeoutError):
        return False
    transport.abort()
    return True


class Connection(asyncio.BufferedProtocol):
    def __init__(self) -> None:
        self.decoder = FrameDecoder(1 << 30, allocate=_pooled)
        self.transport: asyncio.Transport | None = None
        self.pending: dict[int, asyncio.Future[tuple[Message, Payload]]] = {}
        self.follows: dict[int, FollowHandler] = {}
        self.writable = asyncio.Event()
        self.writable.set()
        self.closed: SlipstreamError | None = None
        self.address = "?"
        self.tls: ssl.SSLContext | None = None  # what it was opened with: a redial uses it
        self.token: str | None = None  # likewise
        #: producer ids claimed on (or granted by) this connection's broker session
        self.claimed: set[int] = set()
        # Until the broker's Welcome: the first bytes received, to tell another service
        # (an HTTP server, a database) from a broker and name it in the error.
        self._greeting: bytearray | None = bytearray()
        self._receiving: memoryview | None = None
        self.max_batch_bytes = 8 * 1024 * 1024
        self.broker_version = "?"
        self._ids = itertools.count(1)
        self.follow_ids = itertools.count(1)

    @classmethod
    async def open(
        cls,
        address: str,
        *,
        client_name: str = "slipstream-python",
        timeout: float = 10.0,
        tls: ssl.SSLContext | None = None,
        token: str | None = None,
    ) -> Connection:
        """Connect and handshake within ``timeout`` seconds in all.

        Raises BrokerUnavailable naming the address and what happened: nobody listens there;
        what listens answers with bytes that do not start a slipstream frame (the error quotes
        them, e.g. an HTTP server's status line); or it accepts the connection but does not
        answer the handshake within ``HANDSHAKE_TIMEOUT`` seconds (a broker answers in
        milliseconds). In that last case the client half-closes the connection and waits a
        moment more, because a server that waits for a line end (HTTP) answers only then.

        With ``tls`` (a context from ``slipstream._tls.client_context``) the connection is TLS,
        verified as the context says; raises TlsError, within ``timeout``, for a broker whose
        certificate is not trusted or not issued for ``address``'s host, one that requires a
        client certificate this client lacks, and a broker that does not speak TLS. Without
        it, a broker that speaks TLS fails the handshake with TlsError too.

        ``token`` goes in the Hello's credentials; a broker with authentication on refuses a
        missing, expired, forged, revoked or malformed one with AuthenticationFailed (its
        message says why and what to do).
        """
        host, port = parse_address(address)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            async with asyncio.timeout_at(deadline):  # no inner task to orphan if cancelled
                if tls is None:
                    _, connection = await loop.create_connection(cls, host, port)
                else:
                    _, connection = await loop.create_connection(
                        cls,
                        host,
                        port,
                        ssl=tls,
                        server_hostname=host,
                        ssl_handshake_timeout=max(0.1, deadline - loop.time()),
                    )
        except ssl.SSLError as exc:
            raise _tls_failure(address, exc) from exc
        except TimeoutError as exc:
            if tls is not None and await _answers_tcp(host, port, loop):
                raise TlsError(
                    f"{address} accepted the connection but did not complete a TLS handshake "
                    f"in {timeout:g} s: the broker does not use TLS (started without "
                    "--tls-cert); connect without --tls / SLIPSTREAM_TLS_CA",
                    address=address,
                ) from exc
            raise BrokerUnavailable(
                f"no broker at {address} (no answer in {timeout:g} s); start "
                "one with 'slipstream up' or pass --broker / SLIPSTREAM_BROKER",
                address=address,
            ) from exc
        except OSError as exc:
            raise BrokerUnavailable(
                f"no broker at {address} ({str(exc) or f'no answer in {timeout:g} s'}); start "
                "one with 'slipstream up' or pass --broker / SLIPSTREAM_BROKER",
                address=address,
            ) from exc
        connection.address = address
        connection.tls = tls
        connection.token = token
        try:
            welcome = await connection._handshake(client_name, deadline - loop.time())
        except BaseException:
            connection.close()
            raise
        if not isinstance(welcome, Welcome):
            connection.close()
            raise ProtocolError(f"expected Welcome, got {type(welcome).__name__}")
        connection.max_batch_bytes = welcome.max_batch_bytes
        connection.broker_version = welcome.broker_version
        return connection

    async def _handshake(self, client_name: str, budget: float) -> Message:
        credentials = {"token": self.token} if self.token else None
        reply = self.send_request(
            Hello(PROTOCOL_VERSION, f"{client_name}/{__version__}", credentials)
        )
        grace = min(0.5, budget / 4)
        waited = max(0.0, min(HANDSHAKE_TIMEOUT, budget - grace))
        try:
            done, _ = await asyncio.wait({reply}, timeout=waited)
            if not done:
                if self.transport is not None and self.transport.can_write_eof():
                    self.transport.write_eof()  # an HTTP server answers a request cut short
                done, _ = await asyncio.wait({reply}, timeout=grace)
                if not done:
                    raise BrokerUnavailable(
                        f"{self.address} accepted the connection but did not answer the "
                        f"slipstream handshake within {waited:.2g} s: not a slipstream broker, "
                        "or a stuck one",
                        address=self.address,
                    )
                if reply.exception() is None:
                    raise BrokerUnavailable(
                        f"{self.address} answered the slipstream handshake only after more "
                        f"than {waited:.2g} s: the broker is overloaded or stuck",
                        address=self.address,
                    )
            welcome, _ = reply.result()  # or the typed error of what answered
            return welcome
        finally:
            if not reply.done():
                reply.cancel()

    # --- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)  # uvloop's: no subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        transport.set_write_buffer_limits(high=16 * 1024 * 1024)

    def connection_lost(self, exc: Exception | None) -> None:
        if isinstance(exc, ssl.SSLError) and self._greeting is not None:
            self._shutdown(_tls_failure(self.address, exc))
            return
        if self.tls is not None and self._greeting is not None and not self._greeting:
            # TLS 1.3: the broker checks a client certificate after the client's handshake
            # is done, and its alert is not always surfaced: a bare close before any answer
            self._shutdown(
                TlsError(
                    f"{self.address} closed the TLS connection before answering: the broker "
                    "requires a client certificate signed by its --tls-client-ca, and this "
                    "client passed none or one it refused; pass cert= and key= (--tls-cert/"
                    "--tls-key, SLIPSTREAM_TLS_CERT/SLIPSTREAM_TLS_KEY)",
                    address=self.address,
                )
            )
            return
        if self._greeting is not None:
            answered = f" after sending {_preview(self._greeting)}" if self._greeting else ""
            self._shutdown(
                BrokerUnavailable(
                    f"{self.address} closed the connection during the slipstream handshake"
                    f"{answered}: not a slipstream broker, or one that refused this client",
                    address=self.address,
                )
            )
            return
        self._shutdown(
            BrokerUnavailable(f"connection to {self.address} lost" + (f": {exc}" if exc else ""))
        )

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    def get_buffer(self, sizehint: int) -> memoryview:
        buffer = self.decoder.get_buffer(sizehint)
        if self._greeting is not None:
            self._receiving = buffer
        return buffer

    def buffer_updated(self, nbytes: int) -> None:
        if self._greeting is not None and not self._greeting_looks_right(nbytes):
            return
        self.decoder.buffer_updated(nbytes)
        try:
            while (item := self.decoder.next_item()) is not None:
                if isinstance(item, Frame):
                    self._deliver(item)
                elif isinstance(item, Oversized | Malformed):
                    raise ProtocolError(f"broker sent a bad frame: {item}")
        except ProtocolError as exc:
            self._shutdown(exc)
            if self.transport is not None:
                self.transport.close()

    def _greeting_looks_right(self, nbytes: int) -> bool:
        """Before the Welcome: check that the peer's first bytes start a small Welcome or
        Error frame; if not, fail the handshake naming what answered."""
        assert self._greeting is not None and self._receiving is not None
        if self.closed is not None:
            return False  # what follows a wrong answer is of no interest
        self._greeting += self._receiving[:nbytes]
        if len(self._greeting) < _FIRST_BYTES.size:
            return True
        length, kind = _FIRST_BYTES.unpack_from(self._greeting)
        if kind in _GREETING_KINDS and length <= _GREETING_MAX_BYTES:
            self._greeting = self._receiving = None  # a broker: the rest is the decoder's
            return True
        if self._greeting[0] == TLS_ALERT_BYTE and self._greeting[1] == 3:  # a TLS alert
            self._shutdown(
                TlsError(
                    f"{self.address} speaks TLS and this client connected without it; connect "
                    "with tls=True and ca=..., --tls-ca or SLIPSTREAM_TLS_CA (the CA that "
                    "signed the broker's certificate)",
                    address=self.address,
                )
            )
            if self.transport is not None:
                self.transport.abort()
            return False
        self._shutdown(
            BrokerUnavailable(
                f"{self.address} answered with {_preview(self._greeting)}, not a slipstream "
                "broker (pass --broker / SLIPSTREAM_BROKER with the broker's address)",
                address=self.address,
            )
        )
        if self.transport is not None:
            self.transport.abort()
        return False

    def _deliver(self, frame: Frame) -> None:
        message = frame.message
        if frame.correlation_id == 0:
            if isinstance(message, Data | FollowEnded | FollowFailed):
                handler = self.follows.get(message.sub_id)
                if handler is not None:
                    handler(message, frame.payload)
            elif isinstance(message, Error):  # the broker is closing this connection
                self._shutdown(error_from_wire(message.code, message.message, message.details))
            return
        future = self.pending.pop(frame.correlation_id, None)
        if future is None or future.done():
            return
        if isinstance(message, Error):
            future.set_exception(error_from_wire(message.code, message.message, message.details))
        else:
            future.set_result((message, frame.payload))

    def _shutdown(self, error: SlipstreamError) -> None:
        if self.closed is not None:
            return
        self.closed = error
        pending, self.pending = self.pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(error)
        follows, self.follows = self.follows, {}
        for handler in follows.values():
            handler(error, bytearray())
        self.writable.set()

    # --- requests ----------------------------------------------------------------------------

    def send_request(
        self, message: Message, payload: Sequence[Any] = ()
    ) -> asyncio.Future[tuple[Message, Payload]]:
        """Send a request now; the future resolves with the response or a typed error."""
        future: asyncio.Future[tuple[Message, Payload]] = asyncio.get_running_loop().create_future()
        if self.closed is not None:
            future.set_exception(self.closed)
            return future
        assert self.transport is not None
        correlation_id = next(self._ids) & 0xFFFFFFFF or next(self._ids)
        self.pending[correlation_id] = future
        length = sum(len(p) for p in payload)
        head = encode_frame(message, correlation_id, length)
        if payload:
            self.transport.writelines([head, *payload])
        else:
            self.transport.write(head)
        return future

    async def request(
        self, message: Message, payload: Sequence[Any] = ()
    ) -> tuple[Message, Payload]:
        return await self.send_request(message, payload)

    def send_oneway(self, message: Message) -> None:
        """Send a message that has no response (Credit)."""
        if self.closed is None and self.transport is not None:
            self.transport.write(encode_frame(message, 0))

    def close(self, error: SlipstreamError | None = None) -> None:
        """Close; pending requests fail with ``error`` (default: closed by the client)."""
        if self.transport is not None:
            self.transport.abort()
        self._shutdown(error or BrokerUnavailable("connection closed by the client"))

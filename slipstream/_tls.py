"""TLS settings shared by the broker's listeners and the clients.

The broker: ``server_context(cert, key, client_ca)`` is the one SSLContext of the binary port;
``reload`` loads the certificate files again into that same object on SIGHUP, so handshakes
after it present the new certificate while open connections keep theirs. The client:
``client_context(ca, cert, key)`` verifies the broker's certificate and host name by default
(the system's CAs, or ``ca``); ``cert``/``key`` is the client certificate for mutual TLS.
``from_env`` reads ``SLIPSTREAM_TLS_CA``/``_CERT``/``_KEY`` (setting any of them turns TLS on).
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from pathlib import Path

from ._errors import InvalidArgument

#: a file name, as str or Path
PathArg = str | os.PathLike[str]

#: The first byte of a TLS record carrying a handshake (a ClientHello, a ServerHello).
TLS_HANDSHAKE_BYTE = 0x16
#: The first byte of a TLS alert record (what a TLS server answers a plaintext request with).
TLS_ALERT_BYTE = 0x15


def _load_chain(ctx: ssl.SSLContext, cert: PathArg, key: PathArg | None) -> None:
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise InvalidArgument(
            f"cannot load the TLS certificate {cert} with key {key or cert} ({exc}); pass PEM "
            "files: the certificate (chain) and its unencrypted private key",
            cert=str(cert),
        ) from exc


def _load_ca(ctx: ssl.SSLContext, ca: PathArg) -> None:
    try:
        ctx.load_verify_locations(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise InvalidArgument(
            f"cannot load the CA certificates {ca} ({exc}); pass a PEM file", ca=str(ca)
        ) from exc


@dataclass(frozen=True)
class ServerTls:
    """The broker's certificate files: ``--tls-cert``, ``--tls-key``, ``--tls-client-ca``."""

    cert: Path
    key: Path
    #: clients must present a certificate signed by one of these CAs (mutual TLS)
    client_ca: Path | None = None

    def context(self, *, require_client_cert: bool = True) -> ssl.SSLContext:
        """A server context with the certificate loaded; raises InvalidArgument naming a file
        that cannot be read. ``require_client_cert=False`` (the HTTP API, browsers) asks for
        a client certificate without requiring one."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        self.reload(ctx)
        if self.client_ca is not None:
            ctx.verify_mode = ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_OPTIONAL
        return ctx

    def reload(self, ctx: ssl.SSLContext) -> None:
        """Load the files again into ``ctx``: new handshakes use them, open connections are
        untouched. On an error (raised) ctx keeps what it had."""
        # a certificate whose key does not match would replace the live one before the key
        # check fails: try the files in a scratch context first
        _load_chain(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), self.cert, self.key)
        _load_chain(ctx, self.cert, self.key)
        if self.client_ca is not None:
            _load_ca(ctx, self.client_ca)


def client_context(
    ca: PathArg | None = None, cert: PathArg | None = None, key: PathArg | None = None
) -> ssl.SSLContext:
    """A client context that verifies the broker's certificate chain (against ``ca``, else
    the system's CAs) and that it was issued for the host dialled; ``cert``/``key``: the
    client certificate for a broker started with ``--tls-client-ca``."""
    ctx = ssl.create_default_context()
    if ca is not None:
        _load_ca(ctx, ca)
    if cert is not None:
        _load_chain(ctx, cert, key)
    elif key is not None:
        raise InvalidArgument("a TLS key without a certificate; pass cert= (--tls-cert) too")
    return ctx


def from_env(
    tls: bool | None = None,
    ca: PathArg | None = None,
    cert: PathArg | None = None,
    key: PathArg | None = None,
) -> ssl.SSLContext | None:
    """The client context for ``connect``'s arguments, each defaulting to its environment
    variable (``SLIPSTREAM_TLS``, ``_TLS_CA``, ``_TLS_CERT``, ``_TLS_KEY``); None: plaintext.
    A CA or a client certificate implies TLS unless ``tls=False``."""
    ca = ca or os.environ.get("SLIPSTREAM_TLS_CA") or None
    cert = cert or os.environ.get("SLIPSTREAM_TLS_CERT") or None
    key = key or os.environ.get("SLIPSTREAM_TLS_KEY") or None
    if tls is None:
        flag = os.environ.get("SLIPSTREAM_TLS", "").lower()
        tls = flag in ("1", "true", "yes", "on") or bool(ca or cert)
    if not tls:
        return None
    return client_context(ca, cert, key)

"""Signed tokens (JWT): the broker's keys, issuing, and verifying with a typed reason.

Keys live in the broker's data directory, owner-only (mode 0600), created on first use and
made durable (file, then directory) before anything is signed with them:

    <data-dir>/token-ed25519.pem   Ed25519 private key (PKCS#8 PEM): EdDSA tokens (default)
    <data-dir>/token-hs256.key     32 random bytes: HS256 tokens

A token carries the claims ``sub`` (subject), ``role`` (``admin``/``user``), ``scope``
(optional: the one scope it may act on), ``exp``, ``iat`` and ``jti`` (its id, to revoke it).
Only ``EdDSA`` and ``HS256`` are accepted, each verified with its own key: ``alg: none``, RS*,
ES* and the rest are refused before any signature check, and an HS256 token signed with the
Ed25519 public key as its secret fails, since HS256 is checked against the separate random
secret only. Every failure raises ``AuthenticationFailed`` with ``details["reason"]`` one of
``missing``, ``malformed``, ``algorithm``, ``bad_signature``, ``expired``, ``revoked``; its
message says what to do. No message ever holds a token or a key (token ids are fine).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from collections.abc import Callable, Container
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from .._errors import AuthenticationFailed, InvalidArgument
from ._principal import Principal, Role

log = logging.getLogger("slipstream.security")

#: ``MetaStore.shared_secret``: a value by name, made once by the first caller
Share = Callable[[str, Callable[[], bytes]], bytes]

ED25519_KEY_FILE = "token-ed25519.pem"
HS256_KEY_FILE = "token-hs256.key"
ALGORITHMS = ("EdDSA", "HS256")
_HS256_KEY_BYTES = 32
#: a token's lifetime when none is given
DEFAULT_EXPIRY_S = 30 * 86_400

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 7 * 86_400}


def parse_duration_s(text: str) -> int:
    """``90s``, ``15m``, ``12h``, ``7d``, ``2w`` (or a bare number of seconds) -> seconds."""
    text = text.strip().lower()
    unit = _UNITS.get(text[-1:]) if text else None
    number = text[:-1] if unit else text
    if not number.isdigit() or int(number) <= 0:
        raise InvalidArgument(f"duration {text!r}: use a positive number with s, m, h, d or w")
    return int(number) * (unit or 1)


def _write_new(path: Path, data: bytes, *, fsync: bool) -> bool:
    """Create ``path`` holding ``data``, mode 0600, durably, unless it exists (then False:
    another process, a broker or the CLI, made it first; its key wins)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            if fsync:
                os.fsync(out.fileno())
        try:
            os.link(tmp, path)  # atomic, and fails if the name exists: never replaces a key
        except FileExistsError:
            return False
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    if fsync:
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return True


def _read_or_create(path: Path, make: Any, *, create: bool, fsync: bool) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        if not create:
            raise InvalidArgument(
                f"no token key {path}: start the broker with --auth once on this data "
                "directory (it creates its keys), or check --data-dir",
                file=str(path),
            ) from None
    _write_new(path, make(), fsync=fsync)
    return path.read_bytes()


def _check_private(path: Path) -> None:
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise InvalidArgument(
            f"token key {path} is readable by others (mode {mode:o}); anyone who reads it can "
            f"sign tokens: run 'chmod 600 {path}' (and consider making new keys)",
            file=str(path),
        )


@dataclass(frozen=True)
class IssuedToken:
    """A token just signed: the text to hand over once, and its claims (safe to store)."""

    token: str
    token_id: str
    subject: str
    role: Role
    scope: str | None
    expires_at: int  #: seconds since the epoch
    issued_at: int


class TokenKeys:
    """The broker's signing keys: ``issue`` tokens and ``verify`` them."""

    def __init__(self, ed25519_pem: bytes, hs256_secret: bytes) -> None:
        try:
            private = serialization.load_pem_private_key(ed25519_pem, password=None)
        except ValueError as exc:
            raise InvalidArgument(f"the Ed25519 token key is damaged: {exc}") from None
        if not isinstance(private, Ed25519PrivateKey):
            raise InvalidArgument("the token key is not an Ed25519 key")
        if len(hs256_secret) < _HS256_KEY_BYTES:
            raise InvalidArgument(f"the HS256 token key is shorter than {_HS256_KEY_BYTES} bytes")
        self._private = private
        self._public = private.public_key()
        self._secret = hs256_secret

    @classmethod
    def load(cls, data_dir: Path, *, create: bool = True, fsync: bool = True) -> TokenKeys:
        """The keys of ``data_dir``, created (0600, durably) if missing and ``create``.
        Raises InvalidArgument for a key file others may read, a damaged one, or (without
        ``create``) a missing one, each with the fix."""
        ed_path, hs_path = data_dir / ED25519_KEY_FILE, data_dir / HS256_KEY_FILE

        def new_ed25519() -> bytes:
            return Ed25519PrivateKey.generate().private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )

        ed_pem = _read_or_create(ed_path, new_ed25519, create=create, fsync=fsync)
        secret = _read_or_create(
            hs_path, lambda: secrets.token_bytes(_HS256_KEY_BYTES), create=create, fsync=fsync
        )
        _check_private(ed_path)
        _check_private(hs_path)
        return cls(ed_pem, secret)

    @classmethod
    def shared(
        cls,
        share: Callable[[str, Callable[[], bytes]], bytes],
        data_dir: Path,
        *,
        fsync: bool = True,
    ) -> TokenKeys:
        """A cluster's keys (docs/cluster.md): every broker signs and verifies with the same
        ones, kept by the catalog (``share``: ``MetaStore.shared_secret``). The first broker
        with --auth offers its data directory's keys (made if missing); every broker then
        writes the cluster's into its data directory (0600), so ``slipstream token create
        --data-dir`` on any of them signs tokens the whole cluster takes."""
        local = cls.load(data_dir, fsync=fsync)
        ed_pem = share("token-ed25519", lambda: (data_dir / ED25519_KEY_FILE).read_bytes())
        secret = share("token-hs256", lambda: local._secret)
        for path, key in (
            (data_dir / ED25519_KEY_FILE, ed_pem),
            (data_dir / HS256_KEY_FILE, secret),
        ):
            if path.read_bytes() != key:
                log.warning("%s replaced by the cluster's key (from the catalog)", path)
                path.unlink()
                _write_new(path, key, fsync=fsync)
        return cls(ed_pem, secret)

    def issue(
        self,
        subject: str,
        role: Role | str = Role.USER,
        *,
        scope: str | None = None,
        expires_s: int = DEFAULT_EXPIRY_S,
        algorithm: str = "EdDSA",
    ) -> IssuedToken:
        """Sign a token for ``subject``; ``scope`` limits it to one scope's streams."""
        if not subject or not subject.strip():
            raise InvalidArgument("a token needs a subject (--subject NAME)")
        try:
            role = Role(role)
        except ValueError:
            raise InvalidArgument(f"role {role!r}: use admin or user") from None
        if algorithm not in ALGORITHMS:
            raise InvalidArgument(f"algorithm {algorithm!r}: use one of {', '.join(ALGORITHMS)}")
        if expires_s <= 0:
            raise InvalidArgument("a token's lifetime must be positive")
        now = int(time.time())
        token_id = secrets.token_hex(8)
        claims: dict[str, Any] = {
            "sub": subject,
            "role": role.value,
            "iat": now,
            "exp": now + expires_s,
            "jti": token_id,
        }
        if scope:
            claims["scope"] = scope
        key: Any = self._private if algorithm == "EdDSA" else self._secret
        token = jwt.encode(claims, key, algorithm=algorithm)
        return IssuedToken(token, token_id, subject, role, scope or None, now + expires_s, now)

    def verify(self, token: str | None, *, revoked: Container[str] = ()) -> Principal:
        """The principal a token names, or AuthenticationFailed saying why (``reason`` in
        ``details``): missing, malformed, algorithm, bad_signature, expired, revoked."""
        if not token:
            raise _failed(
                "missing",
                "no credentials: pass a token (token=..., --token, SLIPSTREAM_TOKEN) or a "
                "client certificate signed by the broker's --tls-client-ca",
            )
        try:
            header = jwt.get_unverified_header(token)
        except jwt.DecodeError:
            raise _failed(
                "malformed", "the token is not a JWT (three base64url parts); pass it whole"
            ) from None
        algorithm = header.get("alg")
        if algorithm not in ALGORITHMS:
            raise _failed(
                "algorithm",
                f"the token's algorithm {str(algorithm)[:20]!r} is not accepted (only "
                f"{' and '.join(ALGORITHMS)}); use a token made by 'slipstream token create'",
            )
        key: Any = self._public if algorithm == "EdDSA" else self._secret
        try:
            claims = jwt.decode(
                token,
                key,
                algorithms=[algorithm],
                options={"require": ["sub", "exp", "iat", "jti"]},
            )
        except jwt.ExpiredSignatureError:
            raise _failed(
                "expired", "the token has expired; ask an administrator for a new one"
            ) from None
        except jwt.InvalidSignatureError:
            raise _failed(
                "bad_signature",
                "the token's signature does not check out: it was not signed by this broker's "
                "key (another broker's token, or an edited one); ask for a token made here",
            ) from None
        except jwt.PyJWTError as exc:
            raise _failed("malformed", f"the token's claims are not valid ({exc})") from None
        token_id, subject, role = claims["jti"], claims["sub"], claims.get("role", "user")
        scope = claims.get("scope")
        if not isinstance(subject, str) or not isinstance(token_id, str):
            raise _failed("malformed", "the token's sub and jti must be strings")
        if role not in (Role.ADMIN, Role.USER) or not (scope is None or isinstance(scope, str)):
            raise _failed("malformed", "the token's role must be admin or user, scope a string")
        if token_id in revoked:
            raise _failed(
                "revoked",
                f"token {token_id} was revoked; ask an administrator for a new one",
                token_id=token_id,
            )
        return Principal(subject, Role(role), scope, token_id, "token", claims["exp"])


def _failed(reason: str, message: str, **details: Any) -> AuthenticationFailed:
    return AuthenticationFailed(f"authentication failed: {message}", reason=reason, **details)

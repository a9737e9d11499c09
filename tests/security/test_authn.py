"""Authentication (``slipstream up --auth``) against a real broker process: tokens in the
Hello, every way a token is refused, revocation and expiry of open connections, the key
files, the offline bootstrap and the token CLI.

Every refusal must be ``AuthenticationFailed`` with its ``reason``, audited in the broker's
log, and no token may appear in that log.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jwt
import pytest
from conftest import BrokerProcess
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from security.pki import Authority

import slipstream
from slipstream import AuthenticationFailed, PermissionDenied
from slipstream.security import TokenKeys
from slipstream.security._tokens import ED25519_KEY_FILE, HS256_KEY_FILE

pytestmark = pytest.mark.timeout(120)

BrokerFactory = Callable[..., BrokerProcess]


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "slipstream", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def bootstrap(broker: BrokerProcess, subject: str = "ops", *more: str) -> dict[str, Any]:
    """``token create --data-dir`` on the broker's data directory, as an operator would."""
    done = cli(
        "token",
        "create",
        "--data-dir",
        str(broker.data_dir),
        "--subject",
        subject,
        "--role",
        "admin",
        "--json",
        *more,
    )
    assert done.returncode == 0, done.stderr
    document: dict[str, Any] = json.loads(done.stdout)
    return document


@pytest.fixture
def auth_broker(broker_factory: BrokerFactory) -> BrokerProcess:
    return broker_factory("--auth").start()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _claims(**override: Any) -> dict[str, Any]:
    now = int(time.time())
    claims: dict[str, Any] = {
        "sub": "mallory",
        "role": "admin",
        "iat": now,
        "exp": now + 3600,
        "jti": "f00df00df00df00d",
    }
    claims.update(override)
    return claims


def _hand_signed(header: dict[str, Any], claims: dict[str, Any], key: bytes) -> str:
    """A JWT signed by hand with HMAC-SHA256 (pyjwt refuses a PEM key as an HMAC secret,
    which is exactly the confusion attack this builds)."""
    signing_input = f"{_b64(json.dumps(header).encode())}.{_b64(json.dumps(claims).encode())}"
    mac = hmac.new(key, signing_input.encode(), hashlib.sha256).digest()
    return f"{signing_input}.{_b64(mac)}"


def _refused(broker: BrokerProcess, token: str | None, reason: str) -> AuthenticationFailed:
    with pytest.raises(AuthenticationFailed) as info:
        slipstream.connect(broker.address, token=token, timeout=5).close()
    assert info.value.details.get("reason") == reason, info.value.message
    return info.value


def _audited(broker: BrokerProcess, reason: str) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        texts = [line.split("slipstream.audit: ", 1)[-1] for line in broker.log().splitlines()]
        records = [json.loads(text) for text in texts if text.startswith("{")]
        records = [{**r, **r.get("details", {})} for r in records]  # details: nested or not
        if any(
            r.get("event") == "authentication_failed" and r.get("reason") == reason for r in records
        ):
            return
        time.sleep(0.1)
    raise AssertionError(f"no authentication_failed record with reason {reason}:\n{broker.log()}")


def test_bootstrap_token_works_and_no_token_is_refused(auth_broker: BrokerProcess) -> None:
    admin = bootstrap(auth_broker)
    with slipstream.connect(auth_broker.address, token=admin["token"]) as client:
        client.create_stream("demo/authn")
        assert [s.name for s in client.list_streams("demo")] == ["demo/authn"]
    failure = _refused(auth_broker, None, "missing")
    assert "token" in failure.message and "SLIPSTREAM_TOKEN" in failure.message
    _audited(auth_broker, "missing")
    assert admin["token"] not in auth_broker.log()


def test_token_from_environment(
    auth_broker: BrokerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    admin = bootstrap(auth_broker)
    monkeypatch.setenv("SLIPSTREAM_TOKEN", admin["token"])
    with slipstream.connect(auth_broker.address) as client:
        assert client.list_streams("demo") == []


def test_every_bad_token_is_refused_with_its_reason(
    auth_broker: BrokerProcess, tmp_path: Path
) -> None:
    bootstrap(auth_broker)  # the broker made its keys at start; read them like an attacker
    keys = TokenKeys.load(auth_broker.data_dir, create=False)
    private = (auth_broker.data_dir / ED25519_KEY_FILE).read_bytes()
    public_pem = (
        serialization.load_pem_private_key(private, None)
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )

    expired = jwt.encode(
        _claims(iat=int(time.time()) - 7200, exp=int(time.time()) - 60),
        serialization.load_pem_private_key(private, None),
        algorithm="EdDSA",
    )
    _refused(auth_broker, expired, "expired")

    other = TokenKeys.load(tmp_path)  # another broker's keys: a forged token
    _refused(auth_broker, other.issue("mallory", "admin").token, "bad_signature")
    _refused(auth_broker, other.issue("mallory", "admin", algorithm="HS256").token, "bad_signature")
    forged = jwt.encode(_claims(), Ed25519PrivateKey.generate(), algorithm="EdDSA")
    _refused(auth_broker, forged, "bad_signature")

    # an edited token: a genuine one with its claims swapped keeps a signature that fails
    genuine = keys.issue("alice", "user").token
    head, _, signature = genuine.split(".")
    edited = f"{head}.{_b64(json.dumps(_claims(sub='alice')).encode())}.{signature}"
    _refused(auth_broker, edited, "bad_signature")

    none_header = _b64(b'{"alg":"none","typ":"JWT"}')
    unsigned = f"{none_header}.{_b64(json.dumps(_claims()).encode())}."
    _refused(auth_broker, unsigned, "algorithm")
    none_upper = jwt.encode(_claims(), None, algorithm="none").replace(
        _b64(b'{"alg":"none","typ":"JWT"}'), _b64(b'{"alg":"None","typ":"JWT"}')
    )
    _refused(auth_broker, none_upper, "algorithm")
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    _refused(auth_broker, jwt.encode(_claims(), rsa_key, algorithm="RS256"), "algorithm")
    # algorithm confusion: HS256 keyed with the broker's public key (PEM and raw bytes)
    raw_public = (
        serialization.load_pem_private_key(private, None)
        .public_key()
        .public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    )
    for secret in (public_pem, raw_public):
        confused = _hand_signed({"alg": "HS256", "typ": "JWT"}, _claims(), secret)
        _refused(auth_broker, confused, "bad_signature")

    for garbage in ("not-a-token", "a.b.c", "...", "x" * 5000):
        _refused(auth_broker, garbage, "malformed")
    no_jti = jwt.encode(
        {k: v for k, v in _claims().items() if k != "jti"},
        serialization.load_pem_private_key(private, None),
        algorithm="EdDSA",
    )
    _refused(auth_broker, no_jti, "malformed")
    bad_role = jwt.encode(
        _claims(role="root"), serialization.load_pem_private_key(private, None), algorithm="EdDSA"
    )
    _refused(auth_broker, bad_role, "malformed")

    # HS256 tokens of this broker are accepted (the second algorithm)
    hs = keys.issue("ops", "admin", algorithm="HS256").token
    with slipstream.connect(auth_broker.address, token=hs) as client:
        client.list_streams()

    for reason in ("expired", "bad_signature", "algorithm", "malformed"):
        _audited(auth_broker, reason)
    log = auth_broker.log()
    for secret_text in (expired, forged, genuine, hs, private.decode().splitlines()[1]):
        assert secret_text not in log


def test_key_files_are_owner_only_and_survive_restart(auth_broker: BrokerProcess) -> None:
    paths = [auth_broker.data_dir / ED25519_KEY_FILE, auth_broker.data_dir / HS256_KEY_FILE]
    for path in paths:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    before = [p.read_bytes() for p in paths]
    admin = bootstrap(auth_broker)
    auth_broker.restart()
    assert [p.read_bytes() for p in paths] == before
    with slipstream.connect(auth_broker.address, token=admin["token"]) as client:
        client.list_streams()


def test_a_key_file_others_can_read_stops_the_broker(broker_factory: BrokerFactory) -> None:
    broker = broker_factory("--auth").start()
    broker.stop()
    (broker.data_dir / ED25519_KEY_FILE).chmod(0o644)
    with pytest.raises(RuntimeError, match="chmod 600"):
        broker.start()


def test_revocation_ends_open_connections_and_survives_restart(
    auth_broker: BrokerProcess,
) -> None:
    admin = slipstream.connect(auth_broker.address, token=bootstrap(auth_broker)["token"])
    issued = admin.create_token("alice", scope="demo", expires_s=3600)
    assert issued.info.subject == "alice" and issued.info.scope == "demo"
    user = slipstream.connect(auth_broker.address, token=issued.token, reconnect_timeout=1)
    user.list_streams("demo")  # connected; the scope is authz's to enforce
    admin.revoke_token(issued.info.token_id)
    with pytest.raises(AuthenticationFailed, match="revoked") as info:
        user.list_streams("demo")
    assert info.value.details.get("reason") == "revoked"
    user.close()
    _refused(auth_broker, issued.token, "revoked")
    _audited(auth_broker, "revoked")
    listed = {t.token_id: t for t in admin.list_tokens()}
    assert listed[issued.info.token_id].revoked
    admin.close()
    auth_broker.restart()
    _refused(auth_broker, issued.token, "revoked")
    assert issued.token not in auth_broker.log()


def test_an_open_connection_ends_when_its_token_expires(auth_broker: BrokerProcess) -> None:
    keys = TokenKeys.load(auth_broker.data_dir, create=False)
    short = keys.issue("alice", "admin", expires_s=2)
    client = slipstream.connect(auth_broker.address, token=short.token, reconnect_timeout=1)
    client.list_streams()
    deadline = time.monotonic() + 30
    with pytest.raises(AuthenticationFailed, match="expired"):
        while time.monotonic() < deadline:
            client.list_streams()
            time.sleep(0.2)
    client.close()


def test_only_admins_manage_tokens(auth_broker: BrokerProcess) -> None:
    keys = TokenKeys.load(auth_broker.data_dir, create=False)
    with slipstream.connect(auth_broker.address, token=keys.issue("bob").token) as user:
        with pytest.raises(PermissionDenied):
            user.create_token("bob2", "admin")
        with pytest.raises(PermissionDenied):
            user.list_tokens()
        with pytest.raises(PermissionDenied):
            user.revoke_token("anything")


def test_token_cli_against_the_broker(auth_broker: BrokerProcess) -> None:
    admin = bootstrap(auth_broker)
    env = {"SLIPSTREAM_BROKER": auth_broker.address}
    made = cli(
        "--token", admin["token"], "token", "create", "--subject", "carol", "--expires", "1h",
        "--scope", "demo", "--json", env=env,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    carol = json.loads(made.stdout)
    assert carol["scope"] == "demo"
    listed = cli("token", "list", "--json", env={**env, "SLIPSTREAM_TOKEN": admin["token"]})
    assert listed.returncode == 0, listed.stderr
    assert carol["token"] not in listed.stdout
    assert [t["subject"] for t in json.loads(listed.stdout)] == ["carol"]
    revoked = cli("--token", admin["token"], "token", "revoke", carol["token_id"], env=env)
    assert revoked.returncode == 0, revoked.stderr
    refused = cli("--token", carol["token"], "stream", "list", env=env)
    assert refused.returncode == 1
    assert "revoked" in refused.stderr
    missing = cli("stream", "list", env=env)
    assert missing.returncode == 1 and "no credentials" in missing.stderr


def test_bootstrap_needs_a_data_directory(tmp_path: Path) -> None:
    done = cli("token", "create", "--data-dir", str(tmp_path / "nope"), "--subject", "ops")
    assert done.returncode != 0
    assert "--data-dir" in done.stderr


def test_up_refuses_a_public_host_without_auth(broker_factory: BrokerFactory) -> None:
    refused = cli("up", "--host", "0.0.0.0", "--data-dir", "/nonexistent/never", "--port", "1")
    assert refused.returncode == 2
    assert "--auth" in refused.stderr and "--insecure" in refused.stderr
    broker = broker_factory("--host", "0.0.0.0", "--insecure").start()
    with broker.client() as client:
        client.list_streams()
    assert "without --auth (--insecure)" in broker.log()
    with_auth = broker_factory("--host", "0.0.0.0", "--auth").start()
    _refused(with_auth, None, "missing")


def test_a_client_certificate_is_an_identity(broker_factory: BrokerFactory, tmp_path: Path) -> None:
    folder = tmp_path / "pki"
    folder.mkdir()
    ca = Authority(folder, "good")
    server = ca.issue("broker", hosts=("127.0.0.1",), into="server")
    alice = ca.issue("alice", client=True)
    broker = broker_factory(
        "--auth", "--tls-cert", str(server.cert), "--tls-key", str(server.key),
        "--tls-client-ca", str(ca.path),
    ).start()  # fmt: skip
    tls = {"ca": ca.path, "cert": alice.cert, "key": alice.key}
    # no token: the certificate names a user without rules, and the denial names it
    with (
        slipstream.connect(broker.address, **tls) as client,
        pytest.raises(PermissionDenied, match="alice"),
    ):
        client.create_stream("demo/certs")
    admin = bootstrap(broker)
    with slipstream.connect(broker.address, token=admin["token"], **tls) as client:
        client.create_stream("demo/certs")  # the token wins over the certificate
    assert not any("authentication_failed" in line for line in broker.log().splitlines()), (
        broker.log()
    )


def test_revocation_ends_an_open_follow(auth_broker: BrokerProcess) -> None:
    admin = slipstream.connect(auth_broker.address, token=bootstrap(auth_broker)["token"])
    admin.create_stream("demo/follow")
    with admin.producer("demo/follow") as producer:
        producer.send(b"first")
    issued = admin.create_token("reader", "admin", expires_s=3600)
    reader_client = slipstream.connect(auth_broker.address, token=issued.token)
    events = iter(reader_client.reader("demo/follow", start="earliest"))  # follows the tail
    assert next(events).value == b"first"
    admin.revoke_token(issued.info.token_id)
    with pytest.raises(AuthenticationFailed, match="revoked"):
        next(events)
    reader_client.close()
    texts = [line.split("slipstream.audit: ", 1)[-1] for line in auth_broker.log().splitlines()]
    events_logged = [json.loads(t)["event"] for t in texts if t.startswith("{")]
    assert "token_created" in events_logged and "token_revoked" in events_logged
    admin.close()

"""The audit trail with authentication on (``slipstream up --auth``): failures, denials and
changes of tokens and rules reach ``_system/audit``; only admins read it; and no token or key
appears in the broker's log or in the audit stream, whatever succeeded or failed."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import jwt
import pytest
from conftest import BrokerProcess
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import slipstream
from slipstream import AuthenticationFailed, PermissionDenied
from slipstream.security._audit import AuditRecord, decode_record, verify_chain
from slipstream.security._tokens import ED25519_KEY_FILE, HS256_KEY_FILE

pytestmark = pytest.mark.timeout(180)

AUDIT = "_system/audit"
#: the shortest piece of a secret looked for
WINDOW = 16


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "slipstream", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def records_of(client: slipstream.Client) -> tuple[list[bytes], list[AuditRecord]]:
    end = client.tail(AUDIT)
    with client.reader(AUDIT, start="earliest", end=end) as reader:
        values = [bytes(e.value) for e in reader]
    return values, [decode_record(v) for v in values]


def wait_until(
    client: slipstream.Client, done: Callable[[list[AuditRecord]], bool]
) -> tuple[list[bytes], list[AuditRecord]]:
    deadline = time.monotonic() + 15
    while True:
        values, records = records_of(client)
        if done(records) or time.monotonic() > deadline:
            return values, records
        time.sleep(0.1)


def secret_forms(secret: bytes) -> list[str]:
    """Ways a key's bytes could show up in text: raw, hex, base64 (both alphabets)."""
    forms = [
        secret.hex(),
        base64.b64encode(secret).decode().rstrip("="),
        base64.urlsafe_b64encode(secret).decode().rstrip("="),
    ]
    with contextlib.suppress(UnicodeDecodeError):
        forms.append(secret.decode())
    return [f for f in forms if len(f) >= 16]


def test_no_token_or_key_in_the_log_or_the_audit_stream(
    broker_factory: Callable[..., BrokerProcess],
) -> None:
    broker = broker_factory("--auth").start()
    made = cli(
        "token", "create", "--data-dir", str(broker.data_dir), "--subject", "ops", "--role",
        "admin", "--json",
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    admin_token = json.loads(made.stdout)["token"]
    tokens = [admin_token]
    private_pem = (broker.data_dir / ED25519_KEY_FILE).read_bytes()
    hs_secret = (broker.data_dir / HS256_KEY_FILE).read_bytes()
    private = serialization.load_pem_private_key(private_pem, None)
    raw_private = private.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    producer_key = (broker.data_dir / "producer.key").read_bytes()

    with slipstream.connect(broker.address, token=admin_token) as admin:
        admin.create_stream("demo/orders")
        admin.create_stream("other/secret")
        alice = admin.create_token("alice", scope="demo", expires_s=3600)
        bob = admin.create_token("bob", expires_s=3600)
        hs_alice = admin.create_token("alice", algorithm="HS256", expires_s=3600)
        tokens += [alice.token, bob.token, hs_alice.token]
        admin.grant("alice", "produce", "demo/*")
        admin.grant("alice", "consume", "*")

        # successes
        with slipstream.connect(broker.address, token=alice.token) as as_alice:
            with as_alice.producer("demo/orders") as producer:
                producer.send(b"an order")
            with as_alice.reader("demo/orders", end=as_alice.tail("demo/orders")) as reader:
                assert [e.value for e in reader] == [b"an order"]
            # denials: another scope, manage, and the audit stream (no rule reaches _system)
            with pytest.raises(PermissionDenied):
                as_alice.create_stream("demo/mine")
            with pytest.raises(PermissionDenied):
                as_alice.describe_stream("other/secret")
            with pytest.raises(PermissionDenied):
                list(as_alice.reader(AUDIT, end=admin.tail(AUDIT)))
        with slipstream.connect(broker.address, token=hs_alice.token) as as_hs:
            as_hs.describe_stream("demo/orders")

        # failures: revoked, expired, forged, alg none, garbage, none at all
        admin.revoke_token(bob.info.token_id)
        with pytest.raises(AuthenticationFailed):
            slipstream.connect(broker.address, token=bob.token, timeout=5).close()
        now = int(time.time())
        claims: dict[str, Any] = {"sub": "ops", "role": "admin", "jti": "0123456789abcdef"}
        expired = jwt.encode({**claims, "iat": now - 7200, "exp": now - 60}, private, "EdDSA")
        forged = jwt.encode(
            {**claims, "iat": now, "exp": now + 60}, Ed25519PrivateKey.generate(), "EdDSA"
        )
        unsigned = jwt.encode({**claims, "iat": now, "exp": now + 60}, None, "none")
        for bad in (expired, forged, unsigned, "garbage.token.value", None):
            with pytest.raises(AuthenticationFailed):
                slipstream.connect(broker.address, token=bad, timeout=5).close()
        tokens += [expired, forged, unsigned]

        # the CLI with tokens: an admin verifies the trail, a user may not read it
        env = {"SLIPSTREAM_BROKER": broker.address}
        verified = cli("--token", admin_token, "audit", "verify", "--json", env=env)
        assert verified.returncode == 0, verified.stderr
        assert json.loads(verified.stdout)["ok"]
        refused = cli("--token", alice.token, "audit", "tail", env=env)
        assert refused.returncode == 1 and "alice" in refused.stderr

        values, records = wait_until(
            admin, lambda rs: sum(r.event == "authentication_failed" for r in rs) >= 6
        )

    events = [r.event for r in records]
    for event in ("token_created", "token_revoked", "rule_granted", "stream_created", "denied"):
        assert event in events, events
    reasons = {r.details.get("reason") for r in records if r.event == "authentication_failed"}
    assert {"revoked", "expired", "bad_signature", "algorithm", "malformed", "missing"} <= reasons
    denied = [r for r in records if r.event == "denied"]
    assert {r.subject for r in denied} == {"alice"}
    assert AUDIT in {r.details.get("stream") for r in denied}
    assert verify_chain(values, trimmed=False).ok
    assert [r.seq for r in records] == list(range(1, len(records) + 1))

    assert broker.stop() == 0
    texts = {"broker log": broker.log(), "audit stream": b"\n".join(values).decode()}
    # a token's signature is its secret part (header and claims are only base64 of its claims)
    secrets = {f"signature of token {n}": t.rsplit(".", 1)[1] for n, t in enumerate(tokens)}
    secrets = {name: sig for name, sig in secrets.items() if sig}  # alg none: no signature
    secrets.update({f"ed25519 pem line {n}": line for n, line in enumerate(
        private_pem.decode().splitlines()[1:-1])})  # fmt: skip
    for name, key in (("ed25519", raw_private), ("hs256", hs_secret), ("producer", producer_key)):
        secrets.update({f"{name} key {n}": form for n, form in enumerate(secret_forms(key))})
    for where, text in texts.items():
        assert text
        for name, secret in secrets.items():
            # any 16 characters of it: a cut-off token or key counts too
            for start in range(max(1, len(secret) - WINDOW + 1)):
                piece = secret[start : start + WINDOW]
                assert piece not in text, f"part of {name} ({piece!r}) appears in the {where}"

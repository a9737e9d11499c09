"""TLS on the broker's binary port and HTTP API: a real broker process, certificates made here.

Every mismatch (plaintext against TLS and the reverse, an unknown CA, a wrong host name, a
missing client certificate) must fail connect with TlsError within the connect timeout.
"""

from __future__ import annotations

import json
import signal
import ssl
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from conftest import BrokerProcess
from cryptography import x509
from security.pki import Authority, Issued

import slipstream
from slipstream import TlsError

pytestmark = pytest.mark.timeout(120)

#: connect's budget in these tests: every failure must come back within it
TIMEOUT = 5.0


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, object]:
    folder = tmp_path / "pki"
    folder.mkdir()
    ca = Authority(folder, "good")
    rogue = Authority(folder, "rogue")
    return {
        "ca": ca,
        "rogue": rogue,
        "server": ca.issue("broker", hosts=("127.0.0.1", "localhost"), into="server"),
        "client": ca.issue("alice", client=True),
        "rogue_client": rogue.issue("mallory", client=True),
    }


BrokerFactory = Callable[..., BrokerProcess]


def _tls_broker(
    broker_factory: BrokerFactory, pki: dict[str, object], *extra: str
) -> BrokerProcess:
    server = pki["server"]
    assert isinstance(server, Issued)
    return broker_factory("--tls-cert", str(server.cert), "--tls-key", str(server.key), *extra)


def _ca(pki: dict[str, object], name: str = "ca") -> Path:
    authority = pki[name]
    assert isinstance(authority, Authority)
    return authority.path


def _refusals(broker: BrokerProcess, count: int) -> list[str]:
    """The reasons of the broker's ``connection_refused`` audit records, once it has written
    ``count`` of them (the audit log lines are JSON objects)."""
    deadline = time.monotonic() + 10
    while True:
        found = [
            json.loads(line[line.index("{") :])["details"]["reason"]
            for line in broker.log().splitlines()
            if "slipstream.audit" in line and '"connection_refused"' in line
        ]
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def _fails_fast(connect: Callable[[], object], match: str) -> TlsError:
    started = time.monotonic()
    with pytest.raises(TlsError, match=match) as info:
        connect()
    assert time.monotonic() - started < TIMEOUT + 1, "TLS failure must come within the timeout"
    return info.value


def test_produce_and_consume_over_tls(
    broker_factory: BrokerFactory, pki: dict[str, object]
) -> None:
    broker = _tls_broker(broker_factory, pki).start()
    with slipstream.connect(broker.address, tls=True, ca=_ca(pki), timeout=TIMEOUT) as client:
        client.create_stream("demo/tls")
        with client.producer("demo/tls") as producer:
            for i in range(100):
                producer.send(f"event {i}".encode(), key=f"k{i % 5}")
        events = list(client.reader("demo/tls", start="earliest", end=client.tail("demo/tls")))
    assert sorted(e.value for e in events) == sorted(f"event {i}".encode() for i in range(100))


def test_env_ca_implies_tls(
    broker_factory: BrokerFactory, pki: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    broker = _tls_broker(broker_factory, pki).start()
    monkeypatch.setenv("SLIPSTREAM_TLS_CA", str(_ca(pki)))
    with slipstream.connect(broker.address, timeout=TIMEOUT) as client:
        assert client.list_streams() == []


def test_plaintext_client_against_tls_broker(
    broker_factory: BrokerFactory, pki: dict[str, object]
) -> None:
    broker = _tls_broker(broker_factory, pki).start()
    _fails_fast(lambda: slipstream.connect(broker.address, timeout=TIMEOUT), "requires TLS")
    deadline = time.monotonic() + 10
    while "refused a plaintext connection from 127.0.0.1:" not in broker.log():
        assert time.monotonic() < deadline, broker.log()
        time.sleep(0.05)
    assert "WARNING" in next(
        line for line in broker.log().splitlines() if "refused a plaintext" in line
    )
    assert _refusals(broker, 1) == ["plaintext_on_tls_port"]  # audited


def test_tls_client_against_plaintext_broker(
    broker_factory: BrokerFactory, pki: dict[str, object]
) -> None:
    broker = broker_factory().start()
    _fails_fast(
        lambda: slipstream.connect(broker.address, ca=_ca(pki), timeout=TIMEOUT),
        "does not use TLS|without TLS",
    )
    assert _refusals(broker, 1) == ["tls_error"]  # audited


def test_unknown_ca_is_refused(broker_factory: BrokerFactory, pki: dict[str, object]) -> None:
    broker = _tls_broker(broker_factory, pki).start()
    _fails_fast(
        lambda: slipstream.connect(broker.address, ca=_ca(pki, "rogue"), timeout=TIMEOUT),
        "not signed by a CA this client trusts",
    )
    # the system's CAs do not know a private CA either
    _fails_fast(
        lambda: slipstream.connect(broker.address, tls=True, timeout=TIMEOUT),
        "not signed by a CA this client trusts",
    )


def test_wrong_host_name_is_refused(broker_factory: BrokerFactory, pki: dict[str, object]) -> None:
    broker = _tls_broker(broker_factory, pki).start()
    ca = pki["ca"]
    assert isinstance(ca, Authority)
    other = ca.issue("elsewhere", hosts=("broker.example.com",), into="other")
    broker2 = broker_factory("--tls-cert", str(other.cert), "--tls-key", str(other.key)).start()
    _fails_fast(
        lambda: slipstream.connect(broker2.address, ca=_ca(pki), timeout=TIMEOUT),
        "not issued for the host dialled",
    )
    # the right name works, by name as by address
    with slipstream.connect(f"localhost:{broker.port}", ca=_ca(pki), timeout=TIMEOUT) as client:
        assert client.list_streams() == []


def test_mutual_tls(broker_factory: BrokerFactory, pki: dict[str, object]) -> None:
    broker = _tls_broker(broker_factory, pki, "--tls-client-ca", str(_ca(pki))).start()
    _fails_fast(
        lambda: slipstream.connect(broker.address, ca=_ca(pki), timeout=TIMEOUT),
        "requires a client certificate",
    )
    rogue = pki["rogue_client"]
    assert isinstance(rogue, Issued)
    _fails_fast(
        lambda: slipstream.connect(
            broker.address, ca=_ca(pki), cert=rogue.cert, key=rogue.key, timeout=TIMEOUT
        ),
        "client certificate|refused",
    )
    # audited: no certificate at all, and one from a CA the broker does not trust
    refusals = _refusals(broker, 2)
    assert len(refusals) == 2, refusals
    assert all(r.startswith("tls_handshake_failed") for r in refusals), refusals
    alice = pki["client"]
    assert isinstance(alice, Issued)
    with slipstream.connect(
        broker.address, ca=_ca(pki), cert=alice.cert, key=alice.key, timeout=TIMEOUT
    ) as client:
        client.create_stream("demo/mtls")
        assert [s.name for s in client.list_streams()] == ["demo/mtls"]


def test_https_admin_api(broker_factory: BrokerFactory, pki: dict[str, object]) -> None:
    broker = _tls_broker(broker_factory, pki).start()
    url = f"https://127.0.0.1:{broker.http_port}/api/streams"
    response = httpx.get(url, verify=ssl.create_default_context(cafile=_ca(pki)), timeout=TIMEOUT)
    assert response.status_code == 200
    with pytest.raises(httpx.ConnectError):
        httpx.get(url, verify=ssl.create_default_context(cafile=_ca(pki, "rogue")), timeout=TIMEOUT)


def _peer_serial(address: str, ca: Path) -> int:
    host, port = address.rsplit(":", 1)
    import socket

    ctx = ssl.create_default_context(cafile=ca)
    with (
        socket.create_connection((host, int(port)), timeout=TIMEOUT) as raw,
        ctx.wrap_socket(raw, server_hostname=host) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def test_sighup_reloads_certificates_and_keeps_connections(
    broker_factory: BrokerFactory, pki: dict[str, object]
) -> None:
    broker = _tls_broker(broker_factory, pki).start()
    old = pki["server"]
    assert isinstance(old, Issued)
    ca = pki["ca"]
    assert isinstance(ca, Authority)
    with slipstream.connect(broker.address, ca=_ca(pki), timeout=TIMEOUT) as kept:
        kept.create_stream("demo/reload")
        assert _peer_serial(broker.address, _ca(pki)) == old.serial
        new = ca.issue("broker", hosts=("127.0.0.1",), into="server")  # same files, replaced
        assert new.serial != old.serial
        assert broker.proc is not None
        broker.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "TLS certificates reloaded" not in broker.log():
            assert time.monotonic() < deadline, broker.log()
            time.sleep(0.05)
        assert _peer_serial(broker.address, _ca(pki)) == new.serial
        # the connection opened before the reload still works
        with kept.producer("demo/reload") as producer:
            producer.send(b"after reload")
        assert [
            e.value
            for e in kept.reader("demo/reload", start="earliest", end=kept.tail("demo/reload"))
        ] == [b"after reload"]
        with slipstream.connect(broker.address, ca=_ca(pki), timeout=TIMEOUT) as fresh:
            assert [s.name for s in fresh.list_streams()] == ["demo/reload"]


def test_cli_global_tls_options(broker_factory: BrokerFactory, pki: dict[str, object]) -> None:
    import os
    import subprocess
    import sys

    broker = _tls_broker(broker_factory, pki).start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLIPSTREAM_")}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "slipstream", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )

    created = cli(
        "--tls-ca", str(_ca(pki)), "stream", "create", "demo/cli", "--broker", broker.address
    )
    assert created.returncode == 0, created.stderr
    listed = cli("--tls-ca", str(_ca(pki)), "stream", "list", "--json", "--broker", broker.address)
    assert listed.returncode == 0, listed.stderr
    assert "demo/cli" in listed.stdout
    plain = cli("stream", "list", "--broker", broker.address)
    assert plain.returncode != 0
    assert "requires TLS" in " ".join(plain.stderr.split())
    rogue = cli("--tls-ca", str(_ca(pki, "rogue")), "stream", "list", "--broker", broker.address)
    assert rogue.returncode != 0
    assert "not signed by a CA this client trusts" in " ".join(rogue.stderr.split())


def test_a_silent_connection_to_the_tls_port_is_closed(
    broker_factory: BrokerFactory, pki: dict[str, object]
) -> None:
    """No Session (and so no idle timeout) exists before the first bytes: the gate's timer
    must close a connection that never sends any."""
    import socket

    broker = _tls_broker(broker_factory, pki).start()
    with socket.create_connection(("127.0.0.1", broker.port), timeout=60) as silent:
        assert silent.recv(1) == b""  # closed by the broker (a timeout here raises)


def test_expired_certificate_is_refused(
    broker_factory: BrokerFactory, pki: dict[str, object]
) -> None:
    ca = pki["ca"]
    assert isinstance(ca, Authority)
    old = ca.issue("broker", hosts=("127.0.0.1",), into="expired", expired=True)
    broker = broker_factory("--tls-cert", str(old.cert), "--tls-key", str(old.key)).start()
    _fails_fast(
        lambda: slipstream.connect(broker.address, ca=_ca(pki), timeout=TIMEOUT), "has expired"
    )


@pytest.mark.parametrize("broken", ["garbage", "key_mismatch"])
def test_sighup_with_a_broken_file_keeps_the_old_certificate(
    broker_factory: BrokerFactory, pki: dict[str, object], broken: str
) -> None:
    broker = _tls_broker(broker_factory, pki).start()
    server = pki["server"]
    assert isinstance(server, Issued)
    if broken == "garbage":
        server.cert.write_text("not a certificate\n")
    else:  # a valid certificate, but the key file still holds the old key
        ca = pki["ca"]
        assert isinstance(ca, Authority)
        other = ca.issue("broker", hosts=("127.0.0.1",), into="other")
        server.cert.write_bytes(other.cert.read_bytes())
    assert broker.proc is not None
    broker.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while "TLS certificates not reloaded" not in broker.log():
        assert time.monotonic() < deadline, broker.log()
        time.sleep(0.05)
    assert _peer_serial(broker.address, _ca(pki)) == server.serial
    with slipstream.connect(broker.address, ca=_ca(pki), timeout=TIMEOUT) as client:
        assert client.list_streams() == []

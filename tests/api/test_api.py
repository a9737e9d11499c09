"""The admin HTTP API against a real broker process on loopback: every resource, and the
errors a client can cause (each a typed JSON body with the right status)."""

from __future__ import annotations

import base64
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import BrokerProcess, free_port, produce_json

import slipstream
from slipstream.http import MAX_BODY_BYTES


@pytest.fixture
def api(broker: BrokerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=broker.http_url, timeout=30) as http:
        yield http


def error_of(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert body["error"] == code, body
    assert body["message"] and isinstance(body["details"], dict)
    return dict(body)


def test_a_stream_is_created_described_updated_scaled_and_deleted(api: httpx.Client) -> None:
    created = api.post("/api/streams", json={"name": "ops/orders", "segments": 2})
    assert created.status_code == 201, created.text
    assert [s["number"] for s in created.json()["segments"]] == [0, 1]

    names = [s["name"] for s in api.get("/api/streams").json()]
    assert "ops/orders" in names
    assert api.get("/api/streams", params={"scope": "other"}).json() == []

    changed = api.patch(
        "/api/streams/ops/orders",
        json={"retention_ms": 3_600_000, "scaling": "events 5000/s factor 2 min 2"},
    )
    assert changed.status_code == 200, changed.text
    assert changed.json()["retention_ms"] == 3_600_000
    assert changed.json()["scaling"].startswith("events 5000/s")

    scaled = api.post("/api/streams/ops/orders/scale", json={"segments": [0], "into": 2})
    assert scaled.status_code == 200, scaled.text
    described = api.get("/api/streams/ops/orders").json()
    assert described["epoch"] == 1
    sealed = [s for s in described["segments"] if s["sealed"]]
    assert [s["number"] for s in sealed] == [0]  # segments of every epoch, sealed ones too
    successors = [s for s in described["segments"] if s["predecessors"] == [0]]
    assert len(successors) == 2
    history = api.get("/api/streams/ops/orders/history").json()
    assert [(h["epoch"], list(h["sealed"]), h["reason"]) for h in history] == [(1, ["0"], "manual")]

    assert api.delete("/api/streams/ops/orders").status_code == 204
    error_of(api.get("/api/streams/ops/orders"), 404, "stream_not_found")


def test_events_are_browsed_page_by_page_and_found_by_key(
    broker: BrokerProcess, client: slipstream.Client, api: httpx.Client
) -> None:
    client.create_stream("ops/events", segments=2)
    produce_json(client, "ops/events", 30)
    with client.producer("ops/events") as producer:
        producer.send(b"\xff\x00binary", key=b"\xfe", headers={"trace": b"t-1", "raw": b"\xff"})

    first = api.get("/api/streams/ops/events/events", params={"at": "earliest", "limit": 20})
    assert first.status_code == 200, first.text
    page = first.json()
    assert len(page["events"]) == 20 and page["older"] is None and page["newer"]
    rest = api.get("/api/streams/ops/events/events", params={"after": page["newer"]}).json()
    assert rest["newer"] is None  # the tail
    events = page["events"] + rest["events"]
    assert len(events) == 31
    assert len({(e["segment"], e["offset"]) for e in events}) == 31
    numbers = sorted(e["value"]["n"] for e in events if e["value_format"] == "json")
    assert numbers == list(range(30))
    binary = next(e for e in events if e["value_format"] == "base64")
    assert base64.b64decode(binary["value"]) == b"\xff\x00binary"
    assert binary["key_format"] == "base64" and base64.b64decode(binary["key"]) == b"\xfe"
    assert binary["headers"]["trace"] == "t-1"
    assert binary["headers_base64"] == ["raw"]
    assert base64.b64decode(binary["headers"]["raw"]) == b"\xff"

    newest = api.get("/api/streams/ops/events/events", params={"limit": 5}).json()
    assert newest["newer"] is None and len(newest["events"]) == 5 and newest["older"]

    found = api.get("/api/streams/ops/events/events", params={"key": "k3"}).json()
    assert sorted(e["value"]["n"] for e in found["events"]) == [3, 13, 23]
    assert {e["key"] for e in found["events"]} == {"k3"}


def test_subscriptions_are_created_described_reset_and_deleted(
    client: slipstream.Client, api: httpx.Client
) -> None:
    client.create_stream("ops/subs", segments=1)
    produce_json(client, "ops/subs", 10)
    base = "/api/streams/ops/subs/subscriptions"
    created = api.post(base, json={"name": "billing", "at": "earliest"})
    assert created.status_code == 201, created.text
    assert [s["name"] for s in api.get(base).json()] == ["billing"]
    described = api.get(f"{base}/billing").json()
    assert [s["backlog_events"] for s in described["segments"]] == [10]
    assert described["members"] == []

    reset = api.post(f"{base}/billing/reset", json={"at": "latest"})
    assert reset.status_code == 200, reset.text
    assert [s["backlog_events"] for s in api.get(f"{base}/billing").json()["segments"]] == [0]
    assert reset.json()["generation"] > described["generation"]

    error_of(api.post(base, json={"name": "billing"}), 409, "subscription_exists")
    assert api.delete(f"{base}/billing").status_code == 204
    error_of(api.get(f"{base}/billing"), 404, "subscription_not_found")
    error_of(
        api.post(f"{base}/billing/reset", json={"at": "latest"}), 404, "subscription_not_found"
    )


def test_an_operator_aborts_an_open_transaction(
    client: slipstream.Client, api: httpx.Client
) -> None:
    client.create_stream("ops/txns", segments=1)
    txn = client.transaction("ops-writer")
    txn.send("ops/txns", b"{}", key="k")
    listed = api.get("/api/transactions").json()
    assert [t["txn_id"] for t in listed] == [txn.txn_id]
    aborted = api.post(f"/api/transactions/{txn.txn_id}/abort")
    assert aborted.status_code == 200, aborted.text
    assert aborted.json() == {"txn_id": txn.txn_id, "committed": False, "ranges": []}
    assert api.get("/api/transactions").json() == []
    with pytest.raises(slipstream.TransactionAborted):
        txn.commit()
    error_of(api.post("/api/transactions/abc/abort"), 400, "invalid_argument")


def test_transactional_ids_are_listed_by_prefix_with_their_last_commit(
    broker: BrokerProcess, client: slipstream.Client, api: httpx.Client
) -> None:
    client.create_stream("ops/out", segments=1)
    for tid, batch in (("spark:q-2", 4), ("spark:q-1", 9), ("app-writer", 1)):
        with client.transaction(tid) as txn:
            txn.send("ops/out", b"{}", key="k")
            txn.metadata = {"query": tid, "batch": batch, "events": 1}
    client.transaction("spark:never-committed").abort()

    every = api.get("/api/transactions/identities")
    assert every.status_code == 200, every.text
    assert [i["transactional_id"] for i in every.json()] == [
        "app-writer",
        "spark:never-committed",
        "spark:q-1",
        "spark:q-2",
    ]
    spark = api.get("/api/transactions/identities", params={"prefix": "spark:q-"}).json()
    assert [(i["transactional_id"], i["metadata"]["batch"]) for i in spark] == [
        ("spark:q-1", 9),
        ("spark:q-2", 4),
    ]
    assert spark[0]["last_txn_id"] >= 0 and spark[0]["committed_ms"] > 0
    meta = base64.b64decode(spark[0]["metadata_base64"])
    assert meta.startswith(b"{") and b'"batch"' in meta
    never = api.get("/api/transactions/identities", params={"prefix": "spark:never"}).json()
    assert [(i["last_txn_id"], i["metadata"], i["metadata_base64"]) for i in never] == [
        (-1, None, "")
    ]
    assert api.get("/api/transactions/identities", params={"prefix": "nobody"}).json() == []

    client.close()
    broker.restart()  # the listing comes from the MetaStore after a restart
    with httpx.Client(base_url=broker.http_url, timeout=30) as http:
        again = http.get("/api/transactions/identities", params={"prefix": "spark:q-"}).json()
    assert again == spark


def test_the_broker_reports_version_config_containers_disk_and_recovery(
    broker: BrokerProcess, client: slipstream.Client, api: httpx.Client
) -> None:
    client.create_stream("ops/disk", segments=1)
    produce_json(client, "ops/disk", 5)
    info = api.get("/api/broker").json()
    assert info["version"] == slipstream.__version__
    assert info["address"] == broker.address
    assert info["http_address"] == f"127.0.0.1:{broker.http_port}"
    assert info["config"]["http_port"] == broker.http_port
    assert len(info["containers"]) == info["config"]["containers"]
    assert info["disk"]["journal_bytes"] > 0 and info["disk"]["free_bytes"] > 0
    assert info["disk"]["journal_bytes"] == sum(c["journal_bytes"] for c in info["containers"])
    assert info["recovery"]["streams"] == 0 and "ms" in info["recovery"]
    assert info["streams"] == 1
    broker.restart()
    again = api.get("/api/broker").json()
    assert again["recovery"]["streams"] == 1
    assert again["started_ms"] > info["started_ms"]


def test_the_broker_shows_its_catalog_url_without_the_password(
    broker_factory: type[BrokerProcess], pg_dsn: str
) -> None:
    """Any authenticated caller reads /api/broker: the --meta URL's password must not be there
    (a local ./run.sh --cluster showed it whole)."""
    password = pg_dsn.split("@")[0].rsplit(":", 1)[1]
    assert password
    broker = broker_factory("--meta", pg_dsn).start()
    with httpx.Client(base_url=broker.http_url, timeout=30) as http:
        answer = http.get("/api/broker")
    assert answer.status_code == 200, answer.text
    assert password not in answer.text
    assert answer.json()["config"]["meta"] == pg_dsn.replace(f":{password}@", ":***@")


# --- errors ----------------------------------------------------------------------------------


def test_unknown_streams_and_subscriptions_are_404_with_a_clear_body(api: httpx.Client) -> None:
    body = error_of(api.get("/api/streams/ops/missing"), 404, "stream_not_found")
    assert "ops/missing" in body["message"] and body["details"] == {"stream": "ops/missing"}
    for method, path in [
        ("PATCH", "/api/streams/ops/missing"),
        ("DELETE", "/api/streams/ops/missing"),
        ("GET", "/api/streams/ops/missing/history"),
        ("GET", "/api/streams/ops/missing/events"),
        ("GET", "/api/streams/ops/missing/subscriptions"),
        ("GET", "/api/streams/ops/missing/subscriptions/s"),
    ]:
        response = api.request(method, path, json={} if method == "PATCH" else None)
        error_of(response, 404, "stream_not_found")
    error_of(api.get("/api/nothing"), 404, "not_found")
    error_of(api.put("/api/streams"), 405, "method_not_allowed")
    error_of(api.post("/api/transactions/424242/abort"), 404, "transaction_not_found")


def test_malformed_and_invalid_bodies_are_400(api: httpx.Client) -> None:
    for raw in [b"{not json", b"", b"[1, 2"]:
        response = api.post("/api/streams", content=raw)
        error_of(response, 400, "malformed_json")
    error_of(
        api.post("/api/streams", json={"name": "a/b", "segments": "two"}), 400, "invalid_argument"
    )
    error_of(api.post("/api/streams", json={"name": "a/b", "sgements": 2}), 400, "invalid_argument")
    error_of(api.post("/api/streams", json={"name": "Not A Name"}), 400, "invalid_name")
    error_of(api.post("/api/streams", json={"name": "a/b", "segments": 0}), 400, "invalid_argument")
    error_of(api.get("/api/streams/a/b/events", params={"limit": "many"}), 400, "invalid_argument")
    assert api.post("/api/streams", json={"name": "a/b"}).status_code == 201
    error_of(api.post("/api/streams", json={"name": "a/b"}), 409, "stream_exists")
    error_of(api.get("/api/streams/a/b/events", params={"after": "x:y"}), 400, "invalid_argument")


def test_an_oversized_body_is_413_whether_declared_or_streamed(api: httpx.Client) -> None:
    huge = b'{"name": "a/b", "scaling": "' + b"x" * MAX_BODY_BYTES + b'"}'
    error_of(api.post("/api/streams", content=huge), 413, "request_too_large")

    def chunks() -> Iterator[bytes]:  # no Content-Length: chunked transfer encoding
        yield huge[: len(huge) // 2]
        yield huge[len(huge) // 2 :]

    error_of(api.post("/api/streams", content=chunks()), 413, "request_too_large")
    assert api.get("/api/streams").status_code == 200  # the server serves on


def test_a_key_search_on_a_deleted_stream_is_404(
    client: slipstream.Client, api: httpx.Client
) -> None:
    client.create_stream("ops/gone", segments=1)
    produce_json(client, "ops/gone", 3)
    assert api.get("/api/streams/ops/gone/events", params={"key": "k1"}).status_code == 200
    client.delete_stream("ops/gone")
    error_of(api.get("/api/streams/ops/gone/events", params={"key": "k1"}), 404, "stream_not_found")


# --- the server itself -----------------------------------------------------------------------


def test_openapi_describes_every_route(api: httpx.Client) -> None:
    document = api.get("/api/openapi.json").json()
    assert document["openapi"].startswith("3.1")
    paths = document["paths"]
    assert set(paths["/api/streams/{scope}/{name}"]) == {"get", "patch", "delete"}
    assert "/api/streams/{scope}/{name}/events" in paths
    assert "ErrorBody" in document["components"]["schemas"]


def test_metrics_are_served_beside_the_api(api: httpx.Client) -> None:
    response = api.get("/metrics")
    assert response.status_code == 200
    assert "# TYPE" in response.text


def _up(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "slipstream", "up", "--data-dir", str(tmp_path / "d")]
    return subprocess.run(
        [*command, "--port", "0", *args], capture_output=True, text=True, timeout=60
    )


def test_a_busy_http_port_stops_the_start_with_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = _up(tmp_path, "--http-port", str(port))
    assert result.returncode == 1, result.stderr
    assert f"cannot listen for HTTP on 127.0.0.1:{port}" in result.stderr
    assert "--http-port" in result.stderr


def test_http_port_minus_one_serves_no_http(broker_factory: type[BrokerProcess]) -> None:
    port = free_port()
    broker = broker_factory("--http-port", "-1")
    broker.http_port = port  # the factory's own port is overridden by the later flag
    broker.start()
    assert "admin HTTP API" not in broker.log()
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        pass
    assert broker.stop() == 0

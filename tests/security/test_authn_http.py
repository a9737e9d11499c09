"""Authentication of the broker's HTTP server (``up --auth``): ``Authorization: Bearer`` on
the API and /metrics (401 with a typed JSON body otherwise), the token routes, and the
console's login form with its HttpOnly SameSite=Strict cookie."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest
from conftest import BrokerProcess

from slipstream.security import TokenKeys

pytestmark = pytest.mark.timeout(120)

BrokerFactory = Callable[..., BrokerProcess]


@pytest.fixture
def auth_broker(broker_factory: BrokerFactory) -> BrokerProcess:
    return broker_factory("--auth").start()


def _keys(broker: BrokerProcess) -> TokenKeys:
    return TokenKeys.load(broker.data_dir, create=False)


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_api_needs_a_bearer_token(auth_broker: BrokerProcess) -> None:
    admin = _keys(auth_broker).issue("ops", "admin").token
    (auth_broker.data_dir.parent / "other").mkdir()
    forged = TokenKeys.load(auth_broker.data_dir.parent / "other")  # another broker's keys
    with httpx.Client(base_url=auth_broker.http_url, timeout=10) as http:
        for headers, reason in (
            ({}, "missing"),
            (_bearer("garbage"), "malformed"),
            (_bearer(forged.issue("ops", "admin").token), "bad_signature"),
            ({"Authorization": f"Basic {admin}"}, "missing"),
        ):
            answer = http.get("/api/streams", headers=headers)
            assert answer.status_code == 401, answer.text
            assert answer.json()["error"] == "authentication_failed"
            assert answer.json()["details"]["reason"] == reason
            assert answer.headers["www-authenticate"].startswith("Bearer")
        assert http.get("/api/streams", headers=_bearer(admin)).status_code == 200
        assert http.get("/metrics").status_code == 401
        assert http.get("/metrics", headers=_bearer(admin)).status_code == 200
        assert http.get("/api/openapi.json").status_code == 200  # the description is public
    assert admin not in auth_broker.log()


def test_token_routes(auth_broker: BrokerProcess) -> None:
    keys = _keys(auth_broker)
    admin, user = keys.issue("ops", "admin").token, keys.issue("bob").token
    with httpx.Client(base_url=auth_broker.http_url, timeout=10) as http:
        made = http.post(
            "/api/tokens",
            json={"subject": "carol", "scope": "demo", "expires_s": 3600},
            headers=_bearer(admin),
        )
        assert made.status_code == 201, made.text
        carol = made.json()
        assert carol["info"]["subject"] == "carol" and carol["info"]["scope"] == "demo"
        assert http.get("/api/streams", headers=_bearer(carol["token"])).status_code == 200
        listed = http.get("/api/tokens", headers=_bearer(admin)).json()
        assert [t["subject"] for t in listed] == ["carol"]
        assert carol["token"] not in str(listed)
        refused = http.post("/api/tokens", json={"subject": "x"}, headers=_bearer(user))
        assert refused.status_code == 403
        token_id = carol["info"]["token_id"]
        assert http.delete(f"/api/tokens/{token_id}", headers=_bearer(admin)).status_code == 204
        after = http.get("/api/streams", headers=_bearer(carol["token"]))
        assert after.status_code == 401
        assert after.json()["details"]["reason"] == "revoked"


def test_console_login_sets_a_strict_httponly_cookie(auth_broker: BrokerProcess) -> None:
    admin = _keys(auth_broker).issue("ops", "admin").token
    with httpx.Client(base_url=auth_broker.http_url, timeout=10) as http:
        first = http.get("/stream?name=demo/x")
        assert first.status_code == 303
        assert first.headers["location"] == "/login?next=%2Fstream%3Fname%3Ddemo%2Fx"
        htmx = http.get("/streams/rows", headers={"HX-Request": "true"})
        assert htmx.status_code == 401 and htmx.headers["hx-redirect"].startswith("/login")
        form = http.get("/login")
        assert form.status_code == 200 and 'name="token"' in form.text

        bad = http.post("/login", data={"token": "garbage", "next": "/"})
        assert bad.status_code == 401 and "not a JWT" in bad.text
        assert "set-cookie" not in bad.headers

        away = http.post("/login", data={"token": admin, "next": "//evil.example/"})
        assert away.status_code == 303 and away.headers["location"] == "/"
        cookie = away.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie and "path=/" in cookie
        assert "max-age=" in cookie

        page = http.get("/")  # the client keeps the cookie
        assert page.status_code == 200 and "Log out" in page.text
        # the API does not take the console's cookie: another site's page cannot use it
        assert http.get("/api/streams").status_code == 401

        out = http.post("/logout")
        assert out.status_code == 303 and out.headers["location"] == "/login"
        assert http.get("/").status_code == 303
    assert admin not in auth_broker.log()


def test_console_and_api_are_open_without_auth(broker_factory: BrokerFactory) -> None:
    broker = broker_factory().start()
    with httpx.Client(base_url=broker.http_url, timeout=10) as http:
        assert http.get("/").status_code == 200
        assert http.get("/api/streams").status_code == 200
        assert http.get("/login").status_code == 303
        refused = http.get("/api/tokens")
        assert refused.status_code == 400 and "--auth" in refused.json()["message"]

"""Authorization on a real broker with ``--auth``: a user token tries every request of the
binary protocol without permission (each refused with ``permission_denied``, nothing
changed, audited); the CLI (a clear message, exit code 1) and the HTTP API (403, typed
JSON) refuse the same way; after a grant the same operations go through; a token limited to
one scope is refused the others; an admin token may do everything.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from conftest import BrokerProcess
from raw import RawConnection, batch

import slipstream
from slipstream import PermissionDenied
from slipstream.protocol import (
    KINDS,
    AccessRule,
    Append,
    AppendAudit,
    ApplyBatch,
    BeginTxn,
    CheckAccess,
    ClaimProducer,
    CommitPositions,
    CreateStream,
    CreateSubscription,
    CreateToken,
    Credit,
    DeleteStream,
    DeleteSubscription,
    DescribeCluster,
    DescribeStream,
    DescribeSubscription,
    EndSeal,
    EndTxn,
    Error,
    FetchEvents,
    FindEvents,
    Follow,
    FollowFailed,
    GetCut,
    GetIdentity,
    GetScaleHistory,
    GrantRule,
    HandOverIdentity,
    Hello,
    HoldPositions,
    InitProducer,
    JoinGroup,
    LeaveGroup,
    ListIdentities,
    ListQuotas,
    ListRules,
    ListStreams,
    ListSubscriptions,
    ListTokens,
    ListTxns,
    Message,
    PollGroup,
    PrepareSeal,
    QuotaInfo,
    ReadSegment,
    ReleasePositions,
    ResetSubscription,
    RevokeRule,
    RevokeToken,
    ScaleStream,
    SetQuota,
    SettleEvents,
    StreamList,
    TxnPositions,
    Unfollow,
    UpdateStream,
    Welcome,
)

pytestmark = pytest.mark.timeout(180)

BrokerFactory = Callable[..., BrokerProcess]


def cli(*args: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ}
    env.pop("SLIPSTREAM_TOKEN", None)
    if token is not None:
        env["SLIPSTREAM_TOKEN"] = token
    return subprocess.run(
        [sys.executable, "-m", "slipstream", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


class TokenConnection(RawConnection):
    """A hand-driven protocol connection that authenticates with a token in its Hello."""

    def __init__(self, address: str, token: str) -> None:
        super().__init__(address, credentials={"token": token})
        assert isinstance(self.receive().message, Welcome)

    def send(self, message: Message, cid: int, payload: bytes = b"") -> None:
        self.send_frame(message, cid, payload)


@dataclass
class Setup:
    broker: BrokerProcess
    admin_token: str
    alice_token: str
    admin: slipstream.Client
    member: int  # the admin's consumer in demo/orders "sub"
    queue_member: int  # the admin's queue consumer in demo/orders "q"
    txn: int  # the admin's open anonymous transaction, staged into demo/orders

    def alice(self, token: str | None = None) -> slipstream.Client:
        return slipstream.connect(self.broker.address, token=token or self.alice_token)


def _member(admin: slipstream.Client, subscription: str) -> int:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        members = admin.describe_subscription("demo/orders", subscription).members
        if members:
            return members[0].member_id
        time.sleep(0.05)
    raise AssertionError("the admin's consumer never joined")


@pytest.fixture
def setup(broker_factory: BrokerFactory) -> Iterator[Setup]:
    broker = broker_factory("--auth").start()
    made = cli(
        "token",
        "create",
        "--data-dir",
        str(broker.data_dir),
        "--subject",
        "ops",
        "--role",
        "admin",
        "--json",
    )
    assert made.returncode == 0, made.stderr
    admin_token = json.loads(made.stdout)["token"]
    admin = slipstream.connect(broker.address, token=admin_token)
    for name in ("demo/orders", "demo/del", "prod/orders"):
        admin.create_stream(name, segments=1)
    with admin.producer("demo/orders") as producer:
        for i in range(3):
            producer.send(f"event {i}".encode(), key="k")
    admin.create_subscription("demo/orders", "sub")
    admin.create_subscription("demo/orders", "q", mode="queue")
    consumer = admin.consumer("demo/orders", "sub", commit="manual")
    queue_consumer = admin.consumer("demo/orders", "q")
    txn = admin.transaction(None, timeout=120)
    txn.send("demo/orders", b"staged", key="k")
    txn.flush()
    try:
        yield Setup(
            broker,
            admin_token,
            admin.create_token("alice").token,
            admin,
            _member(admin, "sub"),
            _member(admin, "q"),
            txn.txn_id,
        )
    finally:
        consumer.close()
        queue_consumer.close()
        admin.close()


def snapshot(admin: slipstream.Client) -> object:
    """What a refused request must not change (the audit stream aside: it records it)."""
    streams = [
        (s.name, s.epoch, s.retention_ms, [(g.number, g.end_offset) for g in s.segments])
        for s in admin.list_streams()
        if not s.name.startswith("_system/")
    ]
    subscriptions = [
        (sub.name, sub.generation, [(g.segment, g.position) for g in sub.segments])
        for sub in (admin.describe_subscription("demo/orders", name) for name in ("sub", "q"))
    ]
    txns = [(t.txn_id, t.state, t.events) for t in admin.transactions()]
    tokens = [(t.token_id, t.revoked) for t in admin.list_tokens()]
    return streams, subscriptions, txns, admin.rules(), tokens, admin.quotas()


def requests(s: Setup) -> dict[str, tuple[Message, bytes]]:
    """One request of every kind alice may not make, aimed at demo/orders."""
    rule = AccessRule("alice", "consume", "demo/*")
    return {
        "CreateStream": (CreateStream("demo/new", 1), b""),
        "DeleteStream": (DeleteStream("demo/del"), b""),
        "ListStreams": (ListStreams(None), b""),  # answered: an empty list (checked apart)
        "DescribeStream": (DescribeStream("demo/orders"), b""),
        "Append": (Append("demo/orders", 0), batch(2)),
        "GetCut": (GetCut("demo/orders", "earliest"), b""),
        "Follow": (Follow(7, "demo/orders", 0, 0, None, 1 << 20), b""),
        "InitProducer": (InitProducer("alice-tid"), b""),
        "BeginTxn": (BeginTxn(-1, -1, 60_000), b""),
        "EndTxn": (EndTxn(s.txn, True), b""),
        "EndTxn (operator)": (EndTxn(s.txn, False, operator=True), b""),
        "ListTxns": (ListTxns(), b""),
        "GetIdentity": (GetIdentity("spark:q"), b""),
        "ListIdentities": (ListIdentities("spark:"), b""),  # admin only
        "UpdateStream": (UpdateStream("demo/orders", 1000), b""),
        "CreateSubscription": (CreateSubscription("demo/orders", "new"), b""),
        "ListSubscriptions": (ListSubscriptions("demo/orders"), b""),
        "DescribeSubscription": (DescribeSubscription("demo/orders", "sub"), b""),
        "DeleteSubscription": (DeleteSubscription("demo/orders", "sub"), b""),
        "ResetSubscription": (ResetSubscription("demo/orders", "sub", "latest"), b""),
        "JoinGroup": (JoinGroup("demo/orders", "sub", "ordered", "alice", 10_000), b""),
        "PollGroup": (PollGroup(s.member, [], 0), b""),
        "CommitPositions": (CommitPositions("demo/orders", "sub", s.member, 1, {0: 3}), b""),
        "LeaveGroup": (LeaveGroup(s.member), b""),
        "FetchEvents": (FetchEvents(s.queue_member, 10, 0), b""),
        "SettleEvents": (SettleEvents(s.queue_member, [[0, 0]], [], 0), b""),
        "ScaleStream": (ScaleStream("demo/orders", [0], 2), b""),
        "GetScaleHistory": (GetScaleHistory("demo/orders"), b""),
        "FindEvents": (FindEvents("demo/orders", None), b""),
        "CreateToken": (CreateToken("alice", "admin"), b""),
        "RevokeToken": (RevokeToken("nope"), b""),
        "ListTokens": (ListTokens(), b""),
        "GrantRule": (GrantRule(rule), b""),
        "RevokeRule": (RevokeRule(rule), b""),
        "ListRules": (ListRules(), b""),
        "CheckAccess": (CheckAccess("alice", "consume", "demo/orders"), b""),
        "SetQuota": (SetQuota(QuotaInfo("demo", requests=1)), b""),
        "ListQuotas": (ListQuotas(), b""),
        "HandOverIdentity": (HandOverIdentity("spark:q", "alice"), b""),  # admin only
        "ReadSegment": (ReadSegment("demo/orders", 0, 0), b""),  # consume
        "ApplyBatch": (ApplyBatch("demo/orders", 0), batch(2)),  # brokers (admin) only
        "AppendAudit": (AppendAudit("b0"), b""),  # brokers (admin) only
        "PrepareSeal": (PrepareSeal("demo/orders", [0], 1, "b0"), b""),  # brokers only
        "EndSeal": (EndSeal("demo/orders", [0], 1, False), b""),  # brokers only
        "HoldPositions": (  # brokers (admin) only
            HoldPositions(1, 1, "", 5_000, TxnPositions("demo/orders", "sub", 1, 1, {0: 1})),
            b"",
        ),
        "ReleasePositions": (ReleasePositions(1, 0), b""),  # brokers (admin) only
    }


#: requests that are not refused for want of a rule, and why
NOT_REFUSED = {
    Hello: "the handshake",
    Credit: "more credit for a follow of this connection; no answer",
    Unfollow: "ends a follow of this connection",
    ClaimProducer: "proves with its HMAC token that this client was granted the id",
    DescribeCluster: "the routing map every client needs: brokers and containers, no stream",
}


def _denied_records(broker: BrokerProcess, subject: str) -> list[dict[str, Any]]:
    found = []
    for line in broker.log().splitlines():
        start = line.find('{"')
        if start < 0 or '"denied"' not in line:
            continue
        try:
            record = json.loads(line[start:])
        except json.JSONDecodeError:
            continue
        if record.get("event") == "denied" and record.get("subject") == subject:
            found.append({**record.get("details", {}), **record})
    return found


def test_every_request_without_permission_is_refused(setup: Setup) -> None:
    table = requests(setup)
    sent_kinds = {type(message) for message, _ in table.values()}
    all_requests = {kind for number, kind in KINDS.items() if number < 64}
    assert all_requests - sent_kinds - set(NOT_REFUSED) == set(), "add the new request kinds"

    before = snapshot(setup.admin)
    connection = TokenConnection(setup.broker.address, setup.alice_token)
    refused: dict[str, str] = {}
    try:
        for cid, (name, (message, payload)) in enumerate(table.items(), start=10):
            connection.send(message, cid, payload)
            reply = connection.receive().message
            if isinstance(reply, FollowFailed):  # a follow fails in its own frame
                refused[name] = reply.code
            elif isinstance(reply, Error):
                refused[name] = reply.code
                assert "slipstream acl grant alice" in reply.message or "admin" in reply.message
            else:
                assert isinstance(reply, StreamList), (name, reply)
                assert [s.name for s in reply.streams] == []
    finally:
        connection.close()
    expected = {name: "permission_denied" for name in table if name != "ListStreams"}
    assert refused == expected
    assert snapshot(setup.admin) == before
    records = _wait_for_records(setup.broker, "alice", len(expected))
    assert {r.get("stream") for r in records} >= {"demo/orders", None}


def _wait_for_records(broker: BrokerProcess, subject: str, count: int) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 10
    while True:
        records = _denied_records(broker, subject)
        if len(records) >= count or time.monotonic() > deadline:
            assert len(records) >= count, records
            return records
        time.sleep(0.1)


def test_the_client_raises_permission_denied_with_the_fix(setup: Setup) -> None:
    with setup.alice() as alice:
        assert alice.list_streams() == []
        with pytest.raises(PermissionDenied) as caught:
            alice.describe_stream("demo/orders")
        assert "alice may not act on demo/orders" in caught.value.message
        with pytest.raises(PermissionDenied, match="acl grant alice consume 'demo/orders'"):
            list(alice.reader("demo/orders", end=setup.admin.tail("demo/orders")))
        with pytest.raises(PermissionDenied):
            alice.grant("alice", "admin", "*")


def test_operations_go_through_after_a_grant_and_stop_after_a_revoke(setup: Setup) -> None:
    admin = setup.admin
    for action in ("produce", "consume", "manage"):
        admin.grant("alice", action, "demo/*")
    with setup.alice() as alice:
        assert [s.name for s in alice.list_streams()] == ["demo/del", "demo/orders"]
        alice.create_stream("demo/new", segments=1)
        with alice.producer("demo/new") as producer:
            producer.send(b"hello", key="k")
        events = list(alice.reader("demo/new", end=alice.tail("demo/new")))
        assert [e.value for e in events] == [b"hello"]
        assert [e.value for e in alice.find("demo/new", key="k")] == [b"hello"]
        alice.create_subscription("demo/new", "mine")
        with alice.consumer("demo/new", "mine", commit="manual") as consumer:
            first = next(iter(consumer))
            assert first.value == b"hello"
            consumer.commit()
        with alice.transaction("alice-tx") as txn:
            txn.send("demo/new", b"in a txn", key="k")
        assert alice.last_commit("alice-tx") is not None
        alice.reset_subscription("demo/new", "mine", "earliest")
        alice.delete_subscription("demo/new", "mine")
        alice.delete_stream("demo/new")
        with pytest.raises(PermissionDenied):  # another scope
            alice.describe_stream("prod/orders")
        with pytest.raises(PermissionDenied):  # the admin action is not granted
            alice.transactions()
        admin.revoke("alice", "produce", "demo/*")
        with (
            pytest.raises(PermissionDenied),  # the same connection: in force at once
            alice.producer("demo/orders") as producer,
        ):
            producer.send(b"no", key="k")
        admin.revoke("alice", "consume", "demo/*")
        with pytest.raises(PermissionDenied):  # describe goes through (manage); follow not
            list(alice.reader("demo/orders", end=admin.tail("demo/orders")))


def test_a_scoped_token_acts_only_in_its_scope(setup: Setup) -> None:
    admin = setup.admin
    admin.grant("alice", "consume", "*")
    scoped = admin.create_token("alice", scope="demo").token
    with setup.alice(scoped) as alice:
        assert [s.name for s in alice.list_streams()] == ["demo/del", "demo/orders"]
        alice.cut("demo/orders", "earliest")
        with pytest.raises(PermissionDenied, match="limited to scope 'demo'"):
            alice.cut("prod/orders", "earliest")
    with setup.alice() as unscoped:
        unscoped.cut("prod/orders", "earliest")


def test_an_admin_may_do_everything(setup: Setup) -> None:
    admin = setup.admin
    assert admin.check_access("ops", "manage", "prod/orders", role="admin").allowed
    admin.scale_stream("prod/orders", split=0)
    admin.abort_transaction(setup.txn)
    assert len(admin.list_streams()) >= 3
    admin.grant("*", "consume", "*/orders")
    assert [str(r.pattern) for r in admin.rules()] == ["*/orders"]
    decision = admin.check_access("bob", "consume", "prod/orders")
    assert decision.allowed and decision.rule == AccessRule("*", "consume", "*/orders")
    assert admin.revoke("*", "consume", "*/orders")
    assert not admin.revoke("*", "consume", "*/orders")


def test_acl_cli(setup: Setup) -> None:
    token, address = setup.admin_token, setup.broker.address
    describe = ("stream", "describe", "demo/orders", "--broker", address)
    denied = cli(*describe, token=setup.alice_token)
    assert denied.returncode == 1
    assert "alice may not act on demo/orders" in denied.stderr
    assert "slipstream acl grant alice" in denied.stderr
    grant = ("acl", "grant", "alice", "consume", "demo/*", "--broker", address)
    refused = cli(*grant, token=setup.alice_token)
    assert refused.returncode == 1 and "may not admin" in refused.stderr

    def acl(*args: str) -> subprocess.CompletedProcess[str]:
        return cli("acl", *args, "--broker", address, token=token)

    granted = acl("grant", "alice", "consume", "demo/*")
    assert granted.returncode == 0, granted.stderr
    assert "alice" in granted.stderr and "demo/*" in granted.stderr
    listed = acl("list", "--json")
    assert json.loads(listed.stdout) == [
        {"subject": "alice", "action": "consume", "pattern": "demo/*"}
    ]
    assert "demo/*" in acl("list").stdout
    check = acl("check", "alice", "consume", "demo/orders")
    assert check.returncode == 0 and "rule 'alice consume demo/*' allows it" in check.stdout
    check = acl("check", "alice", "manage", "demo/orders", "--json")
    assert check.returncode == 1
    assert json.loads(check.stdout) == {
        "allowed": False,
        "rule": None,
        "reason": "no rule allows alice to manage on demo/orders (default deny)",
    }
    bad = acl("grant", "alice", "read", "demo/*")
    assert bad.returncode == 1 and "unknown action 'read'" in bad.stderr
    bad = acl("grant", "alice", "consume", "demo")
    assert bad.returncode == 1 and "stream pattern 'demo'" in bad.stderr
    allowed = cli(*describe, token=setup.alice_token)
    assert allowed.returncode == 0, allowed.stderr
    assert acl("revoke", "alice", "consume", "demo/*").returncode == 0
    gone = acl("revoke", "alice", "consume", "demo/*")
    assert gone.returncode == 1 and "no rule" in gone.stderr


def test_http_api(setup: Setup) -> None:
    url = setup.broker.http_url

    def headers(token: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"}

    alice, admin = headers(setup.alice_token), headers(setup.admin_token)
    with httpx.Client(base_url=url, timeout=10) as http:
        assert http.get("/api/streams", headers=alice).json() == []
        denied = http.get("/api/streams/demo/orders", headers=alice)
        assert denied.status_code == 403
        assert denied.json()["error"] == "permission_denied"
        assert "slipstream acl grant alice" in denied.json()["message"]
        assert http.delete("/api/streams/demo/orders", headers=alice).status_code == 403
        body = {"subject": "alice", "action": "consume", "pattern": "demo/*"}
        assert http.post("/api/rules", json=body, headers=alice).status_code == 403
        assert http.get("/api/rules", headers=alice).status_code == 403
        granted = http.post("/api/rules", json=body, headers=admin)
        assert granted.status_code == 201 and granted.json() == body
        assert http.get("/api/rules", headers=admin).json() == [body]
        check = http.get(
            "/api/rules/check",
            params={"subject": "alice", "action": "consume", "stream": "demo/orders"},
            headers=admin,
        ).json()
        assert check == {
            "allowed": True,
            "rule": body,
            "reason": "rule 'alice consume demo/*' allows it",
        }
        assert http.get("/api/streams/demo/orders", headers=alice).status_code == 200
        assert http.delete("/api/streams/demo/orders", headers=alice).status_code == 403
        bad = http.post("/api/rules", json={**body, "pattern": "x"}, headers=admin)
        assert bad.status_code == 400 and bad.json()["error"] == "invalid_argument"
        metrics = http.get("/metrics", headers=alice)  # every stream's numbers: admin only
        assert metrics.status_code == 403 and metrics.json()["error"] == "permission_denied"
        assert http.get("/metrics", headers=admin).status_code == 200
        revoked = http.post("/api/rules/revoke", json=body, headers=admin)
        assert revoked.json() == {"revoked": True}
        assert http.get("/api/streams/demo/orders", headers=alice).status_code == 403

"""Transactional ids belong to the subject that first initialised them (``up --auth``): on a
real broker, tenant B, allowed to produce to its own streams, cannot initialise (fence),
claim, abort or read the last commit of tenant A's transactional id; A's open transaction
is not aborted and commits; an admin may, and hands the id over; ownership survives a
restart. Authentication off: nothing changes (the transaction tests).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from conftest import BrokerProcess
from raw import batch
from test_authz_broker import BrokerFactory, TokenConnection, _denied_records, cli

import slipstream
from slipstream import PermissionDenied
from slipstream.protocol import (
    Append,
    BeginTxn,
    ClaimProducer,
    EndTxn,
    Error,
    GetIdentity,
    HandOverIdentity,
    IdentityInfo,
    InitProducer,
    Message,
    ProducerGrant,
    TxnBegun,
    TxnEnded,
)

pytestmark = pytest.mark.timeout(180)

TID = "spark:alice-query"


@dataclass
class Tenants:
    broker: BrokerProcess
    admin: slipstream.Client
    alice_token: str
    bob_token: str


@pytest.fixture
def tenants(broker_factory: BrokerFactory) -> Iterator[Tenants]:
    broker = broker_factory("--auth").start()
    made = cli(
        "token", "create", "--data-dir", str(broker.data_dir), "--subject", "ops", "--role",
        "admin", "--json",
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    admin = slipstream.connect(broker.address, token=json.loads(made.stdout)["token"])
    for name in ("alice/orders", "bob/orders"):
        admin.create_stream(name, segments=1)
    admin.grant("alice", "produce", "alice/*")
    admin.grant("alice", "consume", "alice/*")
    admin.grant("bob", "produce", "bob/*")  # bob may produce: only ownership stops him
    try:
        yield Tenants(
            broker, admin, admin.create_token("alice").token, admin.create_token("bob").token
        )
    finally:
        admin.close()


def ask(connection: TokenConnection, message: Message, cid: int) -> Message:
    connection.send(message, cid)
    return connection.receive().message


def refused(reply: Message) -> str:
    assert isinstance(reply, Error), reply
    assert reply.code == "permission_denied", reply
    return reply.message


def test_another_tenant_cannot_fence_claim_abort_or_read_an_owned_id(tenants: Tenants) -> None:
    with slipstream.connect(tenants.broker.address, token=tenants.alice_token) as alice:
        txn = alice.transaction(TID, timeout=120)
        txn.send("alice/orders", b"alice's", key="k")
        txn.flush()
        txn_id = txn.txn_id
        raw_alice = TokenConnection(tenants.broker.address, tenants.alice_token)
        grant = ask(raw_alice, InitProducer("alice-2"), 2)
        raw_alice.close()
        assert isinstance(grant, ProducerGrant)

        bob = TokenConnection(tenants.broker.address, tenants.bob_token)
        try:
            message = refused(ask(bob, InitProducer(TID), 2))
            assert "belongs to alice" in message
            assert f"slipstream txn hand-over '{TID}' bob" in message
            refused(ask(bob, GetIdentity(TID), 3))
            # a producer token of alice's that leaked does not let bob claim her id either
            grant_claim = ClaimProducer(grant.producer_id, grant.epoch, grant.token)
            assert "belongs to alice" in refused(ask(bob, grant_claim, 4))
            refused(ask(bob, EndTxn(txn_id, False, operator=True), 5))
            not_owner = ask(bob, EndTxn(txn_id, False), 6)
            assert isinstance(not_owner, Error) and not_owner.code == "not_owner"
            refused(ask(bob, HandOverIdentity(TID, "bob"), 7))
            # bob's own ids work as before
            assert isinstance(ask(bob, InitProducer("spark:bob-query"), 8), ProducerGrant)
        finally:
            bob.close()
        with (
            slipstream.connect(tenants.broker.address, token=tenants.bob_token) as bob_client,
            pytest.raises(PermissionDenied, match="belongs to alice"),
        ):
            bob_client.last_commit(TID)

        # alice's transaction was neither fenced nor aborted: it commits
        assert [t.txn_id for t in tenants.admin.transactions() if t.state == "open"] == [txn_id]
        txn.commit({"batch": 1})
        last = alice.last_commit(TID)
        assert last is not None and last.metadata == {"batch": 1}
        with alice.transaction(TID) as again:  # and she re-initialises it as before
            again.send("alice/orders", b"more", key="k")

    records = [r for r in _denied_records(tenants.broker, "bob") if r.get("transactional_id")]
    assert {r["transactional_id"] for r in records} == {TID, "alice-2"}
    assert len(records) >= 3  # InitProducer, GetIdentity (twice), ClaimProducer


def test_an_admin_may_use_any_id_hand_it_over_and_ownership_survives_a_restart(
    tenants: Tenants,
) -> None:
    with slipstream.connect(tenants.broker.address, token=tenants.alice_token) as alice:
        with alice.transaction(TID) as txn:
            txn.send("alice/orders", b"a", key="k")
        with alice.transaction("alice:kept") as txn:
            txn.send("alice/orders", b"b", key="k")
    admin = tenants.admin
    assert admin.last_commit(TID) is not None
    with admin.transaction(TID) as txn:  # an admin may initialise (and fence) any id
        txn.send("bob/orders", b"by ops", key="k")

    with pytest.raises(PermissionDenied):
        slipstream.connect(tenants.broker.address, token=tenants.bob_token).last_commit(TID)
    done = cli("txn", "hand-over", TID, "bob", "--broker", tenants.broker.address, token=None)
    assert done.returncode == 1  # no token: refused
    token = admin.create_token("ops", "admin").token
    done = cli("txn", "hand-over", TID, "bob", "--broker", tenants.broker.address, token=token)
    assert done.returncode == 0, done.stderr
    assert "now belongs to bob" in done.stderr

    tenants.broker.restart()
    for subject_token, allowed, denied in (
        (tenants.bob_token, TID, "alice:kept"),
        (tenants.alice_token, "alice:kept", TID),
    ):
        connection = TokenConnection(tenants.broker.address, subject_token)
        try:
            assert isinstance(ask(connection, InitProducer(allowed), 2), ProducerGrant)
            assert isinstance(ask(connection, GetIdentity(allowed), 3), IdentityInfo)
            refused(ask(connection, InitProducer(denied), 4))
        finally:
            connection.close()
    # the hand-over of an id nobody initialised makes it the subject's before it starts
    with slipstream.connect(tenants.broker.address, token=token) as ops:
        ops.hand_over("spark:planned", "alice")
        with pytest.raises(slipstream.InvalidArgument):
            ops.hand_over("spark:planned", "*")
    bob = TokenConnection(tenants.broker.address, tenants.bob_token)
    try:
        refused(ask(bob, InitProducer("spark:planned"), 2))
    finally:
        bob.close()


def test_the_first_initialiser_wins_and_an_admin_hand_over_needs_no_restart(
    tenants: Tenants,
) -> None:
    bob = TokenConnection(tenants.broker.address, tenants.bob_token)
    alice = TokenConnection(tenants.broker.address, tenants.alice_token)
    admin = tenants.admin
    try:
        assert isinstance(ask(bob, InitProducer("shared"), 2), ProducerGrant)
        refused(ask(alice, InitProducer("shared"), 2))
        admin.hand_over("shared", "alice")
        assert isinstance(ask(alice, InitProducer("shared"), 3), ProducerGrant)
        refused(ask(bob, InitProducer("shared"), 3))
        assert isinstance(ask(alice, HandOverIdentity("x", "y"), 4), Error)
    finally:
        bob.close()
        alice.close()


def test_an_anonymous_transaction_is_shared_only_by_the_subject_that_began_it(
    tenants: Tenants,
) -> None:
    address = tenants.broker.address
    tenants.admin.create_stream("common/events", segments=1)
    tenants.admin.grant("*", "produce", "common/*")  # a stream both may write to
    with (
        slipstream.connect(address, token=tenants.alice_token) as alice,
        slipstream.connect(address, token=tenants.alice_token) as alice_task,
    ):
        task = alice_task.transaction(None, timeout=120)  # a Spark task's, on its own connection
        task.send("common/events", b"from a task", key="k")
        task.flush()
        bob = TokenConnection(address, tenants.bob_token)
        try:
            bob.send(Append("bob/orders", 0, task.txn_id), 2, batch(1))
            assert "alice began it" in refused(bob.receive().message)
            refused(ask(bob, EndTxn(task.txn_id, False), 3))
            mine = ask(bob, InitProducer("bob:merger"), 40)
            assert isinstance(mine, ProducerGrant)
            begun = ask(bob, BeginTxn(mine.producer_id, mine.epoch, 60_000), 4)
            assert isinstance(begun, TxnBegun)
            # bob may produce to every stream it staged into: only the subject check refuses
            assert "alice began it" in refused(
                ask(bob, EndTxn(begun.txn_id, True, merge=[task.txn_id]), 5)
            )
            not_refused = ask(bob, EndTxn(begun.txn_id, False), 6)  # his own: he may
            assert isinstance(not_refused, TxnEnded)
        finally:
            bob.close()
        # alice's other connection (the driver) merges it: nothing of bob's in it
        driver = alice.transaction(TID)
        driver.send("alice/orders", b"from the driver", key="k")
        assert driver.commit(merge=[task.txn_id]).committed
    for stream, value in (("alice/orders", b"from the driver"), ("common/events", b"from a task")):
        end = slipstream.StreamCut(stream, {0: 1})
        reader = tenants.admin.reader(stream, start="earliest", end=end)
        assert [e.value for e in reader] == [value]

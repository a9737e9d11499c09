"""Authorization in the service layer: every operation checks the right action on the right
stream (``Service._authorize``), for Callers carrying a Principal; an in-process broker.

The table ``OPERATIONS`` names every Service operation that takes a caller, with the action
it needs; ``test_every_operation_is_in_the_table`` fails when an operation is added without
a row. For each row: refused (PermissionDenied, audited, nothing changed) with no rule and
with rules for every other action; let through (whatever else it then answers) with a rule
for its action.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from raw import batch

from slipstream import PermissionDenied, SlipstreamError
from slipstream.broker import Broker, BrokerConfig, ContainerConfig
from slipstream.broker._segment import Segment
from slipstream.broker._service import Caller, Service
from slipstream.protocol import QuotaInfo, TxnPositions
from slipstream.security import Action, Principal, Role

ALICE = Principal("alice")
ADMIN = Principal("ops", Role.ADMIN)
ANY = None  # describing a stream: produce, consume or manage each allow it
SOMEWHERE = "somewhere"  # produce on some stream (the operation names none yet)


@asynccontextmanager
async def running(data_dir: Path) -> AsyncIterator[Broker]:
    broker = Broker(
        BrokerConfig(
            data_dir=data_dir, port=0, containers=2, container=ContainerConfig(roll_ms=600_000)
        )
    )
    ready = asyncio.Event()
    serving = asyncio.create_task(broker.serve(lambda _: ready.set()))
    waiting = asyncio.create_task(ready.wait())
    await asyncio.wait({serving, waiting}, return_when="FIRST_COMPLETED")
    if serving.done():
        waiting.cancel()
        serving.result()
    try:
        yield broker
    finally:
        broker.stop()
        await serving


@dataclass
class World:
    """What the operations under test act on, made by the admin."""

    service: Service
    admin: Caller
    segment: Segment
    member: int  # an ordered group's member (the admin's)
    queue_member: int  # a queue group's member (the admin's)
    txn: int  # an anonymous transaction with a batch staged into demo/orders


async def make_world(service: Service) -> World:
    admin = service.connect("admin", ADMIN)
    for name in ("demo/orders", "demo/del", "demo/scale"):
        await service.create_stream(admin, name, 1)
    future, _ = service.append(admin, "demo/orders", 0, None, bytearray(batch(3)))
    await future
    await service.create_subscription(admin, "demo/orders", "sub")
    await service.create_subscription(admin, "demo/orders", "del-sub")
    await service.create_subscription(admin, "demo/orders", "q", mode="queue")
    member, _ = service.join_group(admin, "demo/orders", "sub", "ordered", "m", 10_000)
    queue_member, _ = service.join_group(admin, "demo/orders", "q", "queue", "qm", 10_000)
    # an anonymous transaction is shared only by the subject that began it (test_txn_owners):
    # begun under alice's subject, so that what decides here is the actions' rules
    driver = service.connect("alice's driver", Principal("alice", Role.ADMIN))
    txn = await service.begin_txn(driver, -1, -1, 60_000)
    staged, _ = service.append(driver, "demo/orders", 0, txn, bytearray(batch(1)))
    await staged
    segment = service.segment(admin, "demo/orders", 0)
    return World(service, admin, segment, member, queue_member, txn)


Call = Callable[[World, Caller], Any]


def _append(w: World, c: Caller, txn: int | None = None) -> Any:
    return w.service.append(c, "demo/orders", 0, txn, bytearray(batch(1)))[0]


OPERATIONS: dict[str, tuple[Action | str | None, Call]] = {
    "create_stream": (Action.MANAGE, lambda w, c: w.service.create_stream(c, "demo/new", 1)),
    "update_stream": (
        Action.MANAGE,
        lambda w, c: w.service.update_stream(c, "demo/orders", retention_ms=3_600_000),
    ),
    "delete_stream": (Action.MANAGE, lambda w, c: w.service.delete_stream(c, "demo/del")),
    "scale_stream": (Action.MANAGE, lambda w, c: w.service.scale_stream(c, "demo/scale", [0])),
    "scale_history": (ANY, lambda w, c: w.service.scale_history(c, "demo/orders")),
    "describe_stream": (ANY, lambda w, c: w.service.describe_stream(c, "demo/orders")),
    "cut": (Action.CONSUME, lambda w, c: w.service.cut(c, "demo/orders", "earliest")),
    "stream_info": (ANY, lambda w, c: w.service.stream_info(c, "demo/orders")),
    "apply_batch": (
        Action.ADMIN,
        lambda w, c: w.service.apply_batch(c, "demo/orders", 0, 1, 0, bytearray()),
    ),
    "prepare_seal": (
        Action.ADMIN,
        lambda w, c: w.service.prepare_seal(c, "demo/orders", [0], 1, "b0", 1_000, 0.0),
    ),
    "end_seal": (
        Action.ADMIN,
        lambda w, c: w.service.end_seal(c, "demo/orders", [0], 1, False),
    ),
    "hold_positions": (
        Action.ADMIN,
        lambda w, c: w.service.hold_positions(
            c, 1, 1, "", 5_000, TxnPositions("demo/orders", "sub", w.member, 1, {0: 1})
        ),
    ),
    "release_positions": (Action.ADMIN, lambda w, c: w.service.release_positions(c, 1, 0)),
    "append": (Action.PRODUCE, _append),
    "append in a transaction": (Action.PRODUCE, lambda w, c: _append(w, c, w.txn)),
    "segment": (Action.CONSUME, lambda w, c: w.service.segment(c, "demo/orders", 0)),
    "read": (Action.CONSUME, lambda w, c: w.service.read(c, w.segment, 0, 1 << 20)),
    "read_segment": (
        Action.CONSUME,
        lambda w, c: w.service.read_segment(c, "demo/orders", 0, 0, 1 << 20),
    ),
    "find_events": (Action.CONSUME, lambda w, c: w.service.find_events(c, "demo/orders")),
    "browse_events": (Action.CONSUME, lambda w, c: w.service.browse_events(c, "demo/orders")),
    "init_producer": (SOMEWHERE, lambda w, c: w.service.init_producer(c, "tid")),
    "begin_txn": (SOMEWHERE, lambda w, c: w.service.begin_txn(c, -1, -1, 60_000)),
    "end_txn": (Action.PRODUCE, lambda w, c: w.service.end_txn(c, w.txn, True)),
    "end_txn with positions": (
        Action.CONSUME,  # with produce granted too: see _also
        lambda w, c: w.service.end_txn(
            c, w.txn, True, positions=[TxnPositions("demo/orders", "sub", w.member, 1, {0: 1})]
        ),
    ),
    "end_txn by an operator": (
        Action.ADMIN,
        lambda w, c: w.service.end_txn(c, w.txn, False, operator=True),
    ),
    "list_txns": (Action.ADMIN, lambda w, c: w.service.list_txns(c)),
    "identity": (SOMEWHERE, lambda w, c: w.service.identity(c, "tid")),
    "list_identities": (Action.ADMIN, lambda w, c: w.service.list_identities(c)),
    "hand_over_identity": (
        Action.ADMIN,
        lambda w, c: w.service.hand_over_identity(c, "tid", "bob"),
    ),
    "create_subscription": (
        Action.MANAGE,
        lambda w, c: w.service.create_subscription(c, "demo/orders", "new"),
    ),
    "list_subscriptions": (
        Action.CONSUME,
        lambda w, c: w.service.list_subscriptions(c, "demo/orders"),
    ),
    "describe_subscription": (
        Action.CONSUME,
        lambda w, c: w.service.describe_subscription(c, "demo/orders", "sub"),
    ),
    "delete_subscription": (
        Action.MANAGE,
        lambda w, c: w.service.delete_subscription(c, "demo/orders", "del-sub"),
    ),
    "reset_subscription": (
        Action.MANAGE,
        lambda w, c: w.service.reset_subscription(c, "demo/orders", "sub", "earliest"),
    ),
    "join_group": (
        Action.CONSUME,
        lambda w, c: w.service.join_group(c, "demo/orders", "sub", "ordered", "x", 10_000),
    ),
    "poll_group": (Action.CONSUME, lambda w, c: w.service.poll_group(c, w.member, [], 0)),
    "commit_positions": (
        Action.CONSUME,
        lambda w, c: w.service.commit_positions(c, "demo/orders", "sub", w.member, 1, {0: 1}),
    ),
    "leave_group": (Action.CONSUME, lambda w, c: w.service.leave_group(c, w.member)),
    "fetch_events": (Action.CONSUME, lambda w, c: w.service.fetch_events(c, w.queue_member, 1, 0)),
    "settle_events": (
        Action.CONSUME,
        lambda w, c: w.service.settle_events(c, w.queue_member, [[0, 0]], [], 0),
    ),
    "grant": (Action.ADMIN, lambda w, c: w.service.grant(c, "bob", "consume", "demo/*")),
    "revoke": (Action.ADMIN, lambda w, c: w.service.revoke(c, "bob", "consume", "demo/*")),
    "list_rules": (Action.ADMIN, lambda w, c: w.service.list_rules(c)),
    "check_access": (
        Action.ADMIN,
        lambda w, c: w.service.check_access(c, "bob", "consume", "demo/orders"),
    ),
    "create_token": (Action.ADMIN, lambda w, c: w.service.create_token(c, "bob")),
    "revoke_token": (Action.ADMIN, lambda w, c: w.service.revoke_token(c, "some-id")),
    "list_tokens": (Action.ADMIN, lambda w, c: w.service.list_tokens(c)),
    "set_quota": (Action.ADMIN, lambda w, c: w.service.set_quota(c, QuotaInfo("demo", requests=9))),
    "delete_quota": (Action.ADMIN, lambda w, c: w.service.delete_quota(c, "demo")),
    "list_quotas": (Action.ADMIN, lambda w, c: w.service.list_quotas(c)),
}

#: operations that need a second action besides the one under test to get through
_ALSO = {"end_txn with positions": Action.PRODUCE}

#: Service methods with a caller that are not authorized operations, and why
NOT_CHECKED = {
    "connect": "makes a caller",
    "disconnect": "forgets a caller",
    "authenticate": "sets the caller's principal",
    "claim_producer": "re-claims an id this client was granted (its HMAC token proves it)",
    "list_streams": "filters: test_listing_streams_shows_only_those_the_caller_may_act_on",
    "list_streams_live": "list_streams with live segments: the same filter",
    "authorize": "the check itself, for endpoints outside the operations (/metrics)",
    "admit": "counts a connection against its scope's quota",
    "quota_scope": "which scope's quota a request counts against",
}


async def call(op: Call, world: World, caller: Caller) -> None:
    result = op(world, caller)
    if inspect.isawaitable(result):
        await result


async def outcome(op: Call, world: World, caller: Caller) -> str:
    """'denied', or 'through' (it got past authorization: answered or failed otherwise)."""
    try:
        await asyncio.wait_for(call(op, world, caller), 5)
    except PermissionDenied:
        return "denied"
    except (SlipstreamError, TimeoutError):
        return "through"
    return "through"


def audit_records(caplog: pytest.LogCaptureFixture, event: str) -> list[dict[str, Any]]:
    """The audit records of ``event`` logged so far, their details beside their fields."""
    records = [
        json.loads(r.getMessage())
        for r in caplog.records
        if r.name == "slipstream.audit" and r.getMessage().startswith("{")
    ]
    return [{**r.get("details", {}), **r} for r in records if r["event"] == event]


async def snapshot(world: World) -> object:
    """What a refused request must not change (the audit stream aside: it records it)."""
    s, admin = world.service, world.admin
    streams = [
        (i.name, i.epoch, i.retention_ms, [(g.number, g.end_offset) for g in i.segments])
        for i in s.list_streams(admin)
        if not i.name.startswith("_system/")
    ]
    subscriptions = []
    for name, *_ in streams:
        for sub in s.list_subscriptions(admin, name):
            info = await s.describe_subscription(admin, name, sub.name)
            subscriptions.append(
                (
                    name,
                    info.name,
                    info.generation,
                    [(g.segment, g.position) for g in info.segments],
                    sorted(m.member_id for m in info.members),
                )
            )
    txns = [(t.txn_id, t.state, t.events) for t in s.list_txns(admin)]
    identities = [(i.transactional_id, i.epoch) for i in s.list_identities(admin)]
    return streams, subscriptions, txns, identities, sorted(s.subscriptions.members)


def test_every_operation_is_in_the_table() -> None:
    with_caller = {
        name
        for name, fn in inspect.getmembers(Service, inspect.isfunction)
        if not name.startswith("_") and "caller" in inspect.signature(fn).parameters
    }
    covered = {name.split(" ")[0] for name in OPERATIONS} | set(NOT_CHECKED)
    assert with_caller - covered == set(), "add the new operations to OPERATIONS"


def rule_pattern(action: Action) -> str:
    return "*" if action is Action.ADMIN else "demo/*"


def test_each_operation_is_refused_without_its_action(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="slipstream.audit")
    wrong: list[str] = []

    async def main() -> None:
        async with running(tmp_path / "data") as broker:
            service = broker.service
            world = await make_world(service)
            admin = world.admin
            for name, (needed, op) in OPERATIONS.items():
                others = [
                    a
                    for a in Action
                    if not (
                        a is needed
                        or (needed in (ANY, SOMEWHERE) and a is not Action.ADMIN)
                        or (needed is SOMEWHERE and a is Action.PRODUCE)
                    )
                ]
                if needed is ANY:
                    others = [Action.ADMIN]
                if needed is SOMEWHERE:
                    others = [a for a in Action if a is not Action.PRODUCE]
                if name in _ALSO:
                    await service.grant(admin, "alice", _ALSO[name], "demo/*")
                before = await snapshot(world)
                denied_before = len(audit_records(caplog, "denied"))
                if await outcome(op, world, service.connect("alice", ALICE)) != "denied":
                    wrong.append(f"{name}: allowed with no rule")
                if await snapshot(world) != before:
                    wrong.append(f"{name}: a refused call changed something")
                for other in others:
                    await service.grant(admin, "alice", other, rule_pattern(other))
                before = await snapshot(world)
                if await outcome(op, world, service.connect("alice", ALICE)) != "denied":
                    wrong.append(f"{name}: allowed by rules for {others}")
                if await snapshot(world) != before:
                    wrong.append(f"{name}: a refused call changed something")
                records = audit_records(caplog, "denied")[denied_before:]
                if len(records) != 2 or {r["subject"] for r in records} != {"alice"}:
                    wrong.append(f"{name}: audit records {records}")
                granted = (
                    [Action.CONSUME, Action.PRODUCE, Action.MANAGE]
                    if needed is ANY
                    else [Action.PRODUCE]
                    if needed is SOMEWHERE
                    else [needed]
                )
                for action in granted:
                    for rule in service.list_rules(admin):
                        await service.revoke(admin, rule.subject, rule.action, rule.pattern)
                    if name in _ALSO:
                        await service.grant(admin, "alice", _ALSO[name], "demo/*")
                    assert isinstance(action, Action)
                    await service.grant(admin, "alice", action, rule_pattern(action))
                    if await outcome(op, world, service.connect("alice", ALICE)) != "through":
                        wrong.append(f"{name}: refused with a rule for {action}")
                for rule in service.list_rules(admin):
                    await service.revoke(admin, rule.subject, rule.action, rule.pattern)
                if world.txn not in service.coordinator.open:  # ended by a row: a new one
                    world.txn = await service.begin_txn(admin, -1, -1, 60_000)
                    await service.append(admin, "demo/orders", 0, world.txn, bytearray(batch()))[0]

    asyncio.run(main())
    assert wrong == [], "\n".join(wrong)


def test_denial_message_names_who_what_and_the_grant(tmp_path: Path) -> None:
    async def main() -> None:
        async with running(tmp_path / "data") as broker:
            service = broker.service
            world = await make_world(service)
            with pytest.raises(PermissionDenied) as caught:
                await service.find_events(service.connect("a", ALICE), "demo/orders")
            message = caught.value.message
            del world
            assert "alice may not consume demo/orders" in message
            assert "slipstream acl grant alice consume 'demo/orders'" in message
            assert caught.value.details == {
                "subject": "alice",
                "action": "consume",
                "stream": "demo/orders",
            }

    asyncio.run(main())


def test_authentication_off_allows_everything(tmp_path: Path) -> None:
    async def main() -> None:
        async with running(tmp_path / "data") as broker:
            world = await make_world(broker.service)
            anonymous = broker.service.connect("anyone")  # principal None
            for name, (_, op) in OPERATIONS.items():
                assert await outcome(op, world, anonymous) == "through", name

    asyncio.run(main())


def test_listing_streams_shows_only_those_the_caller_may_act_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="slipstream.audit")

    async def main() -> None:
        async with running(tmp_path / "data") as broker:
            service = broker.service
            admin = service.connect("admin", ADMIN)
            for name in ("demo/a", "demo/b", "prod/a", "prod/b"):
                await service.create_stream(admin, name, 1)

            def names(principal: Principal, scope: str | None = None) -> list[str]:
                caller = service.connect("x", principal)
                return [s.name for s in service.list_streams(caller, scope)]

            denied = len(audit_records(caplog, "denied"))
            assert names(ALICE) == []
            assert len(audit_records(caplog, "denied")) == denied  # a filter, not a refusal
            await service.grant(admin, "alice", "consume", "demo/*")
            await service.grant(admin, "alice", "produce", "*/b")
            assert names(ALICE) == ["demo/a", "demo/b", "prod/b"]
            assert names(ALICE, "prod") == ["prod/b"]
            assert names(Principal("alice", scope="prod")) == ["prod/b"]
            await service.grant(admin, "alice", "admin", "*")  # not a stream action
            assert names(Principal("bob")) == []
            assert len(names(ADMIN)) == 4

    asyncio.run(main())


def test_a_token_scope_limits_whatever_the_rules_say(tmp_path: Path) -> None:
    async def main() -> None:
        async with running(tmp_path / "data") as broker:
            service = broker.service
            admin = service.connect("admin", ADMIN)
            for name in ("demo/a", "prod/a"):
                await service.create_stream(admin, name, 1)
            await service.grant(admin, "alice", "consume", "*")
            scoped = service.connect("x", Principal("alice", scope="demo"))
            await service.cut(scoped, "demo/a", "earliest")
            with pytest.raises(PermissionDenied, match="limited to scope 'demo'"):
                await service.cut(scoped, "prod/a", "earliest")
            scoped_admin = service.connect("x", Principal("ops", Role.ADMIN, scope="demo"))
            await service.delete_stream(scoped_admin, "demo/a")
            with pytest.raises(PermissionDenied):
                await service.delete_stream(scoped_admin, "prod/a")
            with pytest.raises(PermissionDenied):
                service.list_rules(scoped_admin)

    asyncio.run(main())


def test_revoking_takes_effect_at_once_also_for_open_reads(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="slipstream.audit")

    async def main() -> None:
        async with running(tmp_path / "data") as broker:
            service = broker.service
            world = await make_world(service)
            await service.grant(world.admin, "alice", "consume", "demo/*")
            alice = service.connect("x", ALICE)
            segment = service.segment(alice, "demo/orders", 0)  # a follow's segment
            assert await service.read(alice, segment, 0, 1 << 20)
            assert await service.revoke(world.admin, "alice", "consume", "demo/*")
            assert not await service.revoke(world.admin, "alice", "consume", "demo/*")
            with pytest.raises(PermissionDenied):
                await service.read(alice, segment, 0, 1 << 20)
            changes = audit_records(caplog, "rule_granted") + audit_records(caplog, "rule_revoked")
            assert [(r["event"], r["subject"], r["rule_subject"]) for r in changes] == [
                ("rule_granted", "ops", "alice"),
                ("rule_revoked", "ops", "alice"),
            ]

    asyncio.run(main())


def test_rules_are_durable_and_checked(tmp_path: Path) -> None:
    async def grant() -> None:
        async with running(tmp_path / "data") as broker:
            admin = broker.service.connect("admin", ADMIN)
            rule = await broker.service.grant(admin, "alice", "produce", "demo/*")
            assert str(rule) == "alice produce demo/*"
            await broker.service.grant(admin, "*", "consume", "*")

    async def check() -> None:
        async with running(tmp_path / "data") as broker:
            service = broker.service
            admin = service.connect("admin", ADMIN)
            assert [str(r) for r in service.list_rules(admin)] == [
                "* consume *",
                "alice produce demo/*",
            ]
            decision = service.check_access(admin, "alice", "produce", "demo/orders")
            assert decision.allowed and str(decision.rule) == "alice produce demo/*"
            decision = service.check_access(admin, "alice", "manage", "demo/orders")
            assert not decision.allowed and "default deny" in decision.reason
            decision = service.check_access(admin, "alice", "consume", "prod/x", scope="demo")
            assert not decision.allowed and "limited to scope" in decision.reason
            assert service.check_access(admin, "bob", "admin", "*", role="admin").allowed
            from slipstream import InvalidArgument, InvalidName

            with pytest.raises(InvalidArgument):
                await service.grant(admin, "alice", "read", "demo/*")
            with pytest.raises(InvalidArgument):
                await service.grant(admin, "alice", "consume", "demo")
            with pytest.raises(InvalidName):
                service.check_access(admin, "alice", "consume", "nonsense")

    asyncio.run(grant())
    asyncio.run(check())

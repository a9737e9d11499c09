"""Several brokers on one catalog: what one changes reaches the others at their next refresh.

``Controller.refresh`` (streams and segments), ``Service.reload_settings`` (revoked tokens,
rules, quotas, transactional-id owners) and ``Subscriptions.reload``. Two controllers, each
with its own containers and its own connection to one catalog (two SQLite connections to one
file, or two to one PostgreSQL database), stand for two brokers: A serves container 0, B
container 1. Then a broker serving in this process, whose catalog another connection changes
the way another broker's service would (the same MetaStore calls).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest
from objectstores import ACCESS_KEY, SECRET_KEY
from raw import batch
from test_container import Node, make_batch, run
from test_retention import RecordingChunkStore

import slipstream
from slipstream import (
    AuthenticationFailed,
    InvalidArgument,
    SegmentNotFound,
    SlipstreamError,
    StreamNotFound,
    SubscriptionNotFound,
    UnknownMember,
)
from slipstream.broker import Broker, BrokerConfig, ContainerConfig
from slipstream.broker._controller import Controller, build_segment
from slipstream.cluster import coordinator
from slipstream.security import Principal, Role, TokenKeys
from slipstream.security._quotas import Quota, encode_quota
from slipstream.security._rules import encode_rule, make_rule
from slipstream.storage import MemoryJournal, MetaStore, SqliteMetaStore, SubscriptionRecord

Catalog = Callable[[], MetaStore]
ADMIN = Principal("ops", Role.ADMIN)


@pytest.fixture(params=["sqlite", "postgres"])
def catalog(request: pytest.FixtureRequest, tmp_path: Path) -> Catalog:
    """Makes connections to one catalog."""
    if request.param == "sqlite":
        return lambda: SqliteMetaStore(tmp_path / "meta.db")
    from slipstream.storage._meta_pg import PostgresMetaStore

    dsn = request.getfixturevalue("pg_dsn")
    return lambda: PostgresMetaStore(dsn)


@asynccontextmanager
async def two_brokers(catalog: Catalog, root: Path) -> AsyncIterator[tuple[Node, Node]]:
    """A serves container 0, B container 1; one chunk directory (B's store records deletes)."""
    nodes = []
    for serves in (0, 1):
        node = Node(
            [MemoryJournal(), MemoryJournal()], catalog(), RecordingChunkStore(root / "chunks")
        )
        node.containers[1 - serves].serving = False  # the other broker's
        node.start()
        nodes.append(node)
    try:
        yield nodes[0], nodes[1]
    finally:
        for node in nodes:
            await node.close()
            node.meta.close()


def shape(controller: Controller) -> dict[str, Any]:
    """What every broker must agree on: streams, their settings and segment graphs."""
    return {
        name: (
            s.id,
            s.retention_ms,
            s.retention_bytes,
            s.scaling,
            s.created_ms,
            sorted(
                (
                    g.number,
                    g.epoch,
                    g.key_lo,
                    g.key_hi,
                    g.container,
                    g.sealed,
                    sorted(g.predecessors),
                    sorted(g.successors),
                )
                for g in s.segments.values()
            ),
        )
        for name, s in controller.streams.items()
    }


def check_registered(node: Node) -> None:
    """Every segment of every stream is in its container's map, and nothing else is."""
    live = {g.global_id: g for s in node.controller.streams.values() for g in s.segments.values()}
    held = {gid: g for c in node.containers for gid, g in c.segments.items()}
    assert held.keys() == live.keys()
    for gid, segment in held.items():
        assert segment is live[gid] and not segment.deleted
        assert node.containers[segment.container].segments[gid] is segment


def in_container(node: Node, stream: str, container: int) -> int:
    """The number of a segment of ``stream`` in ``container``."""
    segments = node.controller.stream(stream).segments.values()
    return next(g.number for g in segments if g.container == container)


def never_busy(_: object) -> bool:
    return False


def test_streams_created_changed_and_scaled_on_one_broker_appear_on_the_other(
    catalog: Catalog, tmp_path: Path
) -> None:
    async def body() -> None:
        async with two_brokers(catalog, tmp_path) as (a, b):
            assert await b.controller.refresh(), "the first refresh reads the catalog"
            assert not await b.controller.refresh(), "unchanged: nothing to do"
            await a.controller.create_stream("t/orders", 2, 60_000, None)
            assert await b.controller.refresh()
            assert shape(b.controller) == shape(a.controller)
            check_registered(b)
            assert not await b.controller.refresh()

            await a.controller.update_retention("t/orders", None, 1 << 30)
            await a.controller.update_scaling("t/orders", "events 1000/s factor 2 min 1 max 8")
            assert await b.controller.refresh()
            stream = b.controller.stream("t/orders")
            assert (stream.retention_ms, stream.retention_bytes) == (60_000, 1 << 30)
            assert stream.scaling == a.controller.stream("t/orders").scaling != ""

            # A scales its segment (in container 0) after 3 events; B follows that segment
            number = in_container(a, "t/orders", 0)
            assert await a.append("t/orders", number, make_batch(3, "x")) == 0
            sealed = b.controller.stream("t/orders").segments[number]
            woken = asyncio.create_task(sealed.wait_for_change())
            await a.controller.scale("t/orders", [number], 2, never_busy)
            assert await b.controller.refresh()
            await asyncio.wait_for(woken, 5)
            assert shape(b.controller) == shape(a.controller)
            check_registered(b)
            assert sealed is b.controller.stream("t/orders").segments[number]
            assert sealed.sealed and sealed.next_offset == 3, "sealed at A's end"
            assert b.controller.stream("t/orders").info().epoch == 1

    run(body())


def test_a_stream_created_elsewhere_starts_where_its_chunks_end(
    catalog: Catalog, tmp_path: Path
) -> None:
    async def body() -> None:
        async with two_brokers(catalog, tmp_path) as (a, b):
            await a.controller.create_stream("t/moved", 2, None, None)
            number = in_container(a, "t/moved", 0)
            await a.append("t/moved", number, make_batch(4, "m"))
            await a.roll_and_move(a.containers[0])
            await b.controller.refresh()
            segment = b.controller.stream("t/moved").segments[number]
            assert (segment.start_offset, segment.next_offset, segment.chunk_count) == (0, 4, 1)
            assert segment.bytes == a.controller.stream("t/moved").segments[number].bytes

    run(body())


def test_a_stream_deleted_elsewhere_leaves_memory_and_its_chunks_alone(
    catalog: Catalog, tmp_path: Path
) -> None:
    async def body() -> None:
        async with two_brokers(catalog, tmp_path) as (a, b):
            await a.controller.create_stream("t/gone", 2, None, None)
            await a.append("t/gone", in_container(a, "t/gone", 0), make_batch(2, "g"))
            await a.roll_and_move(a.containers[0])
            await b.controller.refresh()
            old = list(b.controller.stream("t/gone").segments.values())
            waiters = [asyncio.create_task(s.wait_for_change()) for s in old]
            await a.controller.delete_stream("t/gone")
            assert await b.controller.refresh()
            await asyncio.wait_for(asyncio.gather(*waiters), 5)
            with pytest.raises(StreamNotFound):
                b.controller.stream("t/gone")
            assert all(s.deleted for s in old)
            check_registered(b)
            assert b.long_term.deleted == [], "the deleting broker removes the chunks"  # type: ignore[attr-defined]
            assert a.long_term.deleted != []  # type: ignore[attr-defined]

    run(body())


def test_a_stream_recreated_elsewhere_under_its_name_replaces_the_old_one(
    catalog: Catalog, tmp_path: Path
) -> None:
    async def body() -> None:
        async with two_brokers(catalog, tmp_path) as (a, b):
            await a.controller.create_stream("t/again", 1, None, None)
            await b.controller.refresh()
            old = b.controller.stream("t/again")
            await a.controller.delete_stream("t/again")
            await a.controller.create_stream("t/again", 3, None, None)
            await b.controller.refresh()
            new = b.controller.stream("t/again")
            assert new.id == a.controller.stream("t/again").id != old.id
            assert len(new.segments) == 3
            assert all(s.deleted for s in old.segments.values())
            check_registered(b)
            assert shape(b.controller) == shape(a.controller)

    run(body())


def test_segments_this_broker_serves_keep_their_live_state(
    catalog: Catalog, tmp_path: Path
) -> None:
    async def body() -> None:
        async with two_brokers(catalog, tmp_path) as (a, b):
            await a.controller.create_stream("t/live", 2, None, None)
            await b.controller.refresh()
            number = in_container(b, "t/live", 1)  # B serves container 1
            served = b.controller.stream("t/live").segments[number]
            assert await b.append("t/live", number, make_batch(3, "b")) == 0
            journal = list(served.journal)
            # A changes the stream (its own, stale view seals the segment at 0)
            await a.controller.update_retention("t/live", 1000, None)
            await a.controller.create_stream("t/other", 1, None, None)
            await b.controller.refresh()
            assert b.controller.stream("t/live").segments[number] is served
            assert served.next_offset == 3 and served.journal == journal
            await a.controller.scale("t/live", [number], 2, never_busy)
            await b.controller.refresh()
            assert b.controller.stream("t/live").segments[number] is served
            assert b.containers[1].segments[served.global_id] is served
            assert served.sealed and served.next_offset == 3 and served.journal == journal
            assert await b.read_all("t/live", number) != []

    run(body())


def test_a_segment_object_a_takeover_put_in_its_container_is_kept(
    catalog: Catalog, tmp_path: Path
) -> None:
    async def body() -> None:
        async with two_brokers(catalog, tmp_path) as (a, b):
            await a.controller.create_stream("t/taken", 2, None, None)
            number = in_container(a, "t/taken", 1)
            (record,) = b.meta.streams()
            taken = build_segment(record, record.segments[number], None, 2)
            taken.next_offset = taken.pending_offset = 7  # what its journal recovered
            b.containers[1].segments[taken.global_id] = taken
            await b.controller.refresh()
            assert b.controller.stream("t/taken").segments[number] is taken
            check_registered(b)

    run(body())


def test_a_refresh_leaves_a_stream_that_is_scaling_here_to_the_next_one(
    catalog: Catalog, tmp_path: Path
) -> None:
    async def body() -> None:
        async with two_brokers(catalog, tmp_path) as (a, b):
            await a.controller.create_stream("t/busy", 1, None, None)
            await b.controller.refresh()
            stream = b.controller.stream("t/busy")
            await a.controller.update_retention("t/busy", 5000, None)
            async with stream.scale_lock:  # B's own scale under way
                assert await b.controller.refresh()
                assert stream.retention_ms is None
            assert await b.controller.refresh(), "read again: the version was not recorded"
            assert stream.retention_ms == 5000
            assert not await b.controller.refresh()

    run(body())


OPS = ("create", "delete", "recreate", "scale", "retention", "scaling", "refresh")


@pytest.mark.parametrize("seed", range(6))
def test_random_changes_on_both_brokers_converge(
    catalog: Catalog, tmp_path: Path, seed: int
) -> None:
    """Creates, deletes, scales and settings changes on either broker, some running at once
    with the other's refresh: after a last refresh on each, both agree with each other and
    with the catalog, and every container holds exactly its streams' segments."""
    rng = random.Random(seed)
    names = [f"t/s{i}" for i in range(4)]

    async def change(node: Node, op: str, name: str) -> None:
        controller = node.controller
        try:
            if op == "create":
                await controller.create_stream(name, rng.randint(1, 3), None, None)
            elif op == "delete":
                await controller.delete_stream(name)
            elif op == "recreate":
                await controller.delete_stream(name)
                await controller.create_stream(name, rng.randint(1, 3), None, None)
            elif op == "scale":
                stream = controller.stream(name)
                mine = [s.number for s in stream.segments.values() if not s.sealed]
                await controller.scale(name, [rng.choice(mine)], 2, never_busy)
            elif op == "retention":
                await controller.update_retention(name, rng.randint(1, 10**6), None)
            elif op == "scaling":
                await controller.update_scaling(name, rng.choice(["", "events 10/s min 1"]))
            else:
                await controller.refresh()
        except (StreamNotFound, SegmentNotFound, InvalidArgument):
            pass  # the other broker deleted or scaled it first, or exists already
        except Exception as exc:  # StreamExists: created by the other one first
            if type(exc).__name__ != "StreamExists":
                raise

    async def body() -> None:
        async with two_brokers(catalog, tmp_path) as (a, b):
            for _ in range(40):
                steps = [
                    change(rng.choice((a, b)), rng.choice(OPS), rng.choice(names))
                    for _ in range(rng.randint(1, 3))
                ]
                await asyncio.gather(*steps)
            for node in (a, b, a):
                await node.controller.refresh()
            assert shape(a.controller) == shape(b.controller)
            ids = {r.name: r.id for r in a.meta.streams()}
            assert {n: s.id for n, s in b.controller.streams.items()} == ids
            check_registered(a)
            check_registered(b)

    run(body())


# --- a serving broker whose catalog another broker changes -----------------------------------


def serving(data_dir: Path, *, auth: bool = False) -> AbstractAsyncContextManager[Broker]:
    """A standalone broker serving in this process on an ephemeral port."""
    return serving_config(
        BrokerConfig(
            data_dir=data_dir,
            port=0,
            containers=2,
            auth=auth,
            container=ContainerConfig(roll_ms=600_000),
        )
    )


@asynccontextmanager
async def serving_config(config: BrokerConfig) -> AsyncIterator[Broker]:
    """A broker serving in this process."""
    broker = Broker(config)
    ready = asyncio.Event()
    task = asyncio.create_task(broker.serve(lambda _: ready.set()))
    waiting = asyncio.create_task(ready.wait())
    await asyncio.wait({task, waiting}, return_when="FIRST_COMPLETED")
    if task.done():
        waiting.cancel()
        task.result()
    try:
        yield broker
    finally:
        broker.stop()
        await task


async def catch_up(broker: Broker) -> None:
    """What the broker does when the catalog changed: refresh, then reload the service."""
    await broker.controller.refresh()
    await broker.service.reload_settings()


def test_a_token_revoked_elsewhere_ends_its_connections_here(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(tmp_path, auth=True) as broker:
            keys = TokenKeys.load(tmp_path, create=False)
            alice = keys.issue("alice", "user")
            bob = keys.issue("bob", "user")
            address = "{}:{}".format(*broker.address)
            other = SqliteMetaStore(tmp_path / "meta.db")  # another broker's catalog connection
            try:
                async with (
                    slipstream.connect_async(address, token=alice.token, reconnect_timeout=0) as a,
                    slipstream.connect_async(address, token=bob.token, reconnect_timeout=0) as b,
                ):
                    await a.list_streams()
                    await b.list_streams()
                    revoked_at = msgspec.json.encode({"revoked_at": 1})
                    other.put_setting("revoked", alice.token_id, revoked_at)
                    await catch_up(broker)
                    assert alice.token_id in broker.service.revoked
                    assert alice.token_id not in broker.service._by_token
                    with pytest.raises(AuthenticationFailed, match="revoked"):
                        await a.list_streams()
                    await b.list_streams()  # another token's connection goes on
            finally:
                other.close()

    run(body())


def test_rules_quotas_and_transactional_id_owners_set_elsewhere_apply_here(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(tmp_path) as broker:
            service = broker.service
            other = SqliteMetaStore(tmp_path / "meta.db")
            try:
                rule = make_rule("alice", "produce", "demo/*")
                other.put_setting("rules", rule.key, encode_rule(rule))
                other.put_setting("quotas", "demo", encode_quota(Quota(produce_bytes=1000)))
                other.put_setting("txn-owners", "job-1", b"alice")
                version = service._rules_version
                await catch_up(broker)
                assert service.rules.rules == [rule] and service._rules_version > version
                quota = service.quotas.get("demo")
                assert quota is not None and quota.produce_bytes == 1000
                assert service._txn_owners == {"job-1": "alice"}

                other.delete_setting("rules", rule.key)
                other.delete_setting("quotas", "demo")
                await catch_up(broker)
                assert service.rules.rules == []
                assert service.quotas.get("demo") is None
            finally:
                other.close()

    run(body())


def test_subscriptions_changed_elsewhere_show_here(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(tmp_path) as broker:
            service = broker.service
            caller = service.connect("test")
            await service.create_stream(caller, "demo/orders", 1)
            future, _ = service.append(caller, "demo/orders", 0, None, bytearray(batch(5)))
            await future
            stream_id = broker.controller.stream("demo/orders").id
            other = SqliteMetaStore(tmp_path / "meta.db")
            try:
                other.create_subscription(
                    SubscriptionRecord(stream_id, "billing", "ordered", 1, {0: 1})
                )
                await catch_up(broker)
                listed = service.list_subscriptions(caller, "demo/orders")
                assert [s.name for s in listed] == ["billing"]
                info = await service.describe_subscription(caller, "demo/orders", "billing")
                assert info.segments[0].position == 1

                # committed elsewhere: no catalog change announced, describe reads it
                other.commit_positions(stream_id, "billing", 0, {0: 4})
                assert not await broker.controller.refresh()
                info = await service.describe_subscription(caller, "demo/orders", "billing")
                assert info.segments[0].position == 4

                member, generation = service.join_group(
                    caller, "demo/orders", "billing", "ordered", "m1", 10_000
                )
                assert generation == 0
                other.reset_subscription(stream_id, "billing", {0: 2})
                await catch_up(broker)
                assignment = await service.poll_group(caller, member, [], 0)
                assert assignment.generation == 1 and assignment.assigned == {0: 2}

                polling = asyncio.create_task(service.poll_group(caller, member, [], 5_000))
                await asyncio.sleep(0.05)  # the poll waits for a change
                other.delete_subscription(stream_id, "billing")
                await catch_up(broker)
                assert service.list_subscriptions(caller, "demo/orders") == []
                with pytest.raises(UnknownMember):  # as after a delete made here
                    await polling
                with pytest.raises(SubscriptionNotFound):
                    service.join_group(caller, "demo/orders", "billing", "ordered", "m1", 10_000)
            finally:
                other.close()

    run(body())


# --- two brokers in cluster mode, in this process ---------------------------------------------


async def eventually(check: Callable[[], Any], what: str) -> Any:
    """``check()``'s first result that raises nothing (the brokers' refresh runs every
    250 ms; the bound only keeps a broken broker from hanging the test)."""
    for _ in range(400):
        try:
            return check()
        except (AssertionError, SlipstreamError):
            await asyncio.sleep(0.05)
    return check()  # its error says what did not happen


def test_two_brokers_of_a_cluster_see_each_others_changes(
    tmp_path: Path, postgres: Any, seaweedfs: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    database = postgres.create_database()
    bucket = seaweedfs.create_bucket()

    def config(name: str) -> BrokerConfig:
        return BrokerConfig(
            data_dir=tmp_path / name,
            port=0,
            containers=2,
            auth=True,
            meta=postgres.dsn(database),
            objects=f"s3://{bucket}/cluster",
            s3_endpoint=seaweedfs.endpoint,
            journal="objects",
            broker_id=name,
            lease_ttl_ms=2000,
            container=ContainerConfig(roll_ms=600_000),
        )

    async def body() -> None:
        # one set of token keys for both: the cluster's, kept by the catalog
        async with serving_config(config("a")) as a, serving_config(config("b")) as b:
            admin_a = a.service.connect("test", ADMIN)
            admin_b = b.service.connect("test", ADMIN)
            await eventually(
                lambda: _check([c.serving for c in b.containers].count(True) == 1),
                "each broker serves one container",
            )
            await a.service.create_stream(admin_a, "demo/x", 2, retention_ms=60_000)
            info = await eventually(
                lambda: b.service.describe_stream(admin_b, "demo/x"), "created on B"
            )
            assert [s.number for s in info.segments] == [0, 1]
            await a.service.update_stream(admin_a, "demo/x", retention_ms=5_000)
            await eventually(
                lambda: _check(b.controller.stream("demo/x").retention_ms == 5_000),
                "retention",
            )
            mine = next(
                s.number
                for s in a.controller.stream("demo/x").segments.values()
                if a.containers[s.container].serving
            )
            await a.service.scale_stream(admin_a, "demo/x", [mine], 2)
            await eventually(
                lambda: _check(b.controller.stream("demo/x").segments[mine].sealed),
                "sealed on B",
            )
            assert len(b.controller.stream("demo/x").segments) == 4
            old = b.controller.stream("demo/x")
            await a.service.delete_stream(admin_a, "demo/x")
            await a.service.create_stream(admin_a, "demo/x", 1)
            await eventually(
                lambda: _check(b.controller.stream("demo/x").id != old.id), "re-created"
            )
            assert len(b.controller.stream("demo/x").segments) == 1
            assert all(s.deleted for s in old.segments.values())
            # a group is created on its coordinator's broker, listed by the other
            here = a.containers[coordinator("demo/x/billing", 2)].serving
            (maker, admin), (viewer, watcher) = (
                ((a, admin_a), (b, admin_b)) if here else ((b, admin_b), (a, admin_a))
            )
            await maker.service.create_subscription(admin, "demo/x", "billing")
            listed = await eventually(
                lambda: _nonempty(viewer.service.list_subscriptions(watcher, "demo/x")),
                "subscription on the other broker",
            )
            assert [s.name for s in listed] == ["billing"]

            # a token revoked on A ends its connection on B
            issued = await a.service.create_token(admin_a, "alice", "admin")
            token_id = issued.info.token_id
            address_b = "{}:{}".format(*b.address)
            async with slipstream.connect_async(
                address_b, token=issued.token, reconnect_timeout=0
            ) as client:
                await client.list_streams()
                assert token_id in b.service._by_token
                await a.service.revoke_token(admin_a, token_id)
                await eventually(lambda: _check(token_id not in b.service._by_token), "closed on B")
                with pytest.raises(AuthenticationFailed, match="revoked"):
                    await client.list_streams()

    run_long(body())


def _check(condition: bool) -> None:
    assert condition


def _nonempty(items: list[Any]) -> list[Any]:
    assert items
    return items


def run_long(coro: Any) -> None:
    """Run a cluster test body on a fresh loop, failing (not hanging) after 120 s."""
    asyncio.run(asyncio.wait_for(coro, 120))

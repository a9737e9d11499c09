"""Several brokers on one catalog (docs/cluster.md): who serves which container, and the loop
that keeps this broker's share of them.

A broker runs in a cluster when its journals, chunks and catalog are all shared (``--journal
objects --objects s3://... --meta postgresql://...``): then no state lives only on its disk and
any broker can serve any container. Each broker registers as a member in the catalog and,
every third of the lease ttl, renews its membership and its leases, reads the members and
leases, and computes the assignment (``slipstream.cluster.assign``: balanced, sticky, the same
on every broker). It takes the containers assigned to it that nobody holds (or whose lease
expired: a dead broker's), and hands over those it holds that are assigned to another live
broker. A broker that dies stops renewing; its containers are taken over once their leases
expire (``--lease-ttl``), from what the catalog and the object store hold.

Threads: everything here runs on the event loop, except catalog calls, which run one at a
time on the ``cluster`` thread. A container changes hands only on the loop: taken (lease, then
recovery on the cluster thread into fresh segments nobody else sees, then swapped in and
served) or handed over (not served, drained, stopped, lease released).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from .._errors import LeaseLost, SlipstreamError, WrongBroker
from ..cluster import assign, coordinator
from ..protocol import BrokerInfo, ClusterInfo
from ..storage import Lease, Member, MetaStore, StreamRecord
from ..storage._meta import SegmentChunks
from ._faults import FAULT, TAKE_PAUSE_S

if TYPE_CHECKING:
    from ._broker import Broker
    from ._container import Container
    from ._segment import Segment

log = logging.getLogger("slipstream.cluster")

#: how soon a broker looks again while a container assigned to it is being handed over
AWAITING_S = 0.1
#: the key of the member registration's landings (containers are 0..N-1)
MEMBER = -1
T = TypeVar("T")


class Cluster:
    """This broker's view of the cluster: the members and which holds each container.

    Standalone (``enabled`` False) the broker holds every container and nothing changes.
    In a cluster the view is refreshed every turn of the membership loop; ``owners`` may lag
    the catalog by one turn, which only makes a client ask once more."""

    def __init__(self, broker_id: str, containers: int, *, enabled: bool) -> None:
        self.broker_id = broker_id
        self.enabled = enabled
        self.count = containers
        self.owners: list[str] = [("" if enabled else broker_id)] * containers
        self.members: dict[str, Member] = {}
        self.address = ""
        self.http_address = ""
        self.started_ms = int(time.time() * 1000)

    def info(self, served: list[int]) -> ClusterInfo:
        """The map clients route by (DescribeCluster)."""
        owners = list(self.owners)
        for cid in served:
            owners[cid] = self.broker_id
        brokers = {
            member.broker_id: BrokerInfo(
                member.broker_id,
                member.address,
                member.http_address,
                [c for c, owner in enumerate(owners) if owner == member.broker_id],
                member.started_ms,
            )
            for member in self.members.values()
        }
        brokers[self.broker_id] = BrokerInfo(
            self.broker_id, self.address, self.http_address, sorted(served), self.started_ms
        )
        return ClusterInfo(self.count, [brokers[b] for b in sorted(brokers)], owners)

    def wrong_broker(self, container: int, what: str) -> WrongBroker:
        """The error for a request this broker cannot serve, naming who does (if known)."""
        owner = self.owners[container] or None
        if owner == self.broker_id:  # it was ours until a moment ago: moving now
            owner = None
        member = self.members.get(owner) if owner else None
        address = member.address if member is not None else None
        where = (
            f"broker {owner!r} at {address}"
            if owner and address
            else "another broker (it is moving: ask again shortly)"
        )
        return WrongBroker(
            f"{what} is in container {container}, served by {where}, not by this broker "
            f"({self.broker_id!r}); clients that know the cluster route there by themselves",
            container=container,
            owner=owner if address else None,
            address=address,
        )


class Membership:
    """The loop that keeps this broker a member and its share of the containers served."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.cluster = broker.cluster
        self.ttl_ms = broker.config.lease_ttl_ms
        self._io = ThreadPoolExecutor(1, thread_name_prefix="cluster")
        # a takeover's journal replay: long, so never on the thread that renews the leases
        self._recovery = ThreadPoolExecutor(1, thread_name_prefix="takeover")
        self.tasks: dict[int, asyncio.Task[None]] = {}  # served container -> its run task
        self.changing: set[int] = set()  # containers being taken or handed over
        self._takes: dict[int, asyncio.Task[None]] = {}  # takeovers under way, in the background
        self._taking: dict[int, Container] = {}  # their containers, once leased (renewed too)
        self._turns = asyncio.Lock()
        self.leaving = False
        self.awaiting: set[int] = set()  # assigned here, still held by another broker
        #: when the last renewal landed (time.monotonic()): MEMBER's registration, or a
        #: container's lease (from its acquisition), for the lateness metric
        self._landed: dict[int, float] = {}

    async def _call(self, call: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._io, call, *args)

    async def run(self) -> None:
        """Every third of the ttl: membership, leases, assignment. A turn that fails (the
        catalog unreachable) is logged and retried; containers whose leases cannot be renewed
        stop acknowledging by themselves when the lease runs out (Container.lease_error)."""
        log.info(
            "cluster member %r: lease ttl %d ms, renewed every %d ms",
            self.cluster.broker_id,
            self.ttl_ms,
            self.ttl_ms // 3,
        )
        while True:
            for cid, task in list(self.tasks.items()):
                if task.done():  # like a standalone broker: a dead container stops it
                    exc = task.exception() if not task.cancelled() else None
                    raise RuntimeError(f"container {cid} stopped: {exc}") from exc
            try:
                await self.turn()
            except (SlipstreamError, OSError) as exc:
                log.warning("cluster turn failed, retrying: %s", exc)
            # a container assigned here that its holder is handing over: look again soon,
            # so that it is served again within a fraction of a turn
            pause = self.ttl_ms / 3000
            await asyncio.sleep(min(pause, AWAITING_S) if self.awaiting else pause)

    async def turn(self) -> None:
        """One turn: renew, look, take and hand over (never while another turn or the
        leaving at a stop runs)."""
        async with self._turns:
            if not self.leaving:
                await self._turn()

    async def _turn(self) -> None:
        broker, cluster = self.broker, self.cluster
        me = await self._call(
            broker.meta.register_member,
            cluster.broker_id,
            cluster.address,
            cluster.http_address,
            self.ttl_ms,
        )
        self._renewed("member", MEMBER)
        await self._renew()
        now_ms = me.expires_ms - self.ttl_ms  # on the catalog's clock, like every expiry
        members, leases = await self._call(members_and_leases, broker.meta)
        cluster.members = {m.broker_id: m for m in members if m.broker_id != cluster.broker_id}
        holders = {
            lease.container: lease.owner
            for lease in leases
            if lease.expires_ms > now_ms and lease.container < cluster.count
        }
        for cid in range(cluster.count):
            cluster.owners[cid] = holders.get(cid, "")
        live = sorted({m.broker_id for m in members} | {cluster.broker_id})
        wanted = assign(cluster.count, live, holders)
        #: containers assigned here that another live broker still holds (handing them over)
        self.awaiting = {
            cid
            for cid, owner in wanted.items()
            if owner == cluster.broker_id and holders.get(cid) not in (None, cluster.broker_id)
        }
        for cid in range(cluster.count):
            if cid in self.changing:
                continue
            mine = wanted.get(cid) == cluster.broker_id
            if mine and cid not in self.tasks and holders.get(cid) in (None, cluster.broker_id):
                # in the background: the turns (and the renewals) go on while it recovers
                self.changing.add(cid)
                task = asyncio.get_running_loop().create_task(self.take(cid), name=f"take {cid}")
                self._takes[cid] = task
                task.add_done_callback(functools.partial(self._took, cid))
            elif not mine and cid in self.tasks and wanted.get(cid) in cluster.members:
                await self.hand_over(cid, f"assigned to broker {wanted[cid]!r}", to=wanted[cid])

    def _took(self, cid: int, _: asyncio.Task[None]) -> None:
        self._takes.pop(cid, None)

    async def _renew(self) -> None:
        """Renew the served containers' leases; a lease refused is lost: the container is
        handed back (not served, stopped) so that it can be taken again later."""
        broker = self.broker
        held = {cid: broker.containers[cid] for cid in self.tasks if cid not in self.changing}
        held.update(self._taking)  # a takeover's recovery may outlast the ttl
        for cid, container in held.items():
            lease = container.lease
            if lease is None:
                continue
            if container.lease_lost is not None:  # found lost since (an append, a fetch)
                if cid not in self._taking:  # (a takeover gives up by itself)
                    await self.hand_over(cid, f"lease lost: {container.lease_lost}", release=False)
                continue
            asked = time.monotonic()
            try:
                renewed = await self._call(broker.meta.renew_lease, lease, self.ttl_ms)
            except LeaseLost as exc:
                self._landed.pop(cid, None)
                container.lose(str(exc))
                if cid not in self._taking:  # (a takeover gives up by itself)
                    await self.hand_over(cid, f"lease lost: {exc}", release=False)
                continue
            container.hold(renewed, asked + self.ttl_ms / 1000)
            self._renewed("lease", cid)

    def _renewed(self, renewal: str, key: int) -> None:
        """A renewal (``renewal``: "member" or "lease", ``key``: MEMBER or the container)
        landed now: observe how late, after the previous one's landing plus a third of the
        ttl (the schedule; two thirds later still, the catalog lets it expire)."""
        now = time.monotonic()
        last = self._landed.get(key)
        self._landed[key] = now
        if last is not None:
            lateness = now - last - self.ttl_ms / 3000
            self.broker.metrics.renewed(renewal, lateness)
            # (bench/takeover.py reads these)
            log.debug("%s renewal %d landed %+.3f s from its schedule", renewal, key, lateness)
            if lateness > self.ttl_ms / 3000:  # half the margin gone: the loop or catalog lags
                log.warning(
                    "%s renewal%s landed %.1f s late; at %.1f s late it expires and another "
                    "broker takes over (--lease-ttl)",
                    renewal,
                    "" if key == MEMBER else f" of container {key}",
                    lateness,
                    self.ttl_ms / 1500,
                )

    async def take(self, cid: int) -> None:
        """Lease container ``cid``, recover it from the catalog and its journal objects into
        fresh segments, swap them in and serve it. Nothing is served until all of that is
        done; a failure releases the lease and leaves the container to the next turn."""
        broker = self.broker
        self.changing.add(cid)  # (the turn that started it added it already)
        lease: Lease | None = None
        try:
            asked = time.monotonic()
            lease = await self._call(
                broker.meta.acquire_lease, cid, self.cluster.broker_id, self.ttl_ms
            )
            if lease is None:  # someone else was faster
                return
            started = self._landed[cid] = time.monotonic()
            container = broker.new_container(cid)
            container.hold(lease, asked + self.ttl_ms / 1000)
            self._taking[cid] = container
            await broker.refresh_catalog()  # the streams as they are now, before swapping in
            records, chunks = await self._call(_container_catalog, broker.meta, cid)
            if FAULT == "cluster.take_pause":  # tests: a stream is created meanwhile
                log.warning(
                    "fault injection: takeover of container %d paused after its catalog read", cid
                )
                await asyncio.sleep(TAKE_PAUSE_S)
            segments = broker.controller.fresh_segments(records, chunks, cid)
            container.segments = {s.global_id: s for s in segments}
            loop = asyncio.get_running_loop()
            totals = await loop.run_in_executor(self._recovery, container.recover)
            if container.lease_error() is not None:  # expired or taken while it recovered
                raise LeaseLost(f"container {cid}: lease lost during its takeover")
            lease = container.lease or lease  # as last renewed
            # the groups it coordinates, from the catalog (under this lease no older holder
            # writes there), before a group request can find the container served; their
            # holds for commits elsewhere removed first: a record not stored by then never is
            await self._call(broker.meta.remove_holds_of, cid)
            await broker.service.subscriptions.adopt(self._coordinated_by(cid))
            old = broker.containers[cid]
            broker.controller.swap_in(container, records, segments)
            _retire(old)
            # the transactions it coordinates: staging journal and commits to apply (these
            # in the background, once it serves)
            await broker.coordinator.adopt(cid, lease, self.cluster.count)
            container.serving = True
            self.tasks[cid] = asyncio.get_running_loop().create_task(
                broker.run_container(container), name=f"container {cid}"
            )
            self.cluster.owners[cid] = self.cluster.broker_id
            log.info(
                "container %d taken (lease epoch %d): %d segments, %d journal batches "
                "recovered in %d ms",
                cid,
                lease.epoch,
                len(segments),
                totals["batches"],
                (time.monotonic() - started) * 1000,
            )
            lease = None  # served: kept
        except (SlipstreamError, OSError) as exc:
            log.warning("container %d not taken: %s", cid, exc)
        finally:
            self._taking.pop(cid, None)
            if lease is not None:
                self._landed.pop(cid, None)
                try:
                    await self._call(broker.meta.release_lease, lease)
                except SlipstreamError as exc:
                    log.warning("container %d: lease not released: %s", cid, exc)
            self.changing.discard(cid)

    async def hand_over(self, cid: int, why: str, *, release: bool = True, to: str = "") -> None:
        """Stop serving container ``cid``: refuse new appends and follows (WrongBroker),
        wait until everything it acknowledged is durable (it already is: an append is
        acknowledged only once durable, so this waits for the appends still queued), stop
        its tasks and release its lease so that the assigned broker takes it at once."""
        broker = self.broker
        container = broker.containers[cid]
        self.changing.add(cid)
        try:
            container.serving = False
            await broker.coordinator.release(cid)  # its open transactions abort
            broker.service.subscriptions.release(self._coordinated_by(cid))  # members rejoin
            for segment in container.segments.values():
                segment.notify()  # follows at the end wake up and fail with WrongBroker
            await container.drain()
            task = self.tasks.pop(cid, None)
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            await container.close()
            lease = container.lease
            if release and lease is not None and container.lease_lost is None:
                try:
                    await self._call(broker.meta.release_lease, lease)
                except SlipstreamError as exc:  # it expires by itself
                    log.warning("container %d: lease not released: %s", cid, exc)
            self._landed.pop(cid, None)
            self.cluster.owners[cid] = to  # who takes it next, if known (a hint until then)
            log.info("container %d handed over: %s", cid, why)
        finally:
            self.changing.discard(cid)

    def _coordinated_by(self, cid: int) -> Callable[[str], bool]:
        """Whether container ``cid`` coordinates a key ("stream/name", a transactional id)."""
        count = self.cluster.count
        return lambda key: coordinator(key, count) == cid

    async def settled(self) -> None:
        """Return once the takeovers under way have ended (taken, or given up)."""
        await asyncio.gather(*list(self._takes.values()), return_exceptions=True)

    async def leave(self) -> None:
        """A clean stop: hand every container over and leave the members, so that the
        others take them at once instead of after the ttl."""
        async with self._turns:
            self.leaving = True
            await self.settled()
            await self._leave()
        self._io.shutdown(wait=False)
        self._recovery.shutdown(wait=False)

    async def _leave(self) -> None:
        for cid in list(self.tasks):
            try:
                await self.hand_over(cid, "this broker is stopping")
            except Exception:
                log.exception("container %d: hand-over at stop failed", cid)
        try:
            await self._call(self.broker.meta.remove_member, self.cluster.broker_id)
        except SlipstreamError as exc:
            log.warning("not removed from the members (it expires by itself): %s", exc)


def members_and_leases(meta: MetaStore) -> tuple[list[Member], list[Lease]]:
    """The live members and every container's last lease."""
    return meta.members(), meta.leases()


def _container_catalog(
    meta: MetaStore, cid: int
) -> tuple[list[StreamRecord], dict[tuple[int, int], SegmentChunks]]:
    """The catalog's streams with a segment in container ``cid``, and those segments'
    chunk totals (read on the cluster thread)."""
    records = [r for r in meta.streams() if any(s.container == cid for s in r.segments)]
    ids = {r.id for r in records}
    chunks = {(c.stream_id, c.segment): c for c in meta.segment_chunks() if c.stream_id in ids}
    return records, chunks


def _retire(container: Container) -> None:
    """The container object a takeover replaced: its segments are no longer live."""
    segments: dict[int, Segment] = container.segments
    for segment in segments.values():
        segment.notify()

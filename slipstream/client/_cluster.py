"""The client's view of a cluster (issue 20): which broker serves which container, and one
connection per broker.

A client starts from a bootstrap list (``"h1:7070,h2:7070"``): it dials the addresses in
order, skipping dead ones, and asks the first that answers ``DescribeCluster`` for the map
(container -> owning broker -> address). A standalone broker names itself as the owner of
every container, and one too old to know the request is taken for standalone: one code path
serves one broker and many.

Routing (``Target``): a container number goes to the broker holding its lease (a segment's
appends and follows, a subscription group's or a transactional id's coordinator); an address
goes to that broker (an anonymous transaction stays where it began); None goes to any live
broker. A broker that does not serve a container refuses with WrongBroker, naming the owner
when it knows it: the map learns that, or is described again (never two descriptions at once,
at most one per ``REFRESH_INTERVAL``), and the request is sent again there; nothing of a
refused request was done, so that is safe for every request.

Failure: a broker that cannot be reached is retried with backoff, the map described again
from any other live broker (or the bootstrap list), until ``reconnect_timeout`` passes; then
the last BrokerUnavailable is raised. A container nobody serves (its broker died and the lease
has not run out yet) is waited for the same way.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from .._errors import (
    BrokerUnavailable,
    InvalidArgument,
    PermissionDenied,
    ProtocolError,
    SlipstreamError,
    WrongBroker,
)
from ..cluster import coordinator
from ..protocol import ClusterInfo, DescribeCluster, Message
from ._connection import Connection, parse_address

#: A request's destination: a container (its owner), a broker address, or None (any broker).
Target = int | str | None
#: At most one DescribeCluster per this many seconds (a burst of WrongBroker answers, or a
#: dead broker, asks once).
REFRESH_INTERVAL = 0.1
_MAX_DELAY = 1.0


def split_addresses(address: str) -> list[str]:
    """``"h1:7070, h2:7070"`` -> ``["h1:7070", "h2:7070"]``, each checked (InvalidArgument
    names the bad one); duplicates are dropped, the order kept."""
    parts: list[str] = []
    for part in address.split(","):
        part = part.strip()
        if part and part not in parts:
            parse_address(part)
            parts.append(part)
    if not parts:
        raise InvalidArgument(
            f"broker address {address!r} must look like 127.0.0.1:7070 or h1:7070,h2:7070"
        )
    return parts


class Cluster:
    """The map and the connections of one client; runs on the client's loop.

    ``prepare`` is awaited with every connection before it is handed out (the client claims
    its producer ids there: brokers of a cluster share the claim tokens' key); it must be
    cheap when there is nothing new to claim.
    """

    def __init__(
        self,
        bootstrap: list[str],
        *,
        timeout: float,
        reconnect_timeout: float,
        tls: ssl.SSLContext | None,
        token: str | None,
        prepare: Callable[[Connection], Awaitable[None]] | None = None,
    ) -> None:
        self.bootstrap = bootstrap
        self.timeout = timeout
        self.reconnect_timeout = reconnect_timeout
        self.tls = tls
        self.token = token
        self.prepare = prepare
        self.connections: dict[str, Connection] = {}
        self._opening: dict[str, asyncio.Task[Connection]] = {}
        self.primary = bootstrap[0]
        self.containers = 1
        #: container -> the address of the broker serving it (None: unknown, or moving)
        self.owners: list[str | None] = [bootstrap[0]]
        #: broker id -> address, of the live brokers last described
        self.brokers: dict[str, str] = {}
        self.standalone = True
        self._refreshing: asyncio.Task[None] | None = None
        self._refreshed_at = -REFRESH_INTERVAL
        self.refreshes = 0
        #: WrongBroker answers taken in (containers found moved), over the client's life
        self.moves = 0
        self.closed = False

    # --- start and map ---------------------------------------------------------------------

    async def start(self) -> Connection:
        """Dial the bootstrap addresses in order, the first that answers becomes the primary
        connection; then describe the cluster through it. A dead address is skipped; other
        failures (TLS, authentication) raise at once: the next address would fail alike.
        With every address dead, raises BrokerUnavailable (the one address's own error, or
        one naming them all)."""
        failures: list[BrokerUnavailable] = []
        for address in self.bootstrap:
            try:
                connection = await self._open(address)
            except BrokerUnavailable as exc:
                failures.append(exc)
                continue
            self.primary = address
            try:
                await self._describe(connection)
            except BaseException:
                connection.close()  # an open transport would hold the client's loop open
                raise
            return connection
        if len(failures) == 1:
            raise failures[0]
        raise BrokerUnavailable(
            f"no broker answered at any of {', '.join(self.bootstrap)}: "
            + "; ".join(f.message for f in failures),
            addresses=self.bootstrap,
        )

    async def _describe(self, connection: Connection) -> None:
        try:
            reply, _ = await connection.request(DescribeCluster())
        except (ProtocolError, PermissionDenied):  # an older broker: standalone
            self._apply_standalone(connection.address)
            return
        assert isinstance(reply, ClusterInfo)
        self.apply(reply, connection.address)

    def _apply_standalone(self, address: str) -> None:
        self.standalone = True
        self.containers = 1
        self.owners = [address]
        self.brokers = {}

    def apply(self, info: ClusterInfo, answered_by: str) -> None:
        """Take a ClusterInfo as the map. A cluster of one broker is reached at the address
        it was dialled at (a standalone broker may advertise the address it binds, 0.0.0.0)."""
        brokers = {b.broker_id: b.address for b in info.brokers if b.address}
        if len(info.brokers) <= 1:
            brokers = {b.broker_id: answered_by for b in info.brokers}
        self.standalone = len(info.brokers) <= 1
        self.containers = max(1, info.containers)
        owners: list[str | None] = [brokers.get(o) if o else None for o in info.owners]
        owners += [None] * (self.containers - len(owners))
        if self.standalone:
            owners = [answered_by] * self.containers
        self.owners = owners[: self.containers]
        self.brokers = brokers

    def coordinator(self, key: str) -> int:
        """The container coordinating ``key`` ("stream/name" of a subscription, or a
        transactional id)."""
        return coordinator(key, self.containers)

    def learn(self, details: Mapping[str, Any]) -> None:
        """Take what a WrongBroker said about a container's owner (None: nobody serves it)."""
        container = details.get("container")
        if not isinstance(container, int) or not 0 <= container < self.containers:
            return
        address = details.get("address")
        self.moves += 1
        self.owners[container] = address if isinstance(address, str) and address else None
        owner = details.get("owner")
        if isinstance(owner, str) and owner and self.owners[container] is not None:
            self.brokers[owner] = self.owners[container]  # type: ignore[assignment]

    async def refresh(self) -> None:
        """Describe the cluster again from any live broker (known ones first, then the
        bootstrap list); waits for a description already under way instead of asking twice.
        Leaves the map as it is when no broker answers (callers retry until their deadline)."""
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.get_running_loop().create_task(self._refresh())
        await asyncio.shield(self._refreshing)

    async def _refresh(self) -> None:
        wait = self._refreshed_at + REFRESH_INTERVAL - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        try:
            for address in self._candidates(live_first=True):
                try:
                    connection = await self.connection(address, prepared=False)
                    await self._describe(connection)
                except (BrokerUnavailable, WrongBroker):
                    continue
                self.refreshes += 1
                return
        finally:
            self._refreshed_at = time.monotonic()

    def _candidates(self, live_first: bool = False) -> list[str]:
        """Every address worth trying: the primary, the brokers of the map, the bootstrap
        list; those with a live connection first if ``live_first``."""
        seen: list[str] = []
        for address in (self.primary, *self.brokers.values(), *self.bootstrap):
            if address not in seen:
                seen.append(address)
        if live_first:
            seen.sort(key=lambda a: self.cached_at(a) is None)
        return seen

    # --- connections -----------------------------------------------------------------------

    def cached_at(self, address: str) -> Connection | None:
        connection = self.connections.get(address)
        return connection if connection is not None and connection.closed is None else None

    def cached(self, target: Target) -> Connection | None:
        """The live connection for ``target`` if one is open (no I/O), else None."""
        if target is None:
            return self.cached_at(self.primary)
        if isinstance(target, str):
            return self.cached_at(target)
        address = self.owners[target % self.containers]
        return None if address is None else self.cached_at(address)

    async def connection(self, address: str, *, prepared: bool = True) -> Connection:
        """The connection to ``address``, opened if there is none (one dial at a time per
        address). Raises BrokerUnavailable (or TlsError, AuthenticationFailed) when it
        cannot be opened."""
        connection = self.cached_at(address)
        if connection is None:
            task = self._opening.get(address)
            if task is None or task.done():
                task = self._opening[address] = asyncio.get_running_loop().create_task(
                    self._open(address)
                )
            connection = await asyncio.shield(task)
        if prepared and self.prepare is not None:
            await self.prepare(connection)
        return connection

    async def _open(self, address: str) -> Connection:
        if self.closed:
            raise BrokerUnavailable("the client is closed", address=address)
        connection = await Connection.open(
            address, timeout=self.timeout, tls=self.tls, token=self.token
        )
        old = self.connections.get(address)
        if old is not None and old is not connection:
            old.close()
        self.connections[address] = connection
        return connection

    async def reach(self, target: Target) -> Connection:
        """A live connection for ``target``: dialled, the map described again, with backoff,
        until ``reconnect_timeout``; then raises the last BrokerUnavailable."""
        deadline = time.monotonic() + self.reconnect_timeout
        delay = 0.05
        while True:
            try:
                return await self._reach_once(target)
            except BrokerUnavailable:
                if self.closed or time.monotonic() + delay > deadline:
                    raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, _MAX_DELAY)

    async def _reach_once(self, target: Target) -> Connection:
        if isinstance(target, str):
            return await self.connection(target)
        if target is None:
            last: BrokerUnavailable | None = None
            for address in self._candidates(live_first=True):
                try:
                    connection = await self.connection(address)
                except BrokerUnavailable as exc:
                    last = exc
                    continue
                self.primary = address
                return connection
            assert last is not None
            raise last
        container = target % self.containers
        owner = self.owners[container]
        if owner is None:
            await self.refresh()
            owner = self.owners[container]
        if owner is None:
            raise BrokerUnavailable(
                f"no broker serves container {container} right now (it is moving to another "
                "broker); retrying",
                container=container,
            )
        try:
            return await self.connection(owner)
        except BrokerUnavailable:
            if self.owners[container] == owner:
                self.owners[container] = None  # described again on the next try
            await self.refresh()
            raise

    async def request(self, message: Message, target: Target = None) -> tuple[Message, Connection]:
        """Send ``message`` to the broker for ``target``; the reply and the connection that
        answered. A WrongBroker answer (the container is served elsewhere, or moving) sends it
        again to the owner it names at once, or, while nobody serves the container (or the
        broker that answered names itself), after a backoff and describing the cluster again,
        for up to ``reconnect_timeout``: nothing of a refused request was done. A request
        whose connection is lost is not sent again (it may have been done)."""
        deadline = time.monotonic() + self.reconnect_timeout
        delay = 0.02
        while True:
            connection = await self.reach(target)
            try:
                reply, _ = await connection.request(message)
                return reply, connection
            except WrongBroker as exc:
                self.learn(exc.details)
                container = exc.details.get("container")
                if isinstance(container, int):
                    target = container
                if time.monotonic() + delay > deadline:
                    raise
                named = exc.details.get("address")
                # nobody serves it, or the broker that answered names itself (it holds the
                # container but does not serve it yet: taking it): wait, describe again
                if not named or named == connection.address:
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, _MAX_DELAY)
                    await self.refresh()

    def live(self) -> Iterable[Connection]:
        return [c for c in self.connections.values() if c.closed is None]

    async def close(self) -> None:
        self.closed = True
        tasks = [t for t in (*self._opening.values(), self._refreshing) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for connection in self.connections.values():
            connection.close()


class Links:
    """How a producer or a reader reaches the broker of each segment it writes or reads.

    ``target_of(segment)``: the segment's container (its owner takes appends and follows),
    or for a transaction's appends the coordinator of its transactional id. ``producer_id``:
    a connection counts as ready only once that id is claimed on it."""

    def __init__(
        self,
        cluster: Cluster,
        target_of: Callable[[int], Target],
        producer_id: int | None = None,
    ) -> None:
        self.cluster = cluster
        self.target_of = target_of
        self.producer_id = producer_id

    def cached(self, segment: int) -> Connection | None:
        connection = self.cluster.cached(self.target_of(segment))
        if connection is None:
            return None
        if self.producer_id is not None and self.producer_id not in connection.claimed:
            return None
        return connection

    async def connect(self, segment: int) -> Connection:
        """A ready connection to the segment's broker (see :meth:`Cluster.reach`)."""
        return await self.cluster.reach(self.target_of(segment))

    def follows_move(self, error: SlipstreamError, segment: int) -> bool:
        """Whether ``error`` says that the broker for ``segment`` moved (so the request goes
        to the new one), rather than that the segment is served by another broker than the
        one this target must use (a transaction's appends go to its coordinator)."""
        if not isinstance(error, WrongBroker):
            return False
        target = self.target_of(segment)
        container = error.details.get("container")
        if isinstance(target, str):
            return False
        return target is None or container is None or container == target % self.cluster.containers

    def moved(self, error: SlipstreamError) -> None:
        """A WrongBroker answer for one of the segments: learn where its container is."""
        if isinstance(error, WrongBroker):
            self.cluster.learn(error.details)

    async def any(self) -> Connection:
        return await self.cluster.reach(None)


def is_moved(error: BaseException) -> bool:
    """Whether a follow or request ended because its broker no longer serves the container,
    or the connection to it was lost: both are retried at the new owner."""
    return isinstance(error, WrongBroker | BrokerUnavailable)

"""The Python API: ``AsyncClient`` (asyncio) and ``Client`` (blocking, any thread).

``Client`` runs an ``AsyncClient`` on an event loop in a background thread; producers and
readers hand work across with thread-safe queues, never one loop round trip per event.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import datetime as dt
import json
import os
import queue
import threading
import weakref
from collections.abc import (
    AsyncIterator,
    Callable,
    Coroutine,
    Generator,
    Iterator,
    Mapping,
    Sequence,
)
from types import TracebackType
from typing import Any, Generic, NamedTuple, Protocol, Self, TypeVar

import numpy as np
import pyarrow as pa

from .._errors import (
    BrokerUnavailable,
    InvalidArgument,
    NotOwner,
    ProducerFenced,
    SlipstreamError,
    StreamExists,
    SubscriptionExists,
    TransactionAborted,
    TransactionNotFound,
)
from .._tls import from_env as tls_from_env
from ..format import Event, events_of
from ..protocol import (
    AccessDecision,
    AccessRule,
    BeginTxn,
    CheckAccess,
    ClaimProducer,
    ClusterInfo,
    CommitPositions,
    CreateStream,
    CreateSubscription,
    CreateToken,
    DeleteStream,
    DeleteSubscription,
    DescribeCluster,
    DescribeStream,
    DescribeSubscription,
    EndTxn,
    EventsFound,
    FindEvents,
    GetIdentity,
    GetScaleHistory,
    GrantRule,
    HandOverIdentity,
    IdentityInfo,
    IdentityList,
    InitProducer,
    ListIdentities,
    ListQuotas,
    ListRules,
    ListStreams,
    ListSubscriptions,
    ListTokens,
    ListTxns,
    Message,
    ProducerGrant,
    QuotaInfo,
    QuotaList,
    ResetSubscription,
    RevokeRule,
    RevokeToken,
    RuleList,
    ScaleEventInfo,
    ScaleHistory,
    ScaleStream,
    SetQuota,
    StreamInfo,
    StreamList,
    SubscriptionInfo,
    SubscriptionList,
    TokenInfo,
    TokenIssued,
    TokenList,
    TxnBegun,
    TxnEnded,
    TxnInfo,
    TxnList,
    TxnPositions,
    UpdateStream,
)
from ..streams import Router, ScalingPolicy, StreamCut, parse_duration_ms, parse_size_bytes
from ._cluster import Cluster, Links, Target, split_addresses
from ._connection import DEFAULT_ADDRESS, Connection
from ._consumer import (
    AsyncConsumer,
    Consumer,
    ConsumerCore,
    CoreFactory,
    Handed,
    _Item,
    cut_positions,
)
from ._producer import BulkReceipt, ProducerCore, Receipt
from ._queue import (
    QUEUE_MODES,
    AsyncQueueConsumer,
    QueueConsumer,
    queue_core_factory,
    subscription_mode,
)
from ._reader import (
    Delivery,
    ReaderCore,
    Start,
    cut_at,
    decode_delivery,
    parse_start,
    with_position,
)

T = TypeVar("T")


class _AsyncContext(Protocol):
    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...


C = TypeVar("C", bound=_AsyncContext)


class Opening(Generic[C]):
    """What ``connect_async``, ``AsyncClient.producer`` and ``AsyncClient.transaction``
    return: await it for the object, or use it directly in ``async with`` (like aiohttp's and
    httpx's requests), which awaits it and leaves through the object's own ``__aexit__``::

        client = await slipstream.connect_async(address)
        async with slipstream.connect_async(address) as client: ...
    """

    __slots__ = ("_coroutine", "_opened")

    def __init__(self, coroutine: Coroutine[Any, Any, C]) -> None:
        self._coroutine = coroutine
        self._opened: C | None = None

    def __await__(self) -> Generator[Any, None, C]:
        return self._coroutine.__await__()

    async def __aenter__(self) -> C:
        self._opened = await self._coroutine
        return await self._opened.__aenter__()

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._opened is not None
        await self._opened.__aexit__(kind, exc, tb)


def default_address() -> str:
    """``SLIPSTREAM_BROKER`` if set, else 127.0.0.1:7070."""
    return os.environ.get("SLIPSTREAM_BROKER") or DEFAULT_ADDRESS


def _retention_ms(value: str | int | dt.timedelta | None) -> int | None:
    if value is None or isinstance(value, int):
        return value
    if isinstance(value, dt.timedelta):
        return int(value.total_seconds() * 1000)
    return parse_duration_ms(value)


def _retention_bytes(value: str | int | None) -> int | None:
    return parse_size_bytes(value) if isinstance(value, str) else value


def _retention_change_ms(value: str | int | dt.timedelta | None) -> int | None:
    """For ``update_stream``: None keeps the limit; "forever", 0 or a zero timedelta -> 0,
    which removes it."""
    if isinstance(value, str) and value.strip().lower() in ("forever", "0"):
        return 0
    if isinstance(value, dt.timedelta) and not value:
        return 0
    return _retention_ms(value)


def _retention_change_bytes(value: str | int | None) -> int | None:
    """For ``update_stream``: None keeps the limit; "unlimited" or 0 -> 0, which removes it."""
    if isinstance(value, str) and value.strip().lower() in ("unlimited", "0"):
        return 0
    return _retention_bytes(value)


#: queue options in the API's units (seconds) -> the protocol's (ms)
_SECONDS = {
    "ack_timeout": "ack_timeout_ms",
    "backoff": "backoff_ms",
    "max_backoff": "max_backoff_ms",
}
_COUNTS = ("max_deliveries", "max_unacked", "dead_letter")


def _queue_options(given: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(given) - set(_SECONDS) - set(_COUNTS))
    if unknown:
        raise InvalidArgument(
            f"unknown option(s) {unknown}; queue options are {', '.join([*_SECONDS, *_COUNTS])}"
        )
    options: dict[str, Any] = {}
    for key, value in given.items():
        if value is None:
            continue
        if key in _SECONDS:
            options[_SECONDS[key]] = int(value * 1000)
        else:
            options[key] = value
    return options


def _policy_text(scaling: ScalingPolicy | str) -> str:
    """A policy for the wire: its compact text (checked here when given as text)."""
    if isinstance(scaling, ScalingPolicy):
        return str(scaling)
    return str(ScalingPolicy.from_text(scaling)) if scaling else ""


def _find_time(value: str | int | dt.datetime | None, name: str) -> int | None:
    """A find's window bound as ms since the epoch (None: open)."""
    if value is None:
        return None
    kind, timestamp_ms, _ = parse_start(value)
    if kind != "time" or timestamp_ms is None:
        raise InvalidArgument(f"a find's {name} must be a time, not {value!r}")
    return timestamp_ms


def _router(info: StreamInfo) -> Router:
    return Router([(s.number, s.key_lo, s.key_hi) for s in info.segments if not s.sealed])


class AsyncClient:
    """A connection to a broker for asyncio code: ``async with connect_async(...) as client``
    (or ``client = await connect_async(...)`` and ``await client.close()``). The same API as
    :class:`Client`, with ``await`` and ``async for``.

    When the connection drops (a broker restart), the next request dials again, for up to
    ``reconnect_timeout`` seconds; idempotent producers resend what was not acknowledged, and
    readers follow again from the next offset they have not received.

    Several brokers (docs/cluster.md): the address may be a list, ``"h1:7070,h2:7070"``; the
    client starts from the first that answers, learns from it which broker serves which
    container (``DescribeCluster``), keeps one connection per broker it needs, and sends
    appends and follows to the broker serving the segment, group requests to the one
    coordinating the subscription and transaction requests to the one coordinating the
    transactional id. A broker that answers WrongBroker (the container moved) is left for the
    new owner, and the request sent again there (``slipstream.client._cluster``).
    """

    def __init__(
        self,
        connection: Connection,
        *,
        timeout: float = 10.0,
        reconnect_timeout: float = 30.0,
        cluster: Cluster | None = None,
    ) -> None:
        if cluster is None:
            cluster = Cluster(
                [connection.address],
                timeout=timeout,
                reconnect_timeout=reconnect_timeout,
                tls=connection.tls,
                token=connection.token,
            )
            cluster.connections[connection.address] = connection
        cluster.prepare = self._claim
        self.cluster = cluster
        self.address = ",".join(cluster.bootstrap)
        self.timeout = timeout
        self.reconnect_timeout = reconnect_timeout
        self._first = connection
        self._identities: dict[str, tuple[int, int]] = {}
        self._grants: dict[int, tuple[int, bytes]] = {}  # producer id -> epoch, claim token
        self._cores: weakref.WeakSet[ProducerCore] = weakref.WeakSet()
        self._described: dict[str, StreamInfo] = {}  # routing of streams transactions write

    @classmethod
    async def connect(
        cls,
        address: str | None = None,
        *,
        timeout: float = 10.0,
        reconnect_timeout: float = 30.0,
        tls: bool | None = None,
        ca: str | os.PathLike[str] | None = None,
        cert: str | os.PathLike[str] | None = None,
        key: str | os.PathLike[str] | None = None,
        token: str | None = None,
    ) -> AsyncClient:
        context = tls_from_env(tls, ca, cert, key)
        cluster = Cluster(
            split_addresses(address or default_address()),
            timeout=timeout,
            reconnect_timeout=reconnect_timeout,
            tls=context,
            token=token or os.environ.get("SLIPSTREAM_TOKEN") or None,
        )
        connection = await cluster.start()
        return cls(
            connection, timeout=timeout, reconnect_timeout=reconnect_timeout, cluster=cluster
        )

    @property
    def _primary(self) -> Connection:
        """The connection to the broker that answers requests for no container in
        particular (the first of the list that answered, until it is lost)."""
        return self.cluster.cached(None) or self.cluster.connections.get(
            self.cluster.primary, self._first
        )

    async def live_connection(self, target: Target = None) -> Connection:
        """A connection to the broker for ``target`` (a container; None: any live broker),
        dialled again if it was lost and the cluster described again (raises
        BrokerUnavailable once ``reconnect_timeout`` passes without one)."""
        return await self.cluster.reach(target)

    def _group_target(self, stream: str, subscription: str) -> int:
        """The container coordinating the subscription's group."""
        return self.cluster.coordinator(f"{stream}/{subscription}")

    async def _segment_target(self, stream: str, segment: int) -> int:
        """The container of a segment (the stream described again if it is new here)."""
        info = self._described.get(stream)
        if info is None or all(s.number != segment for s in info.segments):
            info = self._described[stream] = await self.describe_stream(stream)
        return next((s.container for s in info.segments if s.number == segment), 0)

    async def _init_producer(self, transactional_id: str | None) -> tuple[int, int]:
        """A producer id and epoch owned by this client's connection; the grant's token
        claims them on every other connection (``_claim``). With a transactional id, asked
        of the broker coordinating it."""
        target = None if transactional_id is None else self.cluster.coordinator(transactional_id)
        grant, connection = await self._exchange(InitProducer(transactional_id), target)
        assert isinstance(grant, ProducerGrant)
        self._grants[grant.producer_id] = (grant.epoch, grant.token)
        connection.claimed.add(grant.producer_id)
        return grant.producer_id, grant.epoch

    async def _claim(self, connection: Connection) -> None:
        """Claim this client's producer ids on a connection that has not claimed them yet
        (the broker binds them to the connection; the brokers of a cluster share the claim
        tokens' key), so idempotent producers resend there and transactions end there."""
        if not self._grants.keys() - connection.claimed:
            return
        in_use = {core.identity[0] for core in self._cores if core.identity is not None}
        in_use.update(producer_id for producer_id, _ in self._identities.values())
        for producer_id in [p for p in self._grants if p not in in_use]:
            del self._grants[producer_id]
        for producer_id, (epoch, token) in list(self._grants.items()):
            if producer_id in connection.claimed:
                continue
            with contextlib.suppress(ProducerFenced, NotOwner):  # its next use says so
                await connection.request(ClaimProducer(producer_id, epoch, token))
            connection.claimed.add(producer_id)

    async def _request(self, message: Message, target: Target = None) -> Message:
        reply, _ = await self._exchange(message, target)
        return reply

    async def _exchange(
        self, message: Message, target: Target = None
    ) -> tuple[Message, Connection]:
        """Send ``message`` to the broker for ``target``; the reply and the connection that
        answered (:meth:`Cluster.request`: WrongBroker followed to the owner it names)."""
        return await self.cluster.request(message, target)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        for core in list(self._cores):
            await core.stop()
        await self.cluster.close()
        self._first.close()

    async def create_stream(
        self,
        name: str,
        segments: int = 1,
        *,
        retention_time: str | int | dt.timedelta | None = None,
        retention_bytes: str | int | None = None,
        exist_ok: bool = False,
        scaling: ScalingPolicy | str | None = None,
    ) -> StreamInfo:
        """Create ``scope/name`` with ``segments`` segments. ``retention_time`` ("7d",
        milliseconds or a timedelta) and ``retention_bytes`` ("10GiB" or bytes) bound how much
        history is kept; without them, everything is kept. Raises StreamExists, InvalidName.

        ``scaling``: a ``ScalingPolicy`` (``ScalingPolicy.by_event_rate(5000, scale_factor=2,
        min_segments=1)``, ``by_byte_rate(...)``, ``fixed(n)``): the broker then splits hot
        segments and merges cold neighbours by itself (docs/scaling.md); the stream starts
        with at least ``min_segments``. Without one, segments change only by hand
        (:meth:`scale_stream`).

        ``exist_ok=True``: a stream of that name that exists already is returned as it is
        (its segments and retention are not compared or changed), so a program that creates
        its streams can run again."""
        request = CreateStream(
            name,
            segments,
            _retention_ms(retention_time),
            _retention_bytes(retention_bytes),
            "" if scaling is None else _policy_text(scaling),
        )
        try:
            reply = await self._request(request)
        except StreamExists:
            if not exist_ok:
                raise
            reply = await self.describe_stream(name)
        assert isinstance(reply, StreamInfo)
        return reply

    async def update_stream(
        self,
        name: str,
        *,
        retention_time: str | int | dt.timedelta | None = None,
        retention_bytes: str | int | None = None,
        scaling: ScalingPolicy | str | None = None,
    ) -> StreamInfo:
        """Change the retention or the scaling policy (``scaling``; "" removes it, None
        leaves it) of an existing stream; returns the stream as it is now.
        Same units as :meth:`create_stream` ("7d", milliseconds or a timedelta; "10GiB" or
        bytes). A limit left None stays as it is; ``retention_time="forever"`` and
        ``retention_bytes="unlimited"`` (or 0) remove that limit. The broker stores the
        change before answering (a restart keeps it) and applies it from its next retention
        pass: shrinking a limit removes the old chunks then, and data already removed never
        comes back. Raises StreamNotFound, InvalidArgument (a bad or negative limit)."""
        request = UpdateStream(
            name,
            _retention_change_ms(retention_time),
            _retention_change_bytes(retention_bytes),
            None if scaling is None else _policy_text(scaling),
        )
        reply = await self._request(request)
        assert isinstance(reply, StreamInfo)
        return reply

    async def delete_stream(self, name: str) -> None:
        """Delete a stream and all its data. Readers following it get StreamNotFound."""
        await self._request(DeleteStream(name))

    async def scale_stream(
        self,
        stream: str,
        *,
        split: int | None = None,
        into: int = 2,
        merge: Sequence[int] | None = None,
    ) -> StreamInfo:
        """Split segment ``split`` into ``into`` successors, or merge the adjacent segments
        ``merge``; see :meth:`Client.scale_stream`."""
        if (split is None) == (merge is None):
            raise InvalidArgument("give split=SEGMENT (with into=N) or merge=[SEGMENTS]")
        segments = [split] if split is not None else list(merge or ())
        reply = await self._request(ScaleStream(stream, segments, into))
        assert isinstance(reply, StreamInfo)
        self._described.pop(stream, None)
        return reply

    async def scale_history(self, stream: str) -> list[ScaleEventInfo]:
        """Every split and merge of ``stream``, oldest first."""
        reply = await self._request(GetScaleHistory(stream))
        assert isinstance(reply, ScaleHistory)
        return reply.events

    async def list_streams(self, scope: str | None = None) -> list[StreamInfo]:
        reply = await self._request(ListStreams(scope))
        assert isinstance(reply, StreamList)
        return reply.streams

    async def describe_stream(self, name: str) -> StreamInfo:
        """Segments with key ranges, offsets, bytes and first/last event timestamps."""
        reply = await self._request(DescribeStream(name))
        assert isinstance(reply, StreamInfo)
        return reply

    async def describe_cluster(self) -> ClusterInfo:
        """The live brokers (addresses, containers served, start time) and the owner of each
        container (``owners[c]``: a broker id, "" while the container moves); a standalone
        broker names itself everywhere. Also refreshes the map this client routes by."""
        connection = await self.live_connection()
        reply, _ = await connection.request(DescribeCluster())
        assert isinstance(reply, ClusterInfo)
        self.cluster.apply(reply, connection.address)
        return reply

    async def tail(self, stream: str) -> StreamCut:
        """The StreamCut of the current durable end: a bounded reader stops there."""
        return await self.cut(stream, "latest")

    async def cut(self, stream: str, at: Start) -> StreamCut:
        """The StreamCut at ``at``: "earliest", "latest", a time (ISO-8601 text, a datetime or
        ms since the epoch: per segment, the first event at or after it) or a StreamCut (checked
        against the stream). Times and cuts name positions for bounded reads of history."""
        return await cut_at(self._request, stream, at)

    async def find(
        self,
        stream: str,
        *,
        key: bytes | str | None = None,
        start: str | int | dt.datetime | None = None,
        end: str | int | dt.datetime | None = None,
        limit: int = 100,
        newest_first: bool = True,
    ) -> list[Event]:
        """Events of ``stream`` with routing key ``key`` (any if None; a str is sent UTF-8)
        and an event time at or after ``start`` and before ``end`` (ISO-8601 text with a
        timezone, a relative time like "-1h", a datetime or ms since the epoch; open where
        None): at most ``limit`` (1..10,000), the newest first by default, or the oldest first.
        Each event carries its segment and offset.

        With a key, the events are the key's, in its append order (across splits and merges);
        without one, ordered by time. The broker reads only the batches its find indexes name,
        so a key's last events come back in milliseconds however long the stream. Raises
        StreamNotFound, InvalidArgument (bad limit, an empty window, a bad time)."""
        start_ms, end_ms = _find_time(start, "start"), _find_time(end, "end")
        if isinstance(key, str):
            key = key.encode()
        reply = await self._request(FindEvents(stream, key, start_ms, end_ms, limit, newest_first))
        assert isinstance(reply, EventsFound)
        return [
            Event(e.key, e.value, e.headers, e.timestamp, e.segment, e.offset) for e in reply.events
        ]

    def producer(
        self,
        stream: str,
        *,
        idempotent: bool = True,
        transactional_id: str | None = None,
        **options: Any,
    ) -> Opening[AsyncProducer]:
        """A producer for one stream: ``async with client.producer(stream) as producer``
        (leaving the block flushes) or ``producer = await client.producer(stream)``. See
        :meth:`Client.producer` for the options and guarantees."""
        return Opening(self._open_producer(stream, idempotent, transactional_id, options))

    async def _open_producer(
        self,
        stream: str,
        idempotent: bool,
        transactional_id: str | None,
        options: dict[str, Any],
    ) -> AsyncProducer:
        return AsyncProducer(
            await self._producer_core(stream, idempotent, transactional_id, None, options)
        )

    async def _producer_core(
        self,
        stream: str,
        idempotent: bool,
        transactional_id: str | None,
        txn: int | None,
        options: dict[str, Any],
        home: Target = None,
    ) -> ProducerCore:
        info = self._described.get(stream) if txn is not None else None
        if info is None:
            info = self._described[stream] = await self.describe_stream(stream)
        identity = None
        if txn is None and (idempotent or transactional_id is not None):
            identity = await self._init_producer(transactional_id)
        containers = {s.number: s.container for s in info.segments}

        async def describe() -> StreamInfo:  # after a scale sealed a segment the core writes
            self._described[stream] = info = await self.describe_stream(stream)
            containers.update((s.number, s.container) for s in info.segments)
            return info

        def target_of(segment: int) -> Target:
            return home if txn is not None else containers.get(segment, 0)

        links = Links(self.cluster, target_of, None if identity is None else identity[0])
        connection = await self.live_connection()
        core = ProducerCore(
            connection,
            asyncio.get_running_loop(),
            stream,
            _router(info),
            identity=identity,
            txn=txn,
            reconnect=self.live_connection,
            eager=txn is None,
            describe=describe,
            links=links,
            **options,
        )
        self._cores.add(core)
        for segment in core.router.segments:  # connect (and claim) ahead of the first batch
            with contextlib.suppress(BrokerUnavailable):  # the first send retries
                await links.connect(segment)
        return core

    def reader(
        self, stream: str, start: Start = "earliest", end: StreamCut | None = None
    ) -> AsyncReader:
        """An async iterator of events; see :class:`Reader`."""
        return AsyncReader(self._primary, stream, start, end, self.cluster)

    # --- subscriptions and consumers -------------------------------------------------------

    async def create_subscription(
        self,
        stream: str,
        name: str,
        start: Start = "earliest",
        mode: str = "ordered",
        *,
        exist_ok: bool = False,
        **queue_options: Any,
    ) -> SubscriptionInfo:
        """A named, durable cursor on ``stream``; see :meth:`Client.create_subscription`."""
        kind, timestamp_ms, cut = parse_start(start)
        positions = None
        if cut is not None:
            positions = cut_positions(stream, cut)
        request = CreateSubscription(
            stream, name, mode, kind, timestamp_ms, positions, _queue_options(queue_options)
        )
        try:
            reply = await self._request(request, self._group_target(stream, name))
        except SubscriptionExists:
            if not exist_ok:
                raise
            reply = await self.describe_subscription(stream, name)
        assert isinstance(reply, SubscriptionInfo)
        return reply

    async def list_subscriptions(self, stream: str) -> list[SubscriptionInfo]:
        reply = await self._request(ListSubscriptions(stream))
        assert isinstance(reply, SubscriptionList)
        return reply.subscriptions

    async def describe_subscription(self, stream: str, name: str) -> SubscriptionInfo:
        """Per segment: position, backlog in events and bytes, lag; and the members."""
        reply = await self._request(
            DescribeSubscription(stream, name), self._group_target(stream, name)
        )
        assert isinstance(reply, SubscriptionInfo)
        return reply

    async def delete_subscription(self, stream: str, name: str) -> None:
        await self._request(DeleteSubscription(stream, name), self._group_target(stream, name))

    async def reset_subscription(self, stream: str, name: str, to: Start) -> SubscriptionInfo:
        """Move every position to ``to``; live consumers restart from there at once."""
        kind, timestamp_ms, cut = parse_start(to)
        positions = cut_positions(stream, cut) if cut is not None else None
        reply = await self._request(
            ResetSubscription(stream, name, kind, timestamp_ms, positions),
            self._group_target(stream, name),
        )
        assert isinstance(reply, SubscriptionInfo)
        return reply

    async def commit_subscription(
        self, stream: str, name: str, positions: StreamCut | Mapping[int, int]
    ) -> None:
        """Store positions from outside a group (a job's progress, an operator's fix);
        refused with GroupActive while consumers are joined."""
        info = await self.describe_subscription(stream, name)
        await self._request(
            CommitPositions(stream, name, 0, info.generation, cut_positions(stream, positions)),
            self._group_target(stream, name),
        )

    def consumer(
        self,
        stream: str,
        subscription: str,
        *,
        commit: str = "auto",
        name: str | None = None,
        session_timeout: float = 10.0,
        max_in_flight: int = 256,
    ) -> Opening[AsyncConsumer | AsyncQueueConsumer]:
        """Join the subscription's group: ``async with client.consumer(...) as consumer``
        (leaving the block commits and leaves) or ``consumer = await client.consumer(...)``.
        See :meth:`Client.consumer`."""
        return Opening(
            self._open_consumer(stream, subscription, commit, name, session_timeout, max_in_flight)
        )

    async def _open_consumer(
        self,
        stream: str,
        subscription: str,
        commit: str,
        name: str | None,
        timeout: float,
        max_in_flight: int = 256,
    ) -> AsyncConsumer | AsyncQueueConsumer:
        mode = await subscription_mode(self, stream, subscription)
        if mode in QUEUE_MODES:
            assert mode is not None
            queue_consumer = AsyncQueueConsumer(
                queue_core_factory(self, stream, subscription, mode, name, timeout, max_in_flight)
            )
            await queue_consumer.core.start()
            return queue_consumer
        consumer = AsyncConsumer(self._core_factory(stream, subscription, commit, name, timeout))
        await consumer.core.start()
        return consumer

    def _core_factory(
        self, stream: str, subscription: str, commit: str, name: str | None, timeout: float
    ) -> CoreFactory:
        def make(deliver: Callable[[_Item], None]) -> ConsumerCore:
            return ConsumerCore(self, stream, subscription, commit, name, timeout, deliver)

        return make

    # --- transactions ----------------------------------------------------------------------

    def transaction(
        self,
        transactional_id: str | None,
        *,
        timeout: float = 60.0,
        label: str = "",
        merge_into: str | None = None,
        **options: Any,
    ) -> Opening[AsyncTransaction]:
        """Begin a transaction: ``async with client.transaction(id) as txn`` commits when the
        block ends (aborts on an exception), or ``txn = await client.transaction(id)``. See
        :meth:`Client.transaction`. The first transaction of a ``transactional_id`` on this
        client fences every other client using that id."""
        return Opening(self._begin(transactional_id, timeout, label, options, merge_into))

    async def _begin(
        self,
        transactional_id: str | None,
        timeout: float,
        label: str,
        options: dict[str, Any],
        merge_into: str | None = None,
    ) -> AsyncTransaction:
        home: Target
        if transactional_id is None:
            identity = (-1, -1)
            # it stays where it began: in a cluster, where the commit that merges it runs
            home = (
                self.cluster.coordinator(merge_into)
                if merge_into is not None
                else (await self.live_connection()).address
            )
        else:
            home = self.cluster.coordinator(transactional_id)
            known = self._identities.get(transactional_id)
            if known is None:
                known = await self._init_producer(transactional_id)
                self._identities[transactional_id] = known
            identity = known
        begun = await self._request(BeginTxn(*identity, int(timeout * 1000), label), home)
        assert isinstance(begun, TxnBegun)
        return AsyncTransaction(self, begun.txn_id, transactional_id, options, home)

    async def last_commit(self, transactional_id: str) -> CommitInfo | None:
        """What the last committed transaction of ``transactional_id`` stored as metadata
        (None if it never committed): how a restarted application knows where it was."""
        reply = await self._request(
            GetIdentity(transactional_id), self.cluster.coordinator(transactional_id)
        )
        assert isinstance(reply, IdentityInfo)
        if reply.last_txn_id < 0:
            return None
        metadata = json.loads(reply.last_metadata) if reply.last_metadata else None
        return CommitInfo(reply.last_txn_id, metadata, reply.committed_ms, reply.epoch)

    async def transactions(self, at: str | None = None) -> list[TxnInfo]:
        """Open transactions on the broker, with age, size and state; in a cluster, ``at`` a
        transactional id: those of the broker coordinating it (where its commits merge)."""
        reply = await self._request(
            ListTxns(), None if at is None else self.cluster.coordinator(at)
        )
        assert isinstance(reply, TxnList)
        return reply.txns

    async def identities(self, prefix: str = "") -> list[IdentityInfo]:
        """Every transactional id starting with ``prefix`` ("" for all), sorted: producer
        id, epoch, last committed transaction, its metadata (bytes) and commit time
        (``last_txn_id`` -1 for an id that never committed). The Spark sink's queries are
        the ids under ``spark:``. Raises PermissionDenied without the admin action (with
        authentication on)."""
        reply = await self._request(ListIdentities(prefix))
        assert isinstance(reply, IdentityList)
        return reply.identities

    async def hand_over(self, transactional_id: str, subject: str) -> None:
        """Make ``subject`` the owner of ``transactional_id``: with authentication on, only
        its owner (at first, the subject that initialised it) and admins may use it. Its
        running producers are not fenced. Raises PermissionDenied without the admin
        action."""
        await self._request(HandOverIdentity(transactional_id, subject))

    async def abort_transaction(self, txn_id: int, at: str | None = None) -> None:
        """Abort an open transaction by id (an operator's tool: its owner's commit fails); in
        a cluster, ``at``: a transactional id whose coordinating broker holds it."""
        target = None if at is None else self.cluster.coordinator(at)
        await self._request(EndTxn(txn_id, False, operator=True), target)

    async def set_quota(
        self,
        scope: str,
        *,
        produce_bytes: int | None = None,
        consume_bytes: int | None = None,
        requests: int | None = None,
        connections: int | None = None,
    ) -> list[QuotaInfo]:
        """Set (replace) a scope's quota: bytes per second produced to and consumed from its
        streams, requests per second, open connections of tokens limited to it; None: no
        limit (all None removes the quota). A tenant over a rate is slowed down, not refused.
        Stored before it returns. -> every quota. Raises PermissionDenied without admin
        (authentication on), InvalidArgument for a limit that is not positive."""
        quota = QuotaInfo(scope, produce_bytes, consume_bytes, requests, connections)
        reply = await self._request(SetQuota(quota))
        assert isinstance(reply, QuotaList)
        return reply.quotas

    async def delete_quota(self, scope: str) -> list[QuotaInfo]:
        """Remove a scope's quota (no limits); -> every quota left."""
        return await self.set_quota(scope)

    async def quotas(self) -> list[QuotaInfo]:
        """Every scope's quota, by scope."""
        reply = await self._request(ListQuotas())
        assert isinstance(reply, QuotaList)
        return reply.quotas

    # --- tokens (a broker with --auth; an admin token) ------------------------------------

    async def create_token(
        self,
        subject: str,
        role: str = "user",
        *,
        scope: str | None = None,
        expires_s: int = 0,
        algorithm: str = "EdDSA",
    ) -> TokenIssued:
        """A new token for ``subject`` (``.token``, shown once) and its claims (``.info``);
        ``expires_s`` 0: 30 days. Raises PermissionDenied without an admin token."""
        reply = await self._request(CreateToken(subject, role, scope, expires_s, algorithm))
        assert isinstance(reply, TokenIssued)
        return reply

    async def revoke_token(self, token_id: str) -> None:
        """Revoke a token by id; connections using it are closed at once."""
        await self._request(RevokeToken(token_id))

    async def list_tokens(self) -> list[TokenInfo]:
        """Tokens the broker issued (ids and claims, never the tokens) and revoked ids."""
        reply = await self._request(ListTokens())
        assert isinstance(reply, TokenList)
        return reply.tokens

    # --- access rules (a broker with --auth; an admin token; docs/security.md) ----------

    async def grant(self, subject: str, action: str, pattern: str) -> AccessRule:
        """Allow ``subject`` (``*``: everyone authenticated) ``action`` (produce, consume,
        manage, admin) on the streams ``pattern`` matches (``demo/*``, ``*/orders``, ``*``).
        Stored before it returns. Raises InvalidArgument, PermissionDenied."""
        reply = await self._request(GrantRule(AccessRule(subject, action, pattern)))
        assert isinstance(reply, RuleList)
        return reply.rules[0]

    async def revoke(self, subject: str, action: str, pattern: str) -> bool:
        """Remove a rule (False: there was none); in force at once on open connections."""
        reply = await self._request(RevokeRule(AccessRule(subject, action, pattern)))
        assert isinstance(reply, RuleList)
        return bool(reply.rules)

    async def rules(self) -> list[AccessRule]:
        """Every access rule, sorted by subject, action, pattern."""
        reply = await self._request(ListRules())
        assert isinstance(reply, RuleList)
        return reply.rules

    async def check_access(
        self,
        subject: str,
        action: str,
        stream: str,
        *,
        role: str = "user",
        scope: str | None = None,
    ) -> AccessDecision:
        """A dry run: would ``subject`` be allowed ``action`` on ``stream`` (``*``:
        broker-wide), and which rule decides?"""
        reply = await self._request(CheckAccess(subject, action, stream, role, scope))
        assert isinstance(reply, AccessDecision)
        return reply

    async def _end(
        self,
        txn_id: int,
        commit: bool,
        metadata: bytes,
        merge: Sequence[int] = (),
        positions: Sequence[TxnPositions] = (),
        home: Target = None,
    ) -> TxnEnded:
        """End a transaction at ``home`` (the broker coordinating its transactional id); a
        commit whose answer was lost with the connection is asked again (the broker answers a
        repeated commit with the first one's outcome)."""
        message = EndTxn(txn_id, commit, metadata, list(merge), False, list(positions))
        try:
            reply = await self._request(message, home)
        except BrokerUnavailable:
            reply = await self._request(message, home)
        assert isinstance(reply, TxnEnded)
        return reply


class CommitInfo(NamedTuple):
    """A transactional id's last commit: transaction id, metadata (decoded JSON), time, and
    the epoch of the producer that owns the id now."""

    txn_id: int
    metadata: Any
    committed_ms: int
    epoch: int


class AsyncTransaction:
    """A transaction for asyncio code; see :class:`Transaction`."""

    def __init__(
        self,
        client: AsyncClient,
        txn_id: int,
        transactional_id: str | None,
        options: dict[str, Any],
        home: Target = None,
    ) -> None:
        self.client = client
        self.txn_id = txn_id
        self.transactional_id = transactional_id
        #: where its appends and its end go: the coordinator of its transactional id
        self.home = home
        self._options = options
        self._cores: dict[str, ProducerCore] = {}
        self._consumed: dict[ConsumerCore, Handed] = {}
        self.metadata: Any = None
        self.result: TxnEnded | None = None

    def commit_position(
        self,
        consumer: AsyncConsumer | Consumer,
        positions: StreamCut | Mapping[int, int] | None = None,
    ) -> None:
        """Commit the consumer's position (everything it handed out so far, or
        ``positions``) with this transaction: the events the transaction writes and the input
        it consumed become visible together, or neither (exactly-once consume-transform-
        produce). If a segment moved or was granted again since its events were handed out
        (a rebalance, a reconnect, an expired session), the commit raises NotAssigned and the
        transaction aborts: those events are delivered again."""
        self._consumed[consumer.core] = consumer._side.snapshot(positions)

    async def _core(self, stream: str) -> ProducerCore:
        core = self._cores.get(stream)
        if core is None:
            core = await self.client._producer_core(
                stream, False, None, self.txn_id, self._options, self.home
            )
            self._cores[stream] = core
        return core

    async def send(
        self,
        stream: str,
        value: bytes,
        key: str | bytes | None = None,
        headers: Mapping[str, bytes] | None = None,
        timestamp: int | None = None,
    ) -> None:
        core = await self._core(stream)
        await core.space_available()
        core.send(value, key, headers, timestamp)

    async def send_many(
        self,
        stream: str,
        values: Sequence[bytes] | pa.Array,
        keys: Sequence[str | bytes | None] | pa.Array | None = None,
        timestamps: Sequence[int] | np.ndarray | pa.Array | None = None,
        headers: pa.Array | None = None,
    ) -> None:
        core = await self._core(stream)
        await core.space_available()
        core.send_many(values, keys, timestamps, headers)

    async def flush(self) -> None:
        """Wait until every event sent so far is staged on the broker (not visible yet).
        Raises the error of a batch that failed (then ``commit`` aborts instead: a
        transaction never commits with some of its events missing)."""
        cores = list(self._cores.values())
        await _wait_acknowledged([f for core in cores for f in core.flush_nowait()])
        for core in cores:
            failure = core.take_failure()
            if failure is not None:
                raise failure

    async def commit(self, metadata: Any = None, merge: Sequence[int] = ()) -> TxnEnded:
        """Make every event of the transaction visible at once, with ``metadata`` (any JSON
        value, or ``self.metadata``) stored atomically with them. ``merge``: ids of open
        anonymous transactions (begun with ``transactional_id=None``, possibly by other
        processes) whose events commit with this one's, under the same commit."""
        if self.result is not None:
            return self.result
        try:
            await self.flush()
            failed = sum(core.failed for core in self._cores.values())
            if failed:  # raised by an earlier flush, and the caller went on to commit
                raise TransactionAborted(
                    f"transaction {self.txn_id} aborted: {failed} of its events failed "
                    "earlier, and a transaction commits all of its events or none",
                    txn_id=self.txn_id,
                )
            consumed = [(core, core.txn_positions(h)) for core, h in self._consumed.items()]
        except BaseException:
            await self.abort()
            raise
        data = metadata if metadata is not None else self.metadata
        encoded = b"" if data is None else json.dumps(data).encode()
        positions = [p for _, p in consumed]
        self.result = await self.client._end(
            self.txn_id, True, encoded, merge, positions, self.home
        )
        for core, position in consumed:
            core.committed.update(position.positions)
        self._close_cores()
        return self.result

    async def abort(self) -> None:
        """Discard every event of the transaction (nothing of it ever becomes visible)."""
        if self.result is not None:
            return
        self._close_cores()
        try:
            self.result = await self.client._end(self.txn_id, False, b"", home=self.home)
        except (TransactionAborted, TransactionNotFound):
            self.result = TxnEnded(self.txn_id, False)

    def _close_cores(self) -> None:
        for core in self._cores.values():
            core.closed = True

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if kind is None:
            await self.commit()
        else:
            await self.abort()


class AsyncProducer:
    """The asyncio producer. ``await send(...)`` waits only for buffer space, not for the
    acknowledgement: await the returned Receipt (or ``flush()``) for that."""

    def __init__(self, core: ProducerCore) -> None:
        self.core = core

    async def send(
        self,
        value: bytes,
        key: str | bytes | None = None,
        headers: Mapping[str, bytes] | None = None,
        timestamp: int | None = None,
    ) -> Receipt:
        await self.core.space_available()
        return self.core.send(value, key, headers, timestamp)

    async def send_many(
        self,
        values: Sequence[bytes] | pa.Array,
        keys: Sequence[str | bytes | None] | pa.Array | None = None,
        timestamps: Sequence[int] | np.ndarray | pa.Array | None = None,
        headers: pa.Array | None = None,
    ) -> BulkReceipt:
        await self.core.space_available()
        return self.core.send_many(values, keys, timestamps, headers)

    @property
    def acknowledged(self) -> int:
        """How many events the broker has acknowledged (made durable) so far."""
        return self.core.acknowledged

    async def flush(self) -> None:
        """Wait until every event sent so far is acknowledged; see :meth:`Producer.flush`."""
        await _wait_acknowledged(self.core.flush_nowait())
        failure = self.core.take_failure()
        if failure is not None:
            raise failure

    async def close(self) -> None:
        """Flush, then refuse further sends; raises like :meth:`flush`."""
        try:
            await self.flush()
        finally:
            self.core.closed = True

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            await self.close()
            return
        try:
            await self.close()
        except SlipstreamError as error:  # the block's own exception goes on, with this noted
            exc.add_note(f"and closing the producer raised {type(error).__name__}: {error}")


class AsyncReader:
    """Events of a stream for asyncio code: ``async for event in reader`` or
    ``async for batch in reader.batches()``. Close it (or use ``async with``) to stop."""

    def __init__(
        self,
        connection: Connection,
        stream: str,
        start: Start,
        end: StreamCut | None,
        cluster: Cluster | None = None,
    ) -> None:
        self._queue: asyncio.Queue[Delivery] = asyncio.Queue()
        self.core = ReaderCore(connection, stream, start, end, self._queue.put_nowait, cluster)
        self._started = False

    async def _positioned(self) -> AsyncIterator[tuple[int, int, pa.RecordBatch]]:
        if self._started:  # as the blocking Reader: a second pass would follow twice
            raise InvalidArgument("a reader can be iterated once; create a new one to read again")
        self._started = True
        remaining = set(await self.core.open())
        try:
            while remaining:
                delivery = await self._queue.get()
                if delivery.error is not None:
                    raise delivery.error
                if delivery.payload is None:  # its end; successors may follow
                    remaining.discard(delivery.segment)
                    remaining.update(delivery.opened)
                    continue
                for item in decode_delivery(delivery, self.core):
                    yield item
                self.core.grant(delivery.segment, len(delivery.payload))
        finally:
            await self.core.close()

    async def batches(self) -> AsyncIterator[pa.RecordBatch]:
        async for segment, base, record in self._positioned():
            yield with_position(segment, base, record)

    async def __aiter__(self) -> AsyncIterator[Event]:
        async for segment, base, record in self._positioned():
            for event in events_of(record, segment, base):
                yield event

    async def close(self) -> None:
        await self.core.close()

    async def __aenter__(self) -> AsyncReader:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def _wait_acknowledged(futures: list[concurrent.futures.Future[int]]) -> None:
    """Wait for batch futures without raising: their errors are counted by the producer."""
    if futures:
        await asyncio.gather(*(asyncio.wrap_future(f) for f in futures), return_exceptions=True)


def connect_async(
    address: str | None = None,
    *,
    timeout: float = 10.0,
    reconnect_timeout: float = 30.0,
    tls: bool | None = None,
    ca: str | os.PathLike[str] | None = None,
    cert: str | os.PathLike[str] | None = None,
    key: str | os.PathLike[str] | None = None,
    token: str | None = None,
) -> Opening[AsyncClient]:
    """Connect to a broker from asyncio code (``SLIPSTREAM_BROKER`` or 127.0.0.1:7070 by
    default): ``async with slipstream.connect_async() as client`` closes it at the end of the
    block; ``client = await slipstream.connect_async()`` leaves that to you. Raises
    BrokerUnavailable or TlsError like :func:`connect`."""
    return Opening(
        AsyncClient.connect(
            address,
            timeout=timeout,
            reconnect_timeout=reconnect_timeout,
            tls=tls,
            ca=ca,
            cert=cert,
            key=key,
            token=token,
        )
    )


# --- the blocking client ----------------------------------------------------------------------


class _LoopThread:
    """An event loop in a daemon thread, owned by one Client and stopped by its close()."""

    def __init__(self) -> None:
        try:
            import uvloop

            self.loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        except ImportError:  # pragma: no cover - uvloop is a dependency on Linux and macOS
            self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="slipstream-client", daemon=True
        )
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def stop(self) -> None:
        async def drain() -> None:  # nothing may be left pending when the loop closes
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            self.run(drain(), timeout=5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        if not self.thread.is_alive():
            self.loop.close()


class Client:
    """A blocking connection to a broker, safe to share between threads.

    Create with ``slipstream.connect("host:port")``; use as a context manager or call
    ``close()``. Every method raises the typed errors of ``slipstream.errors``.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        timeout: float = 10.0,
        reconnect_timeout: float = 30.0,
        tls: bool | None = None,
        ca: str | os.PathLike[str] | None = None,
        cert: str | os.PathLike[str] | None = None,
        key: str | os.PathLike[str] | None = None,
        token: str | None = None,
    ) -> None:
        self._loop = _LoopThread()
        try:
            self._async = self._loop.run(
                AsyncClient.connect(
                    address,
                    timeout=timeout,
                    reconnect_timeout=reconnect_timeout,
                    tls=tls,
                    ca=ca,
                    cert=cert,
                    key=key,
                    token=token,
                )
            )
        except BaseException:
            self._loop.stop()
            raise
        self.address = self._async.address

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._loop.thread.is_alive():
            self._loop.run(self._async.close())
            self._loop.stop()

    def create_stream(
        self,
        name: str,
        segments: int = 1,
        *,
        retention_time: str | int | dt.timedelta | None = None,
        retention_bytes: str | int | None = None,
        exist_ok: bool = False,
        scaling: ScalingPolicy | str | None = None,
    ) -> StreamInfo:
        """Create ``scope/name``; see :meth:`AsyncClient.create_stream` (``exist_ok=True``
        returns an existing stream instead of raising StreamExists; ``scaling``: a
        ``ScalingPolicy`` that splits and merges its segments by load)."""
        return self._loop.run(
            self._async.create_stream(
                name,
                segments,
                retention_time=retention_time,
                retention_bytes=retention_bytes,
                exist_ok=exist_ok,
                scaling=scaling,
            )
        )

    def update_stream(
        self,
        name: str,
        *,
        retention_time: str | int | dt.timedelta | None = None,
        retention_bytes: str | int | None = None,
        scaling: ScalingPolicy | str | None = None,
    ) -> StreamInfo:
        """Change a stream's retention or scaling policy; see :meth:`AsyncClient.update_stream`
        (None keeps a limit or the policy, "forever" / "unlimited" or 0 removes a limit, ""
        removes the policy)."""
        return self._loop.run(
            self._async.update_stream(
                name,
                retention_time=retention_time,
                retention_bytes=retention_bytes,
                scaling=scaling,
            )
        )

    def delete_stream(self, name: str) -> None:
        self._loop.run(self._async.delete_stream(name))

    def scale_stream(
        self,
        stream: str,
        *,
        split: int | None = None,
        into: int = 2,
        merge: Sequence[int] | None = None,
    ) -> StreamInfo:
        """Scale a stream by hand: ``split=S, into=N`` seals open segment S and opens N
        successors that divide its key range; ``merge=[S1, S2]`` seals adjacent open segments
        and opens one successor for their joint range. Both happen in one new epoch,
        atomically (also across a broker crash). Producers and readers follow by themselves:
        every key keeps its order. Raises SegmentNotFound, InvalidArgument (a sealed segment,
        segments that are not neighbours, a bad count), StreamNotFound."""
        return self._loop.run(self._async.scale_stream(stream, split=split, into=into, merge=merge))

    def scale_history(self, stream: str) -> list[ScaleEventInfo]:
        """Every split and merge of ``stream``, oldest first: epoch, time, the segments
        sealed (with their ends) and opened, and why."""
        return self._loop.run(self._async.scale_history(stream))

    def list_streams(self, scope: str | None = None) -> list[StreamInfo]:
        return self._loop.run(self._async.list_streams(scope))

    def describe_stream(self, name: str) -> StreamInfo:
        return self._loop.run(self._async.describe_stream(name))

    def describe_cluster(self) -> ClusterInfo:
        """The live brokers and which holds each container (see
        :meth:`AsyncClient.describe_cluster`)."""
        return self._loop.run(self._async.describe_cluster())

    def tail(self, stream: str) -> StreamCut:
        """The StreamCut of the current durable end of ``stream``."""
        return self._loop.run(self._async.tail(stream))

    def cut(self, stream: str, at: Start) -> StreamCut:
        """The StreamCut at "earliest", "latest", a time or a StreamCut; see AsyncClient.cut."""
        return self._loop.run(self._async.cut(stream, at))

    def find(
        self,
        stream: str,
        *,
        key: bytes | str | None = None,
        start: str | int | dt.datetime | None = None,
        end: str | int | dt.datetime | None = None,
        limit: int = 100,
        newest_first: bool = True,
    ) -> list[Event]:
        """Events by routing key and/or time, each with its segment and offset; see
        AsyncClient.find."""
        return self._loop.run(
            self._async.find(
                stream, key=key, start=start, end=end, limit=limit, newest_first=newest_first
            )
        )

    def producer(
        self,
        stream: str,
        *,
        linger_ms: float = 5.0,
        batch_bytes: int = 2 * 1024 * 1024,
        compression: str | None = "lz4",
        max_in_flight: int = 8,
        buffer_bytes: int = 64 * 1024 * 1024,
        idempotent: bool = True,
        transactional_id: str | None = None,
        delivery_timeout: float = 120.0,
        request_timeout: float = 30.0,
    ) -> Producer:
        """A producer for ``stream``.

        Events with the same key go to the same segment and keep their order; keyless events
        fill one segment's batch at a time. A batch is sent when it holds ``batch_bytes``, when
        ``linger_ms`` passed since its first event, or at once when nothing is in flight.
        ``compression``: "lz4" (the default), "zstd" or None: Arrow IPC buffer compression,
        kept for a batch only where it saves a fifth of its bytes. ``send`` blocks
        while more than ``buffer_bytes`` are waiting for acknowledgement (backpressure).

        Idempotent by default: batches the broker did not acknowledge are sent again after a
        reconnect, for up to ``delivery_timeout`` seconds, and the broker stores each exactly
        once. A connection that answers nothing for ``request_timeout`` seconds is dropped
        and dialled again.

        ``transactional_id`` gives the producer a stable identity: opening another producer
        (or transaction) with the same id fences this one, whose next write raises
        ProducerFenced (a zombie instance can never write after its replacement started).
        """
        options = {
            "linger_ms": linger_ms,
            "batch_bytes": batch_bytes,
            "compression": compression,
            "max_in_flight": max_in_flight,
            "buffer_bytes": buffer_bytes,
            "delivery_timeout": delivery_timeout,
            "request_timeout": request_timeout,
        }
        return Producer(
            self._loop.run(
                self._async._producer_core(stream, idempotent, transactional_id, None, options)
            )
        )

    def transaction(
        self,
        transactional_id: str | None,
        *,
        timeout: float = 60.0,
        label: str = "",
        merge_into: str | None = None,
        **options: Any,
    ) -> Transaction:
        """Begin a transaction over any streams::

            with client.transaction("enricher-1") as txn:
                txn.send("demo/orders", b"...", key="k1")
                txn.send("demo/audit", b"...", key="k1")
            # leaving the block commits; an exception aborts

        Readers see all of a committed transaction or nothing of it, never an open or aborted
        one. ``timeout`` (seconds) aborts a transaction left open. ``txn.commit(metadata=...)``
        stores a JSON value atomically with the events (``client.last_commit(id)`` reads it
        back), e.g. how far the input was read. Producer options (``batch_bytes``,
        ``linger_ms``, ``compression``) apply to the transaction's batches.

        With ``transactional_id=None`` the transaction is *anonymous*: it stages events but
        commits only as part of another transaction's commit (``commit(merge=[its txn_id])``),
        for work split over processes (the Spark sink's tasks). ``label`` names it in
        ``slipstream txn list``. ``merge_into``: the transactional id whose commit will merge
        it; in a cluster it then begins at the broker coordinating that id, the only one that
        can merge it.
        """
        return Transaction(
            self._loop,
            self._loop.run(
                self._async._begin(transactional_id, timeout, label, options, merge_into)
            ),
        )

    def last_commit(self, transactional_id: str) -> CommitInfo | None:
        """The last committed transaction of ``transactional_id`` and its metadata, or None."""
        return self._loop.run(self._async.last_commit(transactional_id))

    def hand_over(self, transactional_id: str, subject: str) -> None:
        """Make ``subject`` the owner of ``transactional_id``; see ``AsyncClient.hand_over``."""
        self._loop.run(self._async.hand_over(transactional_id, subject))

    def grant(self, subject: str, action: str, pattern: str) -> AccessRule:
        """Add an access rule; see ``AsyncClient.grant``. Admin only."""
        return self._loop.run(self._async.grant(subject, action, pattern))

    def revoke(self, subject: str, action: str, pattern: str) -> bool:
        """Remove an access rule (False: there was none). Admin only."""
        return self._loop.run(self._async.revoke(subject, action, pattern))

    def rules(self) -> list[AccessRule]:
        """Every access rule. Admin only."""
        return self._loop.run(self._async.rules())

    def check_access(
        self,
        subject: str,
        action: str,
        stream: str,
        *,
        role: str = "user",
        scope: str | None = None,
    ) -> AccessDecision:
        """A dry run; see ``AsyncClient.check_access``. Admin only."""
        return self._loop.run(
            self._async.check_access(subject, action, stream, role=role, scope=scope)
        )

    def transactions(self, at: str | None = None) -> list[TxnInfo]:
        """Open transactions on the broker (id, transactional id, state, age, events, bytes);
        ``at``: see ``AsyncClient.transactions``."""
        return self._loop.run(self._async.transactions(at))

    def identities(self, prefix: str = "") -> list[IdentityInfo]:
        """Transactional ids starting with ``prefix``; see ``AsyncClient.identities``."""
        return self._loop.run(self._async.identities(prefix))

    def abort_transaction(self, txn_id: int, at: str | None = None) -> None:
        """Abort an open transaction by id; ``at``: see ``AsyncClient.abort_transaction``."""
        self._loop.run(self._async.abort_transaction(txn_id, at))

    def create_token(
        self,
        subject: str,
        role: str = "user",
        *,
        scope: str | None = None,
        expires_s: int = 0,
        algorithm: str = "EdDSA",
    ) -> TokenIssued:
        """A new token for ``subject`` (``.token``, shown once) and its claims (``.info``);
        admin only (docs/security.md)."""
        return self._loop.run(
            self._async.create_token(
                subject, role, scope=scope, expires_s=expires_s, algorithm=algorithm
            )
        )

    def revoke_token(self, token_id: str) -> None:
        """Revoke a token by id; connections using it are closed at once. Admin only."""
        self._loop.run(self._async.revoke_token(token_id))

    def list_tokens(self) -> list[TokenInfo]:
        """Tokens the broker issued (ids and claims) and revoked ids. Admin only."""
        return self._loop.run(self._async.list_tokens())

    def set_quota(
        self,
        scope: str,
        *,
        produce_bytes: int | None = None,
        consume_bytes: int | None = None,
        requests: int | None = None,
        connections: int | None = None,
    ) -> list[QuotaInfo]:
        """Set (replace) a scope's quota; see ``AsyncClient.set_quota``."""
        return self._loop.run(
            self._async.set_quota(
                scope,
                produce_bytes=produce_bytes,
                consume_bytes=consume_bytes,
                requests=requests,
                connections=connections,
            )
        )

    def delete_quota(self, scope: str) -> list[QuotaInfo]:
        """Remove a scope's quota; -> every quota left."""
        return self._loop.run(self._async.delete_quota(scope))

    def quotas(self) -> list[QuotaInfo]:
        """Every scope's quota, by scope."""
        return self._loop.run(self._async.quotas())

    def reader(
        self, stream: str, start: Start = "earliest", end: StreamCut | None = None
    ) -> Reader:
        """Iterate over the events of ``stream`` from ``start``.

        ``start``: "earliest", "latest", an ISO-8601 time or datetime (first events at or after
        it), milliseconds since the epoch, or a StreamCut. With ``end`` (a StreamCut, e.g.
        ``client.tail(stream)``) iteration stops there; without it, it follows the tail and
        yields new events as soon as they are durable. Raises OffsetOutOfRange if retention
        removed the start position.
        """
        connection = self._loop.run(self._async.live_connection())
        return Reader(self._loop, connection, stream, start, end, self._async.cluster)

    # --- subscriptions and consumers -------------------------------------------------------

    def create_subscription(
        self,
        stream: str,
        name: str,
        start: Start = "earliest",
        mode: str = "ordered",
        *,
        exist_ok: bool = False,
        **queue_options: Any,
    ) -> SubscriptionInfo:
        """A named, durable cursor on ``stream``, starting at ``start`` ("earliest",
        "latest", a time or a StreamCut, as for :meth:`reader`). Any number of subscriptions
        read one stream independently; each receives every event. Consumers join it with
        :meth:`consumer`.

        ``mode``: ``"ordered"`` (a consumer group: each segment is read by one member at a
        time, in order), ``"queue"`` or ``"key_ordered_queue"`` (work queues: events are
        spread over every member and acknowledged one by one). Queue options:
        ``ack_timeout``, ``backoff`` and ``max_backoff`` (seconds), ``max_deliveries``,
        ``max_unacked``, ``dead_letter`` (a stream name; default ``<stream>.dlq``).
        Raises StreamNotFound, SubscriptionExists (unless ``exist_ok``), InvalidName."""
        return self._loop.run(
            self._async.create_subscription(
                stream, name, start, mode, exist_ok=exist_ok, **queue_options
            )
        )

    def list_subscriptions(self, stream: str) -> list[SubscriptionInfo]:
        """The subscriptions of ``stream`` (name, mode, generation)."""
        return self._loop.run(self._async.list_subscriptions(stream))

    def describe_subscription(self, stream: str, name: str) -> SubscriptionInfo:
        """Per segment: the committed position, the backlog in events and bytes (bytes are
        estimated from the segment's average event size), the lag (``lag_ms``: age of the
        oldest unconsumed event) and which member reads it; and the members."""
        return self._loop.run(self._async.describe_subscription(stream, name))

    def delete_subscription(self, stream: str, name: str) -> None:
        """Delete a subscription; its consumers get SubscriptionNotFound."""
        self._loop.run(self._async.delete_subscription(stream, name))

    def reset_subscription(self, stream: str, name: str, to: Start) -> SubscriptionInfo:
        """Move every position of the subscription to ``to`` ("earliest", "latest", a time
        such as "-1d" or "2026-11-23T00:00Z", or a StreamCut). Live consumers restart from
        there without a restart of their own: how a team reprocesses yesterday."""
        return self._loop.run(self._async.reset_subscription(stream, name, to))

    def commit_subscription(
        self, stream: str, name: str, positions: StreamCut | Mapping[int, int]
    ) -> None:
        """Store positions from outside a group (a Spark query's progress, an operator's
        fix); refused with GroupActive while consumers are joined."""
        self._loop.run(self._async.commit_subscription(stream, name, positions))

    def consumer(
        self,
        stream: str,
        subscription: str,
        *,
        commit: str = "auto",
        name: str | None = None,
        session_timeout: float = 10.0,
        max_in_flight: int = 256,
    ) -> Consumer | QueueConsumer:
        """Join the group of an ``ordered`` subscription and consume its share of segments::

            with client.consumer("demo/orders", "billing") as consumer:
                for event in consumer:
                    handle(event)

        The broker spreads the stream's segments over the group's members (balanced and
        sticky) and moves them when members join, leave or crash (no poll for
        ``session_timeout`` seconds, or the connection closes): only moved segments pause.
        Each segment's events arrive in order, from the subscription's committed position.

        ``commit``: ``"auto"`` (what the application has finished with, i.e. every batch
        before the one it asked for next, is committed about once a second, on a rebalance
        and on close: at-least-once), ``"manual"`` (``consumer.commit()``, or
        ``txn.commit_position(consumer)`` for exactly-once), or ``"at_most_once"`` (each
        batch is committed before it is handed out). ``name`` shows in ``describe`` (default
        host:pid). Raises SubscriptionNotFound.

        A ``queue`` or ``key_ordered_queue`` subscription gives a ``QueueConsumer``
        instead (``commit`` does not apply): iterate for events and settle each with
        ``event.ack()`` or ``event.nack(delay=seconds)``; at most ``max_in_flight`` are
        unsettled at a time. See docs/consumers.md, "Work queues"."""
        mode = self._loop.run(subscription_mode(self._async, stream, subscription))
        if mode in QUEUE_MODES:
            assert mode is not None
            factory = queue_core_factory(
                self._async, stream, subscription, mode, name, session_timeout, max_in_flight
            )
            queue_consumer = QueueConsumer(self._loop, factory)
            self._loop.run(queue_consumer.core.start())
            return queue_consumer
        make = self._async._core_factory(stream, subscription, commit, name, session_timeout)
        consumer = Consumer(self._loop, make)
        self._loop.run(consumer.core.start())
        return consumer


class Producer:
    """The blocking producer; see :meth:`Client.producer`. Use as a context manager: leaving
    the block flushes, so every event sent inside it is acknowledged by then, or the block
    raises the error of those that were not (see :meth:`flush`; when the block raises anyway,
    that error is added to its exception as a note). ``acknowledged`` counts what was stored.
    """

    def __init__(self, core: ProducerCore) -> None:
        self.core = core

    def send(
        self,
        value: bytes,
        key: str | bytes | None = None,
        headers: Mapping[str, bytes] | None = None,
        timestamp: int | None = None,
    ) -> Receipt:
        """Queue one event; returns at once with a Receipt (``receipt.result()`` -> Position).

        ``timestamp`` is the event time in ms since the epoch (default: now). Raises
        BatchTooLarge for an event bigger than a batch.
        """
        return self.core.send(value, key, headers, timestamp)

    def send_many(
        self,
        values: Sequence[bytes] | pa.Array,
        keys: Sequence[str | bytes | None] | pa.Array | None = None,
        timestamps: Sequence[int] | np.ndarray | pa.Array | None = None,
        headers: pa.Array | None = None,
    ) -> BulkReceipt:
        """Queue many events column-wise: a list of bytes or an Arrow binary array. The
        fastest way in; with ``keys``, events are routed per key like ``send``."""
        return self.core.send_many(values, keys, timestamps, headers)

    @property
    def acknowledged(self) -> int:
        """How many events the broker has acknowledged (made durable) so far: with a failure
        from :meth:`flush` or :meth:`close`, what was stored."""
        return self.core.acknowledged

    def flush(self, timeout: float | None = None) -> None:
        """Block until every event sent so far is acknowledged.

        Returns only if every event sent since the previous flush was acknowledged. Otherwise
        raises the typed error of the first batch that failed (StreamNotFound, StorageFull,
        BrokerUnavailable after ``delivery_timeout``, ...), its message saying how many events
        were not acknowledged, also when the failure happened before this call and nobody
        looked at the receipts. Each failure is raised once. TimeoutError if ``timeout``
        seconds pass first (nothing is lost then: flush again)."""
        futures = self.core.flush_nowait()
        _, waiting = concurrent.futures.wait(futures, timeout)
        if waiting:
            raise TimeoutError(
                f"{len(waiting)} batches of {self.core.stream} not acknowledged within {timeout} s"
            )
        failure = self.core.take_failure()
        if failure is not None:
            raise failure

    def close(self) -> None:
        """Flush, then refuse further sends; raises like :meth:`flush`."""
        try:
            self.flush()
        finally:
            self.core.closed = True

    def __enter__(self) -> Producer:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except SlipstreamError as error:  # the block's own exception goes on, with this noted
            exc.add_note(f"and closing the producer raised {type(error).__name__}: {error}")


class Transaction:
    """A blocking transaction; see :meth:`Client.transaction`. ``send`` may be called from any
    thread; leaving the ``with`` block commits (or aborts, on an exception)."""

    def __init__(self, loop: _LoopThread, txn: AsyncTransaction) -> None:
        self._loop = loop
        self._async = txn
        self.txn_id = txn.txn_id
        self.transactional_id = txn.transactional_id

    def _core(self, stream: str) -> ProducerCore:
        core = self._async._cores.get(stream)
        return core if core is not None else self._loop.run(self._async._core(stream))

    def send(
        self,
        stream: str,
        value: bytes,
        key: str | bytes | None = None,
        headers: Mapping[str, bytes] | None = None,
        timestamp: int | None = None,
    ) -> None:
        """Stage one event for ``stream``; visible to readers only once committed."""
        self._core(stream).send(value, key, headers, timestamp)

    def send_many(
        self,
        stream: str,
        values: Sequence[bytes] | pa.Array,
        keys: Sequence[str | bytes | None] | pa.Array | None = None,
        timestamps: Sequence[int] | np.ndarray | pa.Array | None = None,
        headers: pa.Array | None = None,
    ) -> None:
        """Stage many events for ``stream`` column-wise (see :meth:`Producer.send_many`)."""
        self._core(stream).send_many(values, keys, timestamps, headers)

    def flush(self) -> None:
        """Block until every event sent so far is staged (still invisible until commit)."""
        self._loop.run(self._async.flush())

    def commit_position(
        self, consumer: Consumer, positions: StreamCut | Mapping[int, int] | None = None
    ) -> None:
        """Commit the consumer's position (everything it handed out so far, or
        ``positions``) with this transaction: its output and the input it consumed become
        visible together, or neither. Use with ``commit="manual"`` consumers for an
        exactly-once consume-transform-produce loop. If the consumer lost those segments
        meanwhile (or got them again after a reconnect), the commit raises NotAssigned and
        the transaction aborts: the events are delivered again."""
        self._async.commit_position(consumer, positions)

    @property
    def metadata(self) -> Any:
        return self._async.metadata

    @metadata.setter
    def metadata(self, value: Any) -> None:
        """A JSON value to store with the commit (or pass it to ``commit``)."""
        self._async.metadata = value

    def commit(self, metadata: Any = None, merge: Sequence[int] = ()) -> TxnEnded:
        """Commit: every event becomes visible, ``metadata`` is stored with them. Returns
        where the events landed (``ranges``). Raises TransactionAborted if it was aborted
        (timeout, operator, fencing, a broker restart): run it again. ``merge``: see
        :meth:`AsyncTransaction.commit`."""
        return self._loop.run(self._async.commit(metadata, merge))

    def abort(self) -> None:
        self._loop.run(self._async.abort())

    def __enter__(self) -> Transaction:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if kind is None:
            self.commit()
        else:
            self.abort()


class Reader:
    """The blocking reader; see :meth:`Client.reader`. Iterate for events, or call
    ``batches()`` for Arrow record batches (columns key, value, timestamp, headers, segment,
    offset) without per-event decoding."""

    def __init__(
        self,
        loop: _LoopThread,
        connection: Connection,
        stream: str,
        start: Start,
        end: StreamCut | None,
        cluster: Cluster | None = None,
    ) -> None:
        self._loop = loop
        self._queue: queue.SimpleQueue[Delivery] = queue.SimpleQueue()
        self.core = ReaderCore(connection, stream, start, end, self._queue.put, cluster)
        self._started = False

    def _positioned(self) -> Iterator[tuple[int, int, pa.RecordBatch]]:
        if self._started:
            raise InvalidArgument("a reader can be iterated once; create a new one to read again")
        self._started = True
        remaining = set(self._loop.run(self.core.open()))
        try:
            while remaining:
                delivery = self._queue.get()
                if delivery.error is not None:
                    raise delivery.error
                if delivery.payload is None:  # its end; successors may follow
                    remaining.discard(delivery.segment)
                    remaining.update(delivery.opened)
                    continue
                yield from decode_delivery(delivery, self.core)
                self._loop.call(self.core.grant, delivery.segment, len(delivery.payload))
        finally:
            self.close()

    def batches(self) -> Iterator[pa.RecordBatch]:
        for segment, base, record in self._positioned():
            yield with_position(segment, base, record)

    def __iter__(self) -> Iterator[Event]:
        for segment, base, record in self._positioned():
            yield from events_of(record, segment, base)

    def close(self) -> None:
        """Stop following; safe to call twice."""
        if self._loop.thread.is_alive():
            self._loop.run(self.core.close())

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(
    address: str | None = None,
    *,
    timeout: float = 10.0,
    reconnect_timeout: float = 30.0,
    tls: bool | None = None,
    ca: str | os.PathLike[str] | None = None,
    cert: str | os.PathLike[str] | None = None,
    key: str | os.PathLike[str] | None = None,
    token: str | None = None,
) -> Client:
    """Connect to a broker (``SLIPSTREAM_BROKER`` or 127.0.0.1:7070 by default) and handshake.
    Raises BrokerUnavailable if none answers within ``timeout`` seconds. A lost connection is
    dialled again on the next request for up to ``reconnect_timeout`` seconds.

    TLS: ``tls=True`` verifies the broker's certificate against the system's CAs, or ``ca``
    (a PEM file; passing it implies ``tls``), and that it is issued for the host dialled;
    ``cert``/``key`` is a client certificate, for a broker with ``--tls-client-ca``. Each
    defaults to its environment variable (``SLIPSTREAM_TLS``, ``SLIPSTREAM_TLS_CA``,
    ``SLIPSTREAM_TLS_CERT``, ``SLIPSTREAM_TLS_KEY``). Raises TlsError, within ``timeout``,
    when the handshake cannot succeed (a TLS broker dialled without TLS or the reverse, an
    untrusted CA, a wrong host name, a client certificate missing or refused).

    Authentication: ``token`` (default ``SLIPSTREAM_TOKEN``) is presented in the handshake,
    for a broker started with ``--auth``; it refuses a missing, expired, forged, revoked or
    malformed token with AuthenticationFailed, and ends an open connection whose token is
    revoked or expires (the next request raises AuthenticationFailed)."""
    return Client(
        address,
        timeout=timeout,
        reconnect_timeout=reconnect_timeout,
        tls=tls,
        ca=ca,
        cert=cert,
        key=key,
        token=token,
    )

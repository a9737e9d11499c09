"""The broker's Prometheus metrics (docs/metrics.md lists every one with its labels).

Each broker holds its own ``CollectorRegistry`` (``Broker.metrics.registry``), never the
process-wide default one: several brokers may live in one process (tests), and a scrape must
show one broker's numbers. The admin HTTP server serves ``Metrics.asgi_app()`` at
``/metrics``.

Two kinds of metrics, chosen by what the hot path can afford:

* **Counted as things happen**: produced and consumed events and bytes per stream (one lookup
  of the stream's counters per batch or data frame, never per event), append and fsync
  latency histograms, ended transactions, rejected requests, scaling decisions, HTTP
  requests by route and status with their latency, in a cluster how late each lease
  renewal landed.
* **Computed at scrape** by ``_BrokerCollector`` from the state the broker keeps anyway, at
  no cost between scrapes: journal and chunk bytes per container, open connections, open
  transactions, open segments and retained bytes per stream, subscription lag.

Consumed events carry a ``read`` label: ``consume`` for what applications read (follows and
queue-mode fetches, counted by the binary protocol's Session, which pushes them), ``lookup``
for what people look up (``Service.browse_events`` and ``Service.find_events``, counted there
once for every protocol: the admin HTTP API, the console, the binary protocol's FindEvents).
Two values, and a ``lookup`` series only for a stream someone looked into: at most twice the
per-stream series, against a dashboard whose consume rate an operator would move by browsing
the console. Redpanda labels its request bytes the same way (``redpanda_request``: produce or
consume).

Threads: the event loop updates every counter except the fsync histogram, which the
containers' journal threads observe (``timed_fsync`` runs on them); prometheus_client's
metrics take a lock per update, so both are safe. The collector reads loop-owned state
(segments, groups, sessions, open transactions) and must run on the broker's loop thread:
``render`` (``asgi_app``) takes that state there as plain values, then formats the whole
text in the loop's default executor (with 10,000 streams: 50 ms on the loop, 0.5 s off it).
A scrape of the registry from any other thread raises RuntimeError instead of reading state
that the loop is changing.

Counters start at zero when the broker starts (Prometheus' ``rate()`` handles the reset);
a deleted stream's series go with it (``forget_stream``).
"""

from __future__ import annotations

import asyncio
import gzip
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence, Sized
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.exposition import choose_encoder, gzip_accepted
from prometheus_client.metrics_core import GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from ..format import Event
    from ._broker import Broker
    from ._groups import Member
    from ._segment import Segment

T = TypeVar("T")

#: append latency (publish to acknowledgement, fsync included): 100 us to 10 s
APPEND_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0,
)  # fmt: skip
#: one journal fsync (fdatasync): 50 us to 5 s
FSYNC_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
    0.5, 1.0, 2.5, 5.0,
)  # fmt: skip
#: an HTTP request, arrival to the end of its answer: 1 ms to 10 s
HTTP_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
#: how late a lease renewal or member registration lands (docs/operations.md, "Choosing the
#: lease ttl"):
#: 5 ms to 10 s; a renewal later than two thirds of the ttl loses the lease
RENEWAL_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0,
)  # fmt: skip
#: the ``read`` label of consumed events: applications' reads, and people's look-ups
CONSUME, LOOKUP = "consume", "lookup"
#: the ``route`` label of an HTTP request that matched no route (not its path: unbounded)
UNMATCHED_ROUTE = "unmatched"
#: bytes of a journal entry before its batch (the segment's global id)
_ENTRY_PREFIX = 8


class Metrics:
    """The metrics of one broker, and the calls the broker's parts make to update them.

    ``Metrics()`` without a broker is a working instance whose registry nobody serves: what a
    container, controller or coordinator built on its own (tests, benchmarks) counts into."""

    def __init__(self, broker: Broker | None = None) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        per_stream = ["stream"]
        self.produced_events = Counter(
            "slipstream_produced_events",
            "Events appended to the stream (acknowledged appends and applied transaction "
            "commits; staged, aborted and refused ones are not counted)",
            per_stream,
            registry=registry,
        )
        self.produced_bytes = Counter(
            "slipstream_produced_bytes",
            "Bytes of record batches appended to the stream (as stored: headers included, "
            "compressed where the producer compressed)",
            per_stream,
            registry=registry,
        )
        self.consumed_events = Counter(
            "slipstream_consumed_events",
            "Events sent to readers of the stream. read=consume: by follows, the offsets the "
            "reader moved over; by queue-mode fetches, the deliveries (a redelivery counts "
            "again). read=lookup: events a browse or find returned (HTTP API, console, "
            "FindEvents)",
            ["stream", "read"],
            registry=registry,
        )
        self.consumed_bytes = Counter(
            "slipstream_consumed_bytes",
            "Bytes sent to readers of the stream. read=consume: record batches (follows and "
            "queue-mode fetches, which send the whole batches holding their deliveries); "
            "read=lookup: keys, values and headers of the events a browse or find returned",
            ["stream", "read"],
            registry=registry,
        )
        self.append_seconds = Histogram(
            "slipstream_append_seconds",
            "From an Append's arrival to its acknowledgement (durable, or staged in a "
            "transaction); failed appends are not observed",
            registry=registry,
            buckets=APPEND_BUCKETS,
        )
        self.fsync_seconds = Histogram(
            "slipstream_fsync_seconds",
            "One sync of a container's journal (group commit with --fsync always, the "
            "periodic sync with --fsync interval; none with --fsync never)",
            ["container"],
            registry=registry,
            buckets=FSYNC_BUCKETS,
        )
        self.transactions_ended = Counter(
            "slipstream_transactions_ended",
            "Transactions that ended, by outcome (committed, aborted)",
            ["outcome"],
            registry=registry,
        )
        self.rejected_requests = Counter(
            "slipstream_rejected_requests",
            "Error replies sent to clients, by error code (stream_not_found, batch_too_large, ...)",
            ["code"],
            registry=registry,
        )
        self.throttled_seconds = Counter(
            "slipstream_throttled_seconds",
            "Delay imposed on requests of the scope by its quota (quota: produce, consume, "
            "requests): acknowledgements, answers and data pushes held back",
            ["scope", "quota"],
            registry=registry,
        )
        self.scaling_decisions = Counter(
            "slipstream_scaling_decisions",
            "Scales made (kind: split or merge; trigger: manual or policy)",
            ["kind", "trigger"],
            registry=registry,
        )
        self.http_requests = Counter(
            "slipstream_http_requests",
            "Requests to the admin HTTP server (API, console, /metrics), by route template "
            "(not path), method and status",
            ["route", "method", "status"],
            registry=registry,
        )
        self.http_request_seconds = Histogram(
            "slipstream_http_request_seconds",
            "From an HTTP request's arrival to the end of its answer, by route template and method",
            ["route", "method"],
            registry=registry,
            buckets=HTTP_BUCKETS,
        )
        self.lease_renewal_lateness_seconds = Histogram(
            "slipstream_lease_renewal_lateness_seconds",
            "In a cluster: how late a renewal landed in the catalog, after its schedule (the "
            "previous one's landing plus a third of --lease-ttl); renewal: member (the "
            "broker's registration) or lease (a container's). Later than two thirds of the "
            "ttl, the lease has expired and another broker may take the container",
            ["renewal"],
            registry=registry,
            buckets=RENEWAL_BUCKETS,
        )
        self._looked_up: dict[str, tuple[Counter, Counter]] = {}
        self._produced: dict[str, tuple[Counter, Counter]] = {}
        self._consumed: dict[str, tuple[Counter, Counter]] = {}
        self._fsync: dict[int, Histogram] = {}
        self._committed = self.transactions_ended.labels("committed")
        self._aborted = self.transactions_ended.labels("aborted")
        self.broker = broker
        #: what a scrape may read on any thread (their own locks)
        self._thread_safe: list[_Collector] = [
            self.produced_events,
            self.produced_bytes,
            self.consumed_events,
            self.consumed_bytes,
            self.append_seconds,
            self.fsync_seconds,
            self.transactions_ended,
            self.rejected_requests,
            self.scaling_decisions,
            self.throttled_seconds,
            self.http_requests,
            self.http_request_seconds,
            self.lease_renewal_lateness_seconds,
        ]
        self._collector: _BrokerCollector | None = None
        if broker is not None:
            # process_* (memory, CPU, open files)
            self._thread_safe.append(ProcessCollector(registry=registry))
            self._collector = _BrokerCollector(self, broker)
            registry.register(self._collector)
        self._loop_thread: int | None = None

    def attach(self, broker: Broker) -> None:
        """Give the broker's parts (containers, controller, coordinator, service) these
        metrics; the broker calls it in ``open`` on its loop thread, the only thread a scrape
        may run on."""
        for container in broker.containers:
            container.metrics = self
        broker.controller.metrics = self
        broker.coordinator.metrics = self
        broker.service.metrics = self
        self._loop_thread = threading.get_ident()

    # --- scraping ---------------------------------------------------------------------------

    async def render(self, accept: str = "", accept_encoding: str = "") -> tuple[bytes, str, bool]:
        """One scrape, for the broker's loop: (body, content type, gzipped). Only the walk over
        the loop's state (``_BrokerCollector``) runs on the loop; formatting the text, which
        takes most of a scrape's time (4-5 us a sample: about 0.3 s for 10,000 streams with
        a subscription each), runs in the loop's default executor with a snapshot, so the
        loop goes on serving meanwhile. ``accept`` picks the Prometheus text format or
        OpenMetrics, as prometheus-client's own servers do."""
        self.check_thread()
        state = self._collector.take() if self._collector is not None else None
        snapshot = _Snapshot(self._thread_safe, state)
        encoder, content_type = choose_encoder(accept)
        gzipped = gzip_accepted(accept_encoding)

        def bake() -> bytes:
            body = encoder(snapshot)
            return gzip.compress(body) if gzipped else body

        body = await asyncio.get_running_loop().run_in_executor(None, bake)
        return body, content_type, gzipped

    def asgi_app(self) -> AsgiApp:
        """An ASGI app answering every GET with ``render``'s scrape: mount it at ``/metrics``
        of a server on the broker's loop (instead of ``prometheus_client.make_asgi_app``,
        which would format the whole text on the loop)."""

        async def app(scope: dict[str, Any], receive: AsgiReceive, send: AsgiSend) -> None:
            assert scope["type"] == "http"
            headers = {
                k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]
            }
            body, content_type, gzipped = await self.render(
                headers.get("accept", ""), headers.get("accept-encoding", "")
            )
            reply = [(b"content-type", content_type.encode())]
            if gzipped:
                reply.append((b"content-encoding", b"gzip"))
            await send({"type": "http.response.start", "status": 200, "headers": reply})
            await send({"type": "http.response.body", "body": body})

        return app

    # --- updates (hot paths: one dictionary lookup, then the counters' own locks) ---------

    def produced(self, stream: str, events: int, size: int) -> None:
        """A batch was appended to ``stream`` (on the loop, once per batch)."""
        pair = self._produced.get(stream)
        if pair is None:
            pair = self._produced[stream] = (
                self.produced_events.labels(stream),
                self.produced_bytes.labels(stream),
            )
        pair[0].inc(events)
        pair[1].inc(size)

    def consumed(self, segment: Segment, events: int, batches: Sequence[Sized]) -> None:
        """A data frame of ``batches`` went to a reader of ``segment``, moving it over
        ``events`` offsets (on the loop, once per frame)."""
        counted_events, counted_bytes = self._consumers(segment.stream_name)
        counted_events.inc(events)
        counted_bytes.inc(sum(map(len, batches)))

    def delivered(self, member: Member | None, events: int, batches: Sequence[Sized]) -> None:
        """Queue modes: ``events`` deliveries, in ``batches``, went to a member (on the loop,
        once per FetchEvents answer); ``member`` None: it left meanwhile, not counted."""
        if member is None or not events:
            return
        counted_events, counted_bytes = self._consumers(member.group.stream.name)
        counted_events.inc(events)
        counted_bytes.inc(sum(map(len, batches)))

    def looked_up(self, stream: str, events: Sequence[Event]) -> None:
        """A browse or a find of ``stream`` returned ``events`` (the service layer, on the
        loop, once per page): counted with ``read="lookup"``, bytes as keys, values and
        header names and values (what the answer carries, uncompressed)."""
        if not events:
            return
        pair = self._looked_up.get(stream)
        if pair is None:
            pair = self._looked_up[stream] = (
                self.consumed_events.labels(stream, LOOKUP),
                self.consumed_bytes.labels(stream, LOOKUP),
            )
        size = 0
        for event in events:
            size += len(event.value) + (len(event.key) if event.key is not None else 0)
            for name, value in event.headers.items():
                size += len(name.encode()) + len(value)
        pair[0].inc(len(events))
        pair[1].inc(size)

    def _consumers(self, stream: str) -> tuple[Counter, Counter]:
        pair = self._consumed.get(stream)
        if pair is None:
            pair = self._consumed[stream] = (
                self.consumed_events.labels(stream, CONSUME),
                self.consumed_bytes.labels(stream, CONSUME),
            )
        return pair

    def http_requested(self, route: str, method: str, status: int, seconds: float) -> None:
        """An HTTP request to ``route`` (its template, or UNMATCHED_ROUTE) was answered with
        ``status`` after ``seconds`` (on the loop)."""
        self.http_requests.labels(route, method, str(status)).inc()
        self.http_request_seconds.labels(route, method).observe(seconds)

    def appended(self, started: float) -> None:
        """An append was acknowledged; ``started``: ``time.perf_counter()`` at its arrival."""
        self.append_seconds.observe(time.perf_counter() - started)

    def timed_fsync(self, container: int, sync: Callable[[], T]) -> T:
        """Run ``sync`` (a journal's, on its thread) and observe how long it took, also when
        it fails (a failed fsync is worth seeing)."""
        started = time.perf_counter()
        try:
            return sync()
        finally:
            histogram = self._fsync.get(container)
            if histogram is None:
                histogram = self._fsync[container] = self.fsync_seconds.labels(str(container))
            histogram.observe(time.perf_counter() - started)

    def renewed(self, renewal: str, lateness: float) -> None:
        """A member registration or lease renewal (``renewal``: "member" or "lease") landed
        ``lateness`` seconds after it was due (on the loop); early ones count as 0."""
        self.lease_renewal_lateness_seconds.labels(renewal).observe(max(0.0, lateness))

    def transaction_ended(self, committed: bool) -> None:
        (self._committed if committed else self._aborted).inc()

    def rejected(self, code: str) -> None:
        """An error reply with ``code`` went to a client."""
        self.rejected_requests.labels(code).inc()

    def throttled(self, scope: str, quota: str, seconds: float) -> None:
        """A quota of ``scope`` delayed a request by ``seconds`` (on the loop)."""
        self.throttled_seconds.labels(scope, quota).inc(seconds)

    def scaled(self, sealed: int, reason: str) -> None:
        """A scale sealed ``sealed`` segments (1: a split); ``reason`` is "manual" or a
        policy's decision."""
        kind = "split" if sealed == 1 else "merge"
        self.scaling_decisions.labels(kind, "manual" if reason == "manual" else "policy").inc()

    def forget_stream(self, stream: str) -> None:
        """Drop a deleted stream's counters, so its series end with it."""
        for counters, cache, labels in (
            ((self.produced_events, self.produced_bytes), self._produced, (stream,)),
            ((self.consumed_events, self.consumed_bytes), self._consumed, (stream, CONSUME)),
            ((self.consumed_events, self.consumed_bytes), self._looked_up, (stream, LOOKUP)),
        ):
            if cache.pop(stream, None) is not None:
                for counter in counters:
                    counter.remove(*labels)

    def check_thread(self) -> None:
        """Raise unless called on the broker's loop thread (where the collector must run)."""
        if self._loop_thread is not None and threading.get_ident() != self._loop_thread:
            raise RuntimeError(
                "the broker's metrics read loop-owned state: scrape them on the broker's event "
                "loop thread (an ASGI app served on the broker's loop does)"
            )


AsgiReceive = Callable[[], Awaitable[dict[str, Any]]]
AsgiSend = Callable[[dict[str, Any]], Awaitable[None]]
AsgiApp = Callable[[dict[str, Any], AsgiReceive, AsgiSend], Awaitable[None]]


class _Collector(Protocol):
    def collect(self) -> Iterable[Metric]: ...


class _Snapshot:
    """What one ``render`` formats off the loop: the thread-safe metrics, read where the
    formatting runs, and the state the broker's collector took on the loop."""

    def __init__(self, live: list[_Collector], taken: _State | None) -> None:
        self.live = live
        self.taken = taken

    def collect(self) -> Iterator[Metric]:
        for collector in self.live:
            yield from collector.collect()
        if self.taken is not None:
            yield from _families(self.taken)


@dataclass(frozen=True, slots=True)
class _State:
    """What a scrape reads of the loop's state, as plain values (taken on the loop; turned
    into metric families anywhere)."""

    connections: int
    open_transactions: int | None = None  # None: the broker is not open yet
    containers: list[tuple[str, int, int]] = field(default_factory=list)  # journal, chunks
    streams: list[tuple[str, int, int]] = field(default_factory=list)  # open segments, bytes
    lag: list[tuple[str, str, int, float]] = field(default_factory=list)  # events, seconds


class _BrokerCollector:
    """The metrics computed at scrape from the broker's live state: ``take`` reads it on the
    loop thread into plain values, ``families`` makes them metric families on any thread."""

    def __init__(self, metrics: Metrics, broker: Broker) -> None:
        self.metrics = metrics
        self.broker = broker

    def describe(self) -> list[Metric]:
        return []  # names are fixed and distinct from the counters': no check needed

    def collect(self) -> Iterator[Metric]:
        return _families(self.take())

    def take(self) -> _State:
        self.metrics.check_thread()
        broker = self.broker
        if not hasattr(broker, "service"):
            return _State(len(broker.sessions))  # not open yet: nothing else exists
        containers = []
        for container in broker.containers:
            moved = 0
            for segment in list(container.segments.values()):
                moved += segment.bytes - _journal_resident(segment)
            containers.append((str(container.id), container.journal.total_bytes, moved))
        streams = []
        for name, stream in list(broker.controller.streams.items()):
            values = list(stream.segments.values())
            open_segments = sum(1 for s in values if not s.sealed)
            streams.append((name, open_segments, sum(s.bytes for s in values)))
        lag = []
        now_ms = time.time() * 1000
        for group in list(broker.service.subscriptions.groups.values()):
            if group.deleted is not None:
                continue
            backlog, oldest = 0, None
            for number, segment in list(group.stream.segments.items()):
                position = group.position(number)
                if position >= segment.next_offset:
                    continue
                backlog += segment.next_offset - position
                at = _timestamp_at(segment, position)
                if at is not None and (oldest is None or at < oldest):
                    oldest = at
            seconds = 0.0 if oldest is None else max(0.0, now_ms - oldest) / 1000
            lag.append((group.stream.name, group.record.name, backlog, seconds))
        return _State(len(broker.sessions), len(broker.coordinator.open), containers, streams, lag)


def _families(state: _State) -> Iterator[Metric]:
    connections = GaugeMetricFamily(
        "slipstream_connections", "Open client connections (binary protocol)"
    )
    connections.add_metric([], state.connections)
    yield connections
    if state.open_transactions is None:
        return
    transactions = GaugeMetricFamily(
        "slipstream_transactions_open", "Transactions open (or committing) now"
    )
    transactions.add_metric([], state.open_transactions)
    yield transactions
    journal = GaugeMetricFamily(
        "slipstream_journal_bytes",
        "Bytes in the container's journal files (tier 1; moved to chunks and trimmed in the "
        "background)",
        labels=["container"],
    )
    chunks = GaugeMetricFamily(
        "slipstream_chunk_bytes",
        "Bytes of the container's live segments in long-term chunks (tier 2)",
        labels=["container"],
    )
    for container, journal_bytes, chunk_bytes in state.containers:
        journal.add_metric([container], journal_bytes)
        chunks.add_metric([container], chunk_bytes)
    yield journal
    yield chunks
    segments = GaugeMetricFamily(
        "slipstream_stream_open_segments",
        "Open (appendable) segments of the stream",
        labels=["stream"],
    )
    retained = GaugeMetricFamily(
        "slipstream_stream_retained_bytes",
        "Bytes the stream retains (journal and chunks, all segments)",
        labels=["stream"],
    )
    for name, open_segments, retained_bytes in state.streams:
        segments.add_metric([name], open_segments)
        retained.add_metric([name], retained_bytes)
    yield segments
    yield retained
    events = GaugeMetricFamily(
        "slipstream_subscription_lag_events",
        "Events appended to the stream after the subscription's committed positions (all segments)",
        labels=["stream", "subscription"],
    )
    seconds = GaugeMetricFamily(
        "slipstream_subscription_lag_seconds",
        "Age of the oldest event after the subscription's committed positions, by event time "
        "(0 with no backlog); exact to a batch while the backlog starts in the journal, else "
        "the age of the oldest event of the chunk it starts in",
        labels=["stream", "subscription"],
    )
    for stream, subscription, backlog, age in state.lag:
        events.add_metric([stream, subscription], backlog)
        seconds.add_metric([stream, subscription], age)
    yield events
    yield seconds


def _journal_resident(segment: Segment) -> int:
    """Batch bytes of the segment still in the journal (not in chunks): O(its batches)."""
    return sum(b.address.length - _ENTRY_PREFIX for b in segment.journal if not b.lost)


def _timestamp_at(segment: Segment, offset: int) -> int | None:
    """The event time (ms) of the oldest event of the batch holding ``offset``, from memory
    only: the journal's index where it holds the offset, else the oldest event of the newest
    chunk, else of the segment (no catalog read on the loop)."""
    if offset >= segment.chunk_end and segment.journal:
        index = segment.journal_index(offset)
        if index < len(segment.journal):
            return segment.journal[index].min_timestamp
    last = segment.last_chunk
    if last is not None and offset >= last.record.base_offset:
        return last.record.min_timestamp
    return segment.first_timestamp


#: what parts built without a broker (tests, benchmarks) count into: served by nobody
DETACHED = Metrics()

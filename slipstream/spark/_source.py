"""The ``slipstream`` Spark data source: streaming and batch reads.

Planning (offsets, admission control, partitions) runs in Spark's Python planner process on the
driver; ``read()`` runs in Python workers, one partition per task. Offsets are StreamCuts, so a
checkpoint names exact positions in the stream and a replayed micro-batch reads exactly the same
events: a partition is a fixed ``[first, end)`` offset range of one segment, read with a bounded
reader. Batches flow as Arrow from the broker's format to Spark; nothing is decoded per event.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxBytes,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from .._errors import BrokerUnavailable, GroupActive, InvalidArgument, SubscriptionNotFound
from ..client import Client, connect
from ..protocol import StreamInfo
from ..streams import StreamCut
from ._convert import SOURCE_COLUMNS, SOURCE_DDL, to_spark_batch
from ._plan import (
    SegmentSpan,
    SourceOptions,
    TlsOptions,
    cut_to_offset,
    offset_to_cut,
    plan_end,
    resolve_end,
    resolve_start,
    source_options,
    split_ranges,
)

#: broker batches smaller than this are combined before they go to Spark (each Arrow batch
#: costs Spark a little); larger ones go as they are, since combining means copying them
#: (profiled: the copy was a fifth of a worker's time at 64Ki rows per Spark batch)
MIN_ROWS_PER_SPARK_BATCH = 8_192

#: how long a Spark read or write waits for a broker that does not answer (one restarting)
BROKER_PATIENCE_S = 30.0

#: after a failed record of a query's progress in its subscription, wait this long before the
#: next try (planning runs every few milliseconds while a query is idle)
RECORD_RETRY_S = 5.0

log = logging.getLogger(__name__)

_clients: dict[tuple[str, TlsOptions | None], Client] = {}
_clients_lock = threading.Lock()


def connect_patiently(broker: str, tls: TlsOptions | None = None) -> Client:
    """Connect, dialling again for up to BROKER_PATIENCE_S while nothing answers: a broker
    restart should cost a query a pause, not a failure (a lost connection is redialled by
    the client itself for as long)."""
    deadline = time.monotonic() + BROKER_PATIENCE_S
    delay = 0.1
    while True:
        try:
            if tls is None:  # the SLIPSTREAM_TLS_* and SLIPSTREAM_TOKEN variables apply
                return connect(broker, reconnect_timeout=BROKER_PATIENCE_S)
            return connect(
                broker,
                reconnect_timeout=BROKER_PATIENCE_S,
                tls=tls.tls,
                ca=tls.ca,
                cert=tls.cert,
                key=tls.key,
                token=tls.token,  # None: SLIPSTREAM_TOKEN
            )
        except BrokerUnavailable as exc:
            if time.monotonic() + delay > deadline:
                raise BrokerUnavailable(
                    f"{exc} (tried for {BROKER_PATIENCE_S:.0f} s); is the broker running? "
                    'Name it with .option("broker", "host:port")'
                ) from exc
            time.sleep(delay)
            delay = min(delay * 2, 2.0)


def shared_client(broker: str, tls: TlsOptions | None = None) -> Client:
    """One connection per broker per Python process, reused by every task that runs in it
    (Spark reuses its Python workers) and closed when the process exits."""
    with _clients_lock:
        client = _clients.get((broker, tls))
        if client is None:
            client = _clients[broker, tls] = connect_patiently(broker, tls)
        return client


@atexit.register
def _close_clients() -> None:
    with _clients_lock:
        for client in _clients.values():
            client.close()
        _clients.clear()


@dataclass(frozen=True)
class SegmentRange(InputPartition):
    """One Spark partition: events ``[first, end)`` of one segment."""

    segment: int
    first: int
    end: int


class SlipstreamDataSource(DataSource):
    """``spark.readStream.format("slipstream")`` / ``spark.read`` / ``writeStream`` / ``write``.

    Options (keys are case-insensitive): ``broker`` (host:port, or a cluster's list
    ``h1:7070,h2:7070``; default SLIPSTREAM_BROKER or 127.0.0.1:7070), ``stream`` (required),
    ``startingPosition`` (streaming: earliest, latest,
    an ISO time, a time relative to when the query starts such as ``-1h``, or a StreamCut JSON;
    default latest), ``from``/``to`` (batch reads, the same forms, relative to when the read
    is planned; default the whole stream), ``maxEventsPerTrigger``, ``maxBytesPerTrigger``,
    ``maxEventsPerPartition``, ``schema`` (a DDL string: JSON values parsed into these extra
    columns), ``mode`` (PERMISSIVE: malformed values give null columns; FAILFAST: they fail
    the query) and ``subscription`` (streaming: record the query's committed progress in this
    subscription, so that ``describe_subscription`` shows its lag; see
    :class:`SubscriptionProgress`).
    Writes: see :mod:`slipstream.spark._sink`.
    """

    @classmethod
    def name(cls) -> str:
        return "slipstream"

    def schema(self) -> str:
        extra = self.options.get("schema")
        return SOURCE_DDL if not extra else f"{SOURCE_DDL}, {extra}"

    def reader(self, schema: StructType) -> DataSourceReader:
        return BatchReader(source_options(self.options), schema)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return StreamReader(source_options(self.options), schema)

    def writer(self, schema: StructType, overwrite: bool) -> Any:
        from ._sink import BatchWriter

        return BatchWriter(self.options, schema, overwrite)

    def streamWriter(self, schema: StructType, overwrite: bool) -> Any:
        from ._sink import StreamWriter

        return StreamWriter(self.options, schema, overwrite)


def _arrow_schema(schema: StructType) -> pa.Schema:
    names = [f.name.lower() for f in schema.fields]
    clashes = sorted({n for n in names if names.count(n) > 1})
    if clashes:
        raise InvalidArgument(
            f"the schema option names {clashes}, which the source already has "
            f"({', '.join(SOURCE_COLUMNS)}); parse such values with from_json(value) instead"
        )
    return to_arrow_schema(schema, timezone="UTC")


class _Reading:
    """What both readers share: options, the Arrow schema and the driver's connection (made
    lazily and never pickled to the workers)."""

    def __init__(self, options: SourceOptions, schema: StructType) -> None:
        self.options = options
        self.arrow_schema = _arrow_schema(schema)
        self._client: Client | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_client": None}

    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = connect_patiently(self.options.broker, self.options.tls)
        return self._client

    def describe(self) -> StreamInfo:
        return self.client.describe_stream(self.options.stream)

    def spans(self, info: StreamInfo | None = None) -> dict[int, SegmentSpan]:
        """Every segment of every epoch, as planning sees it."""
        info = info or self.describe()
        return {
            s.number: SegmentSpan(
                s.start_offset, s.end_offset if s.sealed else None, tuple(s.predecessors)
            )
            for s in info.segments
        }

    def cut_at(self, position: str) -> StreamCut:
        """A StreamCut for earliest, latest, an ISO time or StreamCut JSON."""
        return self.client.cut(self.options.stream, position)

    def partitions_between(self, start: StreamCut, end: StreamCut) -> Sequence[SegmentRange]:
        ranges = split_ranges(start.positions, end.positions, self.options.events_per_partition)
        return [SegmentRange(segment, first, last) for segment, first, last in ranges]

    def read_range(self, partition: SegmentRange) -> Iterator[pa.RecordBatch]:
        stream = self.options.stream
        start = StreamCut(stream, {partition.segment: partition.first})
        end = StreamCut(stream, {partition.segment: partition.end})
        pending: list[pa.RecordBatch] = []
        rows = 0
        with shared_client(self.options.broker, self.options.tls).reader(
            stream, start, end
        ) as reader:
            for record in reader.batches():
                pending.append(record)
                rows += record.num_rows
                if rows >= MIN_ROWS_PER_SPARK_BATCH:
                    yield self._convert(pending)
                    pending, rows = [], 0
        if pending:
            yield self._convert(pending)

    def _convert(self, records: list[pa.RecordBatch]) -> pa.RecordBatch:
        record = records[0] if len(records) == 1 else pa.concat_batches(records)
        return to_spark_batch(record, self.options.stream, self.arrow_schema, self.options.mode)


class SubscriptionProgress:
    """A streaming query's committed progress, recorded in a subscription of its stream (the
    ``subscription`` option), so that ``describe_subscription`` and ``slipstream subscription
    describe`` show the query's backlog and lag like any consumer group's.

    The record is a mirror, not an input: Spark's checkpoint stays the source of truth for
    where the query reads (and for exactly-once); a new query starts at ``startingPosition``,
    never at the subscription's positions. Only committed offsets are recorded: the end of a
    batch Spark has committed, and the start of each batch it plans (the end of the last
    committed one). A record that fails (broker away, positions refused) is logged and tried
    again with a later batch, at most every RECORD_RETRY_S: it never fails the query. A reset
    or commit by someone else is overwritten by the next record.

    At the query's start, :meth:`claim` creates the subscription at the query's start
    positions if it is missing (also if it is deleted while the query runs), and fails the
    query if consumers are joined to it: their commits and the query's would overwrite each
    other. A consumer that joins later makes the records fail (GroupActive, logged) until it
    leaves."""

    def __init__(self, stream: str, name: str) -> None:
        self.stream = stream
        self.name = name
        self.claimed = False
        self.recorded: dict[int, int] | None = None
        self.failed_at = -RECORD_RETRY_S

    def claim(self, client: Client, start: StreamCut) -> None:
        """Create the subscription at ``start`` if missing; raise GroupActive if a group
        uses it, InvalidArgument if it is a queue."""
        info = client.create_subscription(self.stream, self.name, start, exist_ok=True)
        if info.mode != "ordered":
            raise InvalidArgument(
                f"subscription {self.name!r} of {self.stream!r} is a {info.mode!r} subscription; "
                "a Spark query records its progress only in an ordered one: name another "
                'with .option("subscription", ...)'
            )
        if info.members:
            names = ", ".join(sorted(m.name for m in info.members))
            raise GroupActive(
                f"subscription {self.name!r} of {self.stream!r} has {len(info.members)} "
                f"consumer(s) joined ({names}); a Spark query cannot record its progress where "
                "a consumer group commits its own: stop them, or name another subscription "
                'with .option("subscription", ...)',
                members=len(info.members),
            )
        self.claimed = True

    def record(self, client: Client, committed: StreamCut) -> None:
        """Store ``committed`` (offsets Spark has committed) unless it is stored already;
        the first call claims the subscription (and raises what :meth:`claim` raises)."""
        if not self.claimed:
            self.claim(client, committed)
        positions = dict(committed.positions)
        if positions == self.recorded or time.monotonic() - self.failed_at < RECORD_RETRY_S:
            return
        try:
            try:
                client.commit_subscription(self.stream, self.name, positions)
            except SubscriptionNotFound:  # deleted under the query: create it again
                client.create_subscription(self.stream, self.name, committed, exist_ok=True)
                client.commit_subscription(self.stream, self.name, positions)
        except Exception as exc:  # a mirror: whatever went wrong, the query goes on
            self.failed_at = time.monotonic()
            log.warning(
                "could not record the query's progress in subscription %r of %r (tried again "
                "with a later batch): %s: %s",
                self.name,
                self.stream,
                type(exc).__name__,
                exc,
            )
            return
        self.recorded = positions


class StreamReader(_Reading, DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batches over a stream. Offsets are StreamCut dicts; each micro-batch is the events
    between two cuts, cut by ``maxEventsPerTrigger``/``maxBytesPerTrigger`` (shared fairly over
    segments). A scaled stream's batches follow its segment graph (:func:`._plan.plan_end`): a
    successor is read in a batch only if every predecessor's end is within the batch's end cut,
    so each key's events in a batch come after those of earlier batches, and within a batch
    ordering a key's rows by ``(segment, offset)`` gives append order (successors have higher
    numbers than their predecessors). A cut that does not name a segment (one from before a
    scale) starts it at its end if it precedes a named one, else at its first offset. With the
    ``subscription`` option, committed offsets are recorded there (:class:`SubscriptionProgress`).

    Spark plans one batch at a time: it asks for ``latestOffset(start)`` and ``partitions(start,
    end)`` only once the batch ending at ``start`` is committed (a batch left uncommitted by a
    crash is replayed first, with its logged offsets), so ``start`` is committed progress."""

    def __init__(self, options: SourceOptions, schema: StructType) -> None:
        super().__init__(options, schema)
        self.target: StreamCut | None = None  # Trigger.AvailableNow: never read past this
        self.progress = (
            SubscriptionProgress(options.stream, options.subscription)
            if options.subscription
            else None
        )

    def _record(self, committed: StreamCut) -> None:
        if self.progress is not None:
            self.progress.record(self.client, committed)

    def initialOffset(self) -> dict[str, Any]:
        cut = self.cut_at(self.options.starting_position)
        start = StreamCut(cut.stream, resolve_start(cut.positions, self.spans()))
        self._record(start)
        return cut_to_offset(start)

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.options.max_events_per_trigger is not None:
            return ReadMaxRows(self.options.max_events_per_trigger)
        if self.options.max_bytes_per_trigger is not None:
            return ReadMaxBytes(self.options.max_bytes_per_trigger)
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self.target = self.client.tail(self.options.stream)

    def _start_cut(self, start: dict[str, Any]) -> StreamCut:
        cut = offset_to_cut(start)
        if cut.stream != self.options.stream:
            raise InvalidArgument(
                f"the checkpoint's offsets are for stream {cut.stream!r}, not "
                f"{self.options.stream!r}; use a new checkpoint location for a new stream"
            )
        return cut

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        begin = self._start_cut(start)
        self._record(begin)
        info = self.describe()  # before the tail: a segment sealed now has its end in the tail
        spans = self.spans(info)
        tail = self.target or self.client.tail(self.options.stream)
        positions = resolve_start(begin.positions, spans)
        max_events = self.options.max_events_per_trigger
        max_bytes = self.options.max_bytes_per_trigger
        if isinstance(limit, ReadAllAvailable):
            max_events = max_bytes = None
        elif isinstance(limit, ReadMaxRows):
            max_events = limit.max_rows
        elif isinstance(limit, ReadMaxBytes):
            max_bytes = limit.max_bytes
        sizes = {
            s.number: s.bytes / (s.end_offset - s.start_offset)
            for s in info.segments
            if s.end_offset > s.start_offset
        }
        end = plan_end(positions, tail.positions, spans, max_events, max_bytes, sizes)
        return cut_to_offset(StreamCut(self.options.stream, end))

    def reportLatestOffset(self) -> dict[str, Any]:
        return cut_to_offset(self.client.tail(self.options.stream))

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[SegmentRange]:
        begin = self._start_cut(start)
        self._record(begin)
        finish = self._start_cut(end)
        if not finish.positions.keys() <= begin.positions.keys():
            # a start from an older checkpoint, before a scale: resolve it as latestOffset did
            begin = StreamCut(begin.stream, resolve_start(begin.positions, self.spans()))
        return self.partitions_between(begin, finish)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, SegmentRange)
        return self.read_range(partition)

    def commit(self, end: dict[str, Any]) -> None:
        """Spark committed the batch ending at ``end``: record it in the subscription, if
        any. Nothing else to do: the stream keeps events by retention, not by progress."""
        self._record(self._start_cut(end))

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


class BatchReader(_Reading, DataSourceReader):
    """A bounded read of history between ``from`` and ``to`` (times or StreamCuts); by default
    the whole stream as it is when the query is planned."""

    def partitions(self) -> Sequence[SegmentRange]:
        try:
            spans = self.spans()
            start = resolve_start(self.cut_at(self.options.start).positions, spans)
            end = resolve_end(start, self.cut_at(self.options.end).positions, spans)
        finally:
            self.stop()
        stream = self.options.stream
        return self.partitions_between(StreamCut(stream, start), StreamCut(stream, end))

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, SegmentRange)
        return self.read_range(partition)

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

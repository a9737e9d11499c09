"""The controller: streams and their segments, positions by time, and retention.

It owns the catalog (MetaStore) and the containers; the service calls it, never the storage.

Threads: the event loop owns the stream map and the segments. Catalog writes (create and
delete a stream, retention's chunk removals) and chunk deletions run on the controller's own
``catalog`` thread, one at a time and in order, never on the loop (a SQLite commit waits for
an fsync) and never on the readers' threads (reads must not queue behind them). The MetaStore
takes calls from any thread (SqliteMetaStore serialises its one connection with a lock).
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import logging
import time
import zlib
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

import msgspec
import numpy as np

from .._errors import (
    BrokerUnavailable,
    CorruptData,
    InvalidArgument,
    OffsetOutOfRange,
    SegmentNotFound,
    SlipstreamError,
    StorageError,
    StreamNotFound,
    WrongBroker,
)
from ..format import decode_header, int64_values, read_body
from ..protocol import SegmentInfo, StreamInfo
from ..storage import (
    ChunkRecord,
    Lease,
    LongTermStore,
    MetaStore,
    ScaleRecord,
    SegmentRecord,
    StreamRecord,
)
from ..storage._chunks import ChunkSweep
from ..storage._meta import SegmentChunks
from ..streams import (
    MAX_SEGMENTS,
    KeyRange,
    ProducerTable,
    Rates,
    ScalingDecision,
    ScalingPolicy,
    SegmentLoad,
    decide,
    is_system_stream,
    merge_ranges,
    split_key_space,
    split_range,
    validate_scope,
    validate_stream_name,
)
from ._container import Container
from ._faults import FAULT, PREPARED_PAUSE_S, crash_point, scaling_now_ms
from ._metrics import DETACHED, Metrics
from ._segment import Segment

log = logging.getLogger("slipstream.controller")
T = TypeVar("T")

#: the largest retention limit (time in ms, or bytes) the catalog stores: a signed 64-bit integer
MAX_RETENTION = 2**63 - 1


#: how long a scale keeps trying while a committed transaction's batches are being applied to
#: its segments (``Controller.scale``)
PENDING_RETRY_S = 10.0
#: how long (real seconds) an automatic merge across brokers that a participant refused (its
#: segment not cold) is left alone before it is planned again
REFUSED_MERGE_RETRY_S = 5.0


class RemotePrepare(Protocol):
    """What the brokers serving a merge's other segments answered (_seal.RemotePrepared)."""

    ends: dict[int, int]
    leases: list[Lease]
    deadline_ms: int
    rates: dict[int, Rates]  # their rates as their brokers measured them


class RemoteSeal(Protocol):
    """The coordinator's side of a merge across brokers (_seal.PeerSeals)."""

    async def prepare(
        self, name: str, segments: Collection[Segment], epoch: int, max_rate: float = -1.0
    ) -> RemotePrepare: ...

    async def finish(
        self, name: str, segments: Collection[Segment], epoch: int, *, committed: bool
    ) -> None: ...


class Stream:
    def __init__(
        self,
        stream_id: int,
        name: str,
        retention_ms: int | None,
        retention_bytes: int | None,
        created_ms: int,
        segments: list[Segment],
    ) -> None:
        self.id = stream_id
        self.name = name
        self.retention_ms = retention_ms
        self.retention_bytes = retention_bytes
        self.created_ms = created_ms
        self.segments = {s.number: s for s in segments}
        self.scaling = ""  # the scaling policy's text ("": fixed at the segments it has)
        self.scale_lock = asyncio.Lock()  # one split or merge at a time

    @classmethod
    def from_record(cls, record: StreamRecord, segments: Sequence[Segment]) -> Stream:
        """The stream the catalog's ``record`` describes, with ``segments`` linked."""
        stream = cls(
            record.id,
            record.name,
            record.retention_ms,
            record.retention_bytes,
            record.created_ms,
            [],
        )
        stream.add_segments(segments)
        stream.scaling = record.scaling
        return stream

    @property
    def epoch(self) -> int:
        return max(s.epoch for s in self.segments.values())

    def add_segments(self, segments: Sequence[Segment]) -> None:
        """Successors of a scale (or every segment at start): linked to their predecessors."""
        for segment in segments:
            self.segments[segment.number] = segment
        for segment in segments:
            for number in segment.predecessors:
                predecessor = self.segments.get(number)
                if predecessor is not None and segment.number not in predecessor.successors:
                    predecessor.successors.append(segment.number)

    def segment(self, number: int) -> Segment:
        try:
            return self.segments[number]
        except KeyError:
            raise SegmentNotFound(
                f"stream {self.name!r} has no segment {number}; segments are "
                f"{sorted(self.segments)}",
                stream=self.name,
                segment=number,
            ) from None

    def info(self) -> StreamInfo:
        return StreamInfo(
            self.name,
            [
                SegmentInfo(
                    s.number,
                    s.epoch,
                    s.key_lo,
                    s.key_hi,
                    s.sealed,
                    s.start_offset,
                    s.next_offset,
                    s.bytes,
                    s.first_timestamp,
                    s.last_timestamp,
                    s.predecessors,
                    s.container,
                )
                for s in sorted(self.segments.values(), key=lambda s: s.number)
            ],
            self.retention_ms,
            self.retention_bytes,
            self.created_ms,
            self.epoch,
            self.scaling,
        )


class Controller:
    metrics: Metrics = DETACHED  #: the broker's (``Metrics.attach``)

    def __init__(
        self,
        meta: MetaStore,
        long_term: LongTermStore,
        containers: list[Container],
        read_pool: ThreadPoolExecutor,
    ) -> None:
        self.meta = meta
        self.long_term = long_term
        #: the broker's list (shared, not copied): a takeover swaps a fresh container in
        self.containers = containers
        #: the broker's pool for blocking reads (chunks, journal parts, time lookups, finds)
        self.read_pool = read_pool
        self._catalog = ThreadPoolExecutor(1, thread_name_prefix="catalog")
        self.streams: dict[str, Stream] = {}
        #: ids of streams deleted while this broker ran (a takeover never brings them back)
        self.deleted_ids: set[int] = set()
        #: deletes chunks no record names (failed deletes, uploads never recorded), after
        #: each retention pass once due, on its own thread: a LIST of every chunk is slow
        self.chunk_sweep = ChunkSweep(long_term, meta)
        self._sweeper = ThreadPoolExecutor(1, thread_name_prefix="chunk-sweep")
        self._catalog_version: int | None = None  # as of the last refresh applied
        self._created = 0  # streams created here: a refresh that read before one reads again
        self._refreshing = asyncio.Lock()
        #: automatic merges across brokers the other broker refused (not cold there), by
        #: stream id and segments -> monotonic time before which they are not tried again
        self._refused_merges: dict[tuple[int, tuple[int, ...]], float] = {}

    def close(self) -> None:
        """Finish the catalog writes under way and stop their thread (before the catalog is
        closed)."""
        self.chunk_sweep.stop()
        self._sweeper.shutdown(wait=True)
        self._catalog.shutdown(wait=True)

    async def in_catalog(self, call: Callable[..., T], *args: Any) -> T:
        """Run a catalog write on the catalog thread, after the ones before it."""
        return await asyncio.get_running_loop().run_in_executor(self._catalog, call, *args)

    # --- startup ---------------------------------------------------------------------------

    def recover(self, journals: bool = True) -> dict[str, int]:
        """Load the catalog, then let every container replay its journal (``journals``; in a
        cluster a container's journal is replayed when this broker takes it). Of a segment's
        chunks only their totals and the newest are loaded (``MetaStore.segment_chunks``)."""
        chunks_by_segment = {(c.stream_id, c.segment): c for c in self.meta.segment_chunks()}
        for record in self.meta.streams():
            segments = [
                build_segment(
                    record, s, chunks_by_segment.get((record.id, s.number)), len(self.containers)
                )
                for s in record.segments
            ]
            self._register(Stream.from_record(record, segments))
        # the streams of users: the broker's own (the audit trail) are not news to them
        users = sum(not is_system_stream(name) for name in self.streams)
        totals = {"streams": users, "batches": 0, "skipped": 0}
        for container in self.containers if journals else ():
            for key, value in container.recover().items():
                totals[key] += value
        return totals

    def fresh_segments(
        self,
        records: Sequence[StreamRecord],
        chunks: dict[tuple[int, int], SegmentChunks],
        container: int,
    ) -> list[Segment]:
        """New Segment objects for container ``container``'s segments as the catalog has them
        (a takeover recovers the journal into them before anyone sees them)."""
        return [
            build_segment(record, s, chunks.get((record.id, s.number)), len(self.containers))
            for record in records
            for s in record.segments
            if s.container == container
        ]

    def swap_in(
        self, container: Container, records: Sequence[StreamRecord], segments: list[Segment]
    ) -> None:
        """Serve a taken container: it replaces the old one in the broker's list, and its
        recovered segments replace the old objects in their streams (a stream this broker
        has not loaded yet is added from ``records``, the catalog as the takeover read it).
        A stream deleted since that read keeps its segments out; the segments in the
        container that read did not have (created or scaled since) are served too."""
        self.containers[container.id] = container
        by_id = {record.id: record for record in records}
        fresh: dict[int, list[Segment]] = {}
        for segment in segments:
            fresh.setdefault(segment.stream_id, []).append(segment)
        for stream_id, mine in fresh.items():
            record = by_id[stream_id]
            stream = self.streams.get(record.name)
            if stream is None or stream.id != stream_id:
                if stream is not None or stream_id in self.deleted_ids:
                    for segment in mine:
                        container.segments.pop(segment.global_id, None)
                    continue
                others = [
                    build_segment(record, s, None, len(self.containers))
                    for s in record.segments
                    if s.container != container.id
                ]
                self._register(Stream.from_record(record, [*others, *mine]))
                continue
            for segment in mine:
                old = stream.segments.get(segment.number)
                if old is not None:
                    segment.successors = list(old.successors)
                    old.notify()
                stream.segments[segment.number] = segment
            stream.add_segments(mine)
        # segments in this container that the takeover's read did not have (a stream created
        # or scaled since, here or elsewhere: registered in the container being replaced) are
        # served too, as built from the catalog; nobody wrote to them meanwhile (they were in
        # no served container). Without this the broker held their lease and answered every
        # request for them wrong_broker until the container moved again.
        for stream in self.streams.values():
            for segment in stream.segments.values():
                if segment.container == container.id and not segment.deleted:
                    container.segments.setdefault(segment.global_id, segment)

    def _register(self, stream: Stream) -> None:
        self.streams[stream.name] = stream
        for segment in stream.segments.values():
            self.containers[segment.container].segments[segment.global_id] = segment

    # --- catalog operations ----------------------------------------------------------------

    def stream(self, name: str) -> Stream:
        stream = self.streams.get(name)
        if stream is None:
            validate_stream_name(name)
            raise StreamNotFound(
                f"stream {name!r} does not exist; create it with 'slipstream stream create {name}'",
                stream=name,
            )
        return stream

    async def create_stream(
        self,
        name: str,
        segments: int,
        retention_ms: int | None,
        retention_bytes: int | None,
        scaling: str = "",
        *,
        system: bool = False,
    ) -> Stream:
        """Create a stream: stored in the catalog (on the catalog thread), then served.
        ``system``: the broker's own stream in the reserved scope ``_system`` (the audit
        stream), whose name users may not create.
        ``scaling``: a policy's text (``str(ScalingPolicy)``; "" for none: the segments stay
        as they are unless scaled by hand); the stream starts with at least its
        ``min_segments``. Raises InvalidName, InvalidArgument, StreamExists (also when a
        create of the same name ran first), StorageError / StorageFull when the catalog
        cannot be written."""
        if not (system and is_system_stream(name)):
            validate_stream_name(name)
        if scaling:
            policy = ScalingPolicy.from_text(scaling)
            scaling = str(policy)
            segments = max(segments, policy.min_segments)
            if segments > policy.segment_limit:
                raise InvalidArgument(
                    f"{segments} segments are more than the policy's {policy.segment_limit} "
                    f"({policy}): create fewer, or raise max_segments"
                )
        if not 1 <= segments <= MAX_SEGMENTS:
            raise InvalidArgument(f"segments must be between 1 and {MAX_SEGMENTS}, not {segments}")
        for value, what in ((retention_ms, "retention time"), (retention_bytes, "retention bytes")):
            if value is not None and value <= 0:
                raise InvalidArgument(f"{what} must be positive, not {value}")
        base = zlib.crc32(name.encode())  # spreads streams over containers, stably
        records = [
            SegmentRecord(number, 0, lo, hi, (base + number) % len(self.containers))
            for number, (lo, hi) in enumerate(split_key_space(segments))
        ]
        created_ms = int(time.time() * 1000)
        record = await asyncio.get_running_loop().run_in_executor(
            self._catalog,
            self.meta.create_stream,
            name,
            records,
            retention_ms,
            retention_bytes,
            created_ms,
            scaling,
        )
        self._created += 1
        known = self.streams.get(name)
        if known is not None and known.id == record.id:
            return known  # a refresh found it in the catalog first: keep what it registered
        if known is not None:  # deleted by another broker, not refreshed here yet
            self._forget_stream(known)
        stream = Stream(
            record.id,
            name,
            retention_ms,
            retention_bytes,
            created_ms,
            [
                Segment(record.id, name, r.number, r.epoch, r.key_lo, r.key_hi, r.container)
                for r in records
            ],
        )
        stream.scaling = scaling
        self._register(stream)
        log.info("created stream %s with %d segments (scaling: %s)", name, segments, scaling or "-")
        return stream

    async def update_scaling(self, name: str, scaling: str) -> Stream:
        """Change a stream's scaling policy ("" for none), stored before it returns; the
        automatic scaler applies it from its next pass (its bounds first)."""
        stream = self.stream(name)
        if scaling:
            scaling = str(ScalingPolicy.from_text(scaling))
        try:
            await self.in_catalog(self.meta.update_scaling, stream.id, scaling)
        except StreamNotFound:
            raise StreamNotFound(f"stream {name!r} was deleted", stream=name) from None
        stream.scaling = scaling
        log.info("scaling policy of %s is now %s", name, scaling or "none")
        return stream

    async def delete_stream(self, name: str) -> None:
        """Delete a stream: its catalog entry, then its segments (their appends and reads
        fail with StreamNotFound from here on), then its chunks.

        Keyed by the stream's id, not its name: the name may be created again while this
        runs, and a delete meant for the old stream never touches the new one (a second
        delete of the old one raises StreamNotFound)."""
        stream = self.stream(name)
        try:
            _, chunks = await asyncio.get_running_loop().run_in_executor(
                self._catalog, self.meta.delete_stream, name, stream.id
            )
        except StreamNotFound:
            raise StreamNotFound(f"stream {name!r} was already deleted", stream=name) from None
        if self.streams.get(name) is stream:
            del self.streams[name]
        self.deleted_ids.add(stream.id)
        for segment in stream.segments.values():
            segment.deleted = True
            container = self.containers[segment.container]
            container.segments.pop(segment.global_id, None)
            container.chunk_cache.forget(segment.global_id)
            segment.notify()
        await asyncio.get_running_loop().run_in_executor(self._catalog, self._delete_chunks, chunks)
        self.metrics.forget_stream(name)
        log.info("deleted stream %s (%d chunks removed)", name, len(chunks))

    async def update_retention(
        self, name: str, retention_ms: int | None, retention_bytes: int | None
    ) -> Stream:
        """Change a stream's retention: stored in the catalog (on the catalog thread), then
        applied to the stream, so the next retention pass uses it and a restart keeps it.
        For each limit: None leaves it, 0 removes it, a positive value replaces it. Raises
        StreamNotFound (also when the stream is deleted meanwhile), InvalidArgument,
        StorageError / StorageFull when the catalog cannot be written."""
        stream = self.stream(name)
        for value, what in ((retention_ms, "retention time"), (retention_bytes, "retention bytes")):
            if value is not None and not 0 <= value <= MAX_RETENTION:
                raise InvalidArgument(
                    f"{what} must be positive (or 0 to remove the limit), not {value}"
                )
        try:
            record = await asyncio.get_running_loop().run_in_executor(
                self._catalog, self.meta.update_retention, stream.id, retention_ms, retention_bytes
            )
        except StreamNotFound:
            raise StreamNotFound(f"stream {name!r} was deleted", stream=name) from None
        # from the record, not the arguments: updates of one limit each, racing, keep both
        stream.retention_ms, stream.retention_bytes = record.retention_ms, record.retention_bytes
        log.info(
            "retention of %s is now %s ms, %s bytes (None: no limit)",
            name,
            record.retention_ms,
            record.retention_bytes,
        )
        return stream

    # --- scaling ---------------------------------------------------------------------------

    async def scale(
        self,
        name: str,
        numbers: Sequence[int],
        into: int,
        busy: Callable[[Collection[Segment]], bool],
        reason: str = "manual",
        *,
        served: Callable[[Segment], bool] | None = None,
        remote: RemoteSeal | None = None,
        max_rate: float = -1.0,
    ) -> Stream:
        """Split one open segment into ``into`` successors, or merge adjacent open segments
        into one, in a new epoch. Raises StreamNotFound, SegmentNotFound, InvalidArgument
        (a sealed segment, non-adjacent ones, a bad count).

        The steps, each safe against a crash: (1) the old segments refuse appends
        (``sealing``: SegmentSealed, in memory only); (2) wait until every append they
        took is durable and no transaction that staged into them is still open (``busy``:
        new staging is refused too), so their ends hold everything acknowledged and nothing
        after; (3) one catalog transaction seals them with those ends and adds the
        successors; (4) the successors open. A crash before (3) leaves the old segments
        open after a restart (nothing of the scale happened); after it, the restart finds
        the new epoch whole. A failure of (2) or (3) opens the old segments again.

        In a cluster (``served``: whether this broker serves a segment) a merge may name
        segments other brokers serve: ``remote`` prepares those in step (2) (``PrepareSeal``,
        see _seal.py), step (3) is fenced by every container's lease and the participants'
        deadline, and ``remote`` tells them the outcome. ``max_rate`` >= 0: an automatic
        merge of cold segments, which the participants check against their own rates.

        The catalog refuses step (3) while a committed transaction still has batches to apply
        to an old segment (``MetaStore.scale_stream``, ``pending_txn``): the segments then open
        again for a moment (the batches land) and the scale is tried again, for up to
        ``PENDING_RETRY_S``."""
        stream = self.stream(name)
        async with stream.scale_lock:
            give_up = time.monotonic() + PENDING_RETRY_S
            while True:
                try:
                    old, records, ends = await self._seal(
                        stream, numbers, into, busy, reason, served, remote, max_rate
                    )
                    break
                except InvalidArgument as exc:
                    if "pending_txn" not in exc.details or time.monotonic() > give_up:
                        raise
                    log.info("scaling %s waits for a transaction to be applied: %s", name, exc)
                    await asyncio.sleep(0.05)
            crash_point("scale.after_record")
            successors = [
                Segment(
                    stream.id,
                    name,
                    r.number,
                    r.epoch,
                    r.key_lo,
                    r.key_hi,
                    r.container,
                    predecessors=list(r.predecessors),
                )
                for r in records
            ]
            stream.add_segments(successors)
            now_ms = scaling_now_ms()
            for segment in successors:
                self.containers[segment.container].segments[segment.global_id] = segment
                segment.rates(now_ms)  # measured from its opening (the rules' cool-down)
            others = [s for s in old if served is not None and not served(s)]
            for segment in old:
                if segment in others:  # its broker learns from EndSeal or its refresh
                    segment.next_offset = segment.pending_offset = ends[segment.number]
                segment.sealed, segment.sealing = True, False
                segment.notify()  # followers at its end learn that it ended
        if others and remote is not None:
            await remote.finish(name, others, records[0].epoch, committed=True)
        self.metrics.scaled(len(old), reason)
        log.info(
            "scaled %s in epoch %d: sealed %s at %s, opened %s",
            name,
            records[0].epoch,
            [s.number for s in old],
            ends,
            [r.number for r in records],
        )
        return stream

    async def _seal(
        self,
        stream: Stream,
        numbers: Sequence[int],
        into: int,
        busy: Callable[[Collection[Segment]], bool],
        reason: str,
        served: Callable[[Segment], bool] | None,
        remote: RemoteSeal | None,
        max_rate: float,
    ) -> tuple[list[Segment], list[SegmentRecord], dict[int, int]]:
        """Steps (1) to (3) of ``scale``: the old segments, the successors' records, the ends."""
        name = stream.name
        old = [stream.segment(n) for n in numbers]
        ranges = _successor_ranges(stream, old, into)
        if stream.scaling and reason == "manual":
            _check_bounds(stream, ScalingPolicy.from_text(stream.scaling), old, ranges)
        local = [s for s in old if served is None or served(s)]
        others = [s for s in old if s not in local]
        if others and remote is None:
            raise InvalidArgument(f"segments {[s.number for s in others]} are not served here")
        epoch = stream.epoch + 1
        first = max(stream.segments) + 1
        base = zlib.crc32(name.encode())
        records = [
            SegmentRecord(
                first + i,
                epoch,
                r.lo,
                r.hi,
                (base + first + i) % len(self.containers),
                predecessors=sorted(
                    s.number for s in old if KeyRange(s.key_lo, s.key_hi).overlaps(r)
                ),
            )
            for i, r in enumerate(ranges)
        ]
        for segment in local:
            segment.sealing = True
        prepared = None
        try:
            crash_point("scale.sealing")
            while busy(local) or any(s.pending_offset != s.next_offset for s in local):
                await asyncio.sleep(0.005)
            if others:
                assert remote is not None
                prepared = await remote.prepare(name, others, epoch, max_rate)
                crash_point("scale.prepared")
                if FAULT == "scale.prepared_pause":  # tests: a container moves meanwhile
                    await asyncio.sleep(PREPARED_PAUSE_S)
            crash_point("scale.before_record")
            ends = {s.number: s.next_offset for s in local}
            leases = [] if served is None else self._leases(local)
            record = reason
            if prepared is not None:
                ends.update(prepared.ends)
                leases.extend(prepared.leases)
                if prepared.rates and reason != "manual":  # the decision as its brokers saw it
                    decision = ScalingDecision.from_json(reason).with_rates(prepared.rates)
                    record = decision.to_json().decode()
            await self.in_catalog(
                functools.partial(
                    self.meta.scale_stream,
                    stream.id,
                    epoch,
                    int(time.time() * 1000),
                    ends,
                    records,
                    record.encode(),
                    leases=leases,
                    deadline_ms=None if prepared is None else prepared.deadline_ms,
                )
            )
        except BaseException as exc:
            recorded = False
            if isinstance(exc, StorageError) and prepared is not None:
                recorded = await self._recorded(stream, old)  # the outcome is unknown
            if not recorded:
                for segment in local:
                    segment.sealing = False
                if prepared is not None and not isinstance(exc, StorageError):
                    assert remote is not None
                    await remote.finish(name, others, epoch, committed=False)
                raise
            ends = {s.number: s.next_offset for s in local}
            assert prepared is not None
            ends.update(prepared.ends)
        return old, records, ends

    def _leases(self, segments: Collection[Segment]) -> list[Lease]:
        """The leases of the containers of ``segments`` (served here), which fence a scale."""
        leases = {}
        for segment in segments:
            lease = self.containers[segment.container].lease
            if lease is not None:
                leases[lease.container] = lease
        return list(leases.values())

    async def _recorded(self, stream: Stream, old: Sequence[Segment]) -> bool:
        """After a scale record whose outcome is unknown (the catalog failed mid-commit):
        whether it is in the catalog (its segments sealed there), asked for a few seconds;
        False if the catalog cannot say."""
        for _ in range(20):
            try:
                sealed = await self.in_catalog(
                    self.meta.settle_seal, stream.id, [s.number for s in old], 0
                )
                return len(sealed) == len(old)
            except StorageError:
                await asyncio.sleep(0.25)
        return False

    async def autoscale(
        self,
        busy: Callable[[Collection[Segment]], bool],
        served: Callable[[Segment], bool] | None = None,
        remote: RemoteSeal | None = None,
    ) -> int:
        """One pass of automatic scaling: for every stream with a policy, the decisions of
        ``streams.decide`` on its open segments' rates, applied one by one with their
        reasons (see docs/scaling.md). Returns how many scales it made. A decision that no
        longer applies (the stream was deleted or scaled meanwhile) is logged and skipped.

        In a cluster (``served``) a broker acts on the decisions whose first segment it
        serves: a split of its own segment, or a merge whose other segments another broker
        may serve (``remote``; this broker sees no appends to those, so their rates look
        zero here: the participants check a cold merge against their own rates and refuse
        it when their segments are not cold)."""
        made = 0
        for stream in list(self.streams.values()):
            if not stream.scaling or stream.scale_lock.locked():
                continue
            policy = ScalingPolicy.from_text(stream.scaling)
            now_ms = scaling_now_ms()
            loads = []
            for segment in stream.segments.values():
                if not segment.sealed:
                    tracker = segment.rates(now_ms)
                    loads.append(
                        SegmentLoad(
                            segment.number,
                            KeyRange(segment.key_lo, segment.key_hi),
                            tracker.started_ms,
                            tracker.rates(now_ms),
                        )
                    )
            for decision in decide(policy, loads, now_ms):
                named = [stream.segments[n] for n in decision.segments]
                max_rate = -1.0
                if served is not None:
                    mine = [s for s in named if served(s)]
                    if not served(min(named, key=lambda s: s.number)):
                        continue  # in a cluster: the broker serving the first segment decides
                    if len(mine) < len(named):
                        refused = (stream.id, decision.segments)
                        if (
                            remote is None
                            or self._refused_merges.get(refused, 0) > time.monotonic()
                        ):
                            continue
                        if decision.rule == "cold_300s" and decision.threshold is not None:
                            own = sum(
                                load.rates.of(policy.metric).peak_10s
                                for load in decision.inputs
                                if load.segment in {s.number for s in mine}
                            )
                            max_rate = decision.threshold - own
                stamped = msgspec.structs.replace(decision, at_ms=int(time.time() * 1000))
                into = len(decision.ranges) if decision.action == "split" else 1
                try:
                    await self.scale(
                        stream.name,
                        decision.segments,
                        into,
                        busy,
                        stamped.to_json().decode(),
                        served=served,
                        remote=remote,
                        max_rate=max_rate,
                    )
                except (StreamNotFound, SegmentNotFound, InvalidArgument, WrongBroker) as exc:
                    if max_rate >= 0:  # the other broker measured its segment not cold: later
                        self._refused_merges[stream.id, decision.segments] = (
                            time.monotonic() + REFUSED_MERGE_RETRY_S
                        )
                    log.warning("scaling %s skipped: %s", stream.name, exc)
                    break
                except (BrokerUnavailable, TimeoutError) as exc:
                    log.warning("scaling %s skipped, a broker did not answer: %s", stream.name, exc)
                    break
                made += 1
                log.info("scaled %s automatically: %s", stream.name, decision.reason)
        return made

    def scale_history(self, name: str) -> list[ScaleRecord]:
        """Every split and merge of the stream, oldest first (a catalog read)."""
        return self.meta.scalings(self.stream(name).id)

    def _delete_chunks(self, chunks: Sequence[ChunkRecord]) -> None:
        """Delete chunk files (on the catalog thread), in order, after their records are gone.
        A delete that fails (the store is down) is logged: the chunk is an orphan, which the
        chunk sweep deletes later (``ChunkSweep``), as it does if the broker dies first."""
        for chunk in chunks:
            try:
                self.long_term.delete_chunk(chunk.name)
            except (SlipstreamError, OSError) as exc:
                log.warning(
                    "deleting chunk %s failed, left for the orphan sweep: %s", chunk.name, exc
                )

    def list_streams(self, scope: str | None) -> list[Stream]:
        """The streams of ``scope``, or of every scope but the broker's own ``_system`` (the
        audit trail is listed only when its scope is asked for, like a hidden file)."""
        if scope is not None:
            validate_scope(scope)
        return [
            s
            for name, s in sorted(self.streams.items())
            if name.split("/", 1)[0] == scope or (scope is None and not is_system_stream(name))
        ]

    # --- positions -------------------------------------------------------------------------

    async def cut(
        self,
        name: str,
        at: str,
        timestamp_ms: int | None,
        only: Callable[[Segment], bool] | None = None,
    ) -> dict[int, int]:
        """``{segment: offset}`` of every segment (``only``: of those it accepts)."""
        stream = self.stream(name)
        segments = [s for s in stream.segments.values() if only is None or only(s)]
        if at == "earliest":
            return {s.number: s.start_offset for s in segments}
        if at == "latest":
            return {s.number: s.next_offset for s in segments}
        if at == "time" and timestamp_ms is not None:
            return {s.number: await self._offset_at_time(s, timestamp_ms) for s in segments}
        raise InvalidArgument(
            f"cut 'at' must be earliest, latest or time (with a timestamp), not {at!r}"
        )

    async def _offset_at_time(self, segment: Segment, timestamp_ms: int) -> int:
        """The first offset whose event timestamp is >= ``timestamp_ms`` (the end if none).

        The scan starts at the first chunk (or journal batch) whose newest event is late
        enough: nothing before it is (the catalog finds that chunk, in a reader thread,
        without reading any chunk). It reads forward from there through the container, on
        the loop only batch headers (their newest timestamp); the one batch that holds the
        answer is decoded in a reader thread. A hole (offsets lost to damaged storage; their
        events and times are unknown) is stepped over: the answer is then the first readable
        event at or after the time, never an error.
        """
        container = self.containers[segment.container]
        loop = asyncio.get_running_loop()
        offset = await self._time_floor(segment, timestamp_ms)
        while offset < segment.next_offset:
            try:
                batches = await container.read(
                    segment, max(offset, segment.start_offset), _TIME_SCAN_BYTES
                )
            except CorruptData as exc:
                resume = exc.details.get("resume")
                if resume is None:  # damaged bytes that are not a known hole: say so
                    raise
                offset = max(int(resume), offset + 1)  # always forward
                continue
            except OffsetOutOfRange:
                if offset >= segment.start_offset:
                    raise
                continue  # retention moved the start while we read: from the new start
            if not batches:
                break
            for batch in batches:
                header = decode_header(batch)
                if header.max_timestamp >= timestamp_ms:
                    hit = await loop.run_in_executor(
                        self.read_pool, _first_event_at_or_after, batch, timestamp_ms
                    )
                    if hit is not None:
                        return header.base_offset + hit
                offset = header.next_offset
        return segment.next_offset

    async def _time_floor(self, segment: Segment, timestamp_ms: int) -> int:
        """Where a time lookup starts: the first chunk, or else journal batch, whose newest
        event is at or after ``timestamp_ms`` (no earlier one has such an event). A hole's
        times are a guess (the neighbours'): journal holes are skipped, a chunk that is all
        hole is read (and its hole stepped over)."""
        if segment.last_chunk is not None:
            end = segment.chunk_end
            found = await asyncio.get_running_loop().run_in_executor(
                self.read_pool,
                self.meta.chunk_at_time,
                segment.stream_id,
                segment.number,
                timestamp_ms,
            )
            if found is not None:
                return found.base_offset
            if segment.chunk_end != end:  # the mover made chunks meanwhile: scan them too
                return end
        for batch in segment.journal:
            if not batch.lost and batch.max_timestamp >= timestamp_ms:
                return batch.base_offset
        return segment.next_offset

    # --- retention -------------------------------------------------------------------------

    async def enforce_retention(
        self, now_ms: int | None = None, served: Callable[[Segment], bool] | None = None
    ) -> int:
        """Remove whole old chunks of streams over their time or size limit; returns how many.

        Only chunks (long-term storage) are removed: data still in the journal is young by
        construction and is retained until the mover turns it into chunks. Each segment loses
        a prefix of its chunks, in one catalog statement; the catalog thread plans it, reading
        the chunks it removes (and one more) in pages, never the whole history: the work is
        linear in what is removed, and memory bounded by removing at most
        ``RETENTION_BATCH`` chunks a step.
        """
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        removed = 0
        for stream in list(self.streams.values()):
            if stream.retention_ms is None and stream.retention_bytes is None:
                continue
            while True:
                count = await self._retain(stream, now_ms, served)
                removed += count
                if count < RETENTION_BATCH:
                    break
        # in a cluster one broker sweeps, the one serving container 0 (alone: this one)
        if self.chunk_sweep.due() and self.containers[0].serving:
            await self.sweep_orphaned_chunks()
        return removed

    async def sweep_orphaned_chunks(self) -> list[str]:
        """Delete the chunks that no catalog record names and that are older than the sweep's
        grace (``ChunkSweep``), on the sweep's thread; returns their names. A failed sweep is
        logged and retried at the next pass once due."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._sweeper, self.chunk_sweep.sweep)
        except (SlipstreamError, OSError) as exc:
            log.warning("sweeping orphaned chunks failed, will retry: %s", exc)
            return []

    async def _retain(
        self, stream: Stream, now_ms: int, served: Callable[[Segment], bool] | None = None
    ) -> int:
        """One step of retention for ``stream``: how many chunks it removed. In a cluster
        (``served``) only of the segments this broker serves; the stream's size then counts
        the others as this broker last read them from the catalog."""
        loop = asyncio.get_running_loop()
        # what the catalog thread plans with, taken on the loop
        horizon = None if stream.retention_ms is None else now_ms - stream.retention_ms
        spans = {
            s.number: (s.start_offset, s.chunk_end)
            for s in stream.segments.values()
            if s.last_chunk is not None and (served is None or served(s))
        }
        total = sum(s.bytes for s in stream.segments.values())
        plan = await loop.run_in_executor(
            self._catalog,
            _plan_retention,
            self.meta,
            stream.id,
            spans,
            horizon,
            stream.retention_bytes,
            total,
        )
        if not plan:
            return 0
        cuts = {number: cut for number, (cut, _) in plan.items()}
        records = await loop.run_in_executor(
            self._catalog, self.meta.remove_chunks_before, stream.id, cuts
        )
        by_segment: dict[int, list[ChunkRecord]] = {}
        for record in records:
            by_segment.setdefault(record.segment, []).append(record)
        for number, (cut, first_kept) in plan.items():
            segment = stream.segments[number]
            gone = by_segment.get(number, [])
            segment.start_offset = max(segment.start_offset, cut)
            segment.bytes -= sum(r.bytes for r in gone)
            segment.chunk_count -= len(gone)
            if segment.last_chunk is not None and segment.last_chunk.record.next_offset <= cut:
                segment.last_chunk = None
            self.containers[segment.container].chunk_cache.forget(segment.global_id, cut)
            if first_kept is None and segment.last_chunk is not None:
                first_kept = segment.last_chunk.record.min_timestamp
            segment.first_timestamp = (
                first_kept
                if first_kept is not None
                else min((b.min_timestamp for b in segment.journal), default=None)
            )
        await loop.run_in_executor(self._catalog, self._delete_chunks, records)
        log.info("retention removed %d chunks of %s", len(records), stream.name)
        return len(records)

    # --- several brokers on one catalog ----------------------------------------------------

    async def refresh(self, served: Callable[[int], bool] | None = None) -> bool:
        """Apply what other brokers changed in the catalog to the streams in memory; True if
        the catalog changed since the last refresh (the service then reloads what it caches:
        ``Service.reload_settings``). When it did not, this is one cheap catalog read
        (``MetaStore.catalog_version``).

        Applied: streams created elsewhere (their segments from the catalog: start, newest
        chunk; sealed ones at their end), streams deleted elsewhere or re-created under a new
        id (their segments marked deleted and woken, like ``delete_stream``; their chunks are
        the deleting broker's to remove), successors of a scale (registered in their
        containers), segments sealed elsewhere (woken), retention limits and scaling policy.
        The segments of containers this broker serves (``served``; by default those whose
        ``Container.serving`` is set) keep their objects and live state (offsets, journal,
        producers): refresh only marks them sealed or deleted. A stream scaling here
        meanwhile is left to the next refresh, and so is everything when a stream was created
        here while the catalog was read: the version is then not recorded, and the next call
        reads again. Catalog reads run on
        the catalog thread; StorageError when the catalog cannot be read."""
        async with self._refreshing:
            version = await self.in_catalog(self.meta.catalog_version)
            if version == self._catalog_version:
                return False
            created = self._created
            known = frozenset((s.id, n) for s in self.streams.values() for n in s.segments)
            records, chunks = await self.in_catalog(_read_streams, self.meta, known)
            if served is None:
                served = self._serves
            if created == self._created and self._apply_catalog(records, chunks, served):
                self._catalog_version = version
            return True

    def _apply_catalog(
        self,
        records: Sequence[StreamRecord],
        chunks: Mapping[tuple[int, int], SegmentChunks],
        served: Callable[[int], bool],
    ) -> bool:
        """Make the stream map what ``records`` say (on the loop); False if a stream was
        skipped because it is scaling here (``refresh``)."""
        by_name = {record.name: record for record in records}
        for name, gone in list(self.streams.items()):
            record = by_name.get(name)
            if record is None or record.id != gone.id:
                self._forget_stream(gone)
                log.info("stream %s was deleted by another broker", name)
        complete = True
        for record in records:
            stream = self.streams.get(record.name)
            if stream is None:
                if record.id in self.deleted_ids:
                    continue  # deleted here after the catalog was read
                adopted = [self._adopt(record, s, chunks, served) for s in record.segments]
                self._register(Stream.from_record(record, adopted))
                log.info("stream %s was created by another broker", record.name)
                continue
            if stream.scale_lock.locked():
                complete = False  # its successors are this broker's own to add
                continue
            stream.retention_ms, stream.retention_bytes = (
                record.retention_ms,
                record.retention_bytes,
            )
            stream.scaling = record.scaling
            added = [
                self._adopt(record, s, chunks, served)
                for s in record.segments
                if s.number not in stream.segments
            ]
            if added:  # successors first: followers woken at a sealed end find them
                stream.add_segments(added)
                for segment in added:
                    self.containers[segment.container].segments[segment.global_id] = segment
                log.info(
                    "stream %s was scaled by another broker: segments %s opened",
                    record.name,
                    [s.number for s in added],
                )
            for s in record.segments:
                segment = stream.segments[s.number]
                if s.sealed and not segment.sealed:
                    if not served(segment.container) and s.end_offset >= 0:
                        segment.next_offset = segment.pending_offset = s.end_offset
                    segment.sealed, segment.sealing = True, False
                    segment.notify()
        return complete

    def _serves(self, container: int) -> bool:
        return self.containers[container].serving

    def _adopt(
        self,
        record: StreamRecord,
        s: SegmentRecord,
        chunks: Mapping[tuple[int, int], SegmentChunks],
        served: Callable[[int], bool],
    ) -> Segment:
        """A segment a refresh found in the catalog: the object its container has already (a
        takeover built it), else one built from the catalog; a sealed segment another
        broker serves ends at its recorded end."""
        segment = build_segment(record, s, chunks.get((record.id, s.number)), len(self.containers))
        known = self.containers[segment.container].segments.get(segment.global_id)
        if known is not None:
            return known
        if s.sealed and s.end_offset >= 0 and not served(segment.container):
            segment.next_offset = segment.pending_offset = max(segment.next_offset, s.end_offset)
        return segment

    def _forget_stream(self, stream: Stream) -> None:
        """A stream deleted (here or elsewhere) leaves memory: its appends and reads fail with
        StreamNotFound from here on, its followers wake, its metrics go. Its chunks are left to
        the broker that deleted it."""
        if self.streams.get(stream.name) is stream:
            del self.streams[stream.name]
        self.deleted_ids.add(stream.id)
        for segment in stream.segments.values():
            segment.deleted = True
            container = self.containers[segment.container]
            if container.segments.get(segment.global_id) is segment:
                del container.segments[segment.global_id]
            container.chunk_cache.forget(segment.global_id)
            segment.notify()
        self.metrics.forget_stream(stream.name)


#: the most chunks one retention step removes (and holds the records of)
RETENTION_BATCH = 10_000

#: how much a time lookup reads per trip through the container while it scans batch headers
_TIME_SCAN_BYTES = 1 << 20


def build_segment(
    record: StreamRecord, s: SegmentRecord, chunks: SegmentChunks | None, containers: int
) -> Segment:
    """A segment as the catalog knows it: its newest chunk, totals and producer state, its
    durable end at the end of its chunks (a container's journal recovery adds what follows)."""
    segment = Segment(
        record.id,
        record.name,
        s.number,
        s.epoch,
        s.key_lo,
        s.key_hi,
        s.container % containers,
        start_offset=s.start_offset,
        sealed=s.sealed,
        predecessors=list(s.predecessors),
    )
    if chunks is not None:
        segment.add_chunk(chunks.newest)
        segment.chunk_count = chunks.count
        segment.note_batch(chunks.bytes, chunks.min_timestamp, chunks.max_timestamp)
    # catalogs before SegmentRecord.producers kept the state with the newest chunk
    moved = s.producers or (chunks.newest.producers if chunks is not None else b"")
    segment.moved_producers = moved or None
    segment.producers = ProducerTable.from_snapshot(moved)
    segment.next_offset = segment.pending_offset = segment.chunk_end
    return segment


def _read_streams(
    meta: MetaStore, known: frozenset[tuple[int, int]]
) -> tuple[list[StreamRecord], dict[tuple[int, int], SegmentChunks]]:
    """The catalog's streams and, when it has segments not in ``known`` (stream id, number),
    their chunks' totals (a refresh's read, on the catalog thread): of their streams only,
    not the whole chunk table, which a stream created anywhere would have every broker
    aggregate."""
    records = meta.streams()
    new = {(r.id, s.number) for r in records for s in r.segments} - known
    if not new:
        return records, {}
    return records, {
        (c.stream_id, c.segment): c
        for c in meta.segment_chunks({stream_id for stream_id, _ in new})
        if (c.stream_id, c.segment) in new
    }


def _first_event_at_or_after(
    batch: bytes | bytearray | memoryview, timestamp_ms: int
) -> int | None:
    """Index in ``batch`` of its first event at or after ``timestamp_ms`` (a reader thread's
    work: it decodes the batch)."""
    timestamps = int64_values(read_body(batch).column(2))
    hits = np.flatnonzero(timestamps >= timestamp_ms)
    return int(hits[0]) if len(hits) else None


class _ChunkFront:
    """A segment's chunks from its start, read from the catalog a page at a time, up to
    ``end`` (the chunks the loop knew of when retention began)."""

    PAGE = 512

    def __init__(self, meta: MetaStore, stream_id: int, number: int, start: int, end: int):
        self._meta, self._stream_id, self.number = meta, stream_id, number
        self._page: deque[ChunkRecord] = deque()
        self._next, self._end = start, end
        self.cut = start  # where the segment starts once the chunks popped so far are gone

    def head(self) -> ChunkRecord | None:
        if not self._page and self._next < self._end:
            page = self._meta.chunks_from(self._stream_id, self.number, self._next, self.PAGE)
            self._page.extend(c for c in page if c.next_offset <= self._end)
            full = len(page) == self.PAGE and len(self._page) == len(page)
            self._next = page[-1].base_offset + 1 if full else self._end
        return self._page[0] if self._page else None

    def pop(self) -> ChunkRecord:
        chunk = self._page.popleft()
        self.cut = chunk.next_offset
        return chunk


def _plan_retention(
    meta: MetaStore,
    stream_id: int,
    spans: dict[int, tuple[int, int]],
    horizon: int | None,
    retention_bytes: int | None,
    total: int,
) -> dict[int, tuple[int, int | None]]:
    """Where each segment's retained chunks start (on the catalog thread): the segments that
    lose chunks, each with its new start offset and the first kept chunk's oldest event time
    (None if no chunk is kept). Time retention removes each segment's chunks up to the first
    whose newest event is at or after ``horizon`` (only ever a prefix); size retention then
    removes the oldest chunk of the stream (by newest event) while ``total`` is over the
    limit, and not one more. At most ``RETENTION_BATCH`` chunks in all: the caller repeats."""
    fronts = [_ChunkFront(meta, stream_id, n, start, end) for n, (start, end) in spans.items()]
    budget = RETENTION_BATCH
    if horizon is not None:
        for front in fronts:
            while budget and (head := front.head()) is not None and head.max_timestamp < horizon:
                total -= front.pop().bytes
                budget -= 1
    if retention_bytes is not None:
        heads = [(head.max_timestamp, f.number, f) for f in fronts if (head := f.head())]
        heapq.heapify(heads)
        while budget and total > retention_bytes and heads:
            budget -= 1
            _, number, front = heapq.heappop(heads)
            total -= front.pop().bytes
            if (head := front.head()) is not None:
                heapq.heappush(heads, (head.max_timestamp, number, front))
    return {
        f.number: (f.cut, head.min_timestamp if (head := f.head()) else None)
        for f, (start, _) in zip(fronts, spans.values(), strict=True)
        if f.cut > start
    }


#: the most successors one split makes
MAX_SPLIT = 64


def _successor_ranges(stream: Stream, old: list[Segment], into: int) -> list[KeyRange]:
    """The key ranges of the successors of a split (one segment) or merge (several)."""
    if not old:
        raise InvalidArgument("name the segment to split, or the segments to merge")
    if len({s.number for s in old}) != len(old):
        raise InvalidArgument(f"segments {[s.number for s in old]} name a segment twice")
    for segment in old:
        if segment.sealed or segment.sealing:
            raise InvalidArgument(
                f"segment {segment.number} of {stream.name!r} is sealed (successors "
                f"{segment.successors}); only open segments scale",
                segment=segment.number,
            )
    if len(old) == 1:
        if not 2 <= into <= MAX_SPLIT:
            raise InvalidArgument(f"a split makes 2 to {MAX_SPLIT} segments, not {into}")
        ranges = list(split_range(KeyRange(old[0].key_lo, old[0].key_hi), into))
    else:
        ranges = [merge_ranges([KeyRange(s.key_lo, s.key_hi) for s in old])]
    open_after = sum(not s.sealed for s in stream.segments.values()) - len(old) + len(ranges)
    if open_after > MAX_SEGMENTS:
        raise InvalidArgument(
            f"the stream would have {open_after} open segments, above the limit of "
            f"{MAX_SEGMENTS}: merge first"
        )
    return ranges


def _check_bounds(
    stream: Stream, policy: ScalingPolicy, old: list[Segment], ranges: list[KeyRange]
) -> None:
    """A scale by hand stays within the stream's policy (min and max segments)."""
    after = sum(not s.sealed for s in stream.segments.values()) - len(old) + len(ranges)
    if after > policy.segment_limit:
        raise InvalidArgument(
            f"that makes {after} open segments, above the policy's {policy.segment_limit} "
            f"({policy}): raise max_segments first (stream update)"
        )
    if after < policy.min_segments:
        raise InvalidArgument(
            f"that leaves {after} open segments, below the policy's {policy.min_segments} "
            f"({policy}): lower min_segments first (stream update)"
        )

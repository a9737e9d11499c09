"""Merging segments served by different brokers of a cluster (docs/cluster.md, "Scaling across
brokers"): a two-phase seal with the catalog as the decider.

The broker serving a merge's lowest-numbered segment coordinates it (``Controller.scale``):
it closes its own segments, asks the broker serving each of the others to *prepare* them
(``PrepareSeal``: refuse appends, make everything acknowledged durable, answer the ends, the
containers' lease epochs and a deadline on the catalog's clock), then writes the scale record
in one catalog transaction fenced by every container's lease and by the earliest deadline
(``MetaStore.scale_stream(leases=..., deadline_ms=...)``), and tells them the outcome
(``EndSeal``). The record is the decision: once it is in the catalog the merge happened.

A participant whose coordinator goes silent does not keep its segments closed: past the
deadline it asks the catalog (``MetaStore.settle_seal``, which locks the segments' rows and
checks the clock, so a record can no longer land after it answered): sealed there -> sealed
here (the refresh reads the successors), not -> open again. A container that moves while
prepared fences the record (its lease epoch changed): the merge fails, and the new holder
serves the segments as the catalog has them (open). While prepared a segment also refuses
another broker's committed transaction's batches (``ApplyBatch``, which that broker retries):
the record is refused while such a commit is pending anyway (``scale_stream``), and a batch
landing after the ends were answered would fall past the sealed end.

Threads: the loop only; catalog calls go through ``Controller.in_catalog``. Tasks: the
participants' deadline watchers, owned by ``Preparations`` (``close`` cancels them).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field

from .._errors import (
    InvalidArgument,
    SlipstreamError,
    StorageError,
    StreamNotFound,
)
from ..protocol import Done, EndSeal, Message, PrepareSeal, SealPrepared
from ..storage import Lease
from ..streams import Rates, ScalingPolicy, WindowRates
from ..streams._scaling import LONG_WINDOW_MS
from ._cluster import Cluster
from ._controller import Controller, Stream
from ._faults import scaling_now_ms
from ._peers import Peers, gather_answers
from ._segment import Segment

log = logging.getLogger("slipstream.seal")

#: how long (catalog clock, from its answer) a participant keeps prepared segments closed
#: waiting for the coordinator's EndSeal before it settles them from the catalog
SEAL_DEADLINE_MS = 5000
#: how long a participant waits for its segments' appends and transactions when preparing
PREPARE_WAIT_MS = 3000


@dataclass
class RemotePrepared:
    """What the participants answered for a merge's segments they serve."""

    ends: dict[int, int]
    leases: list[Lease]
    deadline_ms: int
    #: their rates as their brokers measured them (for the merge's recorded decision)
    rates: dict[int, Rates] = field(default_factory=dict)


class PeerSeals:
    """The coordinator's side: ask the brokers serving ``segments`` to prepare them, and tell
    them the outcome."""

    def __init__(self, peers: Peers, cluster: Cluster) -> None:
        self.peers = peers
        self.cluster = cluster

    def _owners(self, segments: Collection[Segment]) -> dict[str, list[Segment]]:
        by_owner: dict[str, list[Segment]] = {}
        for segment in segments:
            owner = self.cluster.owners[segment.container]
            if not owner or owner == self.cluster.broker_id:
                raise self.cluster.wrong_broker(
                    segment.container, f"segment {segment.number} of {segment.stream_name!r}"
                )
            by_owner.setdefault(owner, []).append(segment)
        return by_owner

    async def prepare(
        self, name: str, segments: Collection[Segment], epoch: int, max_rate: float = -1.0
    ) -> RemotePrepared:
        """Prepare ``segments`` on the brokers serving them, all at once. If any refuses or
        does not answer, every one is told to reopen and the first error is raised (WrongBroker
        while a container moves: the caller may try again)."""
        numbers = {o: sorted(s.number for s in mine) for o, mine in self._owners(segments).items()}
        asked: dict[str, Message] = {
            owner: PrepareSeal(name, mine, epoch, self.cluster.broker_id, PREPARE_WAIT_MS, max_rate)
            for owner, mine in numbers.items()
        }
        answers = await gather_answers(self.peers, asked)
        failed = [a for a in answers.values() if not isinstance(a, SealPrepared)]
        if failed:
            await self.finish(name, segments, epoch, committed=False)
            error = failed[0]
            if isinstance(error, SlipstreamError):
                raise error
            raise SlipstreamError(f"unexpected answer to PrepareSeal: {type(error).__name__}")
        ends: dict[int, int] = {}
        leases: list[Lease] = []
        rates: dict[int, Rates] = {}
        deadline = None
        for owner, answer in answers.items():
            assert isinstance(answer, SealPrepared)
            ends.update(zip(numbers[owner], answer.ends, strict=True))
            if len(answer.rates) == len(numbers[owner]):  # none from an older broker
                rates.update(zip(numbers[owner], map(_rates_of, answer.rates), strict=True))
            leases.extend(
                Lease(c, owner, e, 0) for c, e in zip(answer.containers, answer.leases, strict=True)
            )
            deadline = answer.deadline_ms if deadline is None else min(deadline, answer.deadline_ms)
        assert deadline is not None
        return RemotePrepared(ends, leases, deadline, rates)

    async def finish(
        self, name: str, segments: Collection[Segment], epoch: int, *, committed: bool
    ) -> None:
        """Tell the participants the outcome (best effort: one that does not hear it settles
        its segments from the catalog after the deadline, or reads the record on its next
        refresh)."""
        try:
            by_owner = self._owners(segments)
        except SlipstreamError:
            by_owner = {}
            for segment in segments:
                owner = self.cluster.owners[segment.container]
                if owner and owner != self.cluster.broker_id:
                    by_owner.setdefault(owner, []).append(segment)
        told: dict[str, Message] = {
            owner: EndSeal(name, sorted(s.number for s in mine), epoch, committed)
            for owner, mine in by_owner.items()
        }
        answers = await gather_answers(self.peers, told)
        for owner, answer in answers.items():
            if not isinstance(answer, Done):
                log.warning(
                    "broker %s did not hear that the merge of %s (epoch %d) %s: %s; it settles "
                    "from the catalog",
                    owner,
                    name,
                    epoch,
                    "was recorded" if committed else "failed",
                    answer,
                )


@dataclass
class _Prepared:
    stream: Stream
    segments: list[Segment]
    epoch: int
    coordinator: str
    deadline_ms: int = 0
    ended: bool = False
    watcher: asyncio.Task[None] | None = field(default=None, repr=False)


class Preparations:
    """The participant's side: segments this broker prepared for another broker's merge."""

    def __init__(
        self,
        controller: Controller,
        busy: Callable[[Collection[Segment]], bool],
        refresh: Callable[[], Awaitable[bool]],
    ) -> None:
        self.controller = controller
        self.busy = busy
        self.refresh = refresh
        self._prepared: dict[tuple[int, int], _Prepared] = {}  # (stream id, number)
        self._watchers: set[asyncio.Task[None]] = set()

    async def prepare(
        self,
        stream: Stream,
        numbers: Sequence[int],
        epoch: int,
        coordinator: str,
        wait_ms: int,
        max_rate: float,
        leases: Callable[[Segment], Lease],
    ) -> SealPrepared:
        """Close ``numbers`` for the merge ``coordinator`` makes in ``epoch`` (see
        ``PrepareSeal``); ``leases``: a served segment's container lease (WrongBroker if this
        broker lost it). Raises InvalidArgument for a sealed or closing segment, segments that
        are not cold enough (``max_rate``), or ones still busy after ``wait_ms``; they are then
        open again."""
        segments = [stream.segment(n) for n in numbers]
        for segment in segments:
            if segment.sealed or segment.sealing:
                raise InvalidArgument(
                    f"segment {segment.number} of {stream.name!r} is sealed or being sealed "
                    "by another scale",
                    segment=segment.number,
                )
        if max_rate >= 0:
            _check_cold(stream, segments, max_rate)
        contracts = [leases(s) for s in segments]
        entry = _Prepared(stream, segments, epoch, coordinator)
        for segment in segments:
            segment.sealing = True
            self._prepared[segment.stream_id, segment.number] = entry
        try:
            give_up = time.monotonic() + wait_ms / 1000
            while self.busy(segments) or any(s.pending_offset != s.next_offset for s in segments):
                if entry.ended:
                    raise InvalidArgument(f"the merge of {stream.name!r} was called off")
                if time.monotonic() > give_up:
                    raise InvalidArgument(
                        f"segments {list(numbers)} of {stream.name!r} still had appends or "
                        f"transactions under way after {wait_ms} ms: merge them later"
                    )
                await asyncio.sleep(0.005)
            ends = [s.next_offset for s in segments]
            now = await self.controller.in_catalog(self.controller.meta.clock_ms)
            if entry.ended:
                raise InvalidArgument(f"the merge of {stream.name!r} was called off")
        except BaseException:
            self._reopen(entry)
            raise
        entry.deadline_ms = now + SEAL_DEADLINE_MS
        entry.watcher = asyncio.get_running_loop().create_task(self._watch(entry))
        self._watchers.add(entry.watcher)
        entry.watcher.add_done_callback(self._watchers.discard)
        log.info(
            "prepared segments %s of %s for %s's merge (epoch %d) at ends %s",
            list(numbers),
            stream.name,
            coordinator,
            epoch,
            ends,
        )
        now_ms = scaling_now_ms()
        return SealPrepared(
            ends,
            [c.container for c in contracts],
            [c.epoch for c in contracts],
            entry.deadline_ms,
            [_rates_row(s.rates(now_ms).rates(now_ms)) for s in segments],
        )

    async def end(
        self, stream: Stream, numbers: Sequence[int], epoch: int, committed: bool
    ) -> None:
        """The coordinator's outcome (``EndSeal``). Recorded: the catalog is read now (the
        refresh marks the segments sealed and adds the successors). Failed: open again."""
        entries = {
            id(e): e
            for n in numbers
            if (e := self._prepared.get((stream.id, n))) is not None and e.epoch == epoch
        }
        for entry in entries.values():
            if committed:
                await self.refresh()
                if all(s.sealed for s in entry.segments):
                    self._forget(entry)
                # else: the watcher settles them from the catalog at the deadline
            else:
                self._reopen(entry)

    async def _watch(self, entry: _Prepared) -> None:
        """Past the deadline without an outcome: settle from the catalog."""
        await asyncio.sleep(SEAL_DEADLINE_MS / 1000)
        numbers = [s.number for s in entry.segments]
        while not entry.ended:
            try:
                sealed = await self.controller.in_catalog(
                    self.controller.meta.settle_seal, entry.stream.id, numbers, entry.deadline_ms
                )
            except StreamNotFound:
                self._forget(entry)  # deleted meanwhile: the refresh marks its segments
                return
            except (InvalidArgument, StorageError) as exc:  # too early by the catalog's clock
                log.info("settling prepared segments of %s later: %s", entry.stream.name, exc)
                await asyncio.sleep(0.2)
                continue
            if entry.ended:
                return
            if sealed:
                await self.refresh()
                for segment in entry.segments:  # the refresh marked them, unless it could not
                    if not segment.sealed:
                        segment.sealed, segment.sealing = True, False
                        segment.notify()
                self._forget(entry)
                log.info(
                    "%s's merge of %s (epoch %d) was recorded: segments %s sealed at %s",
                    entry.coordinator,
                    entry.stream.name,
                    entry.epoch,
                    numbers,
                    sealed,
                )
            else:
                log.warning(
                    "%s never told the outcome of its merge of %s (epoch %d) and the catalog "
                    "has no record of it: segments %s take appends again",
                    entry.coordinator,
                    entry.stream.name,
                    entry.epoch,
                    numbers,
                )
                self._reopen(entry)
            return

    def _reopen(self, entry: _Prepared) -> None:
        for segment in entry.segments:
            if not segment.sealed:
                segment.sealing = False
        self._forget(entry)

    def _forget(self, entry: _Prepared) -> None:
        entry.ended = True
        for segment in entry.segments:
            key = (segment.stream_id, segment.number)
            if self._prepared.get(key) is entry:
                del self._prepared[key]
        watcher = entry.watcher
        if watcher is not None and watcher is not asyncio.current_task():
            watcher.cancel()

    async def close(self) -> None:
        watchers = list(self._watchers)
        for watcher in watchers:
            watcher.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)


def _rates_row(rates: Rates) -> list[float]:
    """``rates`` as ``SealPrepared.rates`` sends them."""
    windows = (rates.events, rates.bytes)
    return [float(rates.measured_ms)] + [
        r for w in windows for r in (w.last_10s, w.last_60s, w.last_300s, w.peak_10s)
    ]


def _rates_of(row: Sequence[float]) -> Rates:
    """A ``SealPrepared.rates`` row as Rates (zero where it is short)."""
    padded = [*row, *[0.0] * 9][:9]
    return Rates(int(padded[0]), WindowRates(*padded[1:5]), WindowRates(*padded[5:9]))


def _check_cold(stream: Stream, segments: Sequence[Segment], max_rate: float) -> None:
    """An automatic merge of cold segments: refused unless these, measured here (where their
    appends land) long enough, carried less than ``max_rate`` at their 10 s peak."""
    if not stream.scaling:
        raise InvalidArgument(f"stream {stream.name!r} has no scaling policy any more")
    metric = ScalingPolicy.from_text(stream.scaling).metric
    now_ms = scaling_now_ms()
    rate = 0.0
    for segment in segments:
        tracker = segment.rates(now_ms)
        if now_ms - tracker.started_ms < LONG_WINDOW_MS:
            raise InvalidArgument(
                f"segment {segment.number} of {stream.name!r} has been measured here for less "
                "than the merge rule's window: not yet"
            )
        rate += tracker.rates(now_ms).of(metric).peak_10s
    if rate >= max_rate:
        raise InvalidArgument(
            f"segments {[s.number for s in segments]} of {stream.name!r} carried up to "
            f"{rate:,.0f} {metric}/s here, not below {max_rate:,.0f}: not cold, no merge"
        )

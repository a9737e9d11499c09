"""Find events by routing key and by time, reading only the batches that may hold them.

Where the candidates come from, per segment:

* **Chunks** (long-term storage): each chunk's find index (storage/_index.py), stored in the
  catalog by the mover, names the batches holding a key's 32-bit hash and every batch's time
  range. A chunk whose time range misses the window is skipped from its catalog row alone; a
  chunk without a usable index (moved before find indexes existed, indexing switched off, or
  its index damaged) has every batch as a candidate: it is scanned.
* **The journal** (the segment's newest batches, not yet in chunks): its batches' times and
  key hashes are in memory (``JournalBatch.keys``): hashed at append, while the journal writes
  the group, and again by recovery for the batches that survive a restart, so a find on a
  fresh tail or right after a restart reads only the batches holding the key. They are not
  persisted: the mover writes the same hashes into the chunks' indexes. A batch without them
  (indexing off, or a body that did not decode) is read, and the first find that reads it
  keeps its hashes.

Every candidate is read through ``Container.read`` (CRC-checked, holes and retention handled as
for any read) and decoded in a reader thread; its events are compared exactly (the key's bytes,
the time), so a hash collision costs one batch read, never a wrong answer.

Order and limits. With a key, a key's events come from the segments whose key range held its
hash, in every epoch, taken in epoch order: that is the key's append order (a scale seals a
segment before its successors take the key). Without a key, events are ordered by
``(timestamp, segment epoch, segment, offset)``. ``limit`` keeps the first (or, newest first,
the last) events of that order; finds stop reading once nothing unread can be among them (for
time order: once the unread batches' time bounds cannot beat the events found).

In a cluster (``find_in_cluster``) only the broker serving a segment has its journal and its
newest chunks, so a broker searches the segments it serves and, at the same time, asks each
broker serving others for its part (``FindEvents`` with ``local``: the same find over the
segments it serves). Each part holds the first ``limit`` events of the order among its own
segments, so the first ``limit`` of all the parts merged in that order are exactly what one
broker holding every segment would return (``merge_found``).
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import pyarrow as pa

from .._errors import (
    BrokerUnavailable,
    CorruptData,
    InvalidArgument,
    OffsetOutOfRange,
    SlipstreamError,
    WrongBroker,
)
from ..format import (
    EVENT_SCHEMA,
    Event,
    decode_header,
    events_of,
    int64_values,
    numpy_array,
    read_body,
)
from ..protocol import EventsFound, FindEvents
from ..storage import (
    ChunkRecord,
    FindIndex,
    MetaStore,
    batch_holds,
    batches_key_hashes,
    key_hash32,
)
from ..streams import key_hash
from ._peers import gather_answers
from ._segment import Chunk, JournalBatch, Segment

if TYPE_CHECKING:
    from ._container import Container
    from ._service import Service

#: the most events one find returns
MAX_FIND_LIMIT = 10_000
#: a find stops adding events past this many bytes of keys and values (then ``truncated``)
MAX_FIND_BYTES = 4 * 1024 * 1024
_ALL_CHUNKS = 1 << 62


@dataclass(frozen=True, slots=True)
class FoundEvents:
    """A find's answer: ``events`` in the order asked for (newest first, or oldest first);
    ``batches_read``: how many batches it decoded (what the indexes saved is the rest);
    ``truncated``: it stopped at ``MAX_FIND_BYTES`` before ``limit``; ``searched``: the
    numbers of the segments it covers (a cluster's local find names them for the asker)."""

    events: list[Event]
    batches_read: int
    truncated: bool = False
    searched: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class _Candidate:
    """A batch that may hold matches: where it starts and ends (offsets), its length in bytes,
    its time bounds, and its journal entry if it is in the journal (a find that reads one
    without key hashes gives it them)."""

    offset: int
    end: int
    length: int
    min_ts: int
    max_ts: int
    journal: JournalBatch | None = None


class Finder:
    """Runs finds for the service. Reader threads (``read_pool``) load catalog rows and decode
    batches; the loop only plans and reads through the containers."""

    def __init__(
        self,
        meta: MetaStore,
        containers: Sequence[Container],
        read_pool: ThreadPoolExecutor,
    ) -> None:
        self.meta = meta
        self.containers = containers
        self.read_pool = read_pool
        #: decoded find indexes of chunks, least recently used dropped beyond this
        self.index_cache_bytes = 64 * 1024 * 1024
        self._indexes: OrderedDict[tuple[int, int], tuple[FindIndex | None, int]] = OrderedDict()
        self._indexes_bytes = 0
        self._indexes_lock = threading.Lock()

    async def find(
        self,
        segments: Sequence[Segment],
        *,
        key: bytes | None,
        start_ms: int | None,
        end_ms: int | None,
        limit: int,
        newest_first: bool,
    ) -> FoundEvents:
        """Events of ``segments`` (a stream's, every epoch) matching ``key`` (any if None) with
        a time in ``[start_ms, end_ms)``; see the module docstring for order and limits.
        Raises InvalidArgument for a bad limit or window, StreamNotFound if the stream is
        deleted meanwhile, CorruptData for damaged bytes in a candidate batch (holes, offsets
        lost to damaged storage, are stepped over)."""
        check_find_arguments(start_ms, end_ms, limit)
        state = _Search(limit)
        if key is not None:
            h = key_hash(key)
            chain = sorted(
                (s for s in segments if s.key_lo <= h <= s.key_hi),
                key=lambda s: (s.epoch, s.number),
                reverse=newest_first,
            )
            for segment in chain:
                found = await self._search(segment, key, start_ms, end_ms, newest_first, state)
                state.events.extend(found)
                if len(state.events) >= limit or state.truncated:
                    break
            return FoundEvents(state.events[:limit], state.batches_read, state.truncated)
        gathered: list[tuple[tuple[int, int, int, int], Event]] = []
        for segment in segments:
            found = await self._search(segment, None, start_ms, end_ms, newest_first, state)
            gathered.extend(((e.timestamp, segment.epoch, e.segment, e.offset), e) for e in found)
            if state.truncated:
                break
        gathered.sort(key=lambda item: item[0], reverse=newest_first)
        events = [e for _, e in gathered[:limit]]
        return FoundEvents(events, state.batches_read, state.truncated)

    async def _search(
        self,
        segment: Segment,
        key: bytes | None,
        start_ms: int | None,
        end_ms: int | None,
        newest_first: bool,
        state: _Search,
    ) -> list[Event]:
        """Matches in one segment, in the direction asked: with a key, up to the limit still
        open; without, at least the segment's best ``limit`` in time order."""
        loop = asyncio.get_running_loop()
        container = self.containers[segment.container]
        h32 = None if key is None else key_hash32(key)
        # The journal first (on the loop), then the chunks before where it began: a chunk the
        # mover makes meanwhile holds batches of this journal snapshot, which reads still find.
        journal_start = segment.chunk_end
        journal = [
            b
            for b in segment.journal
            if not b.lost
            and b.base_offset >= journal_start
            and _overlaps(b.min_timestamp, b.max_timestamp, start_ms, end_ms)
        ]
        records: list[ChunkRecord] = []
        if segment.last_chunk is not None:
            listed = await loop.run_in_executor(
                self.read_pool,
                self.meta.chunks_from,
                segment.stream_id,
                segment.number,
                0,
                _ALL_CHUNKS,
            )
            records = [r for r in listed if r.base_offset < journal_start]
        # Parts in offset order: each chunk, then the journal; each with its time bounds.
        parts: list[tuple[str, object, int, int]] = [
            ("chunk", r, r.min_timestamp, r.max_timestamp)
            for r in records
            if r.next_offset > r.base_offset
        ]
        if journal:
            parts.append(
                (
                    "journal",
                    journal,
                    min(b.min_timestamp for b in journal),
                    max(b.max_timestamp for b in journal),
                )
            )
        # Bounds on what the parts not yet searched hold, for the time-ordered early stop.
        order = list(range(len(parts)))
        if newest_first:
            order.reverse()
        found: list[Event] = []
        remaining_bound = _remaining_bounds(parts, order, newest_first)
        for step, i in enumerate(order):
            if key is None and _done(found, state.limit, remaining_bound[step], newest_first):
                break
            kind, part, lo, hi = parts[i]
            if not _overlaps(lo, hi, start_ms, end_ms):
                continue
            if kind == "chunk":
                assert isinstance(part, ChunkRecord)
                chunk, candidates = await loop.run_in_executor(
                    self.read_pool,
                    self._chunk_candidates,
                    container,
                    segment,
                    part,
                    h32,
                    start_ms,
                    end_ms,
                )
                if chunk is None or not candidates:
                    continue
                # every candidate run of the chunk read, checked and matched in one trip to a
                # reader thread (a trip per run cost a find more than the reading itself)
                runs = _runs(candidates, newest_first)
                needed = state.limit - len(state.events) - len(found)
                results = await loop.run_in_executor(
                    self.read_pool,
                    _read_chunk_runs,
                    container,
                    segment,
                    chunk,
                    runs,
                    key,
                    start_ms,
                    end_ms,
                    needed if key is not None else (state.limit, list(found), newest_first),
                )
                for run, result in zip(runs, results, strict=False):
                    if isinstance(result, CorruptData):
                        if run[0].offset < segment.start_offset:
                            continue  # retention removed the chunk meanwhile
                        raise result
                    state.batches_read += len(result)
                    matches = _within_budget(result, state)
                    found.extend(reversed(matches) if newest_first else matches)
                    if key is not None and len(state.events) + len(found) >= state.limit:
                        return found
                    if state.truncated:
                        return found
                continue
            else:
                assert isinstance(part, list)
                candidates = [
                    _Candidate(
                        b.base_offset,
                        b.next_offset,
                        b.address.length - 8,
                        b.min_timestamp,
                        b.max_timestamp,
                        journal=b,
                    )
                    for b in part
                    if h32 is None or b.keys is None or batch_holds(b.keys, h32)
                ]
            for run in _runs(candidates, newest_first):
                matches = await self._read_run(
                    container, segment, run, key, start_ms, end_ms, state
                )
                found.extend(reversed(matches) if newest_first else matches)
                if key is not None and len(state.events) + len(found) >= state.limit:
                    return found
                if state.truncated:
                    return found
        return found

    def _chunk_candidates(
        self,
        container: Container,
        segment: Segment,
        record: ChunkRecord,
        h32: int | None,
        start_ms: int | None,
        end_ms: int | None,
    ) -> tuple[Chunk | None, list[_Candidate]]:
        """A chunk (None if retention removed it meanwhile) and its batches that may hold
        matches (a reader thread's work): through its find index, or all of them where it has
        none."""
        chunk = container.chunk_cache.lookup(segment, record.base_offset)
        if chunk is None or chunk.record.base_offset != record.base_offset:
            return None, []  # retention removed it meanwhile
        index = self._index_of(segment, record)
        count = len(chunk.offsets)
        # where each batch ends: the next one's start (a hole between them is no matter: the
        # next batch is then not adjacent), the chunk's end for the last
        ends = np.append(chunk.offsets[1:], record.next_offset)
        if index is None or index.batch_count != count:
            return chunk, [
                _Candidate(int(o), int(e), int(n), record.min_timestamp, record.max_timestamp)
                for o, e, n in zip(chunk.offsets, ends, chunk.lengths, strict=True)
            ]
        chosen = index.batches_with(h32, start_ms, end_ms)
        return chunk, [
            _Candidate(
                int(chunk.offsets[i]),
                int(ends[i]),
                int(chunk.lengths[i]),
                int(index.min_timestamps[i]),
                int(index.max_timestamps[i]),
            )
            for i in chosen
        ]

    def _index_of(self, segment: Segment, record: ChunkRecord) -> FindIndex | None:
        """A chunk's decoded find index, from the cache or the catalog (chunks never change,
        so a cached index stays right; one whose chunk is gone is simply not asked for)."""
        key = (segment.global_id, record.base_offset)
        with self._indexes_lock:
            cached = self._indexes.get(key)
            if cached is not None:
                self._indexes.move_to_end(key)
                return cached[0]
        data = self.meta.chunk_finds(segment.stream_id, segment.number, record.base_offset)
        index = FindIndex.decode(data)
        with self._indexes_lock:
            if key not in self._indexes:
                self._indexes[key] = (index, len(data) + 64)
                self._indexes_bytes += len(data) + 64
                while self._indexes_bytes > self.index_cache_bytes and len(self._indexes) > 1:
                    _, (_, size) = self._indexes.popitem(last=False)
                    self._indexes_bytes -= size
        return index

    async def _read_run(
        self,
        container: Container,
        segment: Segment,
        run: list[_Candidate],
        key: bytes | None,
        start_ms: int | None,
        end_ms: int | None,
        state: _Search,
    ) -> list[Event]:
        """Read a run of adjacent candidates (forward) and return their matches in offset
        order. A candidate in a hole, or removed by retention, is skipped."""
        wanted = {c.offset for c in run}
        got: dict[int, bytes | bytearray | memoryview] = {}
        total = sum(c.length for c in run)
        for candidate in run:
            if candidate.offset in got:
                continue
            try:
                batches = await container.read(segment, candidate.offset, total)
            except CorruptData as exc:
                if exc.details.get("resume") is None:
                    raise
                continue  # a hole: nothing readable there
            except OffsetOutOfRange:
                continue  # retention removed it meanwhile
            for batch in batches:
                base = decode_header(batch).base_offset
                if base in wanted:
                    got[base] = batch
                if base > run[-1].offset:
                    break
        ordered = [(offset, got[offset]) for offset in sorted(got)]
        state.batches_read += len(ordered)
        # journal batches without key hashes get them from this read (with indexing switched
        # off, to measure it, finds keep none either)
        unknown = {
            c.offset: c.journal
            for c in run
            if c.journal is not None and c.journal.keys is None and container.config.find_index
        }
        results = await asyncio.get_running_loop().run_in_executor(
            self.read_pool,
            _match_batches,
            ordered,
            set(unknown),
            segment.number,
            key,
            start_ms,
            end_ms,
        )
        for (offset, _), (_, hashes) in zip(ordered, results, strict=True):
            if hashes is not None and offset in unknown:
                unknown[offset].keys = hashes
        return _within_budget([events for events, _ in results], state)


async def find_in_cluster(
    service: Service,
    finder: Finder,
    stream: str,
    segments: Sequence[Segment],
    *,
    key: bytes | None,
    start_ms: int | None,
    end_ms: int | None,
    limit: int,
    newest_first: bool,
    local: bool,
) -> FoundEvents:
    """``Finder.find`` over a stream whose segments several brokers serve: this broker's own
    segments searched here while the brokers serving the others (with a key: those whose key
    range holds its hash) are asked at once, the parts merged (``merge_found``). ``local``:
    this broker's segments only, naming them in ``searched``. Raises WrongBroker when a
    segment has nobody serving it (moving), when its broker does not answer within the peer
    timeout or no longer serves it (an answer not naming it in ``searched``); a part's own
    error (StreamNotFound, CorruptData) as it was given."""
    served = [s for s in segments if service.is_served(s)]
    searched = tuple(sorted(s.number for s in served))
    if local:
        found = await finder.find(
            served,
            key=key,
            start_ms=start_ms,
            end_ms=end_ms,
            limit=limit,
            newest_first=newest_first,
        )
        return FoundEvents(found.events, found.batches_read, found.truncated, searched)
    h = None if key is None else key_hash(key)
    cluster = service.cluster
    wanted: dict[str, dict[int, int]] = {}  # owner -> {segment: container}
    for segment in segments:
        if service.is_served(segment):
            continue
        if h is not None and not segment.key_lo <= h <= segment.key_hi:
            continue  # never held the key
        owner = cluster.owners[segment.container]
        what = f"segment {segment.number} of {stream!r}"
        if not owner or owner == cluster.broker_id:
            raise cluster.wrong_broker(segment.container, what)
        wanted.setdefault(owner, {})[segment.number] = segment.container
    request = FindEvents(stream, key, start_ms, end_ms, limit, newest_first, local=True)
    mine, answers = await asyncio.gather(
        finder.find(
            served,
            key=key,
            start_ms=start_ms,
            end_ms=end_ms,
            limit=limit,
            newest_first=newest_first,
        ),
        gather_answers(service.peers, dict.fromkeys(wanted, request)),
        return_exceptions=True,
    )
    if isinstance(mine, BaseException):
        raise mine
    if isinstance(answers, BaseException):
        raise answers
    parts = [mine]
    for owner, answer in answers.items():
        if isinstance(answer, SlipstreamError) and not isinstance(
            answer, WrongBroker | BrokerUnavailable
        ):
            raise answer
        covered = set(answer.searched) if isinstance(answer, EventsFound) else set()
        missing = [n for n in wanted[owner] if n not in covered]
        if missing or not isinstance(answer, EventsFound):
            number = (missing or list(wanted[owner]))[0]
            raise cluster.wrong_broker(wanted[owner][number], f"segment {number} of {stream!r}")
        # only the segments asked of it: one this broker still takes for its own (a lease
        # lost while paused) is not counted twice; the part's first ``limit`` over more
        # segments still holds the first ``limit`` of these
        parts.append(
            FoundEvents(
                [
                    Event(e.key, e.value, e.headers, e.timestamp, e.segment, e.offset)
                    for e in answer.events
                    if e.segment in wanted[owner]
                ],
                answer.batches_read,
                answer.truncated,
            )
        )
    epochs = {s.number: s.epoch for s in segments}
    return merge_found(
        parts, epochs, by_key=key is not None, limit=limit, newest_first=newest_first
    )


def merge_found(
    parts: Sequence[FoundEvents],
    epochs: Mapping[int, int],
    *,
    by_key: bool,
    limit: int,
    newest_first: bool,
) -> FoundEvents:
    """The answers of finds over disjoint sets of a stream's segments (``epochs``: segment
    number -> epoch), each in the order asked for and cut at ``limit``, as one find over all
    of them: merged in the find's order (with a key ``(epoch, segment, offset)``, else
    ``(timestamp, epoch, segment, offset)``; newest first reversed), the first ``limit``.
    ``batches_read`` is the parts' sum. A truncated part makes the answer truncated; with a
    key, the answer then ends at the truncated part's last event (what follows in the order
    may be missing from it), so it is a prefix of the key's events, as one broker's would be.
    The byte budget (``MAX_FIND_BYTES``) holds for the merged answer too."""

    def order(event: Event) -> tuple[int, ...]:
        at = (epochs.get(event.segment, 0), event.segment, event.offset)
        return at if by_key else (event.timestamp, *at)

    merged = sorted(
        (event for part in parts for event in part.events), key=order, reverse=newest_first
    )[:limit]
    truncated = any(part.truncated for part in parts)
    if by_key:
        for part in parts:
            if part.truncated and part.events:
                last = order(part.events[-1])
                merged = [
                    e for e in merged if (order(e) >= last if newest_first else order(e) <= last)
                ]
    size = 0
    for count, event in enumerate(merged, 1):
        size += len(event.value) + len(event.key or b"")
        if size > MAX_FIND_BYTES:
            merged, truncated = merged[:count], True
            break
    return FoundEvents(merged, sum(part.batches_read for part in parts), truncated)


def _within_budget(batches: list[list[Event]], state: _Search) -> list[Event]:
    """The matches of batches read (offset order) up to the find's byte budget: past it, the
    rest of the batch that crossed it is kept and ``state.truncated`` set."""
    out: list[Event] = []
    for events in batches:
        for event in events:
            state.bytes += len(event.value) + len(event.key or b"")
            out.append(event)
        if state.bytes > MAX_FIND_BYTES:
            state.truncated = True
            break
    return out


def _read_chunk_runs(
    container: Container,
    segment: Segment,
    chunk: Chunk,
    runs: list[list[_Candidate]],
    key: bytes | None,
    start_ms: int | None,
    end_ms: int | None,
    needed: int | tuple[int, list[Event], bool],
) -> list[list[list[Event]] | CorruptData]:
    """Read runs of candidate batches of one chunk (in the order given, each run forward),
    CRC-checked as every read is (``Container._read_chunk``), and match them: per run, each
    batch's matching events, or the CorruptData its read raised (a hole, ``resume`` set, is
    stepped over as nothing read). With a key, stops after the run that brings the matches
    to ``needed``; without, ``needed`` is (limit, the segment's matches so far, newest
    first), and it stops once no unread run can hold one of the segment's best ``limit`` in
    time order (``_done``), as the search does between chunks. A reader thread's work: the
    chunk, the segment's name and number, and copies are all it touches."""
    out: list[list[list[Event]] | CorruptData] = []
    found = 0
    in_time: list[Event] | None = None
    if isinstance(needed, tuple):
        limit, in_time, newest_first = needed
        # the best time each run from there on can hold
        bounds = [
            max(c.max_ts for c in run) if newest_first else min(c.min_ts for c in run)
            for run in runs
        ]
        for i in range(len(bounds) - 2, -1, -1):
            pick = max if newest_first else min
            bounds[i] = pick(bounds[i], bounds[i + 1])
    for number, run in enumerate(runs):
        if in_time is not None and _done(in_time, limit, bounds[number], newest_first):
            break
        total = sum(c.length for c in run)
        try:
            batches = container._read_chunk(segment, chunk, run[0].offset, total)
        except FileNotFoundError as exc:  # a store without its own error for a gone chunk
            out.append(CorruptData(f"chunk {chunk.record.name} is gone: {exc}"))
            break
        except CorruptData as exc:
            if exc.details.get("resume") is None:
                out.append(exc)  # the loop tells retention from damage
                break
            out.append([])  # a hole: nothing readable there
            continue
        wanted = {c.offset for c in run}
        ordered = []
        for batch in batches:
            base = decode_header(batch).base_offset
            if base in wanted:
                ordered.append((base, batch))
        results = _match_batches(ordered, set(), segment.number, key, start_ms, end_ms)
        matched = [events for events, _ in results]
        out.append(matched)
        if in_time is not None:
            in_time.extend(event for events in matched for event in events)
            continue
        found += sum(len(events) for events in matched)
        if isinstance(needed, int) and found >= needed:
            break
    return out


class _Search:
    """What a find collected so far, over segments."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.events: list[Event] = []
        self.batches_read = 0
        self.bytes = 0
        self.truncated = False


def check_find_arguments(start_ms: int | None, end_ms: int | None, limit: int) -> None:
    """Raise InvalidArgument for a limit outside 1..MAX_FIND_LIMIT or an empty window."""
    if not 1 <= limit <= MAX_FIND_LIMIT:
        raise InvalidArgument(f"limit must be between 1 and {MAX_FIND_LIMIT}, not {limit}")
    if start_ms is not None and end_ms is not None and end_ms <= start_ms:
        raise InvalidArgument(
            f"the window's end ({end_ms} ms) must be after its start ({start_ms} ms)"
        )


def _overlaps(lo: int, hi: int, start_ms: int | None, end_ms: int | None) -> bool:
    return (start_ms is None or hi >= start_ms) and (end_ms is None or lo < end_ms)


def _remaining_bounds(
    parts: list[tuple[str, object, int, int]], order: list[int], newest_first: bool
) -> list[int | None]:
    """For each step of ``order``: the best time any part from that step on can hold (newest
    first: their greatest max; oldest first: their least min); None when none is left."""
    bounds: list[int | None] = [None] * (len(order) + 1)
    for step in range(len(order) - 1, -1, -1):
        _, _, lo, hi = parts[order[step]]
        after = bounds[step + 1]
        if newest_first:
            bounds[step] = hi if after is None else max(hi, after)
        else:
            bounds[step] = lo if after is None else min(lo, after)
    return bounds[:-1] if order else []


def _done(found: list[Event], limit: int, bound: int | None, newest_first: bool) -> bool:
    """Whether no unread event can be among the segment's best ``limit`` in time order: within
    one segment, an unread event at an equal time comes later in the order (newest first:
    earlier), so an equal bound cannot beat the ``limit``-th best either."""
    if len(found) < limit or bound is None:
        return False
    times = np.fromiter((e.timestamp for e in found), dtype=np.int64, count=len(found))
    if newest_first:
        kth = int(np.partition(times, len(times) - limit)[len(times) - limit])
        return bound <= kth
    kth = int(np.partition(times, limit - 1)[limit - 1])
    return bound >= kth


def _runs(candidates: list[_Candidate], newest_first: bool) -> list[list[_Candidate]]:
    """Candidates (in offset order) grouped into runs of adjacent batches, each run read with
    one request; runs in the direction asked, each run itself forward."""
    runs: list[list[_Candidate]] = []
    for candidate in candidates:
        if runs and _adjacent(runs[-1][-1], candidate) and len(runs[-1]) < 64:
            runs[-1].append(candidate)
        else:
            runs.append([candidate])
    if newest_first:
        runs.reverse()
    return runs


def _adjacent(before: _Candidate, after: _Candidate) -> bool:
    """Whether ``after`` starts where ``before`` ends: one read then returns both, and no
    batch between them that is not a candidate."""
    return after.offset == before.end and (after.journal is None) == (before.journal is None)


def _match_batches(
    batches: list[tuple[int, bytes | bytearray | memoryview]],
    in_journal: set[int],
    segment: int,
    key: bytes | None,
    start_ms: int | None,
    end_ms: int | None,
) -> list[tuple[list[Event], bytes | None]]:
    """Each batch's matching events (offset order) and, for the journal batches in
    ``in_journal``, its key hashes (a reader thread's work). Batches of another schema than the
    event schema (typed streams) match nothing."""
    out: list[tuple[list[Event], bytes | None]] = []
    for offset, batch in batches:
        record = read_body(batch)
        hashes = batches_key_hashes([batch])[0] if offset in in_journal else None
        if not record.schema.equals(EVENT_SCHEMA):
            out.append(([], hashes))
            continue
        keys = record.column(0)
        mask = np.ones(record.num_rows, dtype=bool)
        if key is not None:
            mask &= _key_mask(keys, key)
        times = int64_values(record.column(2))
        if start_ms is not None:
            mask &= times >= start_ms
        if end_ms is not None:
            mask &= times < end_ms
        rows = np.flatnonzero(mask)
        if not len(rows):
            out.append(([], hashes))
            continue
        taken = record.take(numpy_array(rows))
        events = [
            msgspec.structs.replace(event, offset=offset + int(row))
            for event, row in zip(events_of(taken, segment, 0), rows, strict=True)
        ]
        out.append((events, hashes))
    return out


def _key_mask(keys: pa.Array, key: bytes) -> np.ndarray:
    """Which rows of a ``binary`` column hold exactly ``key`` (null rows never), with numpy
    alone: ``pyarrow.compute``'s comparison and its boolean ``to_numpy`` import pandas on
    first use (0.4 s of a broker's first find) and cost more than this on short keys."""
    count = len(keys)
    if keys.null_count == count:
        return np.zeros(count, dtype=bool)
    offsets = np.frombuffer(keys.buffers()[1], np.int32, count + 1, keys.offset * 4)
    mask: np.ndarray = np.diff(offsets) == len(key)
    if keys.null_count:
        bitmap = np.frombuffer(keys.buffers()[0], np.uint8)
        valid = np.unpackbits(bitmap, bitorder="little")[keys.offset : keys.offset + count]
        mask &= valid.astype(bool)
    rows = np.flatnonzero(mask)
    if len(rows) and len(key):
        data = np.frombuffer(keys.buffers()[2], np.uint8)
        at = offsets[rows, None].astype(np.int64) + np.arange(len(key))
        same = (data[at] == np.frombuffer(key, np.uint8)).all(axis=1)
        mask[rows[~same]] = False
    return mask

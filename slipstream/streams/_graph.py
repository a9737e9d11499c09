"""Key ranges and the segment graph of an elastic stream.

A segment owns an inclusive range ``lo..hi`` of the 64-bit key hash space (as in
:mod:`._routing`, the protocol's ``SegmentInfo`` and the MetaStore's ``SegmentRecord``). A scale
event seals some open segments and opens successors whose ranges cover exactly the sealed ones;
it opens a new *epoch*. The segments alive in an epoch tile the key space, so every key hash
has exactly one owner per epoch.

The graph is what readers follow so that each key's events arrive in append order across
splits and merges: a key's events before a scale event are in a predecessor, those after it in
a successor, hence a successor may be read only once *every* predecessor has been read to its
end (:meth:`SegmentGraph.readable`). The graph is immutable and pure: no IO, no clock; times
are parameters.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from itertools import pairwise

import msgspec

from .._errors import InvalidArgument, SegmentNotFound
from ._routing import MAX_KEY_HASH, MAX_SEGMENTS, split_key_space


def preceding(predecessors: Mapping[int, Sequence[int]], numbers: Iterable[int]) -> set[int]:
    """Every segment of ``predecessors`` (number -> its predecessors) that precedes one of
    ``numbers``, transitively (not the numbers themselves). Segments not listed (deleted with
    their data, or unknown) are skipped, with what precedes only them."""
    seen: set[int] = set()
    stack = [p for n in numbers if n in predecessors for p in predecessors[n]]
    while stack:
        number = stack.pop()
        if number not in seen and number in predecessors:
            seen.add(number)
            stack.extend(predecessors[number])
    return seen


def read_order(
    predecessors: Mapping[int, Sequence[int]], ended: Callable[[int], bool]
) -> tuple[set[int], list[int]]:
    """The per-key read-order rule, for any reader's progress: ``(finished, readable)``.

    A segment is *finished* when ``ended(number)`` (sealed and read, consumed or committed to
    its end, or its data gone) and every predecessor is finished: an empty sealed segment must
    not let its successors overtake what its own predecessors still hold. A segment is
    *readable* when it is not finished and every predecessor is. A predecessor not listed in
    ``predecessors`` (deleted with its data) counts as finished. Predecessors have lower
    numbers than their successors (a scale numbers successors after the highest so far), so
    one pass in number order decides. Readable numbers are in ascending order."""
    finished: set[int] = set()
    readable: list[int] = []
    for number in sorted(predecessors):
        if all(p in finished or p not in predecessors for p in predecessors[number]):
            if ended(number):
                finished.add(number)
            else:
                readable.append(number)
    return finished, readable


class KeyRange(msgspec.Struct, frozen=True):
    """Key hashes ``lo..hi``, both inclusive, unsigned 64-bit; raises :class:`InvalidArgument`
    when ``lo > hi`` or either bound is outside ``0 .. 2**64 - 1``."""

    lo: int
    hi: int

    def __post_init__(self) -> None:
        if not (0 <= self.lo <= self.hi <= MAX_KEY_HASH):
            raise InvalidArgument(
                f"bad key range {self.lo}..{self.hi}: need 0 <= lo <= hi <= 2**64 - 1 "
                "(both bounds inclusive)",
                lo=self.lo,
                hi=self.hi,
            )

    @property
    def width(self) -> int:
        """How many key hashes the range holds."""
        return self.hi - self.lo + 1

    def __contains__(self, key_hash: object) -> bool:
        return isinstance(key_hash, int) and self.lo <= key_hash <= self.hi

    def overlaps(self, other: KeyRange) -> bool:
        return self.lo <= other.hi and other.lo <= self.hi

    def precedes(self, other: KeyRange) -> bool:
        """True when ``other`` begins right after this range ends (they are neighbours)."""
        return self.hi + 1 == other.lo

    def __str__(self) -> str:
        return f"{self.lo:016x}-{self.hi:016x}"


#: the whole key hash space
FULL_KEY_RANGE = KeyRange(0, MAX_KEY_HASH)


def split_range(key_range: KeyRange, parts: int) -> tuple[KeyRange, ...]:
    """``parts`` contiguous ranges, in key order, that cover ``key_range`` exactly and differ in
    width by at most one hash. Raises :class:`InvalidArgument` for ``parts < 2`` (that is no
    split) or more parts than the range has hashes."""
    if parts < 2:
        raise InvalidArgument(
            f"a split needs at least 2 successors, got {parts}: use --into 2 or more",
            parts=parts,
        )
    if parts > key_range.width:
        raise InvalidArgument(
            f"key range {key_range} holds {key_range.width} key hashes and cannot be split "
            f"into {parts}: split it into at most {key_range.width}",
            parts=parts,
        )
    width = key_range.width
    bounds = [key_range.lo + width * i // parts for i in range(parts + 1)]
    return tuple(KeyRange(bounds[i], bounds[i + 1] - 1) for i in range(parts))


def merge_ranges(ranges: Sequence[KeyRange]) -> KeyRange:
    """The one range that two or more neighbouring ranges (in any order) cover together.
    Raises :class:`InvalidArgument` for fewer than two ranges, or ranges with a gap or an
    overlap between them: only neighbours merge, since the successor must own exactly the keys
    its predecessors owned."""
    if len(ranges) < 2:
        raise InvalidArgument(
            f"a merge needs at least 2 neighbouring segments, got {len(ranges)}",
        )
    ordered = sorted(ranges, key=lambda r: r.lo)
    for left, right in pairwise(ordered):
        if not left.precedes(right):
            raise InvalidArgument(
                f"key ranges {left} and {right} are not neighbours (the first must end right "
                "before the second begins): merge adjacent segments only",
            )
    return KeyRange(ordered[0].lo, ordered[-1].hi)


class SegmentNode(msgspec.Struct, frozen=True):
    """One segment in the graph: its key range, the epochs it was alive in
    (``opened_epoch <= e < sealed_epoch``; open when ``sealed_epoch`` is None) and the segments
    it succeeded (those of the previous scale event whose ranges overlap its own)."""

    number: int
    key_range: KeyRange
    opened_epoch: int
    predecessors: tuple[int, ...] = ()
    sealed_epoch: int | None = None
    opened_ms: int = 0

    @property
    def sealed(self) -> bool:
        return self.sealed_epoch is not None

    def alive_at(self, epoch: int) -> bool:
        return self.opened_epoch <= epoch and (
            self.sealed_epoch is None or epoch < self.sealed_epoch
        )


class ScaleEvent(msgspec.Struct, frozen=True):
    """One step of a stream's history: at ``at_ms`` the segments ``sealed`` were sealed and
    ``created`` opened, together, in epoch ``epoch``. This is what the MetaStore keeps (in the
    same transaction that seals and opens the segments) and what a graph is rebuilt from."""

    epoch: int
    at_ms: int
    sealed: tuple[int, ...]
    created: tuple[SegmentNode, ...]


class SegmentGraph:
    """The segments of one stream over all its epochs, and the read order they impose.

    Immutable: :meth:`apply` returns a new graph. Build one with :meth:`create` (a new stream)
    or :meth:`from_history` (initial ranges plus the stored scale events). Every method that
    takes a segment number raises :class:`SegmentNotFound` for a number the stream never had.
    """

    def __init__(
        self, nodes: Iterable[SegmentNode], epoch: int, events: Sequence[ScaleEvent] = ()
    ) -> None:
        self._nodes = {node.number: node for node in nodes}
        self.epoch = epoch
        self.events = tuple(events)
        successors: dict[int, list[int]] = {number: [] for number in self._nodes}
        for node in self._nodes.values():
            for predecessor in node.predecessors:
                successors[predecessor].append(node.number)
        self._successors = {n: tuple(sorted(s)) for n, s in successors.items()}
        self._predecessors = {n: node.predecessors for n, node in self._nodes.items()}
        self._by_epoch: dict[int, tuple[SegmentNode, ...]] = {}

    # --- building -------------------------------------------------------------------------

    @classmethod
    def create(cls, count: int = 1, *, at_ms: int = 0) -> SegmentGraph:
        """A new stream: ``count`` segments numbered ``0 .. count - 1`` splitting the key space
        evenly (as :func:`split_key_space`), in epoch 0."""
        if not 1 <= count <= MAX_SEGMENTS:
            raise InvalidArgument(
                f"a stream has 1 to {MAX_SEGMENTS} segments, got {count}", segments=count
            )
        return cls.from_initial([KeyRange(lo, hi) for lo, hi in split_key_space(count)], at_ms)

    @classmethod
    def from_initial(cls, ranges: Sequence[KeyRange], at_ms: int = 0) -> SegmentGraph:
        """Epoch 0 of a stream whose segments ``0, 1, ...`` own ``ranges`` (in key order), which
        must tile the whole key space."""
        _check_tiles(ranges, FULL_KEY_RANGE)
        return cls((SegmentNode(i, r, 0, opened_ms=at_ms) for i, r in enumerate(ranges)), epoch=0)

    @classmethod
    def from_history(
        cls, initial: Sequence[KeyRange], events: Iterable[ScaleEvent], at_ms: int = 0
    ) -> SegmentGraph:
        """Replay stored scale events, in epoch order, over the initial segments; raises
        :class:`InvalidArgument` for an event that does not follow (see :meth:`apply`)."""
        graph = cls.from_initial(initial, at_ms)
        for event in events:
            graph = graph.apply(event)
        return graph

    def plan(self, sealed: Sequence[int], ranges: Sequence[KeyRange], at_ms: int) -> ScaleEvent:
        """The scale event that seals the open segments ``sealed`` and opens successors with
        ``ranges``, numbered after the highest number so far, in the next epoch. Nothing
        changes until :meth:`apply`. Raises :class:`SegmentNotFound` for an unknown segment and
        :class:`InvalidArgument` for a sealed one, a segment named twice, ranges that do not
        cover the sealed ranges exactly, or an event that changes nothing (one segment into
        one successor with the same range)."""
        if not sealed:
            raise InvalidArgument("a scale event seals at least one segment")
        nodes = [self.node(number) for number in sealed]
        if len(set(sealed)) != len(sealed):
            raise InvalidArgument(f"segments {list(sealed)} name a segment twice")
        for node in nodes:
            if node.sealed:
                raise InvalidArgument(
                    f"segment {node.number} is sealed (since epoch {node.sealed_epoch}): only "
                    f"open segments scale; its successors are {list(self.successors(node.number))}",
                    segment=node.number,
                )
        if len(nodes) == 1 and len(ranges) == 1:
            raise InvalidArgument(
                f"replacing segment {nodes[0].number} by one successor changes nothing: "
                "split into 2 or more, or merge with a neighbour"
            )
        open_after = len(self.open_segments) - len(nodes) + len(ranges)
        if open_after > MAX_SEGMENTS:
            raise InvalidArgument(
                f"the stream would have {open_after} open segments, above the limit of "
                f"{MAX_SEGMENTS}: split into fewer successors, or merge first"
            )
        ordered_ranges = sorted(ranges, key=lambda r: r.lo)
        _check_covers(ordered_ranges, sorted((n.key_range for n in nodes), key=lambda r: r.lo))
        first = max(self._nodes) + 1
        created = tuple(
            SegmentNode(
                number=first + i,
                key_range=r,
                opened_epoch=self.epoch + 1,
                predecessors=tuple(sorted(n.number for n in nodes if n.key_range.overlaps(r))),
                opened_ms=at_ms,
            )
            for i, r in enumerate(ordered_ranges)
        )
        return ScaleEvent(self.epoch + 1, at_ms, tuple(sorted(sealed)), created)

    def split(self, segment: int, parts: int, at_ms: int) -> ScaleEvent:
        """The event splitting open ``segment`` into ``parts`` near-equal successors."""
        return self.plan([segment], split_range(self.node(segment).key_range, parts), at_ms)

    def merge(self, segments: Sequence[int], at_ms: int) -> ScaleEvent:
        """The event merging the neighbouring open ``segments`` into one successor."""
        merged = merge_ranges([self.node(number).key_range for number in segments])
        return self.plan(segments, [merged], at_ms)

    def apply(self, event: ScaleEvent) -> SegmentGraph:
        """The graph after ``event``. The event must be exactly what :meth:`plan` makes of its
        sealed segments and ranges here (next epoch, next numbers, same predecessors), so that
        a replayed history can never disagree with the one that was written; else
        :class:`InvalidArgument`."""
        expected = self.plan(event.sealed, [n.key_range for n in event.created], event.at_ms)
        if event != expected:
            raise InvalidArgument(
                f"scale event for epoch {event.epoch} does not follow epoch {self.epoch}: "
                f"expected {msgspec.json.encode(expected).decode()}",
            )
        sealed = set(event.sealed)
        nodes = [
            msgspec.structs.replace(node, sealed_epoch=event.epoch)
            if node.number in sealed
            else node
            for node in self._nodes.values()
        ]
        return SegmentGraph([*nodes, *event.created], event.epoch, (*self.events, event))

    # --- questions readers ask -------------------------------------------------------------

    def node(self, number: int) -> SegmentNode:
        try:
            return self._nodes[number]
        except KeyError:
            raise SegmentNotFound(
                f"segment {number} is not part of this stream", segment=number
            ) from None

    @property
    def nodes(self) -> tuple[SegmentNode, ...]:
        """Every segment of every epoch, by number."""
        return tuple(self._nodes[n] for n in sorted(self._nodes))

    @property
    def open_segments(self) -> tuple[SegmentNode, ...]:
        """The segments of the current epoch, in key order: they tile the key space."""
        return self.segments_at(self.epoch)

    def segments_at(self, epoch: int) -> tuple[SegmentNode, ...]:
        """The segments alive in ``epoch``, in key order (they tile the key space)."""
        if not 0 <= epoch <= self.epoch:
            raise InvalidArgument(
                f"epoch {epoch} does not exist: this stream has epochs 0 to {self.epoch}",
                epoch=epoch,
            )
        alive = self._by_epoch.get(epoch)
        if alive is None:
            alive = tuple(
                sorted(
                    (n for n in self._nodes.values() if n.alive_at(epoch)),
                    key=lambda n: n.key_range.lo,
                )
            )
            self._by_epoch[epoch] = alive
        return alive

    def owner(self, key_hash: int, epoch: int | None = None) -> int:
        """The segment that owned ``key_hash`` in ``epoch`` (default: the current one): where
        an event with that key hash appended during that epoch is stored."""
        if not 0 <= key_hash <= MAX_KEY_HASH:
            raise InvalidArgument(f"key hash {key_hash} is outside 0 .. 2**64 - 1")
        alive = self.segments_at(self.epoch if epoch is None else epoch)
        los = [n.key_range.lo for n in alive]
        return alive[bisect_right(los, key_hash) - 1].number

    def predecessors(self, number: int) -> tuple[int, ...]:
        return self.node(number).predecessors

    def successors(self, number: int) -> tuple[int, ...]:
        """The segments opened when ``number`` was sealed that took over some of its keys
        (empty while it is open)."""
        self.node(number)
        return self._successors[number]

    def ancestors(self, numbers: Iterable[int]) -> frozenset[int]:
        """Every segment that precedes one of ``numbers``, transitively (not the numbers
        themselves). A reader starting at a StreamCut has finished these."""
        numbers = tuple(numbers)
        for number in numbers:
            self.node(number)  # SegmentNotFound for an unknown one
        return frozenset(preceding(self._predecessors, numbers))

    def readable(self, finished: Collection[int]) -> tuple[int, ...]:
        """The segments a reader that has read ``finished`` to their ends may read now, by
        number: those not finished whose predecessors are all finished. Reading only these
        keeps every key's events in append order across any splits and merges; a successor
        becomes readable only after the last of its predecessors is finished. ``finished``
        holds only sealed segments (an open segment has no end); a reader that starts at a
        StreamCut passes the cut's :meth:`ancestors` as finished."""
        done = set(finished)
        for number in done:
            if not self.node(number).sealed:
                raise InvalidArgument(
                    f"segment {number} is open and cannot have been read to its end",
                    segment=number,
                )
        return tuple(read_order(self._predecessors, done.__contains__)[1])


def _check_tiles(ranges: Sequence[KeyRange], whole: KeyRange) -> None:
    """Raise unless ``ranges`` (in key order) cover ``whole`` with no gap and no overlap."""
    cursor = whole.lo
    for r in ranges:
        if r.lo != cursor:
            raise InvalidArgument(
                f"key ranges must cover {whole} in key order with no gap or overlap; "
                f"{r} begins at {r.lo:016x}, expected {cursor:016x}"
            )
        cursor = r.hi + 1
    if cursor != whole.hi + 1:
        raise InvalidArgument(f"key ranges must cover {whole}; they end at {cursor - 1:016x}")


def _check_covers(ranges: Sequence[KeyRange], sealed: Sequence[KeyRange]) -> None:
    """Raise unless ``ranges`` cover exactly the keys of ``sealed`` (both in key order): each
    run of neighbouring sealed ranges is tiled by successors."""
    runs: list[KeyRange] = []
    for r in sealed:
        if runs and runs[-1].precedes(r):
            runs[-1] = KeyRange(runs[-1].lo, r.hi)
        else:
            runs.append(r)
    position = 0
    for run in runs:
        end = position
        while end < len(ranges) and ranges[end].hi <= run.hi:
            end += 1
        try:
            _check_tiles(ranges[position:end], run)
        except InvalidArgument:
            raise InvalidArgument(
                "the successors' key ranges must cover exactly the sealed segments' ranges: "
                f"successors {[str(r) for r in ranges]}, sealed {[str(r) for r in sealed]}"
            ) from None
        position = end
    if position != len(ranges):
        raise InvalidArgument(
            "the successors' key ranges must cover exactly the sealed segments' ranges: "
            f"{ranges[position]} lies outside them"
        )

"""Idempotent producers: which batches of a segment are new, which are retries, which are wrong.

Every batch of an idempotent producer carries its producer id, epoch and ``sequence``: the
per-segment sequence number of its first event (the next batch of that producer in that segment
starts at ``sequence + event_count``, modulo 2**31). Each segment keeps, per producer, the next
expected sequence and the last ``WINDOW`` batches it appended (sequence, count, base offset):

- a batch whose sequence and count match a remembered batch is a retry: it is not appended
  again, and the producer gets the original position;
- a batch at the expected sequence is appended;
- anything else is an ``OutOfOrderSequence`` error: a gap (events would be lost) or a retry
  older than the window (the broker cannot name its position). Clients keep at most ``WINDOW``
  batches in flight, so their retries always fall inside it;
- a batch from an older epoch than the newest seen is ``ProducerFenced``; a newer epoch (or an
  unknown producer) starts afresh at whatever sequence it brings.

When the broker fails to store a batch (disk full), the state rolls back and is marked with a
*hole*: the producer may already have sent later batches, so the next batch may skip the lost
sequence numbers once. (Later batches already queued in the container fail with the lost one;
only a batch that arrives after the failure can skip. The transaction coordinator never sends
one: it retries from the hole.) Pure logic, no IO: the container calls it, recovery replays
it, and the mover snapshots it into each chunk record so that it survives restarts.
"""

from __future__ import annotations

import msgspec

from .._errors import OutOfOrderSequence, ProducerFenced

SEQUENCE_MODULUS = 1 << 31
WINDOW = 16
#: producers remembered per segment; the least recently active is forgotten beyond this (it is
#: then treated as new: its retries are no longer recognised). Bounds memory and snapshots.
MAX_PRODUCERS = 1_000


def next_sequence(sequence: int, count: int) -> int:
    return (sequence + count) % SEQUENCE_MODULUS


def _behind(sequence: int, expected: int) -> bool:
    """True when ``sequence`` lies before ``expected`` (modular, within half the range)."""
    return 0 < (expected - sequence) % SEQUENCE_MODULUS < SEQUENCE_MODULUS // 2


class Appended(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A remembered batch: its first sequence number, event count and base offset."""

    sequence: int
    count: int
    base_offset: int


class ProducerState(msgspec.Struct, array_like=True):
    producer_id: int
    epoch: int
    next_sequence: int
    recent: list[Appended]
    hole: bool = False

    def copy(self) -> ProducerState:
        return ProducerState(
            self.producer_id, self.epoch, self.next_sequence, list(self.recent), self.hole
        )


_snapshot_encoder = msgspec.msgpack.Encoder()
_snapshot_decoder = msgspec.msgpack.Decoder(list[ProducerState])


class ProducerTable:
    """The idempotence state of one segment."""

    __slots__ = ("_states",)

    def __init__(self, states: list[ProducerState] | None = None) -> None:
        self._states: dict[int, ProducerState] = {s.producer_id: s for s in states or ()}

    def __len__(self) -> int:
        return len(self._states)

    def get(self, producer_id: int) -> ProducerState | None:
        return self._states.get(producer_id)

    def check(self, producer_id: int, epoch: int, sequence: int, count: int) -> Appended | None:
        """None: append the batch. An ``Appended``: the batch is a retry of that one.

        Raises ProducerFenced or OutOfOrderSequence (with the expected sequence)."""
        state = self._states.get(producer_id)
        if state is None or epoch > state.epoch:
            return None
        if epoch < state.epoch:
            raise ProducerFenced(
                f"producer {producer_id} epoch {epoch} was fenced by epoch {state.epoch}: a "
                "newer producer took over; close this one",
                producer_id=producer_id,
                epoch=epoch,
                current_epoch=state.epoch,
            )
        for appended in state.recent:
            if appended.sequence == sequence:
                if appended.count == count:
                    return appended
                break
        else:
            if sequence == state.next_sequence:
                return None
            if state.hole and not _behind(sequence, state.next_sequence):
                return None
        raise OutOfOrderSequence(
            f"producer {producer_id} sent sequence {sequence} ({count} events), the segment "
            f"expects {state.next_sequence}: "
            + (
                "a retry of a batch appended too long ago to match"
                if _behind(sequence, state.next_sequence)
                else "events in between are missing"
            ),
            producer_id=producer_id,
            expected=state.next_sequence,
            received=sequence,
        )

    def record(
        self, producer_id: int, epoch: int, sequence: int, count: int, base_offset: int
    ) -> None:
        """Note an appended batch (after ``check`` said to append it, or in replay)."""
        state = self._states.pop(producer_id, None)
        if state is None or epoch != state.epoch:
            if state is not None and epoch < state.epoch:
                self._states[producer_id] = state  # replaying a fenced zombie's old batch
                return
            state = ProducerState(producer_id, epoch, 0, [])
        state.recent.append(Appended(sequence, count, base_offset))
        if len(state.recent) > WINDOW:
            del state.recent[0]
        state.next_sequence = next_sequence(sequence, count)
        state.hole = False
        self._states[producer_id] = state  # most recently active last
        if len(self._states) > MAX_PRODUCERS:
            del self._states[next(iter(self._states))]

    def restore(self, producer_id: int, saved: ProducerState | None) -> None:
        """Roll a producer back to ``saved`` (a ``copy()`` taken before a failed append),
        marking the hole the failed batches leave."""
        if saved is None:
            self._states.pop(producer_id, None)
        else:
            saved.hole = True
            self._states[producer_id] = saved

    def snapshot(self) -> bytes:
        return _snapshot_encoder.encode(list(self._states.values()))

    @classmethod
    def from_snapshot(cls, data: bytes | None) -> ProducerTable:
        return cls(_snapshot_decoder.decode(data) if data else None)

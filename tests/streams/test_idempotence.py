"""The idempotence table: retries are recognised, gaps and zombies are refused, and a whole
history of sends, retries and failed appends stores every batch exactly once, in order."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream import OutOfOrderSequence, ProducerFenced
from slipstream.streams import SEQUENCE_MODULUS, WINDOW, ProducerTable, next_sequence


def test_unknown_producer_starts_anywhere_then_must_follow_on() -> None:
    table = ProducerTable()
    assert table.check(7, 0, 40, 5) is None
    table.record(7, 0, 40, 5, 100)
    assert table.check(7, 0, 45, 1) is None
    with pytest.raises(OutOfOrderSequence) as gap:
        table.check(7, 0, 47, 1)
    assert gap.value.details == {"producer_id": 7, "expected": 45, "received": 47}
    assert "missing" in gap.value.message


def test_a_retry_gets_the_first_copys_offset() -> None:
    table = ProducerTable()
    table.record(7, 0, 0, 5, 100)
    table.record(7, 0, 5, 3, 105)
    first = table.check(7, 0, 0, 5)
    assert first is not None and first.base_offset == 100
    retry = table.check(7, 0, 5, 3)
    assert retry is not None and retry.base_offset == 105


def test_a_retry_older_than_the_window_is_refused_not_appended() -> None:
    table = ProducerTable()
    for i in range(WINDOW + 1):
        table.record(7, 0, i, 1, i)
    with pytest.raises(OutOfOrderSequence, match="too long ago"):
        table.check(7, 0, 0, 1)


def test_same_sequence_with_another_count_is_not_a_retry() -> None:
    table = ProducerTable()
    table.record(7, 0, 0, 5, 0)
    with pytest.raises(OutOfOrderSequence):
        table.check(7, 0, 0, 4)


def test_older_epochs_are_fenced_newer_ones_start_afresh() -> None:
    table = ProducerTable()
    table.record(7, 3, 10, 1, 0)
    with pytest.raises(ProducerFenced):
        table.check(7, 2, 11, 1)
    assert table.check(7, 4, 0, 1) is None
    table.record(7, 4, 0, 1, 1)
    state = table.get(7)
    assert state is not None and (state.epoch, state.next_sequence) == (4, 1)


def test_restore_rolls_back_and_tolerates_the_hole_once() -> None:
    table = ProducerTable()
    table.record(7, 0, 0, 2, 0)
    saved = table.get(7)
    assert saved is not None
    saved = saved.copy()
    table.record(7, 0, 2, 2, 2)  # this append then failed on disk
    table.restore(7, saved)
    assert table.check(7, 0, 4, 1) is None  # the next batch may skip the lost sequence numbers
    table.record(7, 0, 4, 1, 2)
    with pytest.raises(OutOfOrderSequence):
        table.check(7, 0, 9, 1)  # but only once


def test_sequences_wrap_around() -> None:
    table = ProducerTable()
    top = SEQUENCE_MODULUS - 2
    table.record(7, 0, top, 2, 0)
    assert next_sequence(top, 2) == 0
    assert table.check(7, 0, 0, 3) is None
    table.record(7, 0, 0, 3, 2)
    assert table.check(7, 0, top, 2) is not None  # still a retry across the wrap


def test_snapshot_round_trip() -> None:
    table = ProducerTable()
    table.record(7, 1, 0, 5, 100)
    table.record(9, 0, 3, 1, 105)
    again = ProducerTable.from_snapshot(table.snapshot())
    assert again.snapshot() == table.snapshot()
    retry = again.check(7, 1, 0, 5)
    assert retry is not None and retry.base_offset == 100
    assert len(ProducerTable.from_snapshot(b"")) == 0


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["send", "retry", "fail", "ack-lost"]), min_size=1, max_size=60))
def test_history_of_sends_retries_and_failures_stores_each_batch_once(
    actions: list[str],
) -> None:
    """A model producer (one segment, up to WINDOW batches in flight) against the table used
    like the container uses it. The stored log must hold each acknowledged batch exactly once,
    in sequence order, and every acknowledgement must name where the batch really is."""
    table = ProducerTable()
    log: list[int] = []  # stored batch numbers, in offset order (one event each)
    in_flight: list[int] = []  # batch numbers sent, not acknowledged
    acked: dict[int, int] = {}
    next_batch = 0

    def deliver(batch: int) -> None:
        original = table.check(1, 0, batch, 1)
        if original is None:
            table.record(1, 0, batch, 1, len(log))
            log.append(batch)
            acked[batch] = len(log) - 1
        else:
            acked[batch] = original.base_offset

    for action in actions:
        if action == "send" and len(in_flight) < WINDOW:
            in_flight.append(next_batch)
            next_batch += 1
        elif action == "retry" and in_flight:  # the connection dropped: resend all, in order
            for batch in in_flight:
                deliver(batch)
            in_flight.clear()
        elif action == "ack-lost" and in_flight:  # stored, but the ack never arrived
            deliver(in_flight[0])
            acked.pop(in_flight[0])
        elif action == "fail" and in_flight:  # the disk refused this batch: it is given up
            batch = in_flight.pop(0)
            state = table.get(1)
            saved = None if state is None else state.copy()
            if table.check(1, 0, batch, 1) is None:
                table.record(1, 0, batch, 1, len(log))
                table.restore(1, saved)
    for batch in in_flight:
        deliver(batch)
    assert log == sorted(set(log)), "stored out of order or twice"
    for batch, offset in acked.items():
        assert log[offset] == batch

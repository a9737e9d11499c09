"""The torture checker finds each kind of anomaly in a synthetic history, and nothing in a
correct one: a checker that cannot fail would pass every broken broker."""

from __future__ import annotations

from pathlib import Path

import pytest

from slipstream.torture._checker import ANOMALIES, check_directory, check_history
from slipstream.torture._records import (
    Ack,
    Damage,
    Read,
    Record,
    RecordWriter,
    Round,
    TxnBegin,
    TxnEnd,
    event_id,
    event_key,
    event_value,
)

T0 = 1_000.0


def ident(worker: int, seq: int, key: int = 0) -> str:
    return event_id(event_value(worker, seq, key), event_key(worker, key).encode())


class History:
    """A correct history to start from: producer 1 (idempotent) acknowledged 4 events of
    key 0 at segment 0 offsets 0-3; producer 2 committed transaction 1 (2 events, offsets
    4-5) and aborted transaction 2 (1 event); the verifying read finds exactly offsets 0-5."""

    def __init__(self) -> None:
        self.producer1: list[Record] = [
            Round(1, "idempotent", 1, 0, 4, T0),
            Ack(1, 0, [(0, 0), (0, 1), (0, 2), (0, 3)]),
        ]
        self.producer2: list[Record] = [
            TxnBegin(2, 1, 0, 2, False, T0),
            TxnEnd(2, 1, "committed", T0 + 1, [(0, 4, 6)]),
            TxnBegin(2, 2, 2, 1, True, T0 + 2),
            TxnEnd(2, 2, "aborted"),
        ]
        self.verify: list[Record] = [
            Read(0, 0, [ident(1, s) for s in range(4)], T0 + 5),
            Read(0, 4, [ident(2, 0), ident(2, 1)], T0 + 5),
        ]
        self.live: list[Record] = [Read(0, 0, [ident(1, 0), ident(1, 1)], T0 + 0.5)]
        self.flips = 0

    def check(self) -> dict[str, int]:
        report = check_history(
            [self.producer1, self.producer2], [self.live], self.verify, flips=self.flips
        )
        assert report.ok == (not any(report.anomalies.values()))
        assert set(report.anomalies) == set(ANOMALIES)
        return {kind: count for kind, count in report.anomalies.items() if count}


def test_a_correct_history_has_no_anomalies() -> None:
    assert History().check() == {}


def test_a_lost_acknowledged_event_is_reported() -> None:
    history = History()
    history.verify[0] = Read(0, 0, [ident(1, s) for s in range(3)], T0 + 5)  # offset 3 gone
    history.verify[1] = Read(0, 4, [ident(2, 0), ident(2, 1)], T0 + 5)
    assert history.check() == {"lost": 1}


def test_a_lost_committed_transaction_is_reported() -> None:
    history = History()
    del history.verify[1]
    assert history.check() == {"lost": 1}


def test_a_duplicate_is_reported() -> None:
    history = History()
    history.verify.append(Read(0, 6, [ident(1, 2)], T0 + 5))
    assert history.check() == {"duplicate": 1}


def test_a_reordered_key_is_reported() -> None:
    history = History()
    history.producer1[1] = Ack(1, 0, [(0, 0), (0, 2), (0, 1), (0, 3)])
    history.live = []
    history.verify[0] = Read(0, 0, [ident(1, 0), ident(1, 2), ident(1, 1), ident(1, 3)], T0 + 5)
    assert history.check() == {"order": 1}


def test_an_unacknowledged_event_may_land_late() -> None:
    # a failed send retried by nobody may still have been stored, after later events
    history = History()
    history.producer1[1] = Ack(1, 0, [(0, 0), None, (0, 1), (0, 2)], err="BrokerUnavailable")
    history.live = []
    history.verify[0] = Read(0, 0, [ident(1, 0), ident(1, 2), ident(1, 3), ident(1, 1)], T0 + 5)
    assert history.check() == {}


def test_an_aborted_read_is_reported() -> None:
    history = History()
    history.live.append(Read(1, 0, [ident(2, 2)], T0 + 3))
    assert history.check() == {"aborted_read": 1}


def test_a_transaction_that_failed_to_commit_is_aborted() -> None:
    history = History()
    history.producer2[1] = TxnEnd(2, 1, "aborted", T0 + 1, err="TransactionAborted")
    assert history.check() == {"aborted_read": 2}


def test_an_uncommitted_read_is_reported() -> None:
    history = History()
    history.live.append(Read(0, 4, [ident(2, 0)], T0 + 0.9))  # before the commit at T0 + 1
    assert history.check() == {"uncommitted_read": 1}


def test_a_partially_visible_transaction_is_reported() -> None:
    history = History()
    history.verify[1] = Read(0, 4, [ident(2, 0)], T0 + 5)
    assert history.check() == {"partial_txn": 1}
    history.producer2[1] = TxnEnd(2, 1, "unknown", T0 + 1, err="BrokerUnavailable")
    assert history.check() == {"partial_txn": 1}
    history.verify.pop()  # none of it visible: an unknown outcome may have been an abort
    assert history.check() == {}


def test_damaged_data_served_is_reported() -> None:
    history = History()
    value = bytearray(event_value(1, 1, 0))
    value[-1] ^= 0x01
    history.live[0] = Read(0, 0, [ident(1, 0), event_id(bytes(value), b"w1-k0")], T0 + 0.5)
    assert history.live[0].ids[1].startswith("!")  # type: ignore[union-attr]
    assert history.check() == {"damaged_served": 1}


def test_an_event_with_another_key_is_damaged() -> None:
    assert event_id(event_value(1, 1, 0), b"w1-k1").startswith("!")


def test_two_reads_disagreeing_on_a_position_are_reported() -> None:
    history = History()
    history.live[0] = Read(0, 0, [ident(1, 1)], T0 + 0.5)
    counts = history.check()
    assert counts.pop("inconsistent") == 1
    assert counts == {"duplicate": 1}


def test_a_position_other_than_the_acknowledged_one_is_reported() -> None:
    history = History()
    history.producer1[1] = Ack(1, 0, [(0, 0), (0, 1), (0, 2), (1, 3)])
    assert history.check() == {"inconsistent": 1}


def test_a_phantom_event_is_reported() -> None:
    history = History()
    history.verify.append(Read(0, 6, [ident(7, 0)], T0 + 5))
    assert history.check() == {"phantom": 1}


def test_loss_inside_reported_damage_is_counted_apart_when_bytes_were_flipped() -> None:
    history = History()
    history.verify[0] = Read(0, 0, [ident(1, 0), ident(1, 1)], T0 + 5)
    history.verify.insert(1, Damage(0, 2, 4, "corrupt data in segment 0"))
    history.flips = 1
    report = check_history(
        [history.producer1, history.producer2], [history.live], history.verify, flips=1
    )
    assert report.ok
    assert report.counts["lost_to_damage"] == 2
    assert report.counts["damaged_ranges"] == 1


def test_damage_without_a_flipped_byte_is_reported_and_excuses_no_loss() -> None:
    history = History()
    history.verify[0] = Read(0, 0, [ident(1, 0), ident(1, 1)], T0 + 5)
    history.verify.insert(1, Damage(0, 2, 4, "corrupt data in segment 0"))
    assert history.check() == {"unexpected_damage": 1, "lost": 2}


def test_damage_wider_than_a_batch_or_than_the_flips_is_reported() -> None:
    history = History()
    history.flips = 1
    history.verify.append(Damage(1, 0, 50, "a hole wider than any batch"))
    assert history.check() == {"unexpected_damage": 1}
    history.verify.append(Damage(2, 0, 1, "a second range from one flip"))
    assert history.check() == {"unexpected_damage": 2}


def test_a_committed_transaction_lost_to_damage_is_counted_apart() -> None:
    history = History()
    history.verify[1] = Damage(0, 4, 6, "corrupt")
    history.flips = 1
    assert history.check() == {}


def test_records_round_trip_through_files_and_a_torn_last_line_is_skipped(
    tmp_path: Path,
) -> None:
    history = History()
    for name, records in [
        ("producer-1", history.producer1),
        ("producer-2", history.producer2),
        ("reader-1", [*history.live, Read(1, 0, [ident(2, 2)], T0 + 3)]),
        ("verify", history.verify),
    ]:
        writer = RecordWriter(tmp_path / f"{name}.jsonl")
        for record in records:
            writer.write(record)
        writer.close()
    with open(tmp_path / "verify.jsonl", "ab") as f:
        f.write(b'{"r":"read","seg":0,"off":6,"ids":["1.9')  # a writer killed mid-line
    report = check_directory(tmp_path)
    assert report.anomalies["aborted_read"] == 1
    assert not report.ok
    assert "aborted_read: 1" in report.text()


@pytest.mark.parametrize("worker,seq,key", [(0, 0, 0), (3, 12345, 15), (99, 7, 3)])
def test_event_values_identify_themselves(worker: int, seq: int, key: int) -> None:
    value = event_value(worker, seq, key)
    assert event_id(value, event_key(worker, key).encode()) == f"{worker}.{seq}.{key}"
    for i in range(len(value)):
        damaged = bytearray(value)
        damaged[i] ^= 0x04
        assert event_id(bytes(damaged), event_key(worker, key).encode()).startswith("!")


def _with_damage(damage: Damage, read_rest: bool = False) -> History:
    history = History()
    history.verify[0] = Read(0, 0, [ident(1, 0), ident(1, 1)], T0 + 5)
    history.verify.insert(1, damage)
    if read_rest:
        history.verify.insert(2, Read(0, 3, [ident(1, 3)], T0 + 5))
    return history


def check_flipped(history: History, flipped: list[tuple[int, int, int] | None]) -> dict[str, int]:
    report = check_history(
        [history.producer1, history.producer2], [history.live], history.verify, flipped=flipped
    )
    return {kind: count for kind, count in report.anomalies.items() if count}


def test_damage_exactly_where_a_byte_was_flipped_is_no_anomaly() -> None:
    history = _with_damage(Damage(0, 2, 4, "a hole"))
    assert check_flipped(history, [(0, 2, 4)]) == {}
    history = _with_damage(Damage(0, 2, None, "probe"))
    history.verify.insert(2, Damage(0, 3, None, "probe"))
    assert check_flipped(history, [(0, 2, 4)]) == {}


def test_damage_outside_the_flipped_batch_is_reported() -> None:
    history = _with_damage(Damage(0, 2, 4, "a hole"))
    assert check_flipped(history, [(1, 2, 4)]) == {"unexpected_damage": 1}
    # where a flip's batch is unknown (a journal file), only the coarse rules apply
    assert check_flipped(history, [(1, 2, 4), None]) == {}


def test_damage_for_part_of_a_flipped_batch_only_is_reported() -> None:
    # offset 3 of the flipped batch was served although its batch failed its check
    history = _with_damage(Damage(0, 2, None, "corrupt"), read_rest=True)
    assert check_flipped(history, [(0, 2, 4)]) == {"unexpected_damage": 1}

"""Damage in synced journal data: only the damaged batches are lost, and readers are told.

A sealed journal file was synced before it was sealed, and the active file up to its sync
checkpoint, so damage there is bit rot, not a torn write: recovery skips the damaged entry,
keeps every entry after it, and records the lost offsets as a hole in their segment. Reads of
a hole raise CorruptData naming segment, offset and where to read on; offsets are never handed
out twice; the mover moves the file anyway, and the hole survives as a gap in the chunk index
(and another restart).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import BrokerProcess, journal_files

import slipstream

STREAM = "faults/damaged"


def _fill(client: slipstream.Client, batches: int, events: int) -> list[slipstream.Position]:
    """``batches`` batches (journal entries) of ``events`` events of 1 KiB; their positions."""
    positions = []
    with client.producer(STREAM, linger_ms=0) as producer:
        for b in range(batches):
            values = [f"b{b:02d}-{i:04d}".encode().ljust(1024, b".") for i in range(events)]
            receipt = producer.send_many(values)
            producer.flush()
            positions.append(receipt.result()[0])
    return positions


def _seal_and_damage(data_dir: Path, batch: int) -> Path:
    """Seal the only journal file with data (an empty next file, as a roll leaves it) and
    flip a byte inside the Arrow body of batch ``batch``."""
    (journal,) = journal_files(data_dir, STREAM)
    (journal.parent / f"{int(journal.stem) + 1:016d}.journal").touch()
    data = journal.read_bytes()
    at = data.index(f"b{batch:02d}-0000".encode()) + 20
    with open(journal, "r+b") as f:
        f.seek(at)
        f.write(bytes([data[at] ^ 0x01]))
    return journal


def _values(
    client: slipstream.Client, start: slipstream.StreamCut | str = "earliest"
) -> list[bytes]:
    reader = client.reader(STREAM, start=start, end=client.tail(STREAM))
    return [e.value[:8] for e in reader]


def _expected(batches: range, events: int) -> list[bytes]:
    return [f"b{b:02d}-{i:04d}".encode() for b in batches for i in range(events)]


def _assert_hole(client: slipstream.Client, good: list[bytes], lost: int, resume: int) -> None:
    """Reading from earliest serves ``good``, then raises CorruptData for the hole."""
    served = []
    with pytest.raises(slipstream.CorruptData) as raised:
        for event in client.reader(STREAM, start="earliest", end=client.tail(STREAM)):
            served.append(event.value[:8])
    assert served == good
    assert raised.value.details == {"segment": 0, "offset": lost, "resume": resume}
    assert f"read on from offset {resume}" in raised.value.message


def _wait_for_move(broker: BrokerProcess, journal: Path) -> None:
    for _ in range(100):
        if not journal.exists():
            return
        time.sleep(0.1)
    raise AssertionError(f"the mover never moved {journal.name}: {broker.log()[-2000:]}")


@pytest.mark.parametrize("events", [1, 300], ids=["small-batches", "large-batches"])
def test_a_damaged_batch_in_a_sealed_file_is_a_hole_and_the_rest_is_kept(
    broker_factory: type[BrokerProcess], events: int
) -> None:
    broker = broker_factory().start()
    with broker.client() as client:
        client.create_stream(STREAM, segments=1)
        positions = _fill(client, 12, events)
    broker.stop()
    journal = _seal_and_damage(broker.data_dir, 5)
    lost, resume = positions[5].offset, positions[6].offset

    broker.start()
    assert "damaged" in broker.log()
    with broker.client() as client:
        _assert_hole(client, _expected(range(5), events), lost, resume)
        after = slipstream.StreamCut(STREAM, {0: resume})
        assert _values(client, after) == _expected(range(6, 12), events)
        (new,) = _fill(client, 1, 1)
        assert new.offset == 12 * events, "no offset is handed out twice"

        _wait_for_move(broker, journal)  # the sealed file became chunks, hole and all
        _assert_hole(client, _expected(range(5), events), lost, resume)
        assert _values(client, after)[: 6 * events] == _expected(range(6, 12), events)
    broker.stop()

    broker.start()
    with broker.client() as client:
        _assert_hole(client, _expected(range(5), events), lost, resume)
        assert len(_values(client, after)) == 6 * events + 1
        assert client.tail(STREAM).positions == {0: 12 * events + 1}


@pytest.mark.parametrize("events", [10, 300], ids=["small-batches", "large-batches"])
def test_a_damaged_last_batch_keeps_its_offsets_taken(
    broker_factory: type[BrokerProcess], events: int
) -> None:
    # No later batch of the segment reveals the gap: recovery reads the damaged entry's own
    # header (segment id, base offset, count), which the flip in its body left intact.
    broker = broker_factory().start()
    with broker.client() as client:
        client.create_stream(STREAM, segments=1)
        _fill(client, 4, events)
    broker.stop()
    journal = _seal_and_damage(broker.data_dir, 3)
    good, lost, end = _expected(range(3), events), 3 * events, 4 * events

    broker.start()
    with broker.client() as client:
        assert client.tail(STREAM).positions == {0: end}
        _assert_hole(client, good, lost, end)
        (new,) = _fill(client, 1, 1)
        assert new.offset == end
        _wait_for_move(broker, journal)
        _assert_hole(client, good, lost, end)
    broker.stop()
    broker.start()
    with broker.client() as client:
        assert client.tail(STREAM).positions == {0: end + 1}
        _assert_hole(client, good, lost, end)


def test_rot_in_the_synced_part_of_the_active_file_is_a_hole(
    broker_factory: type[BrokerProcess],
) -> None:
    broker = broker_factory().start()
    with broker.client() as client:
        client.create_stream(STREAM, segments=1)
        positions = _fill(client, 6, 10)
        time.sleep(1.2)  # the next sync writes a checkpoint covering all of it
        positions += _fill(client, 1, 10)
    broker.stop()
    (journal,) = journal_files(broker.data_dir, STREAM)
    data = journal.read_bytes()
    at = data.index(b"b03-0000") + 20
    with open(journal, "r+b") as f:
        f.seek(at)
        f.write(bytes([data[at] ^ 0x01]))

    broker.start()
    with broker.client() as client:
        assert client.tail(STREAM).positions == {0: 70}
        _assert_hole(client, _expected(range(3), 10), 30, 40)
        after = slipstream.StreamCut(STREAM, {0: 40})
        assert _values(client, after) == [*_expected(range(4, 6), 10), *_expected(range(1), 10)]
        assert positions[6].offset == 60

"""Torn and corrupt bytes: found by CRC32C, cut off in recovery or reported, never served."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from conftest import BrokerProcess, chunk_files, journal_files

import slipstream


def _journal_files(data_dir: Path, stream: str = "faults/torn") -> list[Path]:
    return journal_files(data_dir, stream)


def _logical_end(journal: Path) -> int:
    """Where the last entry ends: a direct write leaves zero padding up to a 4 KiB block."""
    data, end = journal.read_bytes(), 0
    while end + 8 <= len(data):
        length = int.from_bytes(data[end : end + 4], "little")
        if length == 0 or end + 8 + length > len(data):
            break
        end += 8 + length
    return end


def _fill(
    client: slipstream.Client, count: int, stream: str = "faults/torn"
) -> list[slipstream.Position]:
    """One batch (one journal entry) per event: wait for each acknowledgement."""
    with client.producer(stream, linger_ms=0) as producer:
        return [producer.send(f"event-{i}".encode(), key="k").result() for i in range(count)]


def _wait_for_chunks(broker: BrokerProcess, stream: str = "faults/torn") -> list[Path]:
    """The stream's chunk files, once the mover has written at least one (fails after 10 s)."""
    for _ in range(100):
        chunks = chunk_files(broker.data_dir, stream)
        if chunks:
            return chunks
        time.sleep(0.1)
    raise AssertionError("the mover never wrote a chunk")


def _read_all(client: slipstream.Client, stream: str = "faults/torn") -> list[slipstream.Event]:
    return list(client.reader(stream, start="earliest", end=client.tail(stream)))


@pytest.mark.parametrize("damage", ["truncate", "bitflip", "garbage"])
def test_damaged_journal_tail_is_cut_and_the_rest_served(
    broker_factory: type[BrokerProcess], damage: str
) -> None:
    broker = broker_factory().start()
    with broker.client() as client:
        client.create_stream("faults/torn", segments=1)
        _fill(client, 20)
    broker.kill()
    (journal,) = _journal_files(broker.data_dir)
    # A torn write hits only what was never synced: past the sync checkpoint, as if the
    # crash came before the next one (else this damage would be rot, and skipped).
    (journal.parent / "synced.checkpoint").unlink(missing_ok=True)
    size = _logical_end(journal)
    with open(journal, "r+b") as f:
        f.truncate(size)  # as if the padding had not reached the disk
        if damage == "truncate":
            f.truncate(size - 7)  # tear the last entry
        elif damage == "bitflip":
            f.seek(size - 30)
            byte = f.read(1)
            f.seek(size - 30)
            f.write(bytes([byte[0] ^ 0x10]))
        else:  # a half-written entry after the last good one
            f.seek(size)
            f.write(b"\x40\x00\x00\x00\x12\x34\x56\x78" + os.urandom(20))
    broker.start()
    with broker.client() as client:
        events = _read_all(client)
        expected = 20 if damage == "garbage" else 19
        assert [e.value for e in events] == [f"event-{i}".encode() for i in range(expected)]
        # the broker keeps appending after the cut, with no offset gap
        (position,) = _fill(client, 1)
        assert position.offset == expected
    assert "cutting" in broker.log()


def test_corrupt_chunk_is_reported_with_segment_and_offset(
    broker_factory: type[BrokerProcess],
) -> None:
    broker = broker_factory("--roll", "4KiB", "--roll-seconds", "0.2").start()
    with broker.client() as client:
        client.create_stream("faults/torn", segments=1)
        _fill(client, 200)
        chunks = _wait_for_chunks(broker)
    broker.stop()
    with open(chunks[0], "r+b") as f:
        f.seek(100)  # inside the first batch's Arrow body
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    broker.start()
    with broker.client() as client, pytest.raises(slipstream.CorruptData) as raised:
        _read_all(client)
    assert raised.value.details["segment"] == 0
    assert raised.value.details["offset"] == 0
    assert "corrupt data in segment 0" in raised.value.message


def test_journal_bytes_corrupted_while_running_are_reported_not_served(
    broker_factory: type[BrokerProcess],
) -> None:
    broker = broker_factory().start()
    with broker.client() as client:
        client.create_stream("faults/torn", segments=1)
        positions = _fill(client, 20)
    broker.stop()
    broker.start()  # the tail cache is empty now: reads go to the journal file
    (journal,) = _journal_files(broker.data_dir)
    data = journal.read_bytes()
    at = data.index(b"event-5") - 1  # inside the Arrow body of the sixth batch
    with open(journal, "r+b") as f:
        f.seek(at)
        f.write(bytes([data[at] ^ 0x01]))
    with broker.client() as client:
        reader = iter(
            client.reader("faults/torn", start="earliest", end=client.tail("faults/torn"))
        )
        assert [next(reader).value for _ in range(5)] == [f"event-{i}".encode() for i in range(5)]
        with pytest.raises(slipstream.CorruptData) as raised:
            next(reader)
    assert raised.value.details == {"segment": 0, "offset": positions[5].offset}


def test_corrupt_batch_among_large_ones_in_a_chunk_is_reported_after_the_good_ones(
    broker_factory: type[BrokerProcess],
) -> None:
    # one read takes several large batches from the chunk: the good one before the damage is
    # served, then the damaged one is reported with its segment and offset
    broker = broker_factory("--roll", "256KiB", "--roll-seconds", "0.2").start()
    with broker.client() as client:
        client.create_stream("faults/big", segments=1)
        # uncompressed, so that the damage below finds the value's bytes in the chunk
        with client.producer("faults/big", compression=None) as producer:
            for b in range(6):  # six batches of 100 events of 1 KiB
                producer.send_many([f"b{b}-{i:04d}".encode().ljust(1024, b".") for i in range(100)])
                producer.flush()
        # the chunk with the second batch (a roll by time may put it in a later chunk)
        deadline = time.monotonic() + 10
        while not (
            found := [
                c
                for c in chunk_files(broker.data_dir, "faults/big")
                if b"b1-0050" in c.read_bytes()
            ]
        ):
            assert time.monotonic() < deadline, "the second batch never moved to a chunk"
            time.sleep(0.1)
    broker.stop()
    (chunk,) = found
    data = chunk.read_bytes()
    at = data.index(b"b1-0050")  # inside the second batch's Arrow body
    with open(chunk, "r+b") as f:
        f.seek(at)
        f.write(bytes([data[at] ^ 0x01]))
    broker.start()
    with broker.client() as client:
        reader = iter(client.reader("faults/big", start="earliest", end=client.tail("faults/big")))
        assert [next(reader).value[:7] for _ in range(100)] == [
            f"b0-{i:04d}".encode() for i in range(100)
        ]
        with pytest.raises(slipstream.CorruptData) as raised:
            next(reader)
    assert raised.value.details == {"segment": 0, "offset": 100}
    assert "corrupt data in segment 0 of 'faults/big' at offset 100" in raised.value.message


def test_chunk_cut_short_under_a_running_broker_is_reported_not_a_crash(
    broker_factory: type[BrokerProcess],
) -> None:
    # The broker reads chunks through memory maps; touching a mapped page past the end of its
    # file would kill it with SIGBUS. It loads each range first, which fails instead.
    broker = broker_factory("--roll", "4KiB", "--roll-seconds", "0.2").start()
    with broker.client() as client:
        client.create_stream("faults/torn", segments=1)
        _fill(client, 200)
        chunks = _wait_for_chunks(broker)
        assert len(_read_all(client)) == 200  # every chunk read, so mapped, once
        os.truncate(chunks[0], 0)
        with pytest.raises(slipstream.CorruptData) as raised:
            _read_all(client)
        assert raised.value.details["segment"] == 0
        assert raised.value.details["offset"] == 0
        assert "shorter than its catalog entry" in raised.value.message
        # the broker is alive and serves the rest, and takes appends
        later = client.reader("faults/torn", start=client.tail("faults/torn"))
        tail = client.tail("faults/torn")
        assert broker.proc is not None and broker.proc.poll() is None
        rest = list(
            client.reader(
                "faults/torn",
                start=slipstream.StreamCut("faults/torn", {0: 150}),
                end=tail,
            )
        )
        assert [e.value for e in rest] == [f"event-{i}".encode() for i in range(150, 200)]
        _fill(client, 1)
        assert next(iter(later)).value == b"event-0"

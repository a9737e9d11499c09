"""Fuzz journal recovery over real journal files with random damage.

A journal is written as the broker writes one (entries of a segment id and a real batch, the
broker's entry check and resync marker, direct or buffered writes, with or without a sync
checkpoint, several files), then one or two of its files (and maybe the checkpoint) get byte
flips, overwrites, insertions, deletions or a truncation. Recovery must then:

* raise nothing (damage is cut or skipped and reported, never an exception at startup);
* return only entries that were written, each once, in order, each readable at its address
  (so none whose CRC does not check out);
* keep every entry that lies wholly before the first damaged byte of its file, and every entry
  of a file nobody touched;
* leave a journal that appends, and that a second recovery reads back the same plus the new
  entry; sealed files list (``entries``, ``heads``) what recovery kept, raising only
  ``CorruptData``.

tests/storage/test_journal_conformance.py checks exact outcomes of single flips and torn tails;
this one combines damage the way disks and crashes do.
"""

from __future__ import annotations

import contextlib
import struct
import tempfile
from pathlib import Path

from fuzz_inputs import mutated, real_batches
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slipstream import CorruptBatch, CorruptData
from slipstream.format import MAGIC, verify
from slipstream.storage import FileJournal, JournalAddress
from slipstream.storage._journal import ENTRY_OVERHEAD

_SEGMENT_ID = struct.Struct("<Q")
RESYNC = (MAGIC, _SEGMENT_ID.size)  # the broker's: its batch magic, after the segment id


def batch_checks_out(payload: memoryview) -> bool:
    """The broker's check of a self-checked entry: the batch's header, CRC32C and length."""
    try:
        header = verify(payload, _SEGMENT_ID.size)
    except CorruptBatch:
        return False
    return header.batch_length == len(payload) - _SEGMENT_ID.size


def open_journal(directory: Path, checkpoint: bool, direct: bool) -> FileJournal:
    return FileJournal(
        directory,
        fsync=checkpoint,  # a checkpoint is written only by a journal that syncs
        direct=direct,
        check=batch_checks_out,
        resync=RESYNC,
        checkpoint_seconds=0.0 if checkpoint else None,
    )


Written = list[list[tuple[JournalAddress, bytes]]]  # per file, its entries in order

layouts = st.lists(  # files, each a list of appends, each a list of (segment, batch index)
    st.lists(
        st.lists(
            st.tuples(st.integers(0, 3), st.integers(0, len(real_batches()) - 1)),
            min_size=1,
            max_size=3,
        ),
        min_size=1,
        max_size=3,
    ),
    min_size=1,
    max_size=3,
)


def write(
    directory: Path, layout: list[list[list[tuple[int, int]]]], checkpoint: bool, direct: bool
) -> Written:
    journal = open_journal(directory, checkpoint, direct)
    assert list(journal.recover()) == []
    written: Written = []
    for number, appends in enumerate(layout):
        if number:
            journal.roll()
        entries: list[tuple[JournalAddress, bytes]] = []
        for group in appends:
            parts = [(_SEGMENT_ID.pack(s), real_batches()[b]) for s, b in group]
            addresses = journal.append(parts)
            journal.sync()
            entries += [(a, b"".join(p)) for a, p in zip(addresses, parts, strict=True)]
        written.append(entries)
    journal.close()
    return written


def journal_path(directory: Path, file_id: int) -> Path:
    return directory / f"{file_id:016d}.journal"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layout=layouts,
    checkpoint=st.booleans(),
    direct=st.booleans(),
    damage_checkpoint=st.booleans(),
    data=st.data(),
)
def test_recovery_of_damaged_files_keeps_what_is_intact_and_returns_nothing_damaged(
    layout: list[list[list[tuple[int, int]]]],
    checkpoint: bool,
    direct: bool,
    damage_checkpoint: bool,
    data: st.DataObject,
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "journal"
        written = write(directory, layout, checkpoint, direct)
        damaged_files = data.draw(
            st.sets(st.integers(0, len(written) - 1), min_size=1, max_size=2), label="files"
        )
        intact: dict[int, int] = {}
        for file_id in sorted(damaged_files):
            path = journal_path(directory, file_id)
            damage = data.draw(
                mutated(
                    path.read_bytes(), kinds=("flip", "overwrite", "insert", "delete", "truncate")
                ),
                label=f"file {file_id}",
            )
            path.write_bytes(damage.data)
            intact[file_id] = damage.intact
        checkpoint_path = directory / "synced.checkpoint"
        if damage_checkpoint and checkpoint_path.exists():
            record = bytearray(checkpoint_path.read_bytes())
            at = data.draw(st.integers(0, len(record) - 1), label="checkpoint byte")
            record[at] ^= data.draw(st.integers(1, 255), label="checkpoint flip")
            checkpoint_path.write_bytes(bytes(record))

        journal = open_journal(directory, checkpoint, direct)
        try:
            recovered = [(a, bytes(p)) for a, p in journal.recover()]
            check_recovered(journal, written, intact, recovered)
            (new,) = journal.append([[_SEGMENT_ID.pack(9), real_batches()[0]]])
            journal.sync()
        finally:
            journal.close()
        again = open_journal(directory, checkpoint, direct)
        try:
            assert [(a, bytes(p)) for a, p in again.recover()] == [
                *recovered,
                (new, _SEGMENT_ID.pack(9) + real_batches()[0]),
            ]
        finally:
            again.close()


def check_recovered(
    journal: FileJournal,
    written: Written,
    intact: dict[int, int],
    recovered: list[tuple[JournalAddress, bytes]],
) -> None:
    everything = [entry for entries in written for entry in entries]
    # only written entries, each once and in order (a subsequence of what was written)
    payloads = iter(payload for _, payload in everything)
    for address, payload in recovered:
        assert any(payload == p for p in payloads), f"recovered an entry never written: {address}"
        assert journal.read(address) == payload
    assert journal.report.entries == len(recovered)
    # everything before the first damaged byte of its file, and all of untouched files
    kept = {(a.file_id, a.position) for a, _ in recovered}
    for file_id, entries in enumerate(written):
        for address, _ in entries:
            if address.position + address.length <= intact.get(file_id, 1 << 62):
                assert (file_id, address.position) in kept, f"lost intact entry {address}"
    # sealed files list what recovery kept of them
    for file_id in journal.sealed_files():
        assert [(a, bytes(p)) for a, p in journal.entries(file_id)] == [
            e for e in recovered if e[0].file_id == file_id
        ]
        with contextlib.suppress(CorruptData):
            for address, head in journal.heads(file_id, ENTRY_OVERHEAD + 64):
                assert address.file_id == file_id and len(head) <= ENTRY_OVERHEAD + 64

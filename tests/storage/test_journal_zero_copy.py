"""Self-checked entries that a direct FileJournal writes from their own memory.

A large entry whose last part sits at the right place in its 4 KiB block goes to the device
straight from that memory: the journal pads the file to a block boundary, writes the entry
header and the first bytes from its staging buffer, the whole blocks in the middle from the
entry's memory, and the rest from staging again. Its CRC covers only the first
``CHECKED_PREFIX`` payload bytes; the payload's own checksum (the journal's ``check``) covers
the rest. Recovery must skip the padding and still cut at the first torn or damaged entry.
"""

from __future__ import annotations

import shutil
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path

import crc32c
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream.storage import ENTRY_OVERHEAD, FileJournal, JournalAddress, payload_alignment
from slipstream.storage import _journal as journal_module
from slipstream.storage._journal import BLOCK, SELF_CHECKED

PREFIX = b"segment!"  # what the broker puts before a batch: 8 bytes
MIN = 2 * BLOCK  # the zero-copy threshold in these tests (the real one is 256 KiB)


@pytest.fixture(autouse=True)
def small_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(journal_module, "ZERO_COPY_MIN_BYTES", MIN)


def body(size: int, tag: int) -> bytes:
    """A payload body that carries its own CRC32C in its last 4 bytes, as a batch does."""
    data = np.random.default_rng(tag).integers(0, 256, size - 4, dtype=np.uint8).tobytes()
    return data + struct.pack("<I", crc32c.crc32c(data))


def check(payload: memoryview) -> bool:
    inner = payload[len(PREFIX) :]
    return len(inner) > 4 and struct.unpack("<I", inner[-4:])[0] == crc32c.crc32c(inner[:-4])


def placed(data: bytes, aligned: bool = True) -> memoryview:
    """``data`` in memory where the journal can write it in place (or one byte off)."""
    raw = np.empty(len(data) + 2 * BLOCK, np.uint8)
    want = payload_alignment(len(PREFIX)) + (0 if aligned else 1)
    skew = (want - raw.ctypes.data) % BLOCK
    view = memoryview(raw[skew : skew + len(data)])
    view[:] = data
    return view


def new_journal(directory: Path, *, with_check: bool = True) -> FileJournal:
    journal = FileJournal(directory, check=check if with_check else None)
    list(journal.recover())
    if not journal.direct:
        journal.close()
        pytest.skip("this filesystem refuses O_DIRECT")
    return journal


def field_at(path: Path, address: JournalAddress) -> int:
    with open(path, "rb") as f:
        f.seek(address.position - ENTRY_OVERHEAD)
        return int(struct.unpack("<I", f.read(4))[0])


def die(journal: FileJournal) -> None:
    """The process dies: nothing trims the last block's padding."""
    journal._cut_padding = lambda: None  # type: ignore[method-assign]
    journal.close()


def recovered(directory: Path, *, with_check: bool = True) -> tuple[FileJournal, list]:
    journal = FileJournal(directory, check=check if with_check else None)
    found = [(address, bytes(payload)) for address, payload in journal.recover()]
    return journal, found


@pytest.fixture
def directory() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="zero-copy-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_aligned_large_entries_are_written_in_place_and_read_back(directory: Path) -> None:
    journal = new_journal(directory)
    bigs = [body(MIN + 777, 1), body(3 * MIN, 2), body(MIN + 5, 3)]
    entries = [
        [b"small one"],
        [PREFIX, placed(bigs[0])],
        [b"x" * 100],
        [PREFIX, placed(bigs[1])],
        [PREFIX, placed(bigs[2], aligned=False)],  # misplaced: written as a plain entry
        [PREFIX, placed(body(MIN - 100, 4))],  # too small: plain
    ]
    expected = [b"".join(bytes(p) for p in entry) for entry in entries]
    addresses = journal.append(entries)
    journal.sync()
    path = journal.file_path(0)
    assert path is not None
    flags = [field_at(path, a) & SELF_CHECKED for a in addresses]
    assert flags == [0, SELF_CHECKED, 0, SELF_CHECKED, 0, 0]
    for address, flag in zip(addresses, flags, strict=True):
        if flag:  # an aligned entry starts on a block boundary, after zero padding
            assert (address.position - ENTRY_OVERHEAD) % BLOCK == 0
    assert [journal.read(a) for a in addresses] == expected
    # the next group continues right after the last entry, in the same block
    (after,) = journal.append([[b"after"]])
    journal.sync()
    assert after.position == addresses[-1].position + addresses[-1].length + ENTRY_OVERHEAD
    die(journal)

    again, found = recovered(directory)
    try:
        assert found == list(zip([*addresses, after], [*expected, b"after"], strict=True))
        assert again.report.cut_bytes == 0
        assert [journal_bytes for _, journal_bytes in again.heads(0, 4)] == [
            e[:4] for e in [*expected, b"after"]
        ]
        again.roll()
        assert [bytes(p) for _, p in again.entries(0)] == [*expected, b"after"]
    finally:
        again.close()


def test_an_aligned_entry_may_start_a_file_and_end_on_a_block_boundary(directory: Path) -> None:
    journal = new_journal(directory)
    exact = body(4 * BLOCK - ENTRY_OVERHEAD - len(PREFIX), 5)  # the entry fills 4 blocks
    (address,) = journal.append([[PREFIX, placed(exact)]])
    journal.sync()
    assert address.position == ENTRY_OVERHEAD
    assert journal.active_bytes == 4 * BLOCK
    (small,) = journal.append([[b"next"]])
    journal.sync()
    assert small.position == 4 * BLOCK + ENTRY_OVERHEAD
    die(journal)
    again, found = recovered(directory)
    again.close()
    assert found == [(address, PREFIX + exact), (small, b"next")]


def _one_aligned_entry_between_two(directory: Path) -> tuple[list, int, int]:
    """A file of: a small entry, padding, an aligned entry, a small entry. Returns what was
    written, where the padding starts and where the aligned entry starts."""
    journal = new_journal(directory)
    big = body(3 * BLOCK + 100, 6)
    entries = [[b"before" * 3], [PREFIX, placed(big)], [b"after"]]
    addresses = journal.append(entries)
    journal.sync()
    die(journal)
    expected = [b"before" * 3, PREFIX + big, b"after"]
    return (
        list(zip(addresses, expected, strict=True)),
        addresses[0].position + 18,
        (addresses[1].position - ENTRY_OVERHEAD),
    )


@pytest.mark.parametrize(
    "damage",
    [
        "flip in padding",
        "flip in entry header",
        "flip in prefix",
        "flip in middle blocks",
        "flip in last block",
        "tear in padding",
        "tear in first block",
        "tear in middle blocks",
    ],
)
def test_damage_to_an_aligned_entry_cuts_it_and_everything_after(
    directory: Path, damage: str
) -> None:
    written, padding, start = _one_aligned_entry_between_two(directory)
    path = directory / "0000000000000000.journal"
    data = bytearray(path.read_bytes())
    where = {
        "flip in padding": padding + 20,
        "flip in entry header": start + 2,
        "flip in prefix": start + ENTRY_OVERHEAD + 3,
        "flip in middle blocks": start + 2 * BLOCK + 10,
        "flip in last block": start + 3 * BLOCK + 50,
        "tear in padding": padding + 10,
        "tear in first block": start + 100,
        "tear in middle blocks": start + 2 * BLOCK,
    }[damage]
    if damage.startswith("flip"):
        data[where] ^= 0x04
    else:
        del data[where:]
    path.write_bytes(bytes(data))
    journal, found = recovered(directory)
    journal.close()
    assert found == written[:1]
    assert journal.report.cut_bytes > 0
    assert path.stat().st_size == padding, "cut where the first entry ends"


def test_a_journal_without_a_check_cuts_at_self_checked_entries(directory: Path) -> None:
    written, padding, _ = _one_aligned_entry_between_two(directory)
    journal, found = recovered(directory, with_check=False)
    journal.close()
    assert found == written[:1]
    assert journal.report.cut_reason is not None
    assert (directory / "0000000000000000.journal").stat().st_size == padding


@settings(max_examples=40, deadline=None)
@given(
    groups=st.lists(
        st.lists(
            st.one_of(
                st.integers(1, 300),
                st.integers(BLOCK - 24, BLOCK + 8),
                st.tuples(st.integers(MIN, 3 * MIN), st.booleans()),  # large: (size, placed)
            ),
            min_size=1,
            max_size=4,
        ),
        min_size=1,
        max_size=6,
    )
)
def test_any_mix_of_entries_survives_a_crash(groups: list[list[int | tuple[int, bool]]]) -> None:
    directory = Path(tempfile.mkdtemp(prefix="zero-copy-"))
    try:
        journal = new_journal(directory)
        expected = []
        for number, sizes in enumerate(groups):
            entries, items = [], []
            for i, size in enumerate(sizes):
                if isinstance(size, tuple):
                    data = body(size[0], number * 10 + i)
                    entries.append([PREFIX, placed(data, aligned=size[1])])
                    items.append(PREFIX + data)
                else:
                    entries.append([bytes([number % 251 + 1]) * size])
                    items.append(entries[-1][0])
            addresses = journal.append(entries)
            journal.sync()
            expected += list(zip(addresses, items, strict=True))
        assert [journal.read(a) for a, _ in expected] == [item for _, item in expected]
        die(journal)
        again, found = recovered(directory)
        again.close()
        assert found == expected
        assert again.report.cut_bytes == 0
    finally:
        shutil.rmtree(directory, ignore_errors=True)

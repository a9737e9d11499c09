"""The journal's entry format against bytes built by hand from its documentation.

``parse_entry`` is the one parser of journal files (recovery, its resync scan and outline,
``entries``, ``heads``, ``read``) and ``aligned_start`` / ``block_end`` the one padding rule
(the writer's and the parser's). Round trips cannot catch a change to a rule both sides share,
so these tests state the format independently: every entry kind and every damage class at
literal byte positions, and files written by a direct ``FileJournal`` compared byte for byte
with images built from the layout in the module docstring (and docs/format.md, which quotes it).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from pathlib import Path

import crc32c
import numpy as np
import pytest

from slipstream.storage import _journal as journal_module
from slipstream.storage._journal import (
    BLOCK,
    CHECKED_PREFIX,
    ENTRY_OVERHEAD,
    SELF_CHECKED,
    EntryAt,
    FileJournal,
    JournalAddress,
    Parsed,
    _InFile,
    aligned_start,
    block_end,
    checkpoint_record,
    parse_checkpoint,
    parse_entry,
    payload_alignment,
)

PREFIX = b"segment!"  # what the broker puts before a batch: 8 bytes
ZERO_COPY_MIN = 2 * BLOCK  # the zero-copy threshold in these tests (the real one is 256 KiB)


def body(size: int, tag: int) -> bytes:
    """Bytes that carry their own CRC32C in their last 4 bytes, as a batch does."""
    data = np.random.default_rng(tag).integers(0, 256, size - 4, dtype=np.uint8).tobytes()
    return data + struct.pack("<I", crc32c.crc32c(data))


def check(payload: memoryview) -> bool:
    """The journal's check of a self-checked payload: PREFIX, then a body as ``body`` makes."""
    inner = bytes(payload[len(PREFIX) :])
    return len(inner) > 4 and struct.unpack("<I", inner[-4:])[0] == crc32c.crc32c(inner[:-4])


# --- the format, from its documentation -------------------------------------------------------


def plain(payload: bytes) -> bytes:
    """length (u32), CRC32C of the payload (u32), payload."""
    return struct.pack("<II", len(payload), crc32c.crc32c(payload)) + payload


def self_checked(payload: bytes) -> bytes:
    """length with bit 31 set, CRC32C of the first 72 payload bytes, payload."""
    return struct.pack("<II", len(payload) | 0x8000_0000, crc32c.crc32c(payload[:72])) + payload


def pad_to_aligned(image: bytes) -> bytes:
    """Zeros from the end of the previous entry to the first 4096-byte boundary at least 8 bytes
    on (none if it ends on a boundary), written here without the module's helpers."""
    size = len(image)
    if size % 4096 == 0:
        return image
    boundary = (size + 8 + 4095) // 4096 * 4096
    return image + bytes(boundary - size)


def pad_to_block(image: bytes) -> bytes:
    """A direct write's end: zeros up to the next 4096-byte boundary."""
    return image + bytes(-len(image) % 4096)


def test_the_padding_rule_at_literal_positions() -> None:
    assert {p: aligned_start(p) for p in (0, 1, 100, 4088, 4089, 4095, 4096, 4097, 8184)} == {
        0: 0,
        1: 4096,
        100: 4096,
        4088: 4096,  # exactly 8 bytes of padding: room for the zero length field
        4089: 8192,  # 7 bytes would not hold it
        4095: 8192,
        4096: 4096,
        4097: 8192,
        8184: 8192,
    }
    assert {p: block_end(p) for p in (0, 1, 4095, 4096, 4097)} == {
        0: 0,
        1: 4096,
        4095: 4096,
        4096: 4096,
        4097: 8192,
    }
    assert (BLOCK, ENTRY_OVERHEAD, SELF_CHECKED, CHECKED_PREFIX) == (4096, 8, 0x8000_0000, 72)


# --- parse_entry: every entry kind and every damage class --------------------------------------

SMALL = b"small entry"
BIG = PREFIX + body(3 * BLOCK + 123, 1)


def walk(image: bytes, *, verify: bool = True) -> list[EntryAt]:
    """Every answer of parse_entry from the start of ``image`` to its first non-entry."""
    found = [parse_entry(image, 0, check, verify=verify)]
    while found[-1].kind is Parsed.ENTRY:
        found.append(parse_entry(image, found[-1].end, check, verify=verify))
    return found


def entry(start: int, length: int, self_checked: bool = False) -> EntryAt:
    return EntryAt(Parsed.ENTRY, start, length, self_checked)


def test_an_empty_file_and_the_end_of_a_file_are_the_end() -> None:
    assert parse_entry(b"", 0) == EntryAt(Parsed.END, 0)
    image = plain(SMALL)
    assert walk(image) == [entry(0, len(SMALL)), EntryAt(Parsed.END, len(image))]


def test_plain_entries_follow_each_other_without_padding() -> None:
    image = plain(SMALL) + plain(b"x" * 5000) + plain(b"y")
    assert walk(image) == [
        entry(0, len(SMALL)),
        entry(19, 5000),
        entry(5027, 1),
        EntryAt(Parsed.END, 5036),
    ]
    first = walk(image)[0]
    assert (first.payload_start, first.end) == (8, 19)


@pytest.mark.parametrize("before", [9, 80, 4080, 4081, 4088, 4089, 4095])
def test_a_self_checked_entry_after_padding_starts_on_the_rule_s_boundary(before: int) -> None:
    lead = plain(b"p" * (before - ENTRY_OVERHEAD))  # ends at byte ``before``
    image = pad_to_aligned(lead)
    assert len(image) == (4096 if before <= 4088 else 8192)
    boundary = len(image)
    image += self_checked(BIG) + plain(SMALL)
    after_big = boundary + ENTRY_OVERHEAD + len(BIG)
    assert walk(image) == [
        entry(0, len(lead) - ENTRY_OVERHEAD),
        entry(boundary, len(BIG), self_checked=True),
        entry(after_big, len(SMALL)),
        EntryAt(Parsed.END, len(image)),
    ]


def test_a_self_checked_entry_on_a_block_boundary_needs_no_padding() -> None:
    lead = plain(b"q" * (BLOCK - ENTRY_OVERHEAD))  # ends on the boundary
    image = lead + self_checked(BIG)
    assert walk(image)[1] == entry(BLOCK, len(BIG), self_checked=True)
    assert parse_entry(self_checked(BIG), 0, check) == entry(0, len(BIG), self_checked=True)


def test_zero_padding_that_ends_a_block_aligned_file_is_its_end() -> None:
    image = pad_to_block(plain(SMALL))
    assert walk(image) == [entry(0, len(SMALL)), EntryAt(Parsed.END, 19)]
    exact = plain(b"z" * (BLOCK - ENTRY_OVERHEAD))  # ends on a boundary: nothing to pad
    assert walk(exact)[-1] == EntryAt(Parsed.END, BLOCK)


def torn(pos: int, length: int = 0, *, header: bool = False) -> tuple[Parsed, int, str]:
    reason = (
        f"torn entry header at byte {pos}"
        if header
        else f"torn or zero-length entry at byte {pos} (length {length})"
    )
    return Parsed.TORN, pos, reason


def outcome(image: bytes, pos: int, *, verify: bool = True) -> tuple[Parsed, int, str | None]:
    found = parse_entry(image, pos, check, verify=verify)
    return found.kind, found.start, found.reason


@pytest.mark.parametrize("short", range(1, ENTRY_OVERHEAD))
def test_a_short_header_is_torn(short: int) -> None:
    image = plain(SMALL) + plain(SMALL)[:short]
    assert outcome(image, 19) == torn(19, header=True)


def test_a_zero_length_is_torn() -> None:
    image = plain(SMALL) + struct.pack("<II", 0, 0) + b"more"
    assert outcome(image, 19) == torn(19)
    assert outcome(struct.pack("<II", SELF_CHECKED, 0) + b"x", 0) == torn(0)


@pytest.mark.parametrize("missing", [1, 5, len(SMALL)])
def test_a_payload_past_the_end_is_torn(missing: int) -> None:
    image = plain(SMALL) + plain(SMALL)[:-missing]
    assert outcome(image, 19) == torn(19, len(SMALL))
    assert outcome(image, 19, verify=False) == torn(19, len(SMALL))


def damaged(pos: int) -> tuple[Parsed, int, str]:
    return Parsed.DAMAGED, pos, f"CRC32C mismatch in entry at byte {pos}"


@pytest.mark.parametrize("at", [4, 7, 8, 18])  # in the CRC field or the payload
def test_a_flipped_byte_in_a_plain_entry_is_damage(at: int) -> None:
    image = bytearray(plain(SMALL) + plain(SMALL))
    image[19 + at] ^= 0x10
    assert outcome(bytes(image), 19) == damaged(19)
    assert outcome(bytes(image), 19, verify=False) == (Parsed.ENTRY, 19, None)


@pytest.mark.parametrize(
    "at",
    [4, 8 + 3, 8 + CHECKED_PREFIX - 1, 8 + CHECKED_PREFIX, 8 + 2000, 8 + len(BIG) - 1],
    ids=["crc", "prefix", "prefix-end", "after-prefix", "body", "body-crc"],
)
def test_a_flipped_byte_in_a_self_checked_entry_is_damage(at: int) -> None:
    image = bytearray(self_checked(BIG))
    image[at] ^= 0x01
    assert outcome(bytes(image), 0) == damaged(0)
    assert outcome(bytes(image), 0, verify=False) == (Parsed.ENTRY, 0, None)


def test_a_self_checked_entry_without_a_check_or_too_short_is_damage() -> None:
    image = self_checked(BIG)
    assert parse_entry(image, 0, None).kind is Parsed.DAMAGED
    short = PREFIX + b"s" * (CHECKED_PREFIX - len(PREFIX))  # no byte after the checked prefix
    assert outcome(self_checked(short), 0) == damaged(0)


def test_a_damaged_self_checked_entry_after_padding_is_torn_at_the_padding() -> None:
    image = bytearray(pad_to_aligned(plain(SMALL)) + self_checked(BIG))
    image[BLOCK + 100] ^= 0x01
    assert outcome(bytes(image), 19) == torn(19)
    assert parse_entry(bytes(image), 19, check, verify=False) == entry(BLOCK, len(BIG), True)


def test_padding_is_taken_only_before_a_self_checked_entry_on_the_rule_s_boundary() -> None:
    padded = pad_to_aligned(plain(SMALL))
    assert outcome(padded + plain(BIG), 19) == torn(19)  # a plain entry there: damage
    dirty = bytearray(padded + self_checked(BIG))
    dirty[1000] = 1  # a non-zero byte in the padding
    assert outcome(bytes(dirty), 19) == torn(19)
    lead = plain(b"w" * (4090 - ENTRY_OVERHEAD))  # ends at 4090: the rule says 8192
    early = lead + bytes(BLOCK - 4090) + self_checked(BIG)  # 6 bytes of padding to 4096
    assert outcome(early, 4090) == torn(4090)
    late = pad_to_aligned(plain(SMALL)) + bytes(BLOCK) + self_checked(BIG)  # a block too far
    assert outcome(late, 19) == torn(19)
    # an entry that ends on a boundary (or the file's start) is followed by no padding at all
    on_boundary = plain(b"q" * (BLOCK - ENTRY_OVERHEAD)) + bytes(BLOCK) + self_checked(BIG)
    assert outcome(on_boundary, BLOCK) == torn(BLOCK)
    assert outcome(bytes(BLOCK) + self_checked(BIG), 0) == torn(0)


def test_zeros_are_the_end_only_if_short_of_a_block_and_ending_an_aligned_size() -> None:
    image = plain(SMALL) + bytes(BLOCK - 19 - 1)  # one byte short of a block
    assert outcome(image, 19) == torn(19)
    too_long = plain(SMALL) + bytes(BLOCK - 19 + BLOCK)  # ends on a boundary, but a block+
    assert outcome(too_long, 19) == torn(19)
    short_header = plain(SMALL) + bytes(3)
    assert outcome(short_header, 19) == torn(19, header=True)


def test_a_file_parses_as_its_bytes_do(tmp_path: Path) -> None:
    """The file source (``heads``) and the memory source (everything else) agree."""
    image = pad_to_aligned(plain(SMALL) + plain(b"v" * 300)) + self_checked(BIG) + plain(SMALL)
    image += b"".join(plain(bytes([n]) * (700 + n)) for n in range(150))  # across read-aheads
    image = pad_to_aligned(image + plain(b"w" * 70_000)) + self_checked(PREFIX + body(70_000, 9))
    image = pad_to_block(image)
    path = tmp_path / "0000000000000000.journal"
    path.write_bytes(image)
    fd = os.open(path, os.O_RDONLY)
    try:
        source = _InFile(fd)
        found = [parse_entry(source, 0, verify=False)]
        while found[-1].kind is Parsed.ENTRY:
            found.append(parse_entry(source, found[-1].end, verify=False))
        for at in found[:-1]:  # what heads reads: each payload's first bytes
            start = at.payload_start
            assert bytes(source.read(start, 100)) == image[start : start + 100]
    finally:
        os.close(fd)
    assert found == walk(image, verify=False) == walk(image)
    assert [f.kind for f in found] == [Parsed.ENTRY] * 156 + [Parsed.END]
    assert len(image) > 3 * journal_module._READ_AHEAD


def test_the_sync_checkpoint_record() -> None:
    record = checkpoint_record(7, 123_456)
    head = struct.pack("<QQ", 7, 123_456)
    assert record == head + struct.pack("<I", crc32c.crc32c(head))
    assert parse_checkpoint(record) == (7, 123_456)
    for at in range(len(record)):
        flipped = bytearray(record)
        flipped[at] ^= 0x04
        assert parse_checkpoint(bytes(flipped)) is None
    assert parse_checkpoint(record[:-1]) is None
    assert parse_checkpoint(record + b"\0") is None
    assert parse_checkpoint(b"") is None


# --- the writer and recovery, against images built by hand -------------------------------------


def placed(data: bytes) -> memoryview:
    """``data`` in memory where a direct journal writes it in place (zero-copy)."""
    raw = np.empty(len(data) + 2 * BLOCK, np.uint8)
    skew = (payload_alignment(len(PREFIX)) - raw.ctypes.data) % BLOCK
    view = memoryview(raw[skew : skew + len(data)])
    view[:] = data
    return view


@pytest.fixture
def directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setattr(journal_module, "ZERO_COPY_MIN_BYTES", ZERO_COPY_MIN)
    yield tmp_path / "journal"


#: lengths of the entry before a self-checked one: it ends at byte 0 (none), 100, 4088 (8 bytes
#: of padding), 4089 (7 bytes would not do: padding to 8192), 4096 (on a boundary: none)
LEADS = [0, 100, 4088, 4089, 4096]


def expected_image(lead: int, big: bytes) -> tuple[bytes, list[tuple[int, bytes]]]:
    """The file a direct journal leaves after a crash (its last block's padding not cut), and
    (entry start, payload) of each entry, built from the documented layout."""
    parts = [b"L" * (lead - ENTRY_OVERHEAD)] if lead else []
    image = b"".join(plain(p) for p in parts)
    starts = [0] if lead else []
    image = pad_to_aligned(image)
    starts.append(len(image))
    image += self_checked(PREFIX + big)
    starts.append(len(image))
    image += plain(SMALL)
    payloads = [*parts, PREFIX + big, SMALL]
    return pad_to_block(image), list(zip(starts, payloads, strict=True))


@pytest.mark.parametrize("lead", LEADS)
def test_a_direct_journal_writes_the_documented_bytes(directory: Path, lead: int) -> None:
    big = body(ZERO_COPY_MIN + 777, lead)
    image, expected = expected_image(lead, big)
    journal = FileJournal(directory, check=check)
    list(journal.recover())
    if not journal.direct:
        journal.close()
        pytest.skip("this filesystem refuses O_DIRECT")
    entries = [[b"L" * (lead - ENTRY_OVERHEAD)]] if lead else []
    addresses = journal.append([*entries, [PREFIX, placed(big)], [SMALL]])
    journal.sync()
    journal._cut_padding = lambda: None  # type: ignore[method-assign]  # the process dies
    journal.close()
    assert (directory / f"{0:016d}.journal").read_bytes() == image
    assert [(a.position - ENTRY_OVERHEAD, a.length) for a in addresses] == [
        (start, len(payload)) for start, payload in expected
    ]


@pytest.mark.parametrize("lead", LEADS)
@pytest.mark.parametrize("sealed", [False, True], ids=["active", "sealed"])
def test_recovery_reads_the_documented_bytes(directory: Path, lead: int, sealed: bool) -> None:
    image, expected = expected_image(lead, body(ZERO_COPY_MIN + 777, lead))
    directory.mkdir()
    (directory / f"{0:016d}.journal").write_bytes(image)
    if sealed:
        (directory / f"{1:016d}.journal").touch()
    journal = FileJournal(directory, check=check, direct=False)
    try:
        found = [(a, bytes(p)) for a, p in journal.recover()]
        want = [
            (JournalAddress(0, start + ENTRY_OVERHEAD, len(payload)), payload)
            for start, payload in expected
        ]
        assert found == want
        assert journal.report.cut_bytes == 0 and journal.report.damaged == []
        assert [journal.read(a) for a, _ in want] == [p for _, p in want]
        if sealed:
            assert [(a, bytes(p)) for a, p in journal.entries(0)] == want
            assert list(journal.heads(0, 5)) == [(a, p[:5]) for a, p in want]
    finally:
        journal.close()


# --- the documentation ----------------------------------------------------------------------


def test_docs_format_page_quotes_the_journal_layout() -> None:
    docs = (Path(__file__).parents[2] / "docs" / "format.md").read_text()
    source = Path(journal_module.__file__).read_text()
    start = source.index("On-disk layout of a ``FileJournal``")
    block = source[start : source.index("A checkpoint that fails its CRC is ignored.") + 43]
    assert block in docs

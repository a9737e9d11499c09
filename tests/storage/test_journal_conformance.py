"""One suite for every Journal: FileJournal on a temporary directory, MemoryJournal, and
ObjectJournal on SeaweedFS with its records in SQLite or PostgreSQL, and on moto's S3 server (and,
in the state machine, on the in-memory chunk store and catalog).

The contract under test (slipstream/storage/_journal.py): ``append`` is not durable until
``sync``; a failed ``append`` leaves none of its entries behind; after a failed ``sync`` the
caller discards what is unsynced before appending again; ``roll`` makes the sealed file durable;
sealed files are listed, read back and deleted whole; ``read`` finds an entry by the address
``append`` returned for as long as its file lives (then FileNotFoundError). Faults are injected
through the journal's own ``fault`` hook ("fail the 3rd sync"), the FileJournal-only tests
tear and flip bytes on disk and check what recovery cuts.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from slipstream import CorruptData, StorageError, StorageFull
from slipstream.storage import (
    ENTRY_OVERHEAD,
    FileJournal,
    Journal,
    JournalAddress,
    MemoryChunkStore,
    MemoryJournal,
    MetaStore,
    SqliteMetaStore,
    _journal,
)
from slipstream.storage._journal import BLOCK, Buffer
from slipstream.storage._journal_objects import ObjectJournal
from slipstream.storage._meta_pg import PostgresMetaStore

Entry = tuple[JournalAddress, bytes]


class Faults:
    """Deterministic fault injection for a journal's ``fault`` hook.

    ``fail("sync", 3)`` makes the 3rd call of the hook with "sync" raise; ``fail_next`` arms
    the next call. ``calls`` counts every call, failed or not.
    """

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self._armed: defaultdict[str, dict[int, int]] = defaultdict(dict)

    def fail(self, op: str, nth: int, code: int = errno.ENOSPC) -> None:
        self._armed[op][nth] = code

    def fail_next(self, op: str, code: int = errno.ENOSPC) -> None:
        self.fail(op, self.calls[op] + 1, code)

    def __call__(self, op: str) -> None:
        self.calls[op] += 1
        code = self._armed[op].pop(self.calls[op], None)
        if code is not None:
            raise OSError(code, f"injected failure of {op} #{self.calls[op]}")


class Kit:
    """A journal under test plus how to restart it.

    ``reopen`` is a clean restart (everything appended was synced or discarded): a new
    FileJournal on the same directory, a new ObjectJournal on the same bucket and catalog, or
    the same MemoryJournal recovered again (an embedded broker restarting over its in-memory
    journal).
    """

    def __init__(
        self,
        request: pytest.FixtureRequest,
        kind: str,
        make: Callable[[], Journal],
        faults: Faults,
    ) -> None:
        self.request = request
        self.kind = kind
        self.make = make
        self.faults = faults
        self.journal = make()
        self.recovered = recover(self.journal)

    def reopen(self) -> list[Entry]:
        if self.kind != "memory":
            self.journal.close()
            self.journal = self.make()
        self.recovered = recover(self.journal)
        return self.recovered


def recover(journal: Journal) -> list[Entry]:
    return [(address, bytes(payload)) for address, payload in journal.recover()]


@pytest.fixture(params=["file", "memory", "objects", "objects-pg", "objects-moto"])
def kit(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Kit]:
    faults = Faults()
    make: Callable[[], Journal]
    closing: list[Callable[[], None]] = []
    if request.param == "file":

        def make() -> Journal:
            return FileJournal(tmp_path / "journal", fault=faults)

    elif request.param == "memory":
        memory = MemoryJournal(fault=faults)

        def make() -> Journal:
            return memory

    else:
        server = request.getfixturevalue(
            "moto_s3" if request.param == "objects-moto" else "seaweedfs"
        )
        store = server.store(f"s3://{server.create_bucket()}/p")
        meta: MetaStore = (
            PostgresMetaStore(request.getfixturevalue("pg_dsn"))
            if request.param == "objects-pg"
            else SqliteMetaStore(tmp_path / "meta.db")
        )
        closing.append(meta.close)

        def make() -> Journal:
            return ObjectJournal(store, meta, 3, fault=faults)

    kit = Kit(request, request.param, make, faults)
    yield kit
    kit.journal.close()
    for close in closing:
        close()


def payloads(count: int, size: int = 13, tag: bytes = b"e") -> list[bytes]:
    return [tag + bytes([i % 251]) * (size + i) for i in range(count)]


def append_synced(journal: Journal, items: list[bytes]) -> list[JournalAddress]:
    addresses = journal.append([[p] for p in items])
    journal.sync()
    return addresses


# --- the contract, on every implementation ------------------------------------------------------


def test_fresh_journal_recovers_nothing(kit: Kit) -> None:
    assert kit.recovered == []
    assert kit.journal.report.cut_bytes == 0
    assert kit.journal.report.cut_reason is None
    assert kit.journal.sealed_files() == []
    assert kit.journal.active_bytes == 0
    assert kit.journal.total_bytes == 0


def test_append_sync_read_round_trip(kit: Kit) -> None:
    journal = kit.journal
    # an entry is given as buffers to concatenate, of any buffer type
    entries = [
        [b"head", bytearray(b"-body")],
        [memoryview(b"one piece")],
        [b"a", b"b", b"c", bytearray(b"d"), memoryview(b"e")],
    ]
    addresses = journal.append(entries)
    journal.sync()
    expected = [b"head-body", b"one piece", b"abcde"]
    assert [a.length for a in addresses] == [len(p) for p in expected]
    assert [journal.read(a) for a in addresses] == expected
    # reading is repeatable and in any order
    assert [journal.read(a) for a in reversed(addresses)] == expected[::-1]
    assert journal.active_bytes > 0
    assert journal.total_bytes >= journal.active_bytes


def test_unsynced_entries_are_readable_before_sync(kit: Kit) -> None:
    (address,) = kit.journal.append([[b"not yet durable"]])
    assert kit.journal.read(address) == b"not yet durable"


def test_addresses_are_stable_across_appends_rolls_and_reopen(kit: Kit) -> None:
    journal = kit.journal
    written: list[Entry] = []
    for group in range(4):
        items = payloads(3, tag=b"g%d" % group)
        written += zip(append_synced(journal, items), items, strict=True)
        if group % 2:
            assert journal.roll() is not None
    for address, payload in written:
        assert journal.read(address) == payload
    assert kit.reopen() == written
    for address, payload in written:
        assert kit.journal.read(address) == payload


def test_recover_after_reopen_returns_exactly_the_synced_entries_in_order(kit: Kit) -> None:
    items = payloads(20)
    addresses: list[JournalAddress] = []
    for start in range(0, 20, 5):
        addresses += append_synced(kit.journal, items[start : start + 5])
    recovered = kit.reopen()
    assert recovered == list(zip(addresses, items, strict=True))
    assert kit.journal.report.cut_bytes == 0
    # the reopened journal appends after what it recovered
    more = append_synced(kit.journal, [b"after reopen"])
    assert kit.reopen() == [*recovered, (more[0], b"after reopen")]


def test_roll_entries_and_delete_file(kit: Kit) -> None:
    journal = kit.journal
    assert journal.roll() is None, "rolling an empty active file seals nothing"
    first = payloads(3, tag=b"first")
    first_addresses = append_synced(journal, first)
    sealed = journal.roll()
    assert sealed == first_addresses[0].file_id
    assert journal.sealed_files() == [sealed]
    assert journal.active_bytes == 0
    assert journal.roll() is None

    second = payloads(2, tag=b"second")
    second_addresses = append_synced(journal, second)
    assert second_addresses[0].file_id > sealed
    sealed_again = journal.roll()
    assert sealed_again == second_addresses[0].file_id
    assert journal.sealed_files() == [sealed, sealed_again]

    def entries_of(file_id: int) -> list[Entry]:
        return [(a, bytes(p)) for a, p in journal.entries(file_id)]

    assert entries_of(sealed) == list(zip(first_addresses, first, strict=True))
    assert entries_of(sealed_again) == list(zip(second_addresses, second, strict=True))
    assert list(journal.heads(sealed, 7)) == [(a, p[:7]) for a, p in entries_of(sealed)]

    active = append_synced(journal, [b"active"])
    total = journal.total_bytes
    journal.delete_file(sealed)
    assert journal.sealed_files() == [sealed_again]
    assert journal.total_bytes < total
    with pytest.raises(ValueError, match="active"):
        journal.delete_file(active[0].file_id)

    assert kit.reopen() == [
        *zip(second_addresses, second, strict=True),
        (active[0], b"active"),
    ]
    assert kit.journal.sealed_files() == [sealed_again]


def test_roll_seals_entries_even_when_not_yet_synced(kit: Kit) -> None:
    (address,) = kit.journal.append([[b"appended, then rolled"]])
    assert kit.journal.roll() == address.file_id
    kit.journal.discard_unsynced()  # cuts only the (empty) new active file
    assert kit.journal.read(address) == b"appended, then rolled"
    assert kit.reopen() == [(address, b"appended, then rolled")]


@pytest.mark.parametrize("failing_sync", [1, 2, 3])
def test_failed_sync_fails_the_append_and_discard_cuts_it(kit: Kit, failing_sync: int) -> None:
    journal, faults = kit.journal, kit.faults
    faults.fail("sync", failing_sync)
    kept: list[Entry] = []
    for group in range(1, 5):
        items = payloads(2, tag=b"g%d" % group)
        addresses = journal.append([[p] for p in items])
        if group == failing_sync:
            with pytest.raises(StorageFull, match="disk full"):
                journal.sync()
            journal.discard_unsynced()
        else:
            journal.sync()
            kept += zip(addresses, items, strict=True)
    assert faults.calls["sync"] == 4
    for address, payload in kept:
        assert journal.read(address) == payload
    assert kit.reopen() == kept


@pytest.mark.parametrize("discard", [False, True], ids=["no-discard", "discard"])
def test_failed_append_leaves_nothing_and_appends_resume(kit: Kit, discard: bool) -> None:
    journal, faults = kit.journal, kit.faults
    before = append_synced(journal, [b"before"])
    size = journal.active_bytes
    faults.fail_next("write")
    with pytest.raises(StorageFull):
        journal.append([[b"lost"], [b"also lost"]])
    assert journal.active_bytes == size
    if discard:  # still allowed, and harmless
        journal.discard_unsynced()
    after = append_synced(journal, [b"after"])
    assert after[0].file_id == before[0].file_id
    assert journal.read(after[0]) == b"after"
    assert kit.reopen() == [(before[0], b"before"), (after[0], b"after")]


def test_failed_append_keeps_earlier_unsynced_entries(kit: Kit) -> None:
    journal, faults = kit.journal, kit.faults
    (earlier,) = journal.append([[b"earlier, unsynced"]])
    faults.fail_next("write")
    with pytest.raises(StorageFull):
        journal.append([[b"lost"]])
    assert journal.read(earlier) == b"earlier, unsynced"
    (later,) = append_synced(journal, [b"later"])
    assert kit.reopen() == [(earlier, b"earlier, unsynced"), (later, b"later")]


def test_discard_after_a_failed_sync_cuts_every_entry_since_the_last_sync(kit: Kit) -> None:
    journal, faults = kit.journal, kit.faults
    synced = append_synced(journal, [b"synced"])
    journal.append([[b"unsynced 1"]])
    journal.append([[b"unsynced 2"], [b"unsynced 3"]])
    faults.fail_next("sync")
    with pytest.raises(StorageFull):
        journal.sync()
    journal.discard_unsynced()
    bytes_after_discard = journal.active_bytes
    assert kit.reopen() == [(synced[0], b"synced")]
    assert kit.journal.active_bytes == bytes_after_discard
    later = append_synced(kit.journal, [b"later"])
    assert kit.journal.read(later[0]) == b"later"
    assert kit.reopen() == [(synced[0], b"synced"), (later[0], b"later")]


def test_discard_after_a_failed_append_still_cuts_earlier_unsynced_entries(kit: Kit) -> None:
    synced = append_synced(kit.journal, [b"synced"])
    kit.journal.append([[b"never synced"]])
    kit.faults.fail_next("write")
    with pytest.raises(StorageFull):
        kit.journal.append([[b"failed write"]])
    kit.journal.discard_unsynced()
    assert kit.reopen() == [(synced[0], b"synced")]


def test_discard_without_failure_cuts_unsynced_only(kit: Kit) -> None:
    synced = append_synced(kit.journal, [b"keep"])
    kit.journal.append([[b"drop"]])
    kit.journal.discard_unsynced()
    kit.journal.discard_unsynced()  # idempotent
    assert kit.reopen() == [(synced[0], b"keep")]


@pytest.mark.parametrize("op", ["write", "sync"])
def test_other_io_errors_are_storage_errors(kit: Kit, op: str) -> None:
    kit.faults.fail_next(op, errno.EIO)
    with pytest.raises(StorageError) as raised:
        kit.journal.append([[b"x"]])
        kit.journal.sync()
    assert not isinstance(raised.value, StorageFull)
    kit.journal.discard_unsynced()
    assert kit.reopen() == []


def test_quota_exceeded_is_storage_full(kit: Kit) -> None:
    kit.faults.fail_next("sync", errno.EDQUOT)
    kit.journal.append([[b"x"]])
    with pytest.raises(StorageFull):
        kit.journal.sync()


def test_roll_makes_the_sealed_file_durable_so_a_failing_sync_fails_it(kit: Kit) -> None:
    # both implementations sync in roll, so "fail the Nth sync" hits the same operation on both
    kit.journal.append([[b"unsynced"]])
    kit.faults.fail_next("sync")
    with pytest.raises(StorageFull):
        kit.journal.roll()
    assert kit.journal.sealed_files() == []
    kit.journal.discard_unsynced()
    assert kit.reopen() == []


def test_empty_entry_is_refused_and_writes_nothing(kit: Kit) -> None:
    # on disk a zero length marks a torn entry: recovery would cut it and every later entry
    (first,) = append_synced(kit.journal, [b"first"])
    for empty in ([b""], [b"", bytearray()], []):
        with pytest.raises(ValueError, match="empty"):
            kit.journal.append([[b"before"], empty, [b"after"]])
    assert kit.faults.calls["write"] == 1, "refused before any write"
    (last,) = append_synced(kit.journal, [b"last"])
    assert kit.reopen() == [(first, b"first"), (last, b"last")]


def test_read_in_a_deleted_file_raises_file_not_found(kit: Kit) -> None:
    # Container.read retries a read that raced the mover on exactly this error
    (address,) = append_synced(kit.journal, [b"moved away"])
    kit.journal.roll()
    kit.journal.delete_file(address.file_id)
    with pytest.raises(FileNotFoundError):
        kit.journal.read(address)


# --- on-disk damage: FileJournal only -----------------------------------------------------------


def build_journal(directory: Path, groups: list[list[bytes]]) -> list[list[Entry]]:
    """Write one file per group (rolling between them); returns each file's entries."""
    journal = FileJournal(directory)
    recover(journal)
    files = []
    for i, group in enumerate(groups):
        if i:
            journal.roll()
        files.append(list(zip(append_synced(journal, group), group, strict=True)))
    journal.close()
    return files


def journal_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.journal"))


def reopen_file_journal(directory: Path) -> tuple[FileJournal, list[Entry]]:
    journal = FileJournal(directory)
    return journal, recover(journal)


def assert_clean_second_recovery(directory: Path, expected: list[Entry]) -> None:
    journal, entries = reopen_file_journal(directory)
    try:
        assert entries == expected
        assert journal.report.cut_bytes == 0
        assert journal.report.cut_reason is None
    finally:
        journal.close()


@pytest.fixture
def one_file(tmp_path: Path) -> tuple[bytes, list[Entry]]:
    """The bytes of a one-file journal of four entries, and its entries."""
    (entries,) = build_journal(tmp_path / "pristine", [payloads(4, size=17)])
    (path,) = journal_files(tmp_path / "pristine")
    return path.read_bytes(), entries


def write_image(directory: Path, image: bytes) -> None:
    directory.mkdir()
    (directory / f"{0:016d}.journal").write_bytes(image)


def test_torn_tail_at_every_byte_of_the_last_entry_is_cut(
    tmp_path: Path, one_file: tuple[bytes, list[Entry]]
) -> None:
    image, entries = one_file
    last = entries[-1][0]
    start = last.position - ENTRY_OVERHEAD
    assert start + ENTRY_OVERHEAD + last.length == len(image)
    for cut_at in range(start + 1, len(image)):
        directory = tmp_path / f"torn{cut_at}"
        write_image(directory, image[:cut_at])
        journal, recovered = reopen_file_journal(directory)
        try:
            assert recovered == entries[:-1], cut_at
            assert journal.report.cut_bytes == cut_at - start
            assert journal.report.cut_reason is not None
            assert "torn" in journal.report.cut_reason
            assert (directory / f"{0:016d}.journal").stat().st_size == start
            # the journal appends right after the cut, at the torn entry's address
            assert append_synced(journal, [entries[-1][1]]) == [last]
        finally:
            journal.close()
        assert_clean_second_recovery(directory, entries)


def test_torn_tail_exactly_between_entries_cuts_nothing(
    tmp_path: Path, one_file: tuple[bytes, list[Entry]]
) -> None:
    image, entries = one_file
    for kept in range(len(entries) + 1):
        end = entries[kept - 1][0].position + entries[kept - 1][0].length if kept else 0
        directory = tmp_path / f"whole{kept}"
        write_image(directory, image[:end])
        assert_clean_second_recovery(directory, entries[:kept])


def test_bit_flip_anywhere_in_the_last_entry_cuts_exactly_that_entry(
    tmp_path: Path, one_file: tuple[bytes, list[Entry]]
) -> None:
    image, entries = one_file
    last = entries[-1][0]
    start = last.position - ENTRY_OVERHEAD
    for at in range(start, len(image)):
        for bit in (0, 3, 7):
            damaged = bytearray(image)
            damaged[at] ^= 1 << bit
            directory = tmp_path / f"flip{at}-{bit}"
            write_image(directory, bytes(damaged))
            journal, recovered = reopen_file_journal(directory)
            journal.close()
            assert recovered == entries[:-1], (at, bit)
            assert journal.report.cut_bytes == len(image) - start
            assert journal.report.cut_reason is not None
            assert_clean_second_recovery(directory, entries[:-1])


def test_bit_flip_in_a_middle_entry_cuts_it_and_everything_after(
    tmp_path: Path, one_file: tuple[bytes, list[Entry]]
) -> None:
    image, entries = one_file
    second = entries[1][0]
    damaged = bytearray(image)
    damaged[second.position + 3] ^= 0x40
    directory = tmp_path / "flipped"
    write_image(directory, bytes(damaged))
    journal, recovered = reopen_file_journal(directory)
    journal.close()
    assert recovered == entries[:1]
    assert journal.report.cut_bytes == len(image) - (second.position - ENTRY_OVERHEAD)
    assert journal.report.cut_reason is not None
    assert "CRC32C" in journal.report.cut_reason
    assert_clean_second_recovery(directory, entries[:1])


@settings(max_examples=60, deadline=None)
@given(
    items=st.lists(st.binary(min_size=1, max_size=40), min_size=1, max_size=8),
    cut=st.floats(min_value=0.0, max_value=1.0),
)
def test_torn_tail_anywhere_keeps_the_longest_whole_prefix(items: list[bytes], cut: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "journal"
        (entries,) = build_journal(directory, [items])
        (path,) = journal_files(directory)
        size = path.stat().st_size
        cut_at = round(size * cut)
        with open(path, "r+b") as f:
            f.truncate(cut_at)
        expected = [(a, p) for a, p in entries if a.position + a.length <= cut_at]
        end_of_kept = expected[-1][0].position + expected[-1][0].length if expected else 0
        journal, recovered = reopen_file_journal(directory)
        journal.close()
        assert recovered == expected
        assert journal.report.cut_bytes == cut_at - end_of_kept
        assert (journal.report.cut_reason is None) == (cut_at == end_of_kept)
        assert_clean_second_recovery(directory, expected)


def flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_damage_in_a_sealed_file_is_skipped_to_its_end_and_later_files_are_kept(
    tmp_path: Path,
) -> None:
    # Without a resync marker the journal cannot find the next entry in a damaged file, but a
    # sealed file was synced before it was sealed: later files hold acknowledged entries.
    directory = tmp_path / "journal"
    files = build_journal(directory, [payloads(3, tag=b"f0"), payloads(3, tag=b"f1"), [b"f2"]])
    paths = journal_files(directory)
    sizes = [p.stat().st_size for p in paths]
    bad = files[0][1][0]  # the second entry of the first (sealed) file
    flip(paths[0], bad.position)

    journal, recovered = reopen_file_journal(directory)
    try:
        assert recovered == [files[0][0], *files[1], *files[2]]
        start = bad.position - ENTRY_OVERHEAD
        (damage,) = journal.report.damaged
        assert (damage.file_id, damage.start, damage.end) == (0, start, sizes[0])
        flipped = bytes([files[0][1][1][0] ^ 0xFF]) + files[0][1][1][1:]
        assert damage.heads == (flipped, files[0][2][1])  # unverified, as the bytes are
        assert journal.report.cut_bytes == 0 and journal.report.cut_reason is None
        assert journal_files(directory) == paths, "no file is cut or removed"
        assert [p.stat().st_size for p in paths] == sizes
        assert journal.sealed_files() == [0, 1]
        assert list(journal.entries(0)) == files[0][:1]
        assert list(journal.heads(0, 2)) == [(files[0][0][0], files[0][0][1][:2])]
        (address,) = append_synced(journal, [b"new"])
        assert address.file_id == 2
    finally:
        journal.close()
    assert_clean_second_recovery(directory, [*recovered, (address, b"new")])


MARK = b"MARK"


def marked(count: int, tag: bytes) -> list[bytes]:
    """Payloads that carry MARK two bytes in, as the broker's carry their batch magic."""
    return [
        tag[:2].ljust(2, b"_") + MARK + f"{tag.decode()}-{i}".encode() * 3 for i in range(count)
    ]


def resync_journal(directory: Path) -> FileJournal:
    return FileJournal(directory, resync=(MARK, 2))


@settings(max_examples=80, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=1, max_value=6), min_size=2, max_size=4),
    where=st.floats(min_value=0.0, max_value=1.0, exclude_max=True),
)
def test_a_flipped_byte_anywhere_in_a_sealed_file_loses_only_its_own_entry(
    sizes: list[int], where: float
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "journal"
        groups = [marked(n, f"g{i}".encode()) for i, n in enumerate(sizes)]
        files = build_journal(directory, groups)
        paths = journal_files(directory)
        file = min(int(where * (len(paths) - 1)), len(paths) - 2)  # a sealed file
        size = paths[file].stat().st_size
        at = int((where * 7919) % 1 * size)
        flip(paths[file], at)
        hit = next(
            i for i, (a, _) in enumerate(files[file]) if a.position + a.length > at
        )  # the entry whose header or payload holds byte ``at``
        journal = resync_journal(directory)
        try:
            recovered = recover(journal)
            expected = [e for f in files for e in f]
            expected.remove(files[file][hit])
            assert recovered == expected
            (damage,) = journal.report.damaged
            address = files[file][hit][0]
            assert (damage.file_id, damage.start) == (file, address.position - ENTRY_OVERHEAD)
            assert damage.end == address.position + address.length
            assert journal.report.cut_reason is None
            kept = [e for e in files[file] if e != files[file][hit]]
            assert list(journal.entries(file)) == kept
            assert list(journal.heads(file, 6)) == [(a, p[:6]) for a, p in kept]
        finally:
            journal.close()


def test_damage_in_the_active_file_is_still_cut_as_a_torn_tail(tmp_path: Path) -> None:
    # The active file's last entries may never have been synced: a write torn in the middle
    # and a later block that reached the disk look alike, so nothing after damage is trusted.
    directory = tmp_path / "journal"
    files = build_journal(directory, [marked(2, b"f0"), marked(3, b"f1")])
    paths = journal_files(directory)
    flip(paths[1], files[1][1][0].position + 3)
    journal = resync_journal(directory)
    try:
        assert recover(journal) == [*files[0], files[1][0]]
        assert journal.report.damaged == []
        assert journal.report.cut_reason is not None
    finally:
        journal.close()


def checkpointed_journal(directory: Path, items: list[bytes], later: list[bytes]) -> list[Entry]:
    """One active file: ``items`` synced and checkpointed, then ``later`` synced without a
    checkpoint (the next one is an hour away)."""
    journal = FileJournal(directory, resync=(MARK, 2), checkpoint_seconds=3600)
    recover(journal)
    try:
        first = list(zip(append_synced(journal, items), items, strict=True))
        return first + list(zip(append_synced(journal, later), later, strict=True))
    finally:
        journal.close()


@pytest.mark.parametrize("damaged", [0, 1, 2])
def test_damage_in_the_checkpointed_part_of_the_active_file_is_skipped(
    tmp_path: Path, damaged: int
) -> None:
    directory = tmp_path / "journal"
    entries = checkpointed_journal(directory, marked(3, b"a0"), marked(2, b"a1"))
    (path,) = journal_files(directory)
    address = entries[damaged][0]
    flip(path, address.position + 3)
    kept = entries[:damaged] + entries[damaged + 1 :]
    for _ in range(2):  # and again after an append, which moves the checkpoint on
        journal = FileJournal(directory, resync=(MARK, 2), checkpoint_seconds=3600)
        try:
            recovered = recover(journal)
            assert recovered[: len(kept)] == kept
            (damage,) = journal.report.damaged
            assert (damage.start, damage.end) == (
                address.position - ENTRY_OVERHEAD,
                address.position + address.length,
            )
            assert journal.report.cut_reason is None
            (new,) = append_synced(journal, [b"new"])
            kept = [*recovered, (new, b"new")]
        finally:
            journal.close()


def test_damage_past_the_checkpoint_is_cut_as_a_torn_tail(tmp_path: Path) -> None:
    directory = tmp_path / "journal"
    entries = checkpointed_journal(directory, marked(3, b"a0"), marked(2, b"a1"))
    (path,) = journal_files(directory)
    flip(path, entries[3][0].position + 3)  # the first entry after the checkpoint
    journal = FileJournal(directory, resync=(MARK, 2), checkpoint_seconds=3600)
    try:
        assert recover(journal) == entries[:3]
        assert journal.report.damaged == []
        assert journal.report.cut_reason is not None
    finally:
        journal.close()


@pytest.mark.parametrize("how", ["flipped", "short", "missing"])
def test_a_damaged_or_missing_checkpoint_leaves_the_active_file_to_be_cut(
    tmp_path: Path, how: str
) -> None:
    directory = tmp_path / "journal"
    entries = checkpointed_journal(directory, marked(3, b"a0"), [])
    checkpoint = directory / "synced.checkpoint"
    assert checkpoint.stat().st_size == 20
    if how == "flipped":
        flip(checkpoint, 9)
    elif how == "short":
        os.truncate(checkpoint, 12)
    else:
        checkpoint.unlink()
    (path,) = journal_files(directory)
    flip(path, entries[1][0].position + 3)
    journal = FileJournal(directory, resync=(MARK, 2), checkpoint_seconds=3600)
    try:
        assert recover(journal) == entries[:1]
        assert journal.report.cut_reason is not None
    finally:
        journal.close()


def test_a_checkpoint_of_an_older_file_protects_nothing_in_the_active_one(tmp_path: Path) -> None:
    directory = tmp_path / "journal"
    journal = FileJournal(directory, resync=(MARK, 2), checkpoint_seconds=3600)
    recover(journal)
    try:
        append_synced(journal, marked(2, b"f0"))  # checkpoints file 0
        journal.roll()
        items = marked(3, b"f1")
        active = list(zip(append_synced(journal, items), items, strict=True))
    finally:
        journal.close()
    flip(journal_files(directory)[1], active[1][0].position + 3)
    again = FileJournal(directory, resync=(MARK, 2), checkpoint_seconds=3600)
    try:
        assert recover(again)[-1] == active[0]
        assert again.report.cut_reason is not None
    finally:
        again.close()


def test_read_of_flipped_bytes_raises_corrupt_data(tmp_path: Path) -> None:
    directory = tmp_path / "journal"
    (entries,) = build_journal(directory, [payloads(3)])
    (path,) = journal_files(directory)
    journal, _ = reopen_file_journal(directory)
    try:
        pristine = path.read_bytes()
        target = entries[1][0]
        for at in (target.position - ENTRY_OVERHEAD, target.position - 1, target.position + 5):
            damaged = bytearray(pristine)
            damaged[at] ^= 0x10
            path.write_bytes(bytes(damaged))
            with pytest.raises(CorruptData) as raised:
                journal.read(target)
            assert raised.value.details["position"] == target.position
            assert journal.read(entries[0][0]) == entries[0][1]
            assert journal.read(entries[2][0]) == entries[2][1]
    finally:
        journal.close()


def test_read_of_a_truncated_entry_raises_corrupt_data(tmp_path: Path) -> None:
    directory = tmp_path / "journal"
    (entries,) = build_journal(directory, [payloads(2)])
    (path,) = journal_files(directory)
    journal, _ = reopen_file_journal(directory)
    try:
        last = entries[-1][0]
        for size in (last.position - ENTRY_OVERHEAD + 3, last.position + 1):
            with open(path, "r+b") as f:
                f.truncate(size)
            with pytest.raises(CorruptData):
                journal.read(last)
    finally:
        journal.close()


def test_entries_of_a_corrupt_sealed_file_raise_corrupt_data(tmp_path: Path) -> None:
    journal = FileJournal(tmp_path / "journal")
    recover(journal)
    try:
        (address,) = append_synced(journal, [b"sealed entry"])
        sealed = journal.roll()
        assert sealed is not None
        path = journal.file_path(sealed)
        assert path is not None
        damaged = bytearray(path.read_bytes())
        damaged[address.position] ^= 1
        path.write_bytes(bytes(damaged))
        with pytest.raises(CorruptData):
            list(journal.entries(sealed))
    finally:
        journal.close()


def test_heads_skip_payloads_and_stop_at_padding_but_not_at_damage(tmp_path: Path) -> None:
    journal = FileJournal(tmp_path / "journal")
    recover(journal)
    try:
        items = [b"a" * 10, b"b" * 100_000, b"c" * 3]
        addresses = append_synced(journal, items)
        sealed = journal.roll()
        assert sealed is not None
        path = journal.file_path(sealed)
        assert path is not None
        expected = [(a, p[:20]) for a, p in zip(addresses, items, strict=True)]
        assert list(journal.heads(sealed, 20)) == expected
        size = path.stat().st_size
        with open(path, "ab") as f:
            f.write(bytes(-size % BLOCK))  # padding a crash left behind
        assert list(journal.heads(sealed, 20)) == expected
        with open(path, "r+b") as f:
            f.truncate(size)
            f.seek(size)
            f.write(b"\x40\x00\x00\x00junk")  # an entry running past the end
        with pytest.raises(CorruptData, match="torn entry"):
            list(journal.heads(sealed, 20))
    finally:
        journal.close()


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_write_torn_at_byte_17_is_cut_before_append_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: bool
) -> None:
    journal = FileJournal(tmp_path / "journal", direct=direct)
    recover(journal)
    try:
        (first,) = append_synced(journal, [b"first"])
        size = journal.active_bytes
        path = journal.file_path(first.file_id)
        assert path is not None

        def torn_writev(fd: int, buffers: Sequence[Buffer]) -> int:
            # the disk fills 17 bytes into the write
            os.write(fd, b"".join(bytes(b) for b in buffers)[:17])
            raise OSError(errno.ENOSPC, "No space left on device (injected)")

        def torn_pwritev(fd: int, buffers: Sequence[Buffer], offset: int) -> int:
            with open(path, "r+b") as f:  # a direct fd takes whole blocks only
                f.seek(offset)
                f.write(b"".join(bytes(b) for b in buffers)[:17])
            raise OSError(errno.ENOSPC, "No space left on device (injected)")

        with monkeypatch.context() as patch:
            patch.setattr(os, "writev", torn_writev)
            patch.setattr(os, "pwritev", torn_pwritev)
            with pytest.raises(StorageFull):
                journal.append([[b"x" * 40], [b"y" * 40]])
        assert path.stat().st_size == size == journal.active_bytes, "the torn bytes are gone"
        (second,) = append_synced(journal, [b"second"])
        assert second.position == size + ENTRY_OVERHEAD
    finally:
        journal.close()
    assert_clean_second_recovery(tmp_path / "journal", [(first, b"first"), (second, b"second")])


def test_a_new_journal_file_is_durable_in_its_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # fdatasync of a new file does not make its directory entry durable: a power cut could
    # lose the whole file, and every acknowledged entry in it, unless the directory is synced
    directory = tmp_path / "journal"
    synced_dirs: list[Path] = []
    real_fsync_dir = _journal.fsync_dir

    def recording_fsync_dir(path: Path) -> None:
        synced_dirs.append(path)
        real_fsync_dir(path)

    monkeypatch.setattr(_journal, "fsync_dir", recording_fsync_dir)
    journal = FileJournal(directory)
    recover(journal)
    try:
        assert synced_dirs == [directory.parent, directory], "its own name, the first file"
        append_synced(journal, [b"in file 0"])
        synced_dirs.clear()
        journal.roll()
        (address,) = append_synced(journal, [b"in file 1"])
        assert address.file_id == 1
        assert synced_dirs == [directory], "the rolled-to file"
    finally:
        journal.close()


# --- direct IO: FileJournal only ---------------------------------------------------------------


def direct_journal(directory: Path) -> FileJournal:
    journal = FileJournal(directory)
    recover(journal)
    if not journal.direct:
        journal.close()
        pytest.skip("this filesystem refuses O_DIRECT")
    return journal


def test_a_crash_after_direct_writes_leaves_padding_that_recovery_drops_quietly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "journal"
    journal = direct_journal(directory)
    items = payloads(7, size=300)
    addresses = append_synced(journal, items)
    addresses += append_synced(journal, [b"z" * (BLOCK * 2 + 5)])  # spans blocks
    path = journal.file_path(0)
    assert path is not None
    logical = journal.active_bytes
    assert path.stat().st_size == -(-logical // BLOCK) * BLOCK, "whole blocks on disk"
    with monkeypatch.context() as patch:  # the process dies: nothing trims the padding
        patch.setattr(FileJournal, "_cut_padding", lambda self: None)
        journal.close()
    assert path.stat().st_size > logical
    again = FileJournal(directory)
    found = recover(again)
    try:
        assert found == list(zip(addresses, [*items, b"z" * (BLOCK * 2 + 5)], strict=True))
        assert again.report.cut_bytes == 0 and again.report.cut_reason is None
        assert path.stat().st_size == logical, "the padding is trimmed"
        (more,) = append_synced(again, [b"after the restart"])
        assert more.position == logical + ENTRY_OVERHEAD
    finally:
        again.close()
    assert_clean_second_recovery(
        directory,
        [
            *zip(addresses, [*items, b"z" * (BLOCK * 2 + 5)], strict=True),
            (more, b"after the restart"),
        ],
    )


def test_direct_appends_larger_than_the_write_buffer_round_trip(tmp_path: Path) -> None:
    journal = direct_journal(tmp_path / "journal")
    try:
        big = [os.urandom(3 * 1024 * 1024 + 7), os.urandom(5 * 1024 * 1024 + 11)]
        addresses = journal.append([[b"head"], [big[0], big[1]], [b"tail"]])
        journal.sync()
        assert [journal.read(a) for a in addresses] == [b"head", big[0] + big[1], b"tail"]
        journal.roll()
        assert [bytes(p) for _, p in journal.entries(0)] == [b"head", big[0] + big[1], b"tail"]
        path = journal.file_path(0)
        assert path is not None and path.stat().st_size == sum(
            ENTRY_OVERHEAD + a.length for a in addresses
        ), "rolling trims the sealed file's padding"
    finally:
        journal.close()


@settings(max_examples=60, deadline=None)
@given(
    groups=st.lists(
        st.lists(
            st.one_of(
                st.integers(1, 300),
                st.integers(BLOCK - 24, BLOCK + 8),  # entries that end on or near a block edge
                st.integers(2 * BLOCK - 8, 2 * BLOCK - 8),
            ),
            min_size=1,
            max_size=4,
        ),
        min_size=1,
        max_size=8,
    )
)
@example(groups=[[1, 4072]])  # padding shorter than an entry header (found by CI)
def test_direct_appends_of_any_sizes_survive_a_crash(groups: list[list[int]]) -> None:
    directory = Path(tempfile.mkdtemp(prefix="direct-"))
    try:
        journal = FileJournal(directory)
        recover(journal)
        if not journal.direct:
            journal.close()
            pytest.skip("this filesystem refuses O_DIRECT")
        expected = []
        for number, sizes in enumerate(groups):
            items = [bytes([number % 251 + 1]) * size for size in sizes]
            expected += list(zip(append_synced(journal, items), items, strict=True))
        journal._cut_padding = lambda: None  # type: ignore[method-assign]  # dies untidily
        journal.close()
        assert_clean_second_recovery(directory, expected)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_zeros_are_padding_only_up_to_a_block_boundary(tmp_path: Path) -> None:
    for tail, is_padding in [(BLOCK - 40, True), (BLOCK - 41, False), (BLOCK + BLOCK - 40, False)]:
        directory = tmp_path / f"journal-{tail}"
        journal = FileJournal(directory, direct=False)
        recover(journal)
        (address,) = append_synced(journal, [b"x" * 32])  # 40 bytes with its entry header
        journal.close()
        path = directory / "0000000000000000.journal"
        with open(path, "ab") as f:
            f.write(bytes(tail))
        again = FileJournal(directory)
        try:
            assert recover(again) == [(address, b"x" * 32)]
            assert (again.report.cut_bytes == 0) == is_padding, tail
            assert path.stat().st_size == 40
        finally:
            again.close()


def test_a_filesystem_without_direct_io_gets_buffered_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = os.open

    def no_direct(path: str, flags: int, mode: int = 0o777) -> int:
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument (injected)")
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", no_direct)
    journal = FileJournal(tmp_path / "journal")
    recover(journal)
    try:
        assert not journal.direct
        addresses = append_synced(journal, [b"one", b"two"])
        assert [journal.read(a) for a in addresses] == [b"one", b"two"]
    finally:
        journal.close()


def test_file_journal_without_fsync_still_round_trips(tmp_path: Path) -> None:
    journal = FileJournal(tmp_path / "journal", fsync=False)
    recover(journal)
    addresses = append_synced(journal, [b"a", b"b"])
    journal.close()
    journal, recovered = reopen_file_journal(tmp_path / "journal")
    journal.close()
    assert recovered == list(zip(addresses, [b"a", b"b"], strict=True))


# --- a model-based run over both implementations --------------------------------------------


class JournalMachine(RuleBasedStateMachine):
    """Random append / sync / fail / discard / roll / delete / reopen against a model.

    The model: sealed files (id -> entries) and the active file's entries, of which the last
    ``unsynced`` are not yet synced. After a failed sync only ``discard`` is allowed until it
    runs; a failed append changes nothing.
    """

    def __init__(self) -> None:
        super().__init__()
        self.faults = Faults()
        self.journal = self.open()
        recover(self.journal)
        self.sealed: dict[int, list[Entry]] = {}
        self.active: list[Entry] = []
        self.active_id = 0
        self.unsynced = 0
        self.failed = False

    def open(self) -> Journal:
        raise NotImplementedError

    def restart(self) -> Journal:
        raise NotImplementedError

    def model(self) -> list[Entry]:
        return [e for file_id in sorted(self.sealed) for e in self.sealed[file_id]] + self.active

    @rule(items=st.lists(st.binary(min_size=1, max_size=24), min_size=1, max_size=4))
    @precondition(lambda self: not self.failed)
    def append(self, items: list[bytes]) -> None:
        # each entry split in two buffers, to cover concatenation
        addresses = self.journal.append([[p[:1], p[1:]] for p in items])
        assert all(a.file_id == self.active_id for a in addresses)
        self.active += zip(addresses, items, strict=True)
        self.unsynced += len(items)

    @rule()
    @precondition(lambda self: not self.failed)
    def sync(self) -> None:
        self.journal.sync()
        self.unsynced = 0

    @rule(items=st.lists(st.binary(min_size=1, max_size=24), min_size=1, max_size=3))
    @precondition(lambda self: not self.failed)
    def failed_append(self, items: list[bytes]) -> None:
        # a failed append leaves nothing behind and needs no discard: the model is unchanged
        self.faults.fail_next("write")
        try:
            self.journal.append([[p] for p in items])
        except StorageFull:
            pass
        else:
            raise AssertionError("the injected write failure did not surface")

    @rule()
    @precondition(lambda self: not self.failed)
    def failed_sync(self) -> None:
        self.faults.fail_next("sync")
        try:
            self.journal.sync()
        except StorageFull:
            self.failed = True
        else:
            raise AssertionError("the injected sync failure did not surface")

    @rule()
    def discard(self) -> None:
        self.journal.discard_unsynced()
        if self.unsynced:
            del self.active[-self.unsynced :]
        self.unsynced = 0
        self.failed = False

    @rule()
    @precondition(lambda self: not self.failed)
    def roll(self) -> None:
        sealed = self.journal.roll()
        if not self.active:
            assert sealed is None
            return
        assert sealed == self.active_id
        self.sealed[sealed] = self.active
        self.active, self.unsynced = [], 0
        self.active_id += 1

    @rule()
    @precondition(lambda self: bool(self.sealed))
    def delete_oldest_sealed(self) -> None:
        oldest = min(self.sealed)
        self.journal.delete_file(oldest)
        del self.sealed[oldest]

    @rule()
    @precondition(lambda self: not self.failed and self.unsynced == 0)
    def reopen(self) -> None:
        self.journal = self.restart()
        assert recover(self.journal) == self.model()
        assert self.journal.report.cut_bytes == 0

    @invariant()
    def reads_match_the_model(self) -> None:
        for address, payload in self.model():
            assert self.journal.read(address) == payload
        assert self.journal.sealed_files() == sorted(self.sealed)
        for file_id, entries in self.sealed.items():
            assert [(a, bytes(p)) for a, p in self.journal.entries(file_id)] == entries
        assert (self.journal.active_bytes == 0) == (not self.active)

    def teardown(self) -> None:
        self.journal.close()


class FileJournalMachine(JournalMachine):
    def __init__(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="journal-machine-"))
        super().__init__()

    def open(self) -> Journal:
        # no fdatasync: the fault hook still runs on every sync, and the machine stays fast
        return FileJournal(self.tmp / "journal", fsync=False, fault=self.faults)

    def restart(self) -> Journal:
        self.journal.close()
        return self.open()

    def teardown(self) -> None:
        super().teardown()
        shutil.rmtree(self.tmp, ignore_errors=True)


class DirectFileJournalMachine(FileJournalMachine):
    def open(self) -> Journal:
        return FileJournal(self.tmp / "journal", fsync=False, direct=True, fault=self.faults)


class MemoryJournalMachine(JournalMachine):
    def open(self) -> Journal:
        return MemoryJournal(fault=self.faults)

    def restart(self) -> Journal:
        return self.journal


class ObjectJournalMachine(JournalMachine):
    """ObjectJournal on the in-memory chunk store and catalog: the same mapping of files onto
    objects and records as on SeaweedFS, fast enough for a state machine."""

    def open(self) -> Journal:
        if not hasattr(self, "store"):
            self.store = MemoryChunkStore()
            self.meta = SqliteMetaStore(":memory:")
        return ObjectJournal(self.store, self.meta, 0, cache_bytes=64, fault=self.faults)

    def restart(self) -> Journal:
        self.journal.close()
        return self.open()


_machine_settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
TestFileJournalMachine = FileJournalMachine.TestCase
TestFileJournalMachine.settings = _machine_settings
TestDirectFileJournalMachine = DirectFileJournalMachine.TestCase
TestDirectFileJournalMachine.settings = _machine_settings
TestMemoryJournalMachine = MemoryJournalMachine.TestCase
TestMemoryJournalMachine.settings = _machine_settings
TestObjectJournalMachine = ObjectJournalMachine.TestCase
TestObjectJournalMachine.settings = _machine_settings

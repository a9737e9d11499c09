"""PowerFS, the power-loss filesystem, keeps exactly what was made durable: file data on
fsync/fdatasync, directory entries on fsync of their directory, everything present at mount."""

from __future__ import annotations

import os
from pathlib import Path

from conftest import needs_fuse

from slipstream.storage import FileJournal, LocalChunkStore, chunk_name
from slipstream.torture._powerfs import PowerFS

pytestmark = needs_fuse


def fail(powerfs: PowerFS) -> Path:
    """Fail the power and mount again; returns the mountpoint."""
    powerfs.power_fail()
    powerfs.mount()
    return powerfs.mountpoint


def write(path: Path, data: bytes, *, sync: bool, flags: int = os.O_CREAT | os.O_TRUNC) -> None:
    fd = os.open(path, os.O_WRONLY | flags, 0o644)
    try:
        os.write(fd, data)
        if sync:
            os.fdatasync(fd)
    finally:
        os.close(fd)


def sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def test_synced_data_is_kept_and_unsynced_data_is_lost(powerfs: PowerFS) -> None:
    m = powerfs.mountpoint
    write(m / "kept", b"one", sync=True)
    write(m / "lost", b"two", sync=False)
    sync_dir(m)
    write(m / "kept", b"+more", sync=False, flags=os.O_APPEND)
    write(m / "lost", b"three", sync=False)
    assert (m / "kept").read_bytes() == b"one+more"  # the live state, while the power is on
    m = fail(powerfs)
    assert (m / "kept").read_bytes() == b"one"
    assert (m / "lost").read_bytes() == b""  # its name was synced, its data never


def test_a_new_file_needs_its_directory_synced(powerfs: PowerFS) -> None:
    m = powerfs.mountpoint
    write(m / "unnamed", b"data", sync=True)  # the data is durable, its name is not
    m = fail(powerfs)
    assert not (m / "unnamed").exists()
    write(m / "named", b"data", sync=True)
    sync_dir(m)
    m = fail(powerfs)
    assert (m / "named").read_bytes() == b"data"


def test_a_directory_needs_its_parent_synced(powerfs: PowerFS) -> None:
    m = powerfs.mountpoint
    (m / "a" / "b").mkdir(parents=True)
    write(m / "a" / "b" / "file", b"data", sync=True)
    sync_dir(m / "a" / "b")
    sync_dir(m / "a")  # but not m: "a" itself is not durable, nor anything in it
    m = fail(powerfs)
    assert os.listdir(m) == []
    (m / "a" / "b").mkdir(parents=True)
    write(m / "a" / "b" / "file", b"data", sync=True)
    for directory in (m / "a" / "b", m / "a", m):
        sync_dir(directory)
    m = fail(powerfs)
    assert (m / "a" / "b" / "file").read_bytes() == b"data"


def test_rename_and_unlink_are_durable_only_after_the_directory_sync(powerfs: PowerFS) -> None:
    m = powerfs.mountpoint
    write(m / "old", b"data", sync=True)
    write(m / "doomed", b"x", sync=True)
    sync_dir(m)
    os.rename(m / "old", m / "new")
    os.unlink(m / "doomed")
    m = fail(powerfs)
    assert sorted(os.listdir(m)) == ["doomed", "old"]
    os.rename(m / "old", m / "new")
    os.unlink(m / "doomed")
    sync_dir(m)
    m = fail(powerfs)
    assert os.listdir(m) == ["new"]
    assert (m / "new").read_bytes() == b"data"


def test_a_hard_link_is_one_file(powerfs: PowerFS) -> None:
    m = powerfs.mountpoint
    write(m / "a", b"data", sync=True)
    sync_dir(m)
    os.link(m / "a", m / "b")
    assert os.path.samefile(m / "a", m / "b")  # the chunk store relies on this
    m = fail(powerfs)
    assert os.listdir(m) == ["a"]
    os.link(m / "a", m / "b")
    sync_dir(m)
    write(m / "b", b"-more", sync=True, flags=os.O_APPEND)  # synced through the other name
    m = fail(powerfs)
    assert (m / "a").read_bytes() == (m / "b").read_bytes() == b"data-more"
    assert os.path.samefile(m / "a", m / "b")


def test_truncation_is_undone_unless_synced(powerfs: PowerFS) -> None:
    m = powerfs.mountpoint
    write(m / "f", b"0123456789", sync=True)
    sync_dir(m)
    os.truncate(m / "f", 3)
    write(m / "f", b"ab", sync=False, flags=os.O_APPEND)
    m = fail(powerfs)
    assert (m / "f").read_bytes() == b"0123456789"
    with open(m / "f", "r+b") as f:
        f.truncate(3)
        f.seek(0, os.SEEK_END)
        f.write(b"ab")
        f.flush()
        os.fsync(f.fileno())
    m = fail(powerfs)
    assert (m / "f").read_bytes() == b"012ab"


def test_a_torn_write_lands_in_part(tmp_path: Path) -> None:
    powerfs = PowerFS(tmp_path / "disk", tmp_path / "mnt", tear=True, seed=7)
    powerfs.mount()
    m = powerfs.mountpoint
    write(m / "f", b"synced", sync=True)
    sync_dir(m)
    write(m / "f", b"x" * 100, sync=False, flags=os.O_APPEND)
    m = fail(powerfs)
    data = (m / "f").read_bytes()
    powerfs.unmount()
    assert data.startswith(b"synced")
    assert 0 < len(data) - len(b"synced") < 100
    assert set(data[len(b"synced") :]) == {ord("x")}


def test_everything_present_at_mount_is_durable(powerfs: PowerFS) -> None:
    powerfs.unmount()
    (powerfs.backing / "dir").mkdir()
    (powerfs.backing / "dir" / "f").write_bytes(b"before")
    powerfs.mount()
    m = fail(powerfs)
    assert (m / "dir" / "f").read_bytes() == b"before"


def test_the_journal_writes_directly_and_recovers_what_it_synced(powerfs: PowerFS) -> None:
    """The broker's journal opens its files with O_DIRECT; PowerFS allows it."""
    journal = FileJournal(powerfs.mountpoint / "journal" / "0")
    list(journal.recover())
    assert journal.direct
    journal.append([[b"synced"]])
    journal.sync()
    journal.append([[b"lost"]])
    journal.close()
    m = fail(powerfs)
    journal = FileJournal(m / "journal" / "0")
    assert [bytes(p) for _, p in journal.recover()] == [b"synced"]
    journal.close()


def test_chunks_written_or_adopted_survive(powerfs: PowerFS) -> None:
    """The chunk store syncs the <stream>/<segment>/ directories it creates, not only files."""
    m = powerfs.mountpoint
    journal = FileJournal(m / "journal" / "0")
    list(journal.recover())
    journal.append([[b"moved"]])
    sealed = journal.roll()
    assert sealed is not None
    store = LocalChunkStore(m / "chunks")
    store.write_chunk(chunk_name(1, 0, 0), [b"written"])
    source = journal.file_path(sealed)
    assert source is not None
    store.adopt_ranges(chunk_name(2, 1, 0), source, [(0, 8)])
    journal.close()
    m = fail(powerfs)
    store = LocalChunkStore(m / "chunks")
    assert bytes(store.read_chunk(chunk_name(1, 0, 0))) == b"written"
    assert bytes(store.read_chunk(chunk_name(2, 1, 0), 8, 5)) == b"moved"

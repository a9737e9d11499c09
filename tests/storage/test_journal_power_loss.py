"""Journal files and their names across a power failure, on PowerFS (a filesystem that keeps
only what was made durable: file data on fsync/fdatasync, names on their directory's fsync).

A deleted journal file must stay deleted: ``delete_file`` syncs the directory when the journal
syncs (see the module docstring of slipstream/storage/_journal.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import needs_fuse

from slipstream.storage import FileJournal, _journal
from slipstream.torture._powerfs import PowerFS

pytestmark = needs_fuse


def test_a_deleted_journal_file_stays_deleted_after_a_power_failure(powerfs: PowerFS) -> None:
    directory = powerfs.mountpoint / "journal"
    journal = FileJournal(directory)
    list(journal.recover())
    for n in range(3):
        journal.append([[f"entry {n}".encode()]])
        journal.roll()  # syncs, seals file n
    journal.delete_file(0)
    journal.delete_file(1)
    journal.close()
    powerfs.power_fail()
    powerfs.mount()
    assert sorted(p.name for p in directory.glob("*.journal")) == [
        f"{2:016d}.journal",
        f"{3:016d}.journal",
    ]
    again = FileJournal(directory)
    try:
        assert [bytes(p) for _, p in again.recover()] == [b"entry 2"]
    finally:
        again.close()


def test_delete_file_syncs_the_directory_only_when_the_journal_syncs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[Path] = []
    real = _journal.fsync_dir
    monkeypatch.setattr(_journal, "fsync_dir", lambda path: (synced.append(path), real(path)))
    for fsync in (True, False):
        directory = tmp_path / f"fsync-{fsync}"
        journal = FileJournal(directory, fsync=fsync)
        list(journal.recover())
        journal.append([[b"x"]])
        journal.roll()
        synced.clear()
        journal.delete_file(0)
        journal.close()
        assert synced == ([directory] if fsync else [])
        assert not (directory / f"{0:016d}.journal").exists()

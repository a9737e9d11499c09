"""The journal's durability checked at the syscall, not at a fault hook.

``FileJournal.sync`` must call ``os.fdatasync`` on the active journal file: kill -9 cannot tell a
journal that syncs from one that never does (the page cache outlives the process), and a fault
hook is called whether or not the syscall follows. So a recorder replaces ``os.fdatasync``
(the journal calls it through the ``os`` module): it notes which file each call syncs, can hold
a call until the test releases it, and can fail one with an errno. Journals run with
``fsync=True`` in a temporary directory; the acknowledgement tests run a real broker in this
process (``Broker.serve`` on a thread) and talk to it with the raw protocol connection.
"""

from __future__ import annotations

import asyncio
import errno
import os
import select
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from raw import RawConnection, batch

import slipstream
from slipstream import StorageError, StorageFull
from slipstream.broker import Broker, BrokerConfig
from slipstream.protocol import Append, AppendAck, CreateStream, Error, StreamInfo, Welcome
from slipstream.storage import FileJournal

_real_fdatasync = os.fdatasync


class FdatasyncRecorder:
    """Stands in for ``os.fdatasync``. Calls on files under ``scope`` ending in ``.journal``
    are recorded (by the path their fd names), may be held (``hold()``, then ``release()``) or
    failed once (``fail_next(errno)``); every other call passes straight through."""

    def __init__(self, scope: Path) -> None:
        self.scope = str(scope)
        self.paths: list[str] = []
        self.entered = threading.Event()  # a held call is waiting
        self.returned = threading.Event()  # the real fdatasync of a journal file returned
        self._release: threading.Event | None = None
        self._fail: int | None = None

    def hold(self) -> None:
        self._release = threading.Event()

    def release(self) -> None:
        assert self._release is not None
        self._release.set()

    def fail_next(self, code: int) -> None:
        self._fail = code

    def __call__(self, fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if not (path.startswith(self.scope) and path.endswith(".journal")):
            _real_fdatasync(fd)
            return
        self.paths.append(path)
        if self._fail is not None:
            code, self._fail = self._fail, None
            raise OSError(code, os.strerror(code))
        if self._release is not None:
            self.entered.set()
            if not self._release.wait(20):
                raise OSError(errno.ETIMEDOUT, "the test never released the held fdatasync")
        _real_fdatasync(fd)
        self.returned.set()


@pytest.fixture
def recorder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FdatasyncRecorder:
    recording = FdatasyncRecorder(tmp_path)
    monkeypatch.setattr(os, "fdatasync", recording)
    return recording


def journal_file(directory: Path, file_id: int) -> str:
    return str(directory / f"{file_id:016d}.journal")


def recovered(directory: Path) -> list[bytes]:
    journal = FileJournal(directory, fsync=True)
    try:
        return [bytes(payload) for _, payload in journal.recover()]
    finally:
        journal.close()


# --- the journal alone ---------------------------------------------------------------------------


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_every_sync_is_one_fdatasync_of_the_active_file(
    tmp_path: Path, recorder: FdatasyncRecorder, direct: bool
) -> None:
    directory = tmp_path / "journal"
    journal = FileJournal(directory, fsync=True, direct=direct)
    list(journal.recover())
    for i in range(3):
        journal.append([[f"entry {i}".encode()]])
        journal.sync()
        assert recorder.paths == [journal_file(directory, 0)] * (i + 1)
    # a roll makes the sealed file durable (one sync), then appends go to the new file
    journal.append([[b"last in file 0"]])
    assert journal.roll() == 0
    assert recorder.paths == [journal_file(directory, 0)] * 4
    journal.append([[b"first in file 1"], [b"second in file 1"]])
    journal.sync()
    assert recorder.paths[4:] == [journal_file(directory, 1)]
    journal.close()


def test_a_journal_without_fsync_never_calls_fdatasync(
    tmp_path: Path, recorder: FdatasyncRecorder
) -> None:
    journal = FileJournal(tmp_path / "journal", fsync=False)
    list(journal.recover())
    journal.append([[b"buffered only"]])
    journal.sync()
    journal.roll()
    journal.close()
    assert recorder.paths == []


@pytest.mark.parametrize(
    ("code", "error"),
    [(errno.ENOSPC, StorageFull), (errno.EDQUOT, StorageFull), (errno.EIO, StorageError)],
    ids=["ENOSPC", "EDQUOT", "EIO"],
)
def test_a_failed_fdatasync_fails_the_sync_and_discard_cuts_the_group(
    tmp_path: Path, recorder: FdatasyncRecorder, code: int, error: type[StorageError]
) -> None:
    directory = tmp_path / "journal"
    journal = FileJournal(directory, fsync=True)
    list(journal.recover())
    journal.append([[b"synced"]])
    journal.sync()
    journal.append([[b"group entry 1"], [b"group entry 2"]])
    recorder.fail_next(code)
    with pytest.raises(error) as raised:
        journal.sync()
    assert type(raised.value) is error  # EIO is not reported as a full disk
    # the documented contract: a caller that acknowledges only synced entries discards the
    # rest, and appends go on from the last synced entry
    journal.discard_unsynced()
    journal.append([[b"after the failure"]])
    journal.sync()
    assert len(recorder.paths) == 3
    journal.close()
    assert recovered(directory) == [b"synced", b"after the failure"]


# --- acknowledgements of a real broker -----------------------------------------------------------


class InProcessBroker:
    """``Broker.serve`` on a thread of this process (so the recorder sees its syscalls), one
    container, any free port."""

    def __init__(self, data_dir: Path) -> None:
        self.broker = Broker(BrokerConfig(data_dir=data_dir, port=0, containers=1))
        self.loop: asyncio.AbstractEventLoop | None = None
        self.address = ""
        self.failure: BaseException | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="in-process-broker")

    def _run(self) -> None:
        def ready(address: tuple[str, int]) -> None:
            self.loop = asyncio.get_running_loop()
            self.address = f"{address[0]}:{address[1]}"
            self._ready.set()

        try:
            asyncio.run(self.broker.serve(ready))
        except BaseException as exc:  # reported by stop(), not lost on the thread
            self.failure = exc
        finally:
            self._ready.set()

    def start(self) -> InProcessBroker:
        self._thread.start()
        assert self._ready.wait(30), "the broker did not start"
        if self.failure is not None:
            raise self.failure
        return self

    def stop(self) -> None:
        if self.loop is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.broker.stop)
        self._thread.join(30)
        assert not self._thread.is_alive(), "the broker did not stop"
        if self.failure is not None:
            raise self.failure


@pytest.fixture
def start_broker(tmp_path: Path) -> Iterator[Callable[[], InProcessBroker]]:
    running: list[InProcessBroker] = []

    def start() -> InProcessBroker:
        for broker in running:
            broker.stop()
        running.clear()
        running.append(InProcessBroker(tmp_path / "data").start())
        return running[0]

    yield start
    for broker in running:
        broker.stop()


def open_stream(address: str, stream: str) -> RawConnection:
    connection = RawConnection(address)
    assert isinstance(connection.receive().message, Welcome)
    connection.send_frame(CreateStream(stream, 1, None, None), 2)
    assert isinstance(connection.receive().message, StreamInfo)
    return connection


def audit_written(broker: InProcessBroker) -> None:
    """Wait until the broker's audit writer has appended every record made so far (the
    stream's creation): its fdatasync must not be taken for the one a test waits for."""
    audit = broker.broker.service.audit
    deadline = time.monotonic() + 20
    while audit.appended < audit.seq:
        assert time.monotonic() < deadline, "the audit records were never appended"
        time.sleep(0.01)


def nothing_to_read(connection: RawConnection, wait: float) -> bool:
    """No frame decoded or bytes arrived within ``wait`` seconds."""
    if connection.decoder.buffered:
        return False
    readable, _, _ = select.select([connection.sock], [], [], wait)
    return not readable


def test_an_append_is_acknowledged_only_after_its_fdatasync_returns(
    tmp_path: Path,
    recorder: FdatasyncRecorder,
    start_broker: Callable[[], InProcessBroker],
) -> None:
    broker = start_broker()
    connection = open_stream(broker.address, "t/acks")
    audit_written(broker)
    recorder.scope = str(tmp_path / "data" / "journal")  # the containers' journals only
    recorder.paths.clear()
    recorder.returned.clear()  # the audit record's sync returned already
    recorder.hold()
    connection.send_frame(Append("t/acks", 0), 3, batch(3, b"durable"))
    assert recorder.entered.wait(20), "the append's group never called fdatasync"
    # held in fdatasync: no acknowledgement may leave the broker yet
    assert nothing_to_read(connection, 0.5), "acknowledged before fdatasync returned"
    assert not recorder.returned.is_set()
    recorder.release()
    frame = connection.receive()
    assert recorder.returned.is_set()
    assert frame.correlation_id == 3 and frame.message == AppendAck(0, 3)
    assert recorder.paths == [str(tmp_path / "data" / "journal" / "0" / f"{0:016d}.journal")]
    connection.close()


def test_a_full_disk_at_fdatasync_fails_the_append_and_later_appends_go_on(
    tmp_path: Path,
    recorder: FdatasyncRecorder,
    start_broker: Callable[[], InProcessBroker],
) -> None:
    broker = start_broker()
    connection = open_stream(broker.address, "t/full")
    audit_written(broker)
    recorder.scope = str(tmp_path / "data" / "journal")  # the containers' journals only
    recorder.paths.clear()
    connection.send_frame(Append("t/full", 0), 3, batch(2, b"first"))
    assert connection.receive().message == AppendAck(0, 2)
    recorder.fail_next(errno.ENOSPC)
    connection.send_frame(Append("t/full", 0), 4, batch(3, b"never acknowledged"))
    frame = connection.receive()
    assert frame.correlation_id == 4 and isinstance(frame.message, Error), frame.message
    assert frame.message.code == StorageFull.code
    # the failed group's offsets are taken back, and the next append is stored and durable
    connection.send_frame(Append("t/full", 0), 5, batch(1, b"after"))
    assert connection.receive().message == AppendAck(2, 1)
    assert len(recorder.paths) == 3
    connection.close()
    broker = start_broker()  # a clean restart recovers only what was acknowledged
    with slipstream.connect(broker.address) as client:
        end = client.tail("t/full")
        values = [event.value for event in client.reader("t/full", "earliest", end)]
    assert values == [b"first", b"first", b"after"]

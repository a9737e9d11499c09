"""Fuzz a real broker's stored data: damaged journal and chunk files never crash it or get
served.

A broker fills a data directory once (one container, small journal files, so there are sealed
files, chunks made from them, and an active file). Each example copies it, damages one
journal or chunk file (byte flips, overwrites, insertions, deletions, a truncation), starts a
broker on the copy and reads every segment from its start to its end, reading on past
``corrupt_data`` where the broker names a resume offset, straight off the wire. Invariants:
the broker starts and stays up, its log gains no traceback, every batch it serves passes its
CRC32C and holds only events that were produced, each once, offsets only grow, and damage is
reported as ``corrupt_data``, never as another error.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import pytest
from conftest import BrokerProcess
from fuzz_inputs import mutated
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from raw import RawConnection

from slipstream.format import iter_batches, read_body
from slipstream.protocol import (
    Credit,
    Cut,
    Data,
    Done,
    Follow,
    FollowEnded,
    FollowFailed,
    GetCut,
    Welcome,
)

STREAM = "fuzz/stored"
SEGMENTS = 2
BROKER_ARGS = ("--containers", "1", "--roll", "16KiB")


def produced_values() -> list[bytes]:
    return [f"event {n:05d} ".encode().ljust(120, b"~") for n in range(600)]


@pytest.fixture(scope="module")
def golden(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A stopped broker's data directory with chunks and journal files. Made again (up to 5
    times) when no journal kept any bytes: where the last batch lands decides that (one that
    fills the active file rolls it, empty, and the mover may trim the sealed one before the
    stop), and batching varies from run to run."""
    for _attempt in range(5):
        data_dir = tmp_path_factory.mktemp("golden") / "data"
        broker = BrokerProcess(data_dir, *BROKER_ARGS).start()
        try:
            with broker.client() as client:
                client.create_stream(STREAM, segments=SEGMENTS)
                with client.producer(STREAM, linger_ms=0, compression=None) as producer:
                    values = produced_values()
                    for at in range(0, len(values), 20):
                        for n, value in enumerate(values[at : at + 20]):
                            producer.send(value, key=f"k{(at + n) % 7}")
                        producer.flush()
            deadline = time.monotonic() + 30
            while not list((data_dir / "chunks").rglob("*.chunk")) and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            assert broker.stop() == 0, broker.log()[-3000:]
        if {".journal", ".chunk"} <= {p.suffix for p in damageable(data_dir)}:
            break
    return data_dir


def damageable(data_dir: Path) -> list[Path]:
    files = [*(data_dir / "journal").rglob("*.journal"), *(data_dir / "chunks").rglob("*")]
    return sorted(p for p in files if p.is_file() and p.stat().st_size)


def read_everything(address: str) -> list[bytes]:
    """Every event of every segment, straight off the wire (so the broker's own checks are
    what is tested, not the client's), reading on past holes the broker names. Every batch
    the broker serves must pass its CRC32C and decode."""
    raw = RawConnection(address)
    try:
        assert isinstance(raw.receive().message, Welcome)
        cuts = []
        for cid, at in [(2, "earliest"), (3, "latest")]:
            raw.send_frame(GetCut(STREAM, at), cid)
            reply = raw.receive().message
            assert isinstance(reply, Cut), reply
            cuts.append(reply.positions)
        served: list[bytes] = []
        sub_id = 0
        for segment, stop in cuts[1].items():
            offset = cuts[0][segment]
            while offset < stop:
                sub_id += 1
                raw.send_frame(Follow(sub_id, STREAM, segment, offset, stop, CREDIT), 10 + sub_id)
                offset = follow(raw, sub_id, offset, served)
    finally:
        raw.close()
    return served


CREDIT = 4 * 1024 * 1024


def follow(raw: RawConnection, sub_id: int, offset: int, served: list[bytes]) -> int:
    """Run one follow to its end; returns where to go on (past the end if nothing can)."""
    while True:
        frame = raw.receive()
        message = frame.message
        if isinstance(message, Done):
            continue
        assert getattr(message, "sub_id", sub_id) == sub_id, message
        if isinstance(message, FollowEnded):
            return 1 << 62
        if isinstance(message, FollowFailed):
            assert message.code == "corrupt_data", message
            resume = message.details.get("resume")
            if resume is None:
                return 1 << 62  # damage without a known way on: reported, nothing served
            assert resume > offset
            return int(resume)
        assert isinstance(message, Data), message
        for header, view in iter_batches(frame.payload):  # CorruptBatch: garbage was served
            assert header.next_offset > offset, "an offset went back"
            offset = header.next_offset
            served += read_body(view).column("value").to_pylist()
        raw.send_frame(Credit(sub_id, len(frame.payload)), 0)


def test_the_golden_data_reads_back_whole(golden: Path) -> None:
    kinds = {p.suffix for p in damageable(golden)}
    assert {".journal", ".chunk"} <= kinds, kinds
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "data"
        shutil.copytree(golden, data_dir)
        broker = BrokerProcess(data_dir, *BROKER_ARGS).start()
        try:
            assert sorted(read_everything(broker.address)) == produced_values()
        finally:
            broker.kill()


@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_damaged_stored_files_are_reported_never_served_and_never_crash_the_broker(
    golden: Path, data: st.DataObject
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "data"
        shutil.copytree(golden, data_dir)
        target = data.draw(st.sampled_from(damageable(data_dir)), label="file")
        damage = data.draw(
            mutated(
                target.read_bytes(),
                max_mutations=3,
                kinds=("flip", "overwrite", "insert", "delete", "truncate"),
            ),
            label="damage",
        )
        target.write_bytes(damage.data)
        broker = BrokerProcess(data_dir, *BROKER_ARGS).start()
        try:
            served = read_everything(broker.address)
            assert broker.proc is not None and broker.proc.poll() is None
            assert set(served) <= set(produced_values()), "an event nobody produced was served"
            assert len(served) == len(set(served)), "an event was served twice"
            assert "Traceback" not in broker.log(), broker.log()[-4000:]
        finally:
            broker.kill()

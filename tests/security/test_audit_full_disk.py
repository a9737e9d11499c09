"""A full disk under the audit trail: records made while the audit stream cannot be written
are logged, kept queued and appended in order once space returns; none is lost, the chain
holds. The data directory is a small tmpfs (mounting needs root: skipped without it)."""

from __future__ import annotations

import contextlib
import errno
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import BrokerProcess

import slipstream
from slipstream import AuthenticationFailed
from slipstream.security._audit import decode_record, verify_chain

pytestmark = pytest.mark.timeout(180)

AUDIT = "_system/audit"


def fill(path: Path) -> None:
    """Write ``path`` until the filesystem has no byte left."""
    with open(path, "wb", buffering=0) as f:
        chunk = b"\0" * (64 * 1024)
        while True:
            try:
                f.write(chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                if len(chunk) == 1:
                    return
                chunk = chunk[: len(chunk) // 2]


def test_records_wait_out_a_full_disk_and_arrive_in_order(
    broker_factory: Callable[..., BrokerProcess], small_disk: Path, tmp_path: Path
) -> None:
    broker = broker_factory("--auth", "--containers", "1", data_dir=small_disk / "data")
    broker.log_path = tmp_path / "broker.log"  # not on the full disk: the errors must show
    broker.start()
    made = subprocess.run(
        [
            *(sys.executable, "-m", "slipstream", "token", "create", "--data-dir"),
            *(str(broker.data_dir), "--subject", "ops", "--role", "admin", "--json"),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert made.returncode == 0, made.stderr
    admin = json.loads(made.stdout)["token"]
    with slipstream.connect(broker.address, token=admin) as client:
        client.create_stream("demo/a")  # seq 1, durable before the disk fills
        deadline = time.monotonic() + 10
        while client.describe_stream(AUDIT).segments[0].end_offset < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)

        sizes = (120_000, 8_000, 400, 60)
        producers = [client.producer("demo/a", linger_ms=0, compression=None) for _ in sizes]
        for producer in producers:
            producer.send(b"first").result(10)
        ballast = small_disk / "ballast"
        fill(ballast)
        # the journal (one container: the audit stream's too) may have room it reserved
        # earlier: use it up, with ever smaller events
        for size, producer in zip(sizes, producers, strict=True):
            with pytest.raises(slipstream.StorageFull):
                for i in range(100_000):
                    producer.send(b"%06d" % i * (size // 6)).result(10)
            with contextlib.suppress(slipstream.StorageFull):  # the failure, reported again
                producer.close()
        fill(small_disk / "ballast2")  # what the failed write gave back
        # records that need no catalog write: refused connections
        for _ in range(3):
            with pytest.raises(AuthenticationFailed):
                slipstream.connect(broker.address, token="not-a-token", timeout=5).close()
        deadline = time.monotonic() + 15
        while "not yet in the audit stream" not in broker.log():
            assert time.monotonic() < deadline, broker.log()
            time.sleep(0.1)
        assert client.describe_stream(AUDIT).segments[0].end_offset == 1

        ballast.unlink()
        (small_disk / "ballast2").unlink()
        deadline = time.monotonic() + 20
        while client.describe_stream(AUDIT).segments[0].end_offset < 4:
            assert time.monotonic() < deadline, broker.log()
            time.sleep(0.1)
        with client.reader(AUDIT, end=client.tail(AUDIT)) as reader:
            values = [bytes(e.value) for e in reader]
    records = [decode_record(v) for v in values]
    assert [r.seq for r in records] == [1, 2, 3, 4]
    assert [r.event for r in records] == ["stream_created", *["authentication_failed"] * 3]
    assert {r.details["reason"] for r in records[1:]} == {"malformed"}
    assert verify_chain(values, trimmed=False).ok
    assert "audit stream writable again" in broker.log()

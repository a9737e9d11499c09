"""A full disk: appends fail with StorageFull and are not acknowledged, the broker stays up,
and once space returns it accepts writes again; everything acknowledged is still there.

The data directory is a small tmpfs, filled with a ballast file. Mounting needs root; without
it the test is skipped (the same failure is covered through the Journal interface by the
container and journal conformance tests).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import BrokerProcess

import slipstream


def test_full_disk_refuses_appends_then_recovers(
    broker_factory: type[BrokerProcess], small_disk: Path
) -> None:
    broker = broker_factory(data_dir=small_disk / "data").start()
    acknowledged: dict[bytes, slipstream.Position] = {}
    with broker.client() as client:
        client.create_stream("faults/full", segments=1)
        ballast = small_disk / "ballast"
        free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
        with open(ballast, "wb") as f:
            f.write(b"\0" * (free - 2 * 1024 * 1024))
        producer = client.producer(  # uncompressed: the repeated values would shrink 1000x
            "faults/full", linger_ms=0, batch_bytes=256 * 1024, compression=None
        )
        refused = None
        for i in range(100):
            value = f"{i:06d}".encode() * 20_000  # 120 kB events: the disk fills within a few
            try:
                acknowledged[value[:6]] = producer.send(value).result(10)
            except slipstream.StorageFull as exc:
                refused = exc
                break
        assert refused is not None, "the disk never filled"
        assert "disk full" in refused.message
        # still serving: reads and metadata work while the disk is full
        assert client.describe_stream("faults/full").segments[0].end_offset == len(acknowledged)
        with pytest.raises(slipstream.StorageFull):  # and it stays refused while full
            producer.send(b"x" * 120_000).result(10)
        ballast.unlink()
        position = producer.send(b"after").result(10)
        assert position.offset == len(acknowledged)  # no gap where the refused appends were
        events = list(client.reader("faults/full", end=client.tail("faults/full")))
        assert [e.value[:6] for e in events[:-1]] == list(acknowledged)
        assert events[-1].value == b"after"

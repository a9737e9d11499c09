"""Changing a stream's retention on a real broker (``update_stream``): the answer and
``describe_stream`` show it, a restart keeps it, and the broker's next retention pass applies
a shrunk limit to data it had kept."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import Callable

import pytest
from conftest import BrokerProcess, chunk_files

import slipstream

DAY_MS = 86_400_000


def _chunk_files(broker: BrokerProcess, stream: str) -> int:
    return len(chunk_files(broker.data_dir, stream))


def _wait_for(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"{what} within {timeout}s")


def test_update_is_described_kept_across_restarts_and_applied_by_retention(
    broker_factory: type[BrokerProcess],
) -> None:
    broker = broker_factory(
        "--roll", "8KiB", "--roll-seconds", "0.2", "--retention-check-seconds", "0.2"
    ).start()
    stream = "upd/orders"
    with broker.client() as client:
        client.create_stream(stream)  # keeps everything
        old = int(time.time() * 1000) - 60_000  # a minute old: past any limit set below
        # uncompressed: 300 x 400 repeated bytes would compress into one small batch
        with client.producer(stream, batch_bytes=4096, compression=None) as producer:
            for _ in range(300):
                producer.send(b"v" * 400, timestamp=old)
        _wait_for(lambda: _chunk_files(broker, stream) >= 3, "the mover never made chunks")
        assert client.describe_stream(stream).segments[0].start_offset == 0

        info = client.update_stream(stream, retention_time="1s")
        assert (info.name, info.retention_ms, info.retention_bytes) == (stream, 1000, None)
        assert client.describe_stream(stream).retention_ms == 1000
        _wait_for(
            lambda: client.describe_stream(stream).segments[0].start_offset > 0,
            "retention never applied the new limit",
        )
        start = client.describe_stream(stream).segments[0].start_offset
        events = list(client.reader(stream, end=client.tail(stream)))
        assert [e.offset for e in events] == list(range(start, 300))

        # one limit at a time: the other stays
        info = client.update_stream(stream, retention_bytes="1MiB")
        assert (info.retention_ms, info.retention_bytes) == (1000, 1 << 20)

    broker.restart()  # kill -9: the catalog had it before the answer
    with broker.client() as client:
        info = client.describe_stream(stream)
        assert (info.retention_ms, info.retention_bytes) == (1000, 1 << 20)
        assert info.segments[0].start_offset >= start
        info = client.update_stream(stream, retention_time="forever", retention_bytes=0)
        assert (info.retention_ms, info.retention_bytes) == (None, None)

    broker.restart()
    with broker.client() as client:
        info = client.describe_stream(stream)
        assert (info.retention_ms, info.retention_bytes) == (None, None)


def test_update_units_errors_and_the_async_client(broker: BrokerProcess) -> None:
    async def main() -> None:
        async with await slipstream.connect_async(broker.address) as client:
            await client.create_stream("upd/units", retention_time="1h")
            info = await client.update_stream(
                "upd/units", retention_time=dt.timedelta(days=7), retention_bytes="10GiB"
            )
            assert (info.retention_ms, info.retention_bytes) == (7 * DAY_MS, 10 * 2**30)
            info = await client.update_stream("upd/units", retention_time=90_000)
            assert (info.retention_ms, info.retention_bytes) == (90_000, 10 * 2**30)
            info = await client.update_stream("upd/units")  # nothing given: nothing changes
            assert (info.retention_ms, info.retention_bytes) == (90_000, 10 * 2**30)
            info = await client.update_stream(
                "upd/units", retention_time=dt.timedelta(0), retention_bytes="unlimited"
            )
            assert (info.retention_ms, info.retention_bytes) == (None, None)

            with pytest.raises(slipstream.InvalidArgument, match="must be positive"):
                await client.update_stream("upd/units", retention_time=-5)
            with pytest.raises(slipstream.InvalidArgument, match="bad size"):
                await client.update_stream("upd/units", retention_bytes="lots")
            with pytest.raises(slipstream.StreamNotFound, match="upd/missing"):
                await client.update_stream("upd/missing", retention_time="1d")
            described = await client.describe_stream("upd/units")
            assert (described.retention_ms, described.retention_bytes) == (None, None)

    asyncio.run(main())

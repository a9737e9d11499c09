"""Volume over TLS: what bench/security.py measures must also arrive whole and in order.

A replay moves Data frames of up to 4 MiB, each many TLS records (16 KiB of plaintext at
most), with batches larger than a record and frames that end mid-record; several TLS
connections read at once. Every byte is checked, not only the count.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import BrokerProcess
from security.pki import Authority

import slipstream

pytestmark = pytest.mark.timeout(180)

BrokerFactory = Callable[..., BrokerProcess]

#: value sizes cycled through: below, at and far above one TLS record; 12 MiB in all
SIZES = (1, 100, 16 * 1024 - 1, 16 * 1024, 16 * 1024 + 7, 100_000, 700_000)
EVENTS = 105


def _value(i: int) -> bytes:
    """Event i's value: its number, then bytes derived from it (a wrong or shifted byte
    anywhere shows)."""
    size = SIZES[i % len(SIZES)]
    seed = hashlib.sha256(i.to_bytes(4, "little")).digest()
    body = (seed * (size // len(seed) + 1))[: max(0, size - 4)]
    return (i.to_bytes(4, "little") + body)[:size] if size >= 4 else seed[:size]


def test_large_batches_replay_whole_and_in_order_over_tls(
    broker_factory: BrokerFactory, tmp_path: Path
) -> None:
    ca = Authority(tmp_path, "volume")
    server = ca.issue("broker", hosts=("127.0.0.1",), into="server")
    broker = broker_factory("--tls-cert", str(server.cert), "--tls-key", str(server.key))
    broker.start()
    expected = [_value(i) for i in range(EVENTS)]
    assert sum(map(len, expected)) > 3 * 4 * 1024 * 1024  # several full Data frames

    with slipstream.connect(broker.address, tls=True, ca=ca.path) as client:
        client.create_stream("demo/volume", segments=1)
        # one batch per event up to 2 MiB: send() with a linger gathers many per batch
        with client.producer("demo/volume", linger_ms=20) as producer:
            for value in expected:
                producer.send(value)
        end = client.tail("demo/volume")

    results: dict[str, list[bytes]] = {}
    failures: list[BaseException] = []

    def read(name: str, by_batches: bool) -> None:
        try:
            with slipstream.connect(broker.address, tls=True, ca=ca.path) as reader_client:
                reader = reader_client.reader("demo/volume", start="earliest", end=end)
                if by_batches:
                    values: list[bytes] = []
                    for batch in reader.batches():
                        values.extend(batch.column("value").to_pylist())
                else:
                    values = [event.value for event in reader]
                results[name] = values
        except BaseException as exc:  # reported below
            failures.append(exc)

    readers = [threading.Thread(target=read, args=(f"reader{i}", i % 2 == 0)) for i in range(3)]
    for thread in readers:
        thread.start()
    for thread in readers:
        thread.join(120)
    assert not failures, failures
    assert set(results) == {"reader0", "reader1", "reader2"}
    for name, values in results.items():
        assert len(values) == EVENTS, name
        for i, (got, want) in enumerate(zip(values, expected, strict=True)):
            assert got == want, f"{name}: event {i} differs ({len(got)} bytes, {len(want)} sent)"

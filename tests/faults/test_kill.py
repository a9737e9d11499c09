"""kill -9 the broker under sustained load from several producers: with fsync=always every
acknowledged event survives, in order, at its acknowledged position, with no offset gaps."""

from __future__ import annotations

import threading
import time

import pytest
from checker import Sent, check_history, encode, produce_and_record
from conftest import BrokerProcess

import slipstream

PRODUCERS = 4
KEYS = 6
#: (batch_bytes, linger_ms, value size): small batches, and batches of several hundred KiB,
#: which the broker's journal writes straight from the memory they arrived in
LOADS = {"small": (64 * 1024, 2, 0), "large": (1024 * 1024, 20, 2048)}


def _produce(
    address: str,
    producer_id: int,
    acknowledged: dict[bytes, slipstream.Position],
    lock: threading.Lock,
    stop: threading.Event,
    load: str,
) -> None:
    batch_bytes, linger_ms, size = LOADS[load]
    produce_and_record(
        address,
        "faults/kill",
        producer_id,
        acknowledged,
        lock,
        stop,
        keys=KEYS,
        per_round=50,
        size=size,
        linger_ms=linger_ms,
        batch_bytes=batch_bytes,
        pause=0.001,
    )


@pytest.mark.parametrize("round_", range(3))
@pytest.mark.parametrize("load", list(LOADS))
def test_kill_9_during_writes_loses_nothing_acknowledged(
    broker_factory: type[BrokerProcess], round_: int, load: str
) -> None:
    # Small journal files and fast rolls so that kills also land while data moves to chunks.
    broker = broker_factory("--roll", "256KiB", "--roll-seconds", "0.5").start()
    with broker.client() as client:
        client.create_stream("faults/kill", segments=3)
    acknowledged: dict[bytes, slipstream.Position] = {}
    lock = threading.Lock()
    for life in range(2):  # kill, restart, produce more, kill again
        stop = threading.Event()
        threads = [
            threading.Thread(
                target=_produce,
                args=(broker.address, life * 100 + p, acknowledged, lock, stop, load),
            )
            for p in range(PRODUCERS)
        ]
        for thread in threads:
            thread.start()
        time.sleep(1.0 + 0.4 * round_)
        broker.kill()
        stop.set()
        for thread in threads:
            thread.join(20)
        broker.start()
    assert len(acknowledged) > 1000, "the load was too light to mean anything"
    with broker.client() as client:
        events = list(
            client.reader("faults/kill", start="earliest", end=client.tail("faults/kill"))
        )
    problems = check_history(acknowledged, events)
    assert not problems, "\n".join(problems[:20])
    assert "recovered 1 streams" in broker.log()


def test_checker_catches_a_lost_and_a_reordered_event() -> None:
    """The checker itself must be able to fail."""
    a = encode(Sent(0, "k", 0))
    b = encode(Sent(0, "k", 1))
    events = [
        slipstream.Event(b"k", b, {}, 0, 0, 0),
        slipstream.Event(b"k", a, {}, 0, 0, 1),
    ]
    problems = check_history({a: slipstream.Position(0, 0)}, events)
    assert any("seq 0 after 1" in p for p in problems)
    assert any("was read at" in p for p in problems)
    assert check_history({}, events[:1], {0: 5}) == ["segment 0: offsets are not contiguous from 5"]

"""Producers never see scaling (issue 17), on a real broker: a producer keeps sending with many
keys while the stream is split and merged several times, and afterwards every acknowledged
event is stored exactly once, each key's events are in send order across segments (read
through the segment graph, predecessors first), and every receipt names where its event is.
Sync and asyncio producers, single and bulk sends, idempotent or not, and transactions.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import threading
from collections import defaultdict
from collections.abc import Callable

import pytest
from conftest import BrokerProcess
from raw import RawConnection

import slipstream
from slipstream.format import iter_batches, read_body
from slipstream.protocol import Data, Done, Follow, FollowEnded, SegmentInfo, StreamInfo

KEYS = [f"key-{i}" for i in range(64)]

Stored = dict[bytes, tuple[bytes | None, slipstream.Position]]  # value -> (key, where)


def read_segment(broker: BrokerProcess, stream: str, segment: int, end: int) -> list[tuple]:
    """Every event of one segment up to ``end``: ``(offset, key, value)``, in offset order."""
    events: list[tuple] = []
    if end == 0:
        return events
    connection = RawConnection(broker.address)
    try:
        connection.receive()
        connection.send_frame(Follow(1, stream, segment, 0, end, 1 << 27), 2)
        assert isinstance(connection.receive().message, Done)
        while True:
            frame = connection.receive()
            if isinstance(frame.message, FollowEnded):
                assert frame.message.next_offset == end
                return events
            assert isinstance(frame.message, Data)
            for header, view in iter_batches(frame.payload):
                record = read_body(view)
                keys = record.column(0).to_pylist()
                values = record.column(1).to_pylist()
                for i in range(record.num_rows):
                    events.append((header.base_offset + i, keys[i], values[i]))
    finally:
        connection.close()


def graph_order(info: StreamInfo) -> list[int]:
    """Segments with every predecessor before its successors (Kahn), ties by number."""
    preds = {s.number: set(s.predecessors) for s in info.segments}
    order: list[int] = []
    while preds:
        ready = sorted(n for n, p in preds.items() if not p - set(order))
        assert ready, f"the segment graph has a cycle: {preds}"
        order.append(ready[0])
        del preds[ready[0]]
    return order


def check_history(
    broker: BrokerProcess,
    client: slipstream.Client,
    stream: str,
    sent: dict[str | None, list[bytes]],
    positions: dict[bytes, slipstream.Position],
) -> Stored:
    """Every sent event stored exactly once, each key's events in send order through the
    graph (keyless ones, under None, in any order), each receipt's position where its event
    is. Returns what is stored."""
    info = client.describe_stream(stream)
    stored: Stored = {}
    by_key: dict[bytes | None, list[bytes]] = defaultdict(list)
    for segment in graph_order(info):
        end = next(s.end_offset for s in info.segments if s.number == segment)
        for offset, key, value in read_segment(broker, stream, segment, end):
            assert value not in stored, f"{value!r} stored twice"
            stored[value] = key, slipstream.Position(segment, offset)
            by_key[key].append(value)
    expected = {v for values in sent.values() for v in values}
    assert expected - stored.keys() == set(), "acknowledged events missing"
    assert stored.keys() - expected == set(), "events stored that were never sent"
    for key, values in sent.items():
        if key is None:
            assert sorted(by_key[None]) == sorted(values)
        else:
            assert by_key[key.encode()] == values, f"{key}: out of send order across segments"
    for value, position in positions.items():
        assert stored[value][1] == position, f"the receipt of {value!r} names {position}"
    return stored


def live_segments(info: StreamInfo) -> list[SegmentInfo]:
    """The open segments, by key range (neighbours next to each other)."""
    return sorted((s for s in info.segments if not s.sealed), key=lambda s: s.key_lo)


def scale_around(client: slipstream.Client, stream: str, rounds: int, pause: float) -> int:
    """Split and merge ``rounds`` times (random segment, random neighbours), ``pause`` apart.
    Returns the epoch reached."""
    rng = random.Random(17)
    info = client.describe_stream(stream)
    for turn in range(rounds):
        threading.Event().wait(pause)
        live = live_segments(info)
        if turn % 3 != 2 or len(live) < 2:
            info = client.scale_stream(
                stream, split=rng.choice(live).number, into=rng.choice([2, 3])
            )
        else:
            i = rng.randrange(len(live) - 1)
            info = client.scale_stream(stream, merge=[live[i].number, live[i + 1].number])
    return info.epoch


def send_while_scaling(
    client: slipstream.Client,
    stream: str,
    send: Callable[[str | None, bytes], None],
    rounds: int = 7,
) -> dict[str | None, list[bytes]]:
    """``send(key, value)`` in a thread, continuously, while the stream scales ``rounds``
    times, one event in nine keyless (key None); returns what was sent per key, in order."""
    sent: dict[str | None, list[bytes]] = defaultdict(list)
    stop = threading.Event()
    failure: list[BaseException] = []

    def produce() -> None:
        try:
            for i in itertools.count():
                if stop.is_set() and i % len(KEYS) == 0:
                    return
                key = None if i % 9 == 0 else KEYS[(i * 7) % len(KEYS)]
                value = b"%s:%d" % (str(key).encode(), len(sent[key]))
                sent[key].append(value)
                send(key, value)
                if i % 50 == 0:
                    threading.Event().wait(0.001)  # let the scaling thread in
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=produce)
    thread.start()
    try:
        assert scale_around(client, stream, rounds, 0.15) == rounds
    finally:
        stop.set()
        thread.join(60)
    assert not failure, failure
    return sent


@pytest.mark.parametrize("idempotent", [True, False])
def test_a_producer_sending_through_splits_and_merges_loses_and_reorders_nothing(
    client: slipstream.Client, broker: BrokerProcess, idempotent: bool
) -> None:
    stream = f"scp/sync-{str(idempotent).lower()}"
    client.create_stream(stream, segments=2)
    receipts: dict[bytes, slipstream.Receipt] = {}
    with client.producer(stream, idempotent=idempotent, linger_ms=2) as producer:

        def send(key: str | None, value: bytes) -> None:
            receipts[value] = producer.send(value, key=key)

        sent = send_while_scaling(client, stream, send)
    positions = {value: receipt.result() for value, receipt in receipts.items()}
    total = sum(len(v) for v in sent.values())
    assert producer.acknowledged == total and producer.core.failed == 0
    assert producer.core.rerouted > 0  # the scales did refuse some of its batches
    stored = check_history(broker, client, stream, sent, positions)
    # the events really crossed epochs: some in sealed segments, some in their successors
    info = client.describe_stream(stream)
    sealed = {s.number for s in info.segments if s.sealed}
    landed = {position.segment for _, position in stored.values()}
    assert landed & sealed and landed - sealed


def test_bulk_sends_of_an_asyncio_producer_land_where_their_receipts_say(
    client: slipstream.Client, broker: BrokerProcess
) -> None:
    stream = "scp/bulk"
    client.create_stream(stream, segments=1)
    sent: dict[str | None, list[bytes]] = defaultdict(list)
    positions: dict[bytes, slipstream.Position] = {}

    async def main() -> None:
        async with (
            slipstream.connect_async(broker.address) as aclient,
            aclient.producer(stream, linger_ms=2) as producer,
        ):
            pending = []
            for round_ in range(60):
                keys = [KEYS[(round_ * 11 + i) % len(KEYS)] for i in range(40)]
                values = []
                for key in keys:
                    values.append(b"%s:%d" % (key.encode(), len(sent[key])))
                    sent[key].append(values[-1])
                pending.append((values, await producer.send_many(values, keys=keys)))
                if round_ % 8 == 4:
                    live = live_segments(await aclient.describe_stream(stream))
                    if round_ % 16 == 4 or len(live) < 2:
                        await aclient.scale_stream(stream, split=live[-1].number)
                    else:
                        await aclient.scale_stream(stream, merge=[live[0].number, live[1].number])
                await asyncio.sleep(0.003)
            for values, receipt in pending:
                positions.update(zip(values, await receipt, strict=True))
            assert producer.core.rerouted > 0

    asyncio.run(main())
    check_history(broker, client, stream, sent, positions)
    assert client.describe_stream(stream).epoch == 7


def test_a_transaction_open_across_scales_commits_every_event_once_in_order(
    client: slipstream.Client, broker: BrokerProcess
) -> None:
    """A scale waits for transactions that staged into its segments, so the events of these
    transactions are buffered (not staged) while another client scales: the commit stages
    them, is refused, and re-routes them inside the same transaction. The next transaction
    starts from this client's description of the stream, stale by then: refused again."""
    stream = "scp/txn"
    client.create_stream(stream, segments=2)
    sent: dict[str | None, list[bytes]] = defaultdict(list)
    rng = random.Random(5)
    with broker.client() as operator:
        for txn_round in range(3):
            with client.transaction(f"scp-{txn_round}", batch_bytes=1024 * 1024) as txn:
                for step in range(3):
                    for _ in range(300):
                        key = KEYS[rng.randrange(len(KEYS))]
                        value = b"%s:%d" % (key.encode(), len(sent[key]))
                        sent[key].append(value)
                        txn.send(stream, value, key=key)
                    info = operator.describe_stream(stream)
                    live = live_segments(info)
                    if step != 1 or len(live) < 2:
                        operator.scale_stream(stream, split=rng.choice(live).number)
                    else:
                        operator.scale_stream(stream, merge=[live[0].number, live[1].number])
                core = txn._core(stream)
            assert core.rerouted > 0 and core.failed == 0
    assert client.describe_stream(stream).epoch == 9
    check_history(broker, client, stream, sent, {})


def test_a_transaction_writing_again_to_a_segment_whose_scale_waits_for_it_commits(
    client: slipstream.Client, broker: BrokerProcess
) -> None:
    """The scale waits for the transaction (it staged into segment 0), and the sealing
    segment keeps taking that transaction's batches: it commits whole, into segment 0, before
    the seal; then the scale ends."""
    stream = "scp/txn-wait"
    client.create_stream(stream, segments=1)
    scaled: list[StreamInfo] = []
    with broker.client() as operator:
        txn = client.transaction("scp-wait", delivery_timeout=2)
        txn.send(stream, b"staged", key="a")
        txn.flush()
        scaler = threading.Thread(
            target=lambda: scaled.append(operator.scale_stream(stream, split=0))
        )
        scaler.start()
        for _ in range(50):  # staged while the scale waits for the transaction
            txn.send(stream, b"more", key="a")
            txn.flush()
            threading.Event().wait(0.01)
        assert not scaled  # still waiting
        txn.commit()
        scaler.join(30)
    assert scaled and scaled[0].epoch == 1 and scaled[0].segments[0].end_offset == 51
    with client.reader(stream, end=client.tail(stream)) as reader:
        assert [(e.segment, e.value) for e in reader] == [(0, b"staged")] + [(0, b"more")] * 50


def test_an_idempotent_producer_resending_after_a_kill_follows_a_scale_done_meanwhile(
    client: slipstream.Client, broker: BrokerProcess
) -> None:
    """kill -9 with batches in flight, a scale as soon as the broker is back: the producer's
    retries are stored once (answered with their offsets) or refused and re-routed, in
    order, whichever comes first."""
    stream = "scp/kill"
    client.create_stream(stream, segments=2)
    receipts: dict[bytes, slipstream.Receipt] = {}
    sent: dict[str | None, list[bytes]] = defaultdict(list)
    stop = threading.Event()
    with broker.client() as writer, writer.producer(stream, linger_ms=2) as producer:

        def produce() -> None:
            for i in itertools.count():
                if stop.is_set():
                    return
                key = KEYS[(i * 5) % len(KEYS)]
                value = b"%s:%d" % (key.encode(), len(sent[key]))
                sent[key].append(value)
                receipts[value] = producer.send(value, key=key)
                if i % 50 == 0:
                    threading.Event().wait(0.001)

        thread = threading.Thread(target=produce)
        thread.start()
        try:
            for _ in range(3):
                threading.Event().wait(0.2)
                broker.restart()
                with broker.client() as operator:
                    info = operator.describe_stream(stream)
                    operator.scale_stream(stream, split=live_segments(info)[0].number)
        finally:
            stop.set()
            thread.join(60)
    positions = {value: receipt.result() for value, receipt in receipts.items()}
    assert producer.core.failed == 0 and producer.core.rerouted > 0
    assert producer.acknowledged == sum(len(v) for v in sent.values())
    check_history(broker, client, stream, sent, positions)


def test_send_many_routed_just_before_a_re_route_goes_to_the_successors(
    client: slipstream.Client, broker: BrokerProcess
) -> None:
    """``send_many`` routes its keys before it takes the producer's lock; a re-route in between
    (another thread's batch refused) must not let its batch reach the sealed segment after
    the same thread's next batch reached a successor. Simulated by handing it the router from
    before the scale."""
    stream = "scp/stale"
    client.create_stream(stream, segments=1)
    sent: dict[str | None, list[bytes]] = defaultdict(list)
    positions: dict[bytes, slipstream.Position] = {}

    def batch_of(round_: int) -> tuple[list[bytes], list[str]]:
        keys = [KEYS[(round_ * 3 + i) % len(KEYS)] for i in range(200)]
        values = []
        for key in keys:
            values.append(b"%s:%d" % (key.encode(), len(sent[key])))
            sent[key].append(values[-1])
        return values, keys

    with client.producer(stream, linger_ms=50) as producer:
        stale = producer.core.router
        client.scale_stream(stream, split=0, into=3)
        values, keys = batch_of(0)
        positions.update(zip(values, producer.send_many(values, keys=keys).result(), strict=True))
        assert producer.core.rerouted == 200 and producer.core.router is not stale
        receipts = []
        for round_ in range(1, 6):
            current = producer.core.router
            producer.core.router = stale  # as read by a thread just before the re-route
            values, keys = batch_of(round_)
            receipts.append((values, producer.send_many(values, keys=keys)))
            producer.core.router = current
            values, keys = batch_of(round_ + 100)
            receipts.append((values, producer.send_many(values, keys=keys)))
        for values, receipt in receipts:
            positions.update(zip(values, receipt.result(), strict=True))
    check_history(broker, client, stream, sent, positions)

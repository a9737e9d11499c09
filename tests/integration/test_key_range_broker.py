"""The key-range check on a real broker: an append holding a key whose hash the segment does not
own is refused with ``key_out_of_range`` and nothing of it is stored (nor does an idempotent
producer's sequence move); a producer whose view of the segments is stale (a scale through
another client between its describe and its appends) or wrong (a router that sends keys to the
wrong open segments, like a buggy client) ends up with every event once, in the segment that
owns its key, each key's events in send order."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
from conftest import BrokerProcess
from raw import RawConnection

import slipstream
from slipstream.format import (
    binary_array,
    encode_body,
    encode_header,
    make_record_batch,
    timestamp_array,
)
from slipstream.protocol import (
    Append,
    AppendAck,
    BeginTxn,
    Error,
    InitProducer,
    ProducerGrant,
    TxnBegun,
)
from slipstream.streams import KEY_SPACE, Router, key_hash

HALF = KEY_SPACE // 2
LOW = [k for k in (b"k%d" % i for i in range(200)) if key_hash(k) < HALF][:20]  # segment 0's
HIGH = [k for k in (b"k%d" % i for i in range(200)) if key_hash(k) >= HALF][:20]  # segment 1's


def keyed_batch(keys: list[bytes | None], **producer: int) -> bytes:
    count = len(keys)
    record = make_record_batch(
        binary_array(keys),
        binary_array([b"v%d" % i for i in range(count)]),
        timestamp_array(np.arange(count)),
    )
    body = encode_body(record)
    head = encode_header(
        body, event_count=count, min_timestamp=0, max_timestamp=count - 1, **producer
    )
    return head + body.to_pybytes()


def ask(connection: RawConnection, message: object, cid: int, payload: bytes = b"") -> object:
    connection.send_frame(message, cid, payload)
    frame = connection.receive()
    assert frame.correlation_id == cid
    return frame.message


def test_an_append_of_a_key_the_segment_does_not_own_is_refused_and_stores_nothing(
    client: slipstream.Client, broker: BrokerProcess
) -> None:
    client.create_stream("kr/a", segments=2)
    connection = RawConnection(broker.address)
    try:
        connection.receive()
        grant = ask(connection, InitProducer(None), 2)
        assert isinstance(grant, ProducerGrant)
        ids = {"producer_id": grant.producer_id, "producer_epoch": grant.epoch}
        # one key of the other half among segment 0's own: the whole batch is refused
        wrong = keyed_batch([LOW[0], HIGH[0], LOW[1], None], **ids, sequence=0)
        error = ask(connection, Append("kr/a", 0), 3, wrong)
        assert isinstance(error, Error) and error.code == "key_out_of_range"
        assert error.details == {
            "stream": "kr/a",
            "segment": 0,
            "key_lo": 0,
            "key_hi": HALF - 1,
            "key_hash": key_hash(HIGH[0]),
            "outside": 1,
        }
        assert "describe the stream again" in error.message
        plain = ask(connection, Append("kr/a", 1), 4, keyed_batch(LOW[:3]))
        assert isinstance(plain, Error) and plain.code == "key_out_of_range"
        assert plain.details["outside"] == 3 and plain.details["key_lo"] == HALF
        begun = ask(connection, BeginTxn(-1, 0, 60_000), 5)
        assert isinstance(begun, TxnBegun)
        staged = ask(connection, Append("kr/a", 1, begun.txn_id), 6, keyed_batch([LOW[2]]))
        assert isinstance(staged, Error) and staged.code == "key_out_of_range"
        assert client.tail("kr/a").positions == {0: 0, 1: 0}  # nothing stored
        # the refused batch did not take sequence 0: the producer's next batch there has it
        right = keyed_batch([LOW[0], LOW[1], None], **ids, sequence=0)
        assert ask(connection, Append("kr/a", 0), 7, right) == AppendAck(0, 3)
        assert ask(connection, Append("kr/a", 1), 8, keyed_batch([None, HIGH[1]])) == AppendAck(
            0, 2
        )
    finally:
        connection.close()
    with client.reader("kr/a", end=client.tail("kr/a")) as reader:
        stored = sorted((e.segment, e.offset, e.key) for e in reader)
    assert stored == [(0, 0, LOW[0]), (0, 1, LOW[1]), (0, 2, None), (1, 0, None), (1, 1, HIGH[1])]


def check_placed(
    client: slipstream.Client, stream: str, sent: dict[bytes, list[bytes]]
) -> list[slipstream.Event]:
    """Every sent event once, in the open or sealed segment whose range holds its key's hash,
    each key's events in send order (read through the segment graph)."""
    ranges = {s.number: (s.key_lo, s.key_hi) for s in client.describe_stream(stream).segments}
    by_key: dict[bytes, list[bytes]] = defaultdict(list)
    with client.reader(stream, end=client.tail(stream)) as reader:
        events = list(reader)
    for event in events:
        assert event.key is not None
        lo, hi = ranges[event.segment]
        assert lo <= key_hash(event.key) <= hi, f"{event.key!r} stored in segment {event.segment}"
        by_key[event.key].append(event.value)
    assert dict(by_key) == sent
    return events


def test_a_producer_whose_view_went_stale_puts_every_event_in_its_segment_in_order(
    client: slipstream.Client, broker: BrokerProcess
) -> None:
    client.create_stream("kr/stale", segments=2)
    sent: dict[bytes, list[bytes]] = defaultdict(list)
    keys = LOW[:8] + HIGH[:8]
    with (
        broker.client() as other,
        client.producer("kr/stale", linger_ms=1, max_in_flight=4) as producer,
    ):
        for i in range(200):  # described and routed before the scale
            key = keys[i % len(keys)]
            sent[key].append(b"%d" % i)
            producer.send(b"%d" % i, key=key)
        producer.flush()
        other.scale_stream("kr/stale", split=0, into=3)  # between this describe and the sends
        other.scale_stream("kr/stale", merge=[4, 1])
        for i in range(200, 1200):
            key = keys[(i * 7) % len(keys)]
            sent[key].append(b"%d" % i)
            producer.send(b"%d" % i, key=key)
        producer.flush()
        assert producer.core.rerouted > 0
    assert len(check_placed(client, "kr/stale", dict(sent))) == 1200


def test_a_producer_routing_keys_to_the_wrong_open_segments_recovers_by_itself(
    client: slipstream.Client, broker: BrokerProcess
) -> None:
    """A router that sends each half's keys to the other half's open segment (what a buggy
    client or an inconsistent view would do): every batch is refused with KeyOutOfRange, the
    producer describes again, re-splits and resends; idempotent sequences stay gap-free."""
    client.create_stream("kr/wrong", segments=2)
    sent: dict[bytes, list[bytes]] = defaultdict(list)
    keys = LOW[:6] + HIGH[:6]
    with client.producer("kr/wrong", linger_ms=1, max_in_flight=4) as producer:
        producer.core.router = Router([(1, 0, HALF - 1), (0, HALF, KEY_SPACE - 1)])  # swapped
        for i in range(600):
            key = keys[(i * 5) % len(keys)]
            sent[key].append(b"%d" % i)
            producer.send(b"%d" % i, key=key)
            if i % 150 == 149:
                producer.flush()
        producer.flush()
        assert producer.core.rerouted > 0 and producer.core.failed == 0
    events = check_placed(client, "kr/wrong", dict(sent))
    assert len(events) == 600
    assert {e.segment for e in events} == {0, 1}


def test_batches_in_flight_behind_a_refused_one_are_resent_in_order_without_gaps(
    client: slipstream.Client, broker: BrokerProcess
) -> None:
    """A router wrong for a quarter of the key space only: segment 1 gets batches mixing a key
    it does not own with keys it does. Its batches sent behind a refused one, all keys its
    own, are refused too (their sequence is past the one it expects); the producer re-splits
    them with the refused one, rewinds the segment's sequence and re-splits what it buffers,
    so every event lands once, in its segment, in order."""
    client.create_stream("kr/behind", segments=2)
    quarter = HALF // 2
    wrong = [k for k in (b"w%d" % i for i in range(400)) if key_hash(k) < quarter][:3]
    keys = [*wrong, *HIGH[:5]]
    sent: dict[bytes, list[bytes]] = defaultdict(list)
    pad = b"x" * 2000  # two events a batch: many batches in flight at once
    with client.producer("kr/behind", linger_ms=20, batch_bytes=4096, max_in_flight=8) as producer:
        producer.core.router = Router(
            [(1, 0, quarter - 1), (0, quarter, HALF - 1), (1, HALF, KEY_SPACE - 1)]
        )
        for i in range(800):
            # the first 40 correctly routed and flushed: the segment knows the producer, so it
            # refuses every batch behind a refused one (an unknown producer starts anywhere)
            key = HIGH[i % 5] if i < 40 else keys[i % len(keys)]
            value = b"%d:" % i + pad
            sent[key].append(value)
            producer.send(value, key=key)
            if i == 39:
                producer.flush()
        producer.flush()
        assert producer.core.rerouted > 0 and producer.core.failed == 0
    events = check_placed(client, "kr/behind", dict(sent))
    assert len(events) == 800

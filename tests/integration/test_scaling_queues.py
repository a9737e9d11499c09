"""Work queues over a scaled stream: a key_ordered_queue hands out a successor's events only
after every predecessor is settled to its end (one event of a key out at a time, in order,
across the split); a plain queue reads every segment at once and loses nothing."""

from __future__ import annotations

from test_queues import produce, queue_consumer, quiet, take

import slipstream


def test_key_ordered_queue_keeps_one_event_per_key_in_order_across_a_split(
    client: slipstream.Client,
) -> None:
    client.create_stream("qs/split", segments=1)
    client.create_subscription("qs/split", "work", mode="key_ordered_queue")
    produce(client, "qs/split", 3, lambda i: "k")
    with queue_consumer(client, "qs/split", "work") as consumer:
        held = take(consumer, 1)  # key k's first event, not acknowledged yet
        assert (held[0].segment, held[0].offset) == (0, 0)
        client.scale_stream("qs/split", split=0)
        produce(client, "qs/split", 3, lambda i: "k")  # into a successor
        assert quiet(consumer, 1.0) == []  # key k's event 0 is still out
        held[0].ack()
        order = []
        while len(order) < 5:
            for event in take(consumer, 1):
                order.append((event.segment, event.offset))
                assert quiet(consumer, 0.3) == []  # one event of the key at a time
                event.ack()
        assert order[:2] == [(0, 1), (0, 2)]  # the predecessor's rest first
        assert len({s for s, _ in order[2:]}) == 1 and [o for _, o in order[2:]] == [0, 1, 2]


def test_a_plain_queue_takes_every_segment_of_every_epoch(client: slipstream.Client) -> None:
    client.create_stream("qs/plain", segments=1)
    client.create_subscription("qs/plain", "work", mode="queue")
    produce(client, "qs/plain", 20, lambda i: f"k{i}")
    client.scale_stream("qs/plain", split=0, into=3)
    produce(client, "qs/plain", 30, lambda i: f"k{i}")
    with queue_consumer(client, "qs/plain", "work") as consumer:
        events = take(consumer, 50)
        for event in events:
            event.ack()
        consumer.flush_acks()
    assert {e.segment for e in events} >= {0} and len({(e.segment, e.offset) for e in events}) == 50
    described = client.describe_subscription("qs/plain", "work")
    assert sum(s.backlog_events for s in described.segments) == 0

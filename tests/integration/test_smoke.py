"""The happy path of the public API against a real broker process."""

from __future__ import annotations

import slipstream


def test_produce_then_read_back_in_order(client: slipstream.Client) -> None:
    client.create_stream("demo/orders", segments=4)
    with client.producer("demo/orders") as producer:
        receipts = [producer.send(f"v{i}".encode(), key=f"user-{i % 7}") for i in range(500)]
    positions = [r.result() for r in receipts]
    end = client.tail("demo/orders")
    events = list(client.reader("demo/orders", start="earliest", end=end))
    assert len(events) == 500
    by_position = {(e.segment, e.offset): e for e in events}
    for i, position in enumerate(positions):
        event = by_position[(position.segment, position.offset)]
        assert event.value == f"v{i}".encode()
        assert event.key == f"user-{i % 7}".encode()

"""A work-queue member for tests/faults/test_queue_faults.py, killed -9 at random.

``queue_worker.py ADDRESS STREAM SUBSCRIPTION RECORDS`` consumes until killed. Each event is
"processed" for a few milliseconds, then acknowledged; an event whose value starts with
``poison`` is always nacked (it must end in the dead-letter stream). Every line written to
RECORDS (flushed at once, so a kill -9 loses nothing written) is one of::

    D segment offset key deliveries t_received             a delivery
    T segment offset                                       an ack about to be flushed
    A segment offset key t_received t_acked                an ack that took effect
    U segment offset                                       an ack the broker did not hold
    ? segment offset                                       an ack whose outcome is unknown

A ``T`` without its ``A``, ``U`` or ``?`` (killed while flushing) is an unknown outcome too.

Times are ``time.monotonic()`` (system-wide on Linux: comparable between processes).
"""

from __future__ import annotations

import random
import sys
import time

import slipstream
from slipstream import QueueConsumer, SlipstreamError, UnknownDelivery


def main() -> None:
    address, stream, subscription, path = sys.argv[1:5]
    records = open(path, "a", buffering=1)  # noqa: SIM115 - open for the life of the process
    client = slipstream.connect(address, reconnect_timeout=60.0)
    consumer = client.consumer(stream, subscription, max_in_flight=8, session_timeout=3.0)
    assert isinstance(consumer, QueueConsumer)
    while True:
        events = consumer.poll(0.2)
        acked = []
        for event in events:
            received = time.monotonic()
            key = (event.key or b"-").decode()
            records.write(f"D {event.segment} {event.offset} {key} {event.deliveries} {received}\n")
            time.sleep(random.uniform(0.001, 0.006))
            if event.value.startswith(b"poison"):
                event.nack()
                continue
            event.ack()
            acked.append((event, key, received, time.monotonic()))
        if not acked:
            continue
        for event, *_ in acked:
            records.write(f"T {event.segment} {event.offset}\n")
        unknown: set[tuple[int, int]] = set()
        failed = False
        try:
            consumer.flush_acks()
        except UnknownDelivery as exc:
            unknown = {(s, o) for s, o in exc.details["deliveries"]}
        except SlipstreamError:
            failed = True  # the broker went away while answering: outcome unknown
        for event, key, received, at in acked:
            if failed:
                records.write(f"? {event.segment} {event.offset}\n")
            elif (event.segment, event.offset) in unknown:
                records.write(f"U {event.segment} {event.offset}\n")
            else:
                records.write(f"A {event.segment} {event.offset} {key} {received} {at}\n")


if __name__ == "__main__":
    main()

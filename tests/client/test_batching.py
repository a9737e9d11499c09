"""How the producer cuts batches, seen in what a real broker stores."""

from __future__ import annotations

import signal
import time

from conftest import BrokerProcess


def test_a_lingered_batch_keeps_growing_while_the_window_is_full(broker: BrokerProcess) -> None:
    """Past its linger time a batch is sent only when ``max_in_flight`` has room: while the
    broker holds the window's acknowledgement (stopped with SIGSTOP here), later events join
    one batch instead of queueing up as one small batch per linger period."""
    assert broker.proc is not None
    with broker.client() as client:
        client.create_stream("batching/window", segments=1)
        with client.producer("batching/window", linger_ms=1, max_in_flight=1) as producer:
            producer.send(b"first").result()  # connected and routed before the broker stops
            broker.proc.send_signal(signal.SIGSTOP)
            try:
                producer.send(b"held")  # nothing in flight: sent at once, fills the window
                time.sleep(0.2)
                for burst in range(3):
                    for i in range(20):
                        producer.send(b"%d-%d" % (burst, i))
                    time.sleep(0.2)  # many linger periods: the old rule sealed a batch each
            finally:
                broker.proc.send_signal(signal.SIGCONT)
            producer.flush()
        batches = client.reader("batching/window", end=client.tail("batching/window")).batches()
        rows = [b.num_rows for b in batches]
        # "first"; "held" (the window); the 60 in one batch. The old rule: a batch per burst
        # at least, [1, 1, 20, 20, 20] (or [1, 21, 20, 20] if "held" waited for burst 0).
        assert sum(rows) == 62
        assert rows[0] == 1
        assert len(rows) <= 3, rows

"""A consume-transform-produce process for test_cluster_ctp.py (killed with SIGKILL, paused).

    PYTHONPATH=tests/cluster python tests/cluster/ctp_worker.py BROKERS INPUT OUTPUT
        SUBSCRIPTION TRANSACTIONAL_ID RUN SESSION_TIMEOUT_S [--final]

Writes ``out:<input value>`` to OUTPUT for each input event, in a transaction of
TRANSACTIONAL_ID that also commits the consumer's positions (``txn.commit_position``). The
test picks the ids so that the transaction and the group are coordinated by different brokers.
A failed transaction (a broker killed, the member fenced) is abandoned and the consumer starts
again from the committed positions, as an application would; it prints ``committed N`` or
``abandoned: ErrorType message`` for each. With ``--final`` it exits 0 once the subscription
has no backlog left (nobody produces any more); without it, it runs until killed.
"""

from __future__ import annotations

import sys
import time

import slipstream


def drained(client: slipstream.Client, stream: str, subscription: str) -> bool:
    info = client.describe_subscription(stream, subscription)
    return sum(s.backlog_events for s in info.segments) == 0


def main() -> int:
    brokers, source, sink, subscription, transactional_id, run, timeout = sys.argv[1:8]
    final = "--final" in sys.argv[8:]
    client = slipstream.connect(brokers, reconnect_timeout=60)
    while True:
        consumer = None
        try:
            consumer = client.consumer(
                source, subscription, commit="manual", name=run, session_timeout=float(timeout)
            )
            while True:
                events = consumer.poll(0.5)
                if not events:
                    if final and drained(client, source, subscription):
                        consumer.close()
                        client.close()
                        return 0
                    continue
                with client.transaction(transactional_id, timeout=30) as txn:
                    for event in events:
                        txn.send(sink, b"out:" + event.value, key=event.key)
                    txn.commit_position(consumer)
                print("committed", len(events), flush=True)
        except slipstream.SlipstreamError as exc:
            print("abandoned:", type(exc).__name__, exc, flush=True)
            if consumer is not None:
                consumer.close()
            time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(main())

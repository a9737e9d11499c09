"""Producer processes for test_cluster_faults.py: load on a cluster whose brokers fail.

    PYTHONPATH=tests python tests/cluster/producer_worker.py idempotent BROKERS STREAM ID ACKS
    PYTHONPATH=tests python tests/cluster/producer_worker.py transactional BROKERS STREAM ID ACKS

``BROKERS`` is the bootstrap list ("h1:p1,h2:p2"). Both run until SIGTERM, then wait for what
is in flight (at most the producer's 120 s delivery timeout) and exit 0.

``idempotent``: sends ``checker.Sent`` values keyed ``p<ID>-k<n>`` and writes one
``checker.Ack`` line per acknowledged event (value and position) to ACKS, flushed at once,
and one ``checker.Ack`` with ``error`` set per event whose send failed (in doubt: it may or
may not be stored, but at most once). After a failure it opens a new producer (a new
producer id on the broker) and goes on with the next sequence numbers, ``Sent.producer``
staying ``ID``: a failed event is never sent again, so a value found twice is a duplicate
made by the cluster, and one in doubt read after a later sequence number of its key was
written late (by a broker that had lost its containers, say).

``transactional``: transaction after transaction (transactional id ``tx<ID>``), each sending
``checker.TxnPart`` values ``0..parts-1`` keyed ``k<part>`` (over several segments) and
writing one ``checker.TxnOutcome`` line after the commit returned (``committed``) or failed
(in doubt: all of it or none may be visible, never a part).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
import time

from checker import Ack, Sent, TxnOutcome, TxnPart, encode, encode_record

import slipstream

KEYS = 8
PARTS = 6
MAX_PENDING = 2000


def connect(brokers: str) -> slipstream.Client:
    """A client, waiting for a broker of the list to answer (a first connect does not)."""
    deadline = time.monotonic() + 120
    while True:
        try:
            return slipstream.connect(brokers, reconnect_timeout=120)
        except slipstream.BrokerUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def idempotent(args: argparse.Namespace, stop: threading.Event) -> None:
    client = connect(args.brokers)
    lives = 0
    seq = 0
    with open(args.acks, "ab") as out:

        def write(ack: Ack) -> None:
            out.write(encode_record(ack) + b"\n")
            out.flush()

        while not stop.is_set():
            lives += 1
            try:
                producer = client.producer(
                    args.stream, linger_ms=5, batch_bytes=64 * 1024, delivery_timeout=120
                )
            except slipstream.SlipstreamError as exc:  # no broker answers yet: try again
                print(f"no producer: {type(exc).__name__}: {exc}", flush=True)
                time.sleep(0.2)
                continue
            pending: list[tuple[bytes, slipstream.Receipt]] = []
            failed = False
            while not failed:
                if not stop.is_set() and len(pending) < MAX_PENDING:
                    for _ in range(10):
                        key = f"p{args.id}-k{seq % KEYS}"
                        value = encode(Sent(args.id, key, seq))
                        pending.append((value, producer.send(value, key=key)))
                        seq += 1
                elif stop.is_set() and not pending:
                    break
                # acknowledgements come in order per key; record each as soon as it is done
                still: list[tuple[bytes, slipstream.Receipt]] = []
                for value, receipt in pending:
                    if not receipt.done():
                        still.append((value, receipt))
                        continue
                    try:
                        position = receipt.result()
                    except slipstream.SlipstreamError as exc:
                        write(Ack(value.decode(), error=f"{type(exc).__name__}: {exc}"))
                        failed = True
                    else:
                        write(Ack(value.decode(), position.segment, position.offset))
                pending = still
                if failed:
                    for value, _ in pending:  # its later sends are abandoned with it
                        write(Ack(value.decode(), error="abandoned after a failure"))
                    print(f"producer {args.id} life {lives} failed; a new one goes on", flush=True)
                    time.sleep(0.2)  # the cluster is moving: do not spin on new producers
                time.sleep(0.01)
            with contextlib.suppress(slipstream.SlipstreamError):
                producer.close()
            if stop.is_set() and not failed:
                break
    client.close()


def transactional(args: argparse.Namespace, stop: threading.Event) -> None:
    client = connect(args.brokers)
    number = 0
    with open(args.acks, "ab") as out:
        while not stop.is_set():
            name = f"{args.id}-{number}"
            number += 1
            try:
                with client.transaction(f"tx{args.id}", timeout=60) as txn:
                    for part in range(PARTS):
                        value = encode_record(TxnPart(name, part, PARTS))
                        txn.send(args.stream, value, key=f"k{part}")
            except slipstream.SlipstreamError as exc:
                outcome = TxnOutcome(name, False, f"{type(exc).__name__}: {exc}")
                print("in doubt:", outcome.error, flush=True)
                time.sleep(0.1)
            else:
                outcome = TxnOutcome(name, True)
            out.write(encode_record(outcome) + b"\n")
            out.flush()
    client.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=["idempotent", "transactional"])
    parser.add_argument("brokers")
    parser.add_argument("stream")
    parser.add_argument("id", type=int)
    parser.add_argument("acks")
    args = parser.parse_args()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    (idempotent if args.kind == "idempotent" else transactional)(args, stop)


if __name__ == "__main__":
    sys.exit(main())

"""Consumer processes for test_consumer_faults.py, which kills them with SIGKILL at random.

    PYTHONPATH=tests python tests/faults/consumer_worker.py member BROKER STREAM SUBSCRIPTION
        RUN auto|manual RECORDS [--final]
    PYTHONPATH=tests python tests/faults/consumer_worker.py transform BROKER INPUT OUTPUT
        SUBSCRIPTION RUN [--final]

``member``: one member of the subscription's group. It writes every event it is handed to
RECORDS (``group_checker.Delivery``, one JSON line, flushed before it asks for the next batch)
and, with ``manual``, commits after most batches and writes each acknowledged commit
(``group_checker.Committed``). ``transform``: a consume-transform-produce loop that writes
``out:<input value>`` to OUTPUT for each input event, in a transaction that also commits the
consumer's position (``txn.commit_position``); a failed transaction (a broker restart aborts
it) is abandoned and the consumer starts again from the committed positions, as an
application would.

With ``--final`` either exits 0 once the subscription has no backlog left (nobody produces
any more); without it, both run until killed.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from group_checker import Committed, Delivery, encode

import slipstream
from slipstream.format import events_of

#: a member that commits fails with one of these when its segment moved or the broker
#: restarted: the next holder starts from the last commit, so it just goes on
RETRIED = (
    slipstream.NotAssigned,
    slipstream.UnknownMember,
    slipstream.StaleGeneration,
    slipstream.BrokerUnavailable,
)


def connect(address: str) -> slipstream.Client:
    """A client, waiting for the broker if it is restarting (a first connect does not)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return slipstream.connect(address, reconnect_timeout=60)
        except slipstream.BrokerUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def drained(client: slipstream.Client, stream: str, subscription: str) -> bool:
    info = client.describe_subscription(stream, subscription)
    return sum(s.backlog_events for s in info.segments) == 0


def member(args: argparse.Namespace) -> None:
    rng = random.Random(args.run)
    client = connect(args.broker)
    while True:
        try:
            consumer = client.consumer(
                args.stream,
                args.subscription,
                commit=args.commit,
                name=args.run,
                session_timeout=30,
            )
            break
        except slipstream.BrokerUnavailable:  # it restarts: join when it is back
            time.sleep(0.2)
    grants: dict[object, int] = {}  # the consumer's lease objects (one per grant) -> number
    with open(args.records, "ab") as out:
        while True:
            # Consumer.__iter__ without its last step: the lease says which grant a batch is of
            records = consumer._next_records(0.5)
            assert records is not None, "closed"
            for lease, base, batch in records:
                grant = grants.setdefault(lease, len(grants) + 1)
                for event in events_of(batch, lease.segment, base):
                    delivery = Delivery(
                        args.run,
                        grant,
                        lease.start,
                        event.segment,
                        event.offset,
                        (event.key or b"").decode(),
                        event.value.decode(),
                        time.time(),
                    )
                    out.write(encode(delivery) + b"\n")
                    out.flush()
            if records and args.commit == "manual" and (args.final or rng.random() < 0.7):
                positions = consumer.positions()
                try:
                    consumer.commit(positions)
                except RETRIED:
                    continue
                out.write(encode(Committed(args.run, positions, time.time())) + b"\n")
                out.flush()
            if not records and args.final and drained(client, args.stream, args.subscription):
                consumer.close()
                client.close()
                return


def transform(args: argparse.Namespace) -> None:
    client = connect(args.broker)
    while True:
        consumer = None
        try:
            consumer = client.consumer(
                args.input, args.subscription, commit="manual", name=args.run, session_timeout=30
            )
            while True:
                events = consumer.poll(0.5)
                if not events:
                    if args.final and drained(client, args.input, args.subscription):
                        consumer.close()
                        client.close()
                        return
                    continue
                with client.transaction("transformer", timeout=30) as txn:
                    for event in events:
                        txn.send(args.output, b"out:" + event.value, key=event.key)
                    txn.commit_position(consumer)
                print("committed", len(events), flush=True)
        except slipstream.SlipstreamError as exc:
            print("abandoned:", type(exc).__name__, exc, flush=True)
            if consumer is not None:
                consumer.close()
            time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("member")
    for name in ("broker", "stream", "subscription", "run"):
        one.add_argument(name)
    one.add_argument("commit", choices=["auto", "manual"])
    one.add_argument("records")
    one.add_argument("--final", action="store_true")
    loop = commands.add_parser("transform")
    for name in ("broker", "input", "output", "subscription", "run"):
        loop.add_argument(name)
    loop.add_argument("--final", action="store_true")
    args = parser.parse_args()
    member(args) if args.command == "member" else transform(args)


if __name__ == "__main__":
    sys.exit(main())

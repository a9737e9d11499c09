"""The torture harness's client processes: producers and readers that write down everything.

Run as ``python -m slipstream.torture._workers ROLE ...`` by the harness, one process each, so
that a broker fault hits them the way it hits real applications (their own event loops,
sockets and timeouts). Each survives every fault it can: on an error it records what it knows,
drops its client and connects again. Each stops when the stop file appears (the harness kills
whatever is still running later).

Roles:

``plain``
    A producer without idempotence: a failed batch is recorded as failed, never resent.
``idempotent``
    The default producer: the client resends unacknowledged batches after a reconnect and the
    broker must store each once. After a failure it gives up on, the worker starts a new
    producer (a new *incarnation*).
``transactional``
    Transactions of 1 to ``MAX_ROUND`` events over the stream's segments; one in five is
    aborted on purpose. A commit whose answer is lost is resolved with ``last_commit`` (the
    commit metadata names the transaction) or recorded as of unknown outcome. After an error
    the client usually reconnects and carries on; one time in four it is replaced, as by an
    application restart (a newer epoch fences the old one).
``tail``
    Follows the stream from the earliest event, reconnecting where it stopped.
``history``
    Reads random ranges of history (from a random position per segment to the tail).
``verify``
    Reads the whole stream once, earliest to tail, and exits (0: done, 3: could not).

A CorruptData error is recorded with its segment, offset and resume offset; the reader goes on
after it (at the resume offset, else one offset later).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import slipstream

from ._records import (
    KEYS,
    MAX_ROUND,
    REQUEST_TIMEOUT,
    Ack,
    Damage,
    Note,
    Read,
    RecordWriter,
    Round,
    TxnBegin,
    TxnEnd,
    event_id,
    event_key,
    event_value,
)

CONNECT_TIMEOUT = 3.0
RESULT_TIMEOUT = 90.0  # longest wait for one round's acknowledgements
HISTORY_SPAN = 2000


class _Worker:
    def __init__(self, args: argparse.Namespace) -> None:
        self.address: str = args.address
        self.stream: str = args.stream
        self.worker: int = args.id
        self.stop_file = Path(args.stop_file)
        self.rng = random.Random(args.seed)
        self.pause: float = args.pause
        self.out = RecordWriter(Path(args.out))
        self.client: slipstream.Client | None = None

    def stopping(self) -> bool:
        return self.stop_file.exists()

    def note(self, message: str) -> None:
        self.out.write(Note(message[:300], time.time()))

    def connect(self) -> slipstream.Client:
        while self.client is None:
            try:
                self.client = slipstream.connect(
                    self.address, timeout=CONNECT_TIMEOUT, reconnect_timeout=60.0
                )
            except slipstream.SlipstreamError as exc:
                self.note(f"connect: {exc!r}")
                if self.stopping():
                    raise SystemExit(0) from None
                time.sleep(0.2)
        return self.client

    def drop_client(self) -> None:
        """Close the client in the background: its unacknowledged batches fail, and a close
        that hangs on a stopped broker does not hang the worker."""
        client, self.client = self.client, None
        if client is not None:
            closer = threading.Thread(target=_quiet_close, args=(client,), daemon=True)
            closer.start()
            closer.join(5)

    def rest(self) -> None:
        if self.pause:
            time.sleep(self.rng.uniform(0, self.pause))


def _quiet_close(client: slipstream.Client) -> None:
    with contextlib.suppress(Exception):
        client.close()


def run_producer(worker: _Worker, idempotent: bool) -> None:
    kind = "idempotent" if idempotent else "plain"
    seq, incarnation = 0, 0
    producer: slipstream.Producer | None = None
    while not worker.stopping():
        client = worker.connect()
        if producer is None:
            try:
                producer = client.producer(
                    worker.stream,
                    idempotent=idempotent,
                    linger_ms=2,
                    request_timeout=REQUEST_TIMEOUT,
                    delivery_timeout=60.0,
                )
            except slipstream.SlipstreamError as exc:
                worker.note(f"producer: {exc!r}")
                worker.drop_client()
                time.sleep(0.2)
                continue
            incarnation += 1
        count = worker.rng.randint(1, MAX_ROUND)
        keys = [worker.rng.randrange(KEYS) for _ in range(count)]
        worker.out.write(Round(worker.worker, kind, incarnation, seq, count, time.time()))
        receipts: list[slipstream.Receipt] = []
        error = ""
        try:
            for i, key in enumerate(keys):
                value = event_value(worker.worker, seq + i, key)
                receipts.append(producer.send(value, key=event_key(worker.worker, key)))
        except slipstream.SlipstreamError as exc:
            error = repr(exc)
        positions: list[tuple[int, int] | None] = []
        for receipt in receipts:
            try:
                position = receipt.result(RESULT_TIMEOUT)
                positions.append((position.segment, position.offset))
            except Exception as exc:  # a typed error, or no answer in time: not acknowledged
                positions.append(None)
                error = error or repr(exc)
        positions += [None] * (count - len(positions))
        worker.out.write(Ack(worker.worker, seq, positions, error[:300]))
        seq += count
        if error:
            producer = None
            worker.drop_client()
        worker.rest()


# After a passing error the transactional client usually carries on (it reconnects and keeps
# its producer epoch); sometimes it is replaced, like a restarted application: the new client
# takes the transactional id over with a newer epoch, fencing the old one.
_PASSING = ("BrokerUnavailable(", "TransactionAborted(", "StorageFull(", "BrokerShuttingDown(")
APPLICATION_RESTARTS = 0.25


def run_transactional(worker: _Worker) -> None:
    transactional_id = f"torture-{worker.worker}"
    seq, number = 0, 0
    while not worker.stopping():
        client = worker.connect()
        number += 1
        count = worker.rng.randint(1, MAX_ROUND)
        keys = [worker.rng.randrange(KEYS) for _ in range(count)]
        abort = worker.rng.random() < 0.2
        worker.out.write(TxnBegin(worker.worker, number, seq, count, abort, time.time()))
        end = _one_transaction(worker, client, transactional_id, number, seq, keys, abort)
        worker.out.write(end)
        seq += count
        if end.err and (
            not end.err.startswith(_PASSING) or worker.rng.random() < APPLICATION_RESTARTS
        ):
            worker.drop_client()
        worker.rest()


def _one_transaction(
    worker: _Worker,
    client: slipstream.Client,
    transactional_id: str,
    number: int,
    seq: int,
    keys: list[int],
    abort: bool,
) -> TxnEnd:
    commit_ts: float | None = None
    try:
        txn = client.transaction(transactional_id, timeout=30.0)
        for i, key in enumerate(keys):
            value = event_value(worker.worker, seq + i, key)
            txn.send(worker.stream, value, key=event_key(worker.worker, key))
        if abort:
            txn.abort()
            return TxnEnd(worker.worker, number, "aborted")
        txn.flush()  # a failure here is before the commit was asked: an abort
        commit_ts = time.time()
        ended = txn.commit(metadata={"txn": number})
    except slipstream.TransactionAborted as exc:
        return TxnEnd(worker.worker, number, "aborted", commit_ts, err=repr(exc)[:300])
    except slipstream.SlipstreamError as exc:
        if commit_ts is None:  # only a commit makes a transaction visible: it never will be
            return TxnEnd(worker.worker, number, "aborted", None, err=repr(exc)[:300])
        return TxnEnd(
            worker.worker,
            number,
            _resolve(worker, transactional_id, number),
            commit_ts,
            err=repr(exc)[:300],
        )
    ranges = [(r.segment, r.start, r.end) for r in ended.ranges]
    outcome = "committed" if ended.committed else "aborted"
    return TxnEnd(worker.worker, number, outcome, commit_ts, ranges)


def _resolve(worker: _Worker, transactional_id: str, number: int) -> str:
    """A commit whose answer was lost: committed if the id's last commit is this one."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not worker.stopping():
        try:
            last = worker.connect().last_commit(transactional_id)
        except slipstream.SlipstreamError as exc:
            worker.note(f"last_commit: {exc!r}")
            worker.drop_client()
            time.sleep(0.2)
            continue
        if last is not None and last.metadata == {"txn": number}:
            return "committed"
        return "unknown"
    return "unknown"


def _read(
    worker: _Worker,
    start: slipstream.StreamCut,
    end: slipstream.StreamCut | None,
    positions: dict[int, int],
) -> None:
    """Read from ``start`` (to ``end``), recording each batch and advancing ``positions``.
    A CorruptData error is recorded and ``positions`` moved past it."""
    client = worker.connect()
    try:
        for batch in client.reader(worker.stream, start=start, end=end).batches():
            segment = int(batch.column("segment")[0].as_py())
            offset = int(batch.column("offset")[0].as_py())
            keys = batch.column("key").to_pylist()
            values = batch.column("value").to_pylist()
            ids = [event_id(v, k) for k, v in zip(keys, values, strict=True)]
            worker.out.write(Read(segment, offset, ids, time.time()))
            positions[segment] = offset + len(ids)
    except slipstream.CorruptData as exc:
        segment, offset = int(exc.details["segment"]), int(exc.details["offset"])
        resume = exc.details.get("resume")
        # The report names the damaged batch's first offset, which may lie before where this
        # read began (a probe past the start of a damaged batch): the damage starts here.
        offset = max(offset, positions.get(segment, offset))
        worker.out.write(Damage(segment, offset, resume, exc.message[:300]))
        positions[segment] = int(resume) if resume is not None else offset + 1


def run_reader(worker: _Worker, role: str) -> int:
    positions: dict[int, int] | None = None
    failures = 0
    while not worker.stopping():
        try:
            client = worker.connect()
            tail = client.tail(worker.stream)
            if positions is None or role == "history":
                earliest = client.cut(worker.stream, "earliest").positions
                positions = dict(earliest)
                if role == "history":
                    positions = {
                        s: worker.rng.randint(o, max(o, tail.positions.get(s, o)))
                        for s, o in earliest.items()
                    }
            end = None if role == "tail" else tail
            if role == "history":  # a bounded replay: up to HISTORY_SPAN events a segment
                end = slipstream.StreamCut(
                    worker.stream,
                    {s: min(o, positions[s] + HISTORY_SPAN) for s, o in tail.positions.items()},
                )
            before = dict(positions)
            _read(worker, slipstream.StreamCut(worker.stream, positions), end, positions)
            if role == "verify" and all(
                positions.get(s, 0) >= o for s, o in tail.positions.items()
            ):
                return 0
            if role == "history" and positions == before:
                worker.rest()
        except slipstream.CorruptData:
            raise  # _read handles it; anything else escaping is a harness bug
        except slipstream.SlipstreamError as exc:
            worker.note(f"read: {exc!r}")
            worker.drop_client()
            failures += 1
            if role == "verify" and failures > 20:
                return 3
            time.sleep(0.2)
        if role == "history":
            worker.rest()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slipstream.torture._workers")
    parser.add_argument(
        "role", choices=["plain", "idempotent", "transactional", "tail", "history", "verify"]
    )
    parser.add_argument("--address", required=True)
    parser.add_argument("--stream", required=True)
    parser.add_argument("--id", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--stop-file", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pause", type=float, default=0.0, help="longest rest between rounds")
    args = parser.parse_args(argv)
    worker = _Worker(args)
    worker.note("ready")  # the harness starts its faults once every worker is up
    if args.role == "verify":
        return run_reader(worker, "verify")
    targets: dict[str, Callable[[], object]] = {
        "plain": lambda: run_producer(worker, idempotent=False),
        "idempotent": lambda: run_producer(worker, idempotent=True),
        "transactional": lambda: run_transactional(worker),
        "tail": lambda: run_reader(worker, "tail"),
        "history": lambda: run_reader(worker, "history"),
    }
    # The work runs in a daemon thread; this one watches the stop file, so a reader blocked on
    # a quiet stream (or a producer on a stopped broker) still ends when told.
    thread = threading.Thread(target=targets[args.role], daemon=True)
    thread.start()
    while thread.is_alive() and not worker.stopping():
        thread.join(0.2)
    thread.join(10)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())

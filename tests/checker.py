"""A history checker: verifies a whole run, not one example.

Producers record what the broker acknowledged; a reader reads everything back. The checker
verifies: every acknowledged event is present exactly at its acknowledged position with its
value; no value appears twice; offsets of every segment are contiguous from its start; events
of one key appear in the order they were sent.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path

import msgspec

import slipstream
from slipstream import Event, Position


class Sent(msgspec.Struct, frozen=True):
    """The value producers send: who sent it, its sequence number for the key, the key."""

    producer: int
    key: str
    seq: int


_decode = msgspec.json.Decoder(Sent).decode


def encode(sent: Sent) -> bytes:
    return msgspec.json.encode(sent)


def check_history(
    acknowledged: Mapping[bytes, Position],
    events: Iterable[Event],
    start_offsets: Mapping[int, int] | None = None,
) -> list[str]:
    """Return every violation found (empty list: the history is correct)."""
    problems: list[str] = []
    seen: dict[bytes, Position] = {}
    offsets: dict[int, list[int]] = defaultdict(list)
    last_seq: dict[tuple[int, str], int] = {}
    for event in events:
        position = Position(event.segment, event.offset)
        if event.value in seen:
            problems.append(f"duplicate {event.value!r} at {position} and {seen[event.value]}")
        seen[event.value] = position
        offsets[event.segment].append(event.offset)
        sent = _decode(event.value)
        if event.key != sent.key.encode():
            problems.append(f"{event.value!r} read with key {event.key!r}")
        previous = last_seq.get((sent.producer, sent.key))
        if previous is not None and sent.seq <= previous:
            problems.append(
                f"key {sent.key} of producer {sent.producer}: seq {sent.seq} after {previous}"
            )
        last_seq[(sent.producer, sent.key)] = sent.seq
    for value, position in acknowledged.items():
        if value not in seen:
            problems.append(f"acknowledged {value!r} at {position} is lost")
        elif seen[value] != position:
            problems.append(f"acknowledged {value!r} at {position} was read at {seen[value]}")
    for segment, found in offsets.items():
        first = (start_offsets or {}).get(segment, 0)
        if found != list(range(first, first + len(found))):
            problems.append(f"segment {segment}: offsets are not contiguous from {first}")
    return problems


def produce_and_record(
    address: str,
    stream: str,
    producer_id: int,
    acknowledged: dict[bytes, Position],
    lock: threading.Lock,
    stop: threading.Event,
    *,
    keys: int,
    per_round: int = 20,
    size: int = 0,
    linger_ms: int = 2,
    batch_bytes: int = 32 * 1024,
    pause: float = 0.002,
) -> None:
    """An idempotent producer that sends ``Sent`` values (padded with spaces to ``size``) and
    records every acknowledged position, until ``stop`` or the first failure: these tests are
    about what was acknowledged before a fault, so it gives up soon after one."""
    try:
        client = slipstream.connect(address, reconnect_timeout=0.5)
    except slipstream.BrokerUnavailable:
        return
    try:
        producer = client.producer(stream, linger_ms=linger_ms, batch_bytes=batch_bytes)
        seq = 0
        pending: list[tuple[bytes, slipstream.Receipt]] = []
        while not stop.is_set():
            for _ in range(per_round):
                key = f"p{producer_id}-k{seq % keys}"
                value = encode(Sent(producer_id, key, seq)).ljust(size)  # JSON allows spaces
                pending.append((value, producer.send(value, key=key)))
                seq += 1
            done = [(v, r) for v, r in pending if r.done()]
            pending = [(v, r) for v, r in pending if not r.done()]
            for value, receipt in done:
                try:
                    position = receipt.result()
                except slipstream.SlipstreamError:
                    return
                with lock:
                    acknowledged[value] = position
            time.sleep(pause)
    except slipstream.SlipstreamError:
        return
    finally:
        client.close()


# --- histories written to files by worker processes (tests/cluster) ---------------------------


class Ack(msgspec.Struct, frozen=True):
    """One line a producer process writes per event: its value and where the broker said it
    is, or ``error`` when its send failed (in doubt: stored once or not at all)."""

    value: str
    segment: int = -1
    offset: int = -1
    error: str = ""


class TxnPart(msgspec.Struct, frozen=True):
    """The value a transactional producer sends: part ``part`` of ``of`` of transaction
    ``txn`` ("<producer>-<number>", numbered in the order the producer began them)."""

    txn: str
    part: int
    of: int


class TxnOutcome(msgspec.Struct, frozen=True):
    """One line per transaction, written once its commit returned (``committed``) or failed
    (in doubt: all of it or nothing may be visible)."""

    txn: str
    committed: bool
    error: str = ""


encode_record = msgspec.json.encode


def _lines(paths: Iterable[Path]) -> Iterable[bytes]:
    """Every line of every file; a line cut by kill -9 (the last of its file) is skipped."""
    for path in paths:
        lines = path.read_bytes().split(b"\n")
        if lines[-1]:
            lines.pop()  # torn: written without its newline
        yield from (line for line in lines if line)


def read_acks(paths: Iterable[Path]) -> tuple[dict[bytes, Position], set[bytes]]:
    """The acknowledged values with their positions, and the values in doubt, from
    producers' ``Ack`` files."""
    decode = msgspec.json.Decoder(Ack).decode
    acknowledged: dict[bytes, Position] = {}
    in_doubt: set[bytes] = set()
    for line in _lines(paths):
        ack = decode(line)
        if ack.error:
            in_doubt.add(ack.value.encode())
        else:
            acknowledged[ack.value.encode()] = Position(ack.segment, ack.offset)
    return acknowledged, in_doubt


def read_outcomes(paths: Iterable[Path]) -> list[TxnOutcome]:
    decode = msgspec.json.Decoder(TxnOutcome).decode
    return [decode(line) for line in _lines(paths)]


def check_transactions(outcomes: Iterable[TxnOutcome], events: Iterable[Event]) -> list[str]:
    """Check what a read-committed reader saw of transactional producers' work; every
    violation found (empty: correct). A committed transaction is visible whole, exactly once;
    one in doubt whole or not at all; none partially; nothing no producer began; and the
    transactions of one producer in the order it committed them, per key."""
    problems: list[str] = []
    decode = msgspec.json.Decoder(TxnPart).decode
    parts: dict[str, list[int]] = defaultdict(list)
    sizes: dict[str, int] = {}
    last: dict[tuple[str, bytes | None], tuple[int, Position]] = {}
    for event in events:
        position = Position(event.segment, event.offset)
        try:
            part = decode(event.value)
        except msgspec.DecodeError:
            problems.append(f"{event.value!r} at {position} is no transaction's part")
            continue
        parts[part.txn].append(part.part)
        sizes[part.txn] = part.of
        producer, _, number = part.txn.rpartition("-")
        earlier = last.get((producer, event.key))
        if earlier is not None and earlier[0] > int(number):
            problems.append(
                f"producer {producer} key {event.key!r}: transaction {number} at {position} "
                f"after its transaction {earlier[0]} at {earlier[1]}"
            )
        last[(producer, event.key)] = (int(number), position)
    known = {outcome.txn: outcome for outcome in outcomes}
    for txn, found in parts.items():
        outcome = known.get(txn)
        if outcome is None:
            problems.append(f"transaction {txn} is visible but no producer recorded it")
        if sorted(found) != list(range(sizes[txn])):
            state = "unrecorded" if outcome is None else "in doubt"
            if outcome is not None and outcome.committed:
                state = "committed"
            problems.append(
                f"transaction {txn} ({state}) is partially visible or repeated: parts "
                f"{sorted(found)} of {sizes[txn]}"
            )
    for txn, outcome in known.items():
        if outcome.committed and txn not in parts:
            problems.append(f"committed transaction {txn} is lost")
    return problems

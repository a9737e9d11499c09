"""What the torture harness's processes write down, and the events they send.

Every worker process appends one JSON line per record to a file of its own, flushed as it
goes, so a worker killed mid-run leaves every record but at most a torn last line (which
``read_records`` skips). Nothing is kept in memory beyond the current round.

Event values are self-checking: ``w.s.k|`` (worker, sequence number, key index) followed by
padding derived from the id, of a length derived from the id. A reader that gets a value which
is not exactly ``event_value(w, s, k)`` has been served damaged data.

Records (the ``r`` field names the kind):

| kind    | written by        | meaning                                                        |
| ------- | ----------------- | -------------------------------------------------------------- |
| round   | producer          | about to send events ``first .. first+n-1`` (intent, before)   |
| ack     | producer          | their outcome: a position each, or null (failed, ``err``)      |
| txn     | txn producer      | a transaction of events ``first .. first+n-1`` begins          |
| txn_end | txn producer      | its outcome: committed, aborted or unknown; when commit began  |
| read    | reader / verifier | a batch read: segment, first offset, the event ids, wall time  |
| damage  | reader / verifier | the broker reported CorruptData: segment, offset, resume       |
| note    | anyone            | a free-text line for humans (reconnects, errors)               |
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import msgspec

KEYS = 16  # keys per producer: several events per key per second, on every segment
MAX_ROUND = 20  # events per round or transaction: a batch never holds more
REQUEST_TIMEOUT = 3.0  # seconds without an answer before a producer drops its connection


class Round(msgspec.Struct, tag="round", tag_field="r", omit_defaults=True):
    w: int
    kind: str  # "plain", "idempotent"
    inc: int  # producer incarnation (a new producer after a failure)
    first: int
    n: int
    ts: float


class Ack(msgspec.Struct, tag="ack", tag_field="r", omit_defaults=True):
    w: int
    first: int
    pos: list[tuple[int, int] | None]
    err: str = ""


class TxnBegin(msgspec.Struct, tag="txn", tag_field="r", omit_defaults=True):
    w: int
    txn: int
    first: int
    n: int
    abort: bool  # the worker means to abort it
    ts: float


class TxnEnd(msgspec.Struct, tag="txn_end", tag_field="r", omit_defaults=True):
    w: int
    txn: int
    outcome: str  # "committed", "aborted", "unknown"
    commit_ts: float | None = None  # wall time just before commit was asked (None: never)
    ranges: list[tuple[int, int, int]] = []  # (segment, start, end) of a committed one
    err: str = ""


class Read(msgspec.Struct, tag="read", tag_field="r", omit_defaults=True):
    seg: int
    off: int
    ids: list[str]  # "w.s.k", or "!<hex>" for a value that is not what any producer sent
    ts: float


class Damage(msgspec.Struct, tag="damage", tag_field="r", omit_defaults=True):
    seg: int
    off: int
    resume: int | None
    msg: str


class Note(msgspec.Struct, tag="note", tag_field="r", omit_defaults=True):
    msg: str
    ts: float = 0.0


Record = Round | Ack | TxnBegin | TxnEnd | Read | Damage | Note

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Record)


class RecordWriter:
    """Appends records to one file, a line each, written through at once (a kill loses at
    most the line being written)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[bytes] = open(path, "ab", buffering=0)  # noqa: SIM115 - closed in close()

    def write(self, record: Record) -> None:
        self._file.write(_encoder.encode(record) + b"\n")

    def close(self) -> None:
        self._file.close()


def read_records(path: Path) -> Iterator[Record]:
    """Every record of a file, in order; a torn or unreadable line (a process killed while
    writing it) is skipped."""
    with open(path, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                return
            try:
                yield _decoder.decode(line)
            except msgspec.DecodeError:
                continue


def _padding(worker: int, seq: int) -> bytes:
    digest = hashlib.blake2b(f"{worker}.{seq}".encode(), digest_size=16).hexdigest().encode()
    length = (worker * 7919 + seq * 104729) % 97 + 16
    return (digest * (length // len(digest) + 1))[:length]


def event_value(worker: int, seq: int, key: int) -> bytes:
    """The value of event ``seq`` of ``worker`` with key index ``key``: fully determined by
    them, so a reader can tell an intact value from a damaged one."""
    return f"{worker}.{seq}.{key}|".encode() + _padding(worker, seq)


def event_key(worker: int, key: int) -> str:
    return f"w{worker}-k{key}"


def event_id(value: bytes, key: bytes | None) -> str:
    """``"w.s.k"`` for an intact event, ``"!<hex>"`` (first 64 bytes) for anything else."""
    head, sep, _ = value.partition(b"|")
    try:
        worker, seq, key_index = (int(part) for part in head.split(b"."))
    except ValueError:
        return "!" + value[:64].hex()
    if (
        not sep
        or value != event_value(worker, seq, key_index)
        or key != event_key(worker, key_index).encode()
    ):
        return "!" + value[:64].hex()
    return f"{worker}.{seq}.{key_index}"


def parse_id(text: str) -> tuple[int, int, int]:
    worker, seq, key = text.split(".")
    return int(worker), int(seq), int(key)


def records_dir(work_dir: Path) -> Path:
    path = work_dir / "records"
    os.makedirs(path, exist_ok=True)
    return path

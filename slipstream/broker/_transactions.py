"""The transaction coordinator: producer identities, fencing, and transactions.

How a transaction works (docs/concepts.md tells users the same):

1. ``BeginTxn`` opens it (in memory only).
2. ``Append(txn=...)`` batches go to the staging journal (``<data-dir>/txns/``, shared by all
   transactions, each entry tagged with its transaction id), not to their segments: nobody can
   read them. Staged writes are not synced one by one.
3. ``EndTxn(commit)``: the staging journal is synced; the *commit record* (which segments, at
   which producer sequence, plus the caller's metadata) is stored in the catalog in one SQLite
   transaction that also makes it the transactional id's last commit. From here on the
   transaction is committed, whatever happens.
4. The staged batches are *applied*: appended to their segments through the containers' group
   commit as ordinary idempotent batches of the owner's producer id, epoch and consecutive
   sequence numbers starting at the commit record's, flagged transactional. Once every one is
   durable, the record is marked applied and the caller answered. A staging file is deleted
   once it is sealed and every transaction with entries in it has ended.

A broker that crashes before step 3 loses the transaction (aborted: its staged entries are
ignored on restart and their files deleted). One that crashes after it applies the record
again on restart, before it serves anyone: segments that already hold some of the batches
recognise them by their sequence numbers, so each batch lands exactly once. A segment where a
newer epoch of the owner has appended since holds all of them (that epoch's InitProducer waited
for the commit), so the record's epoch being fenced there never stops a re-apply, nor the
broker's start. Readers never see
staged data, so they never see uncommitted or aborted events, and committed data reads exactly
like any other.

Open transactions live in memory only: a broker restart aborts them, and their owner's next
call fails with TransactionAborted (run the transaction again).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import struct
import time
from collections import OrderedDict
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .._errors import (
    InvalidArgument,
    ProducerFenced,
    SlipstreamError,
    StreamNotFound,
    TransactionAborted,
    TransactionNotFound,
)
from ..format import FLAG_TRANSACTIONAL, MAGIC, BatchHeader, decode_header, restamp
from ..protocol import IdentityInfo, Payload, TxnEnded, TxnInfo, TxnRange
from ..storage import (
    CommitPart,
    FileJournal,
    Identity,
    JournalAddress,
    MetaStore,
    PositionCommit,
    TxnCommit,
)
from ..streams import SEQUENCE_MODULUS, next_sequence
from ._container import JOURNAL_CHECKPOINT_SECONDS, sealed_error
from ._faults import FAULT, crash_point
from ._metrics import DETACHED, Metrics
from ._segment import Segment, segment_global_id, split_global_id

if TYPE_CHECKING:
    from ._controller import Controller

log = logging.getLogger("slipstream.txn")

_STAGED = struct.Struct("<QQ")  # staging entry prefix: transaction id, segment global id
_STAGING_ROLL_BYTES = 64 * 1024 * 1024
MAX_EPOCH = 0x7FFF
MAX_TIMEOUT_MS = 15 * 60 * 1000
_ID_BLOCK = 1000
_ENDED_REMEMBERED = 10_000
_APPLY_WINDOW_BYTES = 64 * 1024 * 1024
#: Staged batches kept in memory, up to this many bytes in all, so that applying them need not
#: read them back: the staging journal writes past the page cache (direct IO), so a read-back
#: is a disk read plus a copy into fresh memory. Measured with two anonymous transactions of
#: 1,000,000 x 100 B merged into one commit: broker CPU 0.8 -> 0.4 s, commit 0.6 -> 0.2 s.
#: Past the budget, batches are read back.
_HOLD_BYTES = 256 * 1024 * 1024


@dataclass(slots=True, eq=False)
class _Staged:
    """A staged batch: its segment, where it is in the staging journal, its header, and its
    bytes while they are held in memory (see ``_HOLD_BYTES``)."""

    segment: Segment
    address: JournalAddress
    header: BatchHeader
    data: Payload | None = None


@dataclass(eq=False)
class _Txn:
    txn_id: int
    identity: Identity
    timeout_ms: int
    started: float = field(default_factory=time.monotonic)
    state: str = "open"  # open -> committing | aborting
    staged: list[_Staged] = field(default_factory=list)
    writes: set[asyncio.Future[None]] = field(default_factory=set)
    events: int = 0
    bytes: int = 0
    outcome: asyncio.Future[TxnEnded] | None = None
    label: str = ""

    @property
    def anonymous(self) -> bool:
        """Begun without a transactional id: it commits only merged into another one."""
        return self.identity.producer_id < 0

    def info(self) -> TxnInfo:
        return TxnInfo(
            self.txn_id,
            self.identity.transactional_id,
            self.identity.producer_id,
            self.identity.epoch,
            self.state,
            int((time.monotonic() - self.started) * 1000),
            self.timeout_ms,
            self.events,
            self.bytes,
            len({s.segment for s in self.staged}),
            self.label,
        )


async def _settled(futures: list[asyncio.Future[int]]) -> list[int]:
    """The futures' results, once every one is done; then the first failure, if any, raised.
    Waiting for all of them leaves no failure unretrieved ("Future exception was never
    retrieved") when several appends of a group fail together."""
    results = await asyncio.gather(*futures, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return [r for r in results if not isinstance(r, BaseException)]


def _failed(future: asyncio.Future[int] | None) -> bool:
    return (
        future is not None
        and future.done()
        and (future.cancelled() or future.exception() is not None)
    )


def _note_range(
    ranges: dict[Segment, list[int]],
    segment: Segment,
    header: BatchHeader,
    future: asyncio.Future[int],
) -> None:
    """Widen ``segment``'s range in ``ranges`` by a batch once its append is stored."""
    if _failed(future):
        return
    base = future.result()
    span = ranges.setdefault(segment, [base, base + header.event_count])
    span[0], span[1] = min(span[0], base), max(span[1], base + header.event_count)


class _Ids:
    """Ids handed out from blocks reserved durably in the catalog (one write per block)."""

    def __init__(self, meta: MetaStore, name: str) -> None:
        self._meta, self._name = meta, name
        self._next = self._end = 0

    def take(self) -> int:
        if self._next == self._end:
            self._next = self._meta.reserve_ids(self._name, _ID_BLOCK)
            self._end = self._next + _ID_BLOCK
        self._next += 1
        return self._next - 1


class Coordinator:
    metrics: Metrics = DETACHED  #: the broker's (``Metrics.attach``)

    def __init__(
        self, data_dir: Path, meta: MetaStore, controller: Controller, *, fsync: bool = True
    ) -> None:
        # damage in synced staging data loses only the damaged entries (see FileJournal)
        self.staging = FileJournal(
            data_dir / "txns",
            fsync=fsync,
            resync=(MAGIC, _STAGED.size),
            checkpoint_seconds=JOURNAL_CHECKPOINT_SECONDS,
        )
        self.meta = meta
        self.controller = controller
        self._io = ThreadPoolExecutor(1, thread_name_prefix="txn-io")
        self._producer_ids = _Ids(meta, "producer_id")
        self._txn_ids = _Ids(meta, "txn_id")
        self.identities: dict[str, Identity] = {}
        self._epochs: dict[int, int] = {}  # producer id -> current epoch, for transactional ids
        self._tid_of: dict[int, str] = {}  # producer id -> transactional id
        self.open: dict[int, _Txn] = {}
        self._by_tid: dict[str, _Txn] = {}
        self._ended: OrderedDict[int, TxnEnded] = OrderedDict()
        self._pending: list[tuple[TxnCommit, list[_Staged]]] = []
        # Threads: everything above belongs to the event loop. The txn-io thread (``_io``, one
        # thread, FIFO) owns the staging journal, the id blocks and ``_file_users``: a write
        # registers its transaction as a user of a staging file there, before it can roll
        # the file, so a cleanup queued behind it never deletes a file still in use.
        self._file_users: dict[int, set[int]] = {}  # staging file id -> transactions in it
        self._held = 0  # bytes of staged batches held in memory
        # commits under way: owned here, not by the request that asked (see ``end``)
        self._commits: set[asyncio.Task[TxnEnded]] = set()

    # --- startup ---------------------------------------------------------------------------

    def recover(self) -> dict[str, int]:
        """Load identities, and the staged batches of committed transactions still to be
        applied (``apply_pending`` does that once containers run). Every other staged entry
        belongs to a transaction this restart aborted."""
        for identity in self.meta.identities():
            self.identities[identity.transactional_id] = identity
            self._epochs[identity.producer_id] = identity.epoch
            self._tid_of[identity.producer_id] = identity.transactional_id
        pending = {c.txn_id: c for c in self.meta.pending_commits()}
        staged: dict[int, list[_Staged]] = {
            txn_id: [] for commit in pending.values() for txn_id in (commit.txn_id, *commit.merged)
        }
        aborted: set[int] = set()
        for address, payload in self.staging.recover():
            txn_id, global_id = _STAGED.unpack_from(payload)
            if txn_id not in staged:
                aborted.add(txn_id)
                continue
            segment = self._segment(*split_global_id(global_id))
            if segment is not None:
                staged[txn_id].append(
                    _Staged(segment, address, decode_header(payload, _STAGED.size))
                )
        for commit in pending.values():  # the owner's batches first, then each merged one's
            batches = [b for txn_id in (commit.txn_id, *commit.merged) for b in staged[txn_id]]
            self._pending.append((commit, batches))
        if aborted:  # the staging journal does not say which of them had committed
            log.info(
                "ignored the staged entries of %d transactions: left open by the last run "
                "(now aborted) or committed and applied before it stopped",
                len(aborted),
            )
        return {"identities": len(self.identities), "commits": len(self._pending)}

    async def apply_pending(self) -> None:
        """Finish the commits a crash interrupted (before the broker serves anyone), then
        start staging afresh."""
        loop = asyncio.get_running_loop()
        pending, self._pending = self._pending, []
        for commit, staged in pending:
            if len(staged) < commit.batches:  # cannot happen while fsync keeps its promises
                log.error(
                    "transaction %d: only %d of its %d staged batches are readable; applying those",
                    commit.txn_id,
                    len(staged),
                    commit.batches,
                )
            ranges = await self._apply(commit, staged)
            # not marked applied (disk full): the next restart applies it again, as a no-op
            await loop.run_in_executor(self._io, self._finish, commit.txn_id)
            log.info(
                "applied transaction %d of %r after restart (%d segments)",
                commit.txn_id,
                commit.transactional_id,
                len(ranges),
            )
        await loop.run_in_executor(self._io, self._drop_sealed, True)

    def _drop_sealed(self, roll: bool = False) -> None:
        """Delete sealed staging files no open transaction uses (after rolling, if asked).
        Runs on the txn-io thread."""
        try:
            if roll:
                self.staging.roll()
            for file_id in self.staging.sealed_files():
                if not self._file_users.get(file_id):
                    self._file_users.pop(file_id, None)
                    self.staging.delete_file(file_id)
        except (SlipstreamError, OSError) as exc:  # the next transaction to end tries again
            log.warning("could not delete a used-up staging file: %s", exc)

    def _segment(self, stream_id: int, number: int) -> Segment | None:
        for container in self.controller.containers:
            segment = container.segments.get(segment_global_id(stream_id, number))
            if segment is not None:
                return segment
        return None

    # --- producers -------------------------------------------------------------------------

    async def init_producer(self, transactional_id: str | None) -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        if transactional_id is None:
            return await loop.run_in_executor(self._io, self._producer_ids.take), 0
        if not transactional_id or len(transactional_id) > 255:
            raise InvalidArgument("a transactional id is 1 to 255 characters")
        old = self.identities.get(transactional_id)
        if old is None or old.epoch >= MAX_EPOCH:
            producer_id = await loop.run_in_executor(self._io, self._producer_ids.take)
            epoch = 0
        else:
            producer_id, epoch = old.producer_id, old.epoch + 1
        identity = (
            Identity(transactional_id, producer_id, epoch)
            if old is None
            else Identity(
                transactional_id,
                producer_id,
                epoch,
                old.last_txn_id,
                old.last_metadata,
                old.committed_ms,
            )
        )
        # fence first: the older producer's writes fail from now on
        self.identities[transactional_id] = identity
        self._epochs[producer_id] = epoch
        self._tid_of[producer_id] = transactional_id
        txn = self._by_tid.get(transactional_id)
        if txn is not None:
            if txn.state == "committing" and txn.outcome is not None:
                await asyncio.wait({txn.outcome})  # a commit under way finishes first
            else:
                await self._abort(txn, "fenced by a newer producer with the same transactional id")
        await loop.run_in_executor(self._io, self.meta.save_identity, identity)
        return producer_id, epoch

    def check_epoch(self, producer_id: int, epoch: int) -> None:
        current = self._epochs.get(producer_id)
        if current is not None and epoch < current:
            raise ProducerFenced(
                f"producer {producer_id} epoch {epoch} was fenced by epoch {current}: a newer "
                "producer opened with the same transactional id",
                producer_id=producer_id,
                epoch=epoch,
                current_epoch=current,
            )

    def transactional_id(self, producer_id: int) -> str | None:
        """The transactional id ``producer_id`` belongs to (None: an id without one)."""
        return self._tid_of.get(producer_id)

    def list_identities(self, prefix: str = "") -> list[IdentityInfo]:
        """The transactional ids starting with ``prefix`` that ever began, sorted by id, each
        with its epoch and last committed transaction (from memory: the MetaStore's
        identities as loaded at open, and every save since)."""
        return [self.identity(tid) for tid in sorted(self.identities) if tid.startswith(prefix)]

    def identity(self, transactional_id: str) -> IdentityInfo:
        identity = self.identities.get(transactional_id)
        if identity is None:
            return IdentityInfo(transactional_id, -1, -1, -1, b"", 0)
        return IdentityInfo(
            transactional_id,
            identity.producer_id,
            identity.epoch,
            identity.last_txn_id,
            identity.last_metadata,
            identity.committed_ms,
        )

    # --- transactions ----------------------------------------------------------------------

    async def begin(self, producer_id: int, epoch: int, timeout_ms: int, label: str = "") -> int:
        """Open a transaction. ``producer_id`` -1 opens an *anonymous* one: it stages events
        (from any process that knows its id, e.g. a Spark task) and commits only as part of a
        transactional id's commit (``merge``), or aborts."""
        if not 0 < timeout_ms <= MAX_TIMEOUT_MS:
            raise InvalidArgument(f"timeout_ms must be in 1..{MAX_TIMEOUT_MS}, not {timeout_ms}")
        if len(label) > 255:
            raise InvalidArgument("a transaction label is at most 255 characters")
        loop = asyncio.get_running_loop()
        if producer_id < 0:
            txn_id = await loop.run_in_executor(self._io, self._txn_ids.take)
            self.open[txn_id] = _Txn(txn_id, Identity("", -1, -1), timeout_ms, label=label)
            return txn_id
        self.check_epoch(producer_id, epoch)
        tid = self._tid_of.get(producer_id)
        identity = None if tid is None else self.identities.get(tid)
        if identity is None or identity.epoch != epoch:
            raise InvalidArgument(
                f"producer {producer_id} has no transactional id; open it with one "
                "(InitProducer) to run transactions"
            )
        previous = self._by_tid.get(identity.transactional_id)
        if previous is not None:
            if previous.state == "committing" and previous.outcome is not None:
                await asyncio.wait({previous.outcome})
            else:
                await self._abort(previous, "its owner began a new transaction")
        txn_id = await loop.run_in_executor(self._io, self._txn_ids.take)
        txn = _Txn(txn_id, identity, timeout_ms, label=label)
        self.open[txn_id] = txn
        self._by_tid[identity.transactional_id] = txn
        return txn_id

    def _txn(self, txn_id: int) -> _Txn:
        txn = self.open.get(txn_id)
        if txn is None:
            ended = self._ended.get(txn_id)
            if ended is not None and not ended.committed:
                raise TransactionAborted(f"transaction {txn_id} was aborted", txn_id=txn_id)
            raise TransactionNotFound(f"no open transaction {txn_id}", txn_id=txn_id)
        return txn

    def touching(self, segments: Collection[Segment]) -> bool:
        """Whether an open or committing transaction staged into one of ``segments`` (or
        has a staged write under way, whose segment is not known yet)."""
        return any(
            txn.writes or any(s.segment in segments for s in txn.staged)
            for txn in self.open.values()
        )

    def stage(
        self, txn_id: int, segment: Segment, batch: Payload, header: BatchHeader
    ) -> asyncio.Future[None]:
        """Write a batch to a transaction's staging journal; the future is done once written."""
        txn = self._txn(txn_id)
        if txn.state != "open":
            raise TransactionAborted(
                f"transaction {txn_id} is {txn.state}; no more events may join it", txn_id=txn_id
            )
        # a sealing segment still takes a transaction that staged into it already: the scale
        # waits for that transaction to end anyway, and refusing it would leave it nowhere to
        # send (the successors open only after the scale)
        if segment.sealed or (
            segment.sealing and not any(s.segment is segment for s in txn.staged)
        ):
            raise sealed_error(segment)
        entry = [_STAGED.pack(txn_id, segment.global_id), batch]
        future = asyncio.get_running_loop().run_in_executor(self._io, self._write, txn_id, [entry])
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        txn.writes.add(done)

        def written(write: asyncio.Future[list[JournalAddress]]) -> None:
            txn.writes.discard(done)
            exc = write.exception()
            if exc is not None:
                done.set_exception(exc)
                return
            address = write.result()[0]
            held = self._held + len(batch) <= _HOLD_BYTES
            self._held += len(batch) if held else 0
            txn.staged.append(_Staged(segment, address, header, batch if held else None))
            txn.events += header.event_count
            txn.bytes += header.batch_length
            done.set_result(None)

        future.add_done_callback(written)
        return done

    def _write(self, txn_id: int, entries: list[list[Payload | bytes]]) -> list[JournalAddress]:
        """Stage entries of one transaction (on the txn-io thread). The transaction becomes a
        user of the file before the file can be rolled: once sealed, a file is deleted as soon
        as it has no users, possibly by the very next job on this thread."""
        addresses = self.staging.append(entries)
        for file_id in {address.file_id for address in addresses}:
            self._file_users.setdefault(file_id, set()).add(txn_id)
        if self.staging.active_bytes >= _STAGING_ROLL_BYTES:
            self.staging.roll()
        return addresses

    async def end(
        self,
        txn_id: int,
        commit: bool,
        metadata: bytes,
        merge: list[int] | None = None,
        positions: list[PositionCommit] | None = None,
    ) -> TxnEnded:
        """Commit or abort. A commit may ``merge`` open anonymous transactions: their events
        commit with this one's, under one commit record, or not at all; ``positions``
        (subscription positions consumed) are stored in that record. A caller cancelled
        while it waits (its connection lost) stops waiting, not the commit: asking again
        gives the outcome."""
        txn = self.open.get(txn_id)
        if txn is None:
            ended = self._ended.get(txn_id)
            if ended is None and any(i.last_txn_id == txn_id for i in self.identities.values()):
                ended = TxnEnded(txn_id, True)  # committed before a restart
            if ended is None:
                raise TransactionNotFound(f"no open transaction {txn_id}", txn_id=txn_id)
            if commit and not ended.committed:
                raise TransactionAborted(f"transaction {txn_id} was aborted", txn_id=txn_id)
            if not commit and ended.committed:
                raise InvalidArgument(
                    f"transaction {txn_id} is already committed and cannot be aborted",
                    txn_id=txn_id,
                )
            return ended
        if txn.state == "committing" and txn.outcome is not None:
            if not commit:
                raise InvalidArgument(f"transaction {txn_id} is already committing")
            return await asyncio.shield(txn.outcome)
        if txn.state != "open":
            raise TransactionAborted(f"transaction {txn_id} is {txn.state}", txn_id=txn_id)
        if not commit:
            await self._abort(txn, "abort requested")
            return TxnEnded(txn_id, False)
        if txn.anonymous:
            raise InvalidArgument(
                f"transaction {txn_id} has no transactional id; it commits only merged into the "
                "commit of one that has"
            )
        merged = [self._mergeable(m, txn_id) for m in dict.fromkeys(merge or ())]
        loop = asyncio.get_running_loop()
        outcome = txn.outcome = loop.create_future()
        txn.state = "committing"
        for m in merged:
            m.state = "committing"
        # The commit runs in a task of the coordinator's: a caller that goes away (its
        # connection cut, its request cancelled) must not stop a commit whose record may be
        # stored, half applied, while a newer epoch's InitProducer, waiting for the outcome,
        # would go on and append to the same segments. Only ``close`` cancels it.
        task = loop.create_task(
            self._commit(txn, metadata, merged, positions or []), name=f"commit {txn_id}"
        )
        self._commits.add(task)

        def settle(task: asyncio.Task[TxnEnded]) -> None:
            self._commits.discard(task)
            if task.cancelled():
                outcome.cancel()
            elif (exc := task.exception()) is not None:
                outcome.set_exception(exc)
                outcome.exception()  # retrieved: only the commit's caller reports it
            else:
                outcome.set_result(task.result())

        task.add_done_callback(settle)
        return await asyncio.shield(outcome)

    def _mergeable(self, txn_id: int, owner: int) -> _Txn:
        merged = self._txn(txn_id)
        if txn_id == owner or not merged.anonymous or merged.state != "open":
            raise InvalidArgument(
                f"transaction {txn_id} cannot be merged: only other open transactions without a "
                f"transactional id can (it is {merged.state})"
            )
        return merged

    async def _commit(
        self, txn: _Txn, metadata: bytes, merged: list[_Txn], positions: list[PositionCommit]
    ) -> TxnEnded:
        loop = asyncio.get_running_loop()
        identity = txn.identity
        everyone = [txn, *merged]

        async def abort_all(reason: str) -> None:
            for one in everyone:
                await self._abort(one, reason)

        results = await asyncio.gather(
            *(w for one in everyone for w in one.writes), return_exceptions=True
        )
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed or self._epochs.get(identity.producer_id) != identity.epoch:
            reason = "a staged write failed" if failed else "its producer was fenced"
            await abort_all(reason)
            raise TransactionAborted(f"transaction {txn.txn_id} aborted: {reason}")
        staged = [b for one in everyone for b in one.staged]  # the owner's first: see recover
        gone = [s.segment for s in staged if s.segment.deleted]
        if gone:
            await abort_all(f"stream {gone[0].stream_name!r} was deleted")
            raise StreamNotFound(
                f"stream {gone[0].stream_name!r} was deleted; transaction {txn.txn_id} aborted"
            )
        try:
            await loop.run_in_executor(self._io, self.staging.sync)
        except SlipstreamError as exc:
            # what was staged since the last sync is in an unknown state: cut it off, and
            # abort every transaction that may have lost entries with it
            await loop.run_in_executor(self._io, self.staging.discard_unsynced)
            for other in list(self.open.values()):
                if other.state == "open" or other in everyone:
                    await self._abort(other, f"staging could not be made durable: {exc}")
            raise
        parts: dict[Segment, CommitPart] = {}
        for segment in (s.segment for s in staged):
            if segment not in parts:
                state = segment.producers.get(identity.producer_id)
                start = state.next_sequence if state and state.epoch == identity.epoch else 0
                parts[segment] = CommitPart(segment.stream_id, segment.number, start)
        record = TxnCommit(
            txn.txn_id,
            identity.transactional_id,
            identity.producer_id,
            identity.epoch,
            list(parts.values()),
            metadata,
            int(time.time() * 1000),
            len(staged),
            [m.txn_id for m in merged],
            positions,
        )
        crash_point("txn.before_commit_record")
        try:
            await loop.run_in_executor(self._io, self.meta.commit_txn, record)
        except SlipstreamError as exc:
            await abort_all(f"the commit record could not be stored: {exc}")
            raise
        crash_point("txn.after_commit_record")
        self.identities[identity.transactional_id] = Identity(
            identity.transactional_id,
            identity.producer_id,
            identity.epoch,
            txn.txn_id,
            metadata,
            record.committed_ms,
        )
        txn.identity = self.identities[identity.transactional_id]
        landed: dict[Segment, list[int]] = {}  # across attempts: a retry skips what landed
        while True:  # committed: it must be applied, however long storage trouble lasts
            try:
                ranges = await self._apply(record, staged, landed)
                break
            except (SlipstreamError, OSError) as exc:
                log.error("applying transaction %d failed, retrying: %s", txn.txn_id, exc)
                await asyncio.sleep(1)
        crash_point("txn.after_apply")
        # Marking the record applied need not hold up the answer: a restart before it lands
        # applies the record again, and finds every batch already in place. (The io thread is
        # FIFO, so staging files this transaction used are deleted only after it.)
        loop.run_in_executor(self._io, self._finish, txn.txn_id)
        for one in everyone:
            self._forget(one, TxnEnded(one.txn_id, True))
        return TxnEnded(txn.txn_id, True, ranges)

    async def _apply(
        self,
        record: TxnCommit,
        staged: list[_Staged],
        landed: dict[Segment, list[int]] | None = None,
    ) -> list[TxnRange]:
        """Append the staged batches to their segments, skipping any a segment already holds
        (an apply interrupted by a crash, or one whose record was not marked applied); returns
        where they landed. Every append is awaited, failed or not, before the first failure is
        raised; the caller retries (a commit) or fails the start (a restart).

        ``landed`` gathers each segment's offsets ``[lo, hi)`` over the attempts of one commit,
        so the reply names a segment whose batches all landed before a retry (which skips
        them). A segment's batches land as a gap-free prefix: once one fails, no later one of
        that segment is queued (and the container fails those already queued behind it), so
        the retry's skip count, from the segment's next expected sequence, is exact."""
        loop = asyncio.get_running_loop()
        sequence: dict[tuple[int, int], int] = {}
        skip: dict[tuple[int, int], int] = {}
        for part in record.parts:
            key = (part.stream_id, part.segment)
            sequence[key] = part.start_sequence
            segment = self._segment(*key)
            state = None if segment is None else segment.producers.get(record.producer_id)
            already = 0
            if state is not None and state.epoch == record.epoch:
                already = (state.next_sequence - part.start_sequence) % SEQUENCE_MODULUS
                if already >= SEQUENCE_MODULUS // 2:
                    already = 0
            elif state is not None and state.epoch > record.epoch:
                # A newer epoch of the owner appended here, so the record was applied here in
                # full (a newer epoch's InitProducer waits for a commit under way, and a
                # restart applies pending records before it serves): skip every batch. Sending
                # them would only be fenced, and the record, not the epoch, decided them.
                already = SEQUENCE_MODULUS
            skip[key] = already
        in_flight: list[tuple[Segment, asyncio.Future[int], int]] = []
        ranges: dict[Segment, list[int]] = {} if landed is None else landed
        latest: dict[tuple[int, int], asyncio.Future[int]] = {}  # each segment's last append
        window = 0
        sequential = FAULT == "txn.mid_apply"
        first_part: tuple[int, int] | None = None
        for item in staged:
            segment, header = item.segment, item.header
            key = (segment.stream_id, segment.number)
            if segment.deleted or key not in sequence:
                continue
            if skip[key] >= header.event_count:  # already in the segment
                skip[key] -= header.event_count
                sequence[key] = next_sequence(sequence[key], header.event_count)
                continue
            if sequential and first_part not in (None, key):
                await _settled([f for _, f, _ in in_flight])
                crash_point("txn.mid_apply")
            first_part = first_part or key
            batch = self._release(item)
            if batch is None:
                payload = await loop.run_in_executor(self._io, self.staging.read, item.address)
                batch = bytearray(memoryview(payload)[_STAGED.size :])
            if _failed(latest.get(key)):  # checked after the read's await: it may have failed
                continue  # stored past the failed batch, this one would hide its loss
            restamp(
                batch,
                flags=FLAG_TRANSACTIONAL,
                producer_id=record.producer_id,
                producer_epoch=record.epoch,
                sequence=sequence[key],
            )
            sequence[key] = next_sequence(sequence[key], header.event_count)
            container = self.controller.containers[segment.container]
            future = container.append(segment, batch, decode_header(batch), applying=True)
            future.add_done_callback(functools.partial(_note_range, ranges, segment, header))
            latest[key] = future
            in_flight.append((segment, future, header.event_count))
            window += len(batch)
            if window > _APPLY_WINDOW_BYTES:
                await _settled([f for _, f, _ in in_flight])
                window = 0
        # each future's _note_range ran before _settled returns (callbacks run in order)
        await _settled([f for _, f, _ in in_flight])
        return [TxnRange(s.stream_name, s.number, lo, hi) for s, (lo, hi) in ranges.items()]

    def _release(self, item: _Staged) -> Payload | None:
        """Take a staged batch's bytes out of memory (None if they were not held)."""
        data, item.data = item.data, None
        if data is not None:
            self._held -= len(data)
        return data

    def _finish(self, txn_id: int) -> None:
        try:
            self.meta.finish_txn(txn_id)
        except SlipstreamError as exc:  # harmless: a restart re-applies it as a no-op
            log.warning("could not mark transaction %d applied: %s", txn_id, exc)

    async def _abort(self, txn: _Txn, reason: str) -> None:
        if txn.state == "aborting":
            return
        txn.state = "aborting"
        await asyncio.gather(*txn.writes, return_exceptions=True)
        self._forget(txn, TxnEnded(txn.txn_id, False))
        log.info(
            "transaction %d of %r aborted (%s): %d events discarded",
            txn.txn_id,
            txn.identity.transactional_id,
            reason,
            txn.events,
        )

    def _forget(self, txn: _Txn, ended: TxnEnded) -> None:
        self.metrics.transaction_ended(ended.committed)
        self.open.pop(txn.txn_id, None)
        if self._by_tid.get(txn.identity.transactional_id) is txn:
            del self._by_tid[txn.identity.transactional_id]
        for item in txn.staged:
            self._release(item)
        self._ended[txn.txn_id] = TxnEnded(ended.txn_id, ended.committed)
        while len(self._ended) > _ENDED_REMEMBERED:
            self._ended.popitem(last=False)
        # after every write of the transaction: _commit and _abort wait for them
        asyncio.get_running_loop().run_in_executor(self._io, self._release_files, txn.txn_id)

    def _release_files(self, txn_id: int) -> None:
        """An ended transaction no longer uses its staging files (on the txn-io thread);
        delete those that are sealed and now unused."""
        released = False
        for users in self._file_users.values():
            if txn_id in users:
                users.discard(txn_id)
                released |= not users
        if released:
            self._drop_sealed()

    def list(self) -> list[TxnInfo]:
        return [txn.info() for txn in self.open.values()]

    async def run(self) -> None:
        """Abort transactions that outlive their timeout."""
        while True:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            for txn in list(self.open.values()):
                if txn.state == "open" and (now - txn.started) * 1000 > txn.timeout_ms:
                    await self._abort(txn, f"timed out after {txn.timeout_ms} ms")

    async def close(self) -> None:
        """Stop: commits under way are cancelled (a stored record is applied on restart)."""
        for task in self._commits:
            task.cancel()
        await asyncio.gather(*self._commits, return_exceptions=True)
        await asyncio.get_running_loop().run_in_executor(self._io, self.staging.close)
        self._io.shutdown(wait=True)

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

In a cluster (docs/cluster.md, "Transactions") each transaction has a *home*: the container
that coordinates it (a transactional id's ``slipstream.cluster.coordinator``; an anonymous
transaction's, the lowest container the broker serves when it begins). Only the broker serving
the home answers InitProducer, BeginTxn, EndTxn and GetIdentity for it, and stages its appends,
whichever broker serves their segments. Staging goes to an ObjectJournal of the home
(``staging_container``: container ids from 1,000,000 up, never a data container's), fenced by
the home's lease, and so is the commit record (``commit_txn(lease=...)``), which names the home.
Applying appends a batch whose segment this broker serves to its container, as above, and sends
any other to the broker serving it (``ApplyBatch``), retrying while that container moves; the
receiver skips what its segment already holds (same producer id, epoch and sequence), so every
batch lands once however often it is sent. A broker that takes a container (``adopt``) recovers
its staging journal and the commit records it coordinated and applies them in the background;
the home's transactional ids wait for that before they begin anything new. A broker that hands
a container over (``release``) aborts the open transactions it coordinated; commits past their
record go on applying (the adopter applies them too, exactly once by the same skip).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import struct
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._errors import (
    BrokerUnavailable,
    InvalidArgument,
    ProducerFenced,
    SegmentNotFound,
    SlipstreamError,
    StreamNotFound,
    TransactionAborted,
    TransactionNotFound,
    WrongBroker,
)
from ..client._connection import Connection
from ..format import FLAG_TRANSACTIONAL, MAGIC, BatchHeader, decode_header, restamp
from ..protocol import (
    AppendAck,
    ApplyBatch,
    IdentityInfo,
    Message,
    Payload,
    TxnEnded,
    TxnInfo,
    TxnRange,
)
from ..storage import (
    CommitPart,
    FileJournal,
    Identity,
    Journal,
    JournalAddress,
    Lease,
    LongTermStore,
    MetaStore,
    PositionCommit,
    TxnCommit,
)
from ..streams import SEQUENCE_MODULUS, ProducerState, next_sequence
from ._container import JOURNAL_CHECKPOINT_SECONDS, sealed_error
from ._faults import FAULT, HELD_PAUSE_S, crash_point
from ._metrics import DETACHED, Metrics
from ._peers import PEER_TIMEOUT_S
from ._segment import Segment, segment_global_id, split_global_id

if TYPE_CHECKING:
    from ._controller import Controller
    from ._peers import Peers

#: positions of groups other brokers coordinate, held for a commit (``Coordinator.end``):
#: ``() -> (the positions, the time.monotonic() by which their record must be written, the
#: holds' ids its record consumes in the catalog)``
PositionsHold = Callable[[], Awaitable[tuple[list[PositionCommit], float, list[int]]]]

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
#: a standalone broker's one staging journal (``<data-dir>/txns``), as a transaction's home
LOCAL = -1
#: staging journals of a cluster's containers use these container ids (see ``staging_container``)
STAGING_CONTAINER_BASE = 1_000_000
#: how long an apply waits before it sends again to a segment whose container is moving
_APPLY_RETRY_S = 0.5
#: how often a broker of a cluster reads the transactional ids other brokers coordinate
_IDENTITIES_REFRESH_S = 2.0
#: how long a commit waits for a moving segment's broker to say where its batches start
_SEQUENCE_WAIT_S = 15.0
#: how long an apply waits for other brokers to acknowledge the batches it sent them
_REMOTE_APPLY_S = 60.0


def _behind(sequence: int, state: ProducerState) -> bool:
    """Whether a batch at ``sequence`` lies before what ``state`` expects next (modular)."""
    return 0 < (state.next_sequence - sequence) % SEQUENCE_MODULUS < SEQUENCE_MODULUS // 2


def staging_container(cid: int) -> int:
    """The journal container id of container ``cid``'s staging journal (object names
    ``journal/<id>/...`` and catalog records), apart from every data container's."""
    return STAGING_CONTAINER_BASE + cid


@dataclass(slots=True, eq=False)
class _Staged:
    """A staged batch: its segment, where it is in the staging journal, its header, and its
    bytes while they are held in memory (see ``_HOLD_BYTES``)."""

    segment: Segment
    address: JournalAddress
    header: BatchHeader
    data: Payload | None = None
    home: int = LOCAL  # whose staging journal holds it


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
    home: int = LOCAL  # the container coordinating it (in a cluster), whose journal stages it

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


async def _settled(futures: list[asyncio.Future[int]], remote: bool = False) -> list[int]:
    """The futures' results, once every one is done; then the first failure, if any, raised.
    Waiting for all of them leaves no failure unretrieved ("Future exception was never
    retrieved") when several appends of a group fail together. ``remote``: some are another
    broker's answers, waited for at most ``_REMOTE_APPLY_S`` (BrokerUnavailable after)."""
    if remote and futures:
        _, late = await asyncio.wait(futures, timeout=_REMOTE_APPLY_S)
        if late:
            for future in late:
                future.cancel()  # only answers of peers are cancelled: a container's are done
            raise BrokerUnavailable(
                f"{len(late)} batches of a committed transaction were not acknowledged in "
                f"{_REMOTE_APPLY_S} s by the brokers serving their segments"
            )
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
    if base < 0:  # another broker's segment held it already
        return
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
    #: in a cluster: the broker's connections to the others, for ``ApplyBatch`` (the broker
    #: sets them), and which broker serves each container
    peers: Peers | None = None

    def __init__(
        self,
        data_dir: Path,
        meta: MetaStore,
        controller: Controller,
        *,
        fsync: bool = True,
        shared: LongTermStore | None = None,
    ) -> None:
        """``shared``: the cluster's object store (cluster mode: each home container's staging
        journal is an ObjectJournal there, opened by ``adopt``); None: a standalone broker,
        staging in ``<data-dir>/txns``."""
        self._shared = shared
        self._journals: dict[int, Journal] = {}  # home -> its staging journal
        self._leases: dict[int, Lease] = {}  # home -> the lease that fences its writes
        #: home -> set once the commits it coordinated before this broker adopted it are
        #: applied: its transactional ids wait for that before they begin anything new
        self._adopted: dict[int, asyncio.Event] = {}
        if shared is None:
            # damage in synced staging data loses only the damaged entries (see FileJournal)
            self._journals[LOCAL] = FileJournal(
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
        # thread, FIFO) owns the staging journals, the id blocks and ``_file_users``: a write
        # registers its transaction as a user of a staging file there, before it can roll
        # the file, so a cleanup queued behind it never deletes a file still in use.
        # (home, staging file id) -> transactions in it
        self._file_users: dict[tuple[int, int], set[int]] = {}
        self._held = 0  # bytes of staged batches held in memory
        # commits under way: owned here, not by the request that asked (see ``end``)
        self._commits: set[asyncio.Task[TxnEnded]] = set()
        self._adoptions: set[asyncio.Task[None]] = set()  # applies of adopted homes' commits

    @property
    def staging(self) -> Journal:
        """A standalone broker's staging journal."""
        return self._journals[LOCAL]

    @property
    def clustered(self) -> bool:
        return self._shared is not None

    # --- startup ---------------------------------------------------------------------------

    def recover(self) -> dict[str, int]:
        """Load identities, and (standalone) the staged batches of committed transactions
        still to be applied (``apply_pending`` does that once containers run). Every other
        staged entry belongs to a transaction this restart aborted. In a cluster the staging
        journals and commits are each home's, recovered when it is taken (``adopt``)."""
        for identity in self.meta.identities():
            self.identities[identity.transactional_id] = identity
            self._epochs[identity.producer_id] = identity.epoch
            self._tid_of[identity.producer_id] = identity.transactional_id
        if not self.clustered:
            pending = [c for c in self.meta.pending_commits() if c.coordinator == LOCAL]
            found = self._staged_entries(self.staging, pending)
            for commit, entries in found:
                batches = []
                for address, global_id, header in entries:
                    segment = self._segment(*split_global_id(global_id))
                    if segment is not None:
                        batches.append(_Staged(segment, address, header))
                self._pending.append((commit, batches))
        return {"identities": len(self.identities), "commits": len(self._pending)}

    @staticmethod
    def _staged_entries(
        journal: Journal, pending: list[TxnCommit]
    ) -> list[tuple[TxnCommit, list[tuple[JournalAddress, int, BatchHeader]]]]:
        """Each pending commit with its staged entries (address, segment global id, header),
        the owner's first, then each merged transaction's, in staging order. Reads the whole
        journal (on the thread that owns it)."""
        staged: dict[int, list[tuple[JournalAddress, int, BatchHeader]]] = {
            txn_id: [] for commit in pending for txn_id in (commit.txn_id, *commit.merged)
        }
        aborted: set[int] = set()
        for address, payload in journal.recover():
            txn_id, global_id = _STAGED.unpack_from(payload)
            if txn_id not in staged:
                aborted.add(txn_id)
                continue
            staged[txn_id].append((address, global_id, decode_header(payload, _STAGED.size)))
        if aborted:  # the staging journal does not say which of them had committed
            log.info(
                "ignored the staged entries of %d transactions: left open by the last run "
                "(now aborted) or committed and applied before it stopped",
                len(aborted),
            )
        return [
            (commit, [b for txn_id in (commit.txn_id, *commit.merged) for b in staged[txn_id]])
            for commit in pending
        ]

    async def apply_pending(self) -> None:
        """Finish the commits a crash interrupted (before the broker serves anyone), then
        start staging afresh (a standalone broker's; in a cluster ``adopt`` does this)."""
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
        if not self.clustered:
            await loop.run_in_executor(self._io, self._drop_sealed, LOCAL, True)

    # --- homes in a cluster ----------------------------------------------------------------

    async def adopt(self, cid: int, lease: Lease, containers: int) -> None:
        """This broker now serves container ``cid`` (``lease``, of a cluster of ``containers``):
        it becomes the home of the transactions that container coordinates. Recovers its
        staging journal and the commit records it coordinated that are not marked applied, and
        applies them in a background task (retrying while storage or a segment's broker is
        unavailable); transactions of the home begin only after that (``_ready``). Raises
        StorageError / LeaseLost if the journal or catalog cannot be read: the caller fails
        the take. Every staged entry of a transaction without a record is an abort's."""
        from ..cluster import coordinator
        from ..storage._journal_objects import ObjectJournal

        assert self._shared is not None, "adopt is for cluster mode"
        loop = asyncio.get_running_loop()
        journal = ObjectJournal(self._shared, self.meta, staging_container(cid))
        journal.lease = lease

        def read() -> tuple[list[Identity], list[tuple[TxnCommit, list[Any]]]]:
            pending = [c for c in self.meta.pending_commits() if c.coordinator == cid]
            return self.meta.identities(), self._staged_entries(journal, pending)

        ready = self._adopted[cid] = asyncio.Event()
        identities, found = await loop.run_in_executor(self._io, read)
        for identity in identities:  # the home's ids as the last coordinator left them
            if coordinator(identity.transactional_id, containers) == cid:
                self.identities[identity.transactional_id] = identity
                self._epochs[identity.producer_id] = identity.epoch
                self._tid_of[identity.producer_id] = identity.transactional_id
        self._journals[cid], self._leases[cid] = journal, lease
        pending: list[tuple[TxnCommit, list[_Staged]]] = []
        for commit, entries in found:
            batches = []
            for address, global_id, header in entries:
                segment = self._segment(*split_global_id(global_id))
                if segment is not None:
                    batches.append(_Staged(segment, address, header, home=cid))
            pending.append((commit, batches))
        if pending:
            log.info("container %d: %d transactions to apply", cid, len(pending))
        task = loop.create_task(
            self._apply_adopted(cid, journal, pending, ready), name=f"txns {cid}"
        )
        self._adoptions.add(task)
        task.add_done_callback(self._adoptions.discard)

    async def _apply_adopted(
        self,
        cid: int,
        journal: Journal,
        pending: list[tuple[TxnCommit, list[_Staged]]],
        ready: asyncio.Event,
    ) -> None:
        """Apply an adopted home's pending commits, each until it is applied (or the home is
        given up meanwhile: its next adopter applies it), then open the home for business."""
        loop = asyncio.get_running_loop()
        for commit, staged in pending:
            landed: dict[Segment, list[int]] = {}
            while self._journals.get(cid) is journal:
                try:
                    await self._apply(commit, staged, landed)
                    break
                except (SlipstreamError, OSError) as exc:
                    log.warning("applying transaction %d failed, retrying: %s", commit.txn_id, exc)
                    await asyncio.sleep(_APPLY_RETRY_S)
            else:
                return
            await loop.run_in_executor(self._io, self._finish, commit.txn_id)
            log.info(
                "applied transaction %d of %r coordinated by container %d before it was taken",
                commit.txn_id,
                commit.transactional_id,
                cid,
            )
        await loop.run_in_executor(self._io, self._drop_sealed, cid, True)
        ready.set()

    async def release(self, cid: int) -> None:
        """This broker no longer serves container ``cid``: the open transactions it
        coordinated abort (their owners run them again at the new home). Commits past their
        record go on applying; the next adopter applies them too, and each batch lands once."""
        ready = self._adopted.pop(cid, None)
        if ready is not None:
            ready.set()  # whoever waits finds the home gone (WrongBroker)
        for txn in [t for t in self.open.values() if t.home == cid and t.state == "open"]:
            await self._abort(txn, f"container {cid}, coordinating it, moved to another broker")
        journal = self._journals.pop(cid, None)
        self._leases.pop(cid, None)
        if journal is not None:
            await asyncio.get_running_loop().run_in_executor(self._io, journal.close)

    async def _ready(self, home: int) -> None:
        """Wait until the commits an adopted home had pending are applied."""
        ready = self._adopted.get(home)
        if ready is not None and not ready.is_set():
            await ready.wait()
        if home != LOCAL and home not in self._journals:
            raise TransactionAborted(
                f"container {home} no longer coordinates transactions on this broker; begin "
                "again (the client asks the broker that serves it now)"
            )

    def _drop_sealed(self, home: int, roll: bool = False) -> None:
        """Delete sealed staging files of ``home`` that no open transaction uses (after
        rolling, if asked). Runs on the txn-io thread."""
        journal = self._journals.get(home)
        if journal is None:
            return
        try:
            if roll:
                journal.roll()
            deleted = False
            for file_id in journal.sealed_files():
                if not self._file_users.get((home, file_id)):
                    self._file_users.pop((home, file_id), None)
                    journal.delete_file(file_id)
                    deleted = True
            delete_orphans = getattr(journal, "delete_orphans", None)
            if deleted and delete_orphans is not None:  # an object journal: the files' objects
                delete_orphans()
        except (SlipstreamError, OSError) as exc:  # the next transaction to end tries again
            log.warning("could not delete a used-up staging file: %s", exc)

    def _segment(self, stream_id: int, number: int) -> Segment | None:
        """The segment's object: the live one if this broker serves its container."""
        found = None
        for container in self.controller.containers:
            segment = container.segments.get(segment_global_id(stream_id, number))
            if segment is not None:
                if container.serving and container.id == segment.container:
                    return segment
                found = found or segment
        if found is None:  # a segment of a container no object lists (cannot hurt to look)
            for stream in self.controller.streams.values():
                if stream.id == stream_id:
                    return stream.segments.get(number)
        return found

    # --- producers -------------------------------------------------------------------------

    async def init_producer(
        self, transactional_id: str | None, home: int = LOCAL
    ) -> tuple[int, int]:
        """A producer id (and epoch 0), or for a transactional id its stable producer id and
        next epoch, which fences the older ones and aborts their open transaction (a commit
        under way finishes first). ``home``: in a cluster, the id's coordinating container."""
        loop = asyncio.get_running_loop()
        if transactional_id is None:
            return await loop.run_in_executor(self._io, self._producer_ids.take), 0
        if not transactional_id or len(transactional_id) > 255:
            raise InvalidArgument("a transactional id is 1 to 255 characters")
        await self._ready(home)
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

    async def begin(
        self, producer_id: int, epoch: int, timeout_ms: int, label: str = "", home: int = LOCAL
    ) -> int:
        """Open a transaction. ``producer_id`` -1 opens an *anonymous* one: it stages events
        (from any process that knows its id, e.g. a Spark task) and commits only as part of a
        transactional id's commit (``merge``), or aborts. ``home``: in a cluster, the
        container coordinating it (its staging journal's)."""
        if not 0 < timeout_ms <= MAX_TIMEOUT_MS:
            raise InvalidArgument(f"timeout_ms must be in 1..{MAX_TIMEOUT_MS}, not {timeout_ms}")
        if len(label) > 255:
            raise InvalidArgument("a transaction label is at most 255 characters")
        loop = asyncio.get_running_loop()
        await self._ready(home)
        if producer_id < 0:
            txn_id = await loop.run_in_executor(self._io, self._txn_ids.take)
            self.open[txn_id] = _Txn(
                txn_id, Identity("", -1, -1), timeout_ms, label=label, home=home
            )
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
        txn = _Txn(txn_id, identity, timeout_ms, label=label, home=home)
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
        if txn.home not in self._journals:
            raise TransactionAborted(f"transaction {txn_id} lost its home", txn_id=txn_id)
        entry = [_STAGED.pack(txn_id, segment.global_id), batch]
        future = asyncio.get_running_loop().run_in_executor(
            self._io, self._write, txn.home, txn_id, [entry]
        )
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
            txn.staged.append(
                _Staged(segment, address, header, batch if held else None, home=txn.home)
            )
            txn.events += header.event_count
            txn.bytes += header.batch_length
            done.set_result(None)

        future.add_done_callback(written)
        return done

    def _write(
        self, home: int, txn_id: int, entries: list[list[Payload | bytes]]
    ) -> list[JournalAddress]:
        """Stage entries of one transaction in ``home``'s journal (on the txn-io thread). The
        transaction becomes a user of the file before the file can be rolled: once sealed, a
        file is deleted as soon as it has no users, possibly by the very next job here."""
        journal = self._journals.get(home)
        if journal is None:
            raise TransactionAborted(f"transaction {txn_id} lost its home", txn_id=txn_id)
        addresses = journal.append(entries)
        for file_id in {address.file_id for address in addresses}:
            self._file_users.setdefault((home, file_id), set()).add(txn_id)
        if journal.active_bytes >= _STAGING_ROLL_BYTES:
            journal.roll()
        return addresses

    async def _restage(self, txn: _Txn, home: int) -> None:
        """Copy a merged transaction's staged batches into ``home``'s journal (the
        committing transaction's), so that one journal holds every batch its record names:
        the one the home's next adopter reads."""
        loop = asyncio.get_running_loop()
        for item in txn.staged:
            if item.home == home:
                continue
            data: Payload | None = item.data
            if data is None:
                journal = self._journals.get(item.home)
                if journal is None:
                    raise TransactionAborted(
                        f"transaction {txn.txn_id} lost its home", txn_id=txn.txn_id
                    )
                payload = await loop.run_in_executor(self._io, journal.read, item.address)
                data = bytearray(memoryview(payload)[_STAGED.size :])
            entry = [_STAGED.pack(txn.txn_id, item.segment.global_id), data]
            (address,) = await loop.run_in_executor(
                self._io, self._write, home, txn.txn_id, [entry]
            )
            item.address, item.home = address, home

    async def end(
        self,
        txn_id: int,
        commit: bool,
        metadata: bytes,
        merge: list[int] | None = None,
        positions: list[PositionCommit] | None = None,
        hold: PositionsHold | None = None,
    ) -> TxnEnded:
        """Commit or abort. A commit may ``merge`` open anonymous transactions: their events
        commit with this one's, under one commit record, or not at all; ``positions``
        (subscription positions consumed) are stored in that record, with those ``hold``
        gives, awaited just before the record is written (groups held by other brokers): the
        record is stored only if its write starts before the deadline it gives too (else the
        transaction aborts), and an error it raises aborts the transaction. A caller cancelled
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
            self._commit(txn, metadata, merged, positions or [], hold), name=f"commit {txn_id}"
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
        self,
        txn: _Txn,
        metadata: bytes,
        merged: list[_Txn],
        positions: list[PositionCommit],
        hold: PositionsHold | None = None,
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
        home = txn.home
        # both taken now: a hand-over meanwhile (``release``) must not leave the record
        # unfenced, stored after the next holder read the pending ones
        journal, lease = self._journals.get(home), self._leases.get(home)
        try:
            if journal is None or (lease is None and home != LOCAL):
                raise TransactionAborted(
                    f"container {home}, coordinating transaction {txn.txn_id}, moved to "
                    "another broker"
                )
            for one in merged:  # begun at another home of this broker: one journal holds all
                await self._restage(one, home)
            await loop.run_in_executor(self._io, journal.sync)
        except SlipstreamError as exc:
            # what was staged since the last sync is in an unknown state: cut it off, and
            # abort every transaction that may have lost entries with it
            if journal is not None:
                await loop.run_in_executor(self._io, journal.discard_unsynced)
            for other in list(self.open.values()):
                if (other.state == "open" and other.home == home) or other in everyone:
                    await self._abort(other, f"staging could not be made durable: {exc}")
            raise
        parts: dict[Segment, CommitPart] = {}
        try:
            for segment in (s.segment for s in staged):
                if segment not in parts:
                    start = await self._next_sequence(segment, identity.producer_id, identity.epoch)
                    parts[segment] = CommitPart(segment.stream_id, segment.number, start)
        except (SlipstreamError, TimeoutError) as exc:
            await abort_all(f"a segment's broker did not answer: {exc}")
            raise
        deadline, hold_ids = None, list[int]()
        if hold is not None:
            try:
                held, deadline, hold_ids = await hold()
            except (SlipstreamError, TimeoutError) as exc:
                await abort_all(f"its positions could not be held: {exc}")
                raise
            positions = [*positions, *held]
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
            home,
        )
        crash_point("txn.before_commit_record")

        def store() -> None:  # on the io thread: the deadline checked as late as can be
            if deadline is not None and time.monotonic() > deadline:
                raise TransactionAborted(
                    f"transaction {txn.txn_id} aborted: the groups holding its positions for it "
                    "may have let go before its record could be stored"
                )
            if hold_ids and FAULT == "txn.held_pause":  # tests: paused past the holds
                log.warning("fault injection: pausing %.0f s before the record", HELD_PAUSE_S)
                time.sleep(HELD_PAUSE_S)
            # the deadline only spares a doomed write: what makes a late record store nothing
            # is the catalog (the holds' rows, consumed here, removed by a group letting go)
            self.meta.commit_txn(record, lease=lease, holds=hold_ids)

        try:
            await loop.run_in_executor(self._io, store)
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
        applied = True
        while True:  # committed: it must be applied, however long storage trouble lasts
            try:
                ranges = await self._apply(record, staged, landed)
                break
            except (SlipstreamError, OSError) as exc:
                if home != LOCAL and self._journals.get(home) is not journal:
                    # the home moved: its adopter applies the record (each batch once)
                    log.warning(
                        "transaction %d committed; container %d moved before it was applied "
                        "here, its new broker applies it",
                        txn.txn_id,
                        home,
                    )
                    ranges, applied = [], False  # not marked applied: its adopter does that
                    break
                log.error("applying transaction %d failed, retrying: %s", txn.txn_id, exc)
                await asyncio.sleep(_APPLY_RETRY_S if home != LOCAL else 1)
        crash_point("txn.after_apply")
        # Marking the record applied need not hold up the answer: a restart before it lands
        # applies the record again, and finds every batch already in place. (The io thread is
        # FIFO, so staging files this transaction used are deleted only after it.)
        if applied:
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
        the retry's skip count, from the segment's next expected sequence, is exact.

        In a cluster a segment another broker serves gets its batches over ``ApplyBatch``, in
        order on one connection, every one of them: the receiver skips those its segment holds
        (it knows its producer state; this broker does not). WrongBroker or no answer from it
        fails the attempt, like a storage error (the caller retries)."""
        loop = asyncio.get_running_loop()
        sequence: dict[tuple[int, int], int] = {}
        skip: dict[tuple[int, int], int] = {}
        for part in record.parts:
            key = (part.stream_id, part.segment)
            sequence[key] = part.start_sequence
            segment = self._segment(*key)
            if segment is not None and not self._serves(segment):
                skip[key] = 0  # the broker serving it skips what it holds
                continue
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
        connections: dict[str, Connection] = {}  # the brokers serving other segments
        remote = False
        for item in staged:
            header = item.header
            key = (item.segment.stream_id, item.segment.number)
            segment = self._segment(*key) or item.segment  # live: a takeover swaps objects
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
                journal = self._journals.get(item.home)
                if journal is None:
                    raise TransactionAborted(
                        f"the staging journal of container {item.home} is no longer this "
                        "broker's; its new broker applies the transaction"
                    )
                payload = await loop.run_in_executor(self._io, journal.read, item.address)
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
            if self._serves(segment):
                container = self.controller.containers[segment.container]
                future = container.append(segment, batch, decode_header(batch), applying=True)
            else:
                remote = True
                future = await self._send_batch(connections, segment, batch)
            future.add_done_callback(functools.partial(_note_range, ranges, segment, header))
            latest[key] = future
            in_flight.append((segment, future, header.event_count))
            window += len(batch)
            if window > _APPLY_WINDOW_BYTES:
                await _settled([f for _, f, _ in in_flight], remote)
                window = 0
        # each future's _note_range ran before _settled returns (callbacks run in order)
        await _settled([f for _, f, _ in in_flight], remote)
        return [TxnRange(s.stream_name, s.number, lo, hi) for s, (lo, hi) in ranges.items()]

    def _serves(self, segment: Segment) -> bool:
        """Whether this broker appends to ``segment`` itself (standalone: always)."""
        if not self.clustered:
            return True
        container = self.controller.containers[segment.container]
        return container.serving and container.segments.get(segment.global_id) is segment

    async def _owner(self, connections: dict[str, Connection], segment: Segment) -> Connection:
        """A connection to the broker serving ``segment`` (WrongBroker while nobody does)."""
        assert self.peers is not None
        cluster = self.peers.cluster
        owner = cluster.owners[segment.container]
        if not owner or owner == cluster.broker_id:
            raise cluster.wrong_broker(
                segment.container, f"segment {segment.number} of {segment.stream_name!r}"
            )
        connection = connections.get(owner)
        if connection is None or connection.closed is not None:
            async with asyncio.timeout(PEER_TIMEOUT_S):
                connection = connections[owner] = await self.peers.connection(owner)
        return connection

    async def _send_batch(
        self, connections: dict[str, Connection], segment: Segment, batch: Payload
    ) -> asyncio.Future[int]:
        """Send a stamped batch to the broker serving ``segment``: its base offset once
        durable there, -1 if the segment held it already. Batches sent on one connection
        are appended there in the order sent."""
        connection = await self._owner(connections, segment)
        sent = connection.send_request(ApplyBatch(segment.stream_name, segment.number), [batch])
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        def answered(sent: asyncio.Future[tuple[Message, Payload]]) -> None:
            if future.done():
                return
            if sent.cancelled():
                future.cancel()
            elif (exc := sent.exception()) is not None:
                future.set_exception(exc)
            else:
                reply = sent.result()[0]
                future.set_result(reply.base_offset if isinstance(reply, AppendAck) else -1)

        sent.add_done_callback(answered)
        return future

    async def _next_sequence(self, segment: Segment, producer_id: int, epoch: int) -> int:
        """The sequence ``segment`` expects next from ``producer_id`` at ``epoch`` (0 if it
        has none of that epoch): where a commit's batches for it start. Asked of the broker
        serving it if that is not this one; while its container moves (WrongBroker, no
        answer), asked again for up to ``_SEQUENCE_WAIT_S``, then the error is raised."""
        deadline = time.monotonic() + _SEQUENCE_WAIT_S
        while True:
            try:
                return await self._ask_next_sequence(segment, producer_id, epoch)
            except (WrongBroker, BrokerUnavailable, TimeoutError, StreamNotFound, SegmentNotFound):
                # moving, or a stream made a moment ago that its broker has not read yet
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(_APPLY_RETRY_S)

    async def _ask_next_sequence(self, segment: Segment, producer_id: int, epoch: int) -> int:
        live = self._segment(segment.stream_id, segment.number) or segment
        if self._serves(live):
            state = live.producers.get(producer_id)
            return state.next_sequence if state and state.epoch == epoch else 0
        connection = await self._owner({}, live)
        async with asyncio.timeout(PEER_TIMEOUT_S):
            reply, _ = await connection.request(
                ApplyBatch(live.stream_name, live.number, producer_id, epoch)
            )
        if not isinstance(reply, AppendAck):
            raise SlipstreamError(f"unexpected answer to ApplyBatch: {type(reply).__name__}")
        return reply.event_count

    def apply_batch(
        self, segment: Segment, batch: Payload, header: BatchHeader
    ) -> asyncio.Future[int]:
        """A batch another broker's transaction committed, for ``segment`` (served here,
        checked by the caller): appended like the coordinator's own applies, unless the
        segment holds it already (the same producer id and epoch at this sequence or past it,
        or a newer epoch: see ``_apply``), then -1 at once, nothing appended."""
        state = segment.producers.get(header.producer_id)
        if state is not None and (
            state.epoch > header.producer_epoch
            or (state.epoch == header.producer_epoch and _behind(header.sequence, state))
        ):
            done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            done.set_result(-1)
            return done
        container = self.controller.containers[segment.container]
        return container.append(segment, batch, header, applying=True)

    def next_sequence_of(self, segment: Segment, producer_id: int, epoch: int) -> int:
        """``_next_sequence`` for a segment served here (ApplyBatch without a batch)."""
        state = segment.producers.get(producer_id)
        return state.next_sequence if state and state.epoch == epoch else 0

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
        released = set()
        for (home, _), users in self._file_users.items():
            if txn_id in users:
                users.discard(txn_id)
                if not users:
                    released.add(home)
        for home in released:
            self._drop_sealed(home)

    def list(self) -> list[TxnInfo]:
        return [txn.info() for txn in self.open.values()]

    async def run(self) -> None:
        """Abort transactions that outlive their timeout; in a cluster, also take in every
        ``_IDENTITIES_REFRESH_S`` the transactional ids other brokers coordinate (their epochs
        fence this broker's appends too; ``list_identities`` shows their last commits)."""
        loop = asyncio.get_running_loop()
        refreshed = time.monotonic()
        while True:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            for txn in list(self.open.values()):
                if txn.state == "open" and (now - txn.started) * 1000 > txn.timeout_ms:
                    await self._abort(txn, f"timed out after {txn.timeout_ms} ms")
            if self.clustered and now - refreshed >= _IDENTITIES_REFRESH_S:
                refreshed = now
                try:
                    identities = await loop.run_in_executor(self._io, self.meta.identities)
                except SlipstreamError as exc:  # the next turn tries again
                    log.warning("could not read the transactional ids: %s", exc)
                    continue
                self._take_identities(identities)

    def _take_identities(self, identities: Collection[Identity]) -> None:
        """The catalog's identities, for the ids whose coordinating container this broker
        does not serve (for the others its own memory is the newest)."""
        from ..cluster import coordinator

        containers = len(self.controller.containers)
        for identity in identities:
            if coordinator(identity.transactional_id, containers) in self._journals:
                continue
            self.identities[identity.transactional_id] = identity
            self._epochs[identity.producer_id] = identity.epoch
            self._tid_of[identity.producer_id] = identity.transactional_id

    async def close(self) -> None:
        """Stop: commits under way are cancelled (a stored record is applied on restart, or
        in a cluster by the container's next holder)."""
        tasks = [*self._commits, *self._adoptions]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        loop = asyncio.get_running_loop()
        for journal in list(self._journals.values()):
            await loop.run_in_executor(self._io, journal.close)
        self._io.shutdown(wait=True)

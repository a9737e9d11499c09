"""The service layer: the operations every protocol calls, with plain arguments and values.

The binary protocol's ``Session`` (framing, flow control, the push loop of follows) is one
caller; the HTTP admin API, consumer groups and other protocols are the next ones. Each
operation takes the ``Caller`` it runs for, so that ownership, authorization, quotas and
metrics live here, once, not in every protocol.

Ownership of producer ids and transactions: a producer id (with its epoch) belongs to the
caller that ran ``init_producer`` for it. Appends carrying it, and transactions begun with it
(their appends, commit and abort), are refused with ``NotOwner`` for any other caller. A new
connection of the same client re-claims the id with the token ``init_producer`` returned
(``claim_producer``): the token is an HMAC of the id and epoch under a key kept in the data
directory, so it still holds after a broker restart, when the broker remembers no owners.
Callers let an operation run to its end once it started, also when the client that asked
for it goes away: many operations store a change in the catalog and then apply it to the live
state (a commit of positions, a reset, a stream's creation), and one cancelled in between
would leave the two apart until a restart. The binary protocol's Session does so (it cancels
only follows when a connection closes); other protocols must too.

Anonymous transactions (no transactional id) stay shared by design: any caller that knows the
id may stage into, merge or abort them (a Spark job's tasks and driver); with authentication
on, any caller of the subject that began them. A transactional id belongs to the subject
that first initialised it (docs/security.md, "Transactional ids"). An operator may abort
any open transaction (``end_txn(..., operator=True)``); until callers authenticate (the
security issue), that flag is trusted as sent, and the broker logs who used it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import itertools
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from .._errors import (
    AuthenticationFailed,
    BatchTooLarge,
    BrokerUnavailable,
    CorruptBatch,
    InvalidArgument,
    LeaseLost,
    NotOwner,
    PermissionDenied,
    SlipstreamError,
    TransactionAborted,
    WrongBroker,
)
from ..cluster import coordinator
from ..format import BatchHeader, decode_header, verify
from ..protocol import (
    AccessDecision,
    AccessRule,
    ClusterInfo,
    Cut,
    DescribeStream,
    DescribeSubscription,
    GetCut,
    GroupAssignment,
    HoldPositions,
    IdentityInfo,
    ListStreams,
    Message,
    Payload,
    PositionsHeld,
    QuotaInfo,
    ReleasePositions,
    ScaleEventInfo,
    SegmentInfo,
    StreamInfo,
    StreamList,
    SubscriptionInfo,
    TokenInfo,
    TokenIssued,
    TxnEnded,
    TxnInfo,
    TxnPositions,
)
from ..security import Action, AuditLog, Principal, Role, TokenKeys
from ..security._quotas import Quota, Quotas, decode_quota, encode_quota
from ..security._rules import (
    Decision,
    Rule,
    Rules,
    decode_rule,
    encode_rule,
    grant_command,
    make_rule,
)
from ..security._tokens import DEFAULT_EXPIRY_S
from ..storage import PositionCommit, QueueOptions, fsync_dir
from ..streams import (
    is_system_stream,
    parse_positions,
    validate_scope,
    validate_stream_name,
)
from ._browse import EventsPage, events_after, events_before
from ._cluster import Cluster, members_and_leases
from ._find import Finder, FoundEvents, check_find_arguments, find_in_cluster
from ._groups import Subscriptions
from ._metrics import DETACHED, Metrics
from ._peers import Peers, gather_answers
from ._seal import PeerSeals, Preparations

if TYPE_CHECKING:
    from ..storage import Lease
    from ._container import Container
    from ._controller import Controller
    from ._segment import Segment
    from ._transactions import Coordinator

log = logging.getLogger("slipstream.service")

#: Producer ids one caller may own at a time; the oldest grant is forgotten past this (the
#: client does not say when a producer is closed). Its next append gets NotOwner.
MAX_PRODUCERS_PER_CALLER = 4096
#: how long a group coordinated by another broker is held for a transaction's commit
#: (``HoldPositions``): how long a group waits for a transaction coordinator that died. Safe
#: at any length (the catalog refuses a record whose hold expired, ``MetaStore.add_hold``);
#: the record's write is not started in its last HOLD_MARGIN_MS, where it would be refused
HOLD_TTL_MS = 5_000
HOLD_MARGIN_MS = 1_000
#: how long a commit looks for a moving group's coordinator before it aborts
ASK_GROUP_S = 2.0
PRODUCER_KEY_FILE = "producer.key"
_KEY_BYTES = 32
_TOKEN_BYTES = 16
TOKENS_SETTING = "tokens"  # token id -> TokenInfo (msgpack): issued through the API
REVOKED_SETTING = "revoked"  # token id -> {"revoked_at": seconds} (JSON)
QUOTAS_SETTING = "quotas"
RULES_SETTING = "rules"
#: transactional id -> the subject that owns it (UTF-8), with authentication on (docs/security.md)
TXN_OWNERS_SETTING = "txn-owners"
#: (action, stream) decisions one caller keeps; past this the cache starts over
MAX_ACCESS_CACHE = 1024


@dataclass(eq=False, slots=True)
class Caller:
    """Who an operation runs for: one connection of the binary protocol (later also an HTTP
    request), with the authenticated principal once there is one. ``producers``: the producer
    ids this caller owns, oldest first."""

    connection_id: int
    peer: str
    principal: Principal | None = None
    producers: dict[int, None] = field(default_factory=dict)
    #: set by a protocol whose callers live on (a connection): called with
    #: AuthenticationFailed when the caller's token is revoked or expires, it closes the
    #: connection with that error
    end: Callable[[SlipstreamError], None] | None = None
    #: (action, stream) pairs the rules allowed, valid while ``access_version`` is the
    #: service's rules version; bounded by MAX_ACCESS_CACHE
    access: set[tuple[Action | None, str | None]] = field(default_factory=set)
    access_version: int = -1

    def __str__(self) -> str:
        return f"connection {self.connection_id} from {self.peer}"


def load_producer_key(data_dir: Path, *, fsync: bool = True) -> bytes:
    """The key producer tokens are signed with: ``<data-dir>/producer.key``, created (and made
    durable: file, then directory) on first use. A missing or short key is replaced, which
    only invalidates the tokens of producers that were running: they must ``InitProducer``
    again; no data is affected."""
    path = data_dir / PRODUCER_KEY_FILE
    try:
        key = path.read_bytes()
    except FileNotFoundError:
        key = b""
    if len(key) == _KEY_BYTES:
        return key
    if key:
        log.warning("%s is %d bytes, not %d: made a new one", path, len(key), _KEY_BYTES)
    key = secrets.token_bytes(_KEY_BYTES)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as out:
        out.write(key)
        out.flush()  # fsync syncs only what left Python's buffer
        if fsync:
            os.fsync(out.fileno())
    os.replace(tmp, path)
    if fsync:
        fsync_dir(data_dir)
    return key


class Service:
    """Streams, produce, read, producers and transactions, for any protocol.

    Errors are the typed ``SlipstreamError`` subclasses, raised (or set on the returned
    future, for appends); a protocol turns them into its own error replies."""

    metrics: Metrics = DETACHED  #: the broker's (``Metrics.attach``): counts look-ups
    #: who serves which container (docs/cluster.md); the broker sets its own
    cluster: Cluster = Cluster("", 1, enabled=False)
    #: this broker's connections to the others of its cluster (the broker sets them)
    peers: Peers = Peers(cluster)

    async def refresh_catalog(self) -> bool:
        """Read what other brokers changed in the catalog (the broker sets its own
        ``Broker.refresh_catalog``); True if it had changed."""
        return False

    def __init__(
        self,
        controller: Controller,
        coordinator: Coordinator,
        containers: Sequence[Container],
        *,
        max_batch_bytes: int,
        producer_key: bytes,
        token_keys: TokenKeys | None = None,
    ) -> None:
        self.controller = controller
        self.coordinator = coordinator
        self.containers = containers
        self.max_batch_bytes = max_batch_bytes
        self._key = producer_key
        self._owners: dict[int, Caller] = {}  # producer id -> the caller that owns it
        self._connection_ids = itertools.count(1)
        self.subscriptions = Subscriptions(controller)
        self.subscriptions.queues.service = self  # queues read other brokers' segments
        self._finder: Finder | None = None  # made on the first find
        #: quotas per scope (settings kind "quotas"); the Session applies their delays
        self.quotas = Quotas(
            {k: decode_quota(v) for k, v in controller.meta.settings(QUOTAS_SETTING).items()},
            clock=time.monotonic,
        )
        self._counted: dict[Caller, str | None] = {}  # callers admitted by ``admit``
        #: the signing keys when authentication is on (``up --auth``), else None
        self.token_keys = token_keys
        #: ids of revoked tokens (settings kind "revoked"), refused at once, also when open
        self.revoked: set[str] = set(controller.meta.settings("revoked"))
        self._by_token: dict[str, set[Caller]] = {}  # token id -> its callers that live on
        self.audit = AuditLog()
        self.rules = Rules(
            [decode_rule(v) for v in controller.meta.settings(RULES_SETTING).values()]
        )
        self._rules_version = 0  # callers' cached decisions hold while it is unchanged
        #: segments prepared here for merges other brokers coordinate (_seal.py)
        self.seals = Preparations(controller, coordinator.touching, lambda: self.refresh_catalog())
        self._txn_owners: dict[str, str] = {
            tid: subject.decode()
            for tid, subject in controller.meta.settings(TXN_OWNERS_SETTING).items()
        }
        #: open anonymous transaction -> the subject that began it (authentication on)
        self._anonymous_owners: dict[int, str] = {}
        #: commits holding groups on other brokers (``_commit_with_holds``), run to the end
        #: even if their caller goes: a hold is released only once the outcome is known
        self._holding: set[asyncio.Task[TxnEnded]] = set()
        #: this broker asking itself (a hold on a group of another of its containers)
        self._itself = Caller(0, "this broker", None)

    # --- callers -----------------------------------------------------------------------------

    def connect(self, peer: str, principal: Principal | None = None) -> Caller:
        """A new caller (one connection); ``disconnect`` it when it goes."""
        return Caller(next(self._connection_ids), peer, principal)

    @property
    def auth(self) -> bool:
        """Whether callers must authenticate (``slipstream up --auth``)."""
        return self.token_keys is not None

    def authenticate(
        self,
        caller: Caller,
        credentials: Mapping[str, str] | None,
        certificate_subject: str | None = None,
    ) -> None:
        """Set ``caller.principal`` from its credentials when authentication is on (nothing
        to do when off). A token (``credentials["token"]``) wins over a client certificate's
        subject (``certificate_subject``, the CN of a certificate the TLS layer verified
        against ``--tls-client-ca``). A token caller with ``caller.end`` set is kept by token
        id, so that revoking the token ends it. Raises AuthenticationFailed (reason and fix
        in it; audited as ``authentication_failed``) for no credentials or a bad token."""
        if self.token_keys is None:
            return
        token = (credentials or {}).get("token")
        try:
            if token or certificate_subject is None:
                principal = self.token_keys.verify(token, revoked=self.revoked)
            else:
                principal = Principal(certificate_subject, Role.USER, method="certificate")
        except AuthenticationFailed as exc:
            self.audit.record(
                "authentication_failed",
                subject=None,
                peer=caller.peer,
                reason=exc.details.get("reason"),
                token_id=exc.details.get("token_id"),
            )
            raise
        caller.principal = principal
        if principal.token_id is not None and caller.end is not None:
            self._by_token.setdefault(principal.token_id, set()).add(caller)

    # --- tokens (admin only) -----------------------------------------------------------------

    async def create_token(
        self,
        caller: Caller,
        subject: str,
        role: str = "user",
        scope: str | None = None,
        expires_s: int = 0,
        algorithm: str = "EdDSA",
    ) -> TokenIssued:
        """Sign a token (``expires_s`` 0: 30 days) and record its id and claims (settings kind
        "tokens"; never the token itself) before it returns. Raises PermissionDenied for a
        caller without admin, InvalidArgument for a bad role, algorithm or lifetime, or when
        authentication is off (no keys)."""
        self._authorize(caller, Action.ADMIN, None)
        keys = self._keys()
        issued = keys.issue(
            subject,
            role,
            scope=scope,
            expires_s=expires_s or DEFAULT_EXPIRY_S,
            algorithm=algorithm,
        )
        info = TokenInfo(
            issued.token_id,
            issued.subject,
            issued.role.value,
            issued.scope,
            issued.issued_at,
            issued.expires_at,
        )
        await self.controller.in_catalog(
            self.controller.meta.put_setting,
            TOKENS_SETTING,
            info.token_id,
            msgspec.msgpack.encode(info),
        )
        self.audit.record(
            "token_created",
            subject=_subject(caller),
            peer=caller.peer,
            token_id=info.token_id,
            for_subject=info.subject,
            role=info.role,
            scope=info.scope,
            expires_at=info.expires_at,
        )
        return TokenIssued(issued.token, info)

    async def revoke_token(self, caller: Caller, token_id: str) -> None:
        """Refuse the token from now on (durable before it returns, kept across restarts)
        and close the connections that use it with ``authentication_failed``. An id this
        broker never issued through the API (a bootstrap token) is revoked all the same.
        Raises PermissionDenied, InvalidArgument for an empty id."""
        self._authorize(caller, Action.ADMIN, None)
        self._keys()
        token_id = token_id.strip()
        if not token_id or len(token_id) > 64:
            raise InvalidArgument("pass the token's id (slipstream token list shows them)")
        revoked_at = msgspec.json.encode({"revoked_at": int(time.time())})
        await self.controller.in_catalog(
            self.controller.meta.put_setting, REVOKED_SETTING, token_id, revoked_at
        )
        self.revoked.add(token_id)
        self.audit.record(
            "token_revoked", subject=_subject(caller), peer=caller.peer, token_id=token_id
        )
        for victim in self._by_token.pop(token_id, set()):
            if victim.end is not None:
                victim.end(
                    AuthenticationFailed(
                        f"authentication failed: token {token_id} revoked; connect again with "
                        "a new token",
                        reason="revoked",
                        token_id=token_id,
                    )
                )

    def list_tokens(self, caller: Caller) -> list[TokenInfo]:
        """Tokens issued through the API, oldest first, and every revoked id (a revoked
        bootstrap token shows with its id only). Raises PermissionDenied."""
        self._authorize(caller, Action.ADMIN, None)
        self._keys()
        tokens = [
            msgspec.msgpack.decode(raw, type=TokenInfo)
            for raw in self.controller.meta.settings(TOKENS_SETTING).values()
        ]
        tokens = [msgspec.structs.replace(t, revoked=t.token_id in self.revoked) for t in tokens]
        known = {t.token_id for t in tokens}
        tokens.extend(
            TokenInfo(token_id, "", "", None, 0, 0, revoked=True)
            for token_id in sorted(self.revoked - known)
        )
        return sorted(tokens, key=lambda t: (t.created_at, t.token_id))

    def _keys(self) -> TokenKeys:
        if self.token_keys is None:
            raise InvalidArgument(
                "authentication is off on this broker: tokens mean nothing to it; start it "
                "with 'slipstream up --auth'"
            )
        return self.token_keys

    def disconnect(self, caller: Caller) -> None:
        """The caller is gone: its producer ids are owned by nobody until claimed again, and
        its group members leave (their segments move to the others at once)."""
        principal = caller.principal
        if principal is not None and principal.token_id is not None:
            callers = self._by_token.get(principal.token_id)
            if callers is not None:
                callers.discard(caller)
                if not callers:
                    del self._by_token[principal.token_id]
        if caller in self._counted:
            self.quotas.close_connection(self._counted.pop(caller))
        self.subscriptions.disconnect(caller)
        for producer_id in caller.producers:
            if self._owners.get(producer_id) is caller:
                del self._owners[producer_id]
        caller.producers.clear()

    # --- streams -----------------------------------------------------------------------------

    async def create_stream(
        self,
        caller: Caller,
        name: str,
        segments: int,
        retention_ms: int | None = None,
        retention_bytes: int | None = None,
        scaling: str = "",
    ) -> StreamInfo:
        """Raises StreamExists, InvalidName, InvalidArgument (also a bad scaling policy)."""
        self._authorize(caller, Action.MANAGE, name)
        stream = await self.controller.create_stream(
            name, segments, retention_ms, retention_bytes, scaling
        )
        self._audited(
            caller,
            "stream_created",
            stream=name,
            segments=len(stream.segments),
            retention_ms=retention_ms,
            retention_bytes=retention_bytes,
            scaling=stream.scaling,
        )
        return stream.info()

    async def update_stream(
        self,
        caller: Caller,
        name: str,
        retention_ms: int | None = None,
        retention_bytes: int | None = None,
        scaling: str | None = None,
    ) -> StreamInfo:
        """Change a stream's retention and/or scaling policy (``scaling``: a policy's text,
        "" for none, None to leave it). For each limit: None leaves it as it is, 0 removes it
        (keep forever / no size limit), a positive value replaces it. Stored in the catalog
        before it returns (a restart keeps it); the next retention pass applies it, and what
        an earlier pass removed stays removed. Raises StreamNotFound, InvalidName,
        InvalidArgument (a negative or too large limit), StorageError / StorageFull."""
        self._authorize(caller, Action.MANAGE, name)
        if scaling is not None:
            self._refuse_system(name, "scale")
            await self.controller.update_scaling(name, scaling)
        if scaling is None or retention_ms is not None or retention_bytes is not None:
            await self.controller.update_retention(name, retention_ms, retention_bytes)
        self._audited(
            caller,
            "stream_updated",
            stream=name,
            retention_ms=retention_ms,
            retention_bytes=retention_bytes,
            scaling=scaling,
        )
        return self.controller.stream(name).info()

    async def delete_stream(self, caller: Caller, name: str) -> None:
        """Delete a stream, its data and its subscriptions; its followers get StreamNotFound,
        its groups' members SubscriptionNotFound on their next poll."""
        self._authorize(caller, Action.MANAGE, name)
        self._refuse_system(name, "delete")
        stream = self.controller.stream(name)
        await self.controller.delete_stream(name)
        self.subscriptions.forget_stream(stream)
        self._audited(caller, "stream_deleted", stream=name)

    async def scale_stream(
        self, caller: Caller, name: str, segments: Sequence[int], into: int = 2
    ) -> StreamInfo:
        """Split one open segment into ``into`` successors, or merge adjacent open segments,
        in a new epoch (see ``Controller.scale``). Waits for transactions that staged into
        them to end. Raises StreamNotFound, SegmentNotFound, InvalidArgument.

        In a cluster the broker serving the lowest-numbered segment does it (WrongBroker
        elsewhere); the others' brokers prepare theirs for it (docs/cluster.md, "Scaling
        across brokers"): a broker that does not answer, or a container that moves meanwhile,
        fails the merge (InvalidArgument, LeaseLost, BrokerUnavailable) and every segment
        takes appends again."""
        self._authorize(caller, Action.MANAGE, name)
        self._refuse_system(name, "scale")
        known = self.controller.stream(name).segments
        named = [known[n] for n in segments if n in known]  # unknown: SegmentNotFound below
        if named and self.cluster.enabled:
            self._served(min(named, key=lambda s: s.number))  # WrongBroker: its broker leads
        stream = await self.controller.scale(
            name,
            segments,
            into,
            self.coordinator.touching,
            served=self.is_served if self.cluster.enabled else None,
            remote=self.peer_seals,
        )
        self._audited(caller, "stream_scaled", stream=name, segments=list(segments), into=into)
        return stream.info()

    @property
    def peer_seals(self) -> PeerSeals:
        """The coordinator's side of merges across brokers (``Controller.scale(remote=...)``)."""
        return PeerSeals(self.peers, self.cluster)

    async def prepare_seal(
        self,
        caller: Caller,
        stream: str,
        segments: Sequence[int],
        epoch: int,
        coordinator: str,
        wait_ms: int,
        max_rate: float,
    ) -> Message:
        """``PrepareSeal`` (broker to broker): close ``segments``, served here, for the merge
        another broker coordinates -> ``SealPrepared`` (see _seal.Preparations.prepare).
        Admin only with authentication on; InvalidArgument on a standalone broker;
        WrongBroker unless this broker serves every one of them."""
        self._authorize(caller, Action.ADMIN, None)
        if not self.cluster.enabled:
            raise InvalidArgument("PrepareSeal is sent between the brokers of a cluster")
        self._refuse_system(stream, "scale")
        target = self.controller.stream(stream)
        for number in segments:
            self._served(target.segment(number))

        def lease(segment: Segment) -> Lease:
            container = self.containers[segment.container]
            self._served(segment)
            if container.lease is None:
                raise self.cluster.wrong_broker(segment.container, "a segment")
            return container.lease

        return await self.seals.prepare(
            target, segments, epoch, coordinator, min(wait_ms, 10_000), max_rate, lease
        )

    async def end_seal(
        self, caller: Caller, stream: str, segments: Sequence[int], epoch: int, committed: bool
    ) -> None:
        """``EndSeal`` (broker to broker): the outcome of a merge that prepared ``segments``
        here. Admin only with authentication on."""
        self._authorize(caller, Action.ADMIN, None)
        await self.seals.end(self.controller.stream(stream), segments, epoch, committed)

    def scale_history(self, caller: Caller, name: str) -> list[ScaleEventInfo]:
        self._authorize(caller, None, name)
        return [
            ScaleEventInfo(r.epoch, r.at_ms, r.sealed, r.created, r.decision.decode())
            for r in self.controller.scale_history(name)
        ]

    def list_streams(self, caller: Caller, scope: str | None = None) -> list[StreamInfo]:
        """The streams (of ``scope``, or all) the caller may act on: with authentication on,
        those some rule lets it produce to, consume or manage (all for the admin role)."""
        streams = self.controller.list_streams(scope)
        if caller.principal is not None:
            streams = [s for s in streams if self._may(caller, None, s.name)]
        return [s.info() for s in streams]

    def describe_stream(self, caller: Caller, name: str) -> StreamInfo:
        """Any of produce, consume or manage allows it (a producer routes by the segments).
        This broker's own view: in a cluster, the segments it does not serve are as of the
        catalog (``stream_info`` asks their brokers)."""
        self._authorize(caller, None, name)
        return self.controller.stream(name).info()

    async def stream_info(self, caller: Caller, name: str, local: bool = False) -> StreamInfo:
        """The stream with every segment's live state: in a cluster, each segment as the
        broker serving it knows it (asked with ``local``); ``local``: only the segments this
        broker serves. WrongBroker while a container has nobody serving it (moving)."""
        info = self.describe_stream(caller, name)
        if not self.cluster.enabled:
            return info
        if local:
            return self._served_part(info)
        (merged,) = await self._live(
            lambda: [self.describe_stream(caller, name)], lambda: DescribeStream(name, local=True)
        )
        return merged

    async def list_streams_live(
        self, caller: Caller, scope: str | None = None, local: bool = False
    ) -> list[StreamInfo]:
        """``list_streams`` with every segment's live state (see ``stream_info``)."""
        infos = self.list_streams(caller, scope)
        if not self.cluster.enabled:
            return infos
        if local:
            return [self._served_part(info) for info in infos]
        return await self._live(
            lambda: self.list_streams(caller, scope), lambda: ListStreams(scope, local=True)
        )

    async def cut(
        self,
        caller: Caller,
        stream: str,
        at: str,
        timestamp_ms: int | None = None,
        local: bool = False,
    ) -> dict[int, int]:
        """``{segment: offset}`` at "earliest", "latest" or "time" (``timestamp_ms``); in a
        cluster each segment's from the broker serving it (``local``: only this one's)."""
        self._authorize(caller, Action.CONSUME, stream)
        return await self._cut(stream, at, timestamp_ms, local)

    async def _cut(
        self, stream: str, at: str, timestamp_ms: int | None, local: bool = False
    ) -> dict[int, int]:
        if not self.cluster.enabled:
            return await self.controller.cut(stream, at, timestamp_ms)
        mine = await self.controller.cut(stream, at, timestamp_ms, self.is_served)
        if local:
            return mine
        positions, stale = await self._cut_from_peers(stream, at, timestamp_ms, mine)
        if stale:  # a scale elsewhere this broker missed (or took in while it asked)
            await self.refresh_catalog()
            mine = await self.controller.cut(stream, at, timestamp_ms, self.is_served)
            positions, _ = await self._cut_from_peers(stream, at, timestamp_ms, mine)
        return positions

    async def _cut_from_peers(
        self, stream: str, at: str, timestamp_ms: int | None, mine: dict[int, int]
    ) -> tuple[dict[int, int], bool]:
        """``mine`` with the other segments' positions from the brokers serving them, and
        whether those named segments this broker does not know (it must read the catalog)."""
        missing = {
            n: s.container
            for n, s in self.controller.stream(stream).segments.items()
            if n not in mine
        }
        if not missing:
            return mine, False
        asked = await gather_answers(
            self.peers,
            {
                owner: GetCut(stream, at, timestamp_ms, local=True)
                for owner in self._owners_of(missing.values(), f"a segment of {stream!r}")
            },
        )
        positions = dict(mine)
        for number, cid in missing.items():
            answer = asked.get(self.cluster.owners[cid])
            if not isinstance(answer, Cut) or number not in answer.positions:
                raise self.cluster.wrong_broker(cid, f"segment {number} of {stream!r}")
            positions[number] = answer.positions[number]
        known = self.controller.stream(stream).segments
        stale = any(
            n not in known for a in asked.values() if isinstance(a, Cut) for n in a.positions
        )
        return positions, stale

    def is_served(self, segment: Segment) -> bool:
        """Whether this broker serves ``segment`` (its live object, in a container it holds)."""
        container = self.containers[segment.container]
        return container.serving and container.segments.get(segment.global_id) is segment

    def _served_part(self, info: StreamInfo) -> StreamInfo:
        served = {c.id for c in self.containers if c.serving}
        return msgspec.structs.replace(
            info, segments=[s for s in info.segments if s.container in served]
        )

    def _owners_of(self, containers: Iterable[int], what: str) -> set[str]:
        """The brokers serving ``containers`` (WrongBroker for one that nobody serves)."""
        owners = set()
        for cid in containers:
            owner = self.cluster.owners[cid]
            if not owner or owner == self.cluster.broker_id:
                raise self.cluster.wrong_broker(cid, what)
            owners.add(owner)
        return owners

    async def _live(
        self, infos: Callable[[], list[StreamInfo]], local_request: Callable[[], Message]
    ) -> list[StreamInfo]:
        """``infos()`` merged with the other brokers' live answers (``_merged``); once more
        after reading the catalog if those show a scale this broker has not read yet (a
        description missing the successors would route keys to sealed segments)."""
        merged, stale = await self._merged(infos(), local_request)
        if stale:  # merged again even when this refresh read nothing new: the periodic
            await self.refresh_catalog()  # refresh may have taken the scale in meanwhile
            merged, _ = await self._merged(infos(), local_request)
        return merged

    async def _merged(
        self, infos: list[StreamInfo], local_request: Callable[[], Message]
    ) -> tuple[list[StreamInfo], bool]:
        """``infos`` with each segment this broker does not serve replaced by what the broker
        serving it answers to ``local_request``: one request per broker, all at once; and
        whether an answer showed a segment unknown here or sealed while open here."""
        served = {c.id for c in self.containers if c.serving}
        others = {s.container for i in infos for s in i.segments if s.container not in served}
        if not others:
            return infos, False
        owners = self._owners_of(others, "a segment")
        answers = await gather_answers(self.peers, {o: local_request() for o in owners})
        live: dict[tuple[str, int], SegmentInfo] = {}
        for owner, answer in answers.items():
            listed = (
                [answer]
                if isinstance(answer, StreamInfo)
                else answer.streams
                if isinstance(answer, StreamList)
                else []
            )
            for info in listed:
                for segment in info.segments:
                    if self.cluster.owners[segment.container] == owner:
                        live[info.name, segment.number] = segment
        known = {(i.name, s.number): s.sealed for i in infos for s in i.segments}
        stale = any(
            (key not in known or (segment.sealed and not known[key]))
            for key, segment in live.items()
            if key[0] in {i.name for i in infos}
        )
        merged = []
        for info in infos:
            segments = []
            for segment in info.segments:
                if segment.container not in served:
                    found = live.get((info.name, segment.number))
                    if found is None:
                        raise self.cluster.wrong_broker(
                            segment.container, f"segment {segment.number} of {info.name!r}"
                        )
                    segment = found
                segments.append(segment)
            merged.append(msgspec.structs.replace(info, segments=segments))
        return merged, stale

    # --- produce -----------------------------------------------------------------------------

    def append(
        self, caller: Caller, stream: str, segment: int, txn: int | None, batch: Payload
    ) -> tuple[asyncio.Future[int] | asyncio.Future[None], BatchHeader]:
        """Check one record batch and append it (or stage it in transaction ``txn``). The
        future resolves to the batch's base offset once it is durable (None when staged), or
        fails with StorageFull / StorageError: then nothing of it was acknowledged. Raises at
        once for a bad batch (BatchTooLarge, CorruptBatch), an unknown stream or segment, a key
        outside the segment's key range (KeyOutOfRange), a fenced producer (ProducerFenced) or
        another caller's producer id or transaction (NotOwner)."""
        if len(batch) > self.max_batch_bytes:
            raise BatchTooLarge(
                f"batch of {len(batch)} bytes exceeds the limit of {self.max_batch_bytes}",
                limit=self.max_batch_bytes,
            )
        self._authorize(caller, Action.PRODUCE, stream)
        self._refuse_system(stream, "append to")
        target = self.controller.stream(stream).segment(segment)
        if txn is None:  # a transaction's batches are staged by its coordinator, served or not
            self._served(target)
        header = verify(batch)
        if header.batch_length != len(batch):
            raise CorruptBatch(
                f"an Append carries exactly one batch: header says {header.batch_length} bytes, "
                f"payload has {len(batch)}"
            )
        target.check_keys(batch)  # KeyOutOfRange: a sender routing by a stale or wrong view
        if txn is not None:
            self._check_txn_owner(caller, txn)
            return self.coordinator.stage(txn, target, batch, header), header
        producer_id = header.producer_id
        if producer_id >= 0:
            self.coordinator.check_epoch(producer_id, header.producer_epoch)
            if producer_id not in caller.producers:
                raise self._not_owner(caller, producer_id)
        return self.containers[target.container].append(target, batch, header), header

    # --- read --------------------------------------------------------------------------------

    def segment(self, caller: Caller, stream: str, segment: int) -> Segment:
        """A segment to read (StreamNotFound, SegmentNotFound, PermissionDenied)."""
        self._authorize(caller, Action.CONSUME, stream)
        target = self.controller.stream(stream).segment(segment)
        self._served(target)
        return target

    async def read(
        self, caller: Caller, segment: Segment, offset: int, max_bytes: int
    ) -> list[bytes | bytearray | memoryview]:
        """Whole batches from ``offset`` (at least one if any, then up to ``max_bytes``); []
        at the end. Raises OffsetOutOfRange, CorruptData, StreamNotFound (deleted),
        PermissionDenied (a rule revoked since the follow began)."""
        self._authorize(caller, Action.CONSUME, segment.stream_name)
        self._served(segment)
        return await self.containers[segment.container].read(segment, offset, max_bytes)

    async def read_segment(
        self, caller: Caller, stream: str, segment: int, offset: int, max_bytes: int
    ) -> tuple[list[bytes | bytearray | memoryview], int, int, bool]:
        """ReadSegment (a queue's coordinator reading a segment it does not serve; docs/
        cluster.md): whole batches from ``offset`` -> (batches, the offset after them, the
        segment's durable end, sealed). Raises WrongBroker (not served here), OffsetOutOfRange,
        StreamNotFound, SegmentNotFound, PermissionDenied (consume)."""
        target = self.segment(caller, stream, segment)
        batches = await self.containers[target.container].read(target, offset, max_bytes)
        after = decode_header(batches[-1]).next_offset if batches else offset
        return batches, after, target.next_offset, target.sealed

    def _served(self, segment: Segment) -> None:
        """In a cluster: WrongBroker unless this broker serves the segment's container (and
        ``segment`` is its live object, not one a hand-over left behind)."""
        if not self.cluster.enabled or segment.deleted:
            return
        if not self.is_served(segment) or self.containers[segment.container].lease_lost:
            raise self.cluster.wrong_broker(
                segment.container, f"segment {segment.number} of {segment.stream_name!r}"
            )

    def _coordinated(self, key: str, what: str) -> None:
        """In a cluster: WrongBroker unless this broker serves the container that coordinates
        ``key`` (a subscription's group: "stream/name"; a transactional id)."""
        if not self.cluster.enabled:
            return
        cid = coordinator(key, self.cluster.count)
        if not self.containers[cid].serving:
            raise self.cluster.wrong_broker(cid, what)

    async def describe_cluster(self) -> ClusterInfo:
        """The brokers and which serves each container: the map clients route by. Any caller
        may ask (it names no stream); a standalone broker names itself everywhere. In a
        cluster the members and leases are read from the catalog now (this broker's own
        view lags by up to a membership turn): a container's owner is the live member that
        holds its lease ("" while nobody does)."""
        served = [c.id for c in self.containers if c.serving]
        if self.cluster.enabled:
            members, leases = await self.controller.in_catalog(
                members_and_leases, self.controller.meta
            )
            self.cluster.members = {
                m.broker_id: m for m in members if m.broker_id != self.cluster.broker_id
            }
            live = {m.broker_id for m in members}
            for lease in leases:
                if lease.container < self.cluster.count:
                    held = lease.expires_ms > 0 and lease.owner in live
                    self.cluster.owners[lease.container] = lease.owner if held else ""
        return self.cluster.info(served)

    async def find_events(
        self,
        caller: Caller,
        stream: str,
        *,
        key: bytes | str | None = None,
        start_ms: int | None = None,
        end_ms: int | None = None,
        limit: int = 100,
        newest_first: bool = True,
        local: bool = False,
    ) -> FoundEvents:
        """Events of ``stream`` with routing key ``key`` (any if None; a str is UTF-8) and a
        time in ``[start_ms, end_ms)`` (open where None), at most ``limit`` (1..10,000), the
        newest (``newest_first``, returned newest first) or the oldest; each with its segment
        and offset. Reads only the batches the find indexes name (broker/_find.py says how,
        and the order across scaled segments). In a cluster the brokers serving the other
        segments are asked for theirs at once and the answers merged into what one broker
        would return (``find_in_cluster``); ``local``: only the segments this broker serves,
        named in ``searched``. Raises StreamNotFound (also for a stream deleted meanwhile),
        InvalidArgument for a bad limit or window, CorruptData for damaged bytes in a batch
        it must read, WrongBroker in a cluster while a segment has nobody serving it. The
        events returned count as consumed, with ``read="lookup"`` (docs/metrics.md), on the
        broker that was asked (not on those it asked)."""
        self._authorize(caller, Action.CONSUME, stream)
        if isinstance(key, str):
            key = key.encode()
        check_find_arguments(start_ms, end_ms, limit)
        segments = list(self.controller.stream(stream).segments.values())
        if self._finder is None:
            self._finder = Finder(self.controller.meta, self.containers, self.controller.read_pool)
        if self.cluster.enabled:
            found = await find_in_cluster(
                self,
                self._finder,
                stream,
                segments,
                key=key,
                start_ms=start_ms,
                end_ms=end_ms,
                limit=limit,
                newest_first=newest_first,
                local=local,
            )
        else:
            found = await self._finder.find(
                segments,
                key=key,
                start_ms=start_ms,
                end_ms=end_ms,
                limit=limit,
                newest_first=newest_first,
            )
            found = FoundEvents(
                found.events,
                found.batches_read,
                found.truncated,
                tuple(sorted(s.number for s in segments)),
            )
        if not local:
            self.metrics.looked_up(stream, found.events)  # consumed, read="lookup"
        return found

    async def browse_events(
        self,
        caller: Caller,
        stream: str,
        *,
        before: Mapping[int, int] | str | None = None,
        after: Mapping[int, int] | str | None = None,
        at: str = "latest",
        timestamp_ms: int | None = None,
        limit: int = 50,
    ) -> EventsPage:
        """A page of ``stream``'s events, oldest first, with the cuts of its neighbours
        (broker/_browse.py says how pages are cut): the newest ``limit`` below ``before``, the
        oldest from ``after`` on, or, with neither, the newest page (``at`` "latest") or the
        page from ``cut(at, timestamp_ms)`` on ("earliest", "time"). A cut is ``{segment:
        offset}`` or its text form ``0:12,1:40`` (streams.parse_positions). Raises
        StreamNotFound, InvalidArgument (a bad cut or ``limit``, not 1..500, or both
        ``before`` and ``after``), CorruptData for damaged bytes it must read. In a cluster
        the page is cut from every segment's live bounds (``stream_info``), the segments
        other brokers serve read from them (``ReadSegment``); WrongBroker while one has
        nobody serving it. The page's events count as consumed, with ``read="lookup"``
        (docs/metrics.md)."""
        if before is not None and after is not None:
            raise InvalidArgument("browse before a cut or after one, not both")
        self._authorize(caller, Action.CONSUME, stream)
        info = await self.stream_info(caller, stream)
        if isinstance(before, str):
            before = parse_positions(before)
        if isinstance(after, str):
            after = parse_positions(after)
        if before is not None:
            page = await events_before(self, caller, info, before, limit)
        elif after is None and at == "latest":
            page = await events_before(self, caller, info, None, limit)
        else:
            if after is None:
                after = await self.cut(caller, stream, at, timestamp_ms)
            page = await events_after(self, caller, info, after, limit)
        self.metrics.looked_up(stream, page.events)  # consumed, read="lookup"
        return page

    # --- producers ---------------------------------------------------------------------------

    async def init_producer(
        self, caller: Caller, transactional_id: str | None = None
    ) -> tuple[int, int, bytes]:
        """A producer id and epoch owned by ``caller``, and the token that claims them from
        another connection. With a transactional id: its stable id and the next epoch, which
        fences the older producers of the id and aborts their open transaction. With
        authentication on, the caller must be allowed to produce to some stream, and a
        transactional id belongs to the subject that first initialised it: another subject
        gets PermissionDenied, nothing fenced (``_own_transactional_id``)."""
        self._authorize_somewhere(caller, Action.PRODUCE)
        home = -1
        if transactional_id is not None:
            home = self._txn_home(transactional_id)
            await self._own_transactional_id(caller, transactional_id)
        producer_id, epoch = await self.coordinator.init_producer(transactional_id, home)
        self._own(caller, producer_id)
        return producer_id, epoch, self._token(producer_id, epoch)

    def claim_producer(self, caller: Caller, producer_id: int, epoch: int, token: bytes) -> None:
        """Make ``caller`` the owner of a producer id it was granted on an earlier connection
        (or before a broker restart). Raises NotOwner for a wrong token, ProducerFenced when a
        newer producer took the id's transactional id; with authentication on,
        PermissionDenied when that transactional id belongs to another subject."""
        if not hmac.compare_digest(token, self._token(producer_id, epoch)):
            raise NotOwner(
                f"the token does not match producer {producer_id} epoch {epoch}; claim only ids "
                "this client was granted (InitProducer), or ask for a new one",
                producer_id=producer_id,
            )
        transactional_id = self.coordinator.transactional_id(producer_id)
        if transactional_id is not None:
            self._check_transactional_id(caller, transactional_id)
        self.coordinator.check_epoch(producer_id, epoch)
        self._own(caller, producer_id)

    # --- transactions ------------------------------------------------------------------------

    async def begin_txn(
        self, caller: Caller, producer_id: int, epoch: int, timeout_ms: int, label: str = ""
    ) -> int:
        """Open a transaction of the caller's producer id (-1: anonymous, shared by id).
        With authentication on, the caller must be allowed to produce to some stream; each
        append into it and its commit are checked against the streams they touch (what a
        transaction can change is decided there), and an anonymous one is shared only by
        connections of the subject that began it (``_check_anonymous_owner``)."""
        self._authorize_somewhere(caller, Action.PRODUCE)
        home = -1
        if producer_id >= 0:
            self.coordinator.check_epoch(producer_id, epoch)
            if producer_id not in caller.producers:
                raise self._not_owner(caller, producer_id)
            transactional_id = self.coordinator.transactional_id(producer_id)
            if transactional_id is not None:
                home = self._txn_home(transactional_id)
        elif self.cluster.enabled:  # anonymous: staged by the lowest container served here
            served = [c.id for c in self.containers if c.serving]
            if not served:
                raise self.cluster.wrong_broker(0, "a transaction")
            home = served[0]
        txn_id = await self.coordinator.begin(producer_id, epoch, timeout_ms, label, home)
        if producer_id < 0 and caller.principal is not None:
            owners = self._anonymous_owners
            if len(owners) > 2 * len(self.coordinator.open) + 1024:  # ended ones, now and then
                self._anonymous_owners = owners = {
                    t: s for t, s in owners.items() if t in self.coordinator.open
                }
            owners[txn_id] = caller.principal.subject
        return txn_id

    async def end_txn(
        self,
        caller: Caller,
        txn_id: int,
        commit: bool,
        metadata: bytes = b"",
        merge: Sequence[int] = (),
        *,
        operator: bool = False,
        positions: Sequence[TxnPositions] = (),
    ) -> TxnEnded:
        """Commit or abort. Only the owner may end an open transaction, except an operator's
        abort; asking again about one that already ended is answered to anyone. A commit's
        ``positions`` (subscription positions consumed) are stored with it, atomically;
        NotAssigned / StaleGeneration / UnknownMember abort the transaction instead. With
        authentication on: an operator's abort needs the admin action, a commit produce on
        every stream it (and each transaction it merges) staged into, and consume on the
        stream of every position it stores."""
        if operator:
            self._authorize(caller, Action.ADMIN, None)
            if commit:
                raise InvalidArgument("an operator may abort a transaction, not commit it")
            txn = self.coordinator.open.get(txn_id)
            if (
                txn is not None
                and not txn.anonymous
                and txn.identity.producer_id not in caller.producers
            ):
                log.warning("transaction %d aborted by an operator (%s)", txn_id, caller)
        else:
            self._check_txn_owner(caller, txn_id)
            for merged in merge:
                self._check_anonymous_owner(caller, merged)
            if commit and caller.principal is not None:
                for stream in self._staged_streams([txn_id, *merge]):
                    self._authorize(caller, Action.PRODUCE, stream)
                for consumed in positions:
                    self._authorize(caller, Action.CONSUME, consumed.stream)
        if not (commit and positions and txn_id in self.coordinator.open):
            ended = await self.coordinator.end(txn_id, commit, metadata, list(merge))
            if operator:
                self._audited(caller, "transaction_aborted", txn_id=txn_id)
            return ended
        home = self.coordinator.open[txn_id].home
        remote = {
            i: o for i, p in enumerate(positions) if (o := self._group_owner(p, home)) is not None
        }
        if remote and self.coordinator.open[txn_id].state == "open":
            task = asyncio.get_running_loop().create_task(
                self._commit_with_holds(caller, txn_id, metadata, list(merge), positions, remote)
            )
            self._holding.add(task)
            task.add_done_callback(self._holding.discard)
            return await asyncio.shield(task)
        # positions consumed: stored with the commit record if this caller's members still
        # hold those segments; if not (a zombie), the transaction aborts
        checked = False
        try:
            async with self.subscriptions.committing(caller, positions) as commits:
                checked = True
                return await self.coordinator.end(txn_id, True, metadata, list(merge), commits)
        except SlipstreamError:
            if not checked:
                with contextlib.suppress(SlipstreamError):
                    await self.coordinator.end(txn_id, False, b"")
            raise

    def _group_owner(self, consumed: TxnPositions, home: int) -> str | None:
        """The broker to hold ``consumed``'s group at for a commit coordinated by container
        ``home``: None when the group is coordinated by ``home`` itself (or standalone), whose
        lease fences the record; else the broker serving the group's container ("" if nobody
        does right now), this one included: a group of another container of this broker is
        held through its catalog row like another broker's, since its container may be
        handed over while the record is written (the record carries only ``home``'s lease)."""
        if not self.cluster.enabled:
            return None
        cid = coordinator(f"{consumed.stream}/{consumed.subscription}", self.cluster.count)
        if cid == home:
            return None
        if self.containers[cid].serving:
            return self.cluster.broker_id
        owner = self.cluster.owners[cid]
        return "" if owner == self.cluster.broker_id else owner

    async def _commit_with_holds(
        self,
        caller: Caller,
        txn_id: int,
        metadata: bytes,
        merge: list[int],
        positions: Sequence[TxnPositions],
        remote: dict[int, str],
    ) -> TxnEnded:
        """A commit storing positions of groups coordinated by other brokers (``remote``:
        index in ``positions`` -> broker; docs/cluster.md, "Consume-transform-produce").
        The local groups are held by ``committing`` as on one broker; the others, just
        before the commit record is written, by their coordinators (``HoldPositions``, one
        at a time in one order), which check the positions as a member's commit. The record
        is stored only by consuming every hold's row in the catalog (a hold that expired or
        whose group moved is gone: the transaction aborts), and its write is not started
        past HOLD_TTL_MS - HOLD_MARGIN_MS or a coordinator's lease as it answered (it would
        be refused); then the holds are released, telling whether it was stored. A failed
        check (NotAssigned, StaleGeneration, UnknownMember, ...) aborts the transaction with
        that error; a group coordinator that cannot be reached aborts it with
        TransactionAborted."""
        subject = caller.principal.subject if caller.principal is not None else ""
        home = self.coordinator.open[txn_id].home
        local = [p for i, p in enumerate(positions) if i not in remote]
        holds: list[tuple[str, int]] = []

        async def hold() -> tuple[list[PositionCommit], float, list[int]]:
            started = time.monotonic()
            valid_ms = HOLD_TTL_MS - HOLD_MARGIN_MS
            held = []
            for i in sorted(remote, key=lambda i: (positions[i].stream, positions[i].subscription)):
                consumed = positions[i]
                hold_id = secrets.randbits(62)
                answer = await self._ask_group(
                    remote[i],
                    HoldPositions(hold_id, txn_id, subject, HOLD_TTL_MS, consumed),
                    home,
                    holds,
                )
                valid_ms = min(valid_ms, answer.valid_ms)
                held.append(
                    PositionCommit(
                        answer.stream_id,
                        consumed.subscription,
                        consumed.generation,
                        dict(consumed.positions),
                    )
                )
            return held, started + valid_ms / 1000, list(dict.fromkeys(h for _, h in holds))

        stored, checked = 0, False
        try:
            async with self.subscriptions.committing(caller, local) as commits:
                checked = True
                ended = await self.coordinator.end(txn_id, True, metadata, merge, commits, hold)
                stored = 1
                return ended
        except SlipstreamError:
            if not checked:
                with contextlib.suppress(SlipstreamError):
                    await self.coordinator.end(txn_id, False, b"")
            raise
        finally:
            if stored == 0 and holds:
                stored = -1  # failed after holding: the record may be stored or not
            await self._release_holds(holds, stored)

    async def _ask_group(
        self, owner: str, message: HoldPositions, home: int, holds: list[tuple[str, int]]
    ) -> PositionsHeld:
        """Hold ``message.positions``' group at ``owner`` (this broker included), adding each
        broker asked to ``holds`` before asking (an answer lost still releases). A group
        moving (nobody serves it, or the broker asked no longer does) is looked up again for
        up to ASK_GROUP_S: this broker's view of the owners lags a turn behind the catalog."""
        consumed = message.positions
        what = f"the group of subscription {consumed.subscription!r} of {consumed.stream!r}"
        deadline = time.monotonic() + ASK_GROUP_S
        while True:
            try:
                if not owner:
                    raise BrokerUnavailable("nobody coordinates it right now (it is moving)")
                holds.append((owner, message.hold_id))
                if owner == self.cluster.broker_id:
                    answer: Message = await self.hold_positions(
                        self._itself, *msgspec.structs.astuple(message)
                    )
                else:
                    answer = await self.peers.ask(owner, message)
                break
            except (BrokerUnavailable, WrongBroker, TimeoutError) as exc:
                moving = not isinstance(exc, TimeoutError)
                if moving and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                    owner = self._group_owner(consumed, home) or ""
                    continue
                raise TransactionAborted(
                    f"transaction {message.txn_id} aborted: {what} could not be held by its "
                    f"coordinator{f' ({owner})' if owner else ''}: {exc or 'no answer'}; run it "
                    "again",
                    txn_id=message.txn_id,
                ) from None
        if not isinstance(answer, PositionsHeld):
            raise TransactionAborted(f"{what}: unexpected answer {answer!r}")
        return answer

    async def _release_holds(self, holds: list[tuple[str, int]], stored: int) -> None:
        async def one(owner: str, hold_id: int) -> None:
            try:
                if owner == self.cluster.broker_id:
                    await self.release_positions(self._itself, hold_id, stored)
                else:
                    await self.peers.ask(owner, ReleasePositions(hold_id, stored))
            except (SlipstreamError, TimeoutError) as exc:
                log.warning(
                    "hold %d on broker %r not released (%s): it expires there", hold_id, owner, exc
                )

        await asyncio.gather(*(one(owner, hold_id) for owner, hold_id in holds if owner))

    async def hold_positions(
        self,
        caller: Caller,
        hold_id: int,
        txn_id: int,
        subject: str,
        ttl_ms: int,
        consumed: TxnPositions,
    ) -> PositionsHeld:
        """Broker to broker (``HoldPositions``): check a transaction's positions and hold
        their group for its coordinator (``Subscriptions.hold``). Admin only with
        authentication on; InvalidArgument standalone; WrongBroker unless this broker
        coordinates the group; BrokerUnavailable if the group stays busy."""
        self._authorize(caller, Action.ADMIN, None)
        if not self.cluster.enabled:
            raise InvalidArgument("HoldPositions is for brokers of a cluster")
        self._group_here(consumed.stream, consumed.subscription)
        cid = coordinator(f"{consumed.stream}/{consumed.subscription}", self.cluster.count)
        lease = self.containers[cid].lease
        if lease is None:
            raise self.cluster.wrong_broker(cid, f"the group of {consumed.subscription!r}")
        try:
            group = await self.subscriptions.hold(hold_id, txn_id, subject, ttl_ms, consumed, lease)
        except TimeoutError:
            raise BrokerUnavailable(
                f"the group of {consumed.subscription!r} stayed busy; try again"
            ) from None
        except LeaseLost:  # the hold's row is written under the lease: moving, nothing held
            raise self.cluster.wrong_broker(
                cid, f"the group of {consumed.subscription!r}"
            ) from None
        # how long this broker surely coordinates the group: its lease, as it knows it
        left = min(self.containers[cid].lease_deadline - time.monotonic(), HOLD_TTL_MS / 1000)
        if not left > 0:  # (-inf: the lease is lost) moving: nothing held
            await self.subscriptions.release_hold(hold_id, 0)
            raise self.cluster.wrong_broker(cid, f"the group of {consumed.subscription!r}")
        valid_ms = int(left * 1000)
        return PositionsHeld(hold_id, group.record.stream_id, group.record.generation, valid_ms)

    async def release_positions(self, caller: Caller, hold_id: int, stored: int) -> PositionsHeld:
        """Broker to broker (``ReleasePositions``): end a hold (``Subscriptions.release_hold``)."""
        self._authorize(caller, Action.ADMIN, None)
        group = await self.subscriptions.release_hold(hold_id, stored)
        if group is None:
            return PositionsHeld(hold_id, 0, 0, held=False)
        return PositionsHeld(hold_id, group.record.stream_id, group.record.generation)

    def list_txns(self, caller: Caller) -> list[TxnInfo]:
        """Every open transaction (with authentication on, the admin action)."""
        self._authorize(caller, Action.ADMIN, None)
        return self.coordinator.list()

    def identity(self, caller: Caller, transactional_id: str) -> IdentityInfo:
        """A transactional id's last commit (with authentication on, the caller must be
        allowed to produce to some stream, and own the id if someone does, as for
        ``init_producer``)."""
        self._authorize_somewhere(caller, Action.PRODUCE)
        self._check_transactional_id(caller, transactional_id)
        self._txn_home(transactional_id)
        return self.coordinator.identity(transactional_id)

    def _txn_home(self, transactional_id: str) -> int:
        """The container coordinating ``transactional_id``'s transactions in a cluster
        (WrongBroker unless this broker serves it); -1 standalone."""
        if not self.cluster.enabled:
            return -1
        self._coordinated(transactional_id, f"transactional id {transactional_id!r}")
        return coordinator(transactional_id, self.cluster.count)

    def apply_batch(
        self,
        caller: Caller,
        stream: str,
        segment: int,
        producer_id: int,
        epoch: int,
        batch: Payload,
    ) -> tuple[asyncio.Future[int], int]:
        """Broker to broker (``ApplyBatch``): a committed transaction's batch for a segment
        served here; the future gives its base offset once durable (-1: the segment held it
        already) and the second value the batch's event count. An empty ``batch`` asks the
        sequence the segment expects next from ``producer_id`` at ``epoch`` (the second
        value; the future gives -1). Admin only with authentication on; InvalidArgument on a
        standalone broker; CorruptBatch for a batch that is not a stamped one; WrongBroker
        unless this broker serves the segment."""
        self._authorize(caller, Action.ADMIN, None)
        if not self.cluster.enabled:
            raise InvalidArgument("ApplyBatch is sent between the brokers of a cluster")
        target = self.controller.stream(stream).segment(segment)
        self._served(target)
        if batch and target.sealing and not target.sealed:
            # a scale is sealing it: the catalog refuses the scale while this batch's commit
            # is pending, the segment then opens again and the coordinator's retry lands
            from ._container import sealed_error

            raise sealed_error(target)
        if not batch:
            done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            done.set_result(-1)
            return done, self.coordinator.next_sequence_of(target, producer_id, epoch)
        header = verify(batch)
        if header.batch_length != len(batch) or header.producer_id < 0:
            raise CorruptBatch(
                "an ApplyBatch carries exactly one batch, stamped by a transaction's coordinator"
            )
        return self.coordinator.apply_batch(target, batch, header), header.event_count

    async def hand_over_identity(self, caller: Caller, transactional_id: str, subject: str) -> None:
        """Make ``subject`` the owner of a transactional id (authentication on: admin only;
        see ``_own_transactional_id``), stored before it returns. Producers running with it
        are not fenced: the new owner's InitProducer does that. Raises PermissionDenied,
        InvalidArgument (an id not 1 to 255 characters, a bad subject)."""
        self._authorize(caller, Action.ADMIN, None)
        if not 0 < len(transactional_id) <= 255:
            raise InvalidArgument("a transactional id is 1 to 255 characters")
        if subject == "*":
            raise InvalidArgument("a transactional id is handed over to one subject, not '*'")
        make_rule(subject, Action.PRODUCE, "*")  # the rules' check of a subject name
        previous = self._txn_owners.get(transactional_id)
        await self.controller.in_catalog(
            self.controller.meta.put_setting,
            TXN_OWNERS_SETTING,
            transactional_id,
            subject.encode(),
        )
        self._txn_owners[transactional_id] = subject
        self._audited(
            caller,
            "transactional_id_handed_over",
            transactional_id=transactional_id,
            previous_owner=previous,
            owner=subject,
        )

    def list_identities(self, caller: Caller, prefix: str = "") -> list[IdentityInfo]:
        """Every transactional id that starts with ``prefix`` ("" for all), sorted: its
        producer id, epoch, last committed transaction, that commit's metadata and time
        (``last_txn_id`` -1 and ``last_metadata`` b"" for an id that began but never
        committed). The Spark sink's queries are the ids under ``spark:``. A snapshot: a
        commit that ends while this runs is in it or not, never half. With authentication
        on: the admin action."""
        self._authorize(caller, Action.ADMIN, None)
        return self.coordinator.list_identities(prefix)

    # --- subscriptions and groups ------------------------------------------------------------

    async def create_subscription(
        self,
        caller: Caller,
        stream: str,
        name: str,
        mode: str = "ordered",
        at: str = "earliest",
        timestamp_ms: int | None = None,
        positions: dict[int, int] | None = None,
        options: dict[str, object] | None = None,
    ) -> SubscriptionInfo:
        """A durable cursor starting at ``at`` ("earliest", "latest", "time" with
        ``timestamp_ms``, "cut" with ``positions``). Raises StreamNotFound,
        SubscriptionExists, InvalidName, InvalidArgument, OffsetOutOfRange."""
        self._authorize(caller, Action.MANAGE, stream)
        self._group_here(stream, name)
        start = await self._start(caller, stream, at, timestamp_ms, positions)
        queue = _queue_options(stream, options or {}) if mode != "ordered" else None
        if mode == "ordered" and options:
            raise InvalidArgument("options are for the queue modes; an ordered one has none")
        info = await self.subscriptions.create(stream, name, mode, start, queue)
        self._audited(
            caller, "subscription_created", stream=stream, subscription=name, mode=mode, at=at
        )
        return info

    def _group_here(self, stream: str, subscription: str) -> None:
        self._coordinated(
            f"{stream}/{subscription}", f"the group of subscription {subscription!r} of {stream!r}"
        )

    def list_subscriptions(self, caller: Caller, stream: str) -> list[SubscriptionInfo]:
        self._authorize(caller, Action.CONSUME, stream)
        return self.subscriptions.of_stream(stream)

    async def describe_subscription(
        self, caller: Caller, stream: str, name: str, local: bool = False
    ) -> SubscriptionInfo:
        """Per segment: position, backlog (events, bytes), lag; and the members. In a
        cluster the broker coordinating the group answers, since its members and queue
        counts live there: another broker forwards the request to it (``local``: answer
        here, forward no further), or, if it cannot be reached, answers from its own view
        without the members (logged). The answering broker counts each segment another
        broker serves from that broker's live end and size (``stream_info``; WrongBroker
        while a container has nobody serving it) and reads its lag from it."""
        self._authorize(caller, Action.CONSUME, stream)
        if not self.cluster.enabled:
            return await self.subscriptions.describe(stream, name)
        if not local:
            forwarded = await self._describe_at_coordinator(stream, name)
            if forwarded is not None:
                return forwarded
        info = await self.stream_info(caller, stream)
        live = {s.number: s for s in info.segments}
        return await self.subscriptions.describe(stream, name, live)

    async def _describe_at_coordinator(self, stream: str, name: str) -> SubscriptionInfo | None:
        """The group's description from the broker coordinating it; None if this broker
        does (or nobody can answer now: the caller describes from here)."""
        cid = coordinator(f"{stream}/{name}", self.cluster.count)
        if self.containers[cid].serving:
            return None
        owner = self.cluster.owners[cid]
        try:
            if not owner or owner == self.cluster.broker_id:
                raise self.cluster.wrong_broker(cid, f"the group of {stream}:{name}")
            reply = await self.peers.ask(owner, DescribeSubscription(stream, name, local=True))
        except (BrokerUnavailable, WrongBroker, TimeoutError) as exc:
            log.warning(
                "subscription %s:%s described from this broker's view, without its members "
                "and queue counts: the broker coordinating its group (container %d) did not "
                "answer: %s",
                stream,
                name,
                cid,
                exc,
            )
            return None
        if not isinstance(reply, SubscriptionInfo):
            raise SlipstreamError(
                f"broker {owner!r} answered DescribeSubscription with {type(reply).__name__}"
            )
        return reply

    async def delete_subscription(self, caller: Caller, stream: str, name: str) -> None:
        self._authorize(caller, Action.MANAGE, stream)
        await self.subscriptions.delete(stream, name)
        self._audited(caller, "subscription_deleted", stream=stream, subscription=name)

    async def reset_subscription(
        self,
        caller: Caller,
        stream: str,
        name: str,
        at: str,
        timestamp_ms: int | None = None,
        positions: dict[int, int] | None = None,
    ) -> SubscriptionInfo:
        """Move every position to ``at``; live members restart from there."""
        self._authorize(caller, Action.MANAGE, stream)
        start = await self._start(caller, stream, at, timestamp_ms, positions)
        info = await self.subscriptions.reset(stream, name, start)
        self._audited(
            caller, "subscription_reset", stream=stream, subscription=name, at=at, positions=start
        )
        return info

    async def _start(
        self,
        caller: Caller,
        stream: str,
        at: str,
        timestamp_ms: int | None,
        positions: dict[int, int] | None,
    ) -> dict[int, int]:
        if at != "cut":  # authorized by the operation (manage), not as a read
            return await self._cut(stream, at, timestamp_ms)
        if positions is None:
            raise InvalidArgument("a start at a StreamCut needs its positions")
        segments = self.controller.stream(stream).segments
        # segments the cut does not name start at their first retained event
        return {n: positions.get(n, s.start_offset) for n, s in segments.items()}

    def join_group(
        self,
        caller: Caller,
        stream: str,
        subscription: str,
        mode: str,
        member_name: str,
        session_timeout_ms: int,
    ) -> tuple[int, int]:
        """Join the subscription's group -> (member id, generation)."""
        self._authorize(caller, Action.CONSUME, stream)
        self._group_here(stream, subscription)
        return self.subscriptions.join(
            caller, stream, subscription, mode, member_name, session_timeout_ms
        )

    async def poll_group(
        self, caller: Caller, member_id: int, released: Sequence[int], wait_ms: int
    ) -> GroupAssignment:
        self._authorize_member(caller, member_id)
        return await self.subscriptions.poll(caller, member_id, released, wait_ms)

    async def commit_positions(
        self,
        caller: Caller,
        stream: str,
        subscription: str,
        member_id: int,
        generation: int,
        positions: dict[int, int],
    ) -> None:
        self._authorize(caller, Action.CONSUME, stream)
        self._group_here(stream, subscription)
        await self.subscriptions.commit(
            caller, stream, subscription, member_id, generation, positions
        )

    def leave_group(self, caller: Caller, member_id: int) -> None:
        self._authorize_member(caller, member_id)
        self.subscriptions.leave(caller, member_id)

    async def fetch_events(
        self, caller: Caller, member_id: int, max_events: int, wait_ms: int
    ) -> tuple[list[list[int]], list[bytes | bytearray | memoryview]]:
        """Queue modes: events for the member -> ([segment, offset, delivery count], ...)
        and the whole batches holding them; see ``_queues.Queues.fetch``."""
        self._authorize_member(caller, member_id)
        return await self.subscriptions.queues.fetch(caller, member_id, max_events, wait_ms)

    async def settle_events(
        self,
        caller: Caller,
        member_id: int,
        acks: list[list[int]],
        nacks: list[list[int]],
        delay_ms: int,
    ) -> list[list[int]]:
        """Queue modes: ack / nack, durable before it returns -> the deliveries the member
        does not hold (``[segment, offset]``); see ``_queues.Queues.settle``."""
        self._authorize_member(caller, member_id)
        return await self.subscriptions.queues.settle(caller, member_id, acks, nacks, delay_ms)

    # --- access rules ------------------------------------------------------------------------

    def authorize(self, caller: Caller, action: Action | None, stream: str | None) -> None:
        """The access check every operation makes, for a protocol's own endpoints
        (``/metrics``): raises PermissionDenied, audited, unless allowed (``_authorize``)."""
        self._authorize(caller, action, stream)

    def _authorize(self, caller: Caller, action: Action | None, stream: str | None) -> None:
        """Raise PermissionDenied (and write a ``denied`` audit record) unless the caller may
        do ``action`` on ``stream`` (None: a broker-wide operation). ``action`` None: any of
        produce, consume and manage (describing a stream). Authentication off (no principal):
        allowed. A decision that allowed is cached on the caller until the rules change."""
        principal = caller.principal
        if principal is None:
            return
        if caller.access_version == self._rules_version:
            if (action, stream) in caller.access:
                return
        else:
            caller.access.clear()
            caller.access_version = self._rules_version
        decision = self._decide(principal, action, stream)
        if not decision.allowed:
            asked = action or Action.CONSUME
            what = f"{action or 'act on'} {stream}" if stream else f"{asked} (broker-wide)"
            raise self._denied(
                caller,
                principal,
                f"{principal.subject} may not {what}: {decision.reason}; an administrator "
                f"allows it with: {grant_command(principal.subject, asked, stream)}",
                action=action or "any",
                reason=decision.reason,
                stream=stream,
            )
        if len(caller.access) >= MAX_ACCESS_CACHE:
            caller.access.clear()
        caller.access.add((action, stream))

    def _decide(self, principal: Principal, action: Action | None, stream: str | None) -> Decision:
        if action is not None:
            return self.rules.decide(principal, action, stream)
        for each in (Action.CONSUME, Action.PRODUCE, Action.MANAGE):
            decision = self.rules.decide(principal, each, stream)
            if decision.allowed:
                return decision
        return decision

    def _staged_streams(self, txn_ids: Sequence[int]) -> set[str]:
        """The streams the open transactions ``txn_ids`` staged into."""
        open_txns = self.coordinator.open
        return {
            staged.segment.stream_name
            for txn_id in txn_ids
            if (txn := open_txns.get(txn_id)) is not None
            for staged in txn.staged
        }

    def _authorize_member(self, caller: Caller, member_id: int) -> None:
        """Consume on the stream of a group member (an unknown member: the group's own error
        follows)."""
        member = self.subscriptions.members.get(member_id)
        if member is not None:
            self._authorize(caller, Action.CONSUME, member.group.stream.name)

    def _authorize_somewhere(self, caller: Caller, action: Action) -> None:
        """For operations that name no stream yet: the caller may do ``action`` on some
        stream."""
        principal = caller.principal
        if principal is None:
            return
        decision = self.rules.may_somewhere(principal, action)
        if not decision.allowed:
            raise self._denied(
                caller,
                principal,
                f"{principal.subject} may not {action} anywhere: {decision.reason}; an "
                "administrator allows it with: "
                f"{grant_command(principal.subject, action, _scope_pattern(principal))}",
                action=str(action),
                reason=decision.reason,
            )

    def _may(self, caller: Caller, action: Action | None, stream: str) -> bool:
        """``_authorize`` as a question: no exception, no audit record (a listing filters
        with it; what it leaves out was not asked for)."""
        principal = caller.principal
        if principal is None:
            return True
        if caller.access_version == self._rules_version and (action, stream) in caller.access:
            return True
        return self._decide(principal, action, stream).allowed

    async def grant(self, caller: Caller, subject: str, action: str, pattern: str) -> Rule:
        """Add an access rule (admin only); stored in the catalog before it returns, in force
        for every caller at once. Granting a rule that exists changes nothing. Raises
        InvalidArgument for a bad subject, action or pattern, PermissionDenied."""
        self._authorize(caller, Action.ADMIN, None)
        rule = make_rule(subject, action, pattern)
        await self.controller.in_catalog(
            self.controller.meta.put_setting, RULES_SETTING, rule.key, encode_rule(rule)
        )
        if self.rules.add(rule):
            self._rules_version += 1
        self._record_change(caller, "rule_granted", rule)
        return rule

    async def revoke(self, caller: Caller, subject: str, action: str, pattern: str) -> bool:
        """Remove an access rule (admin only), durable before it returns; False if there was
        none. Open connections lose what only it allowed with their next request (an open
        follow with its next read)."""
        self._authorize(caller, Action.ADMIN, None)
        rule = make_rule(subject, action, pattern)
        removed = await self.controller.in_catalog(
            self.controller.meta.delete_setting, RULES_SETTING, rule.key
        )
        if self.rules.remove(rule):
            self._rules_version += 1
            removed = True
        if removed:
            self._record_change(caller, "rule_revoked", rule)
        return removed

    def list_rules(self, caller: Caller) -> list[Rule]:
        """Every access rule, sorted (admin only)."""
        self._authorize(caller, Action.ADMIN, None)
        return self.rules.rules

    def check_access(
        self,
        caller: Caller,
        subject: str,
        action: str,
        stream: str,
        role: str = "user",
        scope: str | None = None,
    ) -> Decision:
        """A dry run (admin only): would ``subject`` (with ``role``, and a token limited to
        ``scope`` if given) be allowed ``action`` on ``stream``, and which rule decides?"""
        self._authorize(caller, Action.ADMIN, None)
        probe = make_rule(subject, action, "*")
        if stream != "*":
            validate_stream_name(stream)
        try:
            principal = Principal(subject, Role(role), scope)
        except ValueError:
            raise InvalidArgument(f"unknown role {role!r}; one of: admin, user") from None
        return self.rules.decide(principal, probe.action, None if stream == "*" else stream)

    def _record_change(self, caller: Caller, event: str, rule: Rule) -> None:
        principal = caller.principal
        self.audit.record(
            event,
            subject=None if principal is None else principal.subject,
            peer=caller.peer,
            rule_subject=rule.subject,
            action=str(rule.action),
            pattern=rule.pattern,
        )

    # --- quotas ------------------------------------------------------------------------------

    def admit(self, caller: Caller) -> None:
        """Count the caller (once authenticated) against its scope's connection quota: the
        scope of its principal's token; an unscoped or unauthenticated caller is not counted.
        Raises LimitExceeded past the quota; ``disconnect`` gives the place back."""
        principal = caller.principal
        scope = principal.scope if principal is not None else None
        self.quotas.open_connection(scope)
        self._counted[caller] = scope

    def quota_scope(self, caller: Caller, stream: str | None) -> str | None:
        """The scope a request counts against: its stream's scope, else the scope of the
        caller's token (None: no quota applies)."""
        if stream is not None and "/" in stream:
            return stream.partition("/")[0]
        principal = caller.principal
        return principal.scope if principal is not None else None

    async def set_quota(self, caller: Caller, quota: QuotaInfo) -> list[QuotaInfo]:
        """Set (replace) ``quota.scope``'s quota; one with no limit removes it. Stored before
        it returns (a restart keeps it) and applied to the scope's next request at once (its
        buckets start afresh). Admin only when authentication is on (PermissionDenied).
        Raises InvalidName, InvalidArgument (a limit not positive). -> every quota."""
        self._authorize(caller, Action.ADMIN, None)
        scope = validate_scope(quota.scope)
        limits = Quota(quota.produce_bytes, quota.consume_bytes, quota.requests, quota.connections)
        if limits.empty:
            await self.delete_quota(caller, scope)
            return self.list_quotas(caller)
        await self.controller.in_catalog(
            self.controller.meta.put_setting, QUOTAS_SETTING, scope, encode_quota(limits)
        )
        self.quotas.set(scope, limits)
        self.audit.record(
            "quota_set",
            subject=caller.principal.subject if caller.principal is not None else None,
            peer=caller.peer,
            scope=scope,
            **msgspec.structs.asdict(limits),
        )
        return self.list_quotas(caller)

    async def delete_quota(self, caller: Caller, scope: str) -> bool:
        """Remove a scope's quota (False if it had none); stored before it returns."""
        self._authorize(caller, Action.ADMIN, None)
        removed = await self.controller.in_catalog(
            self.controller.meta.delete_setting, QUOTAS_SETTING, scope
        )
        self.quotas.delete(scope)
        if removed:
            self.audit.record(
                "quota_deleted",
                subject=caller.principal.subject if caller.principal is not None else None,
                peer=caller.peer,
                scope=scope,
            )
        return removed

    def list_quotas(self, caller: Caller) -> list[QuotaInfo]:
        """Every scope's quota, by scope. Admin only when authentication is on."""
        self._authorize(caller, Action.ADMIN, None)
        return [QuotaInfo(s, *msgspec.structs.astuple(q)) for s, q in self.quotas.items()]

    # --- ownership ---------------------------------------------------------------------------

    def _own(self, caller: Caller, producer_id: int) -> None:
        previous = self._owners.get(producer_id)
        if previous is not None and previous is not caller:
            previous.producers.pop(producer_id, None)
        self._owners[producer_id] = caller
        owned = caller.producers
        owned.pop(producer_id, None)
        owned[producer_id] = None
        if len(owned) > MAX_PRODUCERS_PER_CALLER:
            oldest = next(iter(owned))
            del owned[oldest]
            if self._owners.get(oldest) is caller:
                del self._owners[oldest]

    def _check_txn_owner(self, caller: Caller, txn_id: int) -> None:
        txn = self.coordinator.open.get(txn_id)
        if txn is None:
            return  # the coordinator answers for ended and unknown ones
        if txn.anonymous:
            self._check_anonymous_owner(caller, txn_id)
            return
        producer_id = txn.identity.producer_id
        if producer_id not in caller.producers:
            raise NotOwner(
                f"transaction {txn_id} belongs to producer {producer_id} of another connection; "
                "only its owner may write to, commit or abort it (an operator aborts it with "
                "'slipstream txn abort')",
                txn_id=txn_id,
                producer_id=producer_id,
            )

    def _check_anonymous_owner(self, caller: Caller, txn_id: int) -> None:
        """An anonymous transaction is shared by its id among the connections of the subject
        that began it (a Spark job's tasks and driver); with authentication on, another
        subject gets PermissionDenied (audited) unless it may administer the broker."""
        principal = caller.principal
        owner = self._anonymous_owners.get(txn_id)
        if principal is None or owner is None or owner == principal.subject:
            return
        if self.rules.decide(principal, Action.ADMIN, None).allowed:
            return
        raise self._denied(
            caller,
            principal,
            f"{principal.subject} may not write to, merge, commit or abort transaction "
            f"{txn_id}: {owner} began it; begin a transaction of your own (an administrator "
            f"aborts it with: slipstream txn abort {txn_id})",
            action="transaction",
            reason=f"anonymous transaction begun by {owner}",
            txn_id=txn_id,
        )

    async def _own_transactional_id(self, caller: Caller, transactional_id: str) -> None:
        """With authentication on: make the caller's subject the owner of a transactional id
        nobody owns yet (stored before the id is initialised, so that a restart keeps it),
        else check that it owns it (``_check_transactional_id``). Invalid ids are left to
        the coordinator's error."""
        principal = caller.principal
        if principal is None or not 0 < len(transactional_id) <= 255:
            return
        if transactional_id in self._txn_owners:
            self._check_transactional_id(caller, transactional_id)
            return
        # taken before the write: another subject's InitProducer meanwhile is refused
        self._txn_owners[transactional_id] = principal.subject
        try:
            await self.controller.in_catalog(
                self.controller.meta.put_setting,
                TXN_OWNERS_SETTING,
                transactional_id,
                principal.subject.encode(),
            )
        except BaseException:
            if self._txn_owners.get(transactional_id) == principal.subject:
                del self._txn_owners[transactional_id]
            raise
        self._audited(caller, "transactional_id_owned", transactional_id=transactional_id)

    def _check_transactional_id(self, caller: Caller, transactional_id: str) -> None:
        """PermissionDenied (audited) unless the caller's subject owns the transactional id,
        nobody does, or the caller may administer the broker. Authentication off: allowed."""
        principal = caller.principal
        if principal is None:
            return
        owner = self._txn_owners.get(transactional_id)
        if owner is None or owner == principal.subject:
            return
        if self.rules.decide(principal, Action.ADMIN, None).allowed:
            return
        raise self._denied(
            caller,
            principal,
            f"{principal.subject} may not use transactional id {transactional_id!r}: it "
            f"belongs to {owner}, the subject that first initialised it; use another "
            f"transactional id, or an administrator hands it over with: slipstream txn "
            f"hand-over '{transactional_id}' {principal.subject}",
            action="transactional_id",
            reason=f"transactional id owned by {owner}",
            transactional_id=transactional_id,
        )

    def _not_owner(self, caller: Caller, producer_id: int) -> NotOwner:
        return NotOwner(
            f"producer {producer_id} is not owned by this connection; use the id InitProducer "
            "granted here, or claim it with its token (ClaimProducer) after a reconnect",
            producer_id=producer_id,
        )

    def _token(self, producer_id: int, epoch: int) -> bytes:
        message = f"{producer_id}:{epoch}".encode()
        return hmac.new(self._key, message, hashlib.sha256).digest()[:_TOKEN_BYTES]

    # --- audit -------------------------------------------------------------------------------

    def _denied(
        self,
        caller: Caller,
        principal: Principal,
        message: str,
        *,
        action: str,
        reason: str,
        **details: object,
    ) -> PermissionDenied:
        """Write the ``denied`` audit record of a refusal and return the PermissionDenied to
        raise (``message`` says who may not do what, why, and the command that allows it;
        ``details`` go into both, e.g. the stream)."""
        self.audit.record(
            "denied",
            subject=principal.subject,
            peer=caller.peer,
            action=action,
            reason=reason,
            **{"stream": None, **details},
        )
        return PermissionDenied(message, subject=principal.subject, action=action, **details)

    def _audited(self, caller: Caller, event: str, **details: object) -> None:
        """An audit record of a change the caller made (security/_audit.py)."""
        principal = caller.principal
        subject = None if principal is None else principal.subject
        self.audit.record(event, subject=subject, peer=caller.peer, **details)

    def _refuse_system(self, stream: str, what: str) -> None:
        """Streams of the reserved scope ``_system`` (the audit trail) are written only by
        the broker: PermissionDenied for anyone else, the admin role included."""
        if is_system_stream(stream):
            raise PermissionDenied(
                f"{stream} is the broker's own stream (scope '_system'): only the broker may "
                f"{what} it; read it with 'slipstream audit tail'",
                stream=stream,
            )

    # --- several brokers ---------------------------------------------------------------------

    async def reload_settings(self) -> None:
        """Take in what other brokers changed in the catalog (the broker calls it when
        ``Controller.refresh`` saw the catalog change): revoked tokens (this broker's
        connections that use one end with ``authentication_failed``, as ``revoke_token``
        ends them), access rules (callers' cached decisions are dropped), quotas (a changed
        scope's buckets start afresh), transactional-id owners, and subscriptions
        (``Subscriptions.reload``). Catalog reads on the catalog thread, after the writes
        queued before; StorageError when the catalog cannot be read."""
        meta = self.controller.meta

        def read() -> tuple[set[str], dict[str, bytes], dict[str, bytes], dict[str, bytes]]:
            return (
                set(meta.settings(REVOKED_SETTING)),
                meta.settings(RULES_SETTING),
                meta.settings(QUOTAS_SETTING),
                meta.settings(TXN_OWNERS_SETTING),
            )

        revoked, rules, quotas, owners = await self.controller.in_catalog(read)
        for token_id in revoked - self.revoked:
            self.revoked.add(token_id)
            for victim in self._by_token.pop(token_id, set()):
                if victim.end is not None:
                    victim.end(
                        AuthenticationFailed(
                            f"authentication failed: token {token_id} revoked; connect again "
                            "with a new token",
                            reason="revoked",
                            token_id=token_id,
                        )
                    )
        loaded = sorted({decode_rule(raw) for raw in rules.values()})
        if loaded != self.rules.rules:
            self.rules = Rules(loaded)
            self._rules_version += 1
        limits = {scope: decode_quota(raw) for scope, raw in quotas.items()}
        for scope, _ in list(self.quotas.items()):
            if scope not in limits:
                self.quotas.delete(scope)
        for scope, quota in limits.items():
            if self.quotas.get(scope) != quota:
                self.quotas.set(scope, quota)
        # an id being taken here is in memory before it is stored: kept until it is
        self._txn_owners = {**self._txn_owners, **{t: o.decode() for t, o in owners.items()}}
        await self.subscriptions.reload()


def rule_message(rule: Rule) -> AccessRule:
    """A rule as the protocol and the HTTP API carry it."""
    return AccessRule(rule.subject, str(rule.action), rule.pattern)


def decision_message(decision: Decision) -> AccessDecision:
    rule = None if decision.rule is None else rule_message(decision.rule)
    return AccessDecision(decision.allowed, rule, decision.reason)


def _scope_pattern(principal: Principal) -> str | None:
    return None if principal.scope is None else f"{principal.scope}/*"


def _subject(caller: Caller) -> str | None:
    return caller.principal.subject if caller.principal is not None else None


def _queue_options(stream: str, given: dict[str, object]) -> QueueOptions:
    """A queue's options from the request, checked: counts and times positive, a dead-letter
    stream name (default ``<stream>.dlq``)."""
    unknown = sorted(set(given) - set(QueueOptions.__struct_fields__))
    if unknown:
        raise InvalidArgument(
            f"unknown queue option(s) {unknown}; known: {', '.join(QueueOptions.__struct_fields__)}"
        )
    try:
        options = msgspec.convert(given, QueueOptions)
    except msgspec.ValidationError as exc:
        raise InvalidArgument(f"bad queue option: {exc}") from None
    for name in QueueOptions.__struct_fields__:
        value = getattr(options, name)
        if isinstance(value, int) and value <= 0:
            raise InvalidArgument(f"queue option {name} must be positive, not {value}")
    if options.backoff_ms > options.max_backoff_ms:
        raise InvalidArgument("backoff_ms must not be above max_backoff_ms")
    dead_letter = options.dead_letter or f"{stream}.dlq"
    validate_stream_name(dead_letter)
    return msgspec.structs.replace(options, dead_letter=dead_letter)

"""Protocol messages: frozen msgspec structs, each with a numeric kind on the wire.

Requests go client -> broker with a fresh correlation id; each gets exactly one response
(``Error`` or the response named in its docstring) with the same id. ``Data`` and
``FollowEnded``/``FollowFailed`` are pushed by the broker for a follow, with correlation id 0.
Meta fields are msgpack arrays (``array_like``): new optional fields go at the end.
"""

from __future__ import annotations

from typing import Any

import msgspec

PROTOCOL_VERSION = 1


class Message(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=False):
    """Base of all protocol messages (not sent itself)."""


# --- requests -------------------------------------------------------------------------------


class Hello(Message, frozen=True):
    """First frame of a connection -> ``Welcome``. ``credentials`` is for the security issue."""

    protocol_version: int
    client_name: str
    credentials: dict[str, str] | None = None


class CreateStream(Message, frozen=True):
    """-> ``StreamInfo``."""

    name: str
    segments: int
    retention_ms: int | None = None
    retention_bytes: int | None = None
    #: a scaling policy's text (``str(ScalingPolicy)``: "events 5000/s factor 2 min 1"); ""
    #: for none
    scaling: str = ""


class DeleteStream(Message, frozen=True):
    """-> ``Done``. Readers following the stream get ``FollowFailed(stream_not_found)``."""

    name: str


class UpdateStream(Message, frozen=True):
    """Change a stream's retention or scaling policy -> ``StreamInfo``. For each limit: nil
    leaves it as it is, 0 removes it (keep forever / no size limit), a positive value
    replaces it. The change is stored in the catalog before the answer and applies from the
    next retention (or scaling) pass on; data already removed does not come back."""

    name: str
    retention_ms: int | None = None
    retention_bytes: int | None = None
    #: a new scaling policy's text ("" removes it); nil leaves it as it is
    scaling: str | None = None


class ListStreams(Message, frozen=True):
    """-> ``StreamList``. ``local``: in a cluster, only what this broker serves (see
    ``DescribeStream``)."""

    scope: str | None = None
    local: bool = False


class DescribeStream(Message, frozen=True):
    """-> ``StreamInfo`` with live per-segment counts. In a cluster any broker answers for
    every segment (it asks the brokers serving the others); with ``local`` it lists only the
    segments of the containers it serves itself (brokers asking each other)."""

    name: str
    local: bool = False


class Append(Message, frozen=True):
    """Payload: one record batch. -> ``AppendAck`` once the batch is durable; a retry of an
    idempotent producer's batch gets the first copy's offset. With ``txn`` the batch is staged
    in that open transaction instead (the ack's ``base_offset`` is -1): it becomes visible
    only if and when the transaction commits."""

    stream: str
    segment: int
    txn: int | None = None


class GetCut(Message, frozen=True):
    """-> ``Cut``. ``at``: "earliest", "latest" or "time" (first events at or after
    ``timestamp_ms``)."""

    stream: str
    at: str
    timestamp_ms: int | None = None
    #: in a cluster: only the segments this broker serves (see ``DescribeStream``)
    local: bool = False


class Follow(Message, frozen=True):
    """Start pushing a segment from ``offset`` -> ``Done``, then ``Data`` frames while credit
    lasts, and ``FollowEnded`` at ``end_offset`` (None: follow the tail forever)."""

    sub_id: int
    stream: str
    segment: int
    offset: int
    end_offset: int | None
    credit: int


class Credit(Message, frozen=True):
    """Grant a follow more bytes of ``Data``; no response."""

    sub_id: int
    credit: int


class Unfollow(Message, frozen=True):
    """Stop a follow -> ``Done``."""

    sub_id: int


class InitProducer(Message, frozen=True):
    """-> ``ProducerGrant``: a fresh producer id (epoch 0), or with a ``transactional_id`` its
    stable producer id with the next epoch, which fences every older producer of that id and
    aborts its open transaction. The id belongs to this connection: appends with it and its
    transactions are refused (``not_owner``) on any other, until one claims it
    (``ClaimProducer``)."""

    transactional_id: str | None = None


class ClaimProducer(Message, frozen=True):
    """-> ``Done``: make this connection the owner of a producer id granted on an earlier one
    (a reconnect, also after a broker restart), proving it with the grant's ``token``. The
    previous connection loses it. ``not_owner`` for a wrong token, ``producer_fenced`` when a
    newer epoch of its transactional id exists."""

    producer_id: int
    epoch: int
    token: bytes


class BeginTxn(Message, frozen=True):
    """-> ``TxnBegun``. The transaction aborts by itself if not ended in ``timeout_ms``.
    ``producer_id`` -1 begins an anonymous transaction, which commits only when another
    transaction's commit merges it. ``label`` is shown by ``ListTxns``."""

    producer_id: int
    epoch: int
    timeout_ms: int
    label: str = ""


class EndTxn(Message, frozen=True):
    """Commit (with ``metadata``, stored atomically with the events) or abort -> ``TxnEnded``.
    Retrying a commit that already happened answers ``TxnEnded(committed=True)`` again, on any
    connection. An open transaction is ended only by the connection that owns its producer id
    (``not_owner`` otherwise); an anonymous one by anyone holding its id. ``operator``: abort
    any open transaction (``slipstream txn abort``; logged; to be restricted to an admin
    principal once connections authenticate)."""

    txn_id: int
    commit: bool
    metadata: bytes = b""
    merge: list[int] = []
    operator: bool = False
    positions: list[TxnPositions] = []


class TxnPositions(Message, frozen=True):
    """Subscription positions a transaction consumed (``EndTxn.positions``): committed with
    the transaction, atomically, if ``member_id`` still owns those segments under
    ``generation``; otherwise the commit fails (``not_assigned``, ``stale_generation``) and
    the transaction aborts."""

    stream: str
    subscription: str
    member_id: int
    generation: int
    positions: dict[int, int]


class ListTxns(Message, frozen=True):
    """-> ``TxnList`` of open transactions."""


class GetIdentity(Message, frozen=True):
    """-> ``IdentityInfo``: a transactional id's epoch and last committed transaction."""

    transactional_id: str


class CreateSubscription(Message, frozen=True):
    """A durable cursor on ``stream`` starting at ``at`` (``earliest``, ``latest``, ``time``
    with ``timestamp_ms``, or ``cut`` with ``positions``) -> ``SubscriptionInfo``. ``mode``:
    ``ordered``, ``queue`` or ``key_ordered_queue``; ``options``: the queue's settings
    (``QueueOptions`` fields in ms and counts, and ``dead_letter``)."""

    stream: str
    name: str
    mode: str = "ordered"
    at: str = "earliest"
    timestamp_ms: int | None = None
    positions: dict[int, int] | None = None
    options: dict[str, Any] = {}


class ListSubscriptions(Message, frozen=True):
    """-> ``SubscriptionList`` (without members and backlog: ``DescribeSubscription``)."""

    stream: str


class DescribeSubscription(Message, frozen=True):
    """-> ``SubscriptionInfo`` with per-segment backlog and lag, and the members. In a
    cluster any broker answers: one that does not coordinate the group asks the one that does
    (its members and queue counts live there) with ``local``: "answer here, forward no
    further" (brokers asking each other)."""

    stream: str
    name: str
    local: bool = False


class DeleteSubscription(Message, frozen=True):
    """-> ``Done``. Joined members get ``subscription_not_found`` on their next poll."""

    stream: str
    name: str


class ResetSubscription(Message, frozen=True):
    """Move every position to ``at`` (as in ``CreateSubscription``) -> ``SubscriptionInfo``.
    Live members restart from there at once; commits of older positions are refused."""

    stream: str
    name: str
    at: str
    timestamp_ms: int | None = None
    positions: dict[int, int] | None = None


class JoinGroup(Message, frozen=True):
    """Become a member of the subscription's group -> ``GroupJoined``. The member stays while
    it polls (``PollGroup``) at least every ``session_timeout_ms`` and its connection lives."""

    stream: str
    subscription: str
    mode: str
    member_name: str
    session_timeout_ms: int = 10_000


class PollGroup(Message, frozen=True):
    """Heartbeat and assignment -> ``GroupAssignment``: answered at once when the member's
    assignment or the generation changed since its last poll, else after ``wait_ms``.
    ``released``: segments the member stopped reading because they were revoked."""

    member_id: int
    released: list[int] = []
    wait_ms: int = 1_000


class CommitPositions(Message, frozen=True):
    """Store positions (segment -> offset of the next event to consume) -> ``Done``, durable
    before the answer. ``member_id`` 0 commits from outside a group (a Spark query's
    progress), refused with ``group_active`` while members are joined."""

    stream: str
    subscription: str
    member_id: int
    generation: int
    positions: dict[int, int]


class LeaveGroup(Message, frozen=True):
    """-> ``Done``; the member's segments go to the others at once."""

    member_id: int


class FetchEvents(Message, frozen=True):
    """Queue modes: up to ``max_events`` events for this member -> ``EventsDelivered``,
    waiting up to ``wait_ms`` for some."""

    member_id: int
    max_events: int
    wait_ms: int = 1_000


class SettleEvents(Message, frozen=True):
    """Queue modes: acknowledge ``acks`` and give back ``nacks`` (``[segment, offset]``; to be
    delivered again after ``delay_ms``) -> ``Settled``, durable before the answer."""

    member_id: int
    acks: list[list[int]] = []
    nacks: list[list[int]] = []
    delay_ms: int = 0


class ScaleStream(Message, frozen=True):
    """Split one open segment into ``into`` successors (``segments`` names one), or merge
    adjacent open segments into one (``segments`` names two or more) -> ``StreamInfo`` once
    the old segments are sealed and the successors open, in one new epoch. Appends to a
    sealed segment get ``segment_sealed``."""

    stream: str
    segments: list[int]
    into: int = 2


class GetScaleHistory(Message, frozen=True):
    """-> ``ScaleHistory``: every split and merge of the stream, oldest first."""

    stream: str


# --- responses and pushes ---------------------------------------------------------------------


class Welcome(Message, frozen=True):
    protocol_version: int
    broker_version: str
    max_batch_bytes: int


class Error(Message, frozen=True):
    code: str
    message: str
    details: dict[str, Any] = {}


class Done(Message, frozen=True):
    pass


class SegmentInfo(Message, frozen=True):
    """A segment: hashes ``key_lo..key_hi`` (both inclusive, unsigned 64-bit) route to it."""

    number: int
    epoch: int
    key_lo: int
    key_hi: int
    sealed: bool
    start_offset: int
    end_offset: int
    bytes: int
    first_timestamp: int | None
    last_timestamp: int | None
    #: the segments it succeeded (a scale sealed them and opened it); [] for the first epoch.
    #: A sealed segment's ``end_offset`` is its final end.
    predecessors: list[int] = []
    #: the container it lives in: in a cluster, the broker holding that container's lease
    #: (``ClusterInfo.owners``) takes its appends and follows
    container: int = 0


class StreamInfo(Message, frozen=True):
    """``segments``: those of every epoch, sealed ones too, by number."""

    name: str
    segments: list[SegmentInfo]
    retention_ms: int | None
    retention_bytes: int | None
    created_ms: int
    epoch: int = 0
    scaling: str = ""


class StreamList(Message, frozen=True):
    streams: list[StreamInfo]


class AppendAck(Message, frozen=True):
    base_offset: int
    event_count: int


class Cut(Message, frozen=True):
    stream: str
    positions: dict[int, int]


class Data(Message, frozen=True):
    """Payload: whole batches of the followed segment, in offset order."""

    sub_id: int


class FollowEnded(Message, frozen=True):
    sub_id: int
    next_offset: int


class FollowFailed(Message, frozen=True):
    sub_id: int
    code: str
    message: str
    details: dict[str, Any] = {}


class ProducerGrant(Message, frozen=True):
    """``token``: proof of the grant for ``ClaimProducer`` on a later connection; keep it
    secret like a password (16 bytes)."""

    producer_id: int
    epoch: int
    token: bytes = b""


class TxnBegun(Message, frozen=True):
    txn_id: int


class TxnRange(Message, frozen=True):
    """Where a committed transaction's events landed: offsets ``[start, end)`` of a segment."""

    stream: str
    segment: int
    start: int
    end: int


class TxnEnded(Message, frozen=True):
    txn_id: int
    committed: bool
    ranges: list[TxnRange] = []


class TxnInfo(Message, frozen=True):
    txn_id: int
    transactional_id: str
    producer_id: int
    epoch: int
    state: str
    age_ms: int
    timeout_ms: int
    events: int
    bytes: int
    segments: int
    label: str = ""


class TxnList(Message, frozen=True):
    txns: list[TxnInfo]


class IdentityInfo(Message, frozen=True):
    """``producer_id`` -1: the transactional id was never used. ``last_metadata``: what the
    last committed transaction stored with its events (b"" if none)."""

    transactional_id: str
    producer_id: int
    epoch: int
    last_txn_id: int
    last_metadata: bytes
    committed_ms: int


class SubscriptionSegment(Message, frozen=True):
    """One segment of a subscription: ``position`` (next offset to consume) against the
    segment's ``end_offset``; the backlog in events and bytes; ``lag_ms``: age of the oldest
    unconsumed event (0 without backlog); the member reading it (``owner``, 0 if none); for
    queues, events ``in_flight``, ``waiting`` for redelivery and ``dead_lettered``."""

    segment: int
    position: int
    end_offset: int
    backlog_events: int
    backlog_bytes: int
    lag_ms: int
    owner: int = 0
    in_flight: int = 0
    waiting: int = 0
    dead_lettered: int = 0


class MemberInfo(Message, frozen=True):
    member_id: int
    name: str
    peer: str
    segments: list[int]
    idle_ms: int


class SubscriptionInfo(Message, frozen=True):
    stream: str
    name: str
    mode: str
    generation: int
    created_ms: int
    segments: list[SubscriptionSegment] = []
    members: list[MemberInfo] = []
    options: dict[str, Any] = {}


class SubscriptionList(Message, frozen=True):
    subscriptions: list[SubscriptionInfo]


class GroupJoined(Message, frozen=True):
    member_id: int
    generation: int


class GroupAssignment(Message, frozen=True):
    """The segments this member reads now, each with the committed position to start from
    if it is new to the member (or ``generation`` changed: then every segment restarts
    there); ``revoke``: segments to stop reading, commit and release in the next poll."""

    generation: int
    assigned: dict[int, int]
    revoke: list[int] = []


class EventsDelivered(Message, frozen=True):
    """Payload: the batches that hold the delivered events. ``deliveries``: ``[segment,
    offset, delivery count]`` of each event delivered, in the order to process them."""

    deliveries: list[list[int]]


class Settled(Message, frozen=True):
    """``unknown``: acks or nacks of events this member does not hold (``[segment,
    offset]``); every other one took effect."""

    unknown: list[list[int]] = []


class ScaleEventInfo(Message, frozen=True):
    """One scale: in ``epoch``, at ``at_ms``, the segments ``sealed`` (segment -> end offset)
    were sealed and ``created`` opened; ``reason``: why (JSON text; "manual" for an
    operator's)."""

    epoch: int
    at_ms: int
    sealed: dict[int, int]
    created: list[int]
    reason: str = ""


class ScaleHistory(Message, frozen=True):
    stream: str
    events: list[ScaleEventInfo]


class FindEvents(Message, frozen=True):
    """Find events by routing key and/or time -> ``EventsFound``: the events of ``stream`` with
    routing key ``key`` (nil: any key) and a time in ``[start_ms, end_ms)`` (nil: open), at
    most ``limit`` (1..10,000): the newest, newest first (``newest_first``), or the oldest,
    oldest first. The broker reads only the batches its find indexes name (docs/format.md).
    Errors: ``stream_not_found``, ``invalid_argument`` (limit, an empty window). In a cluster
    any broker answers for every segment (it asks the brokers serving the others, with
    ``local``, and merges); ``wrong_broker`` while a segment has nobody serving it."""

    stream: str
    key: bytes | None = None
    start_ms: int | None = None
    end_ms: int | None = None
    limit: int = 100
    newest_first: bool = True
    #: in a cluster: search only the segments this broker serves (brokers asking each other)
    local: bool = False


class FoundEvent(Message, frozen=True):
    """One event a find returns, with where it is stored (``segment``, ``offset``)."""

    segment: int
    offset: int
    timestamp: int
    key: bytes | None
    value: bytes
    headers: dict[str, bytes] = {}


class EventsFound(Message, frozen=True):
    """``events`` in the order asked for; ``batches_read``: batches the broker decoded;
    ``truncated``: it stopped at 4 MiB of keys and values before ``limit``; ``searched``:
    the segments the answer covers, named for a ``local`` find (the asking broker checks that
    each it asked for was searched by the broker serving it)."""

    events: list[FoundEvent]
    batches_read: int = 0
    truncated: bool = False
    searched: list[int] = []


# --- quotas (docs/protocol.md "Quotas"): requests 40-41, reply 91 -----------------------------


class QuotaInfo(Message, frozen=True):
    """One scope's quota (inside ``SetQuota``'s answer and ``QuotaList``); nil: no limit.
    Bytes per second of record batches produced to / consumed from the scope's streams,
    requests per second, open connections of tokens limited to the scope."""

    scope: str
    produce_bytes: int | None = None
    consume_bytes: int | None = None
    requests: int | None = None
    connections: int | None = None


class SetQuota(Message, frozen=True):
    """Set (replace) a scope's quota; all limits nil removes it -> ``QuotaList`` (every
    quota, after the change). Admin only with authentication on. Stored before the answer;
    applies to the next request of the scope."""

    quota: QuotaInfo


class ListQuotas(Message, frozen=True):
    """-> ``QuotaList``. Admin only with authentication on."""


class QuotaList(Message, frozen=True):
    quotas: list[QuotaInfo]


# --- authentication (docs/protocol.md "Authentication"): requests 32-35, replies 87-88 -------


class CreateToken(Message, frozen=True):
    """-> ``TokenIssued``. Admin only. ``expires_s``: lifetime in seconds (0: 30 days);
    ``algorithm``: ``EdDSA`` or ``HS256``."""

    subject: str
    role: str = "user"
    scope: str | None = None
    expires_s: int = 0
    algorithm: str = "EdDSA"


class RevokeToken(Message, frozen=True):
    """-> ``Done``. Admin only. The token is refused from now on; connections using it are
    closed with ``authentication_failed``."""

    token_id: str


class ListTokens(Message, frozen=True):
    """-> ``TokenList``. Admin only."""


class TokenInfo(Message, frozen=True):
    """A token's id and claims (never the token itself); times in seconds since the epoch
    (0: unknown, for a revoked id the broker did not issue)."""

    token_id: str
    subject: str
    role: str
    scope: str | None
    created_at: int
    expires_at: int
    revoked: bool = False


class TokenIssued(Message, frozen=True):
    """A new token (shown once) and its claims."""

    token: str
    info: TokenInfo


class TokenList(Message, frozen=True):
    tokens: list[TokenInfo]


# --- access rules (docs/protocol.md "Access rules"): requests 36-39, replies 89-90 ----------


class AccessRule(Message, frozen=True):
    """Allow ``subject`` (``*``: every authenticated subject) to do ``action`` (produce,
    consume, manage, admin) on the streams ``pattern`` matches (``*``, ``demo/*``,
    ``*/orders``, ``demo/orders``; ``*`` and ``?`` within one part of the name)."""

    subject: str
    action: str
    pattern: str


class GrantRule(Message, frozen=True):
    """-> ``RuleList`` holding the rule. Admin only. Stored before the answer; in force for
    every connection at once. Granting a rule that exists changes nothing."""

    rule: AccessRule


class RevokeRule(Message, frozen=True):
    """-> ``RuleList`` holding the rule if there was one, else empty. Admin only. Stored
    before the answer; open connections lose what only it allowed at their next request."""

    rule: AccessRule


class ListRules(Message, frozen=True):
    """-> ``RuleList``, sorted by subject, action, pattern. Admin only."""


class CheckAccess(Message, frozen=True):
    """A dry run -> ``AccessDecision``: would ``subject`` (with ``role``, and a token limited
    to ``scope`` if set) be allowed ``action`` on ``stream`` (``*``: broker-wide)? Admin
    only."""

    subject: str
    action: str
    stream: str
    role: str = "user"
    scope: str | None = None


class RuleList(Message, frozen=True):
    rules: list[AccessRule]


class AccessDecision(Message, frozen=True):
    """``rule``: the rule that allowed it (nil when the role, the token's scope or the
    default decided); ``reason`` in words."""

    allowed: bool
    rule: AccessRule | None
    reason: str


# --- transactional ids (docs/protocol.md "Transactions"): request 43, reply 93 ---------------


class ListIdentities(Message, frozen=True):
    """-> ``IdentityList``: every transactional id starting with ``prefix`` ("" for all),
    sorted, each with its producer id, epoch and last commit (as ``GetIdentity`` answers; the
    Spark sink's queries are the ids under ``spark:``). A snapshot: a commit that ends
    meanwhile is in it or not, never half. Admin only with authentication on."""

    prefix: str = ""


class IdentityList(Message, frozen=True):
    identities: list[IdentityInfo]


# --- transactional id owners (docs/security.md "Transactional ids"): request 44 ----------------


class HandOverIdentity(Message, frozen=True):
    """-> ``Done``: make ``subject`` the owner of ``transactional_id`` (with authentication
    on, only its owner, or an admin, may InitProducer, ClaimProducer or GetIdentity it).
    Admin only with authentication on; stored before the answer."""

    transactional_id: str
    subject: str


# --- clusters (docs/cluster.md): request 45, reply 94 -------------------------------------------


class DescribeCluster(Message, frozen=True):
    """-> ``ClusterInfo``: the brokers serving this catalog and which holds each container. Any
    broker answers (a standalone one names itself as the holder of every container)."""


class BrokerInfo(Message, frozen=True):
    """A live broker: ``address`` takes the binary protocol, ``http_address`` the HTTP API
    and console ("" if it serves none); ``containers``: those it serves now."""

    broker_id: str
    address: str
    http_address: str
    containers: list[int]
    started_ms: int


class ClusterInfo(Message, frozen=True):
    """``owners[c]``: the id of the broker holding container ``c``'s lease ("" while nobody
    does: it is moving); ``containers``: how many the cluster has."""

    containers: int
    brokers: list[BrokerInfo]
    owners: list[str]


class ReadSegment(Message, frozen=True):
    """Broker to broker, in a cluster (docs/cluster.md, "Queue subscriptions"): whole batches
    of one segment from the one holding ``offset``, at least one if there is any, then up to
    ``max_bytes``, like a follow's ``Data`` but asked for -> ``SegmentData``. WrongBroker if
    this broker does not serve the segment, OffsetOutOfRange like a read. Needs the consume
    action on the stream."""

    stream: str
    segment: int
    offset: int
    max_bytes: int = 1 << 20


class SegmentData(Message, frozen=True):
    """Payload: the batches read (none at the end). ``next_offset``: the offset after the
    last one (``offset`` asked when none); ``end_offset``: the segment's end as its broker knows
    it now; ``sealed``: no event will follow ``end_offset``."""

    next_offset: int
    end_offset: int
    sealed: bool = False


class PrepareSeal(Message, frozen=True):
    """Broker to broker, in a cluster (docs/cluster.md, "Scaling across brokers"): the broker
    coordinating a merge (the one serving its lowest-numbered segment) asks the broker serving
    ``segments`` to prepare them for it -> ``SealPrepared``: refuse appends to them
    (SegmentSealed, which producers retry), wait until every append they took is durable and
    no transaction this broker coordinates is still open on them (up to ``wait_ms``), and
    answer their ends. They stay closed until ``EndSeal``, or until the answer's deadline has
    passed and the catalog says whether the merge was recorded (sealed) or not (open again).
    ``max_rate`` >= 0 (an automatic merge of cold segments): refused with InvalidArgument
    unless these segments, as this broker measures them, carried less than that (events or
    bytes per second, as the stream's policy counts) in every 10 s of the last 300 s.
    ``epoch``: the one the merge makes; ``coordinator``: its broker's id. InvalidArgument for
    a sealed or preparing segment, WrongBroker if this broker does not serve them. With
    authentication on, only brokers (admin) may send it."""

    stream: str
    segments: list[int]
    epoch: int
    coordinator: str
    wait_ms: int = 3000
    max_rate: float = -1.0


class SealPrepared(Message, frozen=True):
    """``PrepareSeal``'s answer: ``ends[i]`` is ``segments[i]``'s end offset; ``leases``
    the epochs of their containers' leases (``containers[i]``), which fence the merge's
    catalog record (a container that moved since refuses it); ``deadline_ms``: the catalog's
    clock after which this broker stops waiting for ``EndSeal`` (the record is refused from
    then on). ``rates[i]``: ``segments[i]``'s rates as this broker measured them (where its
    appends land), for the merge's recorded decision: ``[measured_ms, events/s over the last
    10 s, 60 s, 300 s, peak 10 s, then bytes/s the same four]`` (streams.Rates); empty from
    a broker that sends none."""

    ends: list[int]
    containers: list[int]
    leases: list[int]
    deadline_ms: int
    rates: list[list[float]] = []


class EndSeal(Message, frozen=True):
    """Broker to broker: the outcome of the merge that prepared ``segments`` (``PrepareSeal``):
    ``committed`` True, its record is in the catalog (the segments are sealed, this broker
    reads the successors from the catalog); False, it was refused and will not be recorded
    (the segments take appends again) -> ``Done``. For segments not prepared for ``epoch``:
    ``Done``, nothing changes."""

    stream: str
    segments: list[int]
    epoch: int
    committed: bool


class ApplyBatch(Message, frozen=True):
    """Broker to broker, in a cluster (docs/cluster.md, "Transactions"): payload, one batch of
    a committed transaction, stamped with its owner's producer id, epoch and sequence, for a
    segment the asking broker (the transaction's coordinator) does not serve. -> ``AppendAck``
    once durable; a batch the segment already holds (a re-apply) is answered with
    ``base_offset`` -1 and appended nothing. Without a payload it asks the sequence the segment
    expects next from ``producer_id`` at ``epoch`` (0 if none of that epoch): ``AppendAck(-1,
    next)``. With authentication on, only brokers (admin) may send it."""

    stream: str
    segment: int
    producer_id: int = -1
    epoch: int = 0


class HoldPositions(Message, frozen=True):
    """Broker to broker, in a cluster (docs/cluster.md, "Consume-transform-produce"): the
    coordinator of transaction ``txn_id`` asks the coordinator of ``positions``' group to check
    them as a member's commit would be checked (``generation``, the member holds those
    segments, the member's connection authenticated as ``subject``: "" without
    authentication) and to hold the group (no grant, commit or reset) until
    ``ReleasePositions(hold_id)`` or ``ttl_ms`` (at most 30 s) -> ``PositionsHeld``. Errors as
    a commit's: ``not_assigned``, ``stale_generation``, ``unknown_member``; ``wrong_broker``
    if this broker does not coordinate the group. With authentication on, only brokers
    (admin) may send it."""

    hold_id: int
    txn_id: int
    subject: str
    ttl_ms: int
    positions: TxnPositions


class ReleasePositions(Message, frozen=True):
    """Broker to broker: end hold ``hold_id`` (``HoldPositions``). ``stored``: 1 the commit
    record with the positions is stored (the group takes them), 0 it is not (nothing
    changes), -1 unknown (the group reads its positions from the catalog) ->
    ``PositionsHeld`` (``held`` False: the hold had expired or never was)."""

    hold_id: int
    stored: int


class PositionsHeld(Message, frozen=True):
    """The answer to ``HoldPositions`` and ``ReleasePositions``: the subscription's stream id
    and generation as the group coordinator has them; ``valid_ms``: how long from its answer
    the group coordinator surely keeps coordinating the group (what is left of its lease):
    the commit record must be written by then; ``held``: the hold is (was) in place."""

    hold_id: int
    stream_id: int
    generation: int
    valid_ms: int = 0
    held: bool = True


class AppendAudit(Message, frozen=True):
    """Broker to broker, in a cluster (docs/cluster.md, "Audit"): audit records of broker
    ``broker_id`` (each one JSON record, docs/security.md) for the audit stream's segment
    served here -> ``AuditHead`` once they are durable: the broker's last record in the
    stream. Only records that continue that broker's chain there are appended; records the
    stream holds already (a retry) are skipped; records that would fork it are refused
    (``invalid_argument`` with details ``head_seq``, ``head_hash``). Without records it asks
    the head. WrongBroker if this broker does not serve the segment. With authentication on,
    only brokers (admin) may send it."""

    broker_id: str
    records: list[bytes] = []


class AuditHead(Message, frozen=True):
    """Broker ``broker_id``'s last record in the audit stream: its ``seq`` and ``hash`` (0 and
    64 zeros for none)."""

    broker_id: str
    seq: int
    hash: str


KINDS: dict[int, type[Message]] = {
    1: Hello,
    2: CreateStream,
    3: DeleteStream,
    4: ListStreams,
    5: DescribeStream,
    6: Append,
    7: GetCut,
    8: Follow,
    9: Credit,
    10: Unfollow,
    11: InitProducer,
    12: BeginTxn,
    13: EndTxn,
    14: ListTxns,
    15: GetIdentity,
    16: ClaimProducer,
    17: UpdateStream,
    18: CreateSubscription,
    19: ListSubscriptions,
    20: DescribeSubscription,
    21: DeleteSubscription,
    22: ResetSubscription,
    23: JoinGroup,
    24: PollGroup,
    25: CommitPositions,
    26: LeaveGroup,
    27: FetchEvents,
    28: SettleEvents,
    29: ScaleStream,
    30: GetScaleHistory,
    31: FindEvents,
    32: CreateToken,
    33: RevokeToken,
    34: ListTokens,
    36: GrantRule,
    37: RevokeRule,
    38: ListRules,
    39: CheckAccess,
    40: SetQuota,
    41: ListQuotas,
    43: ListIdentities,
    44: HandOverIdentity,
    45: DescribeCluster,
    48: PrepareSeal,
    49: EndSeal,
    47: ReadSegment,
    46: ApplyBatch,
    52: AppendAudit,
    50: HoldPositions,
    51: ReleasePositions,
    64: Welcome,
    65: Error,
    66: Done,
    67: StreamInfo,
    68: StreamList,
    69: AppendAck,
    70: Cut,
    71: Data,
    72: FollowEnded,
    73: FollowFailed,
    74: ProducerGrant,
    75: TxnBegun,
    76: TxnEnded,
    77: TxnList,
    78: IdentityInfo,
    79: SubscriptionInfo,
    80: SubscriptionList,
    81: GroupJoined,
    82: GroupAssignment,
    83: EventsDelivered,
    84: Settled,
    85: ScaleHistory,
    86: EventsFound,
    87: TokenIssued,
    88: TokenList,
    89: RuleList,
    90: AccessDecision,
    91: QuotaList,
    93: IdentityList,
    94: ClusterInfo,
    97: SealPrepared,
    96: SegmentData,
    99: AuditHead,
    98: PositionsHeld,
}
KIND_OF: dict[type[Message], int] = {cls: kind for kind, cls in KINDS.items()}

"""Typed errors shared by every layer, and their wire codes.

The broker sends an error as ``(code, message, details)``; the client turns the code back into
the same exception class, so ``except StreamNotFound`` works the same in-process and over TCP.
Each message says what went wrong and, where there is one, the fix.
"""

from __future__ import annotations

from typing import Any, ClassVar


class SlipstreamError(Exception):
    """Base class of every error slipstream raises on purpose."""

    code: ClassVar[str] = "internal"
    #: True when the same request may succeed if sent again later (full disk, lost connection).
    retriable: ClassVar[bool] = False

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details


class ProtocolError(SlipstreamError):
    """Bytes on the wire that do not follow the protocol (bad frame, unknown type, bad field)."""

    code = "protocol"


class UnsupportedVersion(ProtocolError):
    """The peer speaks a protocol version this side does not."""

    code = "unsupported_version"


class CorruptBatch(SlipstreamError):
    """A record batch whose header or CRC32C does not check out; it is never served."""

    code = "corrupt_batch"


class CorruptData(SlipstreamError):
    """Stored data failed its CRC32C check when read; ``details`` name segment and offset."""

    code = "corrupt_data"


class BatchTooLarge(SlipstreamError):
    """A batch above the broker's ``max_batch_bytes``; send smaller batches."""

    code = "batch_too_large"


class InvalidName(SlipstreamError):
    """A stream name that is not ``scope/name`` of ``[a-z0-9._-]``, at most 255 characters."""

    code = "invalid_name"


class InvalidArgument(SlipstreamError):
    """A request field out of range (segment count, retention, offsets, options)."""

    code = "invalid_argument"


class MalformedValue(InvalidArgument):
    """A value that is not JSON of the shape a reader asked for (Spark ``schema``, FAILFAST)."""

    code = "malformed_value"


class StreamNotFound(SlipstreamError):
    """The stream does not exist, or was deleted."""

    code = "stream_not_found"


class StreamExists(SlipstreamError):
    """``create_stream`` for a name that is already taken."""

    code = "stream_exists"


class SegmentNotFound(SlipstreamError):
    """The segment is not part of the stream (stale routing table or a bad StreamCut)."""

    code = "segment_not_found"


class OffsetOutOfRange(SlipstreamError):
    """A read before the oldest retained event or past the end; ``details`` name the bounds."""

    code = "offset_out_of_range"


class StorageFull(SlipstreamError):
    """The broker could not make an append durable (disk full); nothing was acknowledged."""

    code = "storage_full"
    retriable = True


class StorageError(SlipstreamError):
    """The broker could not make an append durable for another IO reason; not acknowledged."""

    code = "storage_error"
    retriable = True


class AuthenticationFailed(SlipstreamError):
    """Credentials were missing or wrong."""

    code = "authentication_failed"


class PermissionDenied(SlipstreamError):
    """The caller is authenticated but no access rule allows what it asked; the message
    names the action and the stream, and how an administrator grants it."""

    code = "permission_denied"


class BrokerUnavailable(SlipstreamError):
    """No broker answered at the address, or the connection was lost."""

    code = "broker_unavailable"
    retriable = True


class TlsError(SlipstreamError):
    """TLS could not be set up between client and broker: one side speaks TLS and the other
    not, the broker's certificate is not signed by a CA the client trusts or not issued for
    the address dialled, or the broker requires a client certificate. The message says
    which, and the fix; not retriable (dialling again meets the same setup)."""

    code = "tls_error"


class BrokerShuttingDown(SlipstreamError):
    """The broker is stopping; retry against it after it restarts."""

    code = "shutting_down"
    retriable = True


class DataDirLocked(SlipstreamError):
    """Another broker already owns the data directory."""

    code = "data_dir_locked"


class LeaseLost(SlipstreamError):
    """This broker no longer holds the lease of the container (docs/operations.md, "Leases and
    fencing"): its lease expired or another broker took it over, so it acknowledges no append
    to that container and makes no catalog write for it visible. Nothing of the refused
    request was acknowledged; retry (against the container's new holder, once clients route)."""

    code = "lease_lost"
    retriable = True


class LeaseHeld(SlipstreamError):
    """Broker start only: another broker holds the lease of a container in the shared catalog
    (``details``: container, holder, expires_ms). One broker per catalog until routing between
    brokers exists: stop the other broker, or wait until its lease expires."""

    code = "lease_held"


class ProducerFenced(SlipstreamError):
    """A newer producer opened with the same transactional id; this one may not write."""

    code = "producer_fenced"


class OutOfOrderSequence(SlipstreamError):
    """A batch's sequence number skips ahead of (or lies behind) what the broker expects from
    this producer in this segment: an event would be lost or duplicated. Details name the
    expected and received sequence."""

    code = "out_of_order_sequence"


class TransactionAborted(SlipstreamError):
    """The transaction was aborted (timeout, operator, a broker restart, or fencing) and none
    of its events will ever be visible; run it again."""

    code = "transaction_aborted"


class TransactionNotFound(SlipstreamError):
    """No open transaction has this id (it never existed, or it ended long ago)."""

    code = "transaction_not_found"


class NotOwner(SlipstreamError):
    """A producer id or transaction used by a connection that does not own it: only the
    connection that ran InitProducer (or re-claimed the id with its token after a reconnect)
    may append with it, or write to, commit or abort its transactions."""

    code = "not_owner"


class WrongBroker(SlipstreamError):
    """In a cluster (docs/cluster.md), this broker does not serve the container the request
    needs: a segment's appends and follows, a subscription's group or queue, or a transactional
    id are served by the broker that holds that container's lease. ``details``: ``container``,
    and ``owner`` and ``address`` of the broker serving it (both None while nobody does: the
    container is moving; ask again shortly). Clients that know the cluster route there by
    themselves; nothing of a refused request was done."""

    code = "wrong_broker"


class LimitExceeded(SlipstreamError):
    """A connection went past one of the broker's per-connection limits; ``details`` name the
    limit and its value. The connection stays open unless the message says otherwise."""

    code = "limit_exceeded"


class TooManyFollows(LimitExceeded):
    """More follows open on one connection than the broker allows; unfollow some, or read
    through another connection."""

    code = "too_many_follows"


class TooManyRequests(LimitExceeded):
    """More requests awaiting an answer on one connection than the broker allows; wait for
    answers before sending more."""

    code = "too_many_requests"
    retriable = True


class CreditLimitExceeded(LimitExceeded):
    """A follow was granted more unused credit than the broker allows; grant credit as data
    is consumed, not ahead of it."""

    code = "credit_limit_exceeded"


class IdleTimeout(SlipstreamError):
    """The broker closed a connection that sent no Hello in time, or nothing at all for too
    long while it had no follows and no requests open; connect again."""

    code = "idle_timeout"


class SegmentSealed(SlipstreamError):
    """An append to a segment that a split or merge sealed; ``details`` name its successors.
    Nothing of the batch was stored; clients send its events to the successors that own
    their keys now (the Python client does so by itself)."""

    code = "segment_sealed"


class KeyOutOfRange(SlipstreamError):
    """An append whose keyed events include one whose key hash lies outside the segment's key
    range: the sender routed by a stale or wrong view of the stream's segments. ``details``
    name the stream, the segment, its range (``key_lo``, ``key_hi``, inclusive), the first
    such key's hash and how many there were. Nothing of the batch was stored; describe the
    stream again and send each key to the open segment whose range holds its hash (the
    Python client does so by itself)."""

    code = "key_out_of_range"


class SubscriptionNotFound(SlipstreamError):
    """No subscription of that name on the stream; ``details`` name stream and subscription."""

    code = "subscription_not_found"


class SubscriptionExists(SlipstreamError):
    """A subscription of that name already exists on the stream."""

    code = "subscription_exists"


class ModeMismatch(InvalidArgument):
    """A consumer joined a subscription with a mode other than the subscription's."""

    code = "mode_mismatch"


class UnknownMember(SlipstreamError):
    """The group does not know this member: its session expired, it left, or the broker
    restarted. The client joins again and continues from the committed positions."""

    code = "unknown_member"
    retriable = True


class NotAssigned(SlipstreamError):
    """A commit for a segment this member does not own (any more): it was moved to another
    member, or the member's session expired. Nothing was committed for that segment."""

    code = "not_assigned"


class StaleGeneration(SlipstreamError):
    """A commit carrying positions from before the subscription was reset; the reset wins and
    the consumer restarts from the reset positions."""

    code = "stale_generation"


class GroupActive(SlipstreamError):
    """Positions committed from outside a group (a Spark query's progress, an operator's
    commit) while members are joined; stop the group or use another subscription."""

    code = "group_active"


class UnknownDelivery(SlipstreamError):
    """An ack or nack for an event this member does not hold: never delivered to it, already
    acknowledged, or redelivered elsewhere after its ack timeout."""

    code = "unknown_delivery"


def _all_subclasses(cls: type[SlipstreamError]) -> list[type[SlipstreamError]]:
    found = [cls]
    for sub in cls.__subclasses__():
        found.extend(_all_subclasses(sub))
    return found


ERRORS_BY_CODE: dict[str, type[SlipstreamError]] = {
    cls.code: cls for cls in _all_subclasses(SlipstreamError)
}


def error_from_wire(code: str, message: str, details: dict[str, Any]) -> SlipstreamError:
    """Rebuild the typed exception the broker sent; unknown codes become the base class."""
    cls = ERRORS_BY_CODE.get(code, SlipstreamError)
    return cls(message, **details)

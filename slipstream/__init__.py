"""slipstream: durable messaging, stream storage and stream compute on Spark, as one service.

import slipstream
with slipstream.connect("127.0.0.1:7070") as client:
    client.create_stream("demo/orders", segments=4, exist_ok=True)
    with client.producer("demo/orders") as producer:  # raises if an event was not stored
        producer.send(b"payload", key="user-42")
    for event in client.reader("demo/orders", start="earliest", end=client.tail("demo/orders")):
        print(event.key, event.value, event.offset)

asyncio: ``async with slipstream.connect_async(...) as client`` and the same API with
``await``; see docs/python.md.
"""

__version__ = "0.1.0"

from . import _errors as errors
from ._errors import (
    AuthenticationFailed,
    BatchTooLarge,
    BrokerShuttingDown,
    BrokerUnavailable,
    CorruptBatch,
    CorruptData,
    CreditLimitExceeded,
    DataDirLocked,
    GroupActive,
    IdleTimeout,
    InvalidArgument,
    InvalidName,
    LimitExceeded,
    MalformedValue,
    ModeMismatch,
    NotAssigned,
    NotOwner,
    OffsetOutOfRange,
    OutOfOrderSequence,
    ProducerFenced,
    ProtocolError,
    SegmentNotFound,
    SlipstreamError,
    StaleGeneration,
    StorageError,
    StorageFull,
    StreamExists,
    StreamNotFound,
    SubscriptionExists,
    SubscriptionNotFound,
    TooManyFollows,
    TooManyRequests,
    TransactionAborted,
    TransactionNotFound,
    UnknownDelivery,
    UnknownMember,
    UnsupportedVersion,
)
from .client import (
    AsyncClient,
    AsyncConsumer,
    AsyncProducer,
    AsyncReader,
    AsyncTransaction,
    BulkReceipt,
    Client,
    CommitInfo,
    Consumer,
    Producer,
    Reader,
    Receipt,
    Transaction,
    connect,
    connect_async,
)
from .format import Event
from .protocol import SegmentInfo, StreamInfo
from .streams import Position, StreamCut

__all__ = [
    "AsyncClient",
    "AsyncConsumer",
    "AsyncProducer",
    "AsyncReader",
    "AsyncTransaction",
    "AuthenticationFailed",
    "BatchTooLarge",
    "BrokerShuttingDown",
    "BrokerUnavailable",
    "BulkReceipt",
    "Client",
    "CommitInfo",
    "Consumer",
    "CorruptBatch",
    "CorruptData",
    "CreditLimitExceeded",
    "DataDirLocked",
    "Event",
    "GroupActive",
    "IdleTimeout",
    "InvalidArgument",
    "InvalidName",
    "LimitExceeded",
    "MalformedValue",
    "ModeMismatch",
    "NotAssigned",
    "NotOwner",
    "OffsetOutOfRange",
    "OutOfOrderSequence",
    "Position",
    "Producer",
    "ProducerFenced",
    "ProtocolError",
    "Reader",
    "Receipt",
    "SegmentInfo",
    "SegmentNotFound",
    "SlipstreamError",
    "StaleGeneration",
    "StorageError",
    "StorageFull",
    "StreamCut",
    "StreamExists",
    "StreamInfo",
    "StreamNotFound",
    "SubscriptionExists",
    "SubscriptionNotFound",
    "TooManyFollows",
    "TooManyRequests",
    "Transaction",
    "TransactionAborted",
    "TransactionNotFound",
    "UnknownDelivery",
    "UnknownMember",
    "UnsupportedVersion",
    "__version__",
    "connect",
    "connect_async",
    "errors",
]

"""The Python client: blocking (``Client``) and asyncio (``AsyncClient``)."""

from ._client import (
    AsyncClient,
    AsyncProducer,
    AsyncReader,
    AsyncTransaction,
    Client,
    CommitInfo,
    Producer,
    Reader,
    Transaction,
    connect,
    connect_async,
    default_address,
)
from ._cluster import split_addresses
from ._connection import DEFAULT_ADDRESS, parse_address
from ._consumer import AsyncConsumer, Consumer
from ._producer import BulkReceipt, Receipt
from ._queue import AsyncQueueConsumer, QueueConsumer, QueueEvent

__all__ = [
    "DEFAULT_ADDRESS",
    "AsyncClient",
    "AsyncConsumer",
    "AsyncProducer",
    "AsyncQueueConsumer",
    "AsyncReader",
    "AsyncTransaction",
    "BulkReceipt",
    "Client",
    "CommitInfo",
    "Consumer",
    "Producer",
    "QueueConsumer",
    "QueueEvent",
    "Reader",
    "Receipt",
    "Transaction",
    "connect",
    "connect_async",
    "default_address",
    "parse_address",
    "split_addresses",
]

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
from ._connection import DEFAULT_ADDRESS, parse_address
from ._consumer import AsyncConsumer, Consumer
from ._producer import BulkReceipt, Receipt

__all__ = [
    "DEFAULT_ADDRESS",
    "AsyncClient",
    "AsyncConsumer",
    "AsyncProducer",
    "AsyncReader",
    "AsyncTransaction",
    "BulkReceipt",
    "Client",
    "CommitInfo",
    "Consumer",
    "Producer",
    "Reader",
    "Receipt",
    "Transaction",
    "connect",
    "connect_async",
    "default_address",
    "parse_address",
]

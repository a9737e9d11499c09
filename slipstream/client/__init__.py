"""The Python client: blocking (``Client``) and asyncio (``AsyncClient``)."""

from ._client import (
    AsyncClient,
    AsyncProducer,
    AsyncReader,
    Client,
    Producer,
    Reader,
    connect,
    connect_async,
    default_address,
)
from ._connection import DEFAULT_ADDRESS, parse_address
from ._producer import BulkReceipt, Receipt

__all__ = [
    "DEFAULT_ADDRESS",
    "AsyncClient",
    "AsyncProducer",
    "AsyncReader",
    "BulkReceipt",
    "Client",
    "Producer",
    "Reader",
    "Receipt",
    "connect",
    "connect_async",
    "default_address",
    "parse_address",
]

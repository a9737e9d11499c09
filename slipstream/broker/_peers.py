"""Brokers of a cluster asking each other (docs/cluster.md): the live state of a segment (its
end, its size, positions by time) is known only to the broker that serves its container, so a
broker answering DescribeStream, ListStreams or GetCut for a whole stream asks the others for
theirs, with ``local=True`` (answer for the containers you serve, ask nobody), and merges.

Appends and follows are never forwarded: clients route them to the owner themselves.

Threads: the loop only. One connection per peer, opened on first use and again after it
drops; a request that fails (the peer died, or handed the container over meanwhile) is not
retried here: the caller gets WrongBroker and asks again, by then with a fresher map.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable, Sequence
from typing import Any

from .._errors import BrokerUnavailable, SlipstreamError
from ..client._connection import Connection
from ..protocol import Message, Payload
from ._cluster import Cluster

log = logging.getLogger("slipstream.peers")

#: how long a broker waits for another's answer before it tells its caller to ask again
PEER_TIMEOUT_S = 5.0


class Peers:
    def __init__(
        self,
        cluster: Cluster,
        credentials: Callable[[], tuple[ssl.SSLContext | None, str | None]] = lambda: (None, None),
    ) -> None:
        self.cluster = cluster
        #: the TLS context and token to dial another broker with (fresh for each connection)
        self.credentials = credentials
        self._connections: dict[str, Connection] = {}
        self._opening: dict[str, asyncio.Task[Connection]] = {}

    async def ask(self, broker_id: str, message: Message) -> Message:
        """``message``'s answer from broker ``broker_id``; raises BrokerUnavailable if it is
        not a live member or does not answer within PEER_TIMEOUT_S, or the error it answers."""
        reply, _ = await self.exchange(broker_id, message)
        return reply

    async def exchange(
        self, broker_id: str, message: Message, payload: Sequence[Any] = ()
    ) -> tuple[Message, Payload]:
        """``ask`` with a payload each way (an Append's batch, ReadSegment's batches); raises
        TimeoutError after PEER_TIMEOUT_S."""
        async with asyncio.timeout(PEER_TIMEOUT_S):
            connection = await self._connection(broker_id)
            try:
                return await connection.request(message, payload)
            except BrokerUnavailable:
                connection.close()
                self._connections.pop(broker_id, None)
                raise

    async def connection(self, broker_id: str) -> Connection:
        """The open connection to broker ``broker_id`` (opened if needed; BrokerUnavailable
        if it is not a live member or cannot be reached): for requests sent in an order the
        peer must keep (``ApplyBatch``), with ``Connection.send_request``."""
        return await self._connection(broker_id)

    async def _connection(self, broker_id: str) -> Connection:
        connection = self._connections.get(broker_id)
        if connection is not None and connection.closed is None:
            return connection
        opening = self._opening.get(broker_id)
        if opening is None:
            member = self.cluster.members.get(broker_id)
            if member is None:
                raise BrokerUnavailable(f"broker {broker_id!r} is not a live member of the cluster")
            tls, token = self.credentials()
            opening = asyncio.get_running_loop().create_task(
                Connection.open(
                    member.address,
                    client_name=f"slipstream-broker/{self.cluster.broker_id}",
                    tls=tls,
                    token=token,
                )
            )
            self._opening[broker_id] = opening
            opening.add_done_callback(lambda _: self._opening.pop(broker_id, None))
        connection = await asyncio.shield(opening)
        self._connections[broker_id] = connection
        return connection

    def close(self) -> None:
        for connection in self._connections.values():
            connection.close()
        self._connections.clear()


async def gather_answers(
    peers: Peers, owners: dict[str, Message]
) -> dict[str, Message | SlipstreamError]:
    """Ask several peers at once: each broker id's answer, or the error it gave."""

    async def one(broker_id: str, message: Message) -> Message | SlipstreamError:
        try:
            return await peers.ask(broker_id, message)
        except SlipstreamError as exc:
            return exc
        except TimeoutError:
            return BrokerUnavailable(f"broker {broker_id!r} did not answer in {PEER_TIMEOUT_S} s")

    answers = await asyncio.gather(*(one(b, m) for b, m in owners.items()))
    return dict(zip(owners, answers, strict=True))

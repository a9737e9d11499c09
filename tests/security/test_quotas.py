"""Tenant quotas on a real broker (slipstream/security/_quotas.py, docs/security.md "Quotas").

No test asserts how fast anything ran. What is asserted:

* lower bounds the broker guarantees: with a rate quota ``Q`` and ``N`` bytes, the last
  acknowledgement (or data frame) cannot come before ``(N - slack) / Q`` seconds, where the
  slack is the bucket's burst plus one batch or frame (the accounting's proven bound). Load on
  the machine only makes a run slower, so these cannot flake the wrong way;
* the broker's own throttle counter (``slipstream_throttled_seconds``): positive for the
  scope over its quota, absent for the scope next to it and after the quota is removed;
* no error and no loss: every event sent is read back once.
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
import urllib.request

import pytest
from conftest import BrokerProcess

import slipstream
from slipstream import InvalidArgument, InvalidName, LimitExceeded, PermissionDenied

EVENT = 10_000  # bytes of each event's value (random: lz4 cannot shrink it)


def throttled(broker: BrokerProcess) -> dict[tuple[str, str], float]:
    """(scope, quota) -> seconds the broker held that scope back, from /metrics."""
    with urllib.request.urlopen(f"{broker.http_url}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    pattern = r'slipstream_throttled_seconds_total\{quota="([^"]+)",scope="([^"]+)"\} (\S+)'
    return {(s, q): float(v) for q, s, v in re.findall(pattern, text)}


def produce(client: slipstream.Client, stream: str, total: int) -> float:
    """Send ``total`` bytes of values in 10 kB events; -> seconds until all acknowledged."""
    values = [os.urandom(EVENT) for _ in range(16)]
    started = time.monotonic()
    with client.producer(stream, batch_bytes=32 * 1024, linger_ms=1, compression=None) as p:
        for i in range(total // EVENT):
            p.send(values[i % 16], key=str(i))
        p.flush()
    return time.monotonic() - started


def read_all(client: slipstream.Client, stream: str) -> tuple[int, float]:
    """Read ``stream`` from the earliest event to its tail now -> (events, seconds)."""
    end = client.tail(stream)
    started = time.monotonic()
    with client.reader(stream, "earliest", end) as reader:
        count = sum(1 for _ in reader)
    return count, time.monotonic() - started


def test_a_producer_over_its_quota_is_slowed_not_refused_and_its_neighbour_is_not(
    broker: BrokerProcess, client: slipstream.Client
) -> None:
    quota, total = 200_000, 1_000_000
    client.set_quota("slow", produce_bytes=quota)
    client.create_stream("slow/events", segments=1)
    client.create_stream("fast/events", segments=1)
    neighbour: list[float] = []
    with broker.client() as other:
        thread = threading.Thread(
            target=lambda: neighbour.append(produce(other, "fast/events", total))
        )
        thread.start()
        seconds = produce(client, "slow/events", total)
        thread.join()
    # stored bytes are a little more than the values: the bound holds all the more
    assert seconds >= 0.95 * (total - quota - 64 * 1024) / quota
    counters = throttled(broker)
    assert counters[("slow", "produce")] > 0
    assert not any(scope == "fast" for scope, _ in counters)  # never held back
    assert read_all(client, "slow/events")[0] == total // EVENT  # nothing lost
    assert read_all(client, "fast/events")[0] == total // EVENT

    # removed: the next produce of the scope is held back no more
    assert client.delete_quota("slow") == []
    before = throttled(broker)[("slow", "produce")]
    produce(client, "slow/events", total)
    assert throttled(broker)[("slow", "produce")] == before
    assert read_all(client, "slow/events")[0] == 2 * total // EVENT


def test_a_reader_over_its_consume_quota_gets_every_event_later(
    broker: BrokerProcess, client: slipstream.Client
) -> None:
    quota, total = 100_000, 600_000
    client.create_stream("readers/events", segments=2)
    produce(client, "readers/events", total)
    client.set_quota("readers", consume_bytes=quota)
    count, seconds = read_all(client, "readers/events")
    assert count == total // EVENT
    # frames are at most one second of the quota: the burst plus the last frame sent early
    assert seconds >= 0.95 * (total - 2 * quota) / quota
    assert throttled(broker)[("readers", "consume")] > 0


def test_requests_over_the_request_quota_are_answered_later(
    broker: BrokerProcess, client: slipstream.Client
) -> None:
    rate, asked = 20, 60
    client.create_stream("chatty/events", segments=1)
    client.set_quota("chatty", requests=rate)

    async def ask_at_once() -> float:
        # sent together (pipelined): the broker reads them at once, so each must wait its turn
        async with slipstream.connect_async(broker.address) as asking:
            started = time.monotonic()
            answers = await asyncio.gather(
                *(asking.describe_stream("chatty/events") for _ in range(asked))
            )
            assert {a.name for a in answers} == {"chatty/events"}
            return time.monotonic() - started

    seconds = asyncio.run(ask_at_once())
    assert seconds >= 0.95 * (asked - rate - 1) / rate
    assert throttled(broker)[("chatty", "requests")] > 0


def test_quotas_are_checked_listed_and_survive_a_restart(
    broker: BrokerProcess, client: slipstream.Client
) -> None:
    with pytest.raises(InvalidArgument, match="positive"):
        client.set_quota("demo", produce_bytes=0)
    with pytest.raises(InvalidName):
        client.set_quota("Not A Scope", requests=5)
    client.set_quota("demo", produce_bytes=10_000_000, requests=1000, connections=50)
    quotas = client.set_quota("b-team", consume_bytes=5_000)
    assert [
        (q.scope, q.produce_bytes, q.consume_bytes, q.requests, q.connections) for q in quotas
    ] == [
        ("b-team", None, 5_000, None, None),
        ("demo", 10_000_000, None, 1000, 50),
    ]
    broker.restart()  # kill -9: what was answered was stored
    with broker.client() as again:
        assert again.quotas() == quotas
        # and enforced after the restart
        again.create_stream("b-team/events", segments=1)
        produce(again, "b-team/events", 100_000)
        assert read_all(again, "b-team/events")[0] == 10
    assert throttled(broker)[("b-team", "consume")] > 0


def test_connections_past_the_scope_quota_are_refused(
    broker_factory: type[BrokerProcess],
) -> None:
    from slipstream.security import TokenKeys

    broker = broker_factory("--auth")
    broker.data_dir.mkdir(parents=True)
    keys = TokenKeys.load(broker.data_dir)
    admin = keys.issue("ops", "admin").token
    tenant = keys.issue("alice", "user", scope="demo").token
    unscoped = keys.issue("bob", "user").token
    broker.start()
    with slipstream.connect(broker.address, token=admin) as ops:
        ops.set_quota("demo", connections=2)
        first = slipstream.connect(broker.address, token=tenant)
        with pytest.raises(PermissionDenied):  # quotas are for admins
            first.set_quota("demo", connections=100)
        with pytest.raises(PermissionDenied):
            first.quotas()
        second = slipstream.connect(broker.address, token=tenant)
        with pytest.raises(LimitExceeded, match="'demo' has 2 connections open"):
            slipstream.connect(broker.address, token=tenant).list_streams()
        # tokens of other scopes, or of none, are not counted
        for _ in range(3):
            with slipstream.connect(broker.address, token=unscoped):
                pass
        first.close()
        for _ in range(50):  # the broker sees the close soon after, not at once
            try:
                third = slipstream.connect(broker.address, token=tenant)
                break
            except LimitExceeded:
                time.sleep(0.1)
        else:
            pytest.fail("a place freed by a closed connection was never given back")
        third.close()
        second.close()
        ops.delete_quota("demo")


def test_a_queue_member_over_the_consume_quota_gets_every_event_later(
    broker: BrokerProcess, client: slipstream.Client
) -> None:
    quota, total = 100_000, 500_000
    client.create_stream("workers/jobs", segments=1)
    client.create_subscription("workers/jobs", "work", mode="queue")
    produce(client, "workers/jobs", total)
    client.set_quota("workers", consume_bytes=quota)
    seen: set[tuple[int, int]] = set()
    started = time.monotonic()
    with client.consumer("workers/jobs", "work", max_in_flight=8) as member:
        for event in member:
            seen.add((event.segment, event.offset))
            event.ack()
            if len(seen) == total // EVENT:
                break
    seconds = time.monotonic() - started
    # each FetchEvents answer is held back for the bytes of its whole batches (32 KiB
    # here): the burst plus the last answer come early, the rest at the quota
    assert seconds >= 0.95 * (total - quota - 64 * 1024) / quota
    assert throttled(broker)[("workers", "consume")] > 0

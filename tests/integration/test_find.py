"""Find by key and by time on a real broker process: the client (sync and asyncio) and the CLI
against what a full read of the stream holds, with data in chunks (small journal files, so the
mover indexes most of it) and in the journal, after a kill -9 and restart (chunk indexes from
the catalog, the journal's rebuilt), across a split, and the errors a find can get.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx
import pytest
from conftest import BrokerProcess

import slipstream
from slipstream import Event

KEYS = [f"user-{i}" for i in range(30)]
BASE_TS = 1_790_000_000_000
PER_ROUND = 1200


def produce(client: slipstream.Client, stream: str, start: int, count: int) -> None:
    """Events ``start .. start + count``: event i has key KEYS[i * 7 % 30], time BASE_TS +
    i * 10 ms and value ``i``, in small batches (several journal files with --roll 64KiB)."""
    with client.producer(stream, linger_ms=1, batch_bytes=4096) as producer:
        for i in range(start, start + count):
            producer.send(
                b"%d-" % i + b"x" * 100, key=KEYS[i * 7 % len(KEYS)], timestamp=BASE_TS + i * 10
            )


def read_all(client: slipstream.Client, stream: str) -> list[Event]:
    with client.reader(stream, start="earliest", end=client.tail(stream)) as reader:
        return list(reader)


def scan(
    events: list[Event],
    key: str | None,
    start: int | None,
    end: int | None,
    limit: int,
    newest_first: bool,
) -> list[tuple[int, int]]:
    """What a find must return, from a full read: (segment, offset) of the matches."""
    hits = [
        e
        for e in events
        if (key is None or e.key == key.encode())
        and (start is None or e.timestamp >= start)
        and (end is None or e.timestamp < end)
    ]
    if key is None:
        hits.sort(key=lambda e: (e.timestamp, e.segment, e.offset))
    if newest_first:
        hits.reverse()
    return [(e.segment, e.offset) for e in hits[:limit]]


QUERIES = [
    ("user-3", None, None, 100, True),
    ("user-3", None, None, 5, False),
    ("user-17", BASE_TS + 3000, BASE_TS + 9000, 1000, True),
    (None, BASE_TS + 10_000, BASE_TS + 10_500, 1000, False),
    (None, None, None, 7, True),
    ("nobody", None, None, 100, True),
]


def check_finds(client: slipstream.Client, stream: str) -> None:
    events = read_all(client, stream)
    for key, start, end, limit, newest_first in QUERIES:
        found = client.find(
            stream, key=key, start=start, end=end, limit=limit, newest_first=newest_first
        )
        want = scan(events, key, start, end, limit, newest_first)
        assert [(e.segment, e.offset) for e in found] == want, (key, start, end, limit)
    by_position = {(e.segment, e.offset): e for e in events}
    for e in client.find(stream, key="user-3", limit=20):
        assert e == by_position[e.segment, e.offset], "the very event a read gives"


@pytest.fixture
def small_files(broker_factory: type[BrokerProcess]) -> BrokerProcess:
    return broker_factory("--roll", "64KiB").start()


def test_find_by_key_and_by_time_matches_a_full_read(small_files: BrokerProcess) -> None:
    with small_files.client() as client:
        client.create_stream("demo/orders", segments=2)
        produce(client, "demo/orders", 0, PER_ROUND)
        check_finds(client, "demo/orders")
        last = client.find("demo/orders", key="user-3", limit=3)
        assert [e.value.split(b"-")[0] for e in last] == [b"1179", b"1149", b"1119"]  # i % 30 == 9


def test_the_asyncio_client_finds_the_same(small_files: BrokerProcess) -> None:
    with small_files.client() as client:
        client.create_stream("demo/orders", segments=1)
        produce(client, "demo/orders", 0, 300)
        want = client.find("demo/orders", key=b"user-5", start="2026-09-21T00:00Z", limit=50)

    async def body() -> list[Event]:
        async with slipstream.connect_async(small_files.address) as client:
            return await client.find(
                "demo/orders", key="user-5", start="2026-09-21T00:00Z", limit=50
            )

    assert asyncio.run(body()) == want and len(want) == 10


def test_finds_after_a_kill_and_restart(small_files: BrokerProcess) -> None:
    with small_files.client() as client:
        client.create_stream("demo/orders", segments=2)
        produce(client, "demo/orders", 0, PER_ROUND)
        before = client.find("demo/orders", key="user-9", limit=1000)
    small_files.restart()  # kill -9: chunk indexes come from the catalog, journal ones anew
    with small_files.client() as client:
        assert client.find("demo/orders", key="user-9", limit=1000) == before
        check_finds(client, "demo/orders")
        produce(client, "demo/orders", PER_ROUND, 300)  # after the restart, into the journal
        check_finds(client, "demo/orders")


def find_over_http(broker: BrokerProcess, stream: str, key: str) -> tuple[int, int]:
    """(events found, batches read) of a find by key through the admin API."""
    scope, name = stream.split("/")
    with httpx.Client(base_url=broker.http_url, timeout=30) as http:
        answer = http.get(f"/api/streams/{scope}/{name}/events", params={"key": key, "limit": 500})
        answer.raise_for_status()
        body = answer.json()
    return len(body["events"]), body["batches_read"]


def test_a_find_in_the_journal_reads_only_the_batches_of_its_key_then_and_after_a_kill(
    broker_factory: type[BrokerProcess],
) -> None:
    # Every batch still in the journal (default 64 MiB files): its key hashes are made at
    # append, and by recovery after a kill -9, so the very first find reads 4 batches of 40.
    broker = broker_factory().start()
    with broker.client() as client:
        client.create_stream("demo/keys", segments=1)
        with client.producer("demo/keys") as producer:
            for b in range(40):
                for i in range(5):
                    producer.send(b"%d-%d" % (b, i), key=f"user-{b % 10}")
                producer.flush()  # one batch, one key
    assert find_over_http(broker, "demo/keys", "user-3") == (20, 4)
    assert find_over_http(broker, "demo/keys", "nobody") == (0, 0)
    broker.restart()  # kill -9
    assert find_over_http(broker, "demo/keys", "user-3") == (20, 4)
    assert find_over_http(broker, "demo/keys", "nobody") == (0, 0)


def test_a_key_is_found_across_a_split_in_its_append_order(small_files: BrokerProcess) -> None:
    with small_files.client() as client:
        client.create_stream("demo/orders", segments=1)
        produce(client, "demo/orders", 0, 600)
        client.scale_stream("demo/orders", split=0, into=2)
        produce(client, "demo/orders", 600, 600)
        for key in ("user-3", "user-4", "user-21"):
            found = client.find("demo/orders", key=key, limit=1000, newest_first=False)
            numbers = [int(e.value.split(b"-")[0]) for e in found]
            assert numbers == [i for i in range(1200) if KEYS[i * 7 % 30] == key]
            assert {e.segment for e in found if int(e.value.split(b"-")[0]) >= 600} <= {1, 2}
            newest = client.find("demo/orders", key=key, limit=3)
            assert [int(e.value.split(b"-")[0]) for e in newest] == numbers[::-1][:3]
        check_finds(client, "demo/orders")


def test_find_errors_are_typed(client: slipstream.Client) -> None:
    with pytest.raises(slipstream.StreamNotFound):
        client.find("demo/nothing", key="k")
    client.create_stream("demo/gone", segments=1)
    produce(client, "demo/gone", 0, 10)
    client.delete_stream("demo/gone")
    with pytest.raises(slipstream.StreamNotFound):
        client.find("demo/gone", key="user-0")
    client.create_stream("demo/s", segments=1)
    for bad in ({"limit": 0}, {"limit": 10_001}, {"start": 2000, "end": 1000}):
        with pytest.raises(slipstream.InvalidArgument):
            client.find("demo/s", **bad)  # type: ignore[arg-type]
    with pytest.raises(slipstream.InvalidArgument):
        client.find("demo/s", start="yesterday-ish")
    with pytest.raises(slipstream.InvalidArgument):
        client.find("demo/s", end="latest")
    assert client.find("demo/s", key="k") == [], "an empty stream finds nothing"
    produce(client, "demo/s", 0, 5)
    assert len(client.find("demo/s")) == 5, "the broker still serves after the bad requests"


def cli(broker: BrokerProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "slipstream", *args, "--broker", broker.address],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_cli_finds_by_key_and_by_time(small_files: BrokerProcess) -> None:
    with small_files.client() as client:
        client.create_stream("demo/orders", segments=2)
        produce(client, "demo/orders", 0, 600)
    done = cli(small_files, "consume", "demo/orders", "--key", "user-3", "--last", "4")
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [line["value"].split("-")[0] for line in lines] == ["489", "519", "549", "579"]
    assert all(line["key"] == "user-3" and "segment" in line for line in lines)
    start = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(BASE_TS / 1000 + 1))
    end = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(BASE_TS / 1000 + 2))
    window = cli(
        small_files, "consume", "demo/orders", "--from", start + "Z", "--to", end + "Z",
        "--limit", "1000",
    )  # fmt: skip
    assert window.returncode == 0, window.stderr
    values = [json.loads(line)["value"].split("-")[0] for line in window.stdout.splitlines()]
    assert values == [str(i) for i in range(100, 200)], "one second: events 100 to 199"
    clash = cli(small_files, "consume", "demo/orders", "--key", "user-3", "--follow")
    assert clash.returncode != 0 and "--follow" in clash.stderr
    missing = cli(small_files, "consume", "demo/none", "--key", "user-3")
    assert missing.returncode != 0 and "demo/none" in missing.stderr

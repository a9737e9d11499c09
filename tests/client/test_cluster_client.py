"""The cluster-aware client against one real broker (issue 20): address lists, bootstrap past
dead addresses, the DescribeCluster map, an older broker taken for standalone, and readers that
follow again after their broker came back. Several brokers: tests/cluster/test_client_routing.py.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import zlib
from collections.abc import Callable, Iterator

import pytest
from conftest import BrokerProcess, free_port

import slipstream
from slipstream import BrokerUnavailable, InvalidArgument
from slipstream.client._cluster import Cluster, split_addresses
from slipstream.protocol import (
    PROTOCOL_VERSION,
    BrokerInfo,
    ClusterInfo,
    DescribeCluster,
    Error,
    Frame,
    FrameDecoder,
    Hello,
    Message,
    Welcome,
    encode_frame,
)


def test_address_lists_are_split_checked_and_deduplicated() -> None:
    assert split_addresses("h1:7070") == ["h1:7070"]
    assert split_addresses(" h1:7070, h2:7071 ,h1:7070,") == ["h1:7070", "h2:7071"]
    with pytest.raises(InvalidArgument, match="'h2'"):
        split_addresses("h1:7070,h2")
    with pytest.raises(InvalidArgument, match="h1:7070,h2:7070"):
        split_addresses(" , ")


def _cluster_state() -> Cluster:
    return Cluster(["h1:7070"], timeout=1, reconnect_timeout=1, tls=None, token=None)


def test_the_map_routes_each_container_to_its_owners_advertised_address() -> None:
    state = _cluster_state()
    brokers = [
        BrokerInfo("b0", "h1:7070", "h1:8080", [0, 2], 1),
        BrokerInfo("b1", "h2:7070", "h2:8080", [1], 1),
    ]
    state.apply(ClusterInfo(4, brokers, ["b0", "b1", "b0", ""]), "h1:7070")
    assert not state.standalone
    assert state.owners == ["h1:7070", "h2:7070", "h1:7070", None]  # 3 is moving
    state.learn({"container": 3, "owner": "b1", "address": "h2:7070"})
    assert state.owners[3] == "h2:7070"
    state.learn({"container": 0, "owner": None, "address": None})
    assert state.owners[0] is None
    assert state.coordinator("s/orders/workers") == zlib.crc32(b"s/orders/workers") % 4


def test_a_single_broker_is_reached_where_it_was_dialled() -> None:
    """A standalone broker may advertise the address it binds (0.0.0.0:7070)."""
    state = _cluster_state()
    info = ClusterInfo(2, [BrokerInfo("b0", "0.0.0.0:7070", "", [0, 1], 1)], ["b0", "b0"])
    state.apply(info, "h1:7070")
    assert state.standalone
    assert state.owners == ["h1:7070", "h1:7070"]


def _dead_address() -> str:
    return f"127.0.0.1:{free_port()}"  # nothing listens there


def test_bootstrap_skips_a_dead_address_and_maps_every_container_to_the_broker(
    broker: BrokerProcess,
) -> None:
    with slipstream.connect(f"{_dead_address()},{broker.address}", timeout=2) as client:
        cluster = client._async.cluster
        assert cluster.primary == broker.address
        assert cluster.containers >= 1
        assert cluster.owners == [broker.address] * cluster.containers
        client.create_stream("c/orders", 3)
        with client.producer("c/orders") as producer:
            receipts = [producer.send(b"v%d" % i, key=f"k{i}") for i in range(30)]
        assert len({r.result().segment for r in receipts}) == 3
        values = [e.value for e in client.reader("c/orders", end=client.tail("c/orders"))]
        assert sorted(values) == sorted(b"v%d" % i for i in range(30))


def test_a_standalone_broker_describes_itself_as_the_owner_of_every_container(
    broker: BrokerProcess,
) -> None:
    with broker.client() as client:
        info = client.describe_cluster()
    assert [b.broker_id for b in info.brokers] == [info.owners[0]]
    assert info.owners == [info.owners[0]] * info.containers
    assert info.brokers[0].containers == list(range(info.containers))


def test_every_address_dead_names_them_all() -> None:
    first, second = _dead_address(), _dead_address()
    with pytest.raises(BrokerUnavailable) as raised:
        slipstream.connect(f"{first},{second}", timeout=1, reconnect_timeout=0.1)
    assert first in raised.value.message and second in raised.value.message


def test_the_environment_variable_takes_a_list(
    broker: BrokerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLIPSTREAM_BROKER", f"{_dead_address()},{broker.address}")
    with slipstream.connect(timeout=2) as client:
        client.create_stream("c/env")
        assert [s.name for s in client.list_streams("c")] == ["c/env"]


def test_the_cli_broker_option_takes_a_list(broker: BrokerProcess) -> None:
    done = subprocess.run(
        [
            *(sys.executable, "-m", "slipstream", "stream", "create", "c/cli"),
            *("--segments", "2", "--broker", f"{_dead_address()},{broker.address}"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    with broker.client() as client:
        assert len(client.describe_stream("c/cli").segments) == 2


@contextlib.contextmanager
def fake_broker(
    answer: Callable[[str, Message], Welcome | ClusterInfo | Error],
) -> Iterator[tuple[str, list[str]]]:
    """A broker as far as its socket goes, on a free port: every frame is answered with
    ``answer(its address, the message)``; yields the address and the names of the requests
    it got (besides Hello)."""
    listener = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    asked: list[str] = []

    def serve(peer: socket.socket) -> None:
        decoder = FrameDecoder()
        with peer:
            while data := peer.recv(65536):
                decoder.feed(data)
                while (item := decoder.next_item()) is not None:
                    assert isinstance(item, Frame)
                    if not isinstance(item.message, Hello):
                        asked.append(type(item.message).__name__)
                    reply = answer(address, item.message)
                    peer.sendall(encode_frame(reply, item.correlation_id))

    def accept() -> None:
        while True:
            try:
                peer, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(peer,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield address, asked
    finally:
        listener.close()
        thread.join(5)


@pytest.fixture
def old_broker() -> Iterator[str]:
    """A broker of before clusters, as far as the handshake goes: it welcomes the client and
    answers every request, DescribeCluster included, with the protocol error an unknown
    kind gets."""

    def answer(address: str, message: Message) -> Welcome | Error:
        if isinstance(message, Hello):
            return Welcome(PROTOCOL_VERSION, "0.1-old", 8 << 20)
        return Error("protocol", "unknown message kind 45")

    with fake_broker(answer) as (address, asked):
        yield address
    assert asked[:1] == ["DescribeCluster"]


@pytest.fixture
def taking_broker() -> Iterator[tuple[str, list[str]]]:
    """A cluster's only broker while it takes its containers: it describes the cluster with
    itself owning every container and answers every other request ``wrong_broker`` naming
    itself (it holds the lease but does not serve yet). Yields its address and the requests
    it was asked."""

    def answer(address: str, message: Message) -> Welcome | ClusterInfo | Error:
        if isinstance(message, Hello):
            return Welcome(PROTOCOL_VERSION, "0.1-taking", 8 << 20)
        if isinstance(message, DescribeCluster):
            return ClusterInfo(2, [BrokerInfo("b0", address, "", [0, 1], 1)], ["b0", "b0"])
        details = {"container": 1, "owner": "b0", "address": address}
        return Error("wrong_broker", "not served yet", details)

    with fake_broker(answer) as (address, asked):
        yield address, asked


def test_a_broker_naming_itself_is_asked_again_after_a_backoff_not_at_once(
    taking_broker: tuple[str, list[str]],
) -> None:
    """A WrongBroker naming the broker that answered (taking the container, not serving it
    yet) is retried with a growing delay until ``reconnect_timeout``, not in a tight loop
    (which asked a broker thousands of times a second for as long as a takeover lasted)."""
    address, asked = taking_broker
    with (
        slipstream.connect(address, timeout=2, reconnect_timeout=2.0) as client,
        pytest.raises(slipstream.WrongBroker),
    ):
        client.create_subscription("t/s", "sub")
    refused = [name for name in asked if name != "DescribeCluster"]
    assert 2 <= len(refused) <= 15, f"asked {len(refused)} times in 2 s"


def test_a_broker_without_describe_cluster_is_taken_for_standalone(old_broker: str) -> None:
    with slipstream.connect(old_broker, timeout=2) as client:
        cluster = client._async.cluster
        assert cluster.standalone
        assert cluster.owners == [old_broker]


def test_a_reader_follows_again_after_its_broker_restarts(broker: BrokerProcess) -> None:
    """kill -9 mid-stream and a restart on the same port: the reader opens its follows again
    from the next offset it has not received; every acknowledged event arrives once, in
    order per key."""
    with slipstream.connect(broker.address, reconnect_timeout=30) as client:
        client.create_stream("c/moving", 2)
        with client.producer("c/moving") as producer:
            for i in range(200):
                producer.send(b"%d" % i, key=f"k{i % 4}")
        reader = client.reader("c/moving")
        seen: list[tuple[bytes | None, int]] = []
        for event in reader:
            seen.append((event.key, int(event.value)))
            if len(seen) == 100:
                broker.kill()
                broker.start()
                with client.producer("c/moving") as producer:
                    for i in range(200, 400):
                        producer.send(b"%d" % i, key=f"k{i % 4}")
            if len(seen) == 400:
                break
        reader.close()
    assert sorted(v for _, v in seen) == list(range(400))
    for key in {k for k, _ in seen}:
        values = [v for k, v in seen if k == key]
        assert values == sorted(values)


def test_a_reader_fails_once_no_broker_comes_back_in_reconnect_timeout(
    broker: BrokerProcess,
) -> None:
    with slipstream.connect(broker.address, reconnect_timeout=0.5) as client:
        client.create_stream("c/gone")
        client.producer("c/gone").close()
        reader = client.reader("c/gone")
        with client.producer("c/gone") as producer:
            producer.send(b"one")
        events = iter(reader)
        assert next(events).value == b"one"
        broker.kill()
        with pytest.raises(BrokerUnavailable):
            next(events)

"""The broker's Prometheus metrics (slipstream/broker/_metrics.py, docs/metrics.md).

A broker serves real clients over loopback from a thread of this process, so that a test can
scrape its registry where the admin HTTP server does: on the broker's own event loop
(``prometheus_client.generate_latest``, the same text ``/metrics`` serves). What is checked,
after producing, consuming, committing and aborting through the public client: counters are
exact (events and bytes per stream, transactions by outcome, rejected requests by error code,
scales by kind), the latency histograms have observations, the gauges computed at scrape
(connections, open transactions and segments, journal and chunk bytes, subscription lag)
follow the broker's state, a deleted stream's series go, a scrape off the loop thread is
refused, and every metric the Grafana dashboard (docs/grafana-dashboard.json) queries exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import os
import re
import threading
import time
import urllib.request
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from conftest import BrokerProcess
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import slipstream
from slipstream import QueueConsumer, QueueEvent, ScalingPolicy, SegmentSealed, StreamNotFound
from slipstream.broker import Broker, BrokerConfig, ContainerConfig

DASHBOARD = Path(__file__).parents[2] / "docs" / "grafana-dashboard.json"
T = TypeVar("T")


class Scrape:
    """One scrape, parsed: ``value(name, **labels)`` of a sample, 0.0 if absent."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {
            (s.name, frozenset(s.labels.items())): s.value
            for family in self.families.values()
            for s in family.samples
        }

    def value(self, name: str, **labels: str) -> float:
        return self.samples.get((name, frozenset(labels.items())), 0.0)

    def total(self, name: str) -> float:
        """The sum of a sample name's values over all label sets."""
        return sum(v for (n, _), v in self.samples.items() if n == name)

    def names(self) -> set[str]:
        """Every family name and sample name (``_bucket``, ``_count``, ``_total`` ...)."""
        return set(self.families) | {n for n, _ in self.samples}


class ServedBroker:
    """A ``Broker`` serving on loopback from its own thread and event loop."""

    def __init__(self, data_dir: Path, **container: int) -> None:
        self.config = BrokerConfig(
            data_dir=data_dir,
            port=0,
            http_port=0,
            containers=2,
            container=ContainerConfig(**container),
        )
        self.ready = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.broker: Broker | None = None
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="broker", daemon=True)

    def _run(self) -> None:
        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            self.broker = Broker(self.config)
            await self.broker.serve(lambda _: self.ready.set())

        try:
            asyncio.run(main())
        except BaseException as exc:
            self.failure = exc
            self.ready.set()

    def start(self) -> ServedBroker:
        self.thread.start()
        assert self.ready.wait(30), "the broker did not start"
        if self.failure is not None:
            raise self.failure
        return self

    @property
    def http_url(self) -> str:
        assert self.broker is not None and self.broker.http_address is not None
        host, port = self.broker.http_address
        return f"http://{host}:{port}"

    @property
    def address(self) -> str:
        assert self.broker is not None and self.broker.address is not None
        host, port = self.broker.address
        return f"{host}:{port}"

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the broker's loop; its result."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def scrape(self) -> Scrape:
        """The broker's registry in the exposition format, baked on the broker's loop."""
        assert self.broker is not None
        registry = self.broker.metrics.registry

        async def bake() -> bytes:
            return generate_latest(registry)

        return Scrape(self.run(bake()).decode())

    def stop(self) -> None:
        if self.loop is not None and self.broker is not None and self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.broker.stop)
        self.thread.join(30)
        if self.failure is not None:
            raise self.failure


@pytest.fixture
def served(tmp_path: Path) -> Iterator[ServedBroker]:
    broker = ServedBroker(tmp_path / "data").start()
    yield broker
    broker.stop()


@pytest.fixture
def client(served: ServedBroker) -> Iterator[slipstream.Client]:
    with slipstream.connect(served.address) as c:
        yield c


def wait_for(check: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def produce(
    client: slipstream.Client, stream: str, count: int, timestamp: int | None = None
) -> None:
    with client.producer(stream, linger_ms=1) as producer:
        for i in range(count):
            producer.send(b"event %d" % i, key=f"k{i % 7}", timestamp=timestamp)


def stored_bytes(client: slipstream.Client, stream: str) -> int:
    return sum(s.bytes for s in client.describe_stream(stream).segments)


# --- produce and consume --------------------------------------------------------------------


def test_produced_and_consumed_events_and_bytes_per_stream(
    served: ServedBroker, client: slipstream.Client
) -> None:
    client.create_stream("m/orders", 2)
    client.create_stream("m/other", 1)
    produce(client, "m/orders", 300)
    produce(client, "m/other", 7)
    orders_bytes = stored_bytes(client, "m/orders")
    scrape = served.scrape()
    assert scrape.value("slipstream_produced_events_total", stream="m/orders") == 300
    assert scrape.value("slipstream_produced_events_total", stream="m/other") == 7
    assert scrape.value("slipstream_produced_bytes_total", stream="m/orders") == orders_bytes
    assert scrape.value("slipstream_stream_retained_bytes", stream="m/orders") == orders_bytes
    assert scrape.value("slipstream_consumed_events_total", stream="m/orders", read="consume") == 0
    # every acknowledged append was timed, and the group commits synced (fsync=always)
    assert scrape.value("slipstream_append_seconds_count") >= 1
    assert scrape.value("slipstream_append_seconds_bucket", le="+Inf") == scrape.value(
        "slipstream_append_seconds_count"
    )
    assert scrape.total("slipstream_fsync_seconds_count") >= 1
    assert (
        sum(scrape.value("slipstream_journal_bytes", container=str(c)) for c in range(2))
        >= orders_bytes
    )

    events = list(client.reader("m/orders", "earliest", client.tail("m/orders")))
    assert len(events) == 300
    scrape = served.scrape()
    assert (
        scrape.value("slipstream_consumed_events_total", stream="m/orders", read="consume") == 300
    )
    assert (
        scrape.value("slipstream_consumed_bytes_total", stream="m/orders", read="consume")
        == orders_bytes
    )
    assert scrape.value("slipstream_consumed_events_total", stream="m/other", read="consume") == 0


def test_queue_deliveries_count_as_consumed(
    served: ServedBroker, client: slipstream.Client
) -> None:
    client.create_stream("m/jobs", 2)
    client.create_subscription("m/jobs", "workers", mode="queue")
    produce(client, "m/jobs", 25)
    with client.consumer("m/jobs", "workers") as consumer:
        assert isinstance(consumer, QueueConsumer)
        taken: list[QueueEvent] = []
        deadline = time.monotonic() + 20
        while len(taken) < 25 and time.monotonic() < deadline:
            for event in consumer.poll(0.2):
                event.ack()
                taken.append(event)
        assert len(taken) == 25
        wait_for(
            lambda: (
                served.scrape().value(
                    "slipstream_subscription_lag_events", stream="m/jobs", subscription="workers"
                )
                == 0
            )
        )
    scrape = served.scrape()
    assert scrape.value("slipstream_consumed_events_total", stream="m/jobs", read="consume") == 25
    assert scrape.value(
        "slipstream_consumed_bytes_total", stream="m/jobs", read="consume"
    ) >= stored_bytes(client, "m/jobs")


def test_open_segments_and_scaling_decisions(
    served: ServedBroker, client: slipstream.Client
) -> None:
    client.create_stream("m/scaled", 1)
    assert served.scrape().value("slipstream_stream_open_segments", stream="m/scaled") == 1
    client.scale_stream("m/scaled", split=0, into=3)
    scrape = served.scrape()
    assert scrape.value("slipstream_stream_open_segments", stream="m/scaled") == 3
    split = {"kind": "split", "trigger": "manual"}
    assert scrape.value("slipstream_scaling_decisions_total", **split) == 1
    client.scale_stream("m/scaled", merge=[1, 2])
    scrape = served.scrape()
    assert scrape.value("slipstream_stream_open_segments", stream="m/scaled") == 2
    merge = {"kind": "merge", "trigger": "manual"}
    assert scrape.value("slipstream_scaling_decisions_total", **merge) == 1
    assert scrape.value("slipstream_scaling_decisions_total", **split) == 1


def test_a_deleted_streams_series_go_with_it(
    served: ServedBroker, client: slipstream.Client
) -> None:
    client.create_stream("m/gone", 1)
    produce(client, "m/gone", 5)
    list(client.reader("m/gone", "earliest", client.tail("m/gone")))
    assert (
        served.scrape().value("slipstream_consumed_events_total", stream="m/gone", read="consume")
        == 5
    )
    client.delete_stream("m/gone")
    assert 'stream="m/gone"' not in served.scrape().text


# --- transactions, rejections, connections --------------------------------------------------


def test_transactions_open_committed_and_aborted(
    served: ServedBroker, client: slipstream.Client
) -> None:
    client.create_stream("m/txn", 2)
    committed = client.transaction("metrics-writer")
    for i in range(5):
        committed.send("m/txn", b"c%d" % i, key=f"k{i}")
    committed.flush()
    scrape = served.scrape()
    assert scrape.value("slipstream_transactions_open") == 1
    assert scrape.value("slipstream_produced_events_total", stream="m/txn") == 0  # staged only
    committed.commit()
    with pytest.raises(RuntimeError), client.transaction("metrics-writer") as aborted:
        for i in range(3):
            aborted.send("m/txn", b"a%d" % i, key=f"k{i}")
        raise RuntimeError("the application failed: abort")
    scrape = served.scrape()
    assert scrape.value("slipstream_transactions_open") == 0
    assert scrape.value("slipstream_transactions_ended_total", outcome="committed") == 1
    assert scrape.value("slipstream_transactions_ended_total", outcome="aborted") == 1
    # the commit's events count once, when applied; the aborted ones never
    assert scrape.value("slipstream_produced_events_total", stream="m/txn") == 5


def test_rejected_requests_by_error_code(served: ServedBroker, client: slipstream.Client) -> None:
    for _ in range(2):
        with pytest.raises(StreamNotFound):
            client.describe_stream("m/missing")
    scrape = served.scrape()
    assert scrape.value("slipstream_rejected_requests_total", code="stream_not_found") == 2
    assert scrape.total("slipstream_rejected_requests_total") == 2


def test_open_connections(served: ServedBroker) -> None:
    assert served.scrape().value("slipstream_connections") == 0
    with slipstream.connect(served.address) as one:
        one.list_streams()
        with slipstream.connect(served.address) as two:
            two.list_streams()
            assert served.scrape().value("slipstream_connections") == 2
    wait_for(lambda: served.scrape().value("slipstream_connections") == 0)


# --- subscription lag ------------------------------------------------------------------------


def test_subscription_lag_in_events_and_seconds_drops_to_zero_after_consumption(
    served: ServedBroker, client: slipstream.Client
) -> None:
    client.create_stream("m/lag", 2)
    client.create_subscription("m/lag", "billing")
    client.create_subscription("m/lag", "audit")
    hour_ago = int(time.time() * 1000) - 3_600_000
    produce(client, "m/lag", 40, timestamp=hour_ago)
    scrape = served.scrape()
    for name in ("billing", "audit"):
        labels = {"stream": "m/lag", "subscription": name}
        assert scrape.value("slipstream_subscription_lag_events", **labels) == 40
        assert scrape.value("slipstream_subscription_lag_seconds", **labels) >= 3_600

    with client.consumer("m/lag", "billing", commit="manual") as consumer:
        events: list[slipstream.Event] = []
        deadline = time.monotonic() + 20
        while len(events) < 40 and time.monotonic() < deadline:
            events.extend(consumer.poll(0.2))
        assert len(events) == 40
        consumer.commit()
    scrape = served.scrape()
    billing = {"stream": "m/lag", "subscription": "billing"}
    assert scrape.value("slipstream_subscription_lag_events", **billing) == 0
    assert scrape.value("slipstream_subscription_lag_seconds", **billing) == 0
    audit = {"stream": "m/lag", "subscription": "audit"}
    assert scrape.value("slipstream_subscription_lag_events", **audit) == 40


# --- storage ---------------------------------------------------------------------------------


def test_journal_and_chunk_bytes_per_container(tmp_path: Path) -> None:
    """With small journal files, data moves to chunks: the chunk gauge then holds what left the
    journal, and journal plus chunks account for every stored byte."""
    served = ServedBroker(tmp_path / "data", roll_bytes=64 * 1024).start()
    try:
        with slipstream.connect(served.address) as client:
            client.create_stream("m/disk", 2)
            with client.producer("m/disk", linger_ms=1) as producer:
                for i in range(2_000):
                    producer.send(os.urandom(200), key=f"k{i % 13}")  # incompressible
            stored = stored_bytes(client, "m/disk")

            def chunked() -> float:
                return sum(
                    served.scrape().value("slipstream_chunk_bytes", container=str(c))
                    for c in range(2)
                )

            wait_for(lambda: chunked() > 0)
            # the gauge is per container, every stream's: the audit stream's records too
            every_stream = client.list_streams() + client.list_streams(scope="_system")
            assert chunked() <= sum(stored_bytes(client, info.name) for info in every_stream)
            scrape = served.scrape()
            assert scrape.value("slipstream_stream_retained_bytes", stream="m/disk") == stored
    finally:
        served.stop()


# --- scraping -------------------------------------------------------------------------------


def test_a_scrape_off_the_brokers_loop_thread_is_refused(served: ServedBroker) -> None:
    assert served.broker is not None
    with pytest.raises(RuntimeError, match="event loop thread"):
        generate_latest(served.broker.metrics.registry)


def test_the_asgi_app_answers_in_both_formats_and_gzipped(
    served: ServedBroker, client: slipstream.Client
) -> None:
    """``Metrics.asgi_app`` (what /metrics mounts): the same numbers as the registry, in the
    Prometheus text format or OpenMetrics as asked, gzipped when accepted."""
    client.create_stream("m/asgi", 1)
    produce(client, "m/asgi", 4)
    assert served.broker is not None
    app = served.broker.metrics.asgi_app()

    async def get(accept: str, encoding: str) -> tuple[dict[str, bytes], bytes]:
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        headers = [(b"accept", accept.encode()), (b"accept-encoding", encoding.encode())]
        scope = {"type": "http", "method": "GET", "path": "/metrics", "headers": headers}
        await app(scope, receive, send)
        start, body = sent
        assert start["status"] == 200
        return dict(start["headers"]), body["body"]

    headers, body = served.run(get("", ""))
    assert headers[b"content-type"].startswith(b"text/plain; version=0.0.4")
    plain = Scrape(body.decode())
    assert plain.value("slipstream_produced_events_total", stream="m/asgi") == 4
    assert plain.value("slipstream_connections") >= 1  # computed on the loop, then formatted

    headers, body = served.run(get("", "gzip"))
    assert headers[b"content-encoding"] == b"gzip"
    unzipped = Scrape(gzip.decompress(body).decode())
    assert unzipped.value("slipstream_produced_events_total", stream="m/asgi") == 4

    headers, body = served.run(get("application/openmetrics-text; version=1.0.0", ""))
    assert headers[b"content-type"].startswith(b"application/openmetrics-text")
    assert body.endswith(b"# EOF\n")
    assert b'slipstream_produced_events_total{stream="m/asgi"} 4.0' in body


def test_metrics_over_http_from_a_broker_process(broker: BrokerProcess) -> None:
    """``/metrics`` of a broker started as a user starts it (``slipstream up``), over HTTP."""
    with broker.client() as client:
        client.create_stream("m/http", 2)
        produce(client, "m/http", 50)
        assert len(list(client.reader("m/http", "earliest", client.tail("m/http")))) == 50
        with pytest.raises(StreamNotFound):
            client.describe_stream("m/none")
        stored = stored_bytes(client, "m/http")
        request = urllib.request.Request(
            broker.http_url + "/metrics", headers={"Accept-Encoding": "gzip"}
        )
        with urllib.request.urlopen(request, timeout=30) as reply:
            assert reply.status == 200
            assert reply.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            assert reply.headers["Content-Encoding"] == "gzip"
            scrape = Scrape(gzip.decompress(reply.read()).decode())
    assert scrape.value("slipstream_produced_events_total", stream="m/http") == 50
    assert scrape.value("slipstream_produced_bytes_total", stream="m/http") == stored
    assert scrape.value("slipstream_consumed_events_total", stream="m/http", read="consume") == 50
    assert (
        scrape.value("slipstream_consumed_bytes_total", stream="m/http", read="consume") == stored
    )
    assert scrape.value("slipstream_rejected_requests_total", code="stream_not_found") == 1
    assert scrape.value("slipstream_stream_open_segments", stream="m/http") == 2
    assert scrape.value("slipstream_connections") >= 1
    assert scrape.value("slipstream_append_seconds_count") >= 1
    assert scrape.total("slipstream_fsync_seconds_count") >= 1
    assert scrape.value("process_resident_memory_bytes") > 0


def http_scrape(broker: BrokerProcess) -> Scrape:
    with urllib.request.urlopen(broker.http_url + "/metrics", timeout=30) as reply:
        return Scrape(reply.read().decode())


def test_a_split_by_the_streams_policy_counts_as_a_policy_decision(
    broker_factory: type[BrokerProcess],
) -> None:
    broker = broker_factory()
    broker.env["SLIPSTREAM_SCALING_SPEEDUP"] = "20"  # the 10 s rule's window in 0.5 s
    broker.start()
    policy = ScalingPolicy.by_event_rate(50, scale_factor=2, min_segments=1, max_segments=2)
    with broker.client() as client:
        client.create_stream("m/auto", scaling=policy)
        deadline = time.monotonic() + 60
        while not client.scale_history("m/auto"):
            assert time.monotonic() < deadline, "no split"
            with contextlib.suppress(SegmentSealed), client.producer("m/auto") as producer:
                for i in range(30):
                    producer.send(b"%d" % i, key=f"k{i}")
            time.sleep(0.05)
        history = client.scale_history("m/auto")
    scrape = http_scrape(broker)
    split = {"kind": "split", "trigger": "policy"}
    assert len(history) == 1  # max_segments=2: one split, and no merge within the cool-down
    assert scrape.value("slipstream_scaling_decisions_total", **split) == 1
    assert scrape.total("slipstream_scaling_decisions_total") == 1
    assert scrape.value("slipstream_stream_open_segments", stream="m/auto") == 2


def test_every_metric_the_grafana_dashboard_queries_exists(
    served: ServedBroker, client: slipstream.Client
) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [
        target["expr"]
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
        if "expr" in target
    ]
    assert len(exprs) >= 8
    # a scrape in which every series has samples
    client.create_stream("m/dash", 1)
    client.create_subscription("m/dash", "app")
    produce(client, "m/dash", 3)
    list(client.reader("m/dash", "earliest", client.tail("m/dash")))
    with pytest.raises(StreamNotFound):
        client.describe_stream("m/nothing")
    http_get(served.http_url + "/api/streams/m/dash/events?limit=2")
    client.scale_stream("m/dash", split=0)
    with client.transaction("dash") as txn:
        txn.send("m/dash", b"x")
    names = served.scrape().names()
    queried = {
        name for expr in exprs for name in re.findall(r"\b((?:slipstream|process)_\w+)", expr)
    }
    assert queried, "the dashboard queries no slipstream metric"
    assert sorted(queried - names) == []


# --- reads through the HTTP API and the console, HTTP requests -------------------------------


def http_get(url: str) -> tuple[int, bytes]:
    """GET ``url``: (status, body), error statuses included."""
    try:
        with urllib.request.urlopen(url, timeout=30) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read()


def test_browse_and_find_through_http_count_as_consumed_lookups(
    served: ServedBroker, client: slipstream.Client
) -> None:
    """A browse or a find through the admin API, the console or the binary protocol moves
    ``slipstream_consumed_*_total{read="lookup"}`` by the events it returned (and their keys'
    and values' bytes); applications' ``read="consume"`` series stay where they were."""
    client.create_stream("m/look", 2)
    with client.producer("m/look", linger_ms=1) as producer:
        for i in range(30):  # 2-byte keys, 8-byte values: 10 bytes an event
            producer.send(b"event %02d" % i, key=f"k{i % 3}")
    lookup = {"stream": "m/look", "read": "lookup"}
    consume = {"stream": "m/look", "read": "consume"}
    assert served.scrape().value("slipstream_consumed_events_total", **lookup) == 0

    status, body = http_get(served.http_url + "/api/streams/m/look/events?limit=7")
    assert status == 200 and len(json.loads(body)["events"]) == 7
    scrape = served.scrape()
    assert scrape.value("slipstream_consumed_events_total", **lookup) == 7
    assert scrape.value("slipstream_consumed_bytes_total", **lookup) == 70

    status, body = http_get(served.http_url + "/api/streams/m/look/events?key=k1&limit=100")
    assert status == 200 and len(json.loads(body)["events"]) == 10
    status, _ = http_get(served.http_url + "/events?stream=m/look&limit=4")  # the console
    assert status == 200
    assert len(client.find("m/look", key="k2", limit=3)) == 3  # FindEvents
    scrape = served.scrape()
    assert scrape.value("slipstream_consumed_events_total", **lookup) == 7 + 10 + 4 + 3
    assert scrape.value("slipstream_consumed_bytes_total", **lookup) == 240
    assert scrape.value("slipstream_consumed_events_total", **consume) == 0

    list(client.reader("m/look", "earliest", client.tail("m/look")))
    scrape = served.scrape()
    assert scrape.value("slipstream_consumed_events_total", **consume) == 30
    assert scrape.value("slipstream_consumed_events_total", **lookup) == 24
    client.delete_stream("m/look")
    assert 'stream="m/look"' not in served.scrape().text


def test_http_requests_by_route_and_status_and_rejections_by_code(served: ServedBroker) -> None:
    """Each HTTP request counts once under its route template (not its path), method and
    status, with a latency observation; error answers count into the rejected counter by
    code, as the binary protocol's do."""
    url = served.http_url
    assert http_get(url + "/api/streams")[0] == 200
    assert http_get(url + "/api/streams")[0] == 200
    assert http_get(url + "/api/streams/m/none")[0] == 404
    assert http_get(url + "/api/streams/m/other")[0] == 404
    assert http_get(url + "/no/such/page")[0] == 404
    assert http_get(url + "/stream?name=m/none")[0] == 404  # the console's error page
    scrape = served.scrape()
    requests = "slipstream_http_requests_total"
    assert scrape.value(requests, route="/api/streams", method="GET", status="200") == 2
    stream = "/api/streams/{scope}/{name}"
    assert scrape.value(requests, route=stream, method="GET", status="404") == 2
    assert scrape.value(requests, route="unmatched", method="GET", status="404") == 1
    assert scrape.value(requests, route="/stream", method="GET", status="404") == 1
    assert 'route="/api/streams/m/none"' not in scrape.text
    seconds = "slipstream_http_request_seconds_count"
    assert scrape.value(seconds, route="/api/streams", method="GET") == 2
    assert scrape.value(seconds, route=stream, method="GET") == 2
    rejected = "slipstream_rejected_requests_total"
    assert scrape.value(rejected, code="stream_not_found") == 3
    assert scrape.value(rejected, code="not_found") == 1

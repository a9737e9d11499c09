"""The console in a real browser (Debian's Chromium through Playwright) against a real
broker process: streams with rates that move, a stream's segments over time after a split,
the message browser (JSON, headers, positions, paging back, a StreamCut to copy, find by
key), a subscription's lag and reset, a transaction aborted as an operator, error pages.

Fixtures: a real broker process serving the console over HTTP, and Debian's Chromium driven
by Playwright (nothing downloaded; scripts/ensure-chromium.sh installs it). A missing
/usr/bin/chromium fails these tests (it does not skip them): test.sh installs it, so CI runs
them. Screenshots of the main pages go to docs/console/ with SLIPSTREAM_SCREENSHOTS=1
(``SLIPSTREAM_SCREENSHOTS=1 .venv/bin/pytest tests/console`` refreshes the ones
docs/console.md shows), else to the test's tmp_path."""

from __future__ import annotations

import json
import os
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from conftest import BrokerProcess
from playwright.sync_api import expect

import slipstream
from slipstream.streams import StreamCut

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
DOCS = Path(__file__).resolve().parents[2] / "docs" / "console"


@pytest.fixture
def console(broker_factory: type[BrokerProcess]) -> Iterator[Any]:
    """A real broker process (``slipstream up --http-port``) whose own HTTP server serves the
    console; ``console.url`` is its address."""
    broker = broker_factory().start()
    deadline = time.monotonic() + 20
    while True:
        try:
            with urllib.request.urlopen(broker.http_url + "/static/console.css", timeout=1):
                break
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no console at {broker.http_url}:\n{broker.log()}") from None
            time.sleep(0.05)
    broker.url = broker.http_url  # type: ignore[attr-defined]
    yield broker


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One Chromium for this module (Playwright's sync API keeps an event loop of its own:
    closed with the module, before other tests run theirs)."""
    from playwright.sync_api import sync_playwright

    if not os.path.exists(CHROMIUM):
        pytest.fail(
            f"{CHROMIUM} is missing: the console's browser tests need Debian's chromium "
            "(run scripts/ensure-chromium.sh; test.sh does)"
        )
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    page = context.new_page()
    page.set_default_timeout(15_000)
    yield page
    context.close()


@pytest.fixture
def screenshot(tmp_path: Path) -> Any:
    """``screenshot(page, "streams")``: docs/console/streams.png with SLIPSTREAM_SCREENSHOTS=1."""
    target = DOCS if os.environ.get("SLIPSTREAM_SCREENSHOTS") == "1" else tmp_path / "shots"

    def take(page: Any, name: str) -> Path:
        target.mkdir(parents=True, exist_ok=True)
        path = target / f"{name}.png"
        page.screenshot(path=str(path), full_page=True)
        return path

    return take


DASH = "\u2013"


@contextmanager
def producing(client: slipstream.Client, stream: str, per_second: int = 200) -> Iterator[None]:
    """Keyed JSON events at about ``per_second`` until the block ends."""
    stop = threading.Event()
    failed: list[BaseException] = []

    def run() -> None:
        try:
            with client.producer(stream) as producer:
                n = 0
                while not stop.is_set():
                    for _ in range(per_second // 20):
                        producer.send(json.dumps({"n": n}).encode(), key=f"k{n % 5}")
                        n += 1
                    time.sleep(0.05)
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(30)
    assert not failed, failed


@contextmanager
def consuming(client: slipstream.Client, stream: str, subscription: str) -> Iterator[None]:
    stop = threading.Event()

    def run() -> None:
        with client.consumer(stream, subscription) as consumer:
            for _ in consumer:
                if stop.is_set():
                    break

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)


def rate_of(text: str) -> float:
    """'1,234/s' or '2.5/s' -> the number; the dash (no rate yet) -> -1."""
    text = text.strip()
    if text == DASH:
        return -1.0
    return float(text.removesuffix("/s").replace(",", ""))


def test_streams_page_shows_rates_that_move(console: Any, page: Any, screenshot: Any) -> None:
    with console.client() as client, console.client() as reading:
        client.create_stream("demo/orders", segments=2)
        client.create_stream("demo/payments")
        client.create_subscription("demo/orders", "billing")
        page.goto(console.url + "/")
        row = page.locator('tr[data-stream="demo/orders"]')
        expect(row).to_be_visible()
        expect(page.locator('tr[data-stream="demo/payments"]')).to_be_visible()
        with producing(client, "demo/orders"), consuming(reading, "demo/orders", "billing"):
            # htmx refreshes the rows every 2 s; the rates come from successive samples
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                produce = rate_of(row.locator("td.produce").inner_text())
                consume = rate_of(row.locator("td.consume").inner_text())
                if produce > 0 and consume > 0:
                    break
                page.wait_for_timeout(500)
            assert produce > 0, "the produce rate never moved"
            assert consume > 0, "the consume rate never moved"
            idle = page.locator('tr[data-stream="demo/payments"] td.produce').inner_text()
            assert rate_of(idle) <= 0
            screenshot(page, "streams")
        page.goto(console.url + "/?q=payments")
        expect(page.locator('tr[data-stream="demo/payments"]')).to_be_visible()
        expect(page.locator('tr[data-stream="demo/orders"]')).to_have_count(0)


def test_stream_page_draws_segments_over_time(console: Any, page: Any, screenshot: Any) -> None:
    with console.client() as client:
        client.create_stream("demo/clicks", segments=2, retention_time="7d")
        with producing(client, "demo/clicks"):
            time.sleep(1.0)
            client.scale_stream("demo/clicks", split=0, into=2)
            time.sleep(1.0)
            client.create_subscription("demo/clicks", "spark-clicks")
            client.commit_subscription("demo/clicks", "spark-clicks", {1: 5})
            page.goto(console.url + "/stream?name=demo/clicks")
            svg = page.locator("svg.segments")
            expect(svg.locator("g.bar.sealed")).to_have_count(1)
            expect(svg.locator("g.bar.open")).to_have_count(3)
            expect(page.locator("dl.facts")).to_contain_text("7 d")
            expect(page.locator("table.history")).to_contain_text("manual")
            whole = "0x8000000000000000..0xffffffffffffffff"  # segment 1: the upper half
            expect(page.locator('table.segments tr[data-segment="1"]')).to_contain_text(whole)
            # the one subscription without members shows as committed progress (Spark)
            expect(page.locator('tr[data-subscription="spark-clicks"]')).to_be_visible()
            page.wait_for_timeout(4500)  # the rate chart's points arrive every 2 s
            expect(page.locator("#rate-chart canvas")).to_have_count(1)
            screenshot(page, "stream")


def test_message_browser(console: Any, page: Any, screenshot: Any) -> None:
    with console.client() as client:
        client.create_stream("demo/orders", segments=2)
        with client.producer("demo/orders") as producer:
            for n in range(120):
                value = {"order": n, "user": f"user-{n % 7}", "items": [n, n + 1]}
                producer.send(
                    json.dumps(value).encode(),
                    key=f"user-{n % 7}",
                    headers={"source": b"checkout"},
                )
            producer.flush()
            time.sleep(0.01)  # a later timestamp: events of one millisecond sort by position
            producer.send(b"\xff\xfe not json", key="binary")
        page.goto(console.url + "/events?stream=demo/orders&limit=20")
        rows = page.locator("tr.event")
        expect(rows).to_have_count(20)
        # among the newest: the binary one, shown as hex
        binary = page.locator('tr.event[data-key="binary"]')
        expect(binary.locator("td.value.binary")).to_contain_text("ff fe")
        # JSON values pretty-printed, headers and positions shown
        first_value = rows.first.locator("td.value.json pre").inner_text()
        assert '\n  "order": ' in first_value
        expect(rows.first.locator("td.headers")).to_contain_text("source: checkout")
        segment, offset = (int(x) for x in rows.first.get_attribute("data-position").split(":"))
        # the StreamCut of an event starts a reader exactly there, in its segment
        cut = StreamCut.from_json(rows.first.locator("button.copy").get_attribute("data-copy"))
        assert cut.stream == "demo/orders" and cut.positions[segment] == offset
        read = client.reader("demo/orders", cut, end=client.tail("demo/orders"))
        first_read = next(e for e in read if e.segment == segment)
        assert first_read.offset == offset
        assert json.loads(first_read.value) == json.loads(first_value)
        screenshot(page, "events")
        # paging back shows older events, none of those already shown
        shown = set(rows.evaluate_all("rs => rs.map(r => r.dataset.position)"))
        page.locator("a#older").click()
        expect(rows).to_have_count(20)
        older = set(rows.evaluate_all("rs => rs.map(r => r.dataset.position)"))
        assert not older & shown
        # the live tail picks up a new event without a reload
        page.goto(console.url + "/events?stream=demo/orders&limit=5")
        with client.producer("demo/orders") as producer:
            producer.send(b'{"late": true}', key="late-key")
        expect(page.locator('tr.event[data-key="late-key"]')).to_have_count(1, timeout=10_000)
        # find by key (the broker's key index) where this build has it
        page.goto(console.url + "/events?stream=demo/orders")
        find = page.locator("#find-button")
        if find.is_disabled():
            expect(page.locator("form.find-key")).to_contain_text("key index")
            return
        page.locator('input[name="key"]').fill("user-3")
        find.click()
        expect(page.locator("tr.event")).not_to_have_count(0)
        keys = set(page.locator("tr.event").evaluate_all("rs => rs.map(r => r.dataset.key)"))
        assert keys == {"user-3"}
        expect(page.locator("tr.event")).to_have_count(len(range(3, 120, 7)))
        screenshot(page, "find")


def test_subscription_lag_and_reset(console: Any, page: Any, screenshot: Any) -> None:
    with console.client() as client:
        client.create_stream("demo/orders", segments=2)
        with client.producer("demo/orders") as producer:
            for n in range(50):
                producer.send(b'{"n": %d}' % n, key=f"k{n}")
        client.create_subscription("demo/orders", "billing")
        page.goto(console.url + "/subscriptions")
        row = page.locator('tr[data-subscription="billing"]')
        expect(row.locator("td.lag-events")).to_have_text("50")
        assert int(row.locator("td.lag-time").get_attribute("data-lag-ms")) > 0
        screenshot(page, "subscriptions")
        row.locator("a", has_text="billing").click()
        expect(page.locator("#lag")).to_contain_text("50 events")
        page.on("dialog", lambda dialog: dialog.accept())
        page.locator('input[name="at"][value="latest"]').check()
        page.locator("#reset-button").click()
        expect(page.locator("#done")).to_contain_text("reset to latest")
        expect(page.locator("#lag")).to_contain_text("0 events")
        screenshot(page, "subscription")
        info = client.describe_subscription("demo/orders", "billing")
        assert sum(s.backlog_events for s in info.segments) == 0
        assert info.generation >= 1


def test_transaction_aborted_by_an_operator(console: Any, page: Any, screenshot: Any) -> None:
    with console.client() as client:
        client.create_stream("demo/orders")
        txn = client.transaction("enricher-1", label="stuck job")
        txn.send("demo/orders", b'{"n": 1}', key="k1")
        txn.flush()
        page.goto(console.url + "/transactions")
        row = page.locator("tr[data-txn]")
        expect(row).to_have_count(1)
        expect(row).to_contain_text("enricher-1")
        expect(row).to_contain_text("stuck job")
        screenshot(page, "transactions")
        page.on("dialog", lambda dialog: dialog.accept())
        row.locator("button", has_text="Abort").click()
        expect(page.locator("#done")).to_contain_text("aborted")
        expect(page.locator("tr[data-txn]")).to_have_count(0)
        assert client.transactions() == []
        with pytest.raises(slipstream.SlipstreamError):
            txn.commit()


@pytest.mark.parametrize(
    ("path", "status", "text"),
    [
        ("/stream?name=demo/missing", 404, "does not exist"),
        ("/events?stream=demo/missing", 404, "does not exist"),
        ("/subscription?stream=demo/orders&name=nobody", 404, "nobody"),
        ("/stream", 400, "name"),
        ("/events?stream=demo/orders&before=zz", 400, "segment:offset"),
        ("/events?stream=demo/orders&limit=0", 400, "limit"),
        ("/events?stream=demo/orders&at=yesterday-ish", 400, "ISO 8601"),
        ("/?page=x", 400, "whole number"),
    ],
)
def test_errors_render_a_page(console: Any, page: Any, path: str, status: int, text: str) -> None:
    with console.client() as client:
        client.create_stream("demo/orders")
    response = page.goto(console.url + path)
    assert response.status == status
    expect(page.locator("#error-message")).to_contain_text(re.compile(re.escape(text)))


def test_a_form_from_another_site_is_refused(console: Any) -> None:
    """A page of another origin cannot make the operator's browser reset a subscription."""
    with console.client() as client:
        client.create_stream("demo/orders")
        with client.producer("demo/orders") as producer:
            producer.send(b'{"n": 1}', key="k1")
        client.create_subscription("demo/orders", "billing")
    body = b"stream=demo%2Forders&name=billing&at=latest"
    request = urllib.request.Request(
        console.url + "/subscription/reset",
        data=body,
        headers={
            "Origin": "http://evil.example",
            "Content-Type": "application/x-www-form-urlencoded",
        },
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request)
    assert refused.value.code == 400
    assert b"refused" in refused.value.read()
    with console.client() as client:
        info = client.describe_subscription("demo/orders", "billing")
    assert sum(s.backlog_events for s in info.segments) == 1  # not reset


def sink_commit(client: slipstream.Client, query: str, batch: int, events: int) -> None:
    """What the sink commits for one batch (spark/_sink.py): its transactional id and
    metadata."""
    with client.transaction(f"spark:{query}") as txn:
        for n in range(events):
            txn.send("demo/out", json.dumps({"n": n}).encode(), key=f"k{n}")
        txn.metadata = {"query": query, "batch": batch, "events": events}


def test_spark_page_lists_every_sink_query(console: Any, page: Any, screenshot: Any) -> None:
    """Every query that committed through the sink, with its last batch and a rate; the
    subscriptions queries read through with their lag; one query by id."""
    with console.client() as client:
        client.create_stream("demo/out")
        client.create_stream("demo/clicks")
        sink_commit(client, "q-42", 6, 3)
        sink_commit(client, "q-42", 7, 3)
        sink_commit(client, "q-43", 0, 2)
        with client.transaction("app-writer") as txn:  # not a Spark query: not listed
            txn.send("demo/out", b"{}", key="k")
            txn.metadata = {"batch": 99}
        client.transaction("spark:never-committed").abort()
        with client.producer("demo/clicks") as producer:
            for n in range(5):
                producer.send(b"{}", key=f"k{n}")
        client.create_subscription("demo/clicks", "spark-clicks")
        client.commit_subscription("demo/clicks", "spark-clicks", {0: 2})

        page.goto(console.url + "/spark")
        rows = page.locator("#spark-rows tr[data-query]")
        expect(rows).to_have_count(2)
        q42 = page.locator('tr[data-query="q-42"]')
        expect(q42.locator("td.batch")).to_have_text("7")
        expect(q42.locator("td.events")).to_have_text("3")
        expect(page.locator('tr[data-query="q-43"] td.batch')).to_have_text("0")
        expect(q42.locator("td.rate")).to_have_text(DASH)  # one commit seen: no rate yet
        spark_clicks = page.locator('tr[data-subscription="spark-clicks"]')
        expect(spark_clicks.locator("td.lag-events")).to_have_text("3")

        time.sleep(0.05)  # a later commit time than batch 7's
        sink_commit(client, "q-42", 9, 40)  # batch 8 was not seen
        # the rows refresh every 2 s: the rate between the commits of batches 7 and 9
        expect(q42.locator("td.batch")).to_have_text("9", timeout=10_000)
        expect(q42.locator("td.events")).to_have_text("40")
        expect(q42.locator("td.rate")).not_to_have_text(DASH)
        assert rate_of(q42.locator("td.rate").inner_text()) > 0
        screenshot(page, "spark")

    page.goto(console.url + "/spark?query=q-43")
    expect(page.locator("#spark-rows tr[data-query]")).to_have_count(1)
    expect(page.locator('tr[data-query="q-43"] td.batch')).to_have_text("0")
    for missing in ("never-ran", "never-committed", "q-4"):
        response = page.goto(console.url + f"/spark?query={missing}")
        assert response.status == 404
        expect(page.locator("#error-message")).to_contain_text(f"spark:{missing}")

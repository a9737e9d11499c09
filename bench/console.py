"""The console's page load times on a broker with many streams (issue 18: the streams page
under 300 ms with 10,000 streams).

    .venv/bin/python bench/console.py                 # 10,000 streams
    .venv/bin/python bench/console.py --streams 1000  # quicker

Starts a broker that serves the console (``slipstream up --http-port``), creates the streams
with the public client (``--fsync never``: only the catalog's speed matters here), produces a
little into one of them, then times each page: the server's answer in full over loopback
(median and p95 of ``--rounds`` requests, after one warm-up) and, in Chromium (Playwright,
/usr/bin/chromium), navigation to the ``load`` event. Not a test: it prints a table and
PASS/MISS for the target.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import slipstream

TARGET_MS = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_broker(data_dir: Path, port: int, http_port: int) -> subprocess.Popen[bytes]:
    command = [
        sys.executable, "-m", "slipstream", "up", "--data-dir", str(data_dir),
        "--port", str(port), "--http-port", str(http_port), "--fsync", "never",
    ]  # fmt: skip
    log = open(data_dir.parent / "broker.log", "ab")  # noqa: SIM115 - the broker's life
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/static/console.css"):
                return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the broker's console did not answer within 30 s")


def create_streams(address: str, count: int, workers: int = 8) -> float:
    started = time.monotonic()
    names = [f"bench/s{n:05d}" for n in range(count)]

    def create(chunk: list[str]) -> None:
        with slipstream.connect(address) as client:
            for name in chunk:
                client.create_stream(name, exist_ok=True)

    chunks = [names[i::workers] for i in range(workers)]
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        list(pool.map(create, chunks))
    with slipstream.connect(address) as client, client.producer("bench/s00000") as producer:
        for n in range(1000):
            producer.send(b'{"n": %d}' % n, key=f"k{n % 10}")
    return time.monotonic() - started


def time_get(url: str, rounds: int) -> list[float]:
    with urllib.request.urlopen(url) as response:  # warm-up
        response.read()
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        with urllib.request.urlopen(url) as response:
            response.read()
        times.append((time.perf_counter() - started) * 1000)
    return times


def time_browser(urls: list[str], rounds: int) -> dict[str, list[float]]:
    from playwright.sync_api import sync_playwright

    args = [
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
    ]  # fmt: skip
    out: dict[str, list[float]] = {}
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path="/usr/bin/chromium", args=args)
        page = browser.new_page()
        for url in urls:
            page.goto(url, wait_until="load")  # warm-up (and the cache of static files)
            times = []
            for _ in range(rounds):
                started = time.perf_counter()
                page.goto(url, wait_until="load")
                times.append((time.perf_counter() - started) * 1000)
            out[url] = times
        browser.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--no-browser", action="store_true")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-console-") as tmp:
        port, http_port = free_port(), free_port()
        proc = start_broker(Path(tmp) / "data", port, http_port)
        try:
            created_s = create_streams(f"127.0.0.1:{port}", options.streams)
            print(f"{options.streams:,} streams created in {created_s:.1f} s")
            base = f"http://127.0.0.1:{http_port}"
            pages = {
                "streams (/)": base + "/",
                "streams rows (htmx refresh)": base + "/streams/rows",
                "streams, filtered (?q=s0999)": base + "/?q=s0999",
                "stream page": base + "/stream?name=bench/s00000",
                "message browser": base + "/events?stream=bench/s00000",
                "subscriptions (all streams)": base + "/subscriptions",
            }
            print(f"\n{'page':32} {'server median':>14} {'p95':>8}")
            streams_median = 0.0
            for label, url in pages.items():
                times = sorted(time_get(url, options.rounds))
                median = statistics.median(times)
                p95 = times[min(len(times) - 1, int(len(times) * 0.95))]
                if label == "streams (/)":
                    streams_median = median
                print(f"{label:32} {median:11.1f} ms {p95:5.1f} ms")
            if not options.no_browser and os.path.exists("/usr/bin/chromium"):
                print(f"\n{'page, in Chromium to load':32} {'median':>14} {'p95':>8}")
                browser_times = time_browser([pages["streams (/)"], pages["stream page"]], 10)
                for url, times in browser_times.items():
                    times.sort()
                    label = "streams (/)" if url.endswith("/") else "stream page"
                    print(f"{label:32} {statistics.median(times):11.1f} ms {times[-1]:5.1f} ms")
            verdict = "PASS" if streams_median < TARGET_MS else "MISS"
            print(
                f"\nstreams page with {options.streams:,} streams: {streams_median:.1f} ms "
                f"(target < {TARGET_MS:.0f} ms): {verdict}"
            )
        finally:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()

"""slipstream peer: a broker subprocess (`python -m slipstream up`) driven through the public
Python client only. Every workload uses the documented API; nothing reaches into internals."""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from nats_peer import free_port, latency_summary, rss_kib, stop_process

PYTHON = os.environ.get("SLIPSTREAM_PYTHON", sys.executable)
#: distinct payloads per produce workload: 8,192 x 100 B is 800 KB, far past lz4's 64 KiB window
PAYLOAD_POOL = 8192


class SlipstreamPeer:
    name = "slipstream"

    def __init__(
        self,
        data_dir: Path,
        fsync: str = "always",
        linger_ms: float = 5,
        batch_bytes: int = 2 << 20,  # the client's default
        compression: str | None = "default",
        extra_args: list[str] | None = None,
    ) -> None:
        import slipstream  # fails here, with a clear message, if the package is not importable

        self.slipstream = slipstream
        self.data_dir = data_dir
        self.fsync = fsync
        self.linger_ms = linger_ms
        self.batch_bytes = batch_bytes
        #: "default" leaves the client's default; None (off), "lz4" or "zstd" set it
        self.compression = compression
        self.extra_args = extra_args or []  # more `slipstream up` options
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.client = None
        self.filled: dict[str, int] = {}
        self.version = getattr(slipstream, "__version__", "?")

    # -- process ---------------------------------------------------------------------------
    def start(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.data_dir.parent / f"{self.data_dir.name}.log"
        self.log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                PYTHON,
                "-m",
                "slipstream",
                "up",
                "--data-dir",
                str(self.data_dir),
                "--port",
                str(self.port),
                "--fsync",
                self.fsync,
                *self.extra_args,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"slipstream broker exited ({self.proc.returncode}): {self.log_tail()}"
                )
            if b"listening on" in self.log_path.read_bytes():
                try:
                    self.client = self.slipstream.connect(f"127.0.0.1:{self.port}")
                    return
                except Exception:  # not accepting yet
                    pass
            time.sleep(0.05)
        raise RuntimeError(f"slipstream broker did not start in 30 s: {self.log_tail()}")

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-2000:]

    def stop(self) -> None:
        if self.client is not None:
            with contextlib.suppress(Exception):  # the broker may be gone already
                self.client.close()
        if self.proc:
            stop_process(self.proc, 15)
            self.log.close()

    def rss_kib(self) -> int:
        return rss_kib(self.proc.pid)

    def _producer(self, stream: str, **options):
        options = {"linger_ms": self.linger_ms, "batch_bytes": self.batch_bytes, **options}
        if self.compression != "default":
            options.setdefault("compression", self.compression)
        return self.client.producer(stream, **options)

    def _stored(self, stream: str) -> int:
        return sum(self.client.tail(stream).positions.values())  # fresh streams start at 0

    def _check(self, stream: str, expected: int) -> None:
        stored = self._stored(stream)
        if stored != expected:
            raise RuntimeError(f"{stream}: sent {expected} events, stream holds {stored}")
        self.filled[stream] = expected

    # -- workloads -------------------------------------------------------------------------
    def produce(self, stream: str, size: int, count: int) -> dict:
        """One event per send() call, then flush(): the time until the last one is durable.

        The payloads are distinct random bytes (a pool larger than a compressor's window): one
        payload repeated would compress a thousandfold and flatter any compression."""
        self.client.create_stream(stream, segments=1)
        pool = [os.urandom(size) for _ in range(PAYLOAD_POOL)]
        with self._producer(stream) as producer:
            send = producer.send
            start = time.perf_counter()
            for payload in itertools.islice(itertools.cycle(pool), count):
                send(payload)
            producer.flush()
            seconds = time.perf_counter() - start
        self._check(stream, count)
        return {
            "events": count,
            "size": size,
            "seconds": seconds,
            "events_s": count / seconds,
            "mb_s": count * size / seconds / 1e6,
        }

    def produce_bulk(self, stream: str, size: int, count: int, chunk: int = 65536) -> dict:
        """send_many() with an Arrow binary array of ``chunk`` events per call."""
        import numpy as np
        import pyarrow as pa

        self.client.create_stream(stream, segments=1)
        n = min(chunk, count)
        offsets = pa.py_buffer((np.arange(n + 1, dtype=np.int32) * size).tobytes())
        array = pa.Array.from_buffers(
            pa.binary(), n, [None, offsets, pa.py_buffer(os.urandom(size * n))]
        )
        with self._producer(stream) as producer:
            start = time.perf_counter()
            sent = 0
            while sent < count:
                part = array if count - sent >= n else array.slice(0, count - sent)
                producer.send_many(part)
                sent += len(part)
            producer.flush()
            seconds = time.perf_counter() - start
        self._check(stream, count)
        return {
            "events": count,
            "size": size,
            "seconds": seconds,
            "chunk": n,
            "events_s": count / seconds,
            "mb_s": count * size / seconds / 1e6,
        }

    def _fill(self, stream: str, size: int, count: int) -> None:
        if self.filled.get(stream, 0) < count:
            self.produce_bulk(stream, size, count)

    def replay_batches(self, stream: str, size: int, count: int) -> dict:
        """Bounded read of the whole stream as Arrow record batches."""
        self._fill(stream, size, count)
        start = time.perf_counter()
        reader = self.client.reader(stream, start="earliest", end=self.client.tail(stream))
        events = nbytes = 0
        for batch in reader.batches():
            events += batch.num_rows
            nbytes += batch.column("value").nbytes
        seconds = time.perf_counter() - start
        if events != count:
            raise RuntimeError(f"{stream}: replayed {events} of {count} events")
        return {
            "events": events,
            "seconds": seconds,
            "events_s": events / seconds,
            "mb_s": count * size / seconds / 1e6,
            "arrow_bytes": nbytes,
        }

    def replay_events(self, stream: str, size: int, count: int) -> dict:
        """Bounded read of the whole stream, one Event object at a time."""
        self._fill(stream, size, count)
        start = time.perf_counter()
        events = nbytes = 0
        for event in self.client.reader(stream, start="earliest", end=self.client.tail(stream)):
            events += 1
            nbytes += len(event.value)
        seconds = time.perf_counter() - start
        if events != count:
            raise RuntimeError(f"{stream}: replayed {events} of {count} events")
        return {
            "events": events,
            "seconds": seconds,
            "events_s": events / seconds,
            "mb_s": nbytes / seconds / 1e6,
        }

    def latency(
        self,
        rate: int,
        seconds: float,
        size: int = 100,
        warmup: float = 1.0,
        linger_ms: float | None = None,
    ) -> dict:
        """A follower thread reads from "latest" while the main thread sends ``rate`` events/s,
        each carrying its perf_counter_ns send time. Warm-up events are not counted."""
        stream = "bench/lat"
        self.client.create_stream(stream, segments=1)
        total = int((warmup + seconds) * rate)
        measured_from = int(warmup * rate)
        samples: list[int] = []
        received = [0]
        reader = self.client.reader(stream, start="latest")
        failure: list[BaseException] = []

        def follow() -> None:
            try:
                for event in reader:
                    now = time.perf_counter_ns()
                    value = event.value
                    if value[8] == 1:
                        samples.append(now - int.from_bytes(value[:8], "little"))
                    received[0] += 1
                    if received[0] >= total:
                        return
            except BaseException as exc:  # reported below, not swallowed
                failure.append(exc)

        follower = threading.Thread(target=follow, daemon=True, name="bench-follower")
        follower.start()
        pad = bytes(size - 9)
        linger = self.linger_ms if linger_ms is None else linger_ms
        with self._producer(stream, linger_ms=linger) as producer:
            start = time.perf_counter_ns()
            for i in range(total):
                due = start + i * 1_000_000_000 // rate
                delay = due - time.perf_counter_ns()
                if delay > 0:
                    time.sleep(delay / 1e9)
                flag = b"\x01" if i >= measured_from else b"\x00"
                producer.send(time.perf_counter_ns().to_bytes(8, "little") + flag + pad)
        follower.join(10)
        if follower.is_alive():
            reader.close()
        if failure:
            raise failure[0]
        result = latency_summary(samples, rate, seconds, total - received[0])
        result["linger_ms"] = linger
        return result

    def transactions(self, size: int, events: int, sizes: tuple[int, ...]) -> dict:
        """``events`` events of ``size`` bytes through transactions of each size in ``sizes``
        (keyed over 4 segments of 2 streams, so each commit spans several containers), against
        the same events through a plain idempotent producer; then a bounded read of committed
        data against a read of plain data."""
        payload = os.urandom(size)
        keys = [f"k{i}" for i in range(64)]
        out: dict = {}
        self.client.create_stream("bench/txplain", segments=4)
        with self._producer("bench/txplain") as producer:
            start = time.perf_counter()
            for i in range(events):
                producer.send(payload, key=keys[i & 63])
            producer.flush()
            seconds = time.perf_counter() - start
        out["plain"] = {"events_s": events / seconds, "mb_s": events * size / seconds / 1e6}
        for per_txn in sizes:
            stream = f"bench/tx{per_txn}"
            self.client.create_stream(stream, segments=4)
            self.client.create_stream(stream + "-audit", segments=4)
            count = min(events, max(per_txn * 20, 200 if per_txn == 1 else per_txn * 5))
            txns = max(1, count // per_txn)
            start = time.perf_counter()
            for t in range(txns):
                with self.client.transaction("bench-tx", batch_bytes=self.batch_bytes) as txn:
                    for i in range(per_txn):
                        txn.send(stream, payload, key=keys[(t + i) & 63])
                    txn.metadata = {"txn": t}
            seconds = time.perf_counter() - start
            stored = self._stored(stream)
            if stored != txns * per_txn:
                raise RuntimeError(f"{stream}: committed {txns * per_txn} events, read {stored}")
            out[f"txn_{per_txn}"] = {
                "events": txns * per_txn,
                "txns_s": txns / seconds,
                "events_s": txns * per_txn / seconds,
                "mb_s": txns * per_txn * size / seconds / 1e6,
            }
        big = f"bench/tx{max(sizes)}"
        committed = self._stored(big)
        best: dict[str, float] = {}
        for _ in range(3):  # alternate and keep each one's best: short reads are noisy here
            for label, stream in (("read_committed", big), ("read_plain", "bench/txplain")):
                start = time.perf_counter()
                n = 0
                for batch in self.client.reader(stream, end=self.client.tail(stream)).batches():
                    n += batch.num_rows
                    if n >= committed:
                        break
                best[label] = min(best.get(label, 1e9), time.perf_counter() - start)
        for label, seconds in best.items():
            out[label] = {"events_s": committed / seconds, "mb_s": committed * size / seconds / 1e6}
        return out

    def many_streams(self, count: int, size: int = 100) -> dict:
        """Create ``count`` single-segment streams, append one event to each, and report the
        broker's RSS growth per stream once they are idle."""
        names = [f"many/s{i:06d}" for i in range(count)]
        time.sleep(0.5)
        rss_before = self.rss_kib()
        start = time.perf_counter()
        for name in names:
            self.client.create_stream(name, segments=1)
        create_s = time.perf_counter() - start
        producers = [self._producer(name) for name in names]
        payload = os.urandom(size)
        start = time.perf_counter()
        receipts = [producer.send(payload) for producer in producers]
        for producer in producers:
            producer.flush()
        produce_s = time.perf_counter() - start
        for producer in producers:
            producer.close()
        positions = [receipt.result() for receipt in receipts]
        assert len(positions) == count
        time.sleep(1.0)  # let the broker settle: idle streams, not in-flight requests
        rss_after = self.rss_kib()
        return {
            "streams": count,
            "create_s": create_s,
            "creates_s": count / create_s,
            "produce_s": produce_s,
            "events_s": count / produce_s,
            "rss_before_mib": rss_before / 1024,
            "rss_after_mib": rss_after / 1024,
            "rss_per_stream_kib": (rss_after - rss_before) / count,
        }

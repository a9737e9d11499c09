"""NATS JetStream peer: a nats-server subprocess and a lean driver that speaks the NATS text
protocol directly over asyncio, so JetStream is measured, not a convenience client.

* produce: core PUBs with one reply subject for all PubAcks; a window of N outstanding acked
  publishes; frames are pre-encoded, so the client costs almost nothing per message.
* replay: a pull consumer (ack none) with several pipelined fetches of thousands of messages.
* latency: a push consumer (deliver new, ack none) on the same connection as the publisher.

JetStream 2.9 acknowledges a publish once the message is in its store's write buffer, before
it is fsynced (it syncs every 2 minutes by default); slipstream's fsync=always acknowledges only
after fdatasync. The numbers therefore compare unequal guarantees, in JetStream's favour.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None

#: consumer and inbox names unique across connections, and across processes (the workers of
#: bench/consumers.py): two subscribers of one inbox subject would each get the other's replies
_names = itertools.count((os.getpid() << 32) + 1)
Handler = Callable[[bytes, bytes, bytes], None]  # (reply subject, headers, payload)


def stop_process(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout`` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def rss_kib(pid: int) -> int:
    """Resident memory of a process, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NatsError(RuntimeError):
    pass


class Connection(asyncio.Protocol):
    """Just enough of the NATS client protocol: CONNECT, SUB, PUB, MSG/HMSG, PING/PONG."""

    def __init__(self) -> None:
        self.buf = b""
        self.handlers: dict[bytes, Handler] = {}
        self.sids = itertools.count(1)
        self.pongs: list[asyncio.Future] = []
        self.error: str | None = None
        self.can_write = asyncio.Event()
        self.can_write.set()
        self.closed = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None

    @classmethod
    async def open(cls, port: int) -> Connection:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(cls, "127.0.0.1", port)
        options = {
            "verbose": False,
            "pedantic": False,
            "headers": True,
            "no_responders": True,
            "protocol": 1,
            "lang": "python-bench",
            "version": "0",
        }
        conn.transport.write(b"CONNECT %s\r\n" % json.dumps(options).encode())
        await conn.ping()
        return conn

    # -- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)

    def connection_lost(self, exc) -> None:
        if not self.closed.done():
            self.closed.set_result(exc)
        for fut in self.pongs:
            if not fut.done():
                fut.set_exception(NatsError(f"connection lost: {self.error or exc}"))

    def pause_writing(self) -> None:
        self.can_write.clear()

    def resume_writing(self) -> None:
        self.can_write.set()

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        pos, end = 0, len(buf)
        handlers = self.handlers
        while pos < end:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                break
            op = buf[pos : pos + 4]
            if op == b"MSG " or op == b"HMSG":
                parts = buf[pos:eol].split(b" ")
                start = eol + 2
                size = int(parts[-1])
                if start + size + 2 > end:
                    break
                hsize = int(parts[-2]) if op == b"HMSG" else 0
                reply = parts[3] if len(parts) == (6 if hsize else 5) else b""
                handler = handlers.get(parts[2])
                if handler is not None:
                    handler(reply, buf[start : start + hsize], buf[start + hsize : start + size])
                pos = start + size + 2
                continue
            line = buf[pos:eol]
            pos = eol + 2
            if line == b"PING":
                self.transport.write(b"PONG\r\n")
            elif line == b"PONG":
                if self.pongs:
                    fut = self.pongs.pop(0)
                    if not fut.done():
                        fut.set_result(None)
            elif line.startswith(b"-ERR"):
                self.error = line.decode(errors="replace")
        self.buf = buf[pos:]

    # -- commands --------------------------------------------------------------------------
    async def ping(self) -> None:
        fut = asyncio.get_running_loop().create_future()
        self.pongs.append(fut)
        self.transport.write(b"PING\r\n")
        await fut
        if self.error:
            raise NatsError(self.error)

    def subscribe(self, subject: bytes, handler: Handler) -> bytes:
        sid = str(next(self.sids)).encode()
        self.handlers[sid] = handler
        self.transport.write(b"SUB %s %s\r\n" % (subject, sid))
        return sid

    def unsubscribe(self, sid: bytes) -> None:
        self.handlers.pop(sid, None)
        self.transport.write(b"UNSUB %s\r\n" % sid)

    def publish(self, subject: bytes, payload: bytes, reply: bytes = b"") -> None:
        if reply:
            frame = b"PUB %s %s %d\r\n%s\r\n" % (subject, reply, len(payload), payload)
            self.transport.write(frame)
        else:
            self.transport.write(b"PUB %s %d\r\n%s\r\n" % (subject, len(payload), payload))

    async def request(self, subject: str, body: dict | None = None, timeout: float = 10) -> dict:
        fut = asyncio.get_running_loop().create_future()
        inbox = b"_INBOX.req.%d" % next(_names)
        sid = self.subscribe(inbox, lambda r, h, p: fut.done() or fut.set_result((h, p)))
        self.publish(subject.encode(), json.dumps(body or {}).encode(), inbox)
        try:
            headers, payload = await asyncio.wait_for(fut, timeout)
        finally:
            self.unsubscribe(sid)
        if headers and not payload:
            raise NatsError(f"{subject}: {headers.decode().strip()}")
        reply = json.loads(payload)
        if "error" in reply:
            raise NatsError(f"{subject}: {reply['error']}")
        return reply

    async def drain(self) -> None:
        await self.can_write.wait()

    def close(self) -> None:
        self.transport.close()


class AckCounter:
    """Counts PubAcks arriving on one reply subject and lets a publisher wait for room."""

    def __init__(self) -> None:
        self.acked = 0
        self.errors = 0
        self.first_error = b""
        self.waiter: asyncio.Future | None = None
        self.wait_until = 0

    def __call__(self, reply: bytes, headers: bytes, payload: bytes) -> None:
        self.acked += 1
        if headers or b'"error"' in payload:  # 503 no responders, or a JetStream API error
            self.errors += 1
            self.first_error = self.first_error or headers + payload
        if self.waiter is not None and self.acked >= self.wait_until:
            if not self.waiter.done():
                self.waiter.set_result(None)
            self.waiter = None

    async def until(self, count: int) -> None:
        if self.acked < count:
            self.wait_until = count
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter


class NatsPeer:
    """nats-server with JetStream in a temp dir, and the workloads run against it."""

    name = "JetStream"

    def __init__(self, data_dir: Path, window: int = 4096, fetch: int = 10_000) -> None:
        self.data_dir = data_dir
        self.window = window
        self.fetch = fetch
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.filled: dict[str, int] = {}  # stream -> events already in it
        self.version = ""

    # -- process ---------------------------------------------------------------------------
    def start(self) -> None:
        binary = shutil.which("nats-server")
        if binary is None:
            raise RuntimeError("nats-server not found (apt-get install -y nats-server)")
        self.version = subprocess.run(
            [binary, "--version"], capture_output=True, text=True
        ).stdout.strip()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log = open(self.data_dir / "nats-server.log", "wb")  # noqa: SIM115 - until stop()
        self.proc = subprocess.Popen(
            [binary, "-js", "-a", "127.0.0.1", "-p", str(self.port), "-sd", str(self.data_dir)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited: {self._log_tail()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                if b"Server is ready" in (self.data_dir / "nats-server.log").read_bytes():
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"nats-server did not start: {self._log_tail()}")

    def _log_tail(self) -> str:
        return (self.data_dir / "nats-server.log").read_text(errors="replace")[-2000:]

    def stop(self) -> None:
        if self.proc:
            stop_process(self.proc, 10)
            self.log.close()

    # -- helpers ---------------------------------------------------------------------------
    def run(self, coro):
        runner = uvloop.run if uvloop else asyncio.run
        return runner(coro)

    async def _connect(self) -> Connection:
        return await Connection.open(self.port)

    async def _create_stream(self, conn: Connection, name: str) -> None:
        config = {
            "name": name,
            "subjects": [name.lower()],
            "storage": "file",
            "retention": "limits",
            "discard": "old",
            "num_replicas": 1,
        }
        await conn.request(f"$JS.API.STREAM.CREATE.{name}", config)

    async def _publish(self, conn: Connection, subject: bytes, payload: bytes, count: int) -> float:
        """Publish ``count`` copies with acks, at most ``window`` unacknowledged. Returns seconds
        from the first PUB to the last PubAck."""
        acks = AckCounter()
        inbox = b"_INBOX.acks.%d" % next(_names)
        sid = conn.subscribe(inbox, acks)
        await conn.ping()
        frame = b"PUB %s %s %d\r\n%s\r\n" % (subject, inbox, len(payload), payload)
        chunk = max(1, self.window // 4)
        sent = 0
        start = time.perf_counter()
        while sent < count:
            await acks.until(sent + min(chunk, count - sent) - self.window)
            n = min(chunk, count - sent)
            conn.transport.write(frame * n)
            sent += n
            await conn.drain()
        await acks.until(count)
        seconds = time.perf_counter() - start
        conn.unsubscribe(sid)
        if acks.errors:
            raise NatsError(f"{acks.errors} publishes failed, first: {acks.first_error[:300]!r}")
        return seconds

    # -- workloads -------------------------------------------------------------------------
    def produce(self, stream: str, size: int, count: int) -> dict:
        async def main():
            conn = await self._connect()
            await self._create_stream(conn, stream)
            seconds = await self._publish(conn, stream.lower().encode(), os.urandom(size), count)
            info = await conn.request(f"$JS.API.STREAM.INFO.{stream}")
            conn.close()
            return seconds, info["state"]["messages"]

        seconds, stored = self.run(main())
        if stored != count:
            raise NatsError(f"{stream}: published {count}, stream holds {stored}")
        self.filled[stream] = count
        return {
            "events": count,
            "size": size,
            "seconds": seconds,
            "events_s": count / seconds,
            "mb_s": count * size / seconds / 1e6,
            "window": self.window,
        }

    def replay(self, stream: str, size: int, count: int) -> dict:
        """Read the whole stream through a pull consumer: ``fetch`` messages per request and
        two requests in flight, so the server never waits for the client to ask."""
        if self.filled.get(stream, 0) < count:
            self.produce(stream, size, count)

        async def main():
            conn = await self._connect()
            durable = f"replay{next(_names)}"
            await conn.request(
                f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{durable}",
                {
                    "stream_name": stream,
                    "config": {
                        "durable_name": durable,
                        "ack_policy": "none",
                        "deliver_policy": "all",
                        "replay_policy": "instant",
                        "max_waiting": 64,
                    },
                },
            )
            done = asyncio.get_running_loop().create_future()
            state = {"events": 0, "bytes": 0}
            inbox = b"_INBOX.replay.%d" % next(_names)
            next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}".encode()
            request = json.dumps({"batch": self.fetch, "expires": 5_000_000_000}).encode()

            def on_message(reply: bytes, headers: bytes, payload: bytes) -> None:
                if headers and not payload:  # status: 404 no messages / 408 timeout
                    if not done.done() and b"408" not in headers:
                        done.set_exception(NatsError(headers.decode(errors="replace")))
                    return
                state["events"] += 1
                state["bytes"] += len(payload)
                if state["events"] % self.fetch == 0:
                    conn.publish(next_subject, request, inbox)
                if state["events"] == count and not done.done():
                    done.set_result(None)

            conn.subscribe(inbox, on_message)
            await conn.ping()
            start = time.perf_counter()
            for _ in range(2):
                conn.publish(next_subject, request, inbox)
            await asyncio.wait_for(done, 120)
            seconds = time.perf_counter() - start
            await conn.request(f"$JS.API.CONSUMER.DELETE.{stream}.{durable}")
            conn.close()
            return seconds, state

        seconds, state = self.run(main())
        return {
            "events": state["events"],
            "seconds": seconds,
            "events_s": count / seconds,
            "mb_s": state["bytes"] / seconds / 1e6,
            "fetch": self.fetch,
        }

    def latency(self, rate: int, seconds: float, size: int = 100, warmup: float = 1.0) -> dict:
        """Publish ``rate`` events/s (acked), each carrying its send time; a push consumer on
        the same connection records receive - send. Warm-up events are not counted."""
        stream = "LAT"

        async def main():
            conn = await self._connect()
            await self._create_stream(conn, stream)
            deliver = b"_INBOX.lat.%d" % next(_names)
            samples: list[int] = []
            state = {"received": 0}

            def on_event(reply: bytes, headers: bytes, payload: bytes) -> None:
                if headers and not payload:
                    return  # idle heartbeat or flow control status
                now = time.perf_counter_ns()
                state["received"] += 1
                sent_ns = int.from_bytes(payload[:8], "little")
                if payload[8] == 1:
                    samples.append(now - sent_ns)

            conn.subscribe(deliver, on_event)
            await conn.request(
                f"$JS.API.CONSUMER.CREATE.{stream}",
                {
                    "stream_name": stream,
                    "config": {
                        "deliver_subject": deliver.decode(),
                        "ack_policy": "none",
                        "deliver_policy": "new",
                        "replay_policy": "instant",
                    },
                },
            )
            acks = AckCounter()
            ack_inbox = b"_INBOX.latacks.%d" % next(_names)
            conn.subscribe(ack_inbox, acks)
            await conn.ping()
            subject, pad = stream.lower().encode(), bytes(size - 9)
            total = int((warmup + seconds) * rate)
            start = time.perf_counter_ns()
            measured_from = int(warmup * rate)
            for i in range(total):
                due = start + i * 1_000_000_000 // rate
                delay = due - time.perf_counter_ns()
                if delay > 0:
                    await asyncio.sleep(delay / 1e9)
                flag = b"\x01" if i >= measured_from else b"\x00"
                conn.publish(
                    subject, time.perf_counter_ns().to_bytes(8, "little") + flag + pad, ack_inbox
                )
            deadline = time.monotonic() + 10
            while state["received"] < total and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            await conn.request(f"$JS.API.STREAM.DELETE.{stream}")
            conn.close()
            if acks.errors:
                raise NatsError(f"latency publishes failed: {acks.first_error[:300]!r}")
            return samples, total - state["received"]

        samples, lost = self.run(main())
        return latency_summary(samples, rate, seconds, lost)


def latency_summary(samples_ns: list[int], rate: int, seconds: float, lost: int) -> dict:
    if not samples_ns:
        return {"events": 0, "lost": lost, "rate": rate, "seconds": seconds}
    ms = sorted(s / 1e6 for s in samples_ns)
    pick = lambda q: ms[min(len(ms) - 1, int(q * len(ms)))]  # noqa: E731
    return {
        "events": len(ms),
        "lost": lost,
        "rate": rate,
        "seconds": seconds,
        "p50_ms": pick(0.50),
        "p99_ms": pick(0.99),
        "max_ms": ms[-1],
    }


# -- durable consumers (bench/consumers.py) ----------------------------------------------------


async def create_durable(
    conn: Connection,
    stream: str,
    durable: str,
    ack_policy: str = "none",
    deliver_policy: str = "all",
    max_ack_pending: int = 65_536,
    ack_wait_s: float = 30.0,
) -> None:
    """A durable pull consumer on ``stream``: ``ack_policy`` "none", "all" (an ack covers every
    earlier message: a cursor committed per fetch, like a subscription's commit of a batch) or
    "explicit" (each message acked on its own: a work queue). Several processes may pull from
    one durable: JetStream spreads the messages over their requests."""
    config: dict = {
        "durable_name": durable,
        "ack_policy": ack_policy,
        "deliver_policy": deliver_policy,
        "replay_policy": "instant",
        "max_waiting": 512,
    }
    if ack_policy != "none":
        config["max_ack_pending"] = max_ack_pending
        config["ack_wait"] = int(ack_wait_s * 1e9)
    await conn.request(
        f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{durable}",
        {"stream_name": stream, "config": config},
    )


async def pull_consume(
    conn: Connection,
    stream: str,
    durable: str,
    on_message: Callable[[bytes], None],
    stop: asyncio.Event,
    ack: str = "none",
    fetch: int = 1000,
) -> None:
    """Pull from a durable consumer until ``stop`` is set, calling ``on_message(payload)`` for
    each message, with two fetch requests in flight so the server never waits for the client.

    ``ack``: "none"; "all" acks the last message of every ``fetch`` messages (one ack commits
    all before it); "explicit" acks every message on its own, as a work-queue worker would.
    A request that ends early (408 expired, 404/409) is replaced at once."""
    inbox = b"_INBOX.pull.%d" % next(_names)
    next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}".encode()
    request = json.dumps({"batch": fetch, "expires": 1_000_000_000}).encode()
    since_request = [0]
    last_reply = [b""]
    publish = conn.publish
    explicit = ack == "explicit"

    def on_pull(reply: bytes, headers: bytes, payload: bytes) -> None:
        if headers and not payload:  # a request ended: 404 no messages, 408 expired, 409
            publish(next_subject, request, inbox)
            return
        if explicit:
            publish(reply, b"")
        else:
            last_reply[0] = reply
        on_message(payload)
        since_request[0] += 1
        if since_request[0] >= fetch:
            since_request[0] = 0
            if ack == "all":
                publish(reply, b"")
            publish(next_subject, request, inbox)

    sid = conn.subscribe(inbox, on_pull)
    await conn.ping()
    for _ in range(2):
        publish(next_subject, request, inbox)
    await stop.wait()
    if ack == "all" and last_reply[0]:
        publish(last_reply[0], b"")
    conn.unsubscribe(sid)
    await conn.ping()


async def create_stream(conn: Connection, name: str, subjects: list[str] | None = None) -> None:
    """A file-store stream with limits retention, one replica (what NatsPeer's workloads use)."""
    config = {
        "name": name,
        "subjects": subjects or [name.lower()],
        "storage": "file",
        "retention": "limits",
        "discard": "old",
        "num_replicas": 1,
    }
    await conn.request(f"$JS.API.STREAM.CREATE.{name}", config)

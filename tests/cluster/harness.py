"""A cluster of broker processes on one PostgreSQL catalog and one S3 bucket, with faults.

    with Cluster(tmp_path, postgres, seaweedfs, brokers=3).start() as cluster:
        client = slipstream.connect(cluster.addresses())   # "127.0.0.1:p1,127.0.0.1:p2,..."
        cluster.kill(1)                  # kill -9
        cluster.pause(2); cluster.resume(2)    # SIGSTOP / SIGCONT
        cluster.restart(1)               # kill -9 if running, start again (same port, same id)
        cluster.stop(1); cluster.start_broker(1)   # SIGTERM (a clean handover), start again
        cluster.cut_pg(0); cluster.heal_pg(0)  # broker 0's catalog connections hang / work
        cluster.restart_pg()             # PostgreSQL fast shutdown and start, under load
        cluster.store_errors(True)       # every S3 request answered 503 SlowDown
        cluster.store_slow(0.5)          # every S3 request delayed 0.5 s (0: off)
        cluster.wait_until_all_containers_served()

``postgres`` and ``seaweedfs`` are the session fixtures of tests/conftest.py and
tests/objectstores.py; the cluster makes its own database and bucket on them (``dsn``,
``bucket``). Broker ``i`` is ``cluster.brokers[i]`` (a conftest ``BrokerProcess``, id ``b<i>``,
its own data directory and log ``<base>/b<i>-broker.log``), started in cluster mode: ``--meta``
through its own :class:`FaultProxy` to PostgreSQL (``cluster.pg_proxies[i]``), ``--objects``
and ``--journal objects`` through one :class:`FaultProxy` to SeaweedFS shared by all brokers
(``cluster.store_proxy``), ``--lease-ttl`` 2 s so takeovers are quick. ``close()`` (or leaving
the ``with`` block) kills every broker and closes the proxies; the database, the bucket and
the base directory are the caller's (pytest's ``tmp_path``).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import signal
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from conftest import BrokerProcess
from objectstores import ACCESS_KEY, SECRET_KEY, SeaweedFS
from pg import PgCluster
from psycopg.conninfo import conninfo_to_dict
from raw import RawConnection

from slipstream.client._connection import Connection
from slipstream.protocol import Message

_S3_UNAVAILABLE = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>injected by the test's fault proxy</Message></Error>"
)


class FaultProxy:
    """A TCP proxy on 127.0.0.1 (``port``) to ``target_port`` that injects faults.

    ``freeze()``: every connection, current and new, stops forwarding and stays open (a hung
    peer, a network partition without resets); ``reset()``: current connections are reset and
    new ones refused at once; ``heal()`` ends either. ``http_errors(True)``: current
    connections are reset and every new request is read and answered ``503 SlowDown`` (what
    an overloaded S3 says) without reaching the target. ``delay(seconds)``: every chunk of a
    request is held that long before it is forwarded (a slow server; 0 ends it). One thread
    per direction per connection, so a delay or a freeze of one connection holds no other.
    """

    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._flowing = threading.Event()  # cleared while frozen
        self._flowing.set()
        self._refusing = False
        self._erroring = False
        self._delay = 0.0
        self._closed = False
        self._threads: list[threading.Thread] = []
        self._spawn(self._accept_loop)

    def _spawn(self, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self._closed:
                client.close()
                return
            self._spawn(self._serve, client)

    def _track(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.add(sock)

    def _serve(self, client: socket.socket) -> None:
        self._track(client)
        if self._refusing:
            self._abort(client)
            return
        if self._erroring:
            self._answer_unavailable(client)
            return
        self._flowing.wait()  # a frozen proxy accepts, then says nothing
        try:
            upstream = socket.create_connection(self.target, timeout=5)
            upstream.settimeout(None)
        except OSError:
            self._abort(client)
            return
        self._track(upstream)
        self._spawn(self._pump, client, upstream, True)
        self._pump(upstream, client, False)

    def _pump(self, source: socket.socket, sink: socket.socket, request: bool) -> None:
        try:
            while True:
                data = source.recv(262144)
                if not data:
                    break
                if request and self._delay:
                    time.sleep(self._delay)
                self._flowing.wait()
                sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):
            self._abort(sock, reset=False)

    def _answer_unavailable(self, client: socket.socket) -> None:
        try:
            client.settimeout(5)
            head = b""
            while b"\r\n\r\n" not in head:
                data = client.recv(65536)
                if not data:
                    raise OSError("closed before the request's head")
                head += data
            header, _, body = head.partition(b"\r\n\r\n")
            length = 0
            for line in header.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value.strip())
            while len(body) < length:  # read the body so the client sees the answer
                data = client.recv(min(262144, length - len(body)))
                if not data:
                    break
                body += data
            client.sendall(
                b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/xml\r\n"
                b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
                % (len(_S3_UNAVAILABLE), _S3_UNAVAILABLE)
            )
        except (OSError, ValueError):
            pass
        self._abort(client, reset=False)

    def _abort(self, sock: socket.socket, *, reset: bool = True) -> None:
        with self._lock:
            self._sockets.discard(sock)
        with contextlib.suppress(OSError):
            if reset:  # an RST, not a FIN: in-flight data is lost both ways
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00" * 2)
            else:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv
        with contextlib.suppress(OSError):
            sock.close()

    def _reset_all(self) -> None:
        with self._lock:
            socks = list(self._sockets)
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00" * 2)
                sock.shutdown(socket.SHUT_RDWR)
            self._abort(sock)

    def freeze(self) -> None:
        self._flowing.clear()

    def reset(self) -> None:
        self._refusing = True
        self._reset_all()

    def heal(self) -> None:
        self._refusing = False
        self._flowing.set()

    def http_errors(self, on: bool) -> None:
        self._erroring = on
        if on:
            self._reset_all()

    def delay(self, seconds: float) -> None:
        self._delay = seconds

    def close(self) -> None:
        self._closed = True
        self.heal()
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self._reset_all()
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(2)


def ask(address: str, message: Message) -> Message:
    """One request on a fresh connection to the broker at ``address``; its answer (an
    Error answer raises it as the typed error)."""

    async def asking() -> Message:
        connection = await Connection.open(address)
        try:
            reply, _ = await connection.request(message)
        finally:
            connection.close()
        return reply

    return asyncio.run(asking())


class Raw:
    """A hand-driven connection that answers one request at a time."""

    def __init__(self, address: str) -> None:
        self.connection = RawConnection(address)
        self.connection.receive()  # Welcome
        self._cid = 100

    def ask(self, message: Message, payload: bytes = b"") -> Any:
        self._cid += 1
        self.connection.send_frame(message, self._cid, payload)
        while True:
            frame = self.connection.receive()
            if frame.correlation_id == self._cid:
                return frame.message

    def close(self) -> None:
        self.connection.close()


def _supports(option: str) -> bool:
    """Whether ``slipstream up`` has ``--option`` (the cluster flags land in steps)."""
    from slipstream.cli import _app

    return option.replace("-", "_") in inspect.signature(_app.up).parameters


class Cluster:
    """``brokers`` broker processes in cluster mode with faults to inject (module docstring).

    The methods take a broker's index. ``kill``, ``pause`` and ``cut_pg`` leave the broker
    unable to serve until ``restart``, ``resume`` or ``heal_pg``; the others take its
    containers over once its leases expire (``lease_ttl`` seconds after its last renewal).
    """

    def __init__(
        self,
        base: Path,
        postgres: PgCluster,
        store: SeaweedFS,
        *,
        brokers: int = 3,
        containers: int = 4,
        lease_ttl: float = 2.0,
        extra: tuple[str, ...] = (),
    ) -> None:
        self.base = base
        self.postgres = postgres
        self.store = store
        self.containers = containers
        self.lease_ttl = lease_ttl
        self.database = postgres.create_database()
        self.dsn = postgres.dsn(self.database)
        self.bucket = store.create_bucket()
        self.store_proxy = FaultProxy(int(store.endpoint.rsplit(":", 1)[1]))
        self.pg_proxies: list[FaultProxy] = []
        self.brokers: list[BrokerProcess] = []
        self.paused: set[int] = set()
        self.cut: set[int] = set()  # cut off PostgreSQL
        pg_port = int(conninfo_to_dict(self.dsn)["port"])
        for i in range(brokers):
            proxy = FaultProxy(pg_port)
            self.pg_proxies.append(proxy)
            dsn = self.dsn.replace(f"127.0.0.1:{pg_port}/", f"127.0.0.1:{proxy.port}/")
            broker = BrokerProcess(base / f"b{i}")
            broker.extra = [
                *("--meta", dsn, "--objects", f"s3://{self.bucket}/cluster"),
                *("--s3-endpoint", f"http://127.0.0.1:{self.store_proxy.port}"),
                *("--journal", "objects", "--broker-id", f"b{i}"),
                *("--containers", str(containers), "--lease-ttl", str(lease_ttl)),
                *(("--advertise", broker.address) if _supports("advertise") else ()),
                *extra,
            ]
            broker.env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
            self.brokers.append(broker)

    # --- lifecycle --------------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> Cluster:
        """Start every broker (one at a time: the first fixes the container count) and wait
        until every container is served."""
        try:
            for i in range(len(self.brokers)):
                self._start(i, timeout)
            self.wait_until_all_containers_served(timeout)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        for i, broker in enumerate(self.brokers):
            if i in self.paused:
                self.resume(i)
            broker.kill()
        for proxy in (*self.pg_proxies, self.store_proxy):
            proxy.close()
        with contextlib.suppress(Exception):
            self.postgres.drop_database(self.database)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- addresses and state ----------------------------------------------------------------

    def addresses(self) -> str:
        """The bootstrap list clients take: ``"127.0.0.1:p0,127.0.0.1:p1,..."``."""
        return ",".join(b.address for b in self.brokers)

    def running(self, i: int) -> bool:
        proc = self.brokers[i].proc
        return proc is not None and proc.poll() is None

    def serving(self) -> set[str]:
        """Ids of brokers that can serve: running, not paused, not cut off PostgreSQL."""
        return {
            f"b{i}"
            for i in range(len(self.brokers))
            if self.running(i) and i not in self.paused and i not in self.cut
        }

    def leases(self) -> dict[int, tuple[str, int, bool]]:
        """Container -> (owner, epoch, live) from the catalog (directly, not through a proxy)."""
        with psycopg.connect(self.dsn, connect_timeout=5) as conn:
            rows = conn.execute(
                "SELECT container, owner, epoch, expires_ms > (extract(epoch FROM now()) * 1000) "
                "FROM leases WHERE epoch > 0"
            ).fetchall()
        return {int(c): (str(o), int(e), bool(live)) for c, o, e, live in rows}

    def wait_until_all_containers_served(
        self, timeout: float = 60.0, *, balanced: bool = True
    ) -> dict[int, str]:
        """Wait until every container holds a live lease of a broker that can serve (see
        ``serving``) and, with ``balanced``, the brokers that can serve hold their shares
        (counts differ by at most one: no hand-over is still due); returns container ->
        broker id. A bound against hanging (raises AssertionError naming what is missing),
        not a timing assertion."""
        deadline = time.monotonic() + timeout
        while True:
            owners: dict[int, str] = {}
            with contextlib.suppress(psycopg.OperationalError):
                serving = self.serving()
                owners = {
                    c: owner
                    for c, (owner, _, live) in self.leases().items()
                    if live and owner in serving
                }
                counts = Counter(dict.fromkeys(serving, 0))
                counts.update(owners.values())
                even = max(counts.values(), default=0) - min(counts.values(), default=0) <= 1
                if len(owners) == self.containers and (even or not balanced):
                    return owners
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"containers not served after {timeout} s: {owners} of {self.containers}"
                    + "".join(f"\n--- b{i}\n{b.log()[-3000:]}" for i, b in enumerate(self.brokers))
                )
            time.sleep(0.1)

    def _start(self, i: int, timeout: float) -> None:
        """Start broker ``i``; one that does not listen in time dumps its threads' stacks to
        its log (faulthandler on SIGABRT) before the error names what it was doing."""
        broker = self.brokers[i]
        try:
            broker.start(timeout)
        except RuntimeError:
            proc = broker.proc
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGABRT)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)
                broker.kill()
                raise RuntimeError(f"b{i} did not listen in {timeout} s:\n{broker.log()}") from None
            raise

    # --- faults -----------------------------------------------------------------------------

    def kill(self, i: int) -> None:
        """kill -9 broker ``i`` (resumed first if paused: a stopped process dies on SIGKILL
        too, this only keeps ``paused`` right)."""
        self.paused.discard(i)
        self.brokers[i].kill()

    def pause(self, i: int) -> None:
        """SIGSTOP: the process, its sockets and its catalog sessions hang."""
        proc = self.brokers[i].proc
        assert proc is not None and proc.poll() is None, f"b{i} is not running"
        proc.send_signal(signal.SIGSTOP)
        self.paused.add(i)

    def resume(self, i: int) -> None:
        proc = self.brokers[i].proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
        self.paused.discard(i)

    def stop(self, i: int) -> int:
        """SIGTERM and wait for a clean exit (it hands its containers over); the exit code."""
        self.resume(i)
        return self.brokers[i].stop()

    def start_broker(self, i: int, timeout: float = 60.0) -> None:
        """Start broker ``i`` again after ``kill`` or ``stop`` (same id, port, data dir)."""
        self._start(i, timeout)

    def restart(self, i: int, timeout: float = 60.0) -> None:
        """kill -9 if it runs (or is paused), then start it again: same id, port, data dir."""
        self.kill(i)
        self._start(i, timeout)

    def cut_pg(self, i: int, *, hang: bool = True) -> None:
        """Cut broker ``i`` off PostgreSQL: its connections hang (``hang``, a partition) or
        are reset and refused."""
        self.cut.add(i)
        if hang:
            self.pg_proxies[i].freeze()
        else:
            self.pg_proxies[i].reset()

    def heal_pg(self, i: int) -> None:
        self.cut.discard(i)
        self.pg_proxies[i].heal()

    def restart_pg(self) -> None:
        """PostgreSQL's fast shutdown and start: every broker's catalog connections close.
        The server is the session's (shared with other tests' databases, on the same port)."""
        self.postgres.restart()

    def store_errors(self, on: bool) -> None:
        """Every request to the object store answered 503 SlowDown (True) or forwarded."""
        self.store_proxy.http_errors(on)

    def store_slow(self, seconds: float) -> None:
        """Every request to the object store held ``seconds`` before it is forwarded."""
        self.store_proxy.delay(seconds)

    def logs(self, tail: int = 4000) -> str:
        return "".join(f"\n--- b{i}\n{b.log()[-tail:]}" for i, b in enumerate(self.brokers))

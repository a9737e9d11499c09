"""A throwaway PostgreSQL cluster for the tests (slipstream.devservers.PostgresServer, which
``./run.sh --cluster`` starts too): Debian's server binaries (scripts/ensure-postgres.sh
installs them), initdb into a temporary directory, listening only on 127.0.0.1 on a free port,
its unix socket in that directory, fsync off. The superuser ``slipstream`` logs in over TCP
with a password (SCRAM), so wrong credentials can be tested. PostgreSQL refuses to run as
root: as root, the cluster runs as the ``postgres`` user the Debian package creates.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
from pathlib import Path

from conftest import free_port

from slipstream.devservers import PostgresServer

USER = "slipstream"
PASSWORD = "slipstream-test-password"


class PgCluster(PostgresServer):
    """``start()`` it once per session, ``create_database()`` per test, ``stop()`` at the end
    (an immediate shutdown, then the directory is removed)."""

    def __init__(self) -> None:
        root = Path(tempfile.mkdtemp(prefix="slipstream-pg-"))
        super().__init__(root, free_port(), PASSWORD, user=USER, durable=False)
        self._names = itertools.count()

    def stop(self, mode: str = "immediate") -> None:
        try:
            super().stop(mode)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

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

"""Local servers for development and operations tooling, not for production: a PostgreSQL and
a SeaweedFS (an S3 gateway) started in a directory on 127.0.0.1 (``PostgresServer``,
``SeaweedServer``).

Why here, in the package: three callers need the same command lines and readiness waits,
and they live in three places that cannot import each other's helpers: the local cluster of
``./run.sh --cluster`` (examples/auctions/cluster.py, persistent data on fixed ports), the
tests (tests/pg.py, tests/objectstores.py: throwaway servers on free ports, fsync off) and
the benchmarks (bench/cluster.py, through the tests' wrappers). A module under tests/ is not
on the path of ``./run.sh``; a module under examples/ is not one the tests should depend on.
Like ``slipstream.torture`` (faults), this package is tooling shipped beside the broker: the
broker never imports it, and it imports psycopg and obstore (the ``postgres`` and ``s3``
extras) only when a caller asks for them.
"""

from ._servers import (
    WEED_PORT_NAMES,
    PostgresServer,
    SeaweedServer,
    ServerError,
    postgres_bin,
    weed_binary,
)

__all__ = [
    "WEED_PORT_NAMES",
    "PostgresServer",
    "SeaweedServer",
    "ServerError",
    "postgres_bin",
    "weed_binary",
]

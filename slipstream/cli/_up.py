"""``slipstream up``: run the broker in the foreground until SIGINT/SIGTERM; SIGHUP reloads
the TLS certificate files.

Exit status: 0 after a clean stop (a signal); 1 for a bad setup (a locked or damaged data
directory, a port in use: the message says which); 70 (EX_SOFTWARE) when a background task
died, with the cause in the log, so that a supervisor restarts the broker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import signal
from pathlib import Path

from .._tls import ServerTls
from ..broker import Broker, BrokerConfig, BrokerFailed, ConnectionLimits, ContainerConfig

#: exit status when the broker stopped because a background task died (sysexits EX_SOFTWARE)
EXIT_FAILED = 70
#: ``--lease-ttl`` unless given (docs/operations.md, "Choosing the lease ttl"). In a cluster,
#: short: a dead broker's containers are served again after about 1.3 ttl (5 s: 6-9 s
#: measured by bench/takeover.py), and the worst renewal stall measured on an overloaded
#: machine (1.7 s) is half the margin a renewal has (2/3 ttl). Standalone nobody takes
#: containers over, so the longer ttl only rides out longer catalog outages.
CLUSTER_LEASE_TTL_MS = 5_000
STANDALONE_LEASE_TTL_MS = 10_000


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
    )


log = logging.getLogger("slipstream.broker")


def is_loopback(host: str) -> bool:
    """Whether only this machine can reach ``host`` (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve to any address


def run_broker(
    data_dir: Path,
    host: str,
    port: int,
    fsync: str,
    containers: int = 4,
    max_batch_bytes: int = 8 * 1024 * 1024,
    roll_bytes: int = 64 * 1024 * 1024,
    roll_ms: int = 300_000,
    retention_check_ms: int = 30_000,
    connection: ConnectionLimits | None = None,
    http_port: int | None = None,
    tls: ServerTls | None = None,
    meta: str | None = None,
    auth: bool = False,
    objects: str | None = None,
    s3_endpoint: str | None = None,
    objects_cache_bytes: int = 1024 * 1024 * 1024,
    broker_id: str | None = None,
    advertise: str | None = None,
    lease_ttl_ms: int | None = None,
    journal: str = "files",
    journal_group_ms: int | None = None,
    journal_group_bytes: int = 4 * 1024 * 1024,
) -> None:
    """Run a broker until a signal; raises SlipstreamError for a bad setup (locked dir) and
    SystemExit(70) if a background task died."""
    config = BrokerConfig(
        data_dir=data_dir,
        host=host,
        port=port,
        containers=containers,
        max_batch_bytes=max_batch_bytes,
        retention_check_ms=retention_check_ms,
        container=ContainerConfig(
            fsync=fsync,
            roll_bytes=roll_bytes,
            roll_ms=roll_ms,
            journal_group_ms=journal_group_ms,
            journal_group_bytes=journal_group_bytes,
        ),
        connection=connection or ConnectionLimits(),
        http_port=http_port,
        tls=tls,
        meta=meta,
        auth=auth,
        objects=objects,
        s3_endpoint=s3_endpoint,
        objects_cache_bytes=objects_cache_bytes,
        broker_id=broker_id,
        advertise=advertise,
        lease_ttl_ms=STANDALONE_LEASE_TTL_MS if lease_ttl_ms is None else lease_ttl_ms,
        journal=journal,
    )
    if lease_ttl_ms is None and config.clustered:
        config = dataclasses.replace(config, lease_ttl_ms=CLUSTER_LEASE_TTL_MS)
    if not auth and not is_loopback(host):
        log.warning(
            "listening on %s without --auth (--insecure): anyone who reaches port %d may read, "
            "write and delete every stream",
            host,
            port,
        )
    broker = Broker(config)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, broker.stop)
        loop.add_signal_handler(signal.SIGHUP, broker.reload_tls)
        await broker.serve()

    try:
        try:
            import uvloop
        except ImportError:  # pragma: no cover
            asyncio.run(main())
        else:
            uvloop.run(main())
    except BrokerFailed:  # logged with its cause and traceback by the broker
        raise SystemExit(EXIT_FAILED) from None

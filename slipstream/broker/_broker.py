"""The broker process: data directory, recovery, the TCP server, background work, shutdown.

Data directory layout (docs/operations.md says the same):

    <data-dir>/LOCK                       flock'ed by the running broker; holds its pid
    <data-dir>/broker.json                format version and container count (fixed at creation)
    <data-dir>/broker-id                  the random part of the default --broker-id
    <data-dir>/meta.db                    the catalog (SQLite, WAL)
    <data-dir>/journal/<container>/*.journal   tier 1: group-committed journals
    <data-dir>/journal/<container>/synced.checkpoint   how much of the active file is synced
                                          (with --journal objects no journal/: the journals are
                                          objects <prefix>/journal/<container>/<file>/<start>)
    <data-dir>/chunks/<stream>/<segment>/<base offset>.chunk   tier 2: long-term chunks
    <data-dir>/chunk-cache/*.block        with --objects: the chunks' read cache (the chunks
                                          are objects <prefix>/<stream>/<segment>/<base offset>)
    <data-dir>/txns/*.journal             staged events of open (and committing) transactions
    <data-dir>/token-ed25519.pem, token-hs256.key   token signing keys (0600; with --auth)
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import secrets
import signal
import ssl
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING

import msgspec

from .._errors import (
    CorruptData,
    DataDirLocked,
    InvalidArgument,
    LeaseHeld,
    LeaseLost,
    SlipstreamError,
    StorageError,
)
from .._tls import ServerTls, client_context
from ..security import Action, TokenKeys
from ..storage import (
    FileJournal,
    Journal,
    LocalChunkStore,
    LongTermStore,
    MetaStore,
    ObjectChunkStore,
    SqliteMetaStore,
    ensure_dir,
    fsync_dir,
)
from ._audit_stream import ClusterAudit, audit_appender, open_audit_stream
from ._cluster import Cluster, Membership
from ._container import (
    FSYNC_MODES,
    JOURNAL_CHECKPOINT_SECONDS,
    JOURNAL_RESYNC,
    Container,
    ContainerConfig,
    batch_checks_out,
)
from ._controller import Controller
from ._faults import FAULT, SCALING_SPEEDUP, crash_point
from ._metrics import Metrics
from ._peers import Peers
from ._service import Service, load_producer_key
from ._session import ConnectionLimits
from ._transactions import Coordinator

if TYPE_CHECKING:
    from ..http import HttpServer
    from ..protocol import AuditHead
    from ._service import Caller
    from ._session import Session

log = logging.getLogger("slipstream.broker")

DATA_FORMAT = 1


#: how often the automatic scaler looks at the streams' rates (the rules' windows are 10 s
#: and more: a pass a second answers a step up within about a second of a rule firing)
SCALING_PASS_S = 1.0
#: how long a stopping broker waits for queued audit records to reach the audit stream
AUDIT_DRAIN_S = 5.0


class BrokerFailed(Exception):
    """The broker stopped because a background task (a container's group commit or mover,
    retention, transactions) failed; ``__cause__`` is that task's error. ``slipstream up``
    exits with status 70 on it, so a supervisor restarts the broker."""


#: how often a broker of a cluster reads the catalog's version for others' changes
CATALOG_REFRESH_S = 0.25


@dataclass(frozen=True)
class BrokerConfig:
    data_dir: Path = Path(".slipstream")
    host: str = "127.0.0.1"
    port: int = 7070
    containers: int = 4
    max_batch_bytes: int = 8 * 1024 * 1024
    retention_check_ms: int = 30_000
    container: ContainerConfig = field(default_factory=ContainerConfig)
    connection: ConnectionLimits = field(default_factory=ConnectionLimits)
    #: the admin HTTP API's port on ``host`` (slipstream/http); 0: any free one; None: none
    #: (``slipstream up`` defaults to 7071)
    http_port: int | None = None
    #: certificate files: the binary port and the HTTP API speak TLS (docs/security.md)
    tls: ServerTls | None = None
    #: the catalog on PostgreSQL (``up --meta postgresql://...``; storage/_meta_pg.py); None:
    #: SQLite in the data directory (meta.db)
    meta: str | None = None
    #: authentication on (``up --auth``): every connection and HTTP request presents a token
    #: or a client certificate (docs/security.md); the token keys are made on first start
    auth: bool = False

    #: chunks in an S3-compatible object store (``up --objects s3://bucket/prefix``;
    #: storage/_objects.py); None: files in the data directory (chunks/)
    objects: str | None = None
    #: the object store's endpoint (``up --s3-endpoint``); None: AWS_ENDPOINT_URL, else AWS
    s3_endpoint: str | None = None
    #: the bound of the object store's local read cache (<data-dir>/chunk-cache)
    objects_cache_bytes: int = 1024 * 1024 * 1024
    #: the holder's name of this broker's container leases (``up --broker-id``); None:
    #: host:port and a random suffix, new at each start
    broker_id: str | None = None
    #: how long a container's lease lasts unless renewed (every third of it; ``--lease-ttl``)
    lease_ttl_ms: int = 10_000
    #: where containers' journals live (``up --journal``): "files" in the data directory, or
    #: "objects" in the --objects store with their records in the catalog
    #: (storage/_journal_objects.py; needs --objects and fsync "always")
    journal: str = "files"
    #: the address other brokers and clients reach this broker at (``up --advertise``), in a
    #: cluster; None: host:port as bound
    advertise: str | None = None

    @property
    def clustered(self) -> bool:
        """Whether this broker joins a cluster (docs/cluster.md): journals, chunks and catalog
        are all shared, so no state lives only in its data directory."""
        return self.meta is not None and self.objects is not None and self.journal == "objects"


class _Layout(msgspec.Struct):
    format: int
    containers: int


class Broker:
    """A single-node broker. ``await broker.serve()`` runs until ``stop()`` (or a signal)."""

    def __init__(self, config: BrokerConfig) -> None:
        if config.container.fsync not in FSYNC_MODES:
            raise InvalidArgument(
                f"fsync must be one of {', '.join(FSYNC_MODES)}, not {config.container.fsync!r}"
            )
        if config.journal not in JOURNALS:
            raise InvalidArgument(
                f"journal must be one of {', '.join(JOURNALS)}, not {config.journal!r}"
            )
        if config.journal == "objects" and (
            config.objects is None or config.container.fsync != "always"
        ):
            raise InvalidArgument(
                "--journal objects needs --objects s3://... and fsync 'always' (an object "
                "journal acknowledges an append once its object is stored and recorded)"
            )
        if config.container.journal_group_ms is None:
            group_ms = OBJECT_JOURNAL_GROUP_MS if config.journal == "objects" else 0
            config = replace(config, container=replace(config.container, journal_group_ms=group_ms))
        self.config = config
        self.sessions: set[Session] = set()
        self._stop = asyncio.Event()
        self._accepted = asyncio.Event()  # set by the first connection accepted
        self._lock_file: IO[str] | None = None
        self.address: tuple[str, int] | None = None
        self.http_address: tuple[str, int] | None = None
        # one context per listener, for the broker's life: reload_tls() refreshes them in place
        self.tls: ssl.SSLContext | None = None
        self.http_tls: ssl.SSLContext | None = None
        if config.tls is not None:
            self.tls = config.tls.context()
            self.http_tls = config.tls.context(require_client_cert=False)
        self.recovery: dict[str, int] = {}  # what open() recovered, for the admin API
        self.metrics = Metrics(self)  # served at /metrics by the admin HTTP server
        #: the holder's name of this broker's container leases in the catalog (set by open())
        self.broker_id = config.broker_id or ""
        #: in a cluster, the loop that keeps this broker's share of containers (set by serve)
        self.membership: Membership | None = None
        #: in a cluster, this broker's audit chain and the audit stream's appends (set by serve)
        self.cluster_audit: ClusterAudit | None = None

    def _lock(self, data_dir: Path) -> None:
        lock = open(data_dir / "LOCK", "a+")  # noqa: SIM115 - held for the broker's life
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "unknown"
            lock.close()
            raise DataDirLocked(
                f"another broker (pid {holder}) is already using {data_dir}; stop it or pass a "
                "different --data-dir",
                data_dir=str(data_dir),
                pid=holder,
            ) from None
        lock.seek(0)
        lock.truncate()
        lock.write(str(os.getpid()))
        lock.flush()
        self._lock_file = lock

    def _layout(self, data_dir: Path) -> _Layout:
        """The data directory's fixed layout: read, or written durably on first start (in any
        fsync mode: the container count must never change under existing data)."""
        path = data_dir / "broker.json"
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raw = None
        if raw is None:
            if (data_dir / "journal").exists():  # created after broker.json, never before
                raise CorruptData(
                    f"{path} is missing but {data_dir} holds a broker's data; "
                    + _layout_fix(path, data_dir),
                    file=str(path),
                )
            layout = _Layout(DATA_FORMAT, self.config.containers)
            tmp = path.with_suffix(".tmp")
            with open(tmp, "wb") as f:
                f.write(msgspec.json.encode(layout))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            fsync_dir(data_dir)  # the name too: a power failure could otherwise empty it
            return layout
        try:
            layout = msgspec.json.decode(raw, type=_Layout)
        except msgspec.DecodeError as exc:
            what = "empty" if not raw.strip() else f"damaged ({exc})"
            raise CorruptData(
                f"{path} is {what}; " + _layout_fix(path, data_dir), file=str(path)
            ) from None
        if layout.containers != self.config.containers:
            log.warning(
                "%s was created with %d containers; keeping them (ignoring %d)",
                data_dir,
                layout.containers,
                self.config.containers,
            )
        if layout.format != DATA_FORMAT:
            raise InvalidArgument(
                f"{data_dir} has data format {layout.format}; this build reads {DATA_FORMAT}"
            )
        return layout

    def _object_journals(self, containers: int) -> list[Journal]:
        """Object journals in the --objects store (refused over a data directory whose file
        journals still hold entries: those would be forgotten)."""
        from ..storage._journal_objects import ObjectJournal

        files = self.config.data_dir / "journal"
        if files.exists() and any(p.stat().st_size for p in files.rglob("*.journal")):
            raise InvalidArgument(
                f"{files} holds journal files: this broker ran with --journal files, and its "
                "acknowledged appends not yet in chunks are there. Start it with --journal files"
            )
        return [
            ObjectJournal(self.long_term, self.meta, cid, fault=_journal_crash_point)
            for cid in range(containers)
        ]

    def open(self) -> dict[str, int]:
        """Lock the data directory and recover everything in it; returns what was recovered.

        Every file and directory the broker creates is made durable with its name (fsync of
        the file, then of its directory) before anything that depends on it is acknowledged.
        Raises CorruptData, naming the file and the fix, if ``broker.json`` or the catalog
        (``meta.db``) is missing or empty under existing data, instead of starting on half a
        data directory.
        """
        data_dir = self.config.data_dir
        if self.config.objects is not None:  # a bad bucket fails here, with the data dir untouched
            _object_chunks(self.config, cache=False).check_writable()
        ensure_dir(data_dir)
        self._lock(data_dir)
        layout = self._layout(data_dir)
        if not self.config.broker_id:
            self.broker_id = _default_broker_id(self.config, data_dir)
        do_sync = self.config.container.fsync != "never"
        catalog = data_dir / "meta.db"
        if self.config.meta is None and (data_dir / "journal").exists() and not catalog.exists():
            raise CorruptData(
                f"{catalog}, the catalog, is missing but {data_dir} holds journals: starting "
                "would forget every stream. Restore the data directory from a backup (or move "
                "it away to start empty)",
                file=str(catalog),
            )
        self.meta: MetaStore = (
            SqliteMetaStore(catalog)
            if self.config.meta is None
            else _postgres_catalog(self.config.meta, catalog)
        )
        self.long_term: LongTermStore = (
            LocalChunkStore(data_dir / "chunks", fsync=do_sync)
            if self.config.objects is None
            else _object_chunks(self.config, cache=True)
        )
        self.read_pool = ThreadPoolExecutor(4, thread_name_prefix="reader")
        clustered = self.config.clustered
        if clustered:  # the cluster's count, fixed by its first broker, wins
            containers = self.meta.shared_secret(
                "containers", lambda: str(layout.containers).encode()
            )
            if int(containers) != layout.containers:
                log.info("the cluster has %s containers (not %d)", containers, layout.containers)
                layout = _Layout(layout.format, int(containers))
        self.journals: list[Journal] = (
            self._object_journals(layout.containers)
            if self.config.journal == "objects"
            else [
                FileJournal(
                    data_dir / "journal" / str(cid),
                    fsync=do_sync,
                    check=batch_checks_out,
                    resync=JOURNAL_RESYNC,
                    checkpoint_seconds=JOURNAL_CHECKPOINT_SECONDS,
                )
                for cid in range(layout.containers)
            ]
        )
        if self.config.journal == "files" and any(
            self.meta.journal_objects(cid) for cid in range(layout.containers)
        ):
            raise InvalidArgument(
                "the catalog lists journal objects: this broker ran with --journal objects, and "
                "its acknowledged appends not yet in chunks are there. Start it with --journal "
                "objects"
            )
        self.containers = [
            Container(
                cid, journal, self.long_term, self.meta, self.read_pool, self.config.container
            )
            for cid, journal in enumerate(self.journals)
        ]
        self.cluster = Cluster(self.broker_id, len(self.containers), enabled=clustered)
        if clustered:  # containers are taken by the membership loop, once serving
            for container in self.containers:
                container.serving = False
        else:
            self._take_leases()
        self.controller = Controller(self.meta, self.long_term, self.containers, self.read_pool)
        self.coordinator = Coordinator(
            data_dir,
            self.meta,
            self.controller,
            fsync=do_sync,
            shared=self.long_term if clustered else None,  # staging in the object store
        )
        # the names of meta.db (SQLite syncs its WAL's name, not the database's) and of the
        # directories above, also where an older build created them without syncing
        if self.config.journal == "files":
            fsync_dir(data_dir / "journal")
        fsync_dir(data_dir)
        self.service = Service(
            self.controller,
            self.coordinator,
            self.containers,
            max_batch_bytes=self.config.max_batch_bytes,
            producer_key=(
                self.meta.shared_secret("producer-key", lambda: secrets.token_bytes(32))
                if clustered  # a producer id granted by one broker is claimed on any
                else load_producer_key(data_dir, fsync=do_sync)
            ),
            token_keys=self._token_keys(data_dir, do_sync) if self.config.auth else None,
        )
        self.service.cluster = self.cluster
        self.service.peers = Peers(self.cluster, self._peer_credentials)
        self.service.refresh_catalog = self.refresh_catalog  # type: ignore[method-assign]
        self.coordinator.peers = self.service.peers  # a transaction's batches for others
        self.metrics.attach(self)
        started = time.monotonic()
        totals = self.controller.recover(journals=not clustered)
        totals.update(self.coordinator.recover())
        totals["subscriptions"] = self.service.subscriptions.recover()
        totals["cut_bytes"] = sum(j.report.cut_bytes for j in self.journals)
        totals["damaged_bytes"] = sum(
            d.end - d.start for j in self.journals for d in j.report.damaged
        )
        totals["ms"] = int((time.monotonic() - started) * 1000)
        # again after recovery, which may have outlasted the ttl: a new epoch, a fresh
        # deadline, before any background task writes with them (LeaseHeld if another broker
        # took a container meanwhile)
        if not clustered:
            self._take_leases()
        for journal in self.journals:
            if journal.report.cut_reason:
                log.warning(
                    "recovery cut a torn or corrupt journal tail: %s", journal.report.cut_reason
                )
        log.info(
            "recovered %(streams)d streams, %(batches)d journal batches in %(ms)d ms "
            "(%(cut_bytes)d torn bytes cut, %(damaged_bytes)d damaged bytes skipped; "
            "%(skipped)d entries skipped: deleted streams, or logged above); "
            "%(identities)d transactional ids, %(commits)d commits to finish, "
            "%(subscriptions)d subscriptions",
            totals,
        )
        return totals

    async def serve(self, ready: Callable[[tuple[str, int]], None] | None = None) -> None:
        """Recover, listen, and run until ``stop()``; then close connections and sync.

        If a background task (a container's, retention, transactions) ends by itself, the broker
        stops the same way and then raises BrokerFailed from that task's error."""
        self.recovery = self.open()
        loop = asyncio.get_running_loop()
        from ..http import start_http
        from ._session import Session

        membership = Membership(self) if self.config.clustered else None
        background = [
            loop.create_task(self.run_container(c), name=f"container {c.id}")
            for c in self.containers
            if membership is None
        ]
        server: asyncio.Server | None = None
        http: HttpServer | None = None
        failed: asyncio.Task[None] | None = None
        clean = False
        try:
            # commits a crash interrupted are finished before anyone can read
            await self.coordinator.apply_pending()
            # the audit stream and its chain's head, before any request can be audited; in
            # a cluster each broker's own chain, through the broker serving the stream (its
            # head is read in the background: records wait until then; docs/cluster.md)
            if self.config.clustered:
                self.cluster_audit = ClusterAudit(self)
                background.append(loop.create_task(self.cluster_audit.run(), name="audit"))
            else:
                audit_stream = await open_audit_stream(self.controller, self.service.audit)
                background.append(
                    loop.create_task(
                        self.service.audit.run(audit_appender(self.controller, audit_stream)),
                        name="audit",
                    )
                )
            # the admin API (None without an http_port), first: a port in use fails the start
            http = await start_http(self)
            if http is not None:
                self.http_address = http.address
                background.append(http.task)
            try:
                server = await loop.create_server(
                    self._protocol_factory(Session),
                    self.config.host,
                    self.config.port,
                    reuse_address=True,
                    backlog=1024,
                    start_serving=membership is None,  # in a cluster: once it serves its share
                )
            except OSError as exc:
                raise InvalidArgument(
                    f"cannot listen on {self.config.host}:{self.config.port} ({exc.strerror}); "
                    "is another broker running? Pass a different --port",
                    host=self.config.host,
                    port=self.config.port,
                ) from exc
            sockname = server.sockets[0].getsockname()
            self.address = (sockname[0], sockname[1])
            self.cluster.address = self.config.advertise or f"{sockname[0]}:{sockname[1]}"
            if self.http_address is not None:
                self.cluster.http_address = f"{self.http_address[0]}:{self.http_address[1]}"
            if membership is not None:  # joins, and takes its share, before it says ready
                await membership.turn()
                await membership.settled()
                await server.start_serving()
                background.append(loop.create_task(membership.run(), name="cluster"))
                background.append(loop.create_task(self._refresh_loop(), name="catalog refresh"))
                self.membership = membership
            log.info(
                "listening on %s:%d (data in %s, fsync=%s)",
                *self.address,
                self.config.data_dir,
                self.config.container.fsync,
            )
            if ready is not None:
                ready(self.address)
            background.append(loop.create_task(self._retention_loop(), name="retention"))
            if membership is None:
                background.append(loop.create_task(self._lease_loop(), name="leases"))
            background.append(loop.create_task(self.coordinator.run(), name="transactions"))
            background.append(
                loop.create_task(self.service.subscriptions.run(), name="group sessions")
            )
            background.append(loop.create_task(self._scaling_loop(), name="scaling"))
            background.append(
                loop.create_task(self.service.subscriptions.queues.run(), name="queue timers")
            )
            stopped = loop.create_task(self._stop.wait())
            done, _ = await asyncio.wait([stopped, *background], return_when="FIRST_COMPLETED")
            # a background loop that ends, by an error or not, stops the broker: never limp on
            failed = next((task for task in background if task in done), None)
            stopped.cancel()
            self._stop.set()  # also when a background task ended it: sessions cancel requests
            server.close()
            if http is not None:
                await http.stop()  # requests in flight end while the service is still up
            for session in list(self.sessions):
                if session.transport is not None:
                    session.transport.close()
            if failed is None:  # the last records into the audit stream (all in the log),
                # before a cluster's broker hands the stream's container over
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.service.audit.drained(), AUDIT_DRAIN_S)
            if membership is not None and failed is None:  # the others take over at once
                await membership.leave()
            clean = failed is None
        finally:
            if failed is None and not clean:  # one that died before the broker listened
                failed = next((t for t in background if t.done() and _failure(t)), None)
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            if server is not None:
                await server.wait_closed()
            await self._close()
            if clean:
                log.info("stopped cleanly")
            elif failed is not None:
                log.error(
                    "stopped because background task %r failed: %s",
                    failed.get_name(),
                    _failure(failed),
                    exc_info=_failure(failed),
                )
            else:
                log.error("stopped by an error while starting or stopping (see below)")
        if failed is not None:
            raise BrokerFailed(
                f"background task {failed.get_name()!r} failed: {_failure(failed)}"
            ) from _failure(failed)

    def _protocol_factory(self, session: type[Session]) -> Callable[[], asyncio.BaseProtocol]:
        """Sessions; with TLS each behind a TlsGate (it refuses plaintext clients clearly)."""
        from ._tls_gate import TlsGate

        tls = self.tls
        if tls is None:
            return lambda: self._accept(session)
        return lambda: TlsGate(tls, lambda: self._accept(session), self._tls_refused)

    async def append_audit(self, caller: Caller, broker_id: str, records: list[bytes]) -> AuditHead:
        """``AppendAudit`` from another broker of the cluster (``ClusterAudit.accept``);
        PermissionDenied unless the caller is an admin; InvalidArgument on a standalone
        broker."""
        self.service._authorize(caller, Action.ADMIN, None)
        if self.cluster_audit is None:
            raise InvalidArgument("AppendAudit is sent between the brokers of a cluster")
        return await self.cluster_audit.accept(caller, broker_id, records)

    def _tls_refused(self, peer: str, reason: str) -> None:
        """A connection the TLS gate or handshake turned away, audited."""
        self.service.audit.record("connection_refused", subject=None, peer=peer, reason=reason)

    def _accept(self, session: type[Session]) -> Session:
        self._accepted.set()
        return session(self)

    def _peer_credentials(self) -> tuple[ssl.SSLContext | None, str | None]:
        """How this broker connects to the others of its cluster: TLS with its own
        certificate as the client certificate, trusting --tls-client-ca (the cluster's CA;
        else the system's), and with --auth a short-lived admin token of its own signed with
        the cluster's keys (docs/cluster.md, "Security")."""
        tls = self.config.tls
        context = None if tls is None else client_context(tls.client_ca, tls.cert, tls.key)
        keys = self.service.token_keys
        token = None
        if keys is not None:
            token = keys.issue(f"broker:{self.broker_id}", "admin", expires_s=3600).token
        return context, token

    def _token_keys(self, data_dir: Path, do_sync: bool) -> TokenKeys:
        """The data directory's signing keys; a cluster's, shared through the catalog."""
        if self.config.clustered:
            return TokenKeys.shared(self.meta.shared_secret, data_dir, fsync=do_sync)
        return TokenKeys.load(data_dir, fsync=do_sync)

    async def refresh_catalog(self) -> bool:
        """In a cluster: take in what other brokers changed in the catalog (streams, scales,
        retention, subscriptions, rules, tokens, quotas); True if it had changed."""
        changed = await self.controller.refresh()
        if changed:
            await self.service.reload_settings()
        return changed

    async def _refresh_loop(self) -> None:
        """In a cluster, every CATALOG_REFRESH_S: ``refresh_catalog``. A failed read (the
        catalog unreachable) is logged and tried again."""
        while True:
            await asyncio.sleep(CATALOG_REFRESH_S)
            try:
                await self.refresh_catalog()
            except (SlipstreamError, OSError) as exc:
                log.warning("catalog refresh failed, retrying: %s", exc)

    def new_container(self, cid: int) -> Container:
        """A fresh container ``cid`` on its object journal (a cluster's takeover)."""
        from ..storage._journal_objects import ObjectJournal

        journal = ObjectJournal(self.long_term, self.meta, cid, fault=_journal_crash_point)
        self.journals[cid] = journal
        return Container(
            cid, journal, self.long_term, self.meta, self.read_pool, self.config.container
        )

    async def run_container(self, container: Container) -> None:
        # fault injection: once the broker serves (a crash, not a failed start)
        if FAULT == "broker.container_dies" and container.id == 0:
            await self._accepted.wait()
            raise RuntimeError("fault injection: SLIPSTREAM_FAULT=broker.container_dies")
        await container.run()

    async def _close(self) -> None:
        self.service.peers.close()
        await self.service.seals.close()
        await self.coordinator.close()
        for container in self.containers:
            if container.serving or not self.config.clustered:  # others: handed over
                await container.close()
        self.read_pool.shutdown(wait=True)
        self.controller.close()  # queued catalog writes finish before the catalog closes
        self._release_leases()
        self.meta.close()
        if self._lock_file is not None:
            self._lock_file.close()

    # --- leases (docs/operations.md, "Leases and fencing") ----------------------------------

    def _take_leases(self) -> None:
        """Lease every container before recovery writes anything. On an embedded catalog
        (SQLite) the data directory's lock already excludes every other broker: its leases are
        taken over from whoever held them (a broker killed before it released them). On
        PostgreSQL a container another broker holds is LeaseHeld, naming it, and the broker
        does not start (one broker per catalog until clients route between brokers)."""
        config = self.config
        ttl = config.lease_ttl_ms
        for container in self.containers:
            asked = time.monotonic()
            lease = self.meta.acquire_lease(
                container.id, self.broker_id, ttl, take_over=config.meta is None
            )
            if lease is None:
                self._release_leases()
                holder = next(x for x in self.meta.leases() if x.container == container.id)
                self.meta.close()
                expires = time.strftime("%H:%M:%S", time.gmtime(holder.expires_ms / 1000))
                raise LeaseHeld(
                    f"container {container.id} is leased to broker {holder.owner!r} until "
                    f"{expires}.{holder.expires_ms % 1000:03d} UTC by the catalog's clock, "
                    "unless it renews: another broker is running on this catalog. Stop it, or "
                    "wait for its lease to expire (one broker per catalog until brokers route "
                    "clients to each other)",
                    container=container.id,
                    holder=holder.owner,
                    expires_ms=holder.expires_ms,
                )
            container.hold(lease, asked + ttl / 1000)
        log.info(
            "leased containers 0-%d as broker %r (epochs %s, ttl %d ms)",
            len(self.containers) - 1,
            self.broker_id,
            ",".join(str(c.lease.epoch) for c in self.containers if c.lease is not None),
            ttl,
        )

    async def _lease_loop(self) -> None:
        """Renew the containers' leases every third of their ttl. A renewal refused
        (LeaseLost: expired, or another broker took the container) stops the container's
        appends for good; one that fails otherwise (PostgreSQL unreachable) is tried again at
        the next turn, and the container stops acknowledging when its lease, as last renewed,
        expires (``Container.lease_error``)."""
        loop = asyncio.get_running_loop()
        ttl = self.config.lease_ttl_ms
        # a thread of its own: renewals never queue behind other work of the default executor
        renewer = ThreadPoolExecutor(1, thread_name_prefix="leases")
        try:
            while True:
                await self._renew_leases(loop, renewer, ttl)
                await asyncio.sleep(ttl / 3000)
        finally:
            renewer.shutdown(wait=False)

    async def _renew_leases(
        self, loop: asyncio.AbstractEventLoop, renewer: ThreadPoolExecutor, ttl: int
    ) -> None:
        for container in self.containers:
            lease = container.lease
            if lease is None or container.lease_lost is not None:
                continue
            asked = time.monotonic()  # the catalog's expiry is at least this + ttl
            try:
                renewed = await loop.run_in_executor(renewer, self.meta.renew_lease, lease, ttl)
            except LeaseLost as exc:
                container.lose(str(exc))
            except SlipstreamError as exc:
                log.warning(
                    "container %d: its lease could not be renewed (%s); appends to it stop "
                    "in %.1f s, when it expires, unless a renewal gets through before",
                    container.id,
                    exc,
                    max(0.0, container.lease_deadline - time.monotonic()),
                )
            else:
                container.hold(renewed, asked + ttl / 1000)

    def _release_leases(self) -> None:
        """Give the containers up at a clean stop, so that another broker (or this one
        restarted) takes them at once instead of after the ttl."""
        for container in self.containers:
            if container.lease is not None and container.lease_lost is None:
                try:
                    self.meta.release_lease(container.lease)
                except SlipstreamError as exc:  # it expires by itself
                    log.warning("container %d: lease not released: %s", container.id, exc)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def reload_tls(self) -> None:
        """Load the certificate files again (SIGHUP): new connections get the new certificate,
        open ones keep theirs. A file that cannot be loaded is logged and the old one kept."""
        if self.config.tls is None:
            return
        try:
            for ctx in (self.tls, self.http_tls):
                if ctx is not None:
                    self.config.tls.reload(ctx)
        except SlipstreamError as exc:
            log.error("TLS certificates not reloaded, the old ones stay in use: %s", exc)
        else:
            log.info("TLS certificates reloaded from %s", self.config.tls.cert)

    def stop(self) -> None:
        self._stop.set()

    async def _scaling_loop(self) -> None:
        """Automatic scaling: a pass over the streams with a policy every second (on the
        scaling clock: SLIPSTREAM_SCALING_SPEEDUP, see _faults.py, makes it run faster)."""
        if SCALING_SPEEDUP != 1:
            log.warning(
                "SLIPSTREAM_SCALING_SPEEDUP=%g: automatic scaling runs %g times faster than "
                "real time (for tests and demos only)",
                SCALING_SPEEDUP,
                SCALING_SPEEDUP,
            )
        while True:
            await asyncio.sleep(SCALING_PASS_S / SCALING_SPEEDUP)
            try:
                await self.controller.autoscale(
                    self.coordinator.touching,
                    self.service.is_served if self.config.clustered else None,
                    self.service.peer_seals if self.config.clustered else None,
                )
            except Exception:  # a failed pass (a full disk) is retried, never fatal
                log.exception("scaling pass failed; will retry")

    async def _retention_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.retention_check_ms / 1000)
            try:
                await self.controller.enforce_retention(
                    served=self.service.is_served if self.config.clustered else None
                )
            except Exception:
                log.exception("retention pass failed; will retry")


def _layout_fix(path: Path, data_dir: Path) -> str:
    """How to repair a lost ``broker.json``: it holds only the format and the container count,
    which the journal directory shows."""
    journals = data_dir / "journal"
    containers = sum(1 for p in journals.iterdir() if p.name.isdigit()) if journals.is_dir() else 0
    if not containers:
        return "restore the data directory from a backup (or move it away to start empty)"
    return (
        f"it records the data format and the container count, and {journals} holds "
        f"{containers} containers: if nothing else is damaged, recreate it with "
        f"""echo '{{"format": {DATA_FORMAT}, "containers": {containers}}}' > {path}"""
        ", else restore the data directory from a backup"
    )


def _failure(task: asyncio.Task[None]) -> BaseException | None:
    """Why a background task ended by itself: its error, or one saying it returned."""
    if task.cancelled():
        return None
    return task.exception() or RuntimeError(f"{task.get_name()} returned, it should run forever")


def _journal_crash_point(op: str) -> None:
    """An object journal's fault hook: ``SLIPSTREAM_FAULT=journal.before_record`` kills the
    broker between a group's upload and its record (an orphaned object);
    ``journal.pause_before_record`` stops it there (SIGSTOP, once) when the file named by
    ``SLIPSTREAM_FAULT_ARM`` exists (removed first), for a test to take its leases over."""
    arm, point = os.environ.get("SLIPSTREAM_FAULT_ARM"), f"journal.pause_before_{op}"
    if arm and point == FAULT:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(arm)
            log.warning("fault injection: pausing the broker at %s", point)
            os.kill(os.getpid(), signal.SIGSTOP)
    crash_point(f"journal.before_{op}")


#: an object journal's default group commit window (``ContainerConfig.journal_group_ms``)
OBJECT_JOURNAL_GROUP_MS = 50
JOURNALS = ("files", "objects")


def _object_chunks(config: BrokerConfig, *, cache: bool) -> ObjectChunkStore:
    """The chunk store in ``config.objects`` (it imports obstore, the ``s3`` extra, itself);
    ``cache``: with its read cache in <data-dir>/chunk-cache (emptied now)."""
    assert config.objects is not None
    return ObjectChunkStore(
        config.objects,
        endpoint=config.s3_endpoint,
        cache_dir=config.data_dir / "chunk-cache" if cache else None,
        cache_bytes=config.objects_cache_bytes if cache else 0,
    )


def _default_broker_id(config: BrokerConfig, data_dir: Path) -> str:
    """host:port and a random suffix made once per data directory (``broker-id``): a broker
    restarted on its data directory (whose lock proves its predecessor dead) is the same
    holder and takes its leases back at once, any other waits for them to expire."""
    path = data_dir / "broker-id"
    try:
        suffix = path.read_text().strip()
    except FileNotFoundError:
        suffix = ""
    if not suffix:
        suffix = secrets.token_hex(4)
        with open(path, "w") as file:
            file.write(suffix + "\n")
            file.flush()
            os.fsync(file.fileno())
        fsync_dir(data_dir)
    return f"{config.host}:{config.port}-{suffix}"


def _postgres_catalog(dsn: str, sqlite_catalog: Path) -> MetaStore:
    """The catalog on PostgreSQL (psycopg is imported only here: the ``postgres`` extra).
    Refused where the data directory has a SQLite catalog: its streams would be forgotten."""
    if sqlite_catalog.exists():
        raise InvalidArgument(
            f"{sqlite_catalog.parent} has a catalog of its own ({sqlite_catalog}, SQLite): with "
            "--meta it would be ignored and every stream in it forgotten. Start without --meta, "
            "or with --meta and a new --data-dir"
        )
    try:
        from ..storage._meta_pg import PostgresMetaStore
    except ImportError as exc:
        raise StorageError(
            f"--meta needs psycopg, which is not installed ({exc}): "
            "pip install 'slipstream[postgres]'"
        ) from None
    return PostgresMetaStore(dsn)

"""The torture run: a real broker, client processes that write everything down, random faults,
then one verifying read and the checker.

The harness owns every process it starts and ends each by its id. Faults, drawn from a seeded
RNG (the same seed draws the same faults at the same moments; what the processes do in
between differs run to run):

``kill``   kill -9 of the broker, then a restart on the same data directory and port.
``stop``   SIGSTOP of the broker for longer than the clients' request timeout, then SIGCONT:
           clients give up on their connections while the broker still holds their requests.
``cut``    every client connection reset by the proxy (RST), the broker unharmed.
``delay``  the proxy holds every byte back (tens of ms to longer than the request timeout).
``disk``   the data directory's filesystem (an ext4 image the harness loop-mounts; root only)
           filled to the last block for a few seconds, then freed.
``flip``   kill -9, one byte flipped in a chunk or a sealed journal file, restart: the broker
           must report CorruptData for the damaged batch and never serve it.
``power``  kill -9 and a power failure of the data directory's filesystem (PowerFS: every
           write not made durable is lost), then a restart. Needs FUSE.

Any two faults of different kinds may overlap (one broker-process fault at a time: kill, stop,
flip, power). At the end every fault is healed, the clients stop, the broker is killed (and
its power failed, with ``power``) a last time and restarted, and a verifying reader reads the
whole stream. Then the broker is stopped with SIGTERM and must exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

import slipstream

from ..format import decode_header
from ..storage._journal import Parsed, parse_entry
from ._checker import Report, check_directory
from ._proxy import TorturingProxy
from ._records import REQUEST_TIMEOUT, Ack, Read, TxnBegin, TxnEnd

_GLOBAL_ID = struct.Struct("<Q")  # a journal entry's payload starts with the segment's id
FAULTS = ("kill", "stop", "cut", "delay", "disk", "flip", "power")
PROCESS_FAULTS = {"kill", "stop", "flip", "power"}
STREAM = "torture/events"
SEGMENTS = 4


@dataclass
class Options:
    """What ``python -m slipstream.torture`` was asked to do (see its ``--help``)."""

    duration: float = 60.0
    faults: list[str] = field(default_factory=lambda: list(FAULTS))
    seed: int = 0
    work_dir: Path | None = None
    data_dir: Path | None = None
    keep: bool = False
    fsync: str = "always"
    producers: int = 1  # of each kind: plain, idempotent, transactional
    readers: int = 2  # tail followers; one history reader besides
    broker_command: list[str] = field(default_factory=lambda: [sys.executable, "-m", "slipstream"])
    disk_mib: int = 1024
    pause: float = 0.05  # longest rest of a producer between rounds


class Outcome(msgspec.Struct, kw_only=True):
    """A run's result: the checker's report plus what the harness did and saw."""

    ok: bool
    seed: int
    duration_s: float
    faults: dict[str, int]
    unavailable: dict[str, str]
    anomalies: dict[str, int]
    examples: dict[str, list[str]]
    counts: dict[str, int]
    harness_errors: list[str]
    work_dir: str
    timeline: list[str]

    def text(self) -> str:
        report = Report(
            ok=self.ok, anomalies=self.anomalies, examples=self.examples, counts=self.counts
        )
        lines = [
            f"seed {self.seed}, {self.duration_s:.0f} s of faults: "
            + (", ".join(f"{k} {v}" for k, v in self.faults.items()) or "none"),
        ]
        lines += [f"  unavailable: {k}: {v}" for k, v in self.unavailable.items()]
        lines += [f"  HARNESS ERROR: {e}" for e in self.harness_errors]
        lines.append(report.text())
        lines.append(f"records and logs: {self.work_dir}")
        return "\n".join(lines)


class Status(msgspec.Struct):
    """What the progress display shows, every half second."""

    elapsed: float
    duration: float
    faults: dict[str, int]
    active: list[str]
    acked: int
    read: int
    acked_rate: float
    read_rate: float
    phase: str


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class BrokerDown(RuntimeError):
    """The broker did not come back after a fault (it exited, or never listened): an anomaly
    of the broker, not of the harness."""


class BrokerProcess:
    """The broker under test, started like a user would: ``<command> up --data-dir ...``."""

    def __init__(self, command: list[str], data_dir: Path, log: Path, fsync: str) -> None:
        self.command = command
        self.data_dir = data_dir
        self.log_path = log
        self.fsync = fsync
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    async def start(self, timeout: float = 60.0) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    *self.command,
                    "up",
                    "--data-dir",
                    str(self.data_dir),
                    "--port",
                    str(self.port),
                    "--http-port",
                    "0",
                    "--fsync",
                    self.fsync,
                    "--roll",
                    "1MiB",
                    "--roll-seconds",
                    "2",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.starts += 1
        failure = RuntimeError if self.starts == 1 else BrokerDown
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise failure(
                    f"the broker exited with {self.proc.returncode} on start:\n{self.log_tail()}"
                )
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", self.port)
                writer.close()
                return
            except OSError:
                await asyncio.sleep(0.05)
        raise failure(f"the broker did not listen within {timeout:g} s:\n{self.log_tail()}")

    def log_tail(self, size: int = 3000) -> str:
        if not self.log_path.exists():
            return ""
        return self.log_path.read_bytes()[-size:].decode(errors="replace")

    def signal(self, number: signal.Signals) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(number)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a stopped process dies only once resumed
            self.proc.kill()
            self.proc.wait(30)

    def terminate(self) -> int | None:
        """SIGTERM and wait for a clean exit; the exit code (None: had to be killed)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
                return None
        return self.proc.returncode


class _Storage:
    """Where the data directory lives: a plain directory, a loop-mounted ext4 image (for
    ``disk``), a PowerFS mount (for ``power``), or PowerFS over the image."""

    def __init__(self, work: Path, options: Options, unavailable: dict[str, str]) -> None:
        self.work = work
        self.mounts: list[Path] = []
        self.disk: Path | None = None
        self.power: Any = None  # a PowerFS
        base = work
        if "disk" in options.faults:
            reason = self._mount_disk(options.disk_mib) if options.data_dir is None else None
            if options.data_dir is not None:
                reason = "--data-dir was given: the harness must mount the data directory's disk"
            if reason:
                unavailable["disk"] = reason
            else:
                base = self.disk = work / "disk"
        if "power" in options.faults:
            reason = self._mount_power(base, options.seed) if options.data_dir is None else None
            if options.data_dir is not None:
                reason = "--data-dir was given: the harness must mount the data directory"
            if reason:
                unavailable["power"] = reason
            else:
                base = work / "power"
        self.data_dir = options.data_dir or base / "data"

    def _mount_disk(self, size_mib: int) -> str | None:
        if os.geteuid() != 0:
            return "needs root (to loop-mount a small ext4 image)"
        if shutil.which("mkfs.ext4") is None or shutil.which("mount") is None:
            return "needs mkfs.ext4 and mount"
        image, mountpoint = self.work / "disk.img", self.work / "disk"
        mountpoint.mkdir()
        with open(image, "wb") as f:
            f.truncate(size_mib * 1024 * 1024)
        for command in (
            ["mkfs.ext4", "-q", "-F", str(image)],
            ["mount", "-o", "loop", str(image), str(mountpoint)],
        ):
            done = subprocess.run(command, capture_output=True, check=False)
            if done.returncode != 0:
                return f"{command[0]} failed: {done.stderr.decode(errors='replace').strip()}"
        self.mounts.append(mountpoint)
        return None

    def _mount_power(self, base: Path, seed: int) -> str | None:
        try:
            from . import _powerfs
        except ImportError as exc:
            return f"PowerFS is not available in this build: {exc}"
        reason = _powerfs.fuse_unusable()
        if reason:
            return reason
        self.power = _powerfs.PowerFS(base / "backing", self.work / "power", seed=seed)
        try:
            self.power.mount()
        except RuntimeError as exc:
            self.power = None
            return f"PowerFS did not mount: {exc}"
        return None

    def close(self) -> None:
        if self.power is not None:
            with contextlib.suppress(Exception):
                self.power.unmount()
        for mountpoint in reversed(self.mounts):
            subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True, check=False)


class _Rates:
    """Counts acknowledged and read events by reading the record files as they grow."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.offsets: dict[Path, int] = {}
        self.acked = 0
        self.read = 0
        self.txn_sizes: dict[tuple[int, int], int] = {}  # transactions begun, not ended
        self.history: list[tuple[float, int, int]] = []

    def update(self) -> tuple[float, float]:
        for path in self.directory.glob("*.jsonl"):
            start = self.offsets.get(path, 0)
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read()
            end = data.rfind(b"\n") + 1
            self.offsets[path] = start + end
            for line in data[:end].splitlines():
                if b'"r":"ack"' in line or b'"r":"read"' in line or b'"r":"txn' in line:
                    record = msgspec.json.decode(line, type=Ack | Read | TxnBegin | TxnEnd)
                    if isinstance(record, Ack):
                        self.acked += sum(1 for p in record.pos if p is not None)
                    elif isinstance(record, Read):
                        self.read += len(record.ids)
                    elif isinstance(record, TxnBegin):
                        self.txn_sizes[(record.w, record.txn)] = record.n
                    else:
                        size = self.txn_sizes.pop((record.w, record.txn), 0)
                        if record.outcome == "committed":
                            self.acked += size
        now = time.monotonic()
        self.history.append((now, self.acked, self.read))
        self.history = [h for h in self.history if now - h[0] <= 5]
        then, acked, read = self.history[0]
        span = max(now - then, 1e-3)
        return (self.acked - acked) / span, (self.read - read) / span


class Run:
    def __init__(self, options: Options, progress: Callable[[Status], None] | None) -> None:
        self.options = options
        self.progress = progress
        self.rng = random.Random(options.seed)
        self.faults: dict[str, int] = {}
        self.unavailable: dict[str, str] = {}
        self.errors: list[str] = []
        self.broker_down: list[str] = []  # why the broker did not come back after a fault
        self.active: list[str] = []
        self.timeline: list[str] = []  # "<seconds into the run> s <fault>", in order
        self.flips = 0
        self.flipped: list[tuple[int, int, int] | None] = []  # the batch each flip hit, if known
        self.process_lock = asyncio.Lock()
        self.workers: list[subprocess.Popen[bytes]] = []
        self.started = time.monotonic()
        self.phase = "starting"

    async def run(self) -> Outcome:
        options = self.options
        unknown = [f for f in options.faults if f not in FAULTS]
        if unknown:
            raise ValueError(f"unknown faults {unknown}: choose from {', '.join(FAULTS)}")
        if (
            options.data_dir is not None
            and options.data_dir.exists()
            and any(options.data_dir.iterdir())
        ):
            raise ValueError(f"--data-dir {options.data_dir} is not empty: give a new one")
        work = options.work_dir or Path(tempfile.mkdtemp(prefix="slipstream-torture-"))
        work.mkdir(parents=True, exist_ok=True)
        self.work = work
        self.records = work / "records"
        self.records.mkdir(exist_ok=True)
        self.stop_file = work / "stop"
        self.stop_file.unlink(missing_ok=True)
        self.rates = _Rates(self.records)
        self.storage = _Storage(work, options, self.unavailable)
        self.broker = BrokerProcess(
            options.broker_command, self.storage.data_dir, work / "broker.log", options.fsync
        )
        self.proxy = TorturingProxy(("127.0.0.1", self.broker.port))
        report: Report | None = None
        progress: asyncio.Task[None] | None = None
        try:
            await self.broker.start()
            await self.proxy.start()
            await asyncio.to_thread(self._create_stream)
            self._start_workers()
            await self._wait_for_workers()
            self.started = time.monotonic()
            self.phase = "faults"
            progress = asyncio.get_running_loop().create_task(self._show_progress())
            await self._inject_faults()
            self.phase = "draining"
            await self._drain()
            self.phase = "verifying"
            await self._final_crash_and_verify()
            self.phase = "checking"
            report = await asyncio.to_thread(
                check_directory, self.records, flips=self.flips, flipped=self.flipped
            )
            self.phase = "done"
        except* BrokerDown as group:
            self.broker_down += [str(e) for e in _leaves(group)]
        except* (RuntimeError, OSError, slipstream.SlipstreamError) as group:
            self.errors += [f"{type(e).__name__}: {e}" for e in _leaves(group)]
        finally:
            if progress is not None:
                progress.cancel()
                await asyncio.gather(progress, return_exceptions=True)
            self._end_workers()
            await self.proxy.close()
            if self.broker.proc is not None and self.broker.proc.poll() is None:
                code = self.broker.terminate()
                if code != 0 and report is not None:
                    self.errors.append(
                        f"the broker exited with {code} on SIGTERM:\n{self.broker.log_tail()}"
                    )
            self.storage.close()
        return self._outcome(report, work)

    def _outcome(self, report: Report | None, work: Path) -> Outcome:
        if report is None:
            report = Report(ok=False, anomalies={}, examples={}, counts={})
        if self.broker_down:
            report.anomalies["broker_down"] = len(self.broker_down)
            report.examples["broker_down"] = self.broker_down
        ok = report.ok and not self.errors and not self.broker_down
        if ok and not self.options.keep and self.options.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
        return Outcome(
            ok=ok,
            seed=self.options.seed,
            duration_s=self.options.duration,
            faults=dict(sorted(self.faults.items())),
            unavailable=self.unavailable,
            anomalies=report.anomalies,
            examples=report.examples,
            counts={
                **report.counts,
                "flips": self.flips,
                "flips_in_known_batches": sum(1 for f in self.flipped if f is not None),
            },
            harness_errors=self.errors,
            work_dir=str(work),
            timeline=self.timeline,
        )

    def _create_stream(self) -> None:
        with slipstream.connect(f"127.0.0.1:{self.broker.port}") as client:
            client.create_stream(STREAM, segments=SEGMENTS)

    # --- client processes --------------------------------------------------------------------

    def _spawn(self, role: str, number: int, name: str, address: str) -> subprocess.Popen[bytes]:
        log = open(self.work / f"{name}.log", "ab")  # noqa: SIM115 - the child owns it
        with log:
            return subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "slipstream.torture._workers",
                    role,
                    "--address",
                    address,
                    "--stream",
                    STREAM,
                    "--id",
                    str(number),
                    "--out",
                    str(self.records / f"{name}.jsonl"),
                    "--stop-file",
                    str(self.stop_file),
                    "--seed",
                    str(self.rng.randrange(1 << 30)),
                    "--pause",
                    str(self.options.pause if role not in ("tail", "history") else 0.5),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def _start_workers(self) -> None:
        number = 0
        for _ in range(self.options.producers):
            for role in ("plain", "idempotent", "transactional"):
                number += 1
                name = f"producer-{number}-{role}"
                self.workers.append(self._spawn(role, number, name, self.proxy.address))
        for i in range(self.options.readers + 1):
            role = "history" if i == self.options.readers else "tail"
            name = f"reader-{i + 1}-{role}"
            self.workers.append(self._spawn(role, 1000 + i, name, self.proxy.address))

    async def _wait_for_workers(self, timeout: float = 120.0) -> None:
        """Until every worker has written its first record (Python and pyarrow take seconds
        to import on a busy machine: faults start when the clients run)."""
        self.phase = "starting clients"
        deadline = time.monotonic() + timeout
        expected = len(self.workers)
        while time.monotonic() < deadline:
            ready = [p for p in self.records.glob("*.jsonl") if p.stat().st_size]
            if len(ready) >= expected:
                return
            if any(w.poll() is not None for w in self.workers):
                raise RuntimeError(f"a client process exited at start: see the logs in {self.work}")
            await asyncio.sleep(0.1)
        raise RuntimeError(f"the client processes did not start within {timeout:g} s")

    async def _drain(self) -> None:
        self.stop_file.touch()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(w.poll() is None for w in self.workers):
            await asyncio.sleep(0.1)
        for worker in self.workers:
            if worker.poll() is None:
                self.errors.append(f"worker {worker.pid} did not stop within 30 s: killed")
        self._end_workers()

    def _end_workers(self) -> None:
        for worker in self.workers:
            if worker.poll() is None:
                worker.kill()
            worker.wait()

    # --- faults ------------------------------------------------------------------------------

    async def _inject_faults(self) -> None:
        options = self.options
        enabled = [f for f in options.faults if f not in self.unavailable]
        deadline = self.started + options.duration
        await asyncio.sleep(min(2.0, options.duration / 10))  # let the clients get going
        while enabled and time.monotonic() < deadline:
            first = self.rng.choice(enabled)
            chosen = [first]
            others = [f for f in enabled if f != first]
            if others and self.rng.random() < 0.3:
                second = self.rng.choice(others)
                # one broker-process fault at a time; a full disk only with network faults
                # (a broker may rightly refuse to start on a full disk)
                pair = {first, second}
                if not (pair <= PROCESS_FAULTS or ("disk" in pair and pair & PROCESS_FAULTS)):
                    chosen.append(second)
            seeds = [self.rng.randrange(1 << 30) for _ in chosen]
            async with asyncio.TaskGroup() as group:
                for name, seed in zip(chosen, seeds, strict=True):
                    group.create_task(self._fault(name, random.Random(seed)))
            await self._quiet(self.rng.uniform(0.5, 2.5))
        await self._quiet(deadline - time.monotonic())

    async def _quiet(self, seconds: float) -> None:
        """Sleep between faults, watching that the broker does not exit by itself."""
        end = time.monotonic() + seconds
        while True:
            proc = self.broker.proc
            if proc is not None and proc.poll() is not None:
                raise BrokerDown(
                    f"the broker exited with {proc.returncode} by itself:\n{self.broker.log_tail()}"
                )
            left = end - time.monotonic()
            if left <= 0:
                return
            await asyncio.sleep(min(left, 0.2))

    async def _fault(self, name: str, rng: random.Random) -> None:
        self.timeline.append(f"{time.monotonic() - self.started:.1f} s {name}")
        self.active.append(name)
        try:
            await getattr(self, f"_fault_{name}")(rng)
            self.faults[name] = self.faults.get(name, 0) + 1
        finally:
            self.active.remove(name)

    async def _fault_kill(self, rng: random.Random) -> None:
        async with self.process_lock:
            self.broker.kill()
            await asyncio.sleep(rng.uniform(0, 1.0))
            await self.broker.start()

    async def _fault_stop(self, rng: random.Random) -> None:
        async with self.process_lock:
            self.broker.signal(signal.SIGSTOP)
            try:
                await asyncio.sleep(rng.uniform(REQUEST_TIMEOUT + 1, REQUEST_TIMEOUT + 4))
            finally:
                self.broker.signal(signal.SIGCONT)

    async def _fault_cut(self, rng: random.Random) -> None:
        self.proxy.cut()
        await asyncio.sleep(rng.uniform(0, 0.5))

    async def _fault_delay(self, rng: random.Random) -> None:
        if rng.random() < 0.3:  # longer than the request timeout: clients give up and resend
            self.proxy.delay = rng.uniform(REQUEST_TIMEOUT, REQUEST_TIMEOUT + 2)
        else:
            self.proxy.delay = rng.uniform(0.01, 0.5)
        try:
            await asyncio.sleep(rng.uniform(1, 4))
        finally:
            self.proxy.delay = 0.0

    async def _fault_disk(self, rng: random.Random) -> None:
        assert self.storage.disk is not None
        ballast = self.storage.disk / "ballast"
        try:
            await asyncio.to_thread(_fill, ballast)
            await asyncio.sleep(rng.uniform(1, 4))
        finally:
            ballast.unlink(missing_ok=True)

    async def _fault_flip(self, rng: random.Random) -> None:
        async with self.process_lock:
            self.broker.kill()
            target = _flip_target(self.storage.data_dir, rng)
            if target is not None:
                path, at = target
                self.flipped.append(_batch_at(path, at))
                with open(path, "r+b") as f:
                    f.seek(at)
                    byte = f.read(1)
                    f.seek(at)
                    f.write(bytes([byte[0] ^ (1 << rng.randrange(8))]))
                    f.flush()
                    os.fsync(f.fileno())
                self.flips += 1
            await self.broker.start()

    async def _fault_power(self, rng: random.Random) -> None:
        async with self.process_lock:
            self.broker.kill()
            await asyncio.to_thread(self.storage.power.power_fail)
            await asyncio.sleep(rng.uniform(0, 0.5))
            await asyncio.to_thread(self.storage.power.mount)
            await self.broker.start()

    # --- the end -----------------------------------------------------------------------------

    async def _final_crash_and_verify(self) -> None:
        await self._quiet(0)
        async with self.process_lock:
            self.broker.kill()
            if self.storage.power is not None:
                await asyncio.to_thread(self.storage.power.power_fail)
                await asyncio.to_thread(self.storage.power.mount)
            await self.broker.start()
        self.stop_file.unlink()
        verifier = self._spawn("verify", 9999, "verify", f"127.0.0.1:{self.broker.port}")
        self.workers.append(verifier)
        deadline = time.monotonic() + 300
        while verifier.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if verifier.poll() != 0:
            raise RuntimeError(f"the verifying read failed ({verifier.poll()}): see verify.log")

    async def _show_progress(self) -> None:
        while self.phase not in ("checking", "done"):
            acked_rate, read_rate = await asyncio.to_thread(self.rates.update)
            if self.progress is not None:
                self.progress(
                    Status(
                        time.monotonic() - self.started,
                        self.options.duration,
                        dict(self.faults),
                        list(self.active),
                        self.rates.acked,
                        self.rates.read,
                        acked_rate,
                        read_rate,
                        self.phase,
                    )
                )
            await asyncio.sleep(0.5)


def _leaves(group: BaseExceptionGroup[Any]) -> list[BaseException]:
    leaves: list[BaseException] = []
    for exc in group.exceptions:
        leaves += _leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc]
    return leaves


def _fill(ballast: Path) -> None:
    """Take every free block of the filesystem holding ``ballast``."""
    stats = os.statvfs(ballast.parent)
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        with contextlib.suppress(OSError):
            os.posix_fallocate(fd, 0, max(1, stats.f_bavail * stats.f_frsize))
        with contextlib.suppress(OSError):
            while True:  # what fallocate left (reserved or metadata blocks)
                os.write(fd, b"\0" * 65536)
    finally:
        os.close(fd)


_NO_BATCH = (-1, 0, 0)  # a flip in padding between journal entries: no batch is damaged


def _batch_at(path: Path, at: int) -> tuple[int, int, int] | None:
    """(segment, first offset, end offset) of the batch whose journal entry holds byte ``at``
    of a journal or chunk file (chunks keep the journal's entries), ``_NO_BATCH`` for a byte
    of padding, None where the file does not parse (then only the coarse rules apply)."""
    data = path.read_bytes()
    pos = 0
    try:
        while True:
            entry = parse_entry(data, pos, verify=False)
            if entry.kind is not Parsed.ENTRY:
                return _NO_BATCH if entry.kind is Parsed.END and at >= pos else None
            if at < entry.start:
                return _NO_BATCH
            if at < entry.end:
                (global_id,) = _GLOBAL_ID.unpack_from(data, entry.payload_start)
                header = decode_header(data, entry.payload_start + _GLOBAL_ID.size)
                return global_id & 0xFFFFFF, header.base_offset, header.next_offset
            pos = entry.end
    except (ValueError, struct.error, slipstream.SlipstreamError):
        return None


def _flip_target(data_dir: Path, rng: random.Random) -> tuple[Path, int] | None:
    """A random byte of a chunk file or a sealed journal file (never the active one)."""
    candidates = [p for p in data_dir.glob("chunks/**/*.chunk") if p.stat().st_size]
    for container in (data_dir / "journal").glob("*"):
        journals = sorted(container.glob("*.journal"))
        candidates += [p for p in journals[:-1] if p.stat().st_size]
    if not candidates:
        return None
    path = rng.choice(sorted(candidates))
    return path, rng.randrange(path.stat().st_size)


async def run(options: Options, progress: Callable[[Status], None] | None = None) -> Outcome:
    """Run the harness (see the module docstring); never raises for what the broker does."""
    return await Run(options, progress).run()


def run_sync(options: Options, progress: Callable[[Status], None] | None = None) -> Outcome:
    """``run`` on a new event loop; SIGTERM and Ctrl-C end the run and still clean up (the
    broker, the client processes, the mounts)."""

    async def main() -> Outcome:
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        return await run(options, progress)

    return asyncio.run(main())

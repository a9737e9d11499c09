"""A broker subprocess owned by a program (the demo, the examples): start, wait, stop."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from .._errors import SlipstreamError


def choose_port(preferred: int = 7070) -> int:
    """``preferred`` if nothing listens there, else any free port."""
    for port in (preferred, 0):
        with socket.socket() as probe:
            # as the broker's listener does: a stopped broker's connections in TIME_WAIT (a
            # minute) do not hold the port, a listening one does
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(probe.getsockname()[1])
    raise OSError("no free TCP port")


class EmbeddedBroker:
    """A broker for one program's lifetime: ``python -m slipstream up`` in a subprocess, in its
    own process group (a Ctrl-C in the terminal reaches only the program, which stops the broker
    last, cleanly), logging to ``<data-dir>.log``. Used by ``slipstream demo``, the examples and
    the benchmarks::

        broker = EmbeddedBroker(Path(".slipstream"), choose_port(), fsync="always")
        broker.start()
        try:
            client = slipstream.connect(broker.address)
            ...
        finally:
            broker.stop()
    """

    def __init__(self, data_dir: Path, port: int, fsync: str) -> None:
        self.data_dir = data_dir
        self.port = port
        self.fsync = fsync
        self.address = f"127.0.0.1:{port}"
        #: the admin HTTP API and console: 7071 if free, else any free port
        self.http_port = choose_port(7071)
        self.log_path = data_dir.with_name(data_dir.name + ".log")
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> None:
        """Start it and wait until it answers; raises SlipstreamError with its log if not."""
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        log: IO[bytes]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
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
                    "--fsync",
                    self.fsync,
                    "--log-level",
                    "warning",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                process_group=0,  # Ctrl-C goes to the program, which stops the broker last
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SlipstreamError(
                    f"the broker exited at start: {self._last_log_line()} "
                    f"(log: {self.log_path}); pass --broker HOST:PORT to use a running broker"
                )
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise SlipstreamError(
            f"the broker did not listen on {self.address} within {timeout:.0f} s "
            f"(log: {self.log_path})"
        )

    def _last_log_line(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "no log"
        return lines[-1] if lines else "no output"

    def stop(self) -> int | None:
        """SIGTERM, wait up to 15 s for a clean shutdown, then SIGKILL; the exit code."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

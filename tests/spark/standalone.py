"""A real Spark standalone cluster on loopback for the tests: a master and two workers, the
same JVM classes that a cluster runs (``spark-class org.apache.spark.deploy.master.Master`` and
``...worker.Worker`` from the pyspark package in this interpreter's environment; pip's pyspark
ships ``bin/spark-class`` but not ``sbin/start-master.sh``), in the foreground as subprocesses
so that a test stops them by their process ids.

Each worker offers 1 core and 1 GiB, so an application gets two executors of 1 core, each in
its own JVM with its own Python workers: a plan that works only in the driver's process (a
client or an object that does not travel, a module the executors cannot import) fails here
where ``local[2]`` would not. Logs and work directories go under ``base``; ``log()`` gathers
them for a failing test's message.

Executors run this interpreter (``PYSPARK_PYTHON``, which PySpark hands to every executor) and
import slipstream from the directory this process imports it from (``executor_conf()``'s
``spark.executorEnv.PYTHONPATH``): a checkout or a private worktree is tested as itself, not
an installed copy.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pyspark
from conftest import free_port

import slipstream

SPARK_HOME = Path(pyspark.__file__).resolve().parent
#: where ``import slipstream`` finds the package in this process (the repository's root)
SLIPSTREAM_ROOT = Path(slipstream.__file__).resolve().parents[1]


class SparkStandalone:
    """``start()`` a master and ``workers`` workers on 127.0.0.1 (free ports), ``stop()`` them
    (SIGTERM, then SIGKILL). ``master_url`` is what an application's ``master`` is set to."""

    def __init__(self, base: Path, workers: int = 2, cores: int = 1, memory: str = "1g") -> None:
        self.base = base
        self.workers, self.cores, self.memory = workers, cores, memory
        self.port = free_port()
        self.ui_port = free_port()
        self.master_url = f"spark://127.0.0.1:{self.port}"
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "SPARK_HOME": str(SPARK_HOME),
            "SPARK_LOCAL_IP": "127.0.0.1",
            "SPARK_LOG_DIR": str(self.base / "logs"),
            "SPARK_LOCAL_DIRS": str(self.base / "local"),
            # the daemons only keep book; the executors' heap is --memory
            "SPARK_DAEMON_MEMORY": "256m",
            # no REST submission server on a fixed port (6066) that two runs would share
            "SPARK_MASTER_OPTS": "-Dspark.master.rest.enabled=false",
            "PYSPARK_PYTHON": sys.executable,
        }

    def _spawn(self, name: str, *args: str) -> None:
        log = open(self.base / f"{name}.log", "ab")  # noqa: SIM115 (closed with the process)
        proc = subprocess.Popen(
            [str(SPARK_HOME / "bin" / "spark-class"), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env(),
            cwd=self.base,
        )
        log.close()  # the child holds its own copy
        self.procs.append((name, proc))

    def start(self, timeout: float = 120.0) -> SparkStandalone:
        self.base.mkdir(parents=True, exist_ok=True)
        self._spawn(
            "master",
            "org.apache.spark.deploy.master.Master",
            *("--host", "127.0.0.1", "--port", str(self.port)),
            *("--webui-port", str(self.ui_port)),
        )
        for i in range(self.workers):
            work = self.base / f"worker-{i}"
            work.mkdir(exist_ok=True)
            self._spawn(
                f"worker-{i}",
                "org.apache.spark.deploy.worker.Worker",
                *("--host", "127.0.0.1", "--webui-port", str(free_port())),
                *("--cores", str(self.cores), "--memory", self.memory),
                *("--work-dir", str(work), self.master_url),
            )
        deadline = time.monotonic() + timeout
        while self.alive_workers() < self.workers:
            for name, proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers not registered within {timeout} s:\n{self.log()}")
            time.sleep(0.2)
        return self

    def state(self) -> dict[str, object]:
        """The master's own view (its web UI's ``/json/``): workers, cores, applications."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json/", timeout=2) as r:
            state: dict[str, object] = json.load(r)
            return state

    def alive_workers(self) -> int:
        try:
            alive = self.state()["aliveworkers"]
        except OSError:  # the master's UI is not up yet
            return 0
        assert isinstance(alive, int)
        return alive

    def executor_conf(self) -> dict[str, str]:
        """What an application on this cluster sets besides its master: executors import
        slipstream from here and bind to loopback like the rest of the test."""
        return {
            "spark.executorEnv.PYTHONPATH": str(SLIPSTREAM_ROOT),
            "spark.executorEnv.SPARK_LOCAL_IP": "127.0.0.1",
        }

    def log(self, tail: int = 4000) -> str:
        """The daemons' and executors' logs (the last ``tail`` characters of each)."""
        parts = []
        for path in sorted(self.base.glob("*.log")) + sorted(self.base.glob("worker-*/*/*/std*")):
            text = path.read_text(errors="replace")
            parts.append(f"--- {path.relative_to(self.base)}\n{text[-tail:]}")
        return "\n".join(parts)

    def stop(self) -> None:
        """Workers first (their executors go with them), then the master."""
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, proc in reversed(self.procs):
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()


# --- the driver: a process of its own, as on a cluster ------------------------------------------

TESTS = Path(__file__).resolve().parents[1]
EXAMPLES = TESTS.parent / "examples"


def driver_env() -> dict[str, str]:
    """The environment of a driver process started by a test: it imports the tests' modules and
    the auctions example, and slipstream from where this process does."""
    path = [str(SLIPSTREAM_ROOT), str(TESTS), str(TESTS / "spark"), str(EXAMPLES)]
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(path),
        "PYSPARK_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",
    }


class Brokers:
    """What the local test reads of its ``broker`` fixture: the address to hand to Spark, here
    a list ``h1:p1,h2:p2`` as users pass it."""

    def __init__(self, address: str) -> None:
        self.address = address


def job_1_on_the_cluster(master: str, brokers: str, tmp: Path, conf: dict[str, str]) -> None:
    """The driver of ``test_main_job``'s job 1 test, unchanged (its pipeline calls, its checks),
    on a SparkSession whose master is ``master``. An assertion that fails ends the process with
    its traceback on stderr."""
    import test_main_job

    from slipstream.spark import session

    spark = session(
        "auctions-job-1-standalone",
        master=master,
        conf={"spark.sql.streaming.pollingDelay": "50ms", **conf},
    )
    print(json.dumps({"application": spark.sparkContext.applicationId}), flush=True)
    try:
        with slipstream.connect(brokers) as client:
            test_main_job.test_job_1_counts_every_bid_once_while_the_bids_stream_splits_and_merges(
                spark,
                Brokers(brokers),  # type: ignore[arg-type]
                client,
                tmp,
            )
    finally:
        spark.stop()


if __name__ == "__main__":
    # python -m standalone MASTER BROKERS TMP CONF_JSON (tests/spark/test_standalone_cluster.py)
    job_1_on_the_cluster(sys.argv[1], sys.argv[2], Path(sys.argv[3]), json.loads(sys.argv[4]))

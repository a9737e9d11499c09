"""The Spark connector against a TLS broker: .option("tls_ca", ...) reads and writes, and a
read without it fails with TlsError rather than hanging."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import BrokerProcess
from pyspark.sql import SparkSession
from security.pki import Authority, Issued

import slipstream
from slipstream.spark._plan import TlsOptions, tls_option


def test_tls_options_parse() -> None:
    assert tls_option({}) is None
    assert tls_option({"tls_ca": "ca.pem"}) == TlsOptions(True, "ca.pem")
    assert tls_option({"tls": "true"}) == TlsOptions(True)
    assert tls_option({"tls": "false", "tls_ca": "ca.pem"}) == TlsOptions(False, "ca.pem")
    with pytest.raises(slipstream.InvalidArgument, match="tls"):
        tls_option({"tls": "yes please"})


def test_read_and_write_over_tls(spark: SparkSession, broker_factory: Any, tmp_path: Path) -> None:
    ca = Authority(tmp_path, "spark")
    server: Issued = ca.issue("broker", hosts=("127.0.0.1",), into="server")
    broker: BrokerProcess = broker_factory(
        "--tls-cert", str(server.cert), "--tls-key", str(server.key)
    ).start()
    with slipstream.connect(broker.address, ca=ca.path) as client:
        client.create_stream("demo/in")
        client.create_stream("demo/out")
        with client.producer("demo/in") as producer:
            for i in range(20):
                producer.send(json.dumps({"n": i}).encode(), key=f"k{i % 3}")

    def read(stream: str, **options: str) -> Any:
        reader = spark.read.format("slipstream").option("broker", broker.address)
        for name, value in options.items():
            reader = reader.option(name, value)
        return reader.option("stream", stream).load()

    frame = read("demo/in", tls_ca=str(ca.path))
    assert frame.count() == 20
    (
        frame.select("key", "value")
        .write.format("slipstream")
        .option("broker", broker.address)
        .option("stream", "demo/out")
        .option("tls_ca", str(ca.path))
        .mode("append")
        .save()
    )
    assert read("demo/out", tls="true", tls_ca=str(ca.path)).count() == 20
    with pytest.raises(Exception, match="requires TLS"):
        read("demo/in").count()

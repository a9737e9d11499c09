"""The Spark connector against a broker with --auth: .option("token", ...) on reads, and a
read without a token fails with the broker's AuthenticationFailed message."""

from __future__ import annotations

import json
from typing import Any

import pytest
from conftest import BrokerProcess
from pyspark.sql import SparkSession

import slipstream
from slipstream.security import TokenKeys
from slipstream.spark._plan import TlsOptions, tls_option


def test_token_option_parses() -> None:
    assert tls_option({"token": "T"}) == TlsOptions(None, token="T")
    assert tls_option({"token": "T", "tls_ca": "ca.pem"}) == TlsOptions(True, "ca.pem", token="T")
    assert tls_option({"token": ""}) is None


def test_read_with_a_token(spark: SparkSession, broker_factory: Any) -> None:
    broker: BrokerProcess = broker_factory("--auth").start()
    token = TokenKeys.load(broker.data_dir, create=False).issue("spark", "admin").token
    with slipstream.connect(broker.address, token=token) as client:
        client.create_stream("demo/in")
        with client.producer("demo/in") as producer:
            for i in range(20):
                producer.send(json.dumps({"n": i}).encode(), key=f"k{i % 3}")

    def read(**options: str) -> Any:
        reader = spark.read.format("slipstream").option("broker", broker.address)
        for name, value in options.items():
            reader = reader.option(name, value)
        return reader.option("stream", "demo/in").load()

    assert read(token=token).count() == 20
    with pytest.raises(Exception, match="no credentials"):
        read().count()

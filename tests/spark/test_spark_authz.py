"""The Spark connector against a broker with --auth and access rules: a read and a write
with a user token that no rule allows fail with the broker's PermissionDenied message (and
the grant that would allow it); after the grants both go through."""

from __future__ import annotations

import json
from typing import Any

import pytest
from conftest import BrokerProcess
from pyspark.sql import SparkSession

import slipstream
from slipstream.security import TokenKeys


def test_read_and_write_need_their_rules(spark: SparkSession, broker_factory: Any) -> None:
    broker: BrokerProcess = broker_factory("--auth").start()
    keys = TokenKeys.load(broker.data_dir, create=False)
    admin_token = keys.issue("ops", "admin").token
    alice = keys.issue("alice", "user").token
    with slipstream.connect(broker.address, token=admin_token) as admin:
        admin.create_stream("demo/in")
        admin.create_stream("demo/out")
        with admin.producer("demo/in") as producer:
            for i in range(10):
                producer.send(json.dumps({"n": i}).encode(), key=f"k{i % 3}")

        def read() -> Any:
            return (
                spark.read.format("slipstream")
                .option("broker", broker.address)
                .option("token", alice)
                .option("stream", "demo/in")
                .load()
            )

        def write() -> None:
            rows = [(f"k{i}", json.dumps({"n": i})) for i in range(5)]
            df = spark.createDataFrame(rows, "key STRING, value STRING")
            df.write.format("slipstream").option("broker", broker.address).option(
                "token", alice
            ).option("stream", "demo/out").mode("append").save()

        with pytest.raises(Exception, match="alice may not") as refused:
            read().count()
        assert "slipstream acl grant alice" in str(refused.value)
        with pytest.raises(Exception, match="alice may not"):
            write()
        assert admin.describe_stream("demo/out").segments[0].end_offset == 0

        admin.grant("alice", "consume", "demo/in")
        assert read().count() == 10
        with pytest.raises(Exception, match="alice may not produce"):
            write()  # consume on demo/in is no right to produce to demo/out
        admin.grant("alice", "produce", "demo/out")
        write()
        assert admin.describe_stream("demo/out").segments[0].end_offset == 5

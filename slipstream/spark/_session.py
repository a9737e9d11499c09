"""A SparkSession set up for slipstream on one machine."""

from __future__ import annotations

import os
import sys
from typing import Any

from pyspark.sql import SparkSession

from ._source import SlipstreamDataSource

#: settings that suit a laptop or one machine; session(conf=...) overrides any of them
DEFAULT_CONF = {
    "spark.sql.shuffle.partitions": "2",
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.streaming.stateStore.providerClass": (
        "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
    ),
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
    "spark.driver.memory": "2g",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
}


def register(spark: SparkSession) -> None:
    """Make ``format("slipstream")`` available in ``spark`` (safe to call twice)."""
    spark.dataSource.register(SlipstreamDataSource)


def session(
    app_name: str = "slipstream",
    *,
    master: str = "local[2]",
    conf: dict[str, str] | None = None,
    log_level: str = "WARN",
) -> SparkSession:
    """A SparkSession with the slipstream source registered and defaults for one machine:
    ``local[2]``, 2 shuffle partitions (not 200), UTC, the RocksDB state store (needed by
    ``transformWithState``), loopback only, no web UI (pass
    ``conf={"spark.ui.enabled": "true"}`` for it). The JVM starts here (6-8 s); Java 17 must be
    on PATH."""
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    # Python workers must import slipstream: run them on this interpreter, not PATH's python3
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder: Any = SparkSession.builder.appName(app_name).master(master)
    for key, value in {**DEFAULT_CONF, **(conf or {})}.items():
        builder = builder.config(key, value)
    spark: SparkSession = builder.getOrCreate()
    spark.sparkContext.setLogLevel(log_level)
    register(spark)
    return spark

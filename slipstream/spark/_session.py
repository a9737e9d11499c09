"""A SparkSession set up for slipstream on one machine."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
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


#: Spark's logging from the JVM's first line on (setLogLevel comes too late for the start-up
#: banner and Hadoop's native-library warning): errors and warnings of the level asked for. The
#: loggers of the classes that start a Python or shell driver, at the root's level, keep Spark
#: from announcing "Setting default log level" (it does when theirs differs from the root's).
LOG4J2 = """\
rootLogger.level = {level}
rootLogger.appenderRef.stderr.ref = stderr
appender.stderr.type = Console
appender.stderr.name = stderr
appender.stderr.target = SYSTEM_ERR
appender.stderr.layout.type = PatternLayout
appender.stderr.layout.pattern = %d{{yy/MM/dd HH:mm:ss}} %p %c{{1}}: %m%n%ex
logger.native.name = org.apache.hadoop.util.NativeCodeLoader
logger.native.level = error
logger.gateway.name = org.apache.spark.api.python.PythonGatewayServer
logger.gateway.level = {level}
logger.submit.name = org.apache.spark.deploy.SparkSubmit
logger.submit.level = {level}
logger.shell.name = org.apache.spark.repl.Main
logger.shell.level = {level}
"""


def log_config(level: str) -> Path:
    """A log4j2 configuration at ``level`` (WARN, ERROR, ...), written once in the temporary
    directory; the JVM reads it at start (``-Dlog4j.configurationFile``)."""
    path = Path(tempfile.gettempdir()) / f"slipstream-log4j2-{level.lower()}.properties"
    text = LOG4J2.format(level=level.lower())
    if not path.exists() or path.read_text() != text:
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(text)
        partial.replace(path)
    return path


def _quiet_accumulator_hangup(spark: SparkSession) -> None:
    """PySpark's accumulator server prints an EOFError traceback when the JVM hangs up on it at
    shutdown (a closed connection, not an error); other errors still print."""
    server = getattr(spark.sparkContext, "_accumulatorServer", None)
    if server is None:
        return
    report = server.handle_error

    def handle_error(request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], EOFError):
            report(request, client_address)

    server.handle_error = handle_error


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
    ``conf={"spark.ui.enabled": "true"}`` for it). Spark logs at ``log_level`` (WARN, ERROR,
    ...) from the JVM's start, to stderr, without the start-up banner or Hadoop's
    native-library warning (``conf`` may set ``spark.driver.extraJavaOptions`` instead). The JVM
    starts here (6-8 s); Java 17 must be on PATH."""
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    # Python workers must import slipstream: run them on this interpreter, not PATH's python3
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder: Any = SparkSession.builder.appName(app_name).master(master)
    logging = {
        "spark.driver.extraJavaOptions": f"-Dlog4j.configurationFile={log_config(log_level)}"
    }
    for key, value in {**DEFAULT_CONF, **logging, **(conf or {})}.items():
        builder = builder.config(key, value)
    spark: SparkSession = builder.getOrCreate()
    spark.sparkContext.setLogLevel(log_level)
    _quiet_accumulator_hangup(spark)
    register(spark)
    return spark

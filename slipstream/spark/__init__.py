"""Stream compute on Spark: the ``slipstream`` data source for PySpark (4.3+).

::

    from slipstream.spark import session
    spark = session("orders-per-minute")          # local[2] with sensible defaults, registered
    orders = (spark.readStream.format("slipstream")
              .option("stream", "demo/orders")
              .option("startingPosition", "earliest")
              .option("schema", "item STRING, price DOUBLE")
              .load())
    (orders.groupBy(window("timestamp", "1 minute")).count()
        .selectExpr("CAST(window.start AS STRING) AS key", "to_json(struct(*)) AS value")
        .writeStream.format("slipstream").option("stream", "demo/counts")
        .option("checkpointLocation", "/tmp/ckpt").outputMode("update").start())

Reads give ``key``, ``value``, ``headers``, ``timestamp`` (event time), ``stream``, ``segment``
and ``offset`` (plus the ``schema`` option's parsed columns). Streaming writes commit each
micro-batch in one slipstream transaction, exactly once across restarts. See docs/spark.md.
"""

from .._errors import MalformedValue
from ._session import DEFAULT_CONF, register, session
from ._source import SlipstreamDataSource

__all__ = ["DEFAULT_CONF", "MalformedValue", "SlipstreamDataSource", "register", "session"]

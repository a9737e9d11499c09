"""The ``slipstream`` Spark sink: exactly-once micro-batches and atomic batch writes.

How a micro-batch commits exactly once:

1. Every task stages its partition's rows in an *anonymous* transaction labelled
   ``spark:<query id>:<batch id>:<partition>`` and returns that transaction's id.
2. The driver's ``commit(messages, batch_id)`` opens the query's own transaction
   (transactional id ``spark:<query id>`` unless the ``transactionalId`` option names one) and
   commits it with ``merge=`` every task's transaction and ``metadata={"query", "batch"}``: one
   atomic commit on the broker, so the batch is visible all at once or not at all.
3. Before committing, the driver reads the id's last commit. Spark calls ``commit`` again for a
   batch after a crash inside it, and re-runs a failed batch under the same id: when the last
   committed batch of this query is already at or past ``batch_id``, the new staging is aborted
   and nothing changes.
4. Staged data that never commits is removed: ``abort`` aborts it, the next commit of the same
   query aborts every other open transaction of the query (tasks of a crashed run), and the
   broker aborts anything still open after ``transactionTimeout`` (default 10 minutes).

Test hook: ``SLIPSTREAM_FAULT=spark.sink.before_commit`` in the driver's environment kills the
driver with SIGKILL just before the broker commit of a batch with data; ``spark.sink.after_commit``
just after the broker acknowledged it, before Spark logs the batch as committed. A suffix
``@<stream>`` limits it to the query writing to that stream. ``commit`` runs in a Python worker
that the pyspark daemon keeps in a process group of its own, so ``SLIPSTREAM_FAULT_GROUP`` names
the group to kill (the driver's; without it only the worker dies and Spark sees a failed commit).
"""

from __future__ import annotations

import contextlib
import os
import signal
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import pyarrow as pa
from pyspark import TaskContext
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import StructType

from .._errors import (
    InvalidArgument,
    ProducerFenced,
    TransactionAborted,
    TransactionNotFound,
)
from ..client import Client
from ..streams import parse_duration_ms
from ._convert import check_sink_schema, from_spark_batch
from ._plan import TlsOptions, broker_option, stream_option, tls_option
from ._source import connect_patiently, shared_client

DEFAULT_TRANSACTION_TIMEOUT = "10m"


@dataclass(frozen=True)
class StagedPartition(WriterCommitMessage):
    """What a task hands to the driver: its staged transaction (None if it wrote nothing)."""

    txn_id: int | None
    query_id: str
    events: int


@dataclass(frozen=True)
class SinkOptions:
    broker: str
    stream: str
    transactional_id: str | None
    timeout_s: float
    tls: TlsOptions | None = None


def sink_options(options: Mapping[str, str]) -> SinkOptions:
    timeout = options.get("transactiontimeout", DEFAULT_TRANSACTION_TIMEOUT)
    return SinkOptions(
        broker=broker_option(options),
        stream=stream_option(options),
        transactional_id=options.get("transactionalid") or None,
        timeout_s=parse_duration_ms(timeout) / 1000,
        tls=tls_option(options),
    )


def _crash_point(name: str, stream: str) -> None:
    """Kill the driver here if SLIPSTREAM_FAULT names this point (see the module docstring)."""
    if os.environ.get("SLIPSTREAM_FAULT") not in (name, f"{name}@{stream}"):
        return
    group = os.environ.get("SLIPSTREAM_FAULT_GROUP")
    if group:
        os.killpg(int(group), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _staged(messages: list[WriterCommitMessage | None]) -> list[StagedPartition]:
    return [m for m in messages if isinstance(m, StagedPartition)]


def _abort_quietly(client: Client, txn_ids: list[int], at: str) -> None:
    """Abort staged transactions held by the broker coordinating ``at`` (the transactional
    id that would have merged them)."""
    for txn_id in txn_ids:
        # already gone (aborted by its timeout or an earlier cleanup) is fine
        with contextlib.suppress(TransactionAborted, TransactionNotFound):
            client.abort_transaction(txn_id, at=at)


class _Writing:
    def __init__(self, options: Mapping[str, str], schema: StructType) -> None:
        self.options = sink_options(options)
        check_sink_schema(schema.fieldNames())

    def merging_id(self, query_id: str) -> str:
        """The transactional id whose commit merges the tasks' transactions."""
        raise NotImplementedError

    def stage(
        self, batches: Iterator[pa.RecordBatch], query_id: str, label: str
    ) -> StagedPartition:
        """Stage every row of this task in one anonymous transaction, begun where the commit
        that merges it will run (in a cluster: the broker coordinating ``merging_id``)."""
        client = shared_client(self.options.broker, self.options.tls)
        txn = None
        events = 0
        try:
            for batch in batches:
                if batch.num_rows == 0:
                    continue
                if txn is None:
                    txn = client.transaction(
                        None,
                        timeout=self.options.timeout_s,
                        label=label,
                        merge_into=self.merging_id(query_id),
                    )
                txn.send_many(self.options.stream, **from_spark_batch(batch))
                events += batch.num_rows
            if txn is not None:
                txn.flush()
        except BaseException:
            if txn is not None:
                txn.abort()
            raise
        return StagedPartition(None if txn is None else txn.txn_id, query_id, events)

    def abort_staged(self, messages: list[WriterCommitMessage | None]) -> None:
        present = _staged(messages)
        staged = [m.txn_id for m in present if m.txn_id is not None]
        if staged:
            with connect_patiently(self.options.broker, self.options.tls) as client:
                _abort_quietly(client, staged, self.merging_id(present[0].query_id))


class StreamWriter(_Writing, DataSourceStreamArrowWriter):
    """``df.writeStream.format("slipstream")``: each micro-batch in one transaction, exactly
    once (see the module docstring)."""

    def __init__(self, options: Mapping[str, str], schema: StructType, overwrite: bool) -> None:
        super().__init__(options, schema)

    def merging_id(self, query_id: str) -> str:
        return self.options.transactional_id or f"spark:{query_id}"

    def write(self, iterator: Iterator[pa.RecordBatch]) -> StagedPartition:
        context = TaskContext.get()
        assert context is not None, "write() runs in a Spark task"
        query_id = context.getLocalProperty("sql.streaming.queryId") or "unknown"
        batch_id = context.getLocalProperty("streaming.sql.batchId") or "0"
        label = f"spark:{query_id}:{batch_id}:{context.partitionId()}"
        return self.stage(iterator, query_id, label)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        present = _staged(messages)
        if not present:
            return
        query_id = present[0].query_id
        staged = [m.txn_id for m in present if m.txn_id is not None]
        transactional_id = self.merging_id(query_id)
        with connect_patiently(self.options.broker, self.options.tls) as client:
            last = client.last_commit(transactional_id)
            done = last.metadata if last is not None and isinstance(last.metadata, dict) else {}
            open_ids = {t.txn_id: t.label for t in client.transactions(at=transactional_id)}
            if done.get("query") == query_id and done.get("batch", -1) >= batchId:
                # committed before: Spark repeats a batch after a crash inside commit, or re-runs
                # it; what was staged again (not the very same, merged transactions) goes away
                _abort_quietly(client, [t for t in staged if t in open_ids], transactional_id)
                return
            orphans = [
                txn_id
                for txn_id, label in open_ids.items()
                if label.startswith(f"spark:{query_id}:") and txn_id not in staged
            ]
            _abort_quietly(client, orphans, transactional_id)
            if not staged:
                return
            events = sum(m.events for m in present)
            owner = client.transaction(transactional_id, timeout=self.options.timeout_s)
            _crash_point("spark.sink.before_commit", self.options.stream)
            owner.commit(
                metadata={"query": query_id, "batch": batchId, "events": events}, merge=staged
            )
            _crash_point("spark.sink.after_commit", self.options.stream)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        self.abort_staged(messages)


class BatchWriter(_Writing, DataSourceArrowWriter):
    """``df.write.format("slipstream").mode("append")``: the whole write in one transaction,
    so readers see all of its rows or none."""

    def __init__(self, options: Mapping[str, str], schema: StructType, overwrite: bool) -> None:
        if overwrite:
            raise InvalidArgument(
                'streams are append-only: write with .mode("append"), or delete and recreate '
                "the stream first"
            )
        super().__init__(options, schema)
        self.write_id = uuid.uuid4().hex

    def merging_id(self, query_id: str) -> str:
        # One id per stream keeps the broker's identity table small; two writes committing at
        # the same instant fence each other, so a fenced commit is tried again.
        return self.options.transactional_id or f"spark-write:{self.options.stream}"

    def write(self, iterator: Iterator[pa.RecordBatch]) -> StagedPartition:
        context = TaskContext.get()
        partition = context.partitionId() if context is not None else 0
        return self.stage(iterator, self.write_id, f"spark-write:{self.write_id}:{partition}")

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        staged = [m.txn_id for m in _staged(messages) if m.txn_id is not None]
        if not staged:
            return
        transactional_id = self.merging_id(self.write_id)
        with connect_patiently(self.options.broker, self.options.tls) as client:
            for attempt in range(3):
                try:
                    owner = client.transaction(transactional_id, timeout=self.options.timeout_s)
                    owner.commit(metadata={"write": self.write_id}, merge=staged)
                    return
                except ProducerFenced:
                    if attempt == 2:
                        raise

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        self.abort_staged(messages)

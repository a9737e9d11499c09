"""``slipstream txn list`` and ``txn identities``: rendering open transactions and
transactional ids."""

from __future__ import annotations

import base64
from typing import Any

import msgspec
from rich import box
from rich.markup import escape
from rich.table import Table

from ..protocol import IdentityInfo, TxnInfo
from ..streams import human_bytes
from ._common import human_duration_ms, iso_ms


def txn_dict(txn: TxnInfo) -> dict[str, Any]:
    return {
        "txn_id": txn.txn_id,
        "transactional_id": txn.transactional_id,
        "producer_id": txn.producer_id,
        "epoch": txn.epoch,
        "state": txn.state,
        "age_ms": txn.age_ms,
        "timeout_ms": txn.timeout_ms,
        "events": txn.events,
        "bytes": txn.bytes,
        "segments": txn.segments,
        "label": txn.label,
    }


def _age(ms: int) -> str:
    if ms < 1000:
        return f"{ms}ms"
    if ms < 60_000:
        return f"{ms / 1000:.1f}s"
    return human_duration_ms(ms - ms % 1000)


def txns_table(txns: list[TxnInfo]) -> Table:
    table = Table(
        title=f"{len(txns)} open transaction{'s' if len(txns) != 1 else ''}",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    table.add_column("Txn", justify="right", style="bold")
    table.add_column("Transactional id", style="cyan")
    table.add_column("State")
    table.add_column("Age", justify="right")
    table.add_column("Times out in", justify="right")
    table.add_column("Events", justify="right")
    table.add_column("Bytes", justify="right")
    table.add_column("Segments", justify="right")
    for t in sorted(txns, key=lambda t: -t.age_ms):
        table.add_row(
            str(t.txn_id),
            t.transactional_id or f"({t.label or 'anonymous'})",
            t.state,
            _age(t.age_ms),
            _age(max(0, t.timeout_ms - t.age_ms)),
            f"{t.events:,}",
            human_bytes(t.bytes),
            str(t.segments),
        )
    return table


def identity_dict(identity: IdentityInfo) -> dict[str, Any]:
    """A transactional id as JSON: the metadata of its last commit decoded where it is JSON
    (the Spark sink's ``{"query", "batch", ...}``), else null with the bytes in
    ``metadata_base64`` (as the admin API's GET /api/transactions/identities)."""
    metadata: Any = None
    if identity.last_metadata:
        try:
            metadata = msgspec.json.decode(identity.last_metadata)
        except msgspec.DecodeError:
            metadata = None
    committed = identity.last_txn_id >= 0
    return {
        "transactional_id": identity.transactional_id,
        "producer_id": identity.producer_id,
        "epoch": identity.epoch,
        "last_txn_id": identity.last_txn_id,
        "committed_ms": identity.committed_ms,
        "committed": iso_ms(identity.committed_ms) if committed else None,
        "metadata": metadata,
        "metadata_base64": base64.b64encode(identity.last_metadata).decode(),
    }


def identities_table(identities: list[IdentityInfo], prefix: str) -> Table:
    count = len(identities)
    table = Table(
        title=f"{count} transactional id{'s' if count != 1 else ''}"
        + (f" starting with {escape(prefix)!r}" if prefix else ""),
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    table.add_column("Transactional id", style="cyan")
    table.add_column("Producer", justify="right")
    table.add_column("Epoch", justify="right")
    table.add_column("Last txn", justify="right")
    table.add_column("Committed")
    table.add_column("Metadata")
    for i in identities:
        document = identity_dict(i)
        if i.last_txn_id < 0:
            last, committed, metadata = "-", "never", ""
        else:
            last, committed = str(i.last_txn_id), document["committed"]
            metadata = (
                msgspec.json.encode(document["metadata"]).decode()
                if document["metadata"] is not None
                else f"{len(i.last_metadata)} bytes"
            )
        table.add_row(
            escape(i.transactional_id),
            str(i.producer_id),
            str(i.epoch),
            last,
            committed,
            escape(metadata),
        )
    return table

"""``slipstream txn list``: rendering open transactions."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.table import Table

from ..protocol import TxnInfo
from ..streams import human_bytes
from ._common import human_duration_ms


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

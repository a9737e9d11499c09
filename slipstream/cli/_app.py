"""The typer application: ``slipstream up | stream ... | produce | consume | demo``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from .._errors import SlipstreamError
from ..broker import FSYNC_MODES
from ..streams import parse_size_bytes

app = typer.Typer(
    help="slipstream: durable streams on your laptop. Start with 'slipstream up'.",
    no_args_is_help=True,
    rich_markup_mode="rich",
)
err = Console(stderr=True)


@app.callback()
def _root() -> None:
    """slipstream: durable streams, replayable history, exactly-once pipelines."""


@app.command(epilog="Example: slipstream up --data-dir ./.slipstream --fsync always")
def up(
    data_dir: Annotated[Path, typer.Option(help="Where streams are stored.")] = Path(".slipstream"),
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port for clients.")] = 7070,
    fsync: Annotated[
        str,
        typer.Option(
            help="always: acknowledge after fdatasync (default, nothing acknowledged is lost); "
            "interval: acknowledge after write, sync every 50 ms; never: leave it to the OS."
        ),
    ] = "always",
    containers: Annotated[
        int, typer.Option(help="Journals (set when the data dir is created).")
    ] = 4,
    max_batch: Annotated[str, typer.Option(help="Largest batch a producer may send.")] = "8MiB",
    roll: Annotated[
        str, typer.Option(help="Journal file size that triggers a move to chunks.")
    ] = "64MiB",
    roll_seconds: Annotated[
        float, typer.Option(help="Move journal data to chunks at least this often.")
    ] = 300.0,
    retention_check_seconds: Annotated[
        float, typer.Option(help="How often retention runs.")
    ] = 30.0,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error.")] = "info",
) -> None:
    """Start the broker in the foreground; Ctrl-C (SIGINT) or SIGTERM stops it cleanly."""
    from ._up import run_broker, setup_logging

    if fsync not in FSYNC_MODES:
        raise typer.BadParameter(f"use one of {', '.join(FSYNC_MODES)}", param_hint="--fsync")
    setup_logging(log_level)
    run_broker(
        data_dir,
        host,
        port,
        fsync,
        containers=containers,
        max_batch_bytes=parse_size_bytes(max_batch),
        roll_bytes=parse_size_bytes(roll),
        roll_ms=int(roll_seconds * 1000),
        retention_check_ms=int(retention_check_seconds * 1000),
    )


def main() -> None:
    """Entry point: typed slipstream errors become one readable line and exit code 1."""
    try:
        app()
    except SlipstreamError as exc:
        err.print(f"[bold red]error[/]: {exc.message}", highlight=False)
        sys.exit(1)

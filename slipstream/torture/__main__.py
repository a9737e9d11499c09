"""``python -m slipstream.torture``: check a machine, its disks and this build of slipstream
under faults. See ``--help``."""

from __future__ import annotations

import argparse
import asyncio
import random
import shlex
import sys
import textwrap
from pathlib import Path

import msgspec
from rich.console import Console
from rich.live import Live
from rich.table import Table

from ._harness import FAULTS, Options, Status, run_sync

DESCRIPTION = textwrap.dedent(
    f"""\
    Torture a real slipstream broker and check that it kept its promises.

    The harness starts a broker (`python -m slipstream up`) on a fresh data directory, then
    client processes that record everything they do: producers (plain, idempotent and
    transactional) and readers (following the tail, and replaying history). While they run,
    it injects faults at random, sometimes two at once:

      kill    kill -9 of the broker, then a restart
      stop    SIGSTOP of the broker for longer than the clients' timeouts, then SIGCONT
      cut     every client connection reset by a TCP proxy between clients and broker
      delay   the proxy holds every byte back, sometimes longer than the clients' timeouts
      disk    the data directory's disk full for a few seconds (root: a loop-mounted ext4)
      flip    one byte flipped in a stored chunk or a sealed journal file (broker down)
      power   power failure: every write not made durable is lost (needs FUSE: PowerFS)

    Then it heals everything, kills the broker a last time, restarts it, reads the whole
    stream and checks the history. It reports, as text or JSON:

      lost              acknowledged events missing after the faults
      duplicate         an event stored twice (exactly-once broken)
      order             events of one key out of order
      aborted_read      events of aborted transactions seen by readers
      uncommitted_read  events of a transaction seen before its commit
      partial_txn       a transaction visible in part
      damaged_served    a value that is not what was sent, served as valid
      inconsistent      two reads disagree on a position, or an acknowledgement lied
      phantom           an event nobody sent
      unexpected_damage CorruptData without a flipped byte, or wider than one batch
      broker_down       the broker did not come back after a fault (its log is quoted)

    Data destroyed on purpose by `flip` is counted apart (lost_to_damage), as long as the
    broker reported it (CorruptData) instead of serving it.

    Exit status: 0 when every check passed, 1 on any anomaly or harness error, 2 on bad
    arguments.
    Available faults: {", ".join(FAULTS)}.
    """
)

EPILOG = textwrap.dedent(
    """\
    examples:
      python -m slipstream.torture --duration 60 --faults all --json
      python -m slipstream.torture --duration 600 --data-dir /mnt/nvme/torture  # your disk
      python -m slipstream.torture --seed 1234 --faults kill,flip               # reproduce

    The seed is printed at the start and in the result: the same seed draws the same faults
    at the same moments. Records and logs are kept (the path is printed) when a check fails
    or with --keep. The data directory must be new or empty-able: the harness creates a
    stream `torture/events` in it.
    """
)


def _faults(text: str) -> list[str]:
    if text == "all":
        return list(FAULTS)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown fault {', '.join(unknown)}: choose from all, {', '.join(FAULTS)}"
        )
    return names


def parse(argv: list[str] | None) -> tuple[Options, bool]:
    parser = argparse.ArgumentParser(
        prog="python -m slipstream.torture",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--duration", type=float, default=60.0, help="seconds of faults (default: 60)"
    )
    parser.add_argument(
        "--faults",
        type=_faults,
        default=list(FAULTS),
        help="'all' or a comma list, e.g. kill,stop,cut (default: all; a fault this machine "
        "cannot inject is reported as unavailable)",
    )
    parser.add_argument("--seed", type=int, help="RNG seed (default: random, printed)")
    parser.add_argument(
        "--data-dir",
        type=Path,
        help="the broker's data directory, to test a disk of your choice (default: a fresh "
        "directory under --work-dir; disk and power faults need the default)",
    )
    parser.add_argument(
        "--work-dir", type=Path, help="records, logs and mounts (default: a new temp dir)"
    )
    parser.add_argument("--keep", action="store_true", help="keep --work-dir after a clean run")
    parser.add_argument(
        "--fsync",
        choices=["always", "interval", "never"],
        default="always",
        help="the broker's --fsync (only 'always' promises that nothing acknowledged is lost "
        "at a power failure)",
    )
    parser.add_argument(
        "--producers", type=int, default=1, help="producer processes of each kind (default: 1)"
    )
    parser.add_argument(
        "--readers", type=int, default=2, help="tail-following readers (default: 2)"
    )
    parser.add_argument(
        "--broker-command",
        default=None,
        help="how to run the broker, before its 'up ...' arguments (default: this Python "
        "with -m slipstream); e.g. another build or a wrapper",
    )
    parser.add_argument(
        "--disk-size", type=int, default=1024, help="MiB of the loop-mounted disk (default 1024)"
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    options = Options(
        duration=args.duration,
        faults=args.faults,
        seed=args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31),
        work_dir=args.work_dir,
        data_dir=args.data_dir,
        keep=args.keep,
        fsync=args.fsync,
        producers=args.producers,
        readers=args.readers,
        disk_mib=args.disk_size,
    )
    if args.broker_command:
        options.broker_command = shlex.split(args.broker_command)
    return options, args.json


def _table(status: Status) -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_row(
        f"[bold]{status.phase}[/]",
        f"{min(status.elapsed, status.duration):.0f}/{status.duration:.0f} s",
        f"acked {status.acked} ({status.acked_rate:.0f}/s)",
        f"read {status.read} ({status.read_rate:.0f}/s)",
    )
    faults = ", ".join(f"{k} {v}" for k, v in sorted(status.faults.items())) or "none yet"
    active = ", ".join(status.active) or "-"
    table.add_row("faults", faults, f"now: {active}", "")
    return table


def main(argv: list[str] | None = None) -> int:
    options, as_json = parse(argv)
    console = Console(stderr=True)
    console.print(
        f"slipstream torture: seed {options.seed}, {options.duration:g} s, "
        f"faults {','.join(options.faults)}"
    )
    try:
        if console.is_terminal:
            with Live(console=console, refresh_per_second=4, transient=True) as live:
                outcome = run_sync(options, lambda status: live.update(_table(status)))
        else:
            last = [0.0]

            def show(status: Status) -> None:
                if status.elapsed - last[0] >= 10:
                    last[0] = status.elapsed
                    console.print(_table(status))

            outcome = run_sync(options, show)
    except ValueError as exc:
        console.print(f"[red]error:[/] {exc}")
        return 2
    except (KeyboardInterrupt, asyncio.CancelledError):
        console.print("interrupted: every process stopped, every mount undone")
        return 130
    if as_json:
        sys.stdout.buffer.write(msgspec.json.format(msgspec.json.encode(outcome)) + b"\n")
    else:
        print(outcome.text())
    sys.stdout.flush()
    return 0 if outcome.ok else 1


if __name__ == "__main__":
    sys.exit(main())

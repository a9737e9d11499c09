"""What a new user trips over on the command line: large events, odd names, help text,
singular counts and table output (issue 15, "The CLI")."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time

import pytest
from conftest import BrokerProcess
from rich.console import Console

from slipstream.cli._consume import Rows, TableOutput


def run(
    *args: str, stdin: str = "", broker: BrokerProcess | None = None, columns: int = 100
) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "slipstream", *args]
    if broker is not None:
        command += ["--broker", broker.address]
    return subprocess.run(
        command,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "COLUMNS": str(columns)},
    )


def flat(text: str) -> str:
    return " ".join(text.split())


def test_an_event_over_2_mib_needs_batch_size_and_the_error_names_it(
    broker: BrokerProcess,
) -> None:
    run("stream", "create", "cli/big", broker=broker)
    event = "x" * (3 * 1024 * 1024) + "\n"
    refused = run("produce", "cli/big", "--raw", stdin=event, broker=broker)
    assert refused.returncode == 1
    assert "--batch-size 4MiB" in flat(refused.stderr)
    taken = run("produce", "cli/big", "--raw", "--batch-size", "4MiB", stdin=event, broker=broker)
    assert taken.returncode == 0, taken.stderr
    assert "produced 1 event " in flat(taken.stderr)  # singular
    raw = run("consume", "cli/big", "--format", "raw", broker=broker).stdout
    assert raw == event


def test_counts_are_singular_for_one() -> None:
    from slipstream.cli._produce import ProduceStats

    stats = ProduceStats("demo/x", events=1, acknowledged=1, skipped=1)
    assert "produced 1 event " in stats.summary() and "skipped 1 bad line" in stats.summary()
    stats = ProduceStats("demo/x", events=2, acknowledged=2, skipped=3)
    assert "produced 2 events " in stats.summary() and "skipped 3 bad lines" in stats.summary()


@pytest.mark.parametrize("name", ["-x/y", "demo/-y", "_x/y", ".x/y"])
def test_names_starting_with_a_dash_are_refused_with_the_rule(
    broker: BrokerProcess, name: str
) -> None:
    result = run("stream", "create", "--broker", broker.address, "--", name)
    assert result.returncode == 1
    assert "start with a lowercase letter or a digit" in flat(result.stderr)


@pytest.mark.parametrize("command", [[], ["stream", "delete"], ["produce"], ["consume"], ["up"]])
def test_help_shows_flags_without_a_value_type(command: list[str]) -> None:
    result = run(*command, "--help", columns=100)
    assert result.returncode == 0
    assert "<bool>" not in result.stdout
    assert "--help " in result.stdout


def test_top_level_help_lists_each_command_on_whole_lines() -> None:
    result = run("--help", columns=80)
    lines = result.stdout.splitlines()
    commands = lines[next(i for i, line in enumerate(lines) if "Commands" in line) + 1 :]
    entries: list[list[str]] = []
    for line in commands:
        if not line.startswith("│"):
            break
        text = line.strip("│").rstrip()
        if text.startswith(" ") and not text.startswith("  "):
            entries.append([text.strip()])  # a command's first line
        else:
            entries[-1].append(text.strip())
    assert len(entries) >= 6
    for entry in entries:
        # wrapped by the terminal, every line but the last is nearly full; the docstring's own
        # line breaks (the bug) left lines like "acknowledged" or "user) and follow them"
        assert all(len(line) > 50 for line in entry[:-1]), "\n".join(entry)


def _rows(offset: int, value: bytes) -> Rows:
    rows = Rows.__new__(Rows)
    rows.keys = [b"user-1"]
    rows.values = [value]
    rows.timestamps = [1_800_000_000_000]
    rows.headers = [None]
    rows.segments = [0]
    rows.offsets = [offset]
    return rows


def test_table_rows_of_later_batches_line_up_with_the_header() -> None:
    buffer = io.StringIO()
    console = Console(file=buffer, width=120, color_system=None)
    output = TableOutput(console)
    output.write(_rows(0, b"first-value"))
    output.write(_rows(1, b"second-value"))
    output.write(_rows(2, b"third-value"))
    lines = [line for line in buffer.getvalue().splitlines() if line.strip()]
    header = next(line for line in lines if "Value" in line)
    column = header.index("Value")
    for value in ("first-value", "second-value", "third-value"):
        row = next(line for line in lines if value in line)
        assert row.index(value) == column, buffer.getvalue()
        assert row.index("user-1") == header.index("Key")


def test_produce_json_summary_counts_acknowledged_events(broker: BrokerProcess) -> None:
    run("stream", "create", "cli/acks", broker=broker)
    result = run("produce", "cli/acks", "--json", stdin="1\n2\n3\n", broker=broker)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["events"] == summary["acknowledged"] == 3
    assert "resume_line" not in summary


def test_from_a_relative_time_reads_the_recent_events(broker: BrokerProcess) -> None:
    now = int(time.time() * 1000)
    hour = 3_600_000
    run("stream", "create", "cli/recent", broker=broker)
    old = "".join(f'{{"value": "old-{i}", "timestamp": {now - 3 * hour + i}}}\n' for i in range(3))
    recent = "".join(
        f'{{"value": "new-{i}", "timestamp": {now - hour // 6 + i}}}\n' for i in range(2)
    )
    assert run("produce", "cli/recent", stdin=old, broker=broker).returncode == 0
    assert run("produce", "cli/recent", stdin=recent, broker=broker).returncode == 0
    last_hour = run("consume", "cli/recent", "--from", "-1h", "--format", "raw", broker=broker)
    assert last_hour.returncode == 0, last_hour.stderr
    assert last_hour.stdout.split() == ["new-0", "new-1"]
    four_hours = run("consume", "cli/recent", "--from=-4h", "--format", "raw", broker=broker)
    assert len(four_hours.stdout.split()) == 5
    bad = run("consume", "cli/recent", "--from", "-1x", broker=broker)
    assert bad.returncode == 1 and "-15m" in flat(bad.stderr)
    with broker.client() as client:  # the Python API takes the same form
        end = client.tail("cli/recent")
        with client.reader("cli/recent", start="-1h", end=end) as reader:
            assert [event.value for event in reader] == [b"new-0", b"new-1"]


def test_the_progress_line_counts_acknowledged_events_not_only_sent_ones() -> None:
    from slipstream.cli._produce import ProduceStats, ProgressReport

    buffer = io.StringIO()
    console = Console(file=buffer, width=200, color_system=None)
    report = ProgressReport(console, io.BytesIO(), every=0.0)
    report.update(ProduceStats("demo/x", events=196_802, acknowledged=9_651))
    report.close()
    assert "9,651 of 196,802 events acknowledged" in buffer.getvalue()

"""The torture harness end to end: a short run against the real broker finds nothing, and the
same run against a broker with producer deduplication switched off finds the duplicates.

Each test runs ``python -m slipstream.torture`` as a user would (a real broker, client
processes, faults through signals and the harness's TCP proxy) and reads its JSON result.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

# Replaces the idempotence check with "always append": the broker then stores every retry of
# an idempotent producer again, which is exactly what deduplication exists to prevent.
BROKEN_BROKER = """\
from slipstream.cli import main
from slipstream.streams._idempotence import ProducerTable

ProducerTable.check = lambda self, producer_id, epoch, sequence, count: None
main()
"""


def torture(tmp_path: Path, *args: str) -> tuple[int, dict[str, Any]]:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "slipstream.torture",
            "--json",
            "--work-dir",
            str(tmp_path / "work"),
            *args,
        ],
        capture_output=True,
        timeout=240,
        check=False,
    )
    try:
        result = json.loads(done.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"no JSON result (exit {done.returncode}):\n{done.stderr.decode()[-3000:]}")
    return done.returncode, result


def test_a_short_run_with_kills_stops_and_cuts_finds_no_anomalies(tmp_path: Path) -> None:
    code, result = torture(tmp_path, "--duration", "20", "--faults", "kill,stop,cut", "--seed", "7")
    assert result["harness_errors"] == []
    assert result["anomalies"] == dict.fromkeys(result["anomalies"], 0), result["examples"]
    assert result["ok"] is True
    assert code == 0
    assert sum(result["faults"].values()) >= 3, result["faults"]
    assert set(result["faults"]) <= {"kill", "stop", "cut"}
    counts = result["counts"]
    assert counts["acknowledged"] > 100
    assert counts["txns_committed"] > 0
    assert counts["events_read_final"] >= counts["acknowledged"]
    assert counts["events_read_live"] > 0


def test_a_broker_without_deduplication_is_caught(tmp_path: Path) -> None:
    wrapper = tmp_path / "broken_broker.py"
    wrapper.write_text(BROKEN_BROKER)
    code, result = torture(
        tmp_path,
        "--duration",
        "15",
        "--faults",
        "stop,cut",
        "--seed",
        "11",
        "--broker-command",
        f"{sys.executable} {wrapper}",
    )
    assert result["harness_errors"] == []
    assert result["anomalies"]["duplicate"] > 0, result
    assert any("idempotent" in e for e in result["examples"]["duplicate"])
    assert result["ok"] is False
    assert code == 1


def test_power_loss_under_fsync_never_is_caught(tmp_path: Path) -> None:
    # --fsync never acknowledges what only the page cache holds: a power failure loses it,
    # and the harness must say so (lost acknowledged events), as it says nothing for always.
    from slipstream.torture._powerfs import fuse_unusable

    reason = fuse_unusable()
    if reason:
        pytest.skip(reason)
    code, result = torture(
        tmp_path, "--duration", "10", "--faults", "power", "--fsync", "never", "--seed", "3"
    )
    assert result["harness_errors"] == []
    assert result["unavailable"] == {}
    assert result["faults"]["power"] >= 1
    assert result["anomalies"]["lost"] > 0, result
    assert code == 1

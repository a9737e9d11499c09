"""``slipstream stream update``: retention of an existing stream, as a user runs it."""

from __future__ import annotations

import json

from conftest import BrokerProcess
from test_cli_smoke import run

DAY_MS = 86_400_000


def test_update_retention_with_json_then_remove_a_limit(broker: BrokerProcess) -> None:
    assert run("stream", "create", "cli/orders", broker=broker).returncode == 0
    updated = run(
        "stream",
        "update",
        "cli/orders",
        "--retention-time",
        "7d",
        "--retention-bytes",
        "10GiB",
        "--json",
        broker=broker,
    )
    assert updated.returncode == 0, updated.stderr
    document = json.loads(updated.stdout)
    assert (document["retention_ms"], document["retention_bytes"]) == (7 * DAY_MS, 10 * 2**30)
    described = json.loads(run("stream", "describe", "cli/orders", "--json", broker=broker).stdout)
    assert (described["retention_ms"], described["retention_bytes"]) == (7 * DAY_MS, 10 * 2**30)

    forever = run("stream", "update", "cli/orders", "--retention-time", "forever", broker=broker)
    assert forever.returncode == 0, forever.stderr
    assert "updated cli/orders: retention 10.0 GiB" in forever.stderr
    unlimited = run(
        "stream", "update", "cli/orders", "--retention-bytes", "unlimited", broker=broker
    )
    assert "retention forever" in unlimited.stderr
    described = json.loads(run("stream", "describe", "cli/orders", "--json", broker=broker).stdout)
    assert (described["retention_ms"], described["retention_bytes"]) == (None, None)


def test_update_refuses_what_it_cannot_do_with_the_reason(broker: BrokerProcess) -> None:
    run("stream", "create", "cli/kept", "--retention-time", "1d", broker=broker)
    nothing = run("stream", "update", "cli/kept", broker=broker)
    assert nothing.returncode == 2
    said = " ".join(nothing.stderr.replace("│", " ").split())  # undo rich's box and wrapping
    assert "nothing to change: give --retention-time, --retention-bytes or both" in said
    bad = run("stream", "update", "cli/kept", "--retention-time", "soon", broker=broker)
    assert bad.returncode == 1
    assert "bad duration 'soon'" in bad.stderr
    missing = run("stream", "update", "cli/nope", "--retention-time", "1d", broker=broker)
    assert missing.returncode == 1
    assert "stream 'cli/nope' does not exist" in missing.stderr
    described = json.loads(run("stream", "describe", "cli/kept", "--json", broker=broker).stdout)
    assert described["retention_ms"] == DAY_MS


def test_update_help_teaches_the_forms() -> None:
    shown = run("stream", "update", "--help")
    assert shown.returncode == 0
    for text in ("--retention-time", "7d", "forever", "--retention-bytes", "10GiB", "unlimited"):
        assert text in shown.stdout

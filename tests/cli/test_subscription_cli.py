"""``slipstream subscription ...`` and ``slipstream consume --subscription``, run as a user
runs them: subprocesses against a real broker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
from conftest import BrokerProcess


def run(
    broker: BrokerProcess, *args: str, stdin: str = "", columns: int = 160
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "slipstream", *args, "--broker", broker.address],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "COLUMNS": str(columns)},
    )


def ok(broker: BrokerProcess, *args: str, stdin: str = "") -> str:
    done = run(broker, *args, stdin=stdin)
    assert done.returncode == 0, f"{args} -> {done.returncode}\n{done.stdout}{done.stderr}"
    assert "Traceback" not in done.stderr
    return done.stdout


def as_json(broker: BrokerProcess, *args: str) -> Any:
    return json.loads(ok(broker, *args, "--json"))


def produce(broker: BrokerProcess, stream: str, count: int, first: int = 0) -> None:
    lines = "".join(
        json.dumps({"key": f"k{i % 7}", "value": {"n": i}}) + "\n"
        for i in range(first, first + count)
    )
    ok(broker, "produce", stream, stdin=lines)


def printed(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stdout.splitlines()]


def wait_for(condition: Any, what: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := condition():
            return result
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_lifecycle_with_json_output(broker: BrokerProcess) -> None:
    ok(broker, "stream", "create", "cli/orders", "--segments", "3")
    produce(broker, "cli/orders", 30)
    created = as_json(broker, "subscription", "create", "cli/orders", "billing")
    assert created["name"] == "billing" and created["mode"] == "ordered"
    assert created["generation"] == 0 and created["backlog_events"] == 30
    assert (
        as_json(broker, "subscription", "create", "cli/orders", "billing", "--exist-ok")["name"]
        == "billing"
    )
    ok(broker, "subscription", "create", "cli/orders", "audit", "--start", "latest")
    listed = as_json(broker, "subscription", "list", "cli/orders")
    assert [(s["name"], s["mode"]) for s in listed] == [
        ("audit", "ordered"),
        ("billing", "ordered"),
    ]
    described = as_json(broker, "subscription", "describe", "cli/orders", "billing")
    assert sorted(s["segment"] for s in described["segments"]) == [0, 1, 2]
    assert all(s["position"] == 0 for s in described["segments"])
    assert sum(s["end_offset"] for s in described["segments"]) == 30
    assert described["backlog_bytes"] > 0 and described["members"] == []
    assert as_json(broker, "subscription", "describe", "cli/orders", "audit")["backlog_events"] == 0

    # a group member prints the backlog and commits it: a second run prints nothing
    events = printed(ok(broker, "consume", "cli/orders", "--subscription", "billing"))
    assert sorted(e["value"]["n"] for e in events) == list(range(30))
    assert (
        as_json(broker, "subscription", "describe", "cli/orders", "billing")["backlog_events"] == 0
    )
    assert ok(broker, "consume", "cli/orders", "--subscription", "billing") == ""
    # fan-out: the other subscription sees new events too, independently
    produce(broker, "cli/orders", 5, first=30)
    audit = printed(ok(broker, "consume", "cli/orders", "--subscription", "audit"))
    assert sorted(e["value"]["n"] for e in audit) == list(range(30, 35))

    reset = as_json(broker, "subscription", "reset", "cli/orders", "billing", "--to", "earliest")
    assert reset["generation"] == 1 and reset["backlog_events"] == 35
    again = printed(ok(broker, "consume", "cli/orders", "--subscription", "billing"))
    assert sorted(e["value"]["n"] for e in again) == list(range(35))

    ok(broker, "subscription", "delete", "cli/orders", "billing")
    assert [s["name"] for s in as_json(broker, "subscription", "list", "cli/orders")] == ["audit"]


def test_consume_with_a_limit_commits_exactly_what_it_printed(broker: BrokerProcess) -> None:
    ok(broker, "stream", "create", "cli/limit")
    produce(broker, "cli/limit", 10)  # one batch: the limit cuts it
    ok(broker, "subscription", "create", "cli/limit", "s")
    first = printed(ok(broker, "consume", "cli/limit", "--subscription", "s", "--limit", "3"))
    assert [e["offset"] for e in first] == [0, 1, 2]
    segment = as_json(broker, "subscription", "describe", "cli/limit", "s")["segments"][0]
    assert segment["position"] == 3 and segment["backlog_events"] == 7
    rest = printed(ok(broker, "consume", "cli/limit", "--subscription", "s"))
    assert [e["offset"] for e in rest] == list(range(3, 10))  # none skipped, none repeated


def test_at_most_once_commits_what_it_hands_out(broker: BrokerProcess) -> None:
    ok(broker, "stream", "create", "cli/amo", "--segments", "2")
    produce(broker, "cli/amo", 12)
    ok(broker, "subscription", "create", "cli/amo", "s")
    events = printed(
        ok(broker, "consume", "cli/amo", "--subscription", "s", "--commit", "at_most_once")
    )
    assert len(events) == 12
    assert as_json(broker, "subscription", "describe", "cli/amo", "s")["backlog_events"] == 0


def test_describe_shows_a_live_member_and_reset_restarts_it(broker: BrokerProcess) -> None:
    ok(broker, "stream", "create", "cli/live", "--segments", "2")
    produce(broker, "cli/live", 8)
    ok(broker, "subscription", "create", "cli/live", "s")
    member = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "slipstream",
            "consume",
            "cli/live",
            "--subscription",
            "s",
            "--follow",
            "--broker",
            broker.address,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:

        def settled(generation: int) -> dict[str, Any] | None:
            info = as_json(broker, "subscription", "describe", "cli/live", "s")
            caught_up = info["generation"] == generation and info["backlog_events"] == 0
            return info if caught_up and info["members"] else None

        info = wait_for(lambda: settled(0), "the member to join and commit everything")
        [joined] = info["members"]
        assert sorted(joined["segments"]) == [0, 1]
        assert {s["owner"] for s in info["segments"]} == {joined["member_id"]}
        table = ok(broker, "subscription", "describe", "cli/live", "s")
        for column in ("Position", "Backlog bytes", "Lag", "Member", "Peer", "Idle"):
            assert column in table
        assert joined["name"] in table and "In flight" not in table

        reset = as_json(broker, "subscription", "reset", "cli/live", "s", "--to", "earliest")
        assert reset["generation"] == 1 and reset["backlog_events"] == 8
        # the live member restarts from the reset and commits again under generation 1
        wait_for(lambda: settled(1), "the member to consume again after the reset")
    finally:
        member.send_signal(signal.SIGINT)
        stdout, stderr = member.communicate(timeout=30)
    assert member.returncode == 0, stderr
    offsets = sorted((e["segment"], e["offset"]) for e in printed(stdout))
    assert len(offsets) == 16 and len(set(offsets)) == 8  # every event twice: once per generation


@pytest.mark.parametrize("deleted", ["stream", "subscription"])
def test_a_member_stops_with_one_line_when_its_subscription_goes(
    broker: BrokerProcess, deleted: str
) -> None:
    ok(broker, "stream", "create", "cli/gone")
    produce(broker, "cli/gone", 3)
    ok(broker, "subscription", "create", "cli/gone", "s")
    member = subprocess.Popen(
        [
            *(sys.executable, "-m", "slipstream", "consume", "cli/gone"),
            *("--subscription", "s", "--follow", "--broker", broker.address),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(
            lambda: as_json(broker, "subscription", "describe", "cli/gone", "s")["members"],
            "the member to join",
        )
        if deleted == "stream":
            ok(broker, "stream", "delete", "cli/gone", "--yes")
        else:
            ok(broker, "subscription", "delete", "cli/gone", "s")
        stdout, stderr = member.communicate(timeout=30)
    finally:
        member.kill()
    assert member.returncode == 1
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    reasons = ("was deleted", "does not exist", "has no subscription 's'")
    assert any(reason in lines[0] for reason in reasons), lines[0]
    assert len(printed(stdout)) == 3


def test_queue_options_show_in_describe(broker: BrokerProcess) -> None:
    ok(broker, "stream", "create", "cli/jobs")
    created = as_json(
        broker,
        "subscription",
        "create",
        "cli/jobs",
        "workers",
        "--mode",
        "queue",
        "--ack-timeout",
        "1m",
        "--max-deliveries",
        "3",
        "--backoff",
        "500ms",
        "--max-unacked",
        "50",
        "--dead-letter",
        "cli/jobs-failed",
    )
    assert created["mode"] == "queue"
    assert created["options"]["ack_timeout_ms"] == 60_000
    assert created["options"]["max_deliveries"] == 3
    assert created["options"]["backoff_ms"] == 500
    assert created["options"]["max_backoff_ms"] == 60_000  # the default
    assert created["options"]["max_unacked"] == 50
    assert created["options"]["dead_letter"] == "cli/jobs-failed"
    table = ok(broker, "subscription", "describe", "cli/jobs", "workers")
    for text in ("In flight", "Waiting", "Dead-lettered", "ack timeout 1m", "cli/jobs-failed"):
        assert text in table


def test_human_units_in_describe() -> None:
    from slipstream.cli._subscriptions import human_lag

    assert [human_lag(ms) for ms in (0, 850, 4_240, 750_400, 2 * 86_400_000 + 3_723_000)] == [
        "0s",
        "850ms",
        "4.2s",
        "12m30s",
        "2d1h",
    ]


ERRORS = [
    (["subscription", "create", "cli/none", "s"], "stream 'cli/none' does not exist"),
    (["subscription", "list", "cli/none"], "stream 'cli/none' does not exist"),
    (["subscription", "describe", "cli/errs", "nope"], "has no subscription 'nope'"),
    (["subscription", "delete", "cli/errs", "nope"], "has no subscription 'nope'"),
    (["subscription", "reset", "cli/errs", "nope", "--to", "latest"], "no subscription 'nope'"),
    (["consume", "cli/errs", "--subscription", "nope"], "has no subscription 'nope'"),
    (["consume", "cli/errs", "--subscription", "jobs"], "is a work queue"),
    (["subscription", "create", "cli/errs", "taken"], "'taken' already exists"),
    (["subscription", "create", "cli/errs", "s", "--mode", "fifo"], "--mode 'fifo': use one of"),
    (["subscription", "create", "cli/errs", "s", "--start", "yesterday"], "start 'yesterday'"),
    (["subscription", "create", "cli/errs", "s", "--start", "-1x"], "bad relative time"),
    (["subscription", "reset", "cli/errs", "taken", "--to", "soon"], "start 'soon'"),
    (["subscription", "create", "cli/errs", "s", "--ack-timeout", "1m"], "add --mode queue"),
    (
        ["subscription", "create", "cli/errs", "s", "--mode", "queue", "--ack-timeout", "1y"],
        "bad duration '1y'",
    ),
    (["subscription", "create", "cli/errs", "Bad Name"], "subscription name"),
    (["consume", "cli/errs", "--subscription", "taken", "--commit", "manual"], "auto or at_most"),
    (["consume", "cli/errs", "--subscription", "taken", "--commit", "often"], "auto or at_most"),
]


@pytest.mark.parametrize(("args", "message"), ERRORS, ids=[" ".join(a) for a, _ in ERRORS])
def test_errors_are_one_line_with_a_non_zero_exit(
    broker: BrokerProcess, args: list[str], message: str
) -> None:
    with broker.client() as client:
        client.create_stream("cli/errs", exist_ok=True)
        client.create_subscription("cli/errs", "taken", exist_ok=True)
        client.create_subscription("cli/errs", "jobs", mode="queue", exist_ok=True)
    done = run(broker, *args)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert message in lines[0]
    assert done.stdout == ""


@pytest.mark.parametrize(
    "args",
    [
        ["consume", "cli/errs", "--subscription", "taken", "--from", "latest"],
        ["consume", "cli/errs", "--subscription", "taken", "--end-cut"],
        ["consume", "cli/errs", "--commit", "auto"],
        ["subscription", "reset", "cli/errs", "taken"],
    ],
)
def test_options_that_do_not_go_together_are_usage_errors(
    broker: BrokerProcess, args: list[str]
) -> None:
    done = run(broker, *args)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""


def help_text(*command: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "slipstream", *command, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "COLUMNS": "120"},
    )
    assert done.returncode == 0, done.stderr
    assert "<bool>" not in done.stdout
    return done.stdout


def test_the_group_lists_every_command() -> None:
    text = help_text("subscription")
    for command in ("create", "list", "describe", "delete", "reset"):
        assert f"│ {command} " in text


@pytest.mark.parametrize("command", ["create", "list", "describe", "delete", "reset"])
def test_every_command_has_examples(command: str) -> None:
    text = help_text("subscription", command)
    assert "Examples" in text and f" slipstream subscription {command} demo/orders" in text


def test_consume_help_shows_the_group_options() -> None:
    text = " ".join(help_text("consume").split())
    assert "--subscription" in text and "at_most_once" in text
    assert "slipstream consume demo/orders --subscription billing --follow" in text

"""``slipstream stream scale``, ``describe --history`` and the scaling policy options of
``stream create | update``, as a user runs them against a real broker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from conftest import BrokerProcess
from test_cli_smoke import run

HALF = 2**63  # the first key hash of the upper half of the key space
TOP = 2**64 - 1


def ok(*args: str, broker: BrokerProcess, stdin: str = "") -> str:
    done = run(*args, broker=broker, stdin=stdin)
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


def refused(*args: str, broker: BrokerProcess | None = None) -> str:
    """A command that must fail with exit status 1 and a one-line error; returns that line."""
    done = run(*args, broker=broker)
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    return lines[0]


def describe(name: str, broker: BrokerProcess, *extra: str) -> Any:
    return json.loads(ok("stream", "describe", name, "--json", *extra, broker=broker))


def test_split_then_merge_prints_the_epoch_and_describe_shows_sealed_segments(
    broker: BrokerProcess,
) -> None:
    ok("stream", "create", "cli/orders", "--segments", "2", broker=broker)
    lines = "".join(f'{{"user": "k{i}", "n": {i}}}\n' for i in range(40))
    ok("produce", "cli/orders", "--key-field", "user", broker=broker, stdin=lines)
    before = describe("cli/orders", broker)
    ends = {s["number"]: s["end_offset"] for s in before["segments"]}
    assert sum(ends.values()) == 40

    split = run("stream", "scale", "cli/orders", "--split", "0", "--into", "3", broker=broker)
    assert split.returncode == 0, split.stderr
    assert "scaled cli/orders to epoch 1: sealed 0, opened 2 (0000000000000000-" in split.stderr
    assert ", 3 (" in split.stderr and ", 4 (" in split.stderr

    merged = json.loads(
        ok("stream", "scale", "cli/orders", "--merge", "4", "1", "--json", broker=broker)
    )
    assert (merged["epoch"], merged["opened"]) == (2, [5])
    assert merged["segments"][5]["predecessors"] == [1, 4]
    assert (merged["segments"][5]["key_lo"], merged["segments"][5]["key_hi"]) == (
        merged["segments"][4]["key_lo"],
        TOP,
    )

    described = describe("cli/orders", broker)
    assert described["epoch"] == 2
    state = {
        s["number"]: (s["epoch"], s["sealed"], s["predecessors"]) for s in described["segments"]
    }
    assert state == {
        0: (0, True, []),
        1: (0, True, []),
        2: (1, False, [0]),
        3: (1, False, [0]),
        4: (1, True, [0]),
        5: (2, False, [1, 4]),
    }
    # a sealed segment's end is where it was sealed: every event it ever took
    assert {s["number"]: s["end_offset"] for s in described["segments"][:2]} == ends
    history = describe("cli/orders", broker, "--history")
    merge = history["epochs"][2]
    # the sealed segments are listed in key order (4 holds keys below 1's), with their ends
    assert [(s["segment"], s["end_offset"]) for s in merge["sealed"]] == [(4, 0), (1, ends[1])]

    broker_flag = ["--broker", broker.address]
    wide = subprocess.run(
        [sys.executable, "-m", "slipstream", "stream", "describe", "cli/orders", *broker_flag],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={**os.environ, "COLUMNS": "220"},  # a table squeezed into 80 columns elides cells
    )
    table = wide.stdout
    assert "epoch 2" in table
    rows = {
        line.split()[0]: line.split() for line in table.splitlines() if line.strip()[:1].isdigit()
    }
    assert rows["0"][1:3] == ["0", "sealed"] and "->" in rows["0"] and "2," in rows["0"]
    assert rows["1"][1:4] == ["0", "sealed", "->"] and rows["1"][4] == "5"
    assert rows["4"][1:3] == ["1", "sealed"]
    assert rows["5"][1:6] == ["2", "open", "<-", "1,", "4"]
    assert str(ends[0]) in rows["0"] and str(ends[1]) in rows["1"]


def test_merge_takes_commas_and_repeated_options(broker: BrokerProcess) -> None:
    ok("stream", "create", "cli/m", "--segments", "4", broker=broker)
    first = json.loads(ok("stream", "scale", "cli/m", "--merge", "0,1", "--json", broker=broker))
    assert first["opened"] == [4]
    second = json.loads(
        ok("stream", "scale", "cli/m", "--merge", "2", "--merge", "3", "--json", broker=broker)
    )
    assert second["opened"] == [5]
    assert [s["number"] for s in second["segments"] if not s["sealed"]] == [4, 5]


def test_history_text_and_json_tell_each_epoch_its_owners_and_why(broker: BrokerProcess) -> None:
    ok("stream", "create", "cli/h", "--segments", "2", broker=broker)
    lines = "".join(f'{{"user": "k{i}", "n": {i}}}\n' for i in range(30))
    ok("produce", "cli/h", "--key-field", "user", broker=broker, stdin=lines)
    ends = {s["number"]: s["end_offset"] for s in describe("cli/h", broker)["segments"]}
    ok("stream", "scale", "cli/h", "--split", "1", broker=broker)
    ok("stream", "scale", "cli/h", "--merge", "0", "2", broker=broker)

    history = describe("cli/h", broker, "--history")
    assert (history["name"], history["epoch"], history["scaling"]) == ("cli/h", 2, "")
    epochs = history["epochs"]
    assert [e["epoch"] for e in epochs] == [0, 1, 2]
    assert [e["action"] for e in epochs] == ["create", "split", "merge"]
    assert epochs[0]["reason"] is None and epochs[0]["opened"] == [0, 1]
    assert epochs[1]["sealed"] == [{"segment": 1, "end_offset": ends[1]}]
    assert epochs[1]["opened"] == [2, 3]
    assert epochs[2]["sealed"] == [
        {"segment": 0, "end_offset": ends[0]},
        {"segment": 2, "end_offset": 0},
    ]
    assert epochs[2]["opened"] == [4]
    assert all(e["reason"]["rule"] == "manual" for e in epochs[1:])
    assert epochs[1]["at_ms"] <= epochs[2]["at_ms"]

    def owners(entry: dict[str, Any]) -> list[tuple[int, int, int]]:
        return [(o["segment"], o["key_lo"], o["key_hi"]) for o in entry["owners"]]

    quarter = HALF + 2**62
    assert owners(epochs[0]) == [(0, 0, HALF - 1), (1, HALF, TOP)]
    assert owners(epochs[1]) == [(0, 0, HALF - 1), (2, HALF, quarter - 1), (3, quarter, TOP)]
    assert owners(epochs[2]) == [(4, 0, quarter - 1), (3, quarter, TOP)]

    text = ok("stream", "describe", "cli/h", "--history", broker=broker)
    blocks = text.split("\n\n")
    assert blocks[0].startswith("cli/h  epoch 2, scaling policy none")
    assert "epoch 1" in blocks[2] and "split 1 into 2, 3 (manual)" in blocks[2]
    assert f"sealed 1 (8000000000000000-ffffffffffffffff) at end offset {ends[1]}" in blocks[2]
    assert "8000000000000000-bfffffffffffffff     2  new, from 1" in blocks[2]
    assert "merged 0, 2 into 4 (manual)" in blocks[3]
    assert "0000000000000000-bfffffffffffffff     4  new, from 0, 2" in blocks[3]
    assert "c000000000000000-ffffffffffffffff     3" in blocks[3]
    assert "why: scaled by hand" in blocks[3]


def test_bad_scale_requests_are_one_line_errors(broker: BrokerProcess) -> None:
    ok("stream", "create", "cli/bad", "--segments", "3", broker=broker)
    ok("stream", "scale", "cli/bad", "--split", "0", broker=broker)
    assert "segment 0 of 'cli/bad' is sealed (successors [3, 4])" in refused(
        "stream", "scale", "cli/bad", "--split", "0", broker=broker
    )
    assert "merge adjacent segments only" in refused(
        "stream", "scale", "cli/bad", "--merge", "3", "2", broker=broker
    )
    assert "stream 'cli/bad' has no segment 9" in refused(
        "stream", "scale", "cli/bad", "--split", "9", broker=broker
    )
    assert "stream 'cli/nope' does not exist" in refused(
        "stream", "scale", "cli/nope", "--split", "0", broker=broker
    )
    assert "a split makes 2 to" in refused(
        "stream", "scale", "cli/bad", "--split", "1", "--into", "1", broker=broker
    )
    assert "--merge needs two or more adjacent segments" in refused(
        "stream", "scale", "cli/bad", "--merge", "1", broker=broker
    )
    assert "give --split SEGMENT [--into N] or --merge" in refused(
        "stream", "scale", "cli/bad", broker=broker
    )
    assert "give --split SEGMENT [--into N] or --merge" in refused(
        "stream", "scale", "cli/bad", "--split", "1", "--merge", "1", "2", broker=broker
    )
    assert "--merge takes segment numbers, got 'x'" in refused(
        "stream", "scale", "cli/bad", "--merge", "1", "x", broker=broker
    )
    assert "segments to merge follow --merge" in refused(
        "stream", "scale", "cli/bad", "1", "2", broker=broker
    )
    # nothing of the refused requests happened
    assert describe("cli/bad", broker)["epoch"] == 1
    history = describe("cli/bad", broker, "--history")
    assert [e["epoch"] for e in history["epochs"]] == [0, 1]
    assert "stream 'cli/nope' does not exist" in refused(
        "stream", "describe", "cli/nope", "--history", broker=broker
    )


def test_policy_options_on_create_and_update(broker: BrokerProcess) -> None:
    created = ok(
        "stream",
        "create",
        "cli/p",
        "--scale-by-events",
        "5000/s",
        "--scale-factor",
        "3",
        "--min-segments",
        "2",
        "--max-segments",
        "64",
        broker=broker,
    )
    assert (
        "created cli/p: 2 segments, retention forever, scaling events 5000/s factor 3 min 2 max 64"
        in created
    )
    described = describe("cli/p", broker)
    assert described["scaling"] == "events 5000/s factor 3 min 2 max 64"
    assert sum(not s["sealed"] for s in described["segments"]) == 2

    by_bytes = json.loads(
        ok("stream", "create", "cli/b", "--scale-by-bytes", "2MiB/s", "--json", broker=broker)
    )
    assert by_bytes["scaling"] == f"bytes {2 * 2**20}/s factor 2 min 1"
    plain = json.loads(
        ok("stream", "create", "cli/plain", "--segments", "3", "--json", broker=broker)
    )
    assert (plain["scaling"], len(plain["segments"])) == ("", 3)

    updated = ok(
        "stream",
        "update",
        "cli/b",
        "--scale-by-events",
        "5k/s",
        "--max-segments",
        "8",
        broker=broker,
    )
    assert "scaling events 5000/s factor 2 min 1 max 8" in updated
    assert describe("cli/b", broker)["scaling"] == "events 5000/s factor 2 min 1 max 8"
    assert "no scaling policy" in ok("stream", "update", "cli/b", "--no-scaling", broker=broker)
    assert describe("cli/b", broker)["scaling"] == ""
    fixed = json.loads(
        ok("stream", "update", "cli/plain", "--segments", "3", "--json", broker=broker)
    )
    assert fixed["scaling"] == "fixed 3"
    # a scale by hand stays within the policy
    assert "above the policy's 3 (fixed 3)" in refused(
        "stream", "scale", "cli/plain", "--split", "0", broker=broker
    )


BAD_POLICY_OPTIONS = [
    (["--scale-by-events", "-3/s"], "bad event rate '-3/s': use events per second"),
    (["--scale-by-events", "0/s"], "bad event rate '0/s'"),
    (["--scale-by-events", "fast"], "bad event rate 'fast'"),
    (["--scale-by-bytes", "lots"], "bad byte rate 'lots': use a size per second"),
    (["--scale-by-bytes", "-3/s"], "bad byte rate '-3/s'"),
    (["--scale-by-events", "5000/s", "--segments", "3"], "use --min-segments instead"),
    (["--max-segments", "4"], "need --scale-by-events or --scale-by-bytes"),
    (["--scale-by-events", "5000/s", "--scale-by-bytes", "1MiB/s"], "not both"),
    (["--scale-by-events", "5000/s", "--scale-factor", "1"], "scale_factor must be >= 2"),
    (
        ["--scale-by-events", "5000/s", "--min-segments", "4", "--max-segments", "2"],
        "max_segments must be between min_segments (4)",
    ),
]


def test_bad_policy_options_are_one_line_errors(broker: BrokerProcess) -> None:
    for options, said in BAD_POLICY_OPTIONS:
        assert said in refused("stream", "create", "cli/x", *options, broker=broker), options
    assert "does not exist" in refused("stream", "describe", "cli/x", broker=broker)


def test_update_refuses_contradicting_scaling_options(broker: BrokerProcess) -> None:
    ok("stream", "create", "cli/u", broker=broker)
    assert "--no-scaling removes the policy" in refused(
        "stream", "update", "cli/u", "--no-scaling", "--segments", "2", broker=broker
    )
    assert "bad event rate" in refused(
        "stream", "update", "cli/u", "--scale-by-events", "-3/s", broker=broker
    )
    assert describe("cli/u", broker)["scaling"] == ""


def test_history_decodes_a_decision_of_the_broker(broker: BrokerProcess) -> None:
    """A policy whose minimum is above the open segments makes the broker split (rule
    below_min) once the segment has been open 10 s; the history shows the decision's rule,
    sentence, policy and the rates it saw."""
    ok("stream", "create", "cli/auto", "--scale-by-events", "1000/s", broker=broker)
    ok(
        "stream",
        "update",
        "cli/auto",
        "--scale-by-events",
        "1000/s",
        "--min-segments",
        "2",
        broker=broker,
    )
    deadline = time.monotonic() + 60
    while describe("cli/auto", broker)["epoch"] == 0:
        assert time.monotonic() < deadline, "the broker never split to the policy's minimum"
        time.sleep(0.5)
    history = describe("cli/auto", broker, "--history")
    decision = history["epochs"][1]["reason"]
    assert decision["rule"] == "below_min"
    assert decision["action"] == "split" and decision["segments"] == [0]
    assert decision["policy"] == "events 1000/s factor 2 min 2"
    assert decision["threshold"] is None
    assert [load["segment"] for load in decision["inputs"]] == [0]
    assert set(decision["inputs"][0]["rates"]["events"]) >= {"last_10s", "last_60s", "peak_10s"}

    text = ok("stream", "describe", "cli/auto", "--history", broker=broker)
    block = text.split("\n\n")[2]
    assert "split 0 into 1, 2 (below_min)" in block
    assert f"why: {decision['reason']}" in " ".join(block.split())
    assert "policy events 1000/s factor 2 min 2" in block
    assert "segment 0 events/s: 10s 0.0" in block


def test_describe_json_names_each_segments_container(broker: BrokerProcess) -> None:
    """The container says which broker of a cluster serves a segment (``slipstream cluster``);
    describe --json gives the broker's SegmentInfo.container of every segment."""
    ok("stream", "create", "ops/placed", "--segments", "4", broker=broker)
    with broker.client() as client:
        expected = [s.container for s in client.describe_stream("ops/placed").segments]
    assert len(set(expected)) > 1  # the default 4 containers share the segments
    described = describe("ops/placed", broker)
    assert [s["container"] for s in described["segments"]] == expected

"""The ``slipstream`` command as a user runs it: a subprocess against a real broker."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import BrokerProcess, free_port

import slipstream


def run(
    *args: str, stdin: str = "", broker: BrokerProcess | None = None
) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "slipstream", *args]
    if broker is not None:
        command += ["--broker", broker.address]
    return subprocess.run(
        command, input=stdin, capture_output=True, text=True, timeout=60, check=False
    )


def test_stream_lifecycle_with_json_output(broker: BrokerProcess) -> None:
    created = run(
        "stream", "create", "cli/orders", "--segments", "3", "--retention-time", "7d", broker=broker
    )
    assert created.returncode == 0, created.stderr
    listed = json.loads(run("stream", "list", "--json", broker=broker).stdout)
    assert [s["name"] for s in listed] == ["cli/orders"]
    described = json.loads(run("stream", "describe", "cli/orders", "--json", broker=broker).stdout)
    assert len(described["segments"]) == 3
    assert described["retention_ms"] == 7 * 86_400_000
    deleted = run("stream", "delete", "cli/orders", "--yes", broker=broker)
    assert deleted.returncode == 0, deleted.stderr
    assert json.loads(run("stream", "list", "--json", broker=broker).stdout) == []


def test_produce_json_lines_and_consume_them_back(broker: BrokerProcess) -> None:
    run("stream", "create", "cli/events", "--segments", "2", broker=broker)
    lines = "\n".join(
        [
            json.dumps(
                {"key": "u1", "value": {"item": "book", "price": 12.5}, "headers": {"src": "web"}}
            ),
            json.dumps({"key": "u2", "value": "plain text", "timestamp": 1_800_000_000_000}),
            json.dumps({"key": "u1", "value": [1, 2, 3]}),
        ]
    )
    produced = run("produce", "cli/events", "--json", stdin=lines + "\n", broker=broker)
    assert produced.returncode == 0, produced.stderr
    assert json.loads(produced.stdout)["events"] == 3
    consumed = run("consume", "cli/events", "--from", "earliest", "--format", "json", broker=broker)
    assert consumed.returncode == 0, consumed.stderr
    events = [json.loads(line) for line in consumed.stdout.splitlines()]
    by_value = {json.dumps(e["value"]): e for e in events}
    assert by_value['{"item": "book", "price": 12.5}']["headers"] == {"src": "web"}
    assert by_value['"plain text"']["timestamp"] == 1_800_000_000_000
    u1 = [e["value"] for e in events if e["key"] == "u1"]
    assert u1 == [{"item": "book", "price": 12.5}, [1, 2, 3]]  # per-key order


def test_raw_lines_and_key_field(broker: BrokerProcess) -> None:
    run("stream", "create", "cli/raw", broker=broker)
    assert run("produce", "cli/raw", "--raw", stdin="alpha\nbeta\n", broker=broker).returncode == 0
    lines = '{"user": "ann", "n": 1}\n{"user": "bob", "n": 2}\n'
    assert (
        run("produce", "cli/raw", "--key-field", "user", stdin=lines, broker=broker).returncode == 0
    )
    raw = run("consume", "cli/raw", "--from", "earliest", "--format", "raw", broker=broker).stdout
    assert raw.splitlines()[:2] == ["alpha", "beta"]
    events = [
        json.loads(x)
        for x in run("consume", "cli/raw", "--format", "json", broker=broker).stdout.splitlines()
    ]
    assert [e["key"] for e in events[2:]] == ["ann", "bob"]


def test_bad_input_is_named_with_its_line_and_exit_code(broker: BrokerProcess) -> None:
    run("stream", "create", "cli/bad", broker=broker)
    bad = run("produce", "cli/bad", stdin='{"value": 1}\nnot json\n', broker=broker)
    assert bad.returncode == 1
    assert "line 2" in bad.stderr
    unknown = run("consume", "no/such", broker=broker)
    assert unknown.returncode == 1
    assert "slipstream stream create no/such" in unknown.stderr
    invalid = run("stream", "create", "NoScope", broker=broker)
    assert invalid.returncode == 1
    assert "scope/name" in invalid.stderr


def test_no_broker_tells_how_to_start_one() -> None:
    result = run("stream", "list", "--broker", f"127.0.0.1:{free_port()}")
    assert result.returncode == 1
    assert "slipstream up" in result.stderr


def test_end_cut_resumes_exactly_where_consume_stopped(broker: BrokerProcess) -> None:
    run("stream", "create", "cli/resume", "--segments", "2", broker=broker)
    run(
        "produce", "cli/resume", "--raw", stdin="".join(f"e{i}\n" for i in range(10)), broker=broker
    )
    first = run(
        "consume", "cli/resume", "--from", "earliest", "--format", "raw", "--end-cut", broker=broker
    )
    cut = first.stderr.strip().splitlines()[-1]
    run("produce", "cli/resume", "--raw", stdin="".join(f"f{i}\n" for i in range(5)), broker=broker)
    second = run("consume", "cli/resume", "--from", cut, "--format", "raw", broker=broker)
    assert sorted(second.stdout.split()) == [f"f{i}" for i in range(5)]


@pytest.mark.parametrize(
    "command",
    [
        ["up"],
        ["stream", "create"],
        ["stream", "list"],
        ["stream", "describe"],
        ["stream", "delete"],
        ["produce"],
        ["consume"],
        ["demo"],
        ["txn", "list"],
        ["txn", "abort"],
        ["txn", "status"],
        ["txn", "identities"],
    ],
)
def test_help_teaches_with_an_example(command: list[str]) -> None:
    result = run(*command, "--help")
    assert result.returncode == 0
    assert "slipstream " in result.stdout and "xample" in result.stdout


def test_demo_runs_and_stops_cleanly(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "slipstream", "demo", "--duration", "4", "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
        cwd=str(tmp_path),
    )
    assert result.returncode == 0, result.stderr
    output = " ".join((result.stdout + result.stderr).split())
    assert "demo done" in output and "consumed" in output


def test_txn_list_status_and_abort(broker: BrokerProcess) -> None:
    with broker.client() as client:
        client.create_stream("cli/txn", segments=1)
        with client.transaction("cli-app") as done:
            done.send("cli/txn", b"committed")
            done.metadata = {"offset": 7}
        open_txn = client.transaction("cli-other", timeout=300)
        open_txn.send("cli/txn", b"pending")
        open_txn.send("cli/txn", b"pending too")
        listed = json.loads(run("txn", "list", "--json", broker=broker).stdout)
        assert [(t["txn_id"], t["transactional_id"], t["state"]) for t in listed] == [
            (open_txn.txn_id, "cli-other", "open")
        ]
        table = run("txn", "list", broker=broker).stdout
        assert "cli-other" in table and "1 open transaction" in table
        status = json.loads(run("txn", "status", "cli-app", "--json", broker=broker).stdout)
        assert status["metadata"] == {"offset": 7} and status["txn_id"] == done.txn_id
        assert "never committed" in run("txn", "status", "nobody", broker=broker).stdout
        aborted = run("txn", "abort", str(open_txn.txn_id), broker=broker)
        assert aborted.returncode == 0, aborted.stderr
        assert json.loads(run("txn", "list", "--json", broker=broker).stdout) == []
        again = run("txn", "abort", str(open_txn.txn_id), broker=broker)  # retry-safe
        assert again.returncode == 0, again.stderr
        committed = run("txn", "abort", str(done.txn_id), broker=broker)
        assert committed.returncode == 1 and "already committed" in committed.stderr
        unknown = run("txn", "abort", "987654321", broker=broker)
        assert unknown.returncode == 1 and "no open transaction" in unknown.stderr
        with pytest.raises(slipstream.TransactionAborted):
            open_txn.commit()


def test_txn_identities_over_the_binary_protocol(broker: BrokerProcess) -> None:
    """ListIdentities (kind 43) through the client and ``slipstream txn identities``: every
    transactional id under a prefix, sorted, with its last commit's metadata; an id that
    began but never committed has last_txn_id -1."""
    with broker.client() as client:
        client.create_stream("cli/ids", segments=1)
        for query, batch in (("spark:q-b", 4), ("spark:q-a", 9)):
            with client.transaction(query) as txn:
                txn.send("cli/ids", b"x")
                txn.metadata = {"batch": batch}
        client.transaction("spark:q-c", timeout=300).abort()  # began, never committed
        with client.transaction("other") as txn:
            txn.send("cli/ids", b"y")
        spark = client.identities("spark:")
        assert [i.transactional_id for i in spark] == ["spark:q-a", "spark:q-b", "spark:q-c"]
        assert [i.last_txn_id >= 0 for i in spark] == [True, True, False]
        assert json.loads(spark[0].last_metadata) == {"batch": 9}
        assert {i.transactional_id for i in client.identities()} >= {"other", "spark:q-a"}
        assert client.identities("nobody") == []

    listed = json.loads(
        run("txn", "identities", "--prefix", "spark:", "--json", broker=broker).stdout
    )
    assert [(i["transactional_id"], i["metadata"]) for i in listed] == [
        ("spark:q-a", {"batch": 9}),
        ("spark:q-b", {"batch": 4}),
        ("spark:q-c", None),
    ]
    assert listed[2]["last_txn_id"] == -1 and listed[2]["committed"] is None
    table = run("txn", "identities", "--prefix", "spark:", broker=broker)
    assert table.returncode == 0, table.stderr
    assert "3 transactional ids" in table.stdout and "spark:q-b" in table.stdout
    assert "other" not in table.stdout and "never" in table.stdout


def test_cluster_of_a_standalone_broker_is_itself_holding_every_container(
    broker: BrokerProcess,
) -> None:
    """``slipstream cluster`` (DescribeCluster, kind 45): a standalone broker names itself as
    the holder of every container, in the table and in JSON; a dead first address of the
    list is skipped."""
    dead = f"127.0.0.1:{free_port()}"
    listed = run("cluster", "--json", "--broker", f"{dead},{broker.address}")
    assert listed.returncode == 0, listed.stderr
    shown = json.loads(listed.stdout)
    (me,) = shown["brokers"]
    assert shown["owners"] == [me["broker_id"]] * shown["containers"]
    assert me["containers"] == list(range(shown["containers"]))
    assert me["address"].endswith(f":{broker.port}")
    table = run("cluster", broker=broker).stdout
    assert f"{shown['containers']} containers, 1 brokers" in table

"""The audit trail of a cluster (issue 20): one hash chain per broker in the one stream
``_system/audit``, in the cluster's stores, written through whichever broker serves the stream;
``slipstream audit verify`` on any broker checks every chain; a broker killed -9 and restarted
goes on with its own chain (no fork), and the broker serving the stream can die without losing
an acknowledged record; a forged record under another broker's name, or an edited one, is
caught and its chain named."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from harness import Cluster
from objectstores import SeaweedFS
from pg import PgCluster

import slipstream
from slipstream import AuthenticationFailed, InvalidArgument, PermissionDenied
from slipstream.client._connection import Connection
from slipstream.protocol import AppendAudit, AuditHead, Message
from slipstream.security._audit import GENESIS_HASH, canonical, verify_chains

pytestmark = pytest.mark.timeout(300)

AUDIT = "_system/audit"


@pytest.fixture
def cluster(tmp_path: Path, postgres: PgCluster, seaweedfs: SeaweedFS) -> Iterator[Cluster]:
    with Cluster(
        tmp_path, postgres, seaweedfs, brokers=3, containers=3, extra=("--auth",)
    ).start() as cluster:
        yield cluster


def make_token(cluster: Cluster, subject: str) -> str:
    """An admin token signed with the cluster's keys (any broker's data directory has them)."""
    made = subprocess.run(
        [
            *(sys.executable, "-m", "slipstream", "token", "create"),
            *("--data-dir", str(cluster.brokers[0].data_dir)),
            *("--subject", subject, "--role", "admin", "--json"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert made.returncode == 0, made.stderr
    return str(json.loads(made.stdout)["token"])


def trail(client: slipstream.Client) -> list[bytes]:
    end = client.tail(AUDIT)
    with client.reader(AUDIT, start="earliest", end=end) as reader:
        return [bytes(e.value or b"") for e in reader]


def chains(values: list[bytes]) -> dict[str, list[dict[str, Any]]]:
    """The records of each broker's chain, in stream order."""
    found: dict[str, list[dict[str, Any]]] = {}
    for value in values:
        record = msgspec.json.decode(value)
        found.setdefault(record["broker"], []).append(record)
    return found


def wait_for(client: slipstream.Client, done: Any, what: str, timeout: float = 60.0) -> list[bytes]:
    """The trail once ``done(chains)`` holds (a bound against hanging, not a timing)."""
    deadline = time.monotonic() + timeout
    while True:
        values = trail(client)
        if done(chains(values)):
            return values
        assert time.monotonic() < deadline, f"{what}: {chains(values)}"
        time.sleep(0.2)


def logged(cluster: Cluster, i: int) -> list[dict[str, Any]]:
    """The audit records broker ``i`` wrote to its log (all its lives)."""
    found = []
    for line in cluster.brokers[i].log().splitlines():
        if "slipstream.audit" in line and '"prev_hash"' in line:
            found.append(json.loads(line[line.index("{") :]))
    return found


def verify(cluster: Cluster, i: int, token: str, *extra: str) -> tuple[int, dict[str, Any]]:
    """``slipstream audit verify --json`` against broker ``i`` alone."""
    result = subprocess.run(
        [
            *(sys.executable, "-m", "slipstream", "--token", token, "audit", "verify"),
            *("--json", "--broker", cluster.brokers[i].address, *extra),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.stdout, result.stderr
    return result.returncode, json.loads(result.stdout)


def audit_owner(cluster: Cluster, client: slipstream.Client) -> int:
    """The index of the broker serving the audit stream's segment."""
    container = client.describe_stream(AUDIT).segments[0].container
    owner = cluster.wait_until_all_containers_served()[container]
    return int(owner[1:])


def activity(cluster: Cluster, i: int, token: str, tag: str) -> None:
    """Audited work on broker ``i`` alone: a stream made and deleted, a failed login."""
    with slipstream.connect(cluster.brokers[i].address, token=token) as client:
        client.create_stream(f"audit/{tag}-b{i}")
        client.delete_stream(f"audit/{tag}-b{i}")
    with pytest.raises(AuthenticationFailed):
        slipstream.connect(cluster.brokers[i].address, token="not.a.token", timeout=10).close()


def ask(address: str, token: str, message: Message) -> Message:
    async def asking() -> Message:
        connection = await Connection.open(address, token=token)
        try:
            reply, _ = await connection.request(message)
        finally:
            connection.close()
        return reply

    return asyncio.run(asking())


def test_each_broker_chains_its_records_and_a_kill_9_forks_none(cluster: Cluster) -> None:
    token = make_token(cluster, "ops")
    for i in range(3):
        activity(cluster, i, token, "first")
    with slipstream.connect(cluster.addresses(), token=token) as client:
        values = wait_for(
            client,
            lambda c: all(
                sum(r["event"] == "authentication_failed" for r in c.get(f"b{i}", [])) >= 1
                and sum(r["event"] == "stream_deleted" for r in c.get(f"b{i}", [])) >= 1
                for i in range(3)
            ),
            "every broker's records in the one stream",
        )
        before = chains(values)
        assert sorted(before) == ["b0", "b1", "b2"]
        for i in range(3):
            records = before[f"b{i}"]
            assert [r["seq"] for r in records] == list(range(1, len(records) + 1))
            assert records[0]["prev_hash"] == GENESIS_HASH
            assert [r["event"] for r in records if r["event"] != "denied"] == [
                "stream_created",
                "stream_deleted",
                "authentication_failed",
            ]
            # the records in the stream are those the broker logged, hashes and all
            assert [r["hash"] for r in logged(cluster, i)] == [r["hash"] for r in records]

        # kill -9 the broker serving the stream: the others' records wait, then go to the
        # broker taking it over; the killed broker's chain resumes where the stream has it
        owner = audit_owner(cluster, client)
        cluster.kill(owner)
        others = [i for i in range(3) if i != owner]
        for i in others:
            activity(cluster, i, token, "during")
        cluster.start_broker(owner)
        for i in range(3):
            activity(cluster, i, token, "after")
        # a stream made and deleted and a failed login per round; the owner missed one
        expected = {f"b{i}": 3 * (2 if i == owner else 3) for i in range(3)}

        def complete(c: dict[str, list[dict[str, Any]]]) -> bool:
            return all(
                sum(r["event"] != "denied" for r in c.get(b, [])) >= n for b, n in expected.items()
            )

        values = wait_for(client, complete, "every record after the kill")

    after = chains(values)
    assert all(report.ok for report in verify_chains(values, trimmed=False).values())
    for name, records in after.items():
        # one chain per broker: no seq twice (no fork), no gap, each linked to the one before
        assert [r["seq"] for r in records] == list(range(1, len(records) + 1)), name
        assert records[: len(before[name])] == before[name], name
        for a, b in itertools.pairwise(records):
            assert b["prev_hash"] == a["hash"], name
    # nothing the surviving brokers logged was lost with the broker serving the stream
    for i in others:
        assert [r["hash"] for r in logged(cluster, i)] == [r["hash"] for r in after[f"b{i}"]]
    restarted = cluster.brokers[owner].log()
    resumed = f"audit chain of broker b{owner} continues after seq {len(before[f'b{owner}'])}"
    assert resumed in restarted, restarted[-3000:]

    # any broker verifies every chain
    for i in range(3):
        code, report = verify(cluster, i, token)
        assert code == 0, report
        assert report["ok"] and report["records"] == len(values)
        assert [c["broker"] for c in report["chains"]] == ["b0", "b1", "b2"]
        for chain in report["chains"]:
            records = after[chain["broker"]]
            assert chain["ok"] and chain["records"] == len(records)
            assert chain["last_seq"] == records[-1]["seq"]
            assert chain["head"] == records[-1]["hash"]


def forged(last: dict[str, Any], event: str) -> bytes:
    """A record that continues ``last``'s chain, its hash computed as a broker would."""
    import hashlib

    fields = {
        "seq": last["seq"] + 1,
        "time_ms": last["time_ms"] + 1,
        "event": event,
        "subject": "mallory",
        "peer": "127.0.0.1:1",
        "details": {},
        "prev_hash": last["hash"],
        "broker": last["broker"],
    }
    fields["hash"] = hashlib.sha256(canonical(fields)).hexdigest()
    return msgspec.json.encode(fields)


def test_a_forged_or_edited_record_is_caught_and_its_chain_named(cluster: Cluster) -> None:
    token = make_token(cluster, "ops")
    for i in range(3):
        activity(cluster, i, token, "first")
    with slipstream.connect(cluster.addresses(), token=token) as client:
        values = wait_for(
            client,
            lambda c: all(
                any(r["event"] == "authentication_failed" for r in c.get(f"b{i}", []))
                for i in range(3)
            ),
            "every broker's records",
        )
        owner = audit_owner(cluster, client)
        victim = (owner + 1) % 3
        name = f"b{victim}"
        head = chains(values)[name][-1]
        address = cluster.brokers[owner].address

        # only broker b<victim> may write its chain; an admin is not that broker
        with pytest.raises(PermissionDenied, match="only broker"):
            ask(address, token, AppendAudit(name, [forged(head, "stream_deleted")]))
        # with the broker's own identity (someone who holds the cluster's keys): a record
        # that does not continue the chain is refused, naming the head
        impostor = make_token(cluster, f"broker:{name}")
        wrong = dict(head, hash="f" * 64, seq=head["seq"] - 1)
        with pytest.raises(InvalidArgument, match="would fork it") as refused:
            ask(address, impostor, AppendAudit(name, [forged(wrong, "stream_deleted")]))
        assert refused.value.details["head_seq"] >= head["seq"]
        # the next seq, linked to a record that is not the head: refused too
        unlinked = forged(dict(head, hash="e" * 64), "stream_deleted")
        with pytest.raises(InvalidArgument, match="would fork it") as refused:
            ask(address, impostor, AppendAudit(name, [unlinked]))
        assert refused.value.details["head_hash"] == head["hash"]
        # one that does continue it is taken (it looks like the broker's own) ...
        planted = forged(head, "token_revoked")
        reply = ask(address, impostor, AppendAudit(name, [planted]))
        assert isinstance(reply, AuditHead) and reply.seq == head["seq"] + 1
        # sent again (an answer lost): the same head, nothing stored twice
        again = ask(address, impostor, AppendAudit(name, [planted]))
        assert isinstance(again, AuditHead) and (again.seq, again.hash) == (reply.seq, reply.hash)
        assert trail(client).count(planted) == 1
        # ... until the broker writes again: it finds a record it did not write and says so
        activity(cluster, victim, token, "later")
        values = wait_for(
            client,
            lambda c: any(r["event"] == "audit_chain_conflict" for r in c.get(name, [])),
            "the victim's conflict record",
        )
    conflict = next(r for r in chains(values)[name] if r["event"] == "audit_chain_conflict")
    assert conflict["seq"] == head["seq"] + 2
    assert conflict["details"]["stream_seq"] == head["seq"] + 1
    assert conflict["details"]["expected_seq"] == head["seq"]
    for i in range(3):
        code, report = verify(cluster, i, token)
        assert code == 1 and not report["ok"], report
        assert report["broker"] == name and report["problem_seq"] == conflict["seq"]
        assert "did not write" in report["problem"]
        by_name = {c["broker"]: c for c in report["chains"]}
        assert not by_name[name]["ok"]
        assert all(c["ok"] for b, c in by_name.items() if b != name)

    # an edited record in a copy of the trail (another stream): its chain (only it) is named
    other = f"b{(victim + 1) % 3}"
    copy = []
    edited_seq = None
    for value in values:
        record = msgspec.json.decode(value)
        if record["broker"] == other and record["seq"] == 2:
            record["subject"] = "mallory"
            edited_seq = record["seq"]
            value = msgspec.json.encode(record)
        copy.append(value)
    assert edited_seq == 2
    edited_at = next(
        i
        for i, v in enumerate(copy)
        if msgspec.json.decode(v)["broker"] == other and msgspec.json.decode(v)["seq"] == 2
    )
    reports = verify_chains(copy, trimmed=False)
    assert not reports[other].ok and reports[other].problem_seq == 2
    assert "was edited" in (reports[other].problem or "")
    assert reports[other].problem_index == edited_at
    with slipstream.connect(cluster.addresses(), token=token) as client:
        client.create_stream("archive/audit", segments=1)
        with client.producer("archive/audit") as producer:
            for value in copy:
                producer.send(value)
    code, report = verify(cluster, victim, token, "--stream", "archive/audit")
    assert code == 1 and not report["ok"], report
    by_name = {c["broker"]: c for c in report["chains"]}
    assert "was edited" in by_name[other]["problem"]
    assert by_name[other]["problem_seq"] == 2 and by_name[other]["problem_offset"] == edited_at
    assert not by_name[name]["ok"]  # the victim's conflict is in the copy too
    assert by_name[f"b{owner}"]["ok"]  # (owner, victim and other are the three brokers)

"""``./run.sh --cluster``'s infrastructure (examples/auctions/cluster.py) without Spark: it
starts PostgreSQL, SeaweedFS and two brokers in cluster mode, both serve containers, events
produced and read through the broker list are all there, the live view's cluster line names
both brokers; stop leaves no process behind, and a second start on the same directory resumes
the same catalog and bucket (the events are still there). The Spark path on two brokers is
tests/spark/test_standalone_cluster.py's."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from auctions import app, pipeline
from auctions.app import cluster_line
from auctions.cluster import LocalCluster
from conftest import free_port
from rich.console import Console

import slipstream

STREAM = "local/orders"
EVENTS = 400


@pytest.fixture
def base() -> Iterator[Path]:
    """Under /tmp, not pytest's tmp_path: PostgreSQL runs as the postgres user (when the tests
    run as root), which must reach its directory, and pytest's base directory is private."""
    path = Path(tempfile.mkdtemp(prefix="slipstream-localcluster-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    """The pids still running after up to ``timeout`` s (a bound, not a timing assertion:
    a process that exited may linger a moment before its parent reaps it)."""
    deadline = time.monotonic() + timeout
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if _running(pid)]
        time.sleep(0.1)
    return alive


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_the_local_cluster_starts_serves_through_the_list_stops_and_resumes(base: Path) -> None:
    ports = [(free_port(), free_port()), (free_port(), free_port())]
    cluster = LocalCluster(base / "cluster", ports, lease_ttl=2.0)
    with cluster.start():
        owners = cluster.wait_until_balanced()
        assert sorted(owners) == ["b1", "b2"]
        assert sorted(c for served in owners.values() for c in served) == [0, 1, 2, 3]
        assert all(owners.values()), owners
        with slipstream.connect(cluster.addresses) as client:
            line = cluster_line(client, cluster)
            assert line is not None
            assert f"b1 127.0.0.1:{ports[0][0]}" in line and f"b2 127.0.0.1:{ports[1][0]}" in line
            info = client.create_stream(STREAM, segments=4)
            assert {s.container for s in info.segments} == {0, 1, 2, 3}
            with client.producer(STREAM) as producer:
                receipts = [producer.send(b"%d" % i, key=f"k{i % 16}") for i in range(EVENTS)]
            assert len({r.result().segment for r in receipts}) == 4
            events = list(client.reader(STREAM, "earliest", end=client.tail(STREAM)))
            assert sorted(int(e.value) for e in events) == list(range(EVENTS))
        pids = cluster.pids()
        assert len(pids) == 4, pids  # PostgreSQL's postmaster, weed, two brokers
    assert _gone(pids) == []
    assert cluster.pids() == []
    assert not (cluster.root / "pids.json").exists()

    # a second run: the same ports, catalog and bucket; what the first stored is there
    again = LocalCluster(base / "cluster", ports, lease_ttl=2.0)
    assert again.dsn == cluster.dsn
    with again.start(), slipstream.connect(again.addresses) as client:
        events = list(client.reader(STREAM, "earliest", end=client.tail(STREAM)))
        assert sorted(int(e.value) for e in events) == list(range(EVENTS))
        pids = again.pids()
    assert _gone(pids) == []


def test_a_start_stops_what_a_killed_run_left(base: Path) -> None:
    """The launcher killed -9 leaves its servers running (they ignore the terminal's ^C in
    sessions of their own): the next start kills what the last one recorded before it starts."""
    ports = [(free_port(), free_port())]
    first = LocalCluster(base / "cluster", ports, lease_ttl=2.0).start()
    left = [p.pid for p in (first.seaweedfs.proc, first.brokers[0].proc) if p is not None]
    try:
        second = LocalCluster(base / "cluster", ports, lease_ttl=2.0)
        with second.start():
            assert second.wait_until_balanced() == {"b1": [0, 1, 2, 3]}
            assert not set(left) & set(second.pids())
        for proc in (first.seaweedfs.proc, first.brokers[0].proc):
            assert proc is not None
            proc.wait(15)  # reaped here: the killed run's children are this process's
        assert _gone(left) == []
    finally:
        for pid in left:
            if _running(pid):
                os.kill(pid, 9)
        first.postgres.stop()


def test_the_live_view_shows_the_cluster_line_and_both_consoles() -> None:
    line = "cluster: b1 127.0.0.1:7070 serves containers 0, 1 | b2 127.0.0.1:7072 serves 2, 3"
    web = "http://127.0.0.1:7071/ and http://127.0.0.1:7073/"
    view = app.render(app.Board(), pipeline.Cycle.steady(100), {}, {}, app.BidsWatch(), web, line)
    console = Console(width=100, record=True)
    console.print(view)
    text = " ".join(console.export_text().split())  # wrapped at 100 columns
    assert line in text and f"console {web}" in text
    plain = app.render(app.Board(), pipeline.Cycle.steady(100), {}, {}, app.BidsWatch(), web)
    console.print(plain)
    assert "cluster:" not in console.export_text()

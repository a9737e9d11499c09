"""What the catalog refresh costs a cluster's brokers (issue 20): every broker polls
``MetaStore.catalog_version()`` every 250 ms and, when it changed, takes in the catalog's
streams, segments, subscriptions and settings (``Controller.refresh``,
``Service.reload_settings``).

    python bench/refresh.py [--quick] [--baseline REV] [--profile] [--json out.json]

Two brokers in cluster mode (bench/cluster.py's ``ClusterBrokers``: PostgreSQL from
tests/pg.py, SeaweedFS from tests/objectstores.py) on a catalog of 100, 1,000 and 5,000
streams (4 segments and one subscription each, made through the brokers with the client). At
each size, for each broker build (``--baseline REV``: the brokers of that git revision,
from a temporary worktree, then this tree's, on the same catalog; the same run, so the ratio
holds whatever the machine's load):

* **idle**: each broker's CPU per second with nothing changing (the 250 ms version poll);
* **churn**: a client creating and deleting a stream through broker b0, one change every
  250 ms (each change moves the catalog's version, so each makes every broker refresh):
  each broker's CPU per second, and per change less the idle rate (b1 only refreshes:
  its CPU per change is one refresh's, plus the reload of subscriptions and settings);
* **one refresh, seen by a client**: b0 creates a stream, then a client of b1 alone
  describes it at once (b1 does not know it yet: it refreshes before answering, waiting
  for a refresh under way first); the median of ``TRIALS``.

``--profile``: py-spy (in the test extra's venv) samples b1 during the churn; the share of
its samples under the refresh's functions is printed.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import objects  # noqa: F401 - puts bench/ and tests/ on sys.path, as every bench does
from cluster import ClusterBrokers, cpu_of
from objects import ACCESS_KEY, SECRET_KEY, SeaweedFS

SIZES = {"full": (100, 1000, 5000), "quick": (100, 1000)}
SEGMENTS = 4
IDLE_S = 3.0
CHURN_S = 6.0
CHANGE_S = 0.25
TRIALS = 7
REPO = Path(__file__).resolve().parent.parent
#: functions whose samples py-spy's profile sums (inclusive)
PROFILED = (
    "Broker.refresh_catalog",
    "Controller.refresh",
    "_read_streams",
    "PostgresMetaStore.streams",
    "PostgresMetaStore.segment_chunks",
    "Controller._apply_catalog",
    "Service.reload_settings",
    "Subscriptions.reload",
    "PostgresMetaStore.subscriptions",
    "PostgresMetaStore.catalog_version",
)


def fill(address: str, have: int, want: int) -> None:
    """Streams ``bench/s<i>`` for i in [have, want), each with ``SEGMENTS`` segments and a
    subscription, made through the client by 4 threads."""
    import slipstream

    def again(call: Callable[[], object]) -> None:
        """``call``, again while a container is moving (a broker just started)."""
        for attempt in range(60):
            try:
                call()
                return
            except slipstream.WrongBroker:
                time.sleep(0.5)
            except (slipstream.StreamExists, slipstream.SubscriptionExists):
                if attempt:
                    return  # made by an earlier attempt
                raise
        raise RuntimeError("a container did not settle in 30 s")

    def make(indexes: range) -> None:
        with slipstream.connect(address) as client:
            for i in indexes:
                again(lambda i=i: client.create_stream(f"bench/s{i}", segments=SEGMENTS))
                again(lambda i=i: client.create_subscription(f"bench/s{i}", "sub"))

    errors: list[BaseException] = []

    def work(indexes: range) -> None:
        try:
            make(indexes)
        except BaseException as exc:
            errors.append(exc)

    threads = [  # daemons: a request that never gets its answer must not hold the bench
        threading.Thread(target=work, args=(range(have + k, want, 4),), daemon=True)
        for k in range(4)
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 600
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    if errors or any(thread.is_alive() for thread in threads):
        raise RuntimeError(f"making streams failed or hung: {errors[:1]}")


def wait_loaded(addresses: list[str], streams: int, timeout: float = 300.0) -> None:
    """Until every broker lists ``streams`` streams (the bench's) or more."""
    import slipstream

    deadline = time.monotonic() + timeout
    for address in addresses:
        with slipstream.connect(address) as client:
            while len(client.list_streams()) < streams:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{address} did not load {streams} streams")
                time.sleep(0.25)


def churn(address: str, seconds: float, stop: threading.Event) -> int:
    """Create and delete stream ``bench/churn`` through ``address``, one change every
    CHANGE_S, for ``seconds``; the number of changes."""
    import slipstream

    changes = 0
    with slipstream.connect(address) as client:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not stop.is_set():
            started = time.monotonic()
            if changes % 2 == 0:
                client.create_stream("bench/churn", segments=SEGMENTS)
            else:
                client.delete_stream("bench/churn")
            changes += 1
            time.sleep(max(0.0, CHANGE_S - (time.monotonic() - started)))
        if changes % 2:
            client.delete_stream("bench/churn")
            changes += 1
    return changes


def one_refresh(writer: str, reader: str, trials: int = TRIALS) -> list[float]:
    """Seconds from b1 being asked to describe a stream b0 has just created to its answer."""
    import slipstream

    seconds = []
    with slipstream.connect(writer) as w, slipstream.connect(reader) as r:
        for trial in range(trials):
            name = f"bench/fresh{trial}-{time.time_ns()}"
            w.create_stream(name, segments=SEGMENTS)
            started = time.perf_counter()
            r.describe_stream(name)
            seconds.append(time.perf_counter() - started)
            w.delete_stream(name)
            time.sleep(0.3)
    return seconds


def profile(pid: int, seconds: float, out: Path) -> dict:
    """py-spy's samples of ``pid`` over ``seconds``: the share under each PROFILED function
    and the top functions by own samples."""
    spy = Path(sys.executable).parent / "py-spy"
    subprocess.run(
        [str(spy), "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate",
         "200", "--format", "raw", "--output", str(out), "--nonblocking"],
        check=True, capture_output=True,
    )  # fmt: skip
    total = 0
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    for line in out.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        total += n
        frames = [f.split(" (")[0] for f in stack.split(";")]
        for name in set(frames) & set(PROFILED):
            inclusive[name] += n
        if frames:
            own[stack.split(";")[-1]] += n
    return {
        "samples": total,
        "share": {k: inclusive[k] / total for k in PROFILED if total},
        "top_own": [(f, n / total) for f, n in own.most_common(12)] if total else [],
    }


def measure(brokers: ClusterBrokers, streams: int, spy: Path | None) -> dict:
    addresses = brokers.addresses().split(",")
    wait_loaded(addresses, streams)
    time.sleep(1.0)  # the loading refreshes done
    pids = [p.proc.pid for p in brokers.peers if p.proc is not None]
    out: dict = {"load": os.getloadavg()[0]}
    before = [cpu_of(pid) for pid in pids]
    time.sleep(IDLE_S)
    idle = [(cpu_of(pid) - b) / IDLE_S for pid, b in zip(pids, before, strict=True)]
    out["idle_cpu_s_per_s"] = idle
    stop = threading.Event()
    result: list[int] = []
    worker = threading.Thread(target=lambda: result.append(churn(addresses[0], CHURN_S, stop)))
    before = [cpu_of(pid) for pid in pids]
    started = time.perf_counter()
    worker.start()
    if spy is not None:
        out["profile_b1"] = profile(pids[1], CHURN_S - 1, spy)
    worker.join()
    seconds = time.perf_counter() - started
    time.sleep(0.5)  # the last change's refresh
    seconds += 0.5
    busy = [(cpu_of(pid) - b) for pid, b in zip(pids, before, strict=True)]
    changes = result[0] if result else 0
    out["changes"] = changes
    out["churn_cpu_s_per_s"] = [b / seconds for b in busy]
    out["cpu_ms_per_change"] = [
        max(0.0, b - i * seconds) / changes * 1000 for b, i in zip(busy, idle, strict=True)
    ]
    trials = one_refresh(addresses[0], addresses[1])
    out["refresh_ms"] = sorted(t * 1000 for t in trials)[len(trials) // 2]
    out["refresh_ms_all"] = [t * 1000 for t in trials]
    return out


class Trees:
    """The broker builds compared: ``baseline`` (a worktree of REV) and this tree."""

    def __init__(self, baseline: str | None, work: Path) -> None:
        self.builds: dict[str, Path] = {}
        self.worktree: Path | None = None
        if baseline:
            self.worktree = work / "baseline"
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "add", "--detach", str(self.worktree),
                 baseline], check=True, capture_output=True,
            )  # fmt: skip
            self.builds[f"baseline {baseline}"] = self.worktree
        self.builds["this tree"] = REPO

    def close(self) -> None:
        if self.worktree is not None:
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "remove", "--force", str(self.worktree)],
                check=False, capture_output=True,
            )  # fmt: skip


def start_brokers(work: Path, dsn: str, server: SeaweedFS, bucket: str | None) -> ClusterBrokers:
    brokers = ClusterBrokers(work, dsn, server)
    if bucket is not None:  # the catalog's journal objects are in the first bucket
        brokers.bucket = bucket
    for _ in range(2):
        brokers.add()
    return brokers


def run(
    sizes: tuple[int, ...], baseline: str | None, spy: bool, work: Path, out: Path | None
) -> dict:
    from pg import PgCluster

    os.environ["AWS_ACCESS_KEY_ID"] = ACCESS_KEY  # for the broker subprocesses
    os.environ["AWS_SECRET_ACCESS_KEY"] = SECRET_KEY
    os.chdir(work)  # `python -m slipstream` puts its working directory first on sys.path
    trees = Trees(baseline, work)
    postgres = PgCluster()
    server = SeaweedFS(work / "seaweedfs")
    results: dict = {}
    started = False
    try:
        postgres.start()
        started = True
        server.start()
        dsn = postgres.dsn(postgres.create_database())
        bucket = None
        have = 0
        run_no = 0
        for size in sizes:
            for label, tree in trees.builds.items():
                os.environ["PYTHONPATH"] = str(tree)
                run_no += 1
                brokers = start_brokers(work / f"run{run_no}", dsn, server, bucket)
                bucket = brokers.bucket
                try:
                    if have < size:
                        print(f"  {size:,} streams: making {size - have:,} ...", flush=True)
                        fill(brokers.addresses(), have, size)
                        have = size
                    print(f"  {size:,} streams, {label}: measuring ...", flush=True)
                    path = work / f"spy{run_no}.txt" if spy else None
                    try:
                        result = measure(brokers, size, path)
                    except Exception as exc:
                        print(f"    {type(exc).__name__}: {exc}", flush=True)
                        result = {"error": f"{type(exc).__name__}: {exc}"}
                    results.setdefault(str(size), {})[label] = result
                    if out is not None:  # as it goes: a later failure keeps what was measured
                        out.write_text(json.dumps(results, indent=2))
                finally:
                    brokers.stop()
    finally:
        server.stop()
        if started:
            postgres.stop()
        else:
            shutil.rmtree(postgres.root, ignore_errors=True)
        trees.close()
    return results


def print_report(results: dict) -> None:
    print("\nbroker CPU (cores) idle and under churn (one catalog change every 250 ms), CPU ms")
    print("per change less idle (b1: one refresh each), one refresh as a client of b1 sees it")
    print(
        f"  {'streams':>7} {'build':24} {'idle b0':>7} {'idle b1':>7} {'churn b0':>8} "
        f"{'churn b1':>8} {'ms/chg b1':>9} {'refresh ms':>10} {'load':>5}"
    )
    for size, builds in results.items():
        for label, r in builds.items():
            if "error" in r:
                print(f"  {int(size):7,} {label:24} {r['error']}")
                continue
            print(
                f"  {int(size):7,} {label:24} {r['idle_cpu_s_per_s'][0]:7.3f} "
                f"{r['idle_cpu_s_per_s'][1]:7.3f} {r['churn_cpu_s_per_s'][0]:8.3f} "
                f"{r['churn_cpu_s_per_s'][1]:8.3f} {r['cpu_ms_per_change'][1]:9.1f} "
                f"{r['refresh_ms']:10.1f} {r['load']:5.1f}"
            )
        labels = list(builds)
        if len(labels) == 2 and not any("error" in builds[k] for k in labels):
            a, b = builds[labels[0]], builds[labels[1]]
            ratio_cpu = a["cpu_ms_per_change"][1] / max(b["cpu_ms_per_change"][1], 1e-9)
            ratio_ms = a["refresh_ms"] / max(b["refresh_ms"], 1e-9)
            print(f"  {'':7} ratio: CPU per change {ratio_cpu:.1f}x, refresh time {ratio_ms:.1f}x")
    for size, builds in results.items():
        for label, r in builds.items():
            if "profile_b1" in r and r["profile_b1"]["samples"]:
                p = r["profile_b1"]
                share = ", ".join(f"{k} {v:.0%}" for k, v in p["share"].items() if v >= 0.005)
                print(f"\n  py-spy b1, {int(size):,} streams, {label}: {p['samples']} samples")
                print(f"    under: {share}")
                for frame, v in p["top_own"][:6]:
                    print(f"    own {v:5.1%} {frame[:110]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100 and 1,000 streams only")
    parser.add_argument("--baseline", help="a git revision whose brokers to compare with")
    parser.add_argument("--profile", action="store_true", help="py-spy on b1 during churn")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    json_path = args.json.resolve() if args.json else None
    with tempfile.TemporaryDirectory(prefix="bench-refresh-") as tmp:
        sizes = SIZES["quick" if args.quick else "full"]
        try:
            results = run(sizes, args.baseline, args.profile, Path(tmp), json_path)
        finally:
            os.chdir(REPO)
    print_report(results)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()

"""The README's main job, as a user runs it: ``python -m auctions live`` with its own embedded
broker, then ``python -m auctions replay`` over what it recorded. Real processes end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
#: what ./run.sh used to print besides the job's own output
NOISE = ("Traceback", "NativeCodeLoader", "Setting default log level", "log4j profile")


def auctions(*args: str, timeout: float) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "auctions", *args, "--json"],
        cwd=EXAMPLES,
        env={**os.environ, "PYTHONPATH": str(EXAMPLES)},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for noise in NOISE:  # the run is quiet: errors only
        assert noise not in done.stderr, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_live_pipeline_runs_stops_cleanly_and_replays(tmp_path: Path) -> None:
    data_dir = str(tmp_path / "auctions")
    live = auctions(
        "live", "--duration", "90", "--rate", "500", "--data-dir", data_dir, timeout=360
    )
    # the first micro-batch of a cold Spark takes 10-40 s; windows close 15 s into the data
    assert live["bids"] >= 500 * 60
    assert live["windows"] > 0 and live["moves"] > 0
    assert live["window_bids"] <= live["bids"]
    assert live["jobs"]["job 1 windows"]["batch"] >= 1
    # the notifier group handled every price move, then left with nothing in its backlog; the
    # jobs recorded their progress in their subscriptions (the source's "subscription" option)
    consumers = live["consumers"]
    assert consumers["notifier group"] == {
        "members": 0,
        "position": live["price_moves_stored"],
        "backlog_events": 0,
        "lag_ms": 0,
        "started": True,
    }
    assert live["moves"] == live["price_moves_stored"] > 0
    assert consumers["job 1 windows"]["position"] > 0
    assert consumers["job 2 prices"]["position"] > 0

    # the live job stopped its broker: replay starts one on the same data directory
    replay = auctions("replay", "--data-dir", data_dir, timeout=240)
    assert replay["compared"] > 0
    assert replay["bids_v2"] >= replay["bids_v1"] > 0
    assert replay["same"] + len(replay["differ"]) == replay["compared"]

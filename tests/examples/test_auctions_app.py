"""The main job's pieces that need no Spark: the bid generator's prices and the defaults that
make the README's commands meet ./run.sh's data."""

from __future__ import annotations

import inspect
import itertools
import json
import math
import re
from pathlib import Path

from auctions import app, pipeline

ROOT = Path(__file__).resolve().parents[2]


def test_prices_stay_in_a_band_around_each_auction_s_level_over_a_long_run() -> None:
    generator = pipeline.BidGenerator(auctions=10, seed=1)
    lowest: dict[str, float] = {}
    highest: dict[str, float] = {}
    late: list[float] = []
    for i in range(300_000):  # the hottest auction gets about 100,000 bids
        auction, value, _ = generator.next(0)
        ratio = json.loads(value)["price"] / generator.levels[auction]
        lowest[auction] = min(lowest.get(auction, ratio), ratio)
        highest[auction] = max(highest.get(auction, ratio), ratio)
        if auction == "a000" and i >= 200_000:
            late.append(math.log(ratio))
    assert min(lowest.values()) > 0.5, lowest
    assert max(highest.values()) < 4.0, highest  # jumps of up to 60 %, and they fade
    assert abs(sum(late) / len(late)) < 0.1  # no drift: the late mean sits at the level


def test_bidding_wars_still_happen_and_fade() -> None:
    generator = pipeline.BidGenerator(auctions=1, seed=2)
    ratios = [json.loads(generator.next(0)[1])["price"] / 10.0 for _ in range(20_000)]
    jumps = sum(1 for a, b in itertools.pairwise(ratios) if b / a > 1.25)
    assert jumps > 10  # about 0.2 % of bids
    assert sum(1 for r in ratios if r > 1.25) < len(ratios) // 10  # high prices do not last


def test_the_default_data_directory_is_the_one_run_sh_uses() -> None:
    run_sh = (ROOT / "run.sh").read_text()
    match = re.search(r"cd examples\n.*--data-dir (\S+)", run_sh)
    if match is not None:
        assert (ROOT / "examples" / match.group(1)).resolve() == app.DEFAULT_DATA_DIR
    assert app.DEFAULT_DATA_DIR == ROOT / ".slipstream" / "auctions"


def test_live_and_replay_default_to_it_from_any_working_directory() -> None:
    """The README's `cd examples && python -m auctions replay`: no --data-dir needed."""
    for command in (app.live, app.replay):
        default = inspect.signature(command).parameters["data_dir"].default
        assert default == ROOT / ".slipstream" / "auctions"

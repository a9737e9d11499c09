"""The main job's pieces that need no Spark: the bid generator's prices and its rate cycle,
the elastic bids stream and the live view of its segments, the notifier group (on a real
broker) and the defaults that make the README's commands meet ./run.sh's data."""

from __future__ import annotations

import datetime as dt
import inspect
import itertools
import json
import math
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from auctions import app, pipeline
from conftest import BrokerProcess
from rich.console import Console

import slipstream

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


def move(i: int, alert: bool) -> bytes:
    end = dt.datetime(2026, 11, 24, 12, 0, tzinfo=dt.UTC) + dt.timedelta(seconds=10 * i)
    value = {"auction": f"a{i % 3}", "end": end.isoformat(), "max_price": 13.0 + i}
    return json.dumps({**value, "previous": 10.0, "change_pct": 30.0, "alert": alert}).encode()


def test_the_notifier_group_acts_on_every_price_move_and_resumes_where_it_left(
    client: slipstream.Client, broker: BrokerProcess
) -> None:
    """The live job's consumer group on auctions/price-moves, on a real broker: every move is
    handed to the board once, alerts are notified, the group's backlog (what the live view
    shows, from describe_subscription) drains to 0, and a new member resumes after the last
    committed move."""
    pipeline.create_streams(client, segments=2)
    moves = [move(i, alert=i % 3 == 0) for i in range(35)]

    def send(values: list[bytes]) -> None:
        with client.producer(pipeline.PRICE_MOVES) as producer:
            for value in values:
                producer.send(value, key=json.loads(value)["auction"])

    def status() -> dict:
        return app.consumer_status(client, *app.CONSUMERS["notifier group"])

    def wait_for(predicate: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 30
        while not predicate():
            assert time.monotonic() < deadline, status()
            time.sleep(0.05)

    send(moves[:10])  # before any member joins: the subscription (made with the streams) keeps them
    board = app.Board()
    notifier = app.Notifier(broker.address, board.on_move).start()
    wait_for(lambda: status()["members"] == 1)
    send(moves[10:30])
    wait_for(lambda: board.counts["moves"] == 30)
    notifier.close(drained=lambda: status()["backlog_events"] == 0)
    assert notifier.error is None and not notifier.thread.is_alive()
    assert status() == {
        "members": 0,
        "position": 30,
        "backlog_events": 0,
        "lag_ms": 0,
        "started": True,
    }
    assert board.counts["alerts"] == 10
    assert all(a["alert"] and a["notified_after"] > 0 for a in board.alerts)

    send(moves[30:])  # while nobody is joined: a backlog of 5, then a new member resumes
    assert status()["backlog_events"] == 5
    handled: list[dict] = []
    notifier = app.Notifier(broker.address, handled.append, name="notifier-2").start()
    wait_for(lambda: len(handled) == 5)
    notifier.close(drained=lambda: status()["backlog_events"] == 0)
    assert sorted(m["max_price"] for m in handled) == [13.0 + i for i in range(30, 35)]
    assert status()["backlog_events"] == 0


def test_the_notifier_reports_its_failure() -> None:
    notifier = app.Notifier("127.0.0.1:1", lambda move: None).start()  # nothing listens there
    notifier.thread.join(60)
    assert isinstance(notifier.error, slipstream.BrokerUnavailable)


# --- the elastic bids stream ------------------------------------------------------------------


def test_the_rush_hour_cycle_crosses_the_split_and_merge_thresholds_of_its_target() -> None:
    cycle = pipeline.Cycle.rush_hour(target=1000)
    assert [(p.name, p.seconds, p.rate) for p in cycle.phases] == [
        ("quiet", 60, 300),
        ("rush hour", 60, 5000),
        ("quiet", 750, 300),
    ]
    rush = cycle.phases[1].rate
    assert rush > 2 * 1000 * 2  # one segment splits (hot_10s), and then each half again
    assert cycle.phases[2].rate < 0.5 * 1000  # below the merge threshold for any pair
    assert cycle.phases[2].seconds > 2 * 300 + 10  # time for two rounds of merges
    assert cycle.period < 15 * 60
    # the generator's schedule is the integral of the rate, over and over
    assert cycle.due(0) == 0
    assert cycle.due(60) == 60 * 300
    assert cycle.due(70) == 60 * 300 + 10 * 5000
    assert cycle.due(cycle.period + 70) == cycle.due(cycle.period) + cycle.due(70)
    assert cycle.at(61) == (cycle.phases[1], 59)
    assert cycle.at(cycle.period + 1)[0] == cycle.phases[0]


def test_a_cycle_is_rush_hour_steady_or_phases_and_nothing_else() -> None:
    assert pipeline.Cycle.parse("rush-hour", target=200) == pipeline.Cycle.rush_hour(200)
    phases = pipeline.Cycle.parse("30:300,30:2500").phases
    assert [(p.seconds, p.rate) for p in phases] == [(30, 300), (30, 2500)]
    assert pipeline.Cycle.steady(500).due(10) == 5000
    for bad in ("rushhour", "30", "30:x", "0:100", "10:-1", ""):
        with pytest.raises(ValueError, match="cycle"):
            pipeline.Cycle.parse(bad)
    assert app.choose_cycle(None, None, 1000) == pipeline.Cycle.rush_hour(1000)
    assert app.choose_cycle(700, None, 1000) == pipeline.Cycle.steady(700)


def test_the_bids_stream_is_elastic_also_when_an_older_run_made_it_fixed(
    client: slipstream.Client,
) -> None:
    client.create_stream(pipeline.BIDS, segments=4)  # as the main job made it before
    pipeline.create_streams(client)
    info = client.describe_stream(pipeline.BIDS)
    assert info.scaling == "events 1000/s factor 2 min 1 max 8"
    assert len(info.segments) == 4  # the policy is within bounds: nothing changes at once
    pipeline.create_streams(client)  # idempotent
    assert client.describe_stream(pipeline.BIDS) == info
    pipeline.create_streams(client, target=250)  # another --target: the policy follows
    assert client.describe_stream(pipeline.BIDS).scaling == "events 250/s factor 2 min 1 max 8"
    for name in (pipeline.WINDOWS, pipeline.PRICE_MOVES):
        assert len(client.describe_stream(name).segments) == 4
        assert client.describe_stream(name).scaling == ""


def test_a_new_bids_stream_starts_with_one_segment(client: slipstream.Client) -> None:
    pipeline.create_streams(client)
    assert len(client.describe_stream(pipeline.BIDS).segments) == 1


def test_the_live_view_shows_the_bids_stream_split_in_a_rush_and_merged_when_quiet(
    broker_factory: type[BrokerProcess],
) -> None:
    """The generator's own cycle on a broker whose scaling clock runs 20 times faster
    (docs/scaling.md: the 10 s and 300 s windows take 0.5 s and 15 s; rates stay in real
    bids/s): a burst at 6 x the target splits the stream by itself (hot_*), the quiet phase
    (a fifth of the target) merges it (cold_300s), and a split by hand shows as manual. The
    live view's summary and its rendering say so."""
    broker = broker_factory()
    broker.env["SLIPSTREAM_SCALING_SPEEDUP"] = "20"
    broker.start()
    client = broker.client()
    pipeline.create_streams(client, target=100)
    board, stop, watch = app.Board(), threading.Event(), app.BidsWatch()
    cycle = pipeline.Cycle.parse("4:600,600:20", target=100)
    generator = threading.Thread(target=app.produce, args=(broker.address, cycle, stop, board))
    generator.start()
    try:
        deadline = time.monotonic() + 90
        while watch.summary()["merges"] == 0:
            assert time.monotonic() < deadline, watch.summary()
            watch.update(client)
            time.sleep(0.2)
        open_now = sorted(s.number for s in watch.open)
        client.scale_stream(pipeline.BIDS, split=open_now[0])
        watch.update(client)
    finally:
        stop.set()
        generator.join(30)
    summary = watch.summary()
    assert summary["splits"] >= 2 and summary["policy"] == "events 100/s factor 2 min 1 max 8"
    first, *_ = summary["scales"]
    assert first["action"] == "split" and first["sealed"] == [0]
    assert first["rule"].startswith("hot_") and "/s > " in first["why"]
    merge = next(s for s in summary["scales"] if s["action"] == "merge")
    assert merge["rule"] == "cold_300s" and merge["why"].startswith("peak ")
    assert len(merge["sealed"]) == 2 and len(merge["created"]) == 1
    last = summary["scales"][-1]
    assert (last["action"], last["rule"], last["why"]) == ("split", "manual", "by hand")
    assert last["sealed"] == [open_now[0]] and summary["epoch"] == last["epoch"]
    # every key hash is in exactly one open segment, and the view lists them in key order
    ranges = [(s.key_lo, s.key_hi) for s in watch.open]
    assert ranges[0][0] == 0 and ranges[-1][1] == 2**64 - 1
    assert all(hi + 1 == lo for (_, hi), (lo, _) in itertools.pairwise(ranges))
    assert summary["open_segments"] == len(watch.open) <= pipeline.MAX_BID_SEGMENTS

    console = Console(width=160, record=True)
    console.print(app.render_bids(watch, "a phase"))
    text = console.export_text()
    assert f"epoch {summary['epoch']}, {len(watch.open)} open segments" in text
    for s in watch.open:
        assert app.key_range(s) in text
    assert "cold_300s" in text and "manual" in text
    assert app.key_space_bar(watch.open, width=40).count("|") == len(watch.open) + 1

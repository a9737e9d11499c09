"""The main job's pieces that need no Spark: the bid generator's prices, the notifier group
(on a real broker) and the defaults that make the README's commands meet ./run.sh's data."""

from __future__ import annotations

import datetime as dt
import inspect
import itertools
import json
import math
import re
import time
from collections.abc import Callable
from pathlib import Path

from auctions import app, pipeline
from conftest import BrokerProcess

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

"""Receipts of a batch that sealed segments refused resolve to where each event landed, also
after a second re-route; a lost part fails only its own events."""

from __future__ import annotations

import asyncio
import concurrent.futures

import numpy as np
import pytest

from slipstream.client._producer import Acknowledgement, BulkReceipt, Receipt, _Landing
from slipstream.streams import Position


def test_a_receipt_follows_its_event_through_two_re_routes() -> None:
    loop = asyncio.new_event_loop()
    try:
        done: list[concurrent.futures.Future[int]] = []
        origin = Acknowledgement(loop)
        receipts = [Receipt(origin, 1, i) for i in range(5)]
        bulk = BulkReceipt([(origin, 1, np.array([4, 0, 1, 2, 3]))])
        # the batch of segment 1 split into segments 2 (rows 0, 2, 4) and 3 (rows 1, 3) ...
        first = _Landing(origin, 5, 2, done.append)
        to_2, to_3 = Acknowledgement(loop), Acknowledgement(loop)
        to_2.add_done_callback(lambda f: first.part_done(2, np.array([0, 2, 4]), f))
        to_3.add_done_callback(lambda f: first.part_done(3, np.array([1, 3]), f))
        # ... and segment 3 was sealed too: its part went to 4 (its row 1) and 5 (its row 0)
        second = _Landing(to_3, 2, 2, done.append)
        to_4, to_5 = Acknowledgement(loop), Acknowledgement(loop)
        to_4.add_done_callback(lambda f: second.part_done(4, np.array([1]), f))
        to_5.add_done_callback(lambda f: second.part_done(5, np.array([0]), f))
        to_2.set_result(100)
        to_5.set_result(7)
        assert not origin.done()
        to_4.set_result(40)
        assert origin.done() and set(done) == {to_3, origin}
        assert [r.result() for r in receipts] == [
            Position(2, 100),
            Position(5, 7),
            Position(2, 101),
            Position(4, 40),
            Position(2, 102),
        ]
        # input row rows[i] is event i of the batch
        assert bulk.result() == [r.result() for r in receipts[1:] + receipts[:1]]

        async def awaited() -> Position:
            return await receipts[3]

        assert loop.run_until_complete(awaited()) == Position(4, 40)
    finally:
        loop.close()


def test_a_lost_part_fails_only_its_own_events() -> None:
    loop = asyncio.new_event_loop()
    try:
        origin = Acknowledgement(loop)
        landing = _Landing(origin, 3, 2, lambda _: None)
        kept, lost = Acknowledgement(loop), Acknowledgement(loop)
        kept.add_done_callback(lambda f: landing.part_done(6, np.array([0, 2]), f))
        lost.add_done_callback(lambda f: landing.part_done(7, np.array([1]), f))
        kept.set_result(10)
        lost.set_exception(RuntimeError("storage full"))
        assert Receipt(origin, 1, 0).result() == Position(6, 10)
        assert Receipt(origin, 1, 2).result() == Position(6, 11)
        with pytest.raises(RuntimeError, match="storage full"):
            Receipt(origin, 1, 1).result()
    finally:
        loop.close()

"""Fault injection for tests: ``SLIPSTREAM_FAULT=<point>`` in a broker's environment makes it
kill itself with SIGKILL when it reaches that point (a crash at an exact step), or, for
``broker.container_dies``, makes container 0's background task fail.

Points: ``txn.before_commit_record``, ``txn.after_commit_record``, ``txn.mid_apply``,
``txn.after_apply`` (a transaction's commit); ``scale.sealing``, ``scale.before_record``,
``scale.after_record`` (a split or merge), ``scale.prepared`` (a merge across brokers whose
other brokers prepared their segments); ``journal.before_record`` (an object journal's
group uploaded, its record not yet committed); ``broker.container_dies``.
``scale.prepared_pause`` is no crash: a merge across brokers waits PREPARED_PAUSE_S between
the prepares and its record (a container moves meanwhile in the test). Nor is
``txn.held_pause``: a commit holding groups on other brokers waits HELD_PAUSE_S after its
deadline check, before its record (its holds expire meanwhile in the test). Nor is
``cluster.take_pause``: a takeover waits TAKE_PAUSE_S after its catalog read, before it
serves (a stream is created meanwhile in the test).

``SLIPSTREAM_SCALING_SPEEDUP=<factor>`` (a float > 0, default 1; for tests and demos) runs the
broker's scaling clock that many times faster: see :func:`scaling_now_ms`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

log = logging.getLogger("slipstream.faults")

FAULT = os.environ.get("SLIPSTREAM_FAULT", "")
#: how long ``scale.prepared_pause`` holds a merge between its prepares and its record
PREPARED_PAUSE_S = 3.0
#: how long ``txn.held_pause`` holds a commit record (past a hold's 5 s, with room for the test)
HELD_PAUSE_S = 20.0
#: how long ``cluster.take_pause`` holds a takeover between its catalog read and serving
TAKE_PAUSE_S = 3.0


def _speedup(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise ValueError(f"SLIPSTREAM_SCALING_SPEEDUP must be a number > 0, got {text!r}")
    return value


#: how many times faster the scaling clock runs than the real one (read once, at import)
SCALING_SPEEDUP = _speedup(os.environ.get("SLIPSTREAM_SCALING_SPEEDUP", "1"))


def scaling_now_ms() -> int:
    """The clock automatic scaling runs on (rate buckets, windows, cool-downs): the event
    loop's monotonic clock in ms, times ``SCALING_SPEEDUP``. With a speedup of 20 the rule's
    300 s window passes in 15 real seconds, so a test can watch a merge.

    The counts fed to the rate trackers are multiplied by the speedup too
    (:func:`scaled_count`): a dilated second holds 1/speedup of the events of a real one, and
    scaling them back keeps every rate in real events (bytes) per second. So a policy's target,
    the rates a decision records and ``describe --history`` mean what they mean in production,
    and a demo uses the policy it would use for real; only the windows and cool-downs shrink.
    Needs a running event loop."""
    return int(asyncio.get_running_loop().time() * 1000 * SCALING_SPEEDUP)


def scaled_count(count: int) -> int:
    """``count`` events (bytes) as the rate trackers count them (see :func:`scaling_now_ms`)."""
    return count if SCALING_SPEEDUP == 1 else round(count * SCALING_SPEEDUP)


def crash_point(name: str) -> None:
    """Kill this process (SIGKILL: nothing flushed or closed) if ``name`` is the fault."""
    if name == FAULT:
        log.warning("fault injection: killing the broker at %s", name)
        os.kill(os.getpid(), signal.SIGKILL)

"""Fault injection for tests: ``SLIPSTREAM_FAULT=<point>`` in a broker's environment makes it
kill itself with SIGKILL when it reaches that point (a crash at an exact step), or, for
``broker.container_dies``, makes container 0's background task fail.

Points: ``txn.before_commit_record``, ``txn.after_commit_record``, ``txn.mid_apply``,
``txn.after_apply`` (a transaction's commit); ``scale.sealing``, ``scale.before_record``,
``scale.after_record`` (a split or merge); ``broker.container_dies``.
"""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger("slipstream.faults")

FAULT = os.environ.get("SLIPSTREAM_FAULT", "")


def crash_point(name: str) -> None:
    """Kill this process (SIGKILL: nothing flushed or closed) if ``name`` is the fault."""
    if name == FAULT:
        log.warning("fault injection: killing the broker at %s", name)
        os.kill(os.getpid(), signal.SIGKILL)

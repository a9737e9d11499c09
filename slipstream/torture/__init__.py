"""Torture testing: faults that a kill -9 cannot show, checked against the broker's guarantees.

``slipstream.torture._powerfs.PowerFS``: a FUSE filesystem that loses, at a simulated power
failure, every write not yet made durable.

``python -m slipstream.torture``: a harness that runs a real broker under producers, readers
and random faults, then checks the whole history (``run``, ``check_history``; see ``--help``).
"""

from ._checker import ANOMALIES, Report, check_directory, check_history
from ._harness import FAULTS, Options, Outcome, run, run_sync

__all__ = [
    "ANOMALIES",
    "FAULTS",
    "Options",
    "Outcome",
    "Report",
    "check_directory",
    "check_history",
    "run",
    "run_sync",
]

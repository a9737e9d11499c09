"""Consumer group members for test_cluster_faults.py: tests/faults/consumer_worker.py's
``member`` (records every event handed out and every acknowledged commit for
group_checker.py) with one more error its commits ride through: ``WrongBroker``, answered while
the group's coordinator container moves between brokers (the member's next poll rejoins at the
new coordinator, which starts from the last committed positions, like after ``NotAssigned``).

    PYTHONPATH=tests python tests/cluster/group_worker.py member BROKERS STREAM SUBSCRIPTION
        RUN auto|manual RECORDS [--final]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "faults"))

import consumer_worker

import slipstream

consumer_worker.RETRIED = (*consumer_worker.RETRIED, slipstream.WrongBroker)

if __name__ == "__main__":
    sys.exit(consumer_worker.main())

"""A stream created while a broker takes a container over (issue 20): the takeover reads the
container's segments from the catalog, recovers them, then serves them. A stream created by
another broker between that read and serving reached the taking broker only through its
catalog refresh, which registered the new segments in the container being replaced; the
takeover then swapped in a container without them. The broker held the lease but served
nothing of the new stream's segment in it: every append, GetCut and create_subscription
that needed it was answered wrong_broker until the container moved again (bench/refresh.py
saw create_subscription calls unanswered for minutes after restarting two brokers, its
client retrying wrong_broker). ``cluster.take_pause`` holds the takeover after its read."""

from __future__ import annotations

import time
from pathlib import Path

from harness import Cluster
from objectstores import SeaweedFS
from pg import PgCluster

import slipstream

STREAM = "taking/created"
PAUSED = "paused after its catalog read"


def test_a_stream_created_during_a_takeover_is_served_by_the_taking_broker(
    tmp_path: Path, postgres: PgCluster, seaweedfs: SeaweedFS
) -> None:
    cluster = Cluster(tmp_path, postgres, seaweedfs, brokers=2, containers=2)
    cluster.brokers[1].env["SLIPSTREAM_FAULT"] = "cluster.take_pause"
    with cluster.start():
        assert sorted(cluster.wait_until_all_containers_served().values()) == ["b0", "b1"]
        assert cluster.stop(1) == 0, cluster.brokers[1].log()[-3000:]
        cluster.wait_until_all_containers_served()  # both on b0
        paused = cluster.brokers[1].log().count(PAUSED)
        cluster.start_broker(1)
        deadline = time.monotonic() + 60  # a bound against hanging, not a timing
        while cluster.brokers[1].log().count(PAUSED) == paused:
            assert time.monotonic() < deadline, cluster.logs()
            time.sleep(0.05)
        # b1 holds the lease of a container and has read its segments; the stream is new
        with slipstream.connect(cluster.brokers[0].address) as client:
            info = client.create_stream(STREAM, 2)
        assert sorted(s.container for s in info.segments) == [0, 1]
        owners = cluster.wait_until_all_containers_served()
        assert sorted(owners.values()) == ["b0", "b1"], owners
        with slipstream.connect(cluster.addresses(), reconnect_timeout=10) as client:
            # a cut of every segment: b1 must serve the segment in the container it took
            client.create_subscription(STREAM, "sub")
            with client.producer(STREAM) as producer:
                for i in range(20):  # keys over both segments
                    producer.send(b"%d" % i, key=f"k{i}").result(timeout=60)
            values = sorted(int(e.value) for e in client.reader(STREAM, end=client.tail(STREAM)))
        assert values == list(range(20))

"""Describing a stream through any broker of a cluster (issue 20): a segment's live state is
its serving broker's, so a broker asks the others; a scale made on another broker a moment ago
(before this one re-read the catalog) must not give a description whose open segments leave
keys without a segment: a producer routing by it sent keys to a sealed segment's neighbour."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import Cluster, ask
from objectstores import SeaweedFS
from pg import PgCluster
from raw import RawConnection

import slipstream
from slipstream.cluster import coordinator
from slipstream.protocol import Cut as CutReply
from slipstream.protocol import (
    DescribeStream,
    DescribeSubscription,
    GetCut,
    GroupJoined,
    JoinGroup,
    ScaleStream,
    StreamInfo,
    SubscriptionInfo,
)

STREAM = "describe/orders"
KEY_SPACE = (0, 2**64 - 1)


def _tiles_the_key_space(info: StreamInfo) -> bool:
    ranges = sorted((s.key_lo, s.key_hi) for s in info.segments if not s.sealed)
    if not ranges or ranges[0][0] != KEY_SPACE[0] or ranges[-1][1] != KEY_SPACE[1]:
        return False
    return all(hi + 1 == lo for (_, hi), (lo, _) in itertools.pairwise(ranges))


@pytest.fixture
def cluster(tmp_path: Path, postgres: PgCluster, seaweedfs: SeaweedFS) -> Iterator[Cluster]:
    with Cluster(tmp_path, postgres, seaweedfs, brokers=2, containers=4).start() as cluster:
        deadline = time.monotonic() + 60  # both brokers serve containers (a bound)
        while len(set(cluster.wait_until_all_containers_served().values())) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        yield cluster


def test_a_description_right_after_a_scale_elsewhere_covers_every_key(cluster: Cluster) -> None:
    with slipstream.connect(cluster.addresses()) as client:
        client.create_stream(STREAM, 4)
    served = cluster.wait_until_all_containers_served()
    addresses = {f"b{i}": broker.address for i, broker in enumerate(cluster.brokers)}
    for _ in range(3):
        info = ask(cluster.brokers[0].address, DescribeStream(STREAM))
        assert isinstance(info, StreamInfo)
        target = next(s for s in info.segments if not s.sealed)
        owner = served[target.container]
        other = next(a for b, a in addresses.items() if b != owner)
        scaled = ask(addresses[owner], ScaleStream(STREAM, [target.number], 2))
        assert isinstance(scaled, StreamInfo), scaled
        # at once, through the broker that did not scale (its catalog read may lag)
        seen = ask(other, DescribeStream(STREAM))
        assert isinstance(seen, StreamInfo), seen
        assert len(seen.segments) == len(scaled.segments), (seen, scaled)
        assert _tiles_the_key_space(seen), seen
        cut = ask(other, GetCut(STREAM, "latest"))
        assert isinstance(cut, CutReply), cut
        assert set(cut.positions) == {s.number for s in scaled.segments}


def test_a_subscription_description_counts_the_segments_of_every_broker(
    cluster: Cluster,
) -> None:
    """Found running ./run.sh --cluster: the auctions view's backlog and `slipstream
    subscription describe` counted only the answering broker's open segments (end 0,
    backlog and lag 0 for the others'); through either broker, each segment counts."""
    stream = "describe/backlog"
    with slipstream.connect(cluster.addresses()) as client:
        client.create_stream(stream, 4)
        client.create_subscription(stream, "g")
        with client.producer(stream) as producer:
            for i in range(40):
                producer.send(b"x", key=f"k{i}")
        ends = {s.number: s.end_offset for s in client.describe_stream(stream).segments}
        assert len({s.container for s in client.describe_stream(stream).segments}) > 1
        time.sleep(0.05)  # so that the oldest unconsumed event is at least 1 ms old
        info = client.describe_subscription(stream, "g")
    assert {s.segment: s.end_offset for s in info.segments} == ends
    assert sum(s.backlog_events for s in info.segments) == 40
    assert all(s.lag_ms > 0 for s in info.segments if s.backlog_events), info
    for broker in cluster.brokers:
        seen = ask(broker.address, DescribeSubscription(stream, "g"))
        assert isinstance(seen, SubscriptionInfo), seen
        assert {s.segment: s.backlog_events for s in seen.segments} == ends


def test_a_subscription_description_shows_the_members_through_either_broker(
    cluster: Cluster,
) -> None:
    """The members live on the broker coordinating the group: another one asks it."""
    stream, name = "describe/members", "g"
    with slipstream.connect(cluster.addresses()) as client:
        client.create_stream(stream, 4)
        client.create_subscription(stream, name)
    served = cluster.wait_until_all_containers_served()
    addresses = {f"b{i}": broker.address for i, broker in enumerate(cluster.brokers)}
    member = RawConnection(addresses[served[coordinator(f"{stream}/{name}", 4)]])
    try:
        member.receive()  # Welcome
        member.send_frame(JoinGroup(stream, name, "ordered", "worker-1", 60_000), 2)
        joined = member.receive().message
        assert isinstance(joined, GroupJoined), joined
        for address in addresses.values():
            info = ask(address, DescribeSubscription(stream, name))
            assert isinstance(info, SubscriptionInfo), info
            assert [(m.member_id, m.name) for m in info.members] == [
                (joined.member_id, "worker-1")
            ], (address, info)
    finally:
        member.close()

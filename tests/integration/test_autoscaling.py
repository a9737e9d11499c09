"""Automatic scaling on a real broker: a stream with a rate policy splits a hot segment by
itself (recording the rule and its inputs), policies are stored and changed like retention,
and bad policies get typed errors. The rule itself (windows, thresholds, no flapping) is
tested on a simulated clock in tests/streams/test_scaling.py.
"""

from __future__ import annotations

import time

import pytest
from conftest import BrokerProcess

import slipstream
from slipstream import InvalidArgument, ScalingPolicy, SegmentSealed
from slipstream.streams import ScalingDecision


def test_a_hot_segment_splits_by_itself_and_says_why(
    client: slipstream.Client, broker: BrokerProcess
) -> None:
    policy = ScalingPolicy.by_event_rate(50, scale_factor=2, min_segments=1, max_segments=4)
    created = client.create_stream("as/hot", scaling=policy)
    assert created.scaling == str(policy) and len(created.segments) == 1
    started = time.monotonic()
    sent = 0
    # about 300 events/s, six times the target: the 10 s rule fires once the window is full
    while not client.scale_history("as/hot") and time.monotonic() - started < 40:
        try:
            with client.producer("as/hot", linger_ms=1) as producer:
                for i in range(30):
                    producer.send(b"%d" % (sent + i), key=f"k{i}")
            sent += 30
        except SegmentSealed:  # a batch in flight when the segment was sealed
            pass
        time.sleep(0.1)
    waited = time.monotonic() - started
    (event,) = client.scale_history("as/hot")
    assert event.sealed.keys() == {0} and len(event.created) == 2
    decision = ScalingDecision.from_json(event.reason)
    assert decision.rule == "hot_10s" and decision.action == "split"
    assert decision.threshold == 100 and decision.policy == str(policy)
    assert decision.inputs[0].rates.events.last_10s > 100
    assert 10 <= waited < 30, waited
    info = client.describe_stream("as/hot")
    assert [s.sealed for s in info.segments] == [True, False, False]
    broker.restart()  # the policy is in the catalog
    with broker.client() as again:
        assert again.describe_stream("as/hot").scaling == str(policy)


def test_policies_are_stored_changed_and_checked(client: slipstream.Client) -> None:
    at_least_two = ScalingPolicy.by_event_rate(1000, min_segments=2)
    info = client.create_stream("as/min", scaling=at_least_two)
    assert len(info.segments) == 2  # a stream starts at its policy's minimum
    bytes_policy = ScalingPolicy.by_byte_rate(2 * 1024 * 1024, scale_factor=4, max_segments=8)
    updated = client.update_stream("as/min", scaling=bytes_policy)
    assert ScalingPolicy.from_text(updated.scaling) == bytes_policy
    assert client.update_stream("as/min", retention_time="1d").scaling == str(bytes_policy)
    assert client.update_stream("as/min", scaling="").scaling == ""
    with pytest.raises(InvalidArgument):
        client.create_stream("as/bad", scaling="events -5/s factor 2 min 1")
    with pytest.raises(InvalidArgument):
        client.create_stream("as/bad", segments=9, scaling=ScalingPolicy.fixed(4))
    # a scale by hand stays within the policy
    client.update_stream("as/min", scaling=ScalingPolicy.fixed(2))
    with pytest.raises(InvalidArgument, match="above the policy"):
        client.scale_stream("as/min", split=0)
    with pytest.raises(InvalidArgument, match="below the policy"):
        client.scale_stream("as/min", merge=[0, 1])


def test_the_decision_record_round_trips_through_the_catalog(client: slipstream.Client) -> None:
    client.create_stream("as/manual", segments=2)
    client.scale_stream("as/manual", merge=[0, 1])
    (event,) = client.scale_history("as/manual")
    assert event.reason == "manual"
    with pytest.raises(InvalidArgument):
        ScalingDecision.from_json(event.reason)
    assert event.sealed == {0: 0, 1: 0} and event.created == [2]

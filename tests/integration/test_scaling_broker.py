"""Manual scaling on a real broker: a split or merge seals the old segments at their durable
end and opens successors in a new epoch; appends to a sealed segment are refused (except the
retry of a batch it stored); follows of a sealed segment end; the epochs survive a restart and
a kill -9 at every step of a scale; bad requests get typed errors.
"""

from __future__ import annotations

import threading

import pytest
from conftest import BrokerProcess
from raw import RawConnection, batch

import slipstream
from slipstream import InvalidArgument, SegmentNotFound, StreamNotFound
from slipstream.protocol import (
    Append,
    AppendAck,
    Data,
    Done,
    Error,
    Follow,
    FollowEnded,
    InitProducer,
    ProducerGrant,
    StreamInfo,
)


def produce(client: slipstream.Client, stream: str, count: int, start: int = 0) -> None:
    with client.producer(stream, linger_ms=1) as producer:
        for i in range(start, start + count):
            producer.send(b"%d" % i, key=f"k{i % 13}")


def shape(info: StreamInfo) -> list[tuple[int, int, bool, list[int]]]:
    return [(s.number, s.epoch, s.sealed, s.predecessors) for s in info.segments]


def raw(broker: BrokerProcess) -> RawConnection:
    connection = RawConnection(broker.address)
    connection.receive()
    return connection


def ask(connection: RawConnection, message: object, cid: int, payload: bytes = b"") -> object:
    connection.send_frame(message, cid, payload)
    frame = connection.receive()
    assert frame.correlation_id == cid
    return frame.message


def test_split_then_merge_in_new_epochs(client: slipstream.Client, broker: BrokerProcess) -> None:
    client.create_stream("sc/a", segments=1)
    produce(client, "sc/a", 100)
    split = client.scale_stream("sc/a", split=0, into=2)
    assert shape(split) == [(0, 0, True, []), (1, 1, False, [0]), (2, 1, False, [0])]
    assert split.epoch == 1 and split.segments[0].end_offset == 100
    lo, hi = split.segments[1], split.segments[2]
    assert (lo.key_lo, hi.key_hi, lo.key_hi + 1) == (0, 2**64 - 1, hi.key_lo)
    merged = client.scale_stream("sc/a", merge=[1, 2])
    assert shape(merged)[3:] == [(3, 2, False, [1, 2])]
    assert [s.sealed for s in merged.segments] == [True, True, True, False]
    history = client.scale_history("sc/a")
    assert [(e.epoch, e.sealed, e.created, e.reason) for e in history] == [
        (1, {0: 100}, [1, 2], "manual"),
        (2, {1: 0, 2: 0}, [3], "manual"),
    ]
    broker.restart()  # the epochs are in the catalog
    with broker.client() as again:
        assert shape(again.describe_stream("sc/a")) == shape(merged)
        assert len(again.scale_history("sc/a")) == 2


def test_a_sealed_segment_refuses_appends_but_answers_a_retry(
    client: slipstream.Client, broker: BrokerProcess
) -> None:
    client.create_stream("sc/sealed", segments=1)
    connection = raw(broker)
    try:
        grant = ask(connection, InitProducer(None), 2)
        assert isinstance(grant, ProducerGrant)
        stored = batch(3, producer_id=grant.producer_id, producer_epoch=grant.epoch, sequence=0)
        assert ask(connection, Append("sc/sealed", 0), 3, stored) == AppendAck(0, 3)
        client.scale_stream("sc/sealed", split=0, into=3)
        assert ask(connection, Append("sc/sealed", 0), 4, stored) == AppendAck(0, 3)  # a retry
        fresh = batch(2, producer_id=grant.producer_id, producer_epoch=grant.epoch, sequence=3)
        error = ask(connection, Append("sc/sealed", 0), 5, fresh)
        assert isinstance(error, Error) and error.code == "segment_sealed"
        assert error.details == {"stream": "sc/sealed", "segment": 0, "successors": [1, 2, 3]}
        plain = ask(connection, Append("sc/sealed", 0), 6, batch(1))
        assert isinstance(plain, Error) and plain.code == "segment_sealed"
        assert ask(connection, Append("sc/sealed", 2), 7, batch(1)) == AppendAck(0, 1)
        # a follow of the sealed segment gets its events, then its end
        assert isinstance(ask(connection, Follow(1, "sc/sealed", 0, 0, None, 1 << 20), 8), Done)
        assert isinstance(connection.receive().message, Data)
        ended = connection.receive().message
        assert ended == FollowEnded(1, 3)
    finally:
        connection.close()
    with client.reader("sc/sealed", end=client.tail("sc/sealed")) as reader:
        assert sorted((e.segment, e.offset) for e in reader) == [(0, 0), (0, 1), (0, 2), (2, 0)]


def test_a_follow_at_the_tail_ends_when_its_segment_is_sealed(
    client: slipstream.Client, broker: BrokerProcess
) -> None:
    client.create_stream("sc/tail", segments=1)
    produce(client, "sc/tail", 5)
    connection = raw(broker)
    try:
        ask(connection, Follow(1, "sc/tail", 0, 0, None, 1 << 20), 2)
        assert isinstance(connection.receive().message, Data)
        client.scale_stream("sc/tail", split=0)
        assert connection.receive().message == FollowEnded(1, 5)
    finally:
        connection.close()


def test_bad_scale_requests_get_typed_errors(client: slipstream.Client) -> None:
    client.create_stream("sc/bad", segments=3)
    with pytest.raises(StreamNotFound):
        client.scale_stream("sc/missing", split=0)
    client.create_stream("sc/deleted", segments=2)
    client.delete_stream("sc/deleted")
    with pytest.raises(StreamNotFound):
        client.scale_stream("sc/deleted", merge=[0, 1])
    with pytest.raises(SegmentNotFound):
        client.scale_stream("sc/bad", split=7)
    with pytest.raises(InvalidArgument, match="2 to 64"):
        client.scale_stream("sc/bad", split=0, into=1)
    with pytest.raises(InvalidArgument, match="neighbours"):
        client.scale_stream("sc/bad", merge=[0, 2])
    with pytest.raises(InvalidArgument, match="twice"):
        client.scale_stream("sc/bad", merge=[1, 1])
    with pytest.raises(InvalidArgument):
        client.scale_stream("sc/bad")
    client.scale_stream("sc/bad", split=1)
    with pytest.raises(InvalidArgument, match="sealed"):
        client.scale_stream("sc/bad", split=1)
    assert client.describe_stream("sc/bad").epoch == 1


def test_a_scale_waits_for_a_transaction_staged_in_the_segment(
    client: slipstream.Client,
) -> None:
    client.create_stream("sc/txn", segments=1)
    txn = client.transaction("scaler")
    txn.send("sc/txn", b"staged", key="k")
    txn.flush()

    done: list[StreamInfo] = []
    scaling = threading.Thread(target=lambda: done.append(client.scale_stream("sc/txn", split=0)))
    scaling.start()
    scaling.join(0.5)
    assert not done  # the transaction staged into segment 0 is still open
    txn.commit()
    scaling.join(30)
    assert done and done[0].segments[0].end_offset == 1  # the commit landed before the seal


@pytest.mark.parametrize("point", ["scale.sealing", "scale.before_record", "scale.after_record"])
def test_a_kill_9_at_any_step_of_a_scale_leaves_one_epoch_or_the_other(
    broker_factory: type[BrokerProcess], point: str
) -> None:
    broker = broker_factory()
    broker.env["SLIPSTREAM_FAULT"] = point
    broker.start()
    with broker.client() as client:
        client.create_stream("sc/kill", segments=2)
        produce(client, "sc/kill", 200)
        with (
            slipstream.connect(broker.address, reconnect_timeout=0.5) as doomed,
            pytest.raises(slipstream.BrokerUnavailable),
        ):
            doomed.scale_stream("sc/kill", merge=[0, 1])
    assert broker.proc is not None and broker.proc.wait(10) == -9
    broker.env.clear()
    broker.start()
    with broker.client() as client:
        info = client.describe_stream("sc/kill")
        if point == "scale.after_record":
            assert shape(info) == [(0, 0, True, []), (1, 0, True, []), (2, 1, False, [0, 1])]
        else:  # nothing of the scale happened: the old segments take appends again
            assert shape(info) == [(0, 0, False, []), (1, 0, False, [])]
        with client.reader("sc/kill", end=client.tail("sc/kill")) as reader:
            assert sorted(int(e.value) for e in reader) == list(range(200))
        produce(client, "sc/kill", 10, start=200)  # appends go on, to the open segments
        assert sum(s.end_offset for s in client.describe_stream("sc/kill").segments) == 210

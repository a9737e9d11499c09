"""A hypothesis state machine against a real broker process: random interleavings of appends
with random keys, splits, merges, clean restarts, kill -9s and reads; per-key order and
completeness hold for every reader (issue 17, "Tests").

The pure-graph machine (tests/streams/test_graph.py) checks the successor rule on a model;
this one checks the product: one idempotent producer, opened at the start and kept across
every scale and restart (so its batches meet sealed segments and are re-routed), appends
events whose value is its key's sequence number, and each ``append`` flushes, so every event
sent is acknowledged. After any steps,

* a reader from the earliest events to the tail,
* a reader from a StreamCut taken earlier in the run (before later scales and restarts),
* a consumer group member of a new subscription that starts at such a cut, and
* a member of one subscription that lives through the whole run, reading on from its commit,

each get every acknowledged event after their start exactly once, each key's in append
order: a key's values as read are exactly ``start, start + 1, ..., sent - 1``. Bad scale
requests on whatever graph the run reached (a sealed segment split, non-neighbours merged)
get InvalidArgument and change nothing.
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from collections.abc import Iterable

import pytest
from conftest import BrokerProcess
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import slipstream
from slipstream import Event, InvalidArgument, StreamCut
from slipstream.client import _consumer, _reader
from slipstream.protocol import SegmentInfo, StreamInfo

KEYS = [f"k{i}" for i in range(12)]
MAX_OPEN = 6  # splits stop here: a deeper graph costs time and finds nothing new
MAX_RESTARTS = 2  # per example: a broker start costs 1-3 s on a loaded machine
READ_TIMEOUT_S = 60.0
runs = itertools.count()
#: events sent right before a scale and acknowledged after it
in_flight = st.lists(st.sampled_from(KEYS), max_size=30)


@pytest.fixture(autouse=True)
def _small_credit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A few KiB of credit per follow, so a segment's events arrive over several pushes: a
    successor followed too early interleaves with its predecessor's rest (with the default
    32 MiB a small predecessor arrives whole in one push, which can hide that bug)."""
    for module in (_reader, _consumer):
        monkeypatch.setattr(module, "CREDIT_BYTES", 4 * 1024)
        monkeypatch.setattr(module, "MIN_SEGMENT_CREDIT", 1024)


def by_key(events: Iterable[Event]) -> dict[str, list[int]]:
    got: dict[str, list[int]] = defaultdict(list)
    for event in events:
        assert event.key is not None
        got[event.key.decode()].append(int(event.value))
    return dict(got)


def open_segments(info: StreamInfo) -> list[SegmentInfo]:
    """The open segments in key order (they tile the key space)."""
    return sorted((s for s in info.segments if not s.sealed), key=lambda s: s.key_lo)


def neighbours(info: StreamInfo) -> list[tuple[int, int]]:
    ordered = open_segments(info)
    return [(a.number, b.number) for a, b in itertools.pairwise(ordered)]


def shape(info: StreamInfo) -> list[tuple[int, int, bool, list[int], int, int]]:
    return [
        (s.number, s.epoch, s.sealed, s.predecessors, s.key_lo, s.key_hi) for s in info.segments
    ]


def commit_progress(consumer: slipstream.Consumer) -> None:
    """Commit the segments whose position moved since their last commit. (Not a plain
    ``commit()``: a sealed segment committed to its end is released by the broker at once,
    and until the consumer's next assignment poll tells it so, committing it again raises
    NotAssigned.)"""
    moved = {s: p for s, p in consumer.positions().items() if consumer.committed.get(s) != p}
    if moved:
        consumer.commit(moved)


class ScalingMachine(RuleBasedStateMachine):
    """One stream per example on a broker shared by the examples (restarted by the rules)."""

    def __init__(self, broker: BrokerProcess) -> None:
        super().__init__()
        self.broker = broker
        if broker.proc is None or broker.proc.poll() is not None:
            broker.start()  # an earlier example failed while the broker was down
        self.stream = f"stateful/run{next(runs)}"
        self.client = broker.client()
        self.producer: slipstream.Producer | None = None
        self.info: StreamInfo | None = None
        #: per key, how many events were acknowledged (the next value to send)
        self.sent: dict[str, int] = defaultdict(int)
        #: StreamCuts taken during the run (as JSON, as an application stores them) with
        #: what had been acknowledged per key when each was taken
        self.cuts: list[tuple[str, dict[str, int]]] = []
        #: per key, how far the long-lived subscription has consumed and committed
        self.consumed: dict[str, int] = defaultdict(int)
        self.subscriptions = itertools.count()
        self.restarts = 0
        #: what this run did, printed with a failure: a replay of a real broker run may
        #: pass (timing), and then Hypothesis reports only that the replay differed
        self.steps: list[str] = []

    # --- setup and bookkeeping -------------------------------------------------------------

    @initialize(segments=st.integers(1, 3))
    def create_stream(self, segments: int) -> None:
        self.info = self.client.create_stream(self.stream, segments=segments)
        self.steps.append(f"create_stream({segments})")
        self.client.create_subscription(self.stream, "steady", start="earliest")
        self.producer = self.client.producer(self.stream, linger_ms=1, batch_bytes=512)
        self.cuts.append((self.client.tail(self.stream).to_json(), {}))

    def teardown(self) -> None:
        try:
            if self.producer is not None:
                self.producer.close()
        finally:
            self.client.close()

    def describe(self) -> StreamInfo:
        self.info = self.client.describe_stream(self.stream)
        return self.info

    # --- writes and scales -----------------------------------------------------------------

    def fail(self, message: str) -> None:
        lines = [message, "after these steps of this run:", *self.steps, "segments:"]
        lines += [str(s) for s in shape(self.info)] if self.info is not None else []
        report = "\n".join(lines)
        print(report)  # shown under "Captured stdout call" whatever Hypothesis reports
        raise AssertionError(report)

    def send(self, keys: list[str]) -> None:
        assert self.producer is not None
        for key in keys:
            self.producer.send(b"%d" % self.sent[key], key=key)
            self.sent[key] += 1

    def acknowledge(self) -> None:
        """Flush: every event sent is acknowledged (flush raises otherwise)."""
        assert self.producer is not None
        self.producer.flush(30)

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=20))
    def append_a_few(self, keys: list[str]) -> None:
        self.send(keys)
        self.acknowledge()
        self.steps.append(f"append({keys})")

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=50, max_size=300))
    def append_many(self, keys: list[str]) -> None:
        """Enough for several pushes of a follow (the credit is small)."""
        self.send(keys)
        self.acknowledge()
        self.steps.append(f"append({len(keys)} events)")

    @precondition(lambda self: self.info is not None and len(open_segments(self.info)) < MAX_OPEN)
    @rule(data=st.data(), into=st.integers(2, 3), during=in_flight)
    def split(self, data: st.DataObject, into: int, during: list[str]) -> None:
        """Split an open segment, with the events ``during`` sent just before and
        acknowledged after: some meet the seal in flight or buffered, and are re-routed."""
        assert self.info is not None
        before = self.info
        segment = data.draw(st.sampled_from([s.number for s in open_segments(before)]))
        self.send(during)
        after = self.client.scale_stream(self.stream, split=segment, into=into)
        self.acknowledge()
        self.steps.append(f"split({segment}, into={into}, during={during})")
        created = after.segments[len(before.segments) :]
        assert after.epoch == before.epoch + 1
        assert [s.predecessors for s in created] == [[segment]] * into
        sealed = next(s for s in after.segments if s.number == segment)
        assert sealed.sealed and (created[0].key_lo, created[-1].key_hi) == (
            sealed.key_lo,
            sealed.key_hi,
        )
        self.info = after

    @precondition(lambda self: self.info is not None and len(open_segments(self.info)) >= 2)
    @rule(data=st.data(), reverse=st.booleans(), during=in_flight)
    def merge(self, data: st.DataObject, reverse: bool, during: list[str]) -> None:
        """Merge two neighbouring open segments (named in either order), with events
        in flight as for :meth:`split`."""
        assert self.info is not None
        before = self.info
        pair = data.draw(st.sampled_from(neighbours(before)))
        self.send(during)
        after = self.client.scale_stream(self.stream, merge=pair[::-1] if reverse else pair)
        self.acknowledge()
        self.steps.append(f"merge({pair}, during={during})")
        created = after.segments[len(before.segments) :]
        assert after.epoch == before.epoch + 1
        assert [sorted(s.predecessors) for s in created] == [sorted(pair)]
        self.info = after

    @precondition(lambda self: self.restarts < MAX_RESTARTS)
    @rule(kill=st.booleans())
    def restart_broker(self, kill: bool) -> None:
        """kill -9 (acknowledged events are durable) or a clean stop; the client and the
        producer reconnect by themselves."""
        before = self.info
        self.restarts += 1
        self.steps.append(f"restart(kill={kill})")
        if kill:
            self.broker.kill()
        else:
            assert self.broker.stop() == 0, self.broker.log()[-3000:]
        self.broker.start()
        assert before is not None and shape(self.describe()) == shape(before)

    @rule()
    def take_cut(self) -> None:
        self.cuts.append((self.client.tail(self.stream).to_json(), dict(self.sent)))
        self.steps.append(f"take_cut() -> cut {len(self.cuts) - 1}")

    @rule(data=st.data())
    def refuse_bad_scales(self, data: st.DataObject) -> None:
        """Bad scale requests on the graph as it is now get typed errors and change nothing."""
        before = self.describe()
        sealed = [s.number for s in before.segments if s.sealed]
        if sealed:
            with pytest.raises(InvalidArgument, match="sealed"):
                self.client.scale_stream(self.stream, split=data.draw(st.sampled_from(sealed)))
        ordered = [s.number for s in open_segments(before)]
        apart = [(a, b) for i, a in enumerate(ordered) for b in ordered[i + 2 :]]
        if apart:
            with pytest.raises(InvalidArgument, match="neighbours"):
                self.client.scale_stream(self.stream, merge=data.draw(st.sampled_from(apart)))
        assert shape(self.describe()) == shape(before)

    # --- reads: each checks exactly-once and per-key order ---------------------------------

    def check(self, who: str, events: list[Event], since: dict[str, int]) -> None:
        got = by_key(events)
        for key in sorted(set(got) | set(self.sent)):
            expected = list(range(since.get(key, 0), self.sent.get(key, 0)))
            if got.get(key, []) != expected:
                self.fail(f"{who}, key {key}: read {got.get(key)}, expected {expected}")

    @rule(data=st.data())
    def read(self, data: st.DataObject) -> None:
        """A reader from the earliest events and one from a cut taken earlier (round-tripped
        through JSON, as an application stores it), both to the tail."""
        with self.client.reader(self.stream, "earliest", self.client.tail(self.stream)) as reader:
            self.check("a reader from the earliest events", list(reader), {})
        text, then = data.draw(st.sampled_from(self.cuts))
        self.steps.append(f"read(from earliest; from {text})")
        start = StreamCut.from_json(text)
        with self.client.reader(self.stream, start, self.client.tail(self.stream)) as reader:
            self.check(f"a reader from the cut {text}", list(reader), then)

    def consume_all(self, subscription: str, count: int) -> list[Event]:
        """``count`` events of one member of ``subscription``, committing as it goes (a
        successor is granted only once its predecessors are committed to their ends); then a
        short poll to see that nothing more arrives."""
        events: list[Event] = []
        with self.client.consumer(self.stream, subscription, commit="manual") as consumer:
            deadline = time.monotonic() + READ_TIMEOUT_S
            while len(events) < count:
                if time.monotonic() > deadline:
                    self.fail(
                        f"{subscription}: {len(events)} of {count} events, holding "
                        f"{consumer.assignment}: {by_key(events)}"
                    )
                events.extend(consumer.poll(0.05))
                commit_progress(consumer)
            events.extend(consumer.poll(0.05))
            commit_progress(consumer)
        return events

    @rule(data=st.data())
    def consume(self, data: st.DataObject) -> None:
        """A member of a new subscription that starts at a cut taken earlier, and one of the
        subscription that lives through the run, reading on from its last commit (across
        every scale and restart since)."""
        text, then = data.draw(st.sampled_from(self.cuts))
        name = f"from-cut-{next(self.subscriptions)}"
        self.steps.append(f"consume({name} from {text}; steady)")
        self.client.create_subscription(self.stream, name, start=StreamCut.from_json(text))
        expected = sum(self.sent.values()) - sum(then.values())
        events = self.consume_all(name, expected)
        self.check(f"a new subscription at the cut {text}", events, then)
        expected = sum(self.sent.values()) - sum(self.consumed.values())
        events = self.consume_all("steady", expected)
        self.check("the long-lived subscription", events, self.consumed)
        self.consumed = defaultdict(int, self.sent)

    @invariant()
    def the_open_segments_tile_the_key_space(self) -> None:
        if self.info is not None:
            ordered = open_segments(self.info)
            assert ordered[0].key_lo == 0 and ordered[-1].key_hi == 2**64 - 1
            assert all(a.key_hi + 1 == b.key_lo for a, b in itertools.pairwise(ordered))


def test_random_appends_scales_restarts_and_reads_keep_every_keys_order(
    broker_factory: type[BrokerProcess],
) -> None:
    broker = broker_factory().start()
    run_state_machine_as_test(
        lambda: ScalingMachine(broker),
        settings=settings(
            max_examples=16,
            stateful_step_count=30,
            deadline=None,
            # No shrinking: a replay of a real broker run is not deterministic (timing), and
            # shrinking one costs minutes; a failure prints its run's steps as they were.
            phases=[Phase.explicit, Phase.reuse, Phase.generate],
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )

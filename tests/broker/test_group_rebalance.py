"""The group coordinator's rebalancing protocol (slipstream/broker/_groups.py ``Group``), driven
by a hypothesis state machine: members join, leave and vanish, poll at random and release what
they are told to revoke, in any interleaving.

Invariants after every step: a segment is held by at most one member, and only by a live one;
a poll never grants a segment that another member still holds (the old holder must release it
first, so two members never read one segment at once). And liveness: once everyone has polled
and released what was revoked, every segment is held, the load is balanced, and what did not
have to move never stopped being held.
"""

from __future__ import annotations

import types

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from slipstream.broker._groups import Group, Member
from slipstream.storage import SubscriptionRecord

SEGMENTS = 6


def fake_stream() -> types.SimpleNamespace:
    segment = types.SimpleNamespace(start_offset=0, next_offset=0, predecessors=(), sealed=False)
    return types.SimpleNamespace(name="s/x", segments=dict.fromkeys(range(SEGMENTS), segment))


class Rebalancing(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        record = SubscriptionRecord(1, "g", "ordered", 0, {})
        self.group = Group(record, fake_stream())  # type: ignore[arg-type]
        self.ids = iter(range(1, 10_000))
        self.told: dict[int, tuple[frozenset[int], frozenset[int]]] = {}  # what each was told
        self.reading: dict[int, set[int]] = {}  # what each member reads (as a client would)

    def _poll(self, member: Member) -> None:
        before = dict(self.group.holder)
        _, held, revoke = self.group.view(member)
        for segment, owner in self.group.holder.items():
            if segment in before and before[segment] != owner:
                raise AssertionError(f"segment {segment} taken from {before[segment]}")
        self.told[member.id] = (held, revoke)
        self.reading[member.id] = set(held)  # revoked ones: stopped at once

    @rule()
    def join(self) -> None:
        member_id = next(self.ids)
        member = Member(member_id, f"m{member_id}", None, self.group, 10.0, 0.0)  # type: ignore[arg-type]
        self.group.members[member_id] = member
        self.reading[member_id] = set()

    @precondition(lambda self: self.group.members)
    @rule(data=st.data())
    def poll(self, data: st.DataObject) -> None:
        member = data.draw(st.sampled_from(sorted(self.group.members.values(), key=lambda m: m.id)))
        self._poll(member)

    @precondition(lambda self: self.group.members)
    @rule(data=st.data())
    def release_revoked(self, data: st.DataObject) -> None:
        member = data.draw(st.sampled_from(sorted(self.group.members.values(), key=lambda m: m.id)))
        _, revoke = self.told.get(member.id, (frozenset(), frozenset()))
        for segment in revoke:
            if self.group.holder.get(segment) == member.id:
                del self.group.holder[segment]
        self.told[member.id] = (self.told.get(member.id, (frozenset(),))[0], frozenset())

    @precondition(lambda self: self.group.members)
    @rule(data=st.data())
    def leave_or_vanish(self, data: st.DataObject) -> None:
        member = data.draw(st.sampled_from(sorted(self.group.members.values(), key=lambda m: m.id)))
        self.group.remove(member)
        self.reading.pop(member.id, None)

    @invariant()
    def one_holder_per_segment_and_only_live_ones(self) -> None:
        assert set(self.group.holder.values()) <= set(self.group.members)
        readers: dict[int, int] = {}
        for member_id, segments in self.reading.items():
            for segment in segments:
                if self.group.holder.get(segment) == member_id:
                    assert segment not in readers, f"segment {segment} read by two members"
                    readers[segment] = member_id

    @invariant()
    def settles_balanced_when_everyone_cooperates(self) -> None:
        if not self.group.members:
            return
        # simulate a quiet period on a copy: everyone polls and releases until nothing changes
        holder = dict(self.group.holder)
        members = sorted(self.group.members.values(), key=lambda m: m.id)
        for _ in range(4):
            for member in members:
                _, _, revoke = self.group.view(member)
                for segment in revoke:
                    del self.group.holder[segment]
        for member in members:
            self.group.view(member)
        loads = [list(self.group.holder.values()).count(m.id) for m in members]
        assert len(self.group.holder) == SEGMENTS
        assert max(loads) - min(loads) <= 1
        # sticky: each member keeps as much of what it held as its final share allows
        for member, load in zip(members, loads, strict=True):
            before = {s for s, m in holder.items() if m == member.id}
            kept = {s for s in before if self.group.holder.get(s) == member.id}
            assert len(kept) >= min(len(before), load), (member.id, before, kept)
        self.group.holder = holder  # back to the state under test


Rebalancing.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
TestRebalancing = Rebalancing.TestCase

"""The access rule engine (slipstream/security/_rules.py): pure, no broker."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream import InvalidArgument
from slipstream.security import Action, Principal, Role
from slipstream.security._rules import (
    Rule,
    Rules,
    check_pattern,
    decode_rule,
    encode_rule,
    make_rule,
    pattern_matches,
)

ALICE = Principal("alice")
BOB = Principal("bob")


def test_default_deny() -> None:
    decision = Rules().decide(ALICE, Action.CONSUME, "demo/orders")
    assert not decision.allowed
    assert decision.rule is None
    assert "no rule allows alice to consume on demo/orders" in decision.reason


def test_a_rule_allows_its_subject_action_and_streams_only() -> None:
    rule = make_rule("alice", "produce", "demo/*")
    rules = Rules([rule])
    decision = rules.decide(ALICE, Action.PRODUCE, "demo/orders")
    assert decision.allowed and decision.rule == rule
    assert "alice produce demo/*" in decision.reason
    assert not rules.decide(ALICE, Action.CONSUME, "demo/orders").allowed  # other action
    assert not rules.decide(BOB, Action.PRODUCE, "demo/orders").allowed  # other subject
    assert not rules.decide(ALICE, Action.PRODUCE, "prod/orders").allowed  # other scope
    assert not rules.decide(ALICE, Action.PRODUCE, None).allowed  # broker-wide


def test_every_subject() -> None:
    rules = Rules([make_rule("*", "consume", "*/orders")])
    assert rules.decide(BOB, Action.CONSUME, "x/orders").allowed
    assert not rules.decide(BOB, Action.CONSUME, "x/order").allowed


def test_admin_role_allows_everything_but_a_scope_limit_still_holds() -> None:
    admin = Principal("ops", Role.ADMIN)
    rules = Rules()
    for action in Action:
        assert rules.decide(admin, action, "demo/orders").allowed
        assert rules.decide(admin, action, None).allowed
    scoped = Principal("ops", Role.ADMIN, scope="demo")
    assert rules.decide(scoped, Action.MANAGE, "demo/orders").allowed
    assert not rules.decide(scoped, Action.MANAGE, "prod/orders").allowed
    assert not rules.decide(scoped, Action.ADMIN, None).allowed


def test_scope_limit_wins_over_rules() -> None:
    rules = Rules([make_rule("alice", "consume", "*")])
    scoped = Principal("alice", scope="demo")
    assert rules.decide(scoped, Action.CONSUME, "demo/orders").allowed
    decision = rules.decide(scoped, Action.CONSUME, "prod/orders")
    assert not decision.allowed
    assert "limited to scope 'demo'" in decision.reason


def test_reserved_scope_only_for_admins() -> None:
    rules = Rules([make_rule("*", "consume", "*"), make_rule("alice", "consume", "_system/*")])
    assert not rules.decide(ALICE, Action.CONSUME, "_system/audit").allowed
    assert rules.decide(Principal("ops", Role.ADMIN), Action.CONSUME, "_system/audit").allowed


def test_broker_wide_operations_need_a_star_rule() -> None:
    rules = Rules([make_rule("alice", "admin", "demo/*")])
    assert not rules.decide(ALICE, Action.ADMIN, None).allowed
    rules.add(make_rule("alice", "admin", "*"))
    assert rules.decide(ALICE, Action.ADMIN, None).allowed


def test_may_somewhere() -> None:
    rules = Rules([make_rule("alice", "produce", "demo/*")])
    assert rules.may_somewhere(ALICE, Action.PRODUCE).allowed
    assert not rules.may_somewhere(BOB, Action.PRODUCE).allowed
    assert not rules.may_somewhere(Principal("alice", scope="prod"), Action.PRODUCE).allowed
    assert rules.may_somewhere(Principal("alice", scope="demo"), Action.PRODUCE).allowed


def test_add_remove_and_order() -> None:
    rules = Rules()
    b, a = make_rule("bob", "consume", "*"), make_rule("alice", "consume", "demo/*")
    assert rules.add(b) and rules.add(a) and not rules.add(a)
    assert rules.rules == [a, b]
    assert rules.remove(a) and not rules.remove(a)
    assert rules.rules == [b]


def test_the_first_rule_in_order_decides() -> None:
    specific, broad = make_rule("alice", "consume", "demo/orders"), make_rule("*", "consume", "*")
    rules = Rules([broad, specific])
    assert rules.decide(ALICE, Action.CONSUME, "demo/orders").rule == broad  # '*' sorts first
    assert rules.decide(BOB, Action.CONSUME, "demo/orders").rule == broad


@pytest.mark.parametrize(
    ("subject", "action", "pattern", "complaint"),
    [
        ("", "consume", "*", "rule subject"),
        ("al ice", "consume", "*", "rule subject"),
        ("al*", "consume", "*", "rule subject"),
        ("alice", "read", "*", "unknown action 'read'"),
        ("alice", "consume", "", "stream pattern"),
        ("alice", "consume", "demo", "stream pattern"),
        ("alice", "consume", "demo/", "stream pattern"),
        ("alice", "consume", "/orders", "stream pattern"),
        ("alice", "consume", "a/b/c", "stream pattern"),
        ("alice", "consume", "Demo/*", "stream pattern"),
        ("alice", "consume", "demo/[ab]", "stream pattern"),
        ("alice", "consume", "**", "stream pattern"),
        ("alice", "consume", "demo/" + "x" * 300, "stream pattern"),
    ],
)
def test_nonsense_is_refused_clearly(
    subject: str, action: str, pattern: str, complaint: str
) -> None:
    with pytest.raises(InvalidArgument, match=re.escape(complaint)):
        make_rule(subject, action, pattern)


def test_stored_form_round_trips_and_is_checked_again() -> None:
    rule = make_rule("alice", "produce", "demo/*")
    assert decode_rule(encode_rule(rule)) == rule
    assert rule.key == "alice produce demo/*"
    assert rule.grant_command() == "slipstream acl grant alice produce 'demo/*'"
    with pytest.raises(InvalidArgument):
        decode_rule(encode_rule(Rule("alice", Action.PRODUCE, "no pattern")))
    with pytest.raises(InvalidArgument):
        decode_rule(b"\xff\x00")


# --- property: the matcher against an independent reference -------------------------------

_CHARS = "ab.-_0"
parts = st.text(alphabet=_CHARS, min_size=1, max_size=5)
globs = st.text(alphabet=_CHARS + "*?", min_size=1, max_size=5)
streams = st.builds(lambda s, n: f"{s}/{n}", parts, parts)
patterns = st.one_of(st.just("*"), st.builds(lambda s, n: f"{s}/{n}", globs, globs))


def _reference(pattern: str, stream: str) -> bool:
    """What a pattern means, written independently: '*' is everything; otherwise each part's
    '*' is any run of characters other than '/', '?' one such character."""
    if pattern == "*":
        return True

    def part(glob: str) -> str:
        return "".join("[^/]*" if c == "*" else "[^/]" if c == "?" else re.escape(c) for c in glob)

    scope, name = pattern.split("/")
    return re.fullmatch(f"{part(scope)}/{part(name)}", stream) is not None


@settings(max_examples=500)
@given(pattern=patterns, stream=streams)
def test_matching_is_the_reference(pattern: str, stream: str) -> None:
    check_pattern(pattern)
    assert pattern_matches(pattern, stream) == _reference(pattern, stream)


@given(stream=streams)
def test_a_literal_pattern_matches_only_itself_and_scope_star_its_scope(stream: str) -> None:
    scope = stream.split("/")[0]
    assert pattern_matches(stream, stream)
    assert pattern_matches(f"{scope}/*", stream)
    assert pattern_matches("*", stream)
    assert not pattern_matches(f"{scope}x/*", stream)
    assert not pattern_matches(stream + "x", stream)


subjects = st.sampled_from(["alice", "bob", "*"])
actions = st.sampled_from(list(Action))
rule_lists = st.lists(st.builds(make_rule, subjects, actions, patterns), max_size=8)


@settings(max_examples=300)
@given(
    rules=rule_lists,
    subject=st.sampled_from(["alice", "bob"]),
    scope=st.one_of(st.none(), parts),
    role=st.sampled_from(list(Role)),
    action=actions,
    stream=st.one_of(st.none(), streams),
)
def test_decide_is_the_documented_order(
    rules: list[Rule],
    subject: str,
    scope: str | None,
    role: Role,
    action: Action,
    stream: str | None,
) -> None:
    principal = Principal(subject, role, scope)
    decision = Rules(rules).decide(principal, action, stream)
    if scope is not None and (stream is None or stream.split("/")[0] != scope):
        expected = False  # outside the token's scope: nothing else counts
    elif role is Role.ADMIN:
        expected = True
    else:
        expected = any(
            r.action is action
            and r.subject in (subject, "*")
            and (r.pattern == "*" if stream is None else _reference(r.pattern, stream))
            for r in rules
        )
    assert decision.allowed == expected
    if decision.rule is not None:  # the rule it names does allow it
        assert decision.rule in rules and decision.rule.action is action
        assert decision.rule.subject in (subject, "*")
    assert (decision.rule is not None) == (expected and role is Role.USER)

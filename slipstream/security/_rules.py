"""Access rules: which subject may do which action on which streams. Pure: no I/O, no clock.

A rule allows; nothing denies. ``Rules.decide`` answers for one principal, action and stream,
in this order (the first that applies decides):

1. A principal whose token is limited to a scope is refused every stream outside that scope,
   and every broker-wide operation (``stream`` None), whatever its role and the rules say.
2. Streams of a reserved scope (``_system``: the audit stream) are for the admin role only;
   no rule reaches them, not even ``*``.
3. The admin role may do everything.
4. The first rule (in ``Rules.rules`` order: subject, action, pattern) whose subject is the
   principal's (or ``*``: every authenticated subject), whose action is the one asked, and
   whose pattern matches the stream allows it. Broker-wide operations (``stream`` None: the
   list of transactions, rules, tokens, quotas) match only rules with the pattern ``*``.
5. Otherwise: refused (default deny).

Patterns are ``*`` (every stream) or ``<scope glob>/<name glob>``, each glob matched
case-sensitively against one part of the stream name, with ``*`` (any run of characters) and
``?`` (one character) as wildcards (``fnmatch`` without character classes): ``demo/*``,
``*/orders``, ``demo/order?``, ``demo/orders``. A ``*`` never crosses the ``/``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fnmatch import fnmatchcase

import msgspec

from .._errors import InvalidArgument
from ._principal import Action, Principal, Role

#: Scopes no rule reaches: only the admin role acts on their streams.
RESERVED_SCOPES = frozenset({"_system"})
EVERY_SUBJECT = "*"
EVERY_STREAM = "*"

_GLOB = re.compile(r"[a-z0-9._*?-]+")
_SUBJECT = re.compile(r"[^\s*]{1,255}")
MAX_PATTERN_LENGTH = 255


class Rule(msgspec.Struct, frozen=True, order=True):
    """Allow ``subject`` (a principal's subject, or ``*`` for every authenticated one) to do
    ``action`` on the streams ``pattern`` matches. Stored as its msgspec encoding."""

    subject: str
    action: Action
    pattern: str

    @property
    def key(self) -> str:
        """Its key in the MetaStore settings (kind ``rules``); unique per rule."""
        return f"{self.subject} {self.action} {self.pattern}"

    def grant_command(self) -> str:
        """The CLI command that grants it."""
        return f"slipstream acl grant {self.subject} {self.action} '{self.pattern}'"

    def __str__(self) -> str:
        return f"{self.subject} {self.action} {self.pattern}"


@dataclass(frozen=True, slots=True)
class Decision:
    """The answer of ``Rules.decide``: ``allowed``, the ``rule`` that allowed it (None when
    no rule decided: the role, the scope limit, the default), and ``reason`` in words."""

    allowed: bool
    rule: Rule | None
    reason: str


def make_rule(subject: str, action: str, pattern: str) -> Rule:
    """A checked rule. Raises InvalidArgument saying what is wrong: an empty subject or one
    with spaces or ``*`` inside a name, an unknown action, a pattern that is not ``*`` or
    ``<scope glob>/<name glob>`` of lowercase letters, digits, ``.``, ``_``, ``-`` and the
    wildcards ``*`` and ``?``."""
    if subject != EVERY_SUBJECT and not (isinstance(subject, str) and _SUBJECT.fullmatch(subject)):
        raise InvalidArgument(
            f"rule subject {str(subject)[:64]!r} must be a subject name (no spaces, no '*', at "
            "most 255 characters) or '*' for every authenticated subject",
            subject=str(subject)[:64],
        )
    try:
        checked_action = Action(action)
    except ValueError:
        raise InvalidArgument(
            f"unknown action {str(action)[:32]!r}; one of: {', '.join(a.value for a in Action)}",
            action=str(action)[:32],
        ) from None
    check_pattern(pattern)
    return Rule(subject, checked_action, pattern)


def check_pattern(pattern: str) -> str:
    """Return ``pattern`` or raise InvalidArgument (see ``make_rule``)."""
    if not isinstance(pattern, str):
        raise InvalidArgument(f"a stream pattern is text, not {type(pattern).__name__}")
    if pattern == EVERY_STREAM:
        return pattern
    parts = pattern.split("/")
    if (
        len(pattern) > MAX_PATTERN_LENGTH
        or len(parts) != 2
        or not all(_GLOB.fullmatch(part) for part in parts)
    ):
        raise InvalidArgument(
            f"stream pattern {pattern[:64]!r} must be '*' or 'scope/name' where each part uses "
            "lowercase letters, digits, '.', '_', '-' and the wildcards '*' and '?', for "
            "example 'demo/*', '*/orders' or 'demo/orders'",
            pattern=pattern[:64],
        )
    return pattern


def pattern_matches(pattern: str, stream: str) -> bool:
    """True if ``pattern`` (checked) matches the stream name ``scope/name``."""
    if pattern == EVERY_STREAM:
        return True
    scope_glob, _, name_glob = pattern.partition("/")
    scope, slash, name = stream.partition("/")
    return bool(slash) and fnmatchcase(scope, scope_glob) and fnmatchcase(name, name_glob)


def scope_of(stream: str) -> str:
    return stream.partition("/")[0]


class Rules:
    """The broker's access rules, in memory (the Service loads and stores them)."""

    def __init__(self, rules: list[Rule] | tuple[Rule, ...] = ()) -> None:
        self._rules: list[Rule] = sorted(set(rules))

    @property
    def rules(self) -> list[Rule]:
        """Every rule, sorted by subject, action, pattern (the order ``decide`` tries them)."""
        return list(self._rules)

    def add(self, rule: Rule) -> bool:
        """Add ``rule``; False if it was there already."""
        if rule in self._rules:
            return False
        self._rules = sorted([*self._rules, rule])
        return True

    def remove(self, rule: Rule) -> bool:
        """Remove ``rule``; False if there was no such rule."""
        if rule not in self._rules:
            return False
        self._rules = [r for r in self._rules if r != rule]
        return True

    def decide(self, principal: Principal, action: Action, stream: str | None) -> Decision:
        """May ``principal`` do ``action`` on ``stream`` (None: a broker-wide operation)? See
        the module's docstring for the order of the checks."""
        who = principal.subject
        if principal.scope is not None:
            if stream is None:
                return Decision(
                    False,
                    None,
                    f"{who}'s token is limited to scope {principal.scope!r}; broker-wide "
                    "operations need a token without a scope",
                )
            if scope_of(stream) != principal.scope:
                return Decision(
                    False,
                    None,
                    f"{who}'s token is limited to scope {principal.scope!r}, and {stream} is "
                    "outside it",
                )
        if stream is not None and scope_of(stream) in RESERVED_SCOPES:
            if principal.role is Role.ADMIN:
                return Decision(True, None, f"{who} has the admin role")
            return Decision(
                False, None, f"{stream} is in a reserved scope: only the admin role acts on it"
            )
        if principal.role is Role.ADMIN:
            return Decision(True, None, f"{who} has the admin role")
        for rule in self._rules:
            if (
                rule.action is action
                and (rule.subject == who or rule.subject == EVERY_SUBJECT)
                and (
                    rule.pattern == EVERY_STREAM
                    if stream is None
                    else pattern_matches(rule.pattern, stream)
                )
            ):
                return Decision(True, rule, f"rule '{rule}' allows it")
        target = "broker-wide" if stream is None else f"on {stream}"
        return Decision(False, None, f"no rule allows {who} to {action} {target} (default deny)")

    def may_somewhere(self, principal: Principal, action: Action) -> Decision:
        """May ``principal`` do ``action`` on at least one stream (a rule for it or ``*``
        with that action, in its token's scope if it has one)? For operations that name no
        stream yet, such as beginning a transaction."""
        who = principal.subject
        if principal.role is Role.ADMIN:
            return Decision(True, None, f"{who} has the admin role")
        for rule in self._rules:
            if (
                rule.action is action
                and (rule.subject == who or rule.subject == EVERY_SUBJECT)
                and (
                    principal.scope is None
                    or rule.pattern == EVERY_STREAM
                    or fnmatchcase(principal.scope, rule.pattern.partition("/")[0])
                )
            ):
                return Decision(True, rule, f"rule '{rule}' allows it")
        return Decision(False, None, f"no rule allows {who} to {action} on any stream")


def grant_command(subject: str, action: Action, stream: str | None) -> str:
    """The CLI command an administrator runs to allow what was refused."""
    return Rule(subject, action, stream or EVERY_STREAM).grant_command()


def encode_rule(rule: Rule) -> bytes:
    return msgspec.msgpack.encode(rule)


def decode_rule(value: bytes) -> Rule:
    """A stored rule, checked again (InvalidArgument if the catalog holds nonsense)."""
    try:
        rule = msgspec.msgpack.decode(value, type=Rule)
    except msgspec.DecodeError as exc:
        raise InvalidArgument(f"a stored access rule does not decode: {exc}") from None
    return make_rule(rule.subject, rule.action, rule.pattern)

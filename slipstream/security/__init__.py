"""Security: who a request runs for (Principal), what it may do (access rules), and the
audit trail of what was refused or changed. See docs/security.md."""

from ._audit import AuditLog
from ._principal import Action, Principal, Role
from ._rules import Decision, Rule, Rules, make_rule
from ._tokens import IssuedToken, TokenKeys, parse_duration_s

__all__ = [
    "Action",
    "AuditLog",
    "Decision",
    "IssuedToken",
    "Principal",
    "Role",
    "Rule",
    "Rules",
    "TokenKeys",
    "make_rule",
    "parse_duration_s",
]

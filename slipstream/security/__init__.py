"""Security: who a request runs for (Principal), what it may do (access rules), and the
audit trail of what was refused or changed. See docs/security.md."""

from ._audit import AuditLog
from ._principal import Action, Principal, Role
from ._tokens import IssuedToken, TokenKeys, parse_duration_s

__all__ = [
    "Action",
    "AuditLog",
    "IssuedToken",
    "Principal",
    "Role",
    "TokenKeys",
    "parse_duration_s",
]

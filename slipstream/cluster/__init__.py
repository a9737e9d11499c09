"""Several brokers on one catalog: which broker serves which container (pure functions)."""

from ._assign import assign, coordinator

__all__ = ["assign", "coordinator"]

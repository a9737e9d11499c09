"""The broker: asyncio wiring of sessions, the controller and segment containers."""

from ._broker import Broker, BrokerConfig, BrokerFailed
from ._browse import MAX_PAGE_EVENTS, EventsPage
from ._container import FSYNC_MODES, ContainerConfig
from ._embedded import EmbeddedBroker, choose_port
from ._service import Caller, Service
from ._session import ConnectionLimits

__all__ = [
    "FSYNC_MODES",
    "MAX_PAGE_EVENTS",
    "Broker",
    "BrokerConfig",
    "BrokerFailed",
    "Caller",
    "ConnectionLimits",
    "ContainerConfig",
    "EmbeddedBroker",
    "EventsPage",
    "Service",
    "choose_port",
]

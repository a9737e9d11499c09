"""The broker: asyncio wiring of sessions, the controller and segment containers."""

from ._broker import Broker, BrokerConfig
from ._container import FSYNC_MODES, ContainerConfig
from ._embedded import EmbeddedBroker, choose_port

__all__ = [
    "FSYNC_MODES",
    "Broker",
    "BrokerConfig",
    "ContainerConfig",
    "EmbeddedBroker",
    "choose_port",
]

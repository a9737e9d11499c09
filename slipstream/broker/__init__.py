"""The broker: asyncio wiring of sessions, the controller and segment containers."""

from ._broker import Broker, BrokerConfig, BrokerFailed
from ._container import FSYNC_MODES, ContainerConfig
from ._embedded import EmbeddedBroker, choose_port

__all__ = [
    "FSYNC_MODES",
    "Broker",
    "BrokerConfig",
    "BrokerFailed",
    "ContainerConfig",
    "EmbeddedBroker",
    "choose_port",
]

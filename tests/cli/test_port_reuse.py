"""A second ``./run.sh`` (or ``slipstream demo``) right after the first gets port 7070 again:
the old broker's connections linger in TIME_WAIT for a minute, which must not count as a
broker still listening there."""

from __future__ import annotations

import socket
import subprocess

import pytest
from conftest import BrokerProcess

from slipstream.broker import choose_port


def time_wait_on(port: int) -> bool:
    output = subprocess.run(
        ["ss", "-tan", "state", "time-wait", f"( sport = :{port} )"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    return f":{port} " in output


def test_the_port_of_a_broker_that_stopped_is_chosen_again(
    broker_factory: type[BrokerProcess],
) -> None:
    broker = broker_factory().start()
    client = broker.client()
    client.create_stream("port/reuse")
    assert choose_port(broker.port) != broker.port  # a broker listens there
    assert broker.stop() == 0  # the broker closes its connections first: TIME_WAIT on its port
    client.close()
    if not time_wait_on(broker.port):
        pytest.skip("no TIME_WAIT connection was left on the port (nothing to prove here)")
    assert choose_port(broker.port) == broker.port
    with socket.socket() as listener:  # and the broker's own listener could bind it
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", broker.port))

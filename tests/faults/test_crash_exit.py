"""A broker whose background task dies stops with a non-zero exit and the cause in its log,
never "stopped cleanly", so that a supervisor restarts it; a signal still stops it cleanly."""

from __future__ import annotations

from conftest import BrokerProcess

#: ``slipstream up``'s exit status when a background task died (EX_SOFTWARE)
EXIT_FAILED = 70


def test_a_dead_background_task_stops_the_broker_with_a_non_zero_exit(
    broker_factory: type[BrokerProcess],
) -> None:
    broker = broker_factory()
    broker.env = {"SLIPSTREAM_FAULT": "broker.container_dies"}
    broker.start()  # the fault fires once a connection was accepted: start()'s own probe
    assert broker.proc is not None
    assert broker.proc.wait(30) == EXIT_FAILED
    log = broker.log()
    assert "stopped because background task 'container 0' failed" in log
    assert "fault injection: SLIPSTREAM_FAULT=broker.container_dies" in log
    assert "stopped cleanly" not in log


def test_a_signal_stops_the_broker_cleanly(broker_factory: type[BrokerProcess]) -> None:
    broker = broker_factory().start()
    with broker.client() as client:
        client.create_stream("crash/clean", segments=1)
    assert broker.stop() == 0
    assert "stopped cleanly" in broker.log()
    assert "stopped because" not in broker.log()

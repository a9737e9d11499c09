"""``slipstream up --idle-timeout --max-follows``: the connection limits an operator sets reach
a real broker process (the limits themselves: tests/integration/test_connection_limits.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import BrokerProcess
from raw import RawConnection
from test_cli_smoke import run

from slipstream.protocol import Done, Error, Follow, Welcome


def test_idle_timeout_flag_closes_a_silent_connection(
    broker_factory: type[BrokerProcess],
) -> None:
    broker = broker_factory("--idle-timeout", "0.5").start()
    raw = RawConnection(broker.address)
    assert isinstance(raw.receive().message, Welcome)
    frame = raw.receive()  # nothing sent after Hello: closed once silent for half a second
    assert frame.correlation_id == 0 and isinstance(frame.message, Error), frame
    assert frame.message.code == "idle_timeout"
    assert frame.message.details["timeout"] == 0.5
    assert "(limit 0.5 s)" in frame.message.message
    with pytest.raises(ConnectionError):
        raw.receive()
    raw.close()


def test_max_follows_flag_limits_follows_per_connection(
    broker_factory: type[BrokerProcess],
) -> None:
    broker = broker_factory("--max-follows", "2").start()
    with broker.client() as client:
        client.create_stream("up/limits", segments=3)
    raw = RawConnection(broker.address)
    assert isinstance(raw.receive().message, Welcome)
    for segment in range(3):
        raw.send_frame(Follow(segment, "up/limits", segment, 0, None, 1 << 16), 10 + segment)
        frame = raw.receive()
        assert frame.correlation_id == 10 + segment
        if segment < 2:
            assert isinstance(frame.message, Done), frame
    assert isinstance(frame.message, Error) and frame.message.code == "too_many_follows"
    assert frame.message.details == {"limit": 2}
    raw.close()


@pytest.mark.parametrize(
    ("flag", "value", "said"),
    [
        ("--idle-timeout", "0", "must be more than 0 seconds"),
        ("--idle-timeout", "-1", "must be more than 0 seconds"),
        ("--max-follows", "0", "must be at least 1"),
    ],
)
def test_bad_limits_are_refused_before_the_broker_starts(
    tmp_path: Path, flag: str, value: str, said: str
) -> None:
    result = run("up", "--data-dir", str(tmp_path / "data"), "--port", "0", flag, value)
    assert result.returncode == 2, result.stderr
    text = " ".join(result.stderr.replace("│", " ").split())
    assert f"Invalid value for {flag}: {said}" in text


def test_up_help_shows_the_limits_and_their_defaults() -> None:
    shown = " ".join(run("up", "--help").stdout.replace("│", " ").split())
    assert "--idle-timeout" in shown and "300" in shown
    assert "--max-follows" in shown and "4096" in shown

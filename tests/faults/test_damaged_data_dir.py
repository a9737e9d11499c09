"""A data directory missing a file the broker needs (``broker.json``, the catalog) or holding
an empty one, as a power failure left them before this build synced them: the broker refuses
to start with one line that names the file and the fix, never a decoder's traceback, and
never starts on half of its data."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import BrokerProcess


def _data_dir_with_a_stream(broker_factory: type[BrokerProcess]) -> BrokerProcess:
    broker = broker_factory("--containers", "3").start()
    with broker.client() as client:
        client.create_stream("damaged/dir", segments=2)
    assert broker.stop() == 0
    return broker


def _up(data_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "slipstream", "up", "--data-dir", str(data_dir), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("damage", ["empty", "missing"])
def test_a_lost_broker_json_is_named_with_its_fix(
    broker_factory: type[BrokerProcess], damage: str
) -> None:
    broker = _data_dir_with_a_stream(broker_factory)
    layout = broker.data_dir / "broker.json"
    if damage == "empty":
        layout.write_bytes(b"")
    else:
        layout.unlink()
    result = _up(broker.data_dir)
    assert result.returncode == 1
    message = " ".join(result.stderr.split())  # rich wraps long lines
    assert f"broker.json is {damage}" in message
    assert """echo '{"format": 1, "containers": 3}'""" in message
    assert "Traceback" not in result.stderr
    # the fix it names works, and nothing was lost meanwhile
    layout.write_text(json.dumps({"format": 1, "containers": 3}))
    broker.start()
    with broker.client() as client:
        assert [s.name for s in client.list_streams()] == ["damaged/dir"]


def test_a_missing_catalog_is_named_instead_of_starting_empty(
    broker_factory: type[BrokerProcess],
) -> None:
    broker = _data_dir_with_a_stream(broker_factory)
    for path in broker.data_dir.glob("meta.db*"):
        path.unlink()
    result = _up(broker.data_dir)
    assert result.returncode == 1
    message = " ".join(result.stderr.split())
    assert "meta.db, the catalog, is missing" in message
    assert "Restore the data directory from a backup" in message
    assert not (broker.data_dir / "meta.db").exists()  # nothing was created in its place

"""``slipstream quota set | list | delete`` as a user runs them, and the HTTP API's quota routes,
against a real broker."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
from conftest import BrokerProcess


def run(*args: str, broker: BrokerProcess) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "slipstream", *args, "--broker", broker.address]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


def test_set_list_and_delete_with_units(broker: BrokerProcess) -> None:
    done = run(
        "quota",
        "set",
        "demo",
        "--produce",
        "10MB/s",
        "--consume",
        "20MiB/s",
        "--requests",
        "1000/s",
        "--connections",
        "50",
        broker=broker,
    )
    assert done.returncode == 0, done.stderr
    assert run("quota", "set", "tiny", "--produce", "512KiB/s", broker=broker).returncode == 0
    listed = json.loads(run("quota", "list", "--json", broker=broker).stdout)
    assert listed == [
        {
            "scope": "demo",
            "produce_bytes_per_s": 10_000_000,
            "consume_bytes_per_s": 20 * 2**20,
            "requests_per_s": 1000,
            "connections": 50,
        },
        {
            "scope": "tiny",
            "produce_bytes_per_s": 512 * 1024,
            "consume_bytes_per_s": None,
            "requests_per_s": None,
            "connections": None,
        },
    ]
    table = run("quota", "list", broker=broker).stdout
    assert "9.5 MiB/s" in table and "1000/s" in table
    removed = run("quota", "delete", "demo", broker=broker)
    assert removed.returncode == 0 and "removed" in removed.stderr
    again = run("quota", "delete", "demo", broker=broker)
    assert again.returncode == 0 and "had no quota" in again.stderr
    listed = json.loads(run("quota", "list", "--json", broker=broker).stdout)
    assert [q["scope"] for q in listed] == ["tiny"]


def test_bad_values_are_refused_with_the_fix(broker: BrokerProcess) -> None:
    no_rate = run("quota", "set", "demo", "--produce", "10MB", broker=broker)
    assert no_rate.returncode != 0 and "10MB/s" in no_rate.stderr
    bad_size = run("quota", "set", "demo", "--consume", "lots/s", broker=broker)
    assert bad_size.returncode != 0 and "per second" in bad_size.stderr
    bad_count = run("quota", "set", "demo", "--requests", "0/s", broker=broker)
    assert bad_count.returncode != 0 and "positive" in bad_count.stderr
    nothing = run("quota", "set", "demo", broker=broker)
    assert nothing.returncode != 0 and "quota delete" in nothing.stderr
    bad_scope = run("quota", "set", "Bad Scope", "--requests", "5/s", broker=broker)
    assert bad_scope.returncode != 0 and "lowercase letter" in bad_scope.stderr
    assert json.loads(run("quota", "list", "--json", broker=broker).stdout) == []


def test_the_http_api_sets_lists_and_deletes_quotas(broker: BrokerProcess) -> None:
    with httpx.Client(base_url=broker.http_url, timeout=30) as http:
        answer = http.put("/api/quotas/demo", json={"produce_bytes": 1000, "requests": 5})
        assert answer.status_code == 200, answer.text
        assert answer.json() == [
            {
                "scope": "demo",
                "produce_bytes": 1000,
                "consume_bytes": None,
                "requests": 5,
                "connections": None,
            }
        ]
        assert http.get("/api/quotas").json() == answer.json()
        refused = http.put("/api/quotas/demo", json={"requests": -1})
        assert refused.status_code == 400 and "positive" in refused.text
        typo = http.put("/api/quotas/demo", json={"request": 5})
        assert typo.status_code == 400
        assert http.delete("/api/quotas/demo").status_code == 204
        assert http.get("/api/quotas").json() == []
    with broker.client() as client:
        assert client.quotas() == []

"""schemathesis against the broker's own OpenAPI description (/api/openapi.json): requests
generated from the schemas, valid and invalid, on a real broker. Holds when no answer is a
500, every status and body is the one described, and every error is a typed JSON body."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from conftest import BrokerProcess
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from slipstream.http._api import OPERATIONS

#: examples per operation and mode: the run takes about 25 s here (under a minute on 2 busy
#: cores)
EXAMPLES = 15


@pytest.fixture(scope="module")
def fuzzed_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    data_dir: Path = tmp_path_factory.mktemp("fuzz") / "data"
    broker = BrokerProcess(data_dir).start()
    yield broker
    assert broker.stop() == 0, broker.log()[-3000:]


def typed_error_body(ctx: Any, response: Any, case: Any) -> bool | None:
    """Every 4xx and 5xx is ``{"error": code, "message": text, "details": object}``."""
    if response.status_code < 400:
        return None
    body = response.json()
    assert isinstance(body, dict), body
    assert set(body) == {"error", "message", "details"}, body
    assert isinstance(body["error"], str) and body["error"], body
    assert isinstance(body["message"], str) and body["message"], body
    assert isinstance(body["details"], dict), body
    return True


def test_no_server_errors_and_every_error_is_typed(fuzzed_broker: BrokerProcess) -> None:
    # the schema is loaded from the running broker, each operation fuzzed in turn (the
    # lazy pytest loader of schemathesis does not run under this pytest)
    schema = schemathesis.openapi.from_url(f"{fuzzed_broker.http_url}/api/openapi.json")
    checks = [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_schema_conformance,
        typed_error_body,
    ]
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == len(OPERATIONS)  # every route is described
    runs = [(op, mode) for op in operations for mode in GenerationMode]
    for operation, mode in runs:  # valid requests, then ones that break the schema

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def call(case: Any) -> None:
            case.call_and_validate(checks=checks)

        try:
            call()
        except Unsatisfiable:
            # an operation with nothing to break (no body, only free-form strings)
            assert mode is GenerationMode.NEGATIVE, operation.label

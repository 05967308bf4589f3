"""Schemathesis against the four servers as real processes, every route of each from its own OpenAPI document.

For each operation, hypothesis draws valid (positive) and invalid (negative) requests, a bounded number
of each, derandomized so a CI run is repeatable. Every request is sent with the right credential and
checked: no 5xx, a documented status, a documented content type, a body that matches the documented
schema. The same request is then sent with no credential and with the other plane's credential: each
must be refused (401 or 403). The test prints how many requests it sent.
"""

from __future__ import annotations

import secrets
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from apps import config as cfg
from apps.processes import ServerProcesses, free_port
from participants.base.observability import METRICS_PATH
from participants.base.wire import CONTROL, OPENAPI_PATH

# Bounded by the examples per operation (about 1,400 requests over the four servers); the timeout is
# the backstop that keeps a slow machine from holding CI.
pytestmark = pytest.mark.timeout(240)

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
EXAMPLES = {GenerationMode.POSITIVE: 4, GenerationMode.NEGATIVE: 2}  # per operation: bounded, derandomized
TIMEOUT_S = 20


@pytest.fixture(scope="module")
def servers(request: pytest.FixtureRequest) -> Any:
    dsn = request.getfixturevalue("module_dsn")
    work = Path(tempfile.mkdtemp(prefix="rbfuzz-"))
    config = cfg.Config(dsn=dsn, control_token=secrets.token_hex(16), data_token=secrets.token_hex(16),
                        servers={k: cfg.ServerConfig(port=free_port()) for k in cfg.KINDS})
    cfg.write(config, work / "rollbook.toml")
    procs = ServerProcesses(config, work / "rollbook.toml", work)
    procs.start()
    yield config
    procs.stop()


@pytest.fixture(scope="module")
def module_dsn() -> Any:
    from tests.conftest import _server

    server = _server("primary")
    url = server.new_database()
    yield url
    server.drop_database(url)


def fuzz(kind: str, config: cfg.Config, http: requests.Session) -> dict[str, int]:
    base = config.url(kind)
    control, data = {"Authorization": f"Bearer {config.control_token}"}, {"Authorization": f"Bearer {config.data_token}"}
    doc = http.get(base + OPENAPI_PATH, headers=data, timeout=TIMEOUT_S).json()
    schema = schemathesis.openapi.from_dict(doc)
    counts = {"operations": 0, "requests": 0, "refused_without_credential": 0}
    for result in schema.get_all_operations():
        op = result.ok()
        counts["operations"] += 1
        right = control if op.path.startswith(CONTROL) or op.path == METRICS_PATH else data
        wrong = [{}, {"Authorization": "Bearer not-a-credential"}] + ([] if op.path == OPENAPI_PATH else [
            data if right is control else control])
        for mode, n in EXAMPLES.items():
            run_operation(op, mode, n, base, http, right, wrong, counts)
    return counts


def run_operation(op: Any, mode: GenerationMode, n: int, base: str, http: requests.Session, right: dict[str, str],
                  wrong: list[dict[str, str]], counts: dict[str, int]) -> None:
    @settings(max_examples=n, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=mode))
    def one(case: Any) -> None:
        response = case.call(base_url=base, session=http, headers=right, timeout=TIMEOUT_S)
        counts["requests"] += 1
        case.validate_response(response, checks=CHECKS, headers=right)
        for headers in wrong:
            refused = case.call(base_url=base, session=http, headers=headers, timeout=TIMEOUT_S)
            counts["requests"] += 1
            assert refused.status_code in (401, 403), (case.method, case.formatted_path, list(headers),
                                                       refused.status_code, refused.text[:300])
            counts["refused_without_credential"] += 1

    one()


def test_schemathesis_finds_no_5xx_no_schema_violation_and_no_request_accepted_without_credential(servers) -> None:
    started = time.monotonic()
    totals: dict[str, dict[str, int]] = {}
    with requests.Session() as http:
        for kind in cfg.KINDS:
            totals[kind] = fuzz(kind, servers, http)
    sent = sum(t["requests"] for t in totals.values())
    print(f"\nschemathesis: {sent} requests in {time.monotonic() - started:.1f} s: {totals}")
    for kind, t in totals.items():
        assert t["operations"] >= 9 and t["refused_without_credential"] > 0, (kind, t)

"""schemathesis against the served `/openapi.json`: generated requests (valid and invalid) to every
operation, a bounded number per operation; no response may be a 5xx or break the document (status,
content type, body schema). The fake engine serves (real sockets, no model), so the run is quick."""
from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("fastapi")

from fake_engine import FakeEngine  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from server_support import ThreadedServer  # noqa: E402

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def fake_server():
    with ThreadedServer(engine=FakeEngine(step_s=0.0005)) as srv:
        yield srv


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_api_conforms_to_its_openapi_document(fake_server, mode):
    from hypothesis import given
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(fake_server.base_url + "/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    assert len(ops) >= 8
    for op in ops:
        @given(case=op.as_strategy(generation_mode=GenerationMode(mode)))
        @settings(max_examples=20, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def run(case) -> None:
            case.call_and_validate(base_url=fake_server.base_url, checks=CHECKS, timeout=30)

        try:
            run()
        except Unsatisfiable:   # an operation with no input has no invalid request (GET /health)
            assert mode == "negative" and op.method.upper() == "GET", op.path

"""schemathesis against a live controller: no 5xx, and every answer matches /openapi.json."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.helpers import live_controller

EXAMPLES = 40  # per operation: enough to cover every field and error, quick on 2 cores


@pytest.fixture(scope="module")
def live_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[schemathesis.BaseSchema]:
    with live_controller(tmp_path_factory.mktemp("api"), "--workers", "2") as ctl:
        yield schemathesis.openapi.from_url(f"{ctl.url}/openapi.json")


def test_every_answer_matches_the_document(live_api: schemathesis.BaseSchema) -> None:
    """Each operation with EXAMPLES generated requests, valid and not (schemathesis's own
    pytest plugin does not run under this pytest, so the operations are driven here)."""
    operations = [result.ok() for result in live_api.get_all_operations()]
    assert {operation.label for operation in operations} == {
        "GET /health/",
        "GET /job/",
        "POST /job/",
        "GET /job/{job_id}/",
        "PUT /job/{job_id}/",
        "DELETE /job/{job_id}/",
        "GET /ping/",
        "GET /",
    }  # and GET /openapi.json, which schemathesis leaves out of a schema it loaded from it

    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
        def check(case: Any) -> None:
            wait = (case.query or {}).get("wait")
            if isinstance(wait, int | float) and not isinstance(wait, bool):
                case.query["wait"] = min(wait, 0.05)  # long-polls have their own tests
            case.call_and_validate(timeout=70)

        check()

"""schemathesis against a live controller: no 5xx, and every answer matches /openapi.json."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
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
    # GET /openapi.json too, unless schemathesis leaves out the schema it loaded (it does
    # without a schemathesis.toml in the working directory).
    assert {operation.label for operation in operations} - {"GET /openapi.json"} == {
        "GET /health/",
        "GET /job/",
        "POST /job/",
        "GET /job/{job_id}/",
        "PUT /job/{job_id}/",
        "DELETE /job/{job_id}/",
        "GET /ping/",
        "POST /job/{job_id}/retry/",
        "GET /job/{job_id}/output/",
        "GET /queue/",
        "PUT /queue/{name}/",
        "GET /events/",
        "GET /",
    }

    for operation in operations:
        if operation.label == "GET /events/":
            continue  # a stream that never ends: tests/test_flows_events.py

        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
        def check(case: Any) -> None:
            wait = (case.query or {}).get("wait")
            if isinstance(wait, int | float) and not isinstance(wait, bool):
                case.query["wait"] = min(wait, 0.05)  # long-polls have their own tests
            if "follow" in (case.query or {}):
                case.query["follow"] = "0"  # following a job that never ends: tests of its own
            case.call_and_validate(timeout=70)

        check()


def test_the_schemathesis_command_finds_nothing(tmp_path: Path) -> None:
    """`st run --checks all` with every phase, bounded: fewer examples, and without the
    /ping/ long polls (a /ping/ waits out its `wait`, up to 60 s; the test above covers it
    with short waits), without job output (`?follow=1` on a job that never ends streams
    until the client leaves; tests/test_output.py covers it), without the event stream
    (it lasts until the client leaves; tests/test_flows_events.py covers it), and without pausing queues (a
    paused queue's jobs never end), and without reading one job (`?wait=` on a job that is
    scheduled, or whose queue or labels no worker serves, waits up to 60 s; the test above
    covers both with short waits). use_after_free is left out: a deleted job stays readable
    (its state is `deleted`, and a PUT on it answers 409), which that check calls a failure."""
    st = Path(sys.executable).with_name("st")
    with live_controller(tmp_path, "--workers", "1") as ctl:
        proc = subprocess.run(
            [
                str(st),
                "run",
                *["--checks", "all", "--exclude-checks", "use_after_free"],
                *["--phases", "coverage,fuzzing,stateful", "--max-examples", "10"],
                *["--exclude-path", "/ping/", "--exclude-path", "/job/{job_id}/output/"],
                *["--exclude-path", "/events/"],
                *["--exclude-path", "/queue/{name}/", "--exclude-name", "GET /job/{job_id}/"],
                *["--seed", "1", "--generation-database", "none"],
                "--no-color",
                f"{ctl.url}/openapi.json",
            ],
            cwd=Path(__file__).parents[1],  # where schemathesis.toml is
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert proc.returncode == 0, proc.stdout[-6000:]
    # Every generated case passed. A warning that random ids found no job (404) is not an
    # issue of the API; whether it is printed depends on which cases the stateful phase chains.
    counts = re.search(r"(\d+) generated, (\d+) passed\n", proc.stdout)
    assert counts is not None and counts[1] == counts[2], proc.stdout[-6000:]


def test_the_document_names_429_and_503_with_retry_after() -> None:
    """Every operation that asks for a token also names its 429; POST /job/'s 503 (the
    journal, or max_pending) carries Retry-After, as the answers do."""
    from controller.doors.http.openapi import OPENAPI

    for path, operations in OPENAPI["paths"].items():
        for method, operation in operations.items():
            if method not in ("get", "put", "post", "delete"):
                continue  # path-level parameters
            responses = operation["responses"]
            if "401" in responses:
                assert "429" in responses, (method, path)
                assert "Retry-After" in responses["429"]["headers"], (method, path)
    busy = OPENAPI["paths"]["/job/"]["post"]["responses"]["503"]
    assert "max_pending" in busy["description"] and "Retry-After" in busy["headers"]

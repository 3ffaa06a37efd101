"""schemathesis against a live controller: no 5xx, and every answer matches /openapi.json."""

from __future__ import annotations

import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.helpers import (
    controller_argv,
    free_tcp_port,
    free_udp_port,
    reap,
    wait_for_condition,
    write_config,
)

EXAMPLES = 40  # per operation: enough to cover every field and error, quick on 2 cores


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


@pytest.fixture(scope="module")
def live_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[schemathesis.BaseSchema]:
    tmp: Path = tmp_path_factory.mktemp("api")
    port = free_tcp_port()
    config = write_config(
        tmp,
        socket_dir=str(tmp / "s"),
        journal=str(tmp / "journal.sqlite3"),
        client_address={"host": "127.0.0.1", "port": free_udp_port()},
        http_address={"host": "127.0.0.1", "port": port},
    )
    proc = subprocess.Popen(
        controller_argv(config, "--workers", "2", log_level="WARNING"), stderr=subprocess.PIPE
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_condition(lambda: _answers(f"{base}/health/"), timeout=20)
        yield schemathesis.openapi.from_url(f"{base}/openapi.json")
    finally:
        stderr = reap(proc)
        assert b"Traceback" not in stderr, stderr.decode(errors="replace")


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

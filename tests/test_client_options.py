"""Job options and retry through the client library and udp-client, against a live controller
with its HTTP, UDP and Redis doors: the options reach the job object, a delayed job waits in
`scheduled`, and a failed job retried from any scheme runs again."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from controller.client import Client, ControllerError, JobFailed
from tests.helpers import (
    REDIS_SERVER,
    LiveController,
    live_controller,
    redis_server,
    run_udp_client,
    wait_for_condition,
)

pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed")

# A payload starting with "flaky" fails the first time it runs and echoes "ok" after;
# "fail" always fails; anything else is echoed.
JOB_SCRIPT = (
    '#!/bin/sh\ninput=$(cat)\ncase "$input" in\n'
    '  flaky*) if [ -e "{dir}/$input" ]; then printf ok; exit 0; fi\n'
    '          : > "{dir}/$input"; echo "first try fails" >&2; exit 3;;\n'
    '  fail*) echo "it failed" >&2; exit 3;;\n'
    "esac\n"
    'printf %s "$input"\n'
)
OPTIONS = {
    "priority": 5,
    "max_retries": 2,
    "retry_delay": 0.5,
    "timeout": 60,
    "placement_timeout": 30,
    "owner": "alice",
}


@dataclass
class Live:
    controller: LiveController
    redis_url: str

    @property
    def urls(self) -> dict[str, str]:
        return {
            "http": self.controller.url,
            "udp": f"udp://127.0.0.1:{self.controller.udp_port}",
            "redis": self.redis_url,
        }


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    tmp: Path = tmp_path_factory.mktemp("options")
    marks = tmp / "marks"
    marks.mkdir()
    script = tmp / "job.sh"
    script.write_text(JOB_SCRIPT.format(dir=marks))
    script.chmod(0o755)
    with redis_server(tmp) as server:
        args = ("--workers", "2", "--", "--exec", str(script))
        redis_settings = {"url": server.url, "claim_after": 2}
        with live_controller(tmp, *args, max_retries=0, redis=redis_settings) as ctl:
            yield Live(ctl, server.url)


def shown(live: Live, job_id: str) -> dict[str, object]:
    """The job object the HTTP API shows."""
    with Client(live.controller.url) as client:
        return client.get(job_id).info


def _state(live: Live, job_id: str) -> object:
    """The job's state as the HTTP API shows it ("" before the controller has it: a Redis
    entry not read yet)."""
    try:
        return shown(live, job_id)["state"]
    except KeyError:
        return ""


@pytest.mark.parametrize("scheme", ["http", "udp", "redis"])
def test_the_options_reach_the_job_object(live, scheme):
    with Client(live.urls[scheme]) as client:
        job = client.submit(f"options over {scheme}", **OPTIONS)
        assert job.result(timeout=20) == f"options over {scheme}".encode()
    info = shown(live, job.id)
    assert {name: info[name] for name in OPTIONS} == OPTIONS
    assert info["queue"] == "default" and info["requires"] == [] and info["run_at"] is None


@pytest.mark.parametrize("scheme", ["http", "redis"])
def test_a_delayed_job_is_scheduled_until_its_time(live, scheme):
    with Client(live.urls[scheme]) as client:
        started = time.monotonic()
        job = client.submit(f"later over {scheme}", delay=1.5)
        wait_for_condition(lambda: _state(live, job.id) == "scheduled", 5)
        assert shown(live, job.id)["run_at"] is not None
        assert job.result(timeout=20) == f"later over {scheme}".encode()
        assert time.monotonic() - started >= 1.5


@pytest.mark.parametrize("scheme", ["http", "redis"])
def test_a_failed_job_retried_runs_again(live, scheme):
    job_id = f"flaky-{scheme}"
    with Client(live.urls[scheme]) as client:
        job = client.submit(job_id, id=job_id, max_retries=0)
        with pytest.raises(JobFailed) as info:
            job.result(timeout=20)
        assert "first try fails" in info.value.error
        again = client.retry(job_id)
        assert again.state not in {"failed", "canceled"}
        assert again.result(timeout=20) == b"ok"
        with pytest.raises(ControllerError) as conflict:
            client.retry(job_id)  # finished: nothing to retry
        assert conflict.value.status == 409
    assert shown(live, job_id)["attempts"] == 2  # attempts go on counting


def test_a_canceled_job_retried_runs_again(live):
    with Client(live.controller.url) as client:
        job = client.submit("to cancel", id="cancel-then-retry", delay=60)
        assert client.cancel(job.id).state == "canceled"
        assert client.retry(job.id).result(timeout=20) == b"to cancel"


def test_udp_client_add_sends_its_option_flags(live):
    done = run_udp_client(
        live.controller.udp_port,
        "add",
        "4242",
        "--payload",
        "flagged",
        "--priority",
        "-7",
        "--max-retries",
        "1",
        "--placement-timeout",
        "20",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == b"flagged"
    with Client(live.controller.url) as client:
        [info] = [
            job.info
            for job in (client.get(job_id) for job_id in _udp_ids(live, 4242))
            if job.info.get("payload") == "flagged"
        ]
    assert (info["priority"], info["max_retries"], info["placement_timeout"]) == (-7, 1, 20)


def _udp_ids(live: Live, task_id: int) -> list[str]:
    """The ids of the UDP jobs numbered `task_id` (whatever port the client used)."""
    with urllib.request.urlopen(f"{live.controller.url}/job/?limit=1000") as resp:
        jobs = json.load(resp)
    return [job_id for job_id in jobs if job_id.endswith(f"-{task_id}")]

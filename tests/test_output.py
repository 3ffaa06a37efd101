"""Job output end to end: real controllers and workers of every kind, over HTTP."""

from __future__ import annotations

import contextlib
import http.client
import json
import sqlite3
import time
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.helpers import (
    live_controller,
    logged_process,
    remote_worker_argv,
    wait_for_condition,
    worker_argv,
)


def _call(url: str, method: str = "GET", body: Any = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, method=method)
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=30) as resp:
        return json.loads(resp.read())


def _output(url: str, job_id: str) -> tuple[int, str, str]:
    """(status, content type, text) of GET /job/{id}/output."""
    try:
        with urllib.request.urlopen(f"{url}/job/{job_id}/output", timeout=30) as resp:
            return resp.status, resp.headers["content-type"], resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["content-type"], exc.read().decode()


def _state(url: str, job_id: str) -> str:
    return str(_call(f"{url}/job/{job_id}/")["state"])


def _ended(url: str, job_id: str, timeout: float = 20) -> dict[str, Any]:
    job = _call(f"{url}/job/{job_id}/?wait={timeout}")
    assert job["state"] in ("finished", "failed"), job
    return job


SLOW = "echo one >&2; sleep 1; echo two >&2"


def _output_on_disk(tmp_path: Path, ending: bytes) -> bool:
    """Whether the journal in `tmp_path` holds an output ending so (the answers that show
    output do not wait for the journal: a test that kills the controller waits for this)."""
    with contextlib.closing(sqlite3.connect(tmp_path / "journal.sqlite3")) as db:
        rows = db.execute("SELECT data FROM output").fetchall()
    return any(bytes(row[0]).endswith(ending) for row in rows)


def test_local_output_is_followed_live_and_survives_a_controller_sigkill(tmp_path: Path) -> None:
    args = ("--workers", "1", "--", "--exec", "sh", "-c", SLOW)
    with live_controller(tmp_path, *args) as ctl:
        job_id = _call(f"{ctl.url}/job/", "POST", {"id": "slow"})["id"]
        parts = urlsplit(ctl.url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
        conn.request("GET", f"/job/{job_id}/output?follow=1")
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.headers["content-type"] == "text/plain; charset=utf-8"
        assert resp.headers["transfer-encoding"] == "chunked"
        first = resp.readline()
        # The first line arrives while the job still runs (it sleeps a second after it).
        assert first == b"one\n"
        assert _state(ctl.url, job_id) in ("requested", "working")
        assert resp.read() == b"two\n"  # and the response ends with the job
        conn.close()
        assert _state(ctl.url, job_id) == "finished"
        assert _output(ctl.url, job_id) == (200, "text/plain; charset=utf-8", "one\ntwo\n")
        wait_for_condition(lambda: _output_on_disk(tmp_path, b"one\ntwo\n"))
        ctl.proc.kill()
        ctl.proc.wait()
        with live_controller(tmp_path) as again:
            assert _output(again.url, job_id)[2] == "one\ntwo\n"
            assert _output(again.url, "nobody")[0] == 404


def test_a_failed_jobs_stderr_is_its_output_and_still_its_error(tmp_path: Path) -> None:
    args = ("--workers", "1", "--", "--exec", "sh", "-c", "echo bad news >&2; exit 3")
    with live_controller(tmp_path, *args, max_retries=0) as ctl:
        job_id = _call(f"{ctl.url}/job/", "POST", {})["id"]
        job = _ended(ctl.url, job_id)
        assert job["state"] == "failed"
        assert "bad news" in job["error"]
        assert _output(ctl.url, job_id)[2] == "bad news\n"


@pytest.mark.parametrize("handler", ["chatty", "achatty"])
def test_a_handlers_prints_and_logging_are_its_output(tmp_path: Path, handler: str) -> None:
    with live_controller(tmp_path) as ctl:
        argv = worker_argv(
            tmp_path / "s", "--handler", f"tests.worker_handlers:{handler}", log_level="INFO"
        )
        with logged_process(argv, tmp_path / "worker.log"):
            job_id = _call(f"{ctl.url}/job/", "POST", {"payload": "hello"})["id"]
            assert _ended(ctl.url, job_id)["result"] == "hello"
            text = _output(ctl.url, job_id)[2]
            assert text.startswith("printed hello\n")
            assert "WARNING" in text and "job: logged hello" in text
        # The worker's own log lines are not any job's output, and the job's are not its log.
        worker_log = (tmp_path / "worker.log").read_text()
        assert "registered as worker" in worker_log
        assert "logged hello" not in worker_log


def test_a_calculators_output_comes_with_its_report(tmp_path: Path) -> None:
    with live_controller(tmp_path, allowed_calculators=["127.0.0.0/8"]) as ctl:
        argv = remote_worker_argv(
            *["--udp", f"127.0.0.1:{ctl.udp_port}", "--pulse", "0.2"],
            *["--exec", "sh", "-c", "printf 'calc\\377\\n' >&2; cat"],
        )
        with logged_process(argv, tmp_path / "calculator.log"):
            job_id = _call(f"{ctl.url}/job/", "POST", {"payload": "x"})["id"]
            assert _ended(ctl.url, job_id)["result"] == "x"
            assert _output(ctl.url, job_id)[2] == "calc\ufffd\n"


def test_a_pollers_output_is_its_lease_log(tmp_path: Path) -> None:
    script = "echo first >&2; sleep 0.8; printf 'second' >&2; cat"
    with live_controller(tmp_path) as ctl:
        argv = remote_worker_argv(
            *["--hub", ctl.url, "--pulse", "0.2", "--exec", "sh", "-c", script],
        )
        with logged_process(argv, tmp_path / "poller.log"):
            job_id = _call(f"{ctl.url}/job/", "POST", {"payload": "p"})["id"]
            wait_for_condition(lambda: _output(ctl.url, job_id)[2] == "first\n")
            job = _ended(ctl.url, job_id)
            assert job["result"] == "p"
            assert job["log"] == ["first\n", "second"]
            assert _output(ctl.url, job_id)[2] == "first\nsecond\n"


def test_endless_output_is_capped_and_non_utf8_replaced(tmp_path: Path) -> None:
    # 4 MiB of x, then two bytes that are not UTF-8 and a last line.
    script = "head -c 4194304 /dev/zero | tr '\\0' x >&2; printf '\\377\\376end\\n' >&2"
    args = ("--workers", "1", "--", "--exec", "sh", "-c", script)
    with live_controller(tmp_path, *args, output_retention=100_000) as ctl:
        started = time.monotonic()
        job_id = _call(f"{ctl.url}/job/", "POST", {})["id"]
        assert _ended(ctl.url, job_id, 60)["state"] == "finished"
        text = _output(ctl.url, job_id)[2]
        assert text.endswith("x\ufffd\ufffdend\n")
        assert len(text.encode()) <= 100_000 + 4  # two replaced bytes grew by two each
        assert time.monotonic() - started < 60
        wait_for_condition(lambda: _output_on_disk(tmp_path, b"end\n"))
        ctl.proc.kill()
        ctl.proc.wait()
        with live_controller(tmp_path, output_retention=100_000) as again:
            assert _output(again.url, job_id)[2] == text

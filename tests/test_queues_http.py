"""Queues and job options through the HTTP and UDP doors: the job object, refusals, retries by
a user (the dead-letter queue), queues as objects and pauses, and what survives a SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from controller import datagram as dg
from controller.options import OPTIONS
from tests.helpers import live_controller
from tests.test_http import client, http_controller

# The job object shows every option but `delay` (as the `run_at` it makes).
OPTION_FIELDS = set(OPTIONS) - {"delay"}


async def test_a_job_without_options_shows_the_http_defaults(sockdir):
    async with (
        http_controller(sockdir, max_retries=2, retry_delay=1.5) as ctl,
        client(ctl.url) as http,
    ):
        job = (await http.post("/job/", json={"payload": "x"})).json()
    assert set(job) >= OPTION_FIELDS
    assert {name: job[name] for name in sorted(OPTION_FIELDS)} == {
        "limits": {},  # the configuration's job_limits: none
        "max_retries": 2,
        "owner": "http",
        "placement_timeout": 0.0,  # HTTP jobs wait for a worker without limit
        "priority": 0,
        "queue": "default",
        "requires": [],
        "retry_delay": 1.5,
        "run_at": None,
        "timeout": 0.0,
        "unique_key": None,
        "after": [],
        "after_any": False,
    }


async def test_options_given_are_kept_and_a_delayed_job_is_scheduled(sockdir):
    async with http_controller(sockdir) as ctl, client(ctl.url) as http:
        body = {
            "payload": "later",
            "queue": "reports",
            "priority": 7,
            "requires": ["gpu", "ssd", "gpu"],
            "delay": 60,
            "max_retries": 5,
            "retry_delay": 2,
            "timeout": 9.5,
            "placement_timeout": 30,
            "owner": "alice",
        }
        before = time.time()
        resp = await http.post("/job/", json=body)
        assert resp.status_code == 201, resp.text
        job = resp.json()
        assert job["state"] == "scheduled"
        assert (job["queue"], job["priority"], job["requires"]) == ("reports", 7, ["gpu", "ssd"])
        assert (job["max_retries"], job["retry_delay"], job["timeout"]) == (5, 2.0, 9.5)
        assert (job["placement_timeout"], job["owner"]) == (30.0, "alice")
        run_at = datetime.fromisoformat(job["run_at"]).timestamp()
        assert before + 59 <= run_at <= time.time() + 61
        listed = (await http.get("/job/", params={"state": "scheduled"})).json()
        assert list(listed) == [job["id"]]
        assert (await http.get("/job/", params={"queue": "other"})).json() == {}
        assert list((await http.get("/job/", params={"queue": "reports"})).json()) == [job["id"]]


async def test_a_job_with_run_at_in_the_past_runs_now(sockdir):
    async with http_controller(sockdir) as ctl, client(ctl.url) as http:
        past = (datetime.now(UTC) - timedelta(hours=1)).isoformat()
        job = (await http.post("/job/", json={"payload": "now", "run_at": past})).json()
        done = (await http.get(f"/job/{job['id']}/", params={"wait": 10})).json()
        assert done["state"] == "finished" and done["run_at"] is None


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("queue", "Upper", "queue must match"),
        ("queue", "", "queue must match"),
        ("priority", 101, "priority must be an integer from -100 to 100"),
        ("priority", 1.5, "priority must be an integer"),
        ("priority", "1", "priority must be an integer"),
        ("requires", "gpu", "requires must be a list"),
        ("requires", ["ok", "no way"], "a label must match"),
        ("delay", -1, "delay must be a number of seconds from 0"),
        ("delay", True, "delay must be a number"),
        ("run_at", "2026-02-30T00:00:00Z", "run_at is not an RFC 3339 time"),
        ("run_at", "2026-01-01T00:00:00", "run_at needs a zone offset"),
        ("max_retries", 101, "max_retries must be an integer from 0 to 100"),
        ("retry_delay", 3601, "retry_delay must be at most 3600"),
        ("timeout", -0.5, "timeout must be a number of seconds from 0"),
        ("placement_timeout", "soon", "placement_timeout must be a number"),
        ("owner", "", "owner must be 1 to 200"),
    ],
)
async def test_a_bad_option_is_a_400_naming_it(sockdir, field, value, says):
    async with http_controller(sockdir, workers=0) as ctl, client(ctl.url) as http:
        resp = await http.post("/job/", json={"payload": "x", field: value})
        assert resp.status_code == 400
        assert says in resp.json()["message"]
        assert ctl.desk.book.latest(10) == []


async def test_delay_and_run_at_together_are_refused(sockdir):
    async with http_controller(sockdir, workers=0) as ctl, client(ctl.url) as http:
        resp = await http.post("/job/", json={"delay": 1, "run_at": datetime.now(UTC).isoformat()})
        assert resp.status_code == 400 and "not both" in resp.json()["message"]


async def test_retry_puts_a_failed_job_back_with_a_fresh_max_retries(sockdir):
    async with (
        http_controller(
            sockdir, handler="tests.worker_handlers:fail_when_asked", max_retries=0
        ) as ctl,
        client(ctl.url) as http,
    ):
        job = (await http.post("/job/", json={"id": "dead", "payload": "fail"})).json()
        failed = (await http.get("/job/dead/", params={"wait": 10})).json()
        assert failed["state"] == "failed" and failed["attempts"] == 1
        assert list((await http.get("/job/", params={"state": "failed"})).json()) == ["dead"]
        resp = await http.post("/job/dead/retry/")
        assert resp.status_code == 200, resp.text
        assert resp.json()["state"] in ("pending", "requested", "working", "failed")
        again = (await http.get("/job/dead/", params={"wait": 10})).json()
        assert again["state"] == "failed" and again["attempts"] == 2
        assert again["payload"] == "fail" and job["id"] == "dead"
        assert ctl.executions[b"fail"] == 2


async def test_retry_of_a_job_in_any_other_state_is_409(sockdir):
    async with http_controller(sockdir) as ctl, client(ctl.url) as http:
        await http.post("/job/", json={"id": "ok", "payload": "x"})
        await http.get("/job/ok/", params={"wait": 10})
        resp = await http.post("/job/ok/retry")  # also without the slash
        assert resp.status_code == 409 and "finished" in resp.json()["message"]
        assert (await http.post("/job/nope/retry/")).status_code == 404
        assert (await http.get("/job/ok/retry/")).status_code == 405


async def test_retry_of_a_canceled_job_runs_it(sockdir):
    async with http_controller(sockdir, workers=0) as ctl, client(ctl.url) as http:
        await http.post("/job/", json={"id": "c", "payload": "x"})
        await http.put("/job/c/", json={"state": "canceled"})
        resp = await http.post("/job/c/retry/")
        assert resp.status_code == 200 and resp.json()["state"] == "pending"
        assert ctl.shell.core.queued == 1


async def test_queues_are_listed_and_a_paused_queue_keeps_its_jobs(sockdir):
    async with http_controller(sockdir, workers=1) as ctl, client(ctl.url) as http:
        resp = await http.put("/queue/default/", json={"paused": True})
        assert resp.status_code == 200, resp.text
        assert resp.json()["default"]["paused"] is True
        await http.post("/job/", json={"id": "held", "payload": "x"})
        await http.post("/job/", json={"id": "later", "payload": "x", "delay": 600})
        await http.post("/job/", json={"id": "elsewhere", "payload": "x", "queue": "other"})
        queues = (await http.get("/queue/")).json()
        assert queues["default"] == {
            "pending": 1,
            "scheduled": 1,
            "working": 0,
            "workers": 1,
            "paused": True,
            "concurrency": None,
            "rate": None,
        }
        assert queues["other"] == {
            "pending": 1,
            "scheduled": 0,
            "working": 0,
            "workers": 0,  # waits: no worker serves it
            "paused": False,
            "concurrency": None,
            "rate": None,
        }
        assert (await http.get("/job/held/", params={"wait": 0.5})).json()["state"] == "pending"
        await http.put("/queue/default", json={"paused": False})
        done = (await http.get("/job/held/", params={"wait": 10})).json()
        assert done["state"] == "finished"


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/queue/Bad/", {"paused": True}, 400),
        ("/queue/q/", {"paused": "yes"}, 400),
        ("/queue/q/", {"stop": True}, 400),
        ("/queue/q/", None, 400),
    ],
)
async def test_bad_queue_requests_are_400(sockdir, path, body, status):
    async with http_controller(sockdir, workers=0) as ctl, client(ctl.url) as http:
        resp = await http.put(path, content=json.dumps(body) if body is not None else b"")
        assert resp.status_code == status


def _udp_add(port: int, params: dict[str, object]) -> dict[str, object]:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(5)
        sock.sendto(dg.request("add_task", params, 7), ("127.0.0.1", port))
        data, _ = sock.recvfrom(65536)
    return json.loads(data)


async def test_udp_add_task_takes_options_and_refuses_bad_ones(sockdir):
    async with http_controller(sockdir, workers=0) as ctl, client(ctl.url) as http:
        # (an error answer is never longer than its request: this one leaves room)
        params = {"task_id": 1, "priority": "high", "payload": "x" * 300}
        bad = await _to_thread(_udp_add, ctl.udp_port, params)
        assert bad["error"]["code"] == "bad_option"
        assert "priority" in bad["error"]["message"]
        good = await _to_thread(
            _udp_add,
            ctl.udp_port,
            {"task_id": 2, "queue": "q", "priority": 3, "requires": ["gpu"], "delay": 100},
        )
        assert "error" not in good
        [job] = (await http.get("/job/", params={"queue": "q"})).json().values()
        assert (job["state"], job["priority"], job["requires"]) == ("scheduled", 3, ["gpu"])
        assert job["owner"] == "127.0.0.1" and job["placement_timeout"] == 30.0


async def _to_thread(fn, *args):
    import trio

    return await trio.to_thread.run_sync(fn, *args)


def test_a_scheduled_job_and_a_pause_survive_a_sigkill_with_the_same_time(tmp_path: Path):
    with live_controller(tmp_path) as first:
        with httpx.Client(base_url=first.url, timeout=10) as http:
            job = http.post("/job/", json={"id": "s", "payload": "x", "delay": 120}).json()
            assert http.put("/queue/q/", json={"paused": True}).status_code == 200
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait()
        with live_controller(tmp_path) as second, httpx.Client(base_url=second.url) as http:
            again = http.get("/job/s/").json()
            assert again["state"] == "scheduled" and again["run_at"] == job["run_at"]
            assert http.get("/queue/").json()["q"]["paused"] is True


async def test_each_attempt_is_kept_with_its_worker_times_outcome_and_error(sockdir, tmp_path):
    journal = tmp_path / "journal.sqlite3"
    async with (
        http_controller(
            sockdir,
            handler="tests.worker_handlers:fails_first_time",
            journal=journal,
            max_retries=1,
        ) as ctl,
        client(ctl.url) as http,
    ):
        await http.post("/job/", json={"id": "twice", "payload": "x"})
        done = (await http.get("/job/twice/", params={"wait": 10})).json()
        assert done["state"] == "finished" and done["attempts"] == 2
        job = ctl.desk.book.get("twice")
        assert job is not None
        first, second = job.attempts_made()
        assert first.outcome == "failed" and "first time unlucky" in first.error
        assert second.outcome == "finished" and second.error == ""
        assert 0 < first.started <= first.ended <= second.started <= second.ended
        assert {first.worker, second.worker} <= set(ctl.shell.core.workers)
        workers = (first.worker, second.worker)
        await ctl.desk.write_ahead.committed()  # its end is on disk too (?wait= does not wait)
    async with http_controller(sockdir, journal=journal) as again:
        job = again.desk.book.get("twice")
        assert job is not None
        first, second = job.attempts_made()
        assert (first.outcome, second.outcome) == ("failed", "finished")
        assert (first.worker, second.worker) == workers
        assert "first time unlucky" in first.error

"""Batches (DESIGN.md section 17): `POST /batch/` makes its jobs as a bulk array would and a
`then` job, in state `waiting`, that runs once they have all ended whatever their outcomes;
`GET /batch/{id}/` counts the batch's jobs by state. Journaled: a restart keeps batches, and a
controller killed with SIGKILL in the middle of one loses no job and runs `then` once."""

from __future__ import annotations

import collections
import json
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import trio

from controller.client import AsyncClient, Batch, Client, Job
from tests.helpers import (
    controller_argv,
    free_tcp_port,
    free_udp_port,
    wait_until,
    worker_argv,
    write_config,
)
from tests.test_http import client, http_controller
from tests.worker_handlers import start_workers


async def test_then_runs_once_every_job_of_the_batch_ended_whatever_the_outcome(sockdir):
    handler = "tests.worker_handlers:fail_when_asked"
    async with (
        http_controller(sockdir, workers=1, handler=handler) as ctl,
        client(ctl.url) as http,
    ):
        body = {
            "jobs": [
                {"id": "one", "payload": "one"},
                {"payload": "fail-two", "max_retries": 0},
                {"payload": "three", "after": ["one"]},
            ],
            "then": {"id": "sum", "payload": "then", "name": "the sum"},
        }
        made = await http.post("/batch/", json=body)
        assert made.status_code == 201, made.text
        batch = made.json()
        assert set(batch) == {"id", "jobs", "then"}
        assert [job["payload"] for job in batch["jobs"]] == ["one", "fail-two", "three"]
        then = batch["then"]
        assert then["id"] == "sum" and then["state"] == "waiting" and then["payload"] == "then"
        assert then["batch"] == batch["id"] and then["after_any"] is True
        assert then["after"] == [job["id"] for job in batch["jobs"]]
        assert all(job["batch"] is None for job in batch["jobs"])
        done = (await http.get("/job/sum/", params={"wait": 10})).json()
        assert done["state"] == "finished" and done["result"] == "then"
        report = (await http.get(f"/batch/{batch['id']}/")).json()
        assert report == {
            "id": batch["id"],
            "counts": {"finished": 2, "failed": 1},
            "ids": then["after"],
            "then": "sum",
        }
        assert ctl.executions[b"then"] == 1


async def test_counts_follow_the_jobs_and_then_waits(sockdir):
    async with http_controller(sockdir, workers=0) as ctl, client(ctl.url) as http:
        body = {"jobs": [{"id": "a"}, {"id": "b"}], "then": {"payload": "t"}}
        batch = (await http.post("/batch/", json=body)).json()
        url = f"/batch/{batch['id']}/"
        assert (await http.get(url)).json()["counts"] == {"pending": 2}
        await http.put("/job/a/", json={"state": "canceled"})
        report = (await http.get(url)).json()
        assert report["counts"] == {"pending": 1, "canceled": 1}
        then = batch["then"]["id"]
        assert (await http.get(f"/job/{then}/")).json()["state"] == "waiting"
        await http.delete("/job/b/")
        assert (await http.get(f"/job/{then}/")).json()["state"] == "pending"  # as after_any
        assert (await http.get(url)).json()["counts"] == {"canceled": 1, "deleted": 1}
        empty = await http.post("/batch/", json={"jobs": [], "then": {}})
        assert empty.status_code == 201 and empty.json()["then"]["state"] == "pending"
        assert (await http.get("/batch/nobody/")).status_code == 404
        assert (await http.get("/batch/nobody")).status_code == 404


BAD_BODIES = [
    (b"", 400),
    (b"[]", 400),
    (b"not json", 400),
    (b'{"jobs": []}', 400),
    (b'{"jobs": {}, "then": {}}', 400),
    (b'{"jobs": [], "then": []}', 400),
    (b'{"jobs": [], "then": {}, "other": 1}', 400),
    (b'{"jobs": [5], "then": {}}', 400),
    (b'{"jobs": [{"queue": "Bad"}], "then": {}}', 400),
    (b'{"jobs": [], "then": {"priority": 500}}', 400),
    (b'{"jobs": [], "then": {"after": []}}', 400),
    (b'{"jobs": [], "then": {"after_any": true}}', 400),
    (b'{"jobs": [{"after": ["nobody"]}], "then": {}}', 400),
    (b'{"jobs": [{"id": "x", "after": ["y"]}, {"id": "y"}], "then": {}}', 400),
    (b'{"jobs": [], "then": {"id": "exists"}}', 409),
    (b'{"jobs": [{"id": "m"}], "then": {"id": "m"}}', 400),
    (json.dumps({"jobs": [{}] * 10_001, "then": {}}).encode(), 413),
    (b'{"jobs": [' * 5000 + b"]" * 5000 + b', "then": {}}', 400),
]


@pytest.mark.parametrize(("body", "status"), BAD_BODIES)
async def test_a_bad_batch_is_refused_and_makes_nothing(sockdir, body, status):
    async with http_controller(sockdir, workers=0) as ctl, client(ctl.url) as http:
        await http.post("/job/", json={"id": "exists"})
        resp = await http.post("/batch/", content=body)
        assert resp.status_code == status, resp.text
        assert resp.json()["code"] == status
        assert list((await http.get("/job/")).json()) == ["exists"]
        assert ctl.desk.waits.batches == {}


async def test_a_then_job_whose_unique_key_is_held_refuses_the_batch(sockdir):
    """A batch is recorded by its `then` job: one another job would answer for cannot be made,
    so the batch is refused and nothing made; once the holder has ended the key is free."""
    async with http_controller(sockdir, workers=0) as ctl, client(ctl.url) as http:
        held = await http.post("/job/", json={"id": "holder", "unique_key": "T:1"})
        assert held.status_code == 201
        body = {"jobs": [{"id": "a"}], "then": {"id": "t", "unique_key": "T:1"}}
        refused = await http.post("/batch/", json=body)
        assert refused.status_code == 409, refused.text
        assert "'T:1' is held by the live job holder" in refused.json()["message"]
        same = {"jobs": [{"id": "a", "unique_key": "T:2"}], "then": {"unique_key": "T:2"}}
        refused = await http.post("/batch/", json=same)
        assert refused.status_code == 400, refused.text
        assert refused.json()["message"] == "then: its unique_key 'T:2' is a job's of the batch"
        assert list((await http.get("/job/")).json()) == ["holder"]
        assert ctl.desk.waits.batches == {}
        await http.delete("/job/holder/")
        made = await http.post("/batch/", json=body)
        assert made.status_code == 201, made.text
        assert made.json()["then"]["unique_key"] == "T:1"
        again = await http.post("/job/", json={"unique_key": "T:1"})
        assert again.status_code == 200 and again.json()["id"] == "t"


async def test_a_batch_is_kept_across_a_restart(sockdir, tmp_path):
    journal = tmp_path / "journal.sqlite3"
    async with http_controller(sockdir, workers=0, journal=journal) as ctl, client(ctl.url) as h:
        batch = (await h.post("/batch/", json={"jobs": [{"id": "a"}], "then": {}})).json()
    async with http_controller(sockdir, workers=1, journal=journal) as ctl, client(ctl.url) as h:
        report = (await h.get(f"/batch/{batch['id']}/")).json()
        assert report["ids"] == ["a"] and report["then"] == batch["then"]["id"]
        then = (await h.get(f"/job/{report['then']}/", params={"wait": 10})).json()
        assert then["state"] == "finished" and then["batch"] == batch["id"]


def test_a_sigkill_in_the_middle_of_a_batch_loses_no_job_and_runs_then_once(tmp_path):
    sockdir = tmp_path / "s"
    sockdir.mkdir()
    gate, execlog = tmp_path / "gate", tmp_path / "executions.log"
    http_port = free_tcp_port()
    config = write_config(
        tmp_path,
        socket_dir=str(sockdir),
        journal=str(tmp_path / "journal.sqlite3"),
        client_address={"host": "127.0.0.1", "port": free_udp_port()},
        http_address={"host": "127.0.0.1", "port": http_port},
    )
    script = f'echo "$TASK_ID" >> {execlog}; while [ ! -e {gate} ]; do sleep 0.01; done; cat'
    url = f"http://127.0.0.1:{http_port}"
    procs: list[subprocess.Popen[bytes]] = []

    def start(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
        with log.open("ab") as sink:
            proc = subprocess.Popen(argv, stderr=sink, stdout=subprocess.DEVNULL)
        procs.append(proc)
        return proc

    def until(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
        trio.run(wait_until, predicate, timeout)

    def answers() -> bool:
        try:
            return httpx.get(f"{url}/health/", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        controller = start(controller_argv(config), tmp_path / "controller-0.log")
        until(answers)
        for _ in range(2):
            start(
                worker_argv(sockdir, "--pulse", "0.2", "--exec", "sh", "-c", script),
                tmp_path / "worker.log",
            )
        jobs = [{"id": f"j{n}", "payload": f"p{n}"} for n in range(6)]
        made = httpx.post(f"{url}/batch/", json={"jobs": jobs, "then": {"payload": "then"}})
        assert made.status_code == 201, made.text
        batch = made.json()
        then_task = batch["then"]["task_id"]
        # Two jobs of the batch are running when the controller is killed.
        until(lambda: execlog.exists() and len(execlog.read_text().split()) >= 2)
        controller.send_signal(signal.SIGKILL)
        controller.wait()
        controller = start(controller_argv(config), tmp_path / "controller-1.log")
        until(answers)
        report = httpx.get(f"{url}/batch/{batch['id']}/").json()
        assert report["ids"] == [f"j{n}" for n in range(6)]
        assert sum(report["counts"].values()) == 6
        assert httpx.get(f"{url}/job/{report['then']}/").json()["state"] == "waiting"
        gate.touch()
        then = httpx.get(f"{url}/job/{report['then']}/", params={"wait": 30}, timeout=40).json()
        assert then["state"] == "finished" and then["result"] == "then"
        report = httpx.get(f"{url}/batch/{batch['id']}/").json()
        assert report["counts"] == {"finished": 6}
        runs = collections.Counter(int(line) for line in execlog.read_text().split())
        assert runs[then_task] == 1
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


async def test_an_exec_then_job_finds_batch_id_in_its_environment(sockdir):
    async with (
        http_controller(sockdir, workers=0) as ctl,
        client(ctl.url) as http,
        trio.open_nursery() as nursery,
    ):
        script = 'printf "%s/%s" "$TASK_ID" "${BATCH_ID-none}"'
        await start_workers(nursery, sockdir, "--exec", "sh", "-c", script, count=1)
        await wait_until(lambda: ctl.shell.core.idle_workers == 1)
        body = {"jobs": [{"id": "part"}], "then": {"id": "join"}}
        batch = (await http.post("/batch/", json=body)).json()
        then = (await http.get("/job/join/", params={"wait": 10})).json()
        assert then["state"] == "finished"
        assert then["result"] == f"{then['task_id']}/{batch['id']}"
        part = (await http.get("/job/part/")).json()
        assert part["result"] == f"{part['task_id']}/none"  # not a then job: no BATCH_ID
        nursery.cancel_scope.cancel()


# ---------------------------------------------------------------- the client


async def test_client_submit_batch_returns_a_batch(sockdir):
    async with http_controller(sockdir, workers=1) as ctl:

        def run() -> tuple[Batch[Job], bytes]:
            with Client(ctl.url) as http_client:
                with pytest.raises(ValueError, match="after and after_any are the batch's"):
                    http_client.submit_batch([b"x"], then={"payload": b"t", "after": ["x"]})
                with pytest.raises(ValueError, match="priority must be"):
                    http_client.submit_batch([{"payload": b"x", "priority": 500}], then=b"t")
                batch = http_client.submit_batch(
                    [b"one", {"payload": "two", "id": "two", "queue": "default"}],
                    then={"payload": b"then", "name": "join"},
                )
                return batch, batch.then.result(timeout=20)

        batch, result = await trio.to_thread.run_sync(run)
        assert isinstance(batch, Batch) and batch.id
        assert [job.id for job in batch.jobs][1] == "two" and len(batch.jobs) == 2
        assert result == b"then"
        assert len(ctl.desk.book) == 3

        def over_udp() -> None:
            with Client(f"udp://127.0.0.1:{ctl.udp_port}") as udp_client:
                udp_client.submit_batch([b"x"], then=b"t")

        with pytest.raises(ValueError, match="submit_batch needs http"):
            await trio.to_thread.run_sync(over_udp)


async def test_async_client_submit_batch(sockdir):
    async with http_controller(sockdir, workers=0) as ctl, AsyncClient(ctl.url) as http_client:
        batch = await http_client.submit_batch([b"a", b"b"], then=b"t")
        assert len(batch.jobs) == 2 and batch.then.state == "waiting"
        assert batch.then.id == ctl.desk.waits.batches[batch.id]


# ---------------------------------------------------------------- the console


async def test_the_console_shows_a_batch_its_counts_and_jobs(sockdir):
    async with http_controller(sockdir, workers=0) as ctl, client(ctl.url) as http:
        body = {"jobs": [{"id": "a"}, {"id": "b=1", "queue": "q1"}], "then": {"id": "t"}}
        batch = (await http.post("/batch/", json=body)).json()
        await http.put("/job/a/", json={"state": "canceled"})
        page = await http.get(f"/ui/batches/{batch['id']}")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        text = page.text
        assert f"<h1>Batch {batch['id']}</h1>" in text
        assert "<tr><td class=canceled>canceled</td><td class=num>1</td></tr>" in text
        assert "<tr><td class=pending>pending</td><td class=num>1</td></tr>" in text
        assert '<a href="/ui/jobs/a">a</a>' in text
        assert (
            '<a href="/ui/jobs/b%3D1">b=1</a></td><td class=pending>pending</td><td>q1</td>' in text
        )
        assert '<a href="/ui/jobs/t">t</a>' in text and "<b class=waiting>waiting</b>" in text
        job_page = await http.get("/ui/jobs/t")
        assert f'<a href="/ui/batches/{batch["id"]}">' in job_page.text
        missing = await http.get("/ui/batches/nobody")
        assert missing.status_code == 404 and "no batch" in missing.text

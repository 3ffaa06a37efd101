"""Dependencies (DESIGN.md section 17): the option `after` names jobs a new job waits for, in
state `waiting` (UDP word `queued`), held by the job desk out of the scheduler until every one
of them has ended; one that failed or was canceled cancels it (with an `error` naming that
job) unless `after_any`. A bad `after` is a bad option in every door; the waiting is journaled
and comes back after a restart; releasing costs O(dependents)."""

from __future__ import annotations

import dataclasses
import json
import socket
import tempfile
from pathlib import Path
from typing import Any

import pytest
import redis
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.app import assemble
from controller.client import AsyncClient, Client, ControllerError, JobFailed
from controller.config import Config, RedisSettings
from controller.core import TaskState
from controller.job_ids import DoorName
from controller.job_states import JobState
from controller.jobs import Job
from controller.options import DEFAULT, MAX_AFTER, BadOption, from_json, parse, to_json
from controller.shell.desk import JobDesk
from tests.helpers import REDIS_SERVER, redis_server, wait_until
from tests.test_http import client, http_controller

# ---------------------------------------------------------------- HTTP


async def test_a_job_waits_until_the_job_it_names_has_finished(sockdir, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    second.write_bytes(b"2")
    handler = "tests.worker_handlers:wait_for_file"
    async with (
        http_controller(sockdir, workers=2, handler=handler) as ctl,
        client(ctl.url) as http,
    ):
        a = (await http.post("/job/", json={"id": "a", "payload": str(first)})).json()
        assert a["after"] == [] and a["after_any"] is False
        made = await http.post("/job/", json={"id": "b", "payload": str(second), "after": ["a"]})
        assert made.status_code == 201, made.text
        b = made.json()
        assert b["state"] == "waiting" and b["after"] == ["a"]
        await wait_until(lambda: ctl.desk.book.get("a").state is JobState.WORKING)
        # A worker is free, yet b waits.
        assert ctl.shell.core.idle_workers == 1
        listed = (await http.get("/job/", params={"state": "waiting"})).json()
        assert list(listed) == ["b"]
        assert (await http.get("/job/b/")).json()["state"] == "waiting"
        first.write_bytes(b"1")
        done = (await http.get("/job/b/", params={"wait": 10})).json()
        assert done["state"] == "finished", done
        assert (await http.get("/job/a/")).json()["state"] == "finished"
        assert len(ctl.desk.waits) == 0 and not ctl.desk.waits.dependents


async def test_a_failed_job_cancels_its_dependents_unless_after_any(sockdir):
    handler = "tests.worker_handlers:fail_when_asked"
    async with (
        http_controller(sockdir, workers=1, handler=handler) as ctl,
        client(ctl.url) as http,
    ):
        jobs = [
            {"id": "a", "payload": "fail-a", "max_retries": 0},
            {"id": "b", "payload": "b", "after": ["a"]},
            {"id": "c", "payload": "c", "after": ["a"], "after_any": True},
            {"id": "d", "payload": "d", "after": ["b"]},  # b is canceled: d is too
        ]
        made = await http.post("/job/", json=jobs)
        assert made.status_code == 201, made.text
        assert [job["state"] for job in made.json()[1:]] == ["waiting"] * 3
        c = (await http.get("/job/c/", params={"wait": 10})).json()
        assert c["state"] == "finished"
        b = (await http.get("/job/b/")).json()
        assert b["state"] == "canceled"
        assert b["error"] == "job 'a', which it waited for, failed"
        d = (await http.get("/job/d/")).json()
        assert d["state"] == "canceled" and "'b'" in d["error"]
        # A job made after its dependency failed is canceled at once.
        late = await http.post("/job/", json={"payload": "e", "after": ["a"]})
        assert late.status_code == 201 and late.json()["state"] == "canceled"


async def test_canceling_or_deleting_a_waiting_job_cancels_its_dependents(sockdir):
    async with http_controller(sockdir, workers=0) as ctl, client(ctl.url) as http:
        jobs = [
            {"id": "a", "payload": "a"},
            {"id": "b", "payload": "b", "after": ["a"]},
            {"id": "c", "payload": "c", "after": ["b"]},
            {"id": "d", "payload": "d", "after": ["b"], "after_any": True},
            {"id": "x", "payload": "x", "after": ["a"]},
            {"id": "y", "payload": "y", "after": ["x"]},
        ]
        assert (await http.post("/job/", json=jobs)).status_code == 201
        canceled = await http.put("/job/b/", json={"state": "canceled"})
        assert canceled.status_code == 200 and canceled.json()["state"] == "canceled"
        assert (await http.get("/job/c/")).json()["state"] == "canceled"
        assert (await http.get("/job/d/")).json()["state"] == "pending"  # after_any: it runs
        deleted = await http.delete("/job/x/")
        assert deleted.status_code == 200 and deleted.json()["state"] == "deleted"
        y = (await http.get("/job/y/")).json()
        assert (
            y["state"] == "canceled" and y["error"] == "job 'x', which it waited for, was canceled"
        )
        # Deleting a pending job the others wait for cancels them too.
        assert (await http.post("/job/", json={"id": "z", "payload": "z", "after": ["a"]})).json()[
            "state"
        ] == "waiting"
        await http.delete("/job/a/")
        assert (await http.get("/job/z/")).json()["state"] == "canceled"
        assert ctl.desk.live_jobs == 1  # d alone
        assert len(ctl.desk.waits) == 0


BAD_AFTER = [
    ("a string", "after must be a list of job ids"),
    ([5], "after: a job id is text"),
    ([""], "after: a job id is text"),
    (["x" * 201], "after: a job id is text"),
    ([f"j{n}" for n in range(MAX_AFTER + 1)], f"after names at most {MAX_AFTER} jobs"),
    (["nobody"], "after names 'nobody', a job this controller does not hold"),
    (["self"], "after names the job itself ('self'): a cycle"),
]


@pytest.mark.parametrize(("after", "message"), BAD_AFTER)
async def test_a_bad_after_is_a_400_and_makes_nothing(sockdir, after, message):
    async with http_controller(sockdir, workers=0) as ctl, client(ctl.url) as http:
        resp = await http.post("/job/", json={"id": "self", "payload": "x", "after": after})
        assert resp.status_code == 400, resp.text
        assert resp.json()["message"].startswith(message), resp.json()
        assert (await http.get("/job/")).json() == {}
        bad_flag = await http.post("/job/", json={"payload": "x", "after_any": "yes"})
        assert bad_flag.status_code == 400


async def test_in_an_array_a_job_may_name_an_earlier_one_not_a_later_one(sockdir):
    async with http_controller(sockdir, workers=0) as ctl, client(ctl.url) as http:
        cycle = [
            {"id": "a", "payload": "a", "after": ["b"]},
            {"id": "b", "payload": "b", "after": ["a"]},
        ]
        resp = await http.post("/job/", json=cycle)
        assert resp.status_code == 400
        assert resp.json()["message"] == (
            "job 0 (id 'a'): after names 'b', a later job of the same request: a cycle"
        )
        assert (await http.get("/job/")).json() == {}
        unheld = await http.post("/job/", json=cycle[1:])  # a: neither held nor in the array
        assert unheld.status_code == 400
        assert "'a', a job this controller does not hold" in unheld.json()["message"]
        fine = [{"id": "a", "payload": "a"}, {"id": "b", "payload": "b", "after": ["a"]}]
        made = await http.post("/job/", json=fine)
        assert made.status_code == 201
        assert [job["state"] for job in made.json()] == ["pending", "waiting"]


# ---------------------------------------------------------------- UDP


def _udp(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.settimeout(10)
    sock.connect(("127.0.0.1", port))
    return sock


async def _ask(sock: socket.socket, method: str, txid: int, **params: Any) -> dict[str, Any]:
    packet = {"method": method, "packet_type": 1, "transmission_id": txid, "params": params}
    sock.send(json.dumps(packet).encode())
    while True:
        answer: dict[str, Any] = json.loads(await trio.to_thread.run_sync(sock.recv, 65536))
        if answer.get("transmission_id") == txid:
            return answer


async def test_udp_after_names_held_jobs_and_the_word_is_queued(sockdir):
    async with http_controller(sockdir, workers=0) as ctl, client(ctl.url) as http:
        await http.post("/job/", json={"id": "a", "payload": "a"})
        sock = _udp(ctl.udp_port)
        try:
            bad = await _ask(sock, "add_task", 1, task_id=7, payload="", after=["nobody"])
            assert bad["error"]["code"] == "bad_option", bad
            assert "nobody" in bad["error"]["message"]
            ack = await _ask(sock, "add_task", 2, task_id=8, payload="", after=["a"])
            assert "error" not in ack, ack
            status = await _ask(sock, "get_task", 3, task_id=8)
            assert status["params"]["status"] == "queued", status
        finally:
            sock.close()
        waiting = (await http.get("/job/", params={"state": "waiting"})).json()
        assert len(waiting) == 1


# ---------------------------------------------------------------- the journal


async def test_waiting_jobs_come_back_waiting_after_a_restart(sockdir, tmp_path):
    journal = tmp_path / "journal.sqlite3"
    async with http_controller(sockdir, workers=0, journal=journal) as ctl, client(ctl.url) as h:
        jobs = [
            {"id": "a", "payload": "a"},
            {"id": "b", "payload": "b", "after": ["a"]},
            {"id": "c", "payload": "c", "after": ["b"], "after_any": True},
        ]
        assert (await h.post("/job/", json=jobs)).status_code == 201
    async with http_controller(sockdir, workers=0, journal=journal) as ctl, client(ctl.url) as h:
        assert (await h.get("/job/b/")).json()["state"] == "waiting"
        c = (await h.get("/job/c/")).json()
        assert c["state"] == "waiting" and c["after"] == ["b"] and c["after_any"] is True
        assert len(ctl.desk.waits) == 2
        await h.put("/job/a/", json={"state": "canceled"})
        assert (await h.get("/job/b/")).json()["state"] == "canceled"
        assert (await h.get("/job/c/")).json()["state"] == "pending"
    async with http_controller(sockdir, workers=1, journal=journal) as ctl, client(ctl.url) as h:
        assert (await h.get("/job/b/")).json()["state"] == "canceled"
        assert (await h.get("/job/c/", params={"wait": 10})).json()["state"] == "finished"


async def test_a_job_whose_dependency_ended_while_down_is_let_go_at_start(sockdir, tmp_path):
    """The journal holds a waiting job whose dependency ended (as a crash between the two
    records would leave it): recovery lets it go."""
    journal = tmp_path / "journal.sqlite3"
    async with http_controller(sockdir, workers=0, journal=journal) as ctl, client(ctl.url) as h:
        await h.post("/job/", json={"id": "a", "payload": "a"})
        await h.post("/job/", json={"id": "b", "payload": "b", "after": ["a"]})
        desk = ctl.desk
        desk.waits.dependents.clear()  # as if the controller stopped before letting b go
        await h.put("/job/a/", json={"state": "canceled"})
        assert (await h.get("/job/b/")).json()["state"] == "waiting"
    async with http_controller(sockdir, workers=0, journal=journal) as ctl, client(ctl.url) as h:
        b = (await h.get("/job/b/")).json()
        assert b["state"] == "canceled" and "'a'" in b["error"]


# ---------------------------------------------------------------- the options


def test_after_round_trips_through_the_journal_text():
    options = parse({"after": ["a", "b", "a"], "after_any": True}, DEFAULT, 0.0)
    assert options.after == ("a", "b") and options.after_any
    assert from_json(to_json(options), DEFAULT) == options
    assert parse({"after": "a, b", "after_any": "true"}, DEFAULT, 0.0, text=True) == options
    assert parse({"after": ""}, DEFAULT, 0.0, text=True).after == ()
    with pytest.raises(BadOption):
        parse({"after_any": 1}, DEFAULT, 0.0)


# ---------------------------------------------------------------- cost, and the property


def _end(desk: JobDesk, job: Job, state: TaskState) -> None:
    """End a queued job as a worker would have (no worker runs here)."""
    actions = desk.scheduling.core.cancel(job.ref, trio.current_time())
    assert len(actions) == 1
    desk.finished(dataclasses.replace(actions[0], state=state))


def _submit(desk: JobDesk, job_id: str, after: list[str], after_any: bool = False) -> Job:
    options = parse({"after": after, "after_any": after_any}, DEFAULT, 0.0) if after else None
    task_id = desk.book.pick_task_id()
    now = trio.current_time()
    return desk.submit(job_id, DoorName.HTTP, None, task_id, b"", now, options=options)


async def _desk() -> Any:
    sockdir = Path(tempfile.mkdtemp(prefix="jc-"))
    return assemble(Config(socket_dir=sockdir, journal=None))


async def test_letting_go_looks_at_the_dependents_only():
    ctl = await _desk()
    desk = ctl.desk
    async with trio.open_nursery() as nursery:
        await nursery.start(ctl.shell.serve)
        roots = [_submit(desk, f"r{n}", []) for n in range(100)]
        chain = [_submit(desk, "c0", ["r0"])]
        for n in range(1, 10_000):
            chain.append(_submit(desk, f"c{n}", [chain[-1].id]))
        for n in range(10_000):
            _submit(desk, f"w{n}", [f"r{1 + n % 99}"])
        assert len(desk.waits) == 20_000 and desk.waits.looked_at == 0
        _end(desk, roots[1], TaskState.SUCCESS)  # 102 wait for it (w0, w99, ...)
        assert desk.waits.looked_at == 102
        assert chain[0].state is JobState.WAITING
        _end(desk, roots[0], TaskState.SUCCESS)  # c0 alone is let go
        assert desk.waits.looked_at == 103
        assert [job.state.value for job in chain[:2]] == ["pending", "waiting"]
        desk.cancel(chain[0], trio.current_time())  # the whole chain ends, a link at a time
        assert desk.waits.looked_at == 103 + 9_999
        assert all(job.state is JobState.CANCELED for job in chain)
        assert len(desk.waits) == 10_000 - 102
        nursery.cancel_scope.cancel()


@st.composite
def _plays(draw: st.DrawFn) -> list[tuple[str, int, list[int], bool]]:
    steps = []
    for n in range(draw(st.integers(1, 25))):
        kind = draw(st.sampled_from(["submit", "submit", "succeed", "fail", "cancel", "delete"]))
        after = draw(st.lists(st.integers(0, max(n - 1, 0)), max_size=3)) if n else []
        steps.append((kind, draw(st.integers(0, 1000)), after, draw(st.booleans())))
    return steps


async def _play(steps: list[tuple[str, int, list[int], bool]]) -> None:
    ctl = await _desk()
    desk = ctl.desk
    async with trio.open_nursery() as nursery:
        await nursery.start(ctl.shell.serve)
        made: list[Job] = []
        for kind, pick, after, after_any in steps:
            if kind == "submit" or not made:
                names = sorted({made[i].id for i in after if i < len(made)})
                made.append(_submit(desk, f"j{len(made)}", names, after_any))
            else:
                job = made[pick % len(made)]
                if kind in ("succeed", "fail") and job.task is not None and not job.state.final:
                    _end(desk, job, TaskState.SUCCESS if kind == "succeed" else TaskState.ERROR)
                elif kind == "cancel":
                    desk.cancel(job, trio.current_time())
                elif kind == "delete":
                    desk.delete(job, trio.current_time())
            for job in made:  # the property, after every step
                others = [desk.book.get(name) for name in job.options.after]
                if job.task is not None and job.options.after:  # let go: all have ended
                    assert all(other is not None and other.state.final for other in others)
                if job.state is JobState.WAITING:
                    assert any(not other.state.final for other in others if other is not None)
            assert desk.live_jobs == sum(1 for job in made if not job.state.final)
        nursery.cancel_scope.cancel()


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_plays())
def test_a_waiting_job_never_starts_before_what_it_waits_for_has_ended(steps):
    trio.run(_play, steps)


# ---------------------------------------------------------------- the client


async def test_client_submit_takes_after_and_after_any(sockdir):
    handler = "tests.worker_handlers:fail_when_asked"
    async with http_controller(sockdir, workers=1, handler=handler) as ctl:

        def run() -> tuple[bytes, str, str, str]:
            with Client(ctl.url) as client, Client(f"udp://127.0.0.1:{ctl.udp_port}") as udp:
                with pytest.raises(ValueError, match="after names at most 100"):
                    client.submit(b"x", after=[f"j{n}" for n in range(101)])
                with pytest.raises(ControllerError, match="does not hold"):
                    client.submit(b"x", after=["nobody"])
                first = client.submit(b"first", id="first")
                then = client.submit(b"then", after=[first.id])
                result = then.result(timeout=20)
                failing = client.submit(b"fail-1", max_retries=0)
                canceled = client.submit(b"never", after=[failing.id])
                anyway = client.submit(b"anyway", after=(failing.id,), after_any=True)
                with pytest.raises(JobFailed):
                    canceled.result(timeout=20)
                anyway.result(timeout=20)
                over_udp = udp.submit(b"udp", after=[first.id])
                over_udp.result(timeout=20)
                return result, canceled.state, anyway.state, over_udp.state

        result, canceled, anyway, over_udp = await trio.to_thread.run_sync(run)
        assert result == b"then" and canceled == "canceled" and anyway == "finished"
        assert over_udp == "finished"


async def test_async_client_submit_takes_after(sockdir):
    async with http_controller(sockdir, workers=0) as ctl, AsyncClient(ctl.url) as client:
        first = await client.submit(b"x", id="x")
        then = await client.submit(b"y", after=[first.id], after_any=True)
        assert then.state == "waiting"
        with pytest.raises(ValueError, match="after must be a list"):
            await client.submit(b"y", after="x")


# ---------------------------------------------------------------- Redis

needs_redis = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed")


@needs_redis
async def test_redis_entries_take_after_as_text(sockdir, tmp_path):
    with redis_server(tmp_path) as server:
        r = redis.Redis.from_url(server.url)
        try:
            gate = tmp_path / "gate"
            async with http_controller(
                sockdir,
                workers=1,
                handler="tests.worker_handlers:wait_for_file",
                redis=RedisSettings(url=server.url),
            ) as ctl:
                r.xadd("jobs", {"id": "first", "payload": str(gate)})
                await wait_until(lambda: ctl.desk.book.get("first") is not None, 20)
                r.xadd(
                    "jobs",
                    {"id": "then", "payload": str(gate), "after": "first", "after_any": "true"},
                )
                await wait_until(lambda: ctl.desk.book.get("then") is not None, 20)
                then = ctl.desk.book.get("then")
                assert then is not None and then.state is JobState.WAITING
                assert then.options.after == ("first",) and then.options.after_any
                r.xadd("jobs", {"id": "bad", "payload": "x", "after": "nobody"})
                await wait_until(lambda: r.hget("job:bad", "state") == b"failed", 20)
                assert b"does not hold" in (r.hget("job:bad", "error") or b"")
                assert ctl.desk.book.get("bad") is None
                gate.write_text("go")
                await wait_until(lambda: r.hget("job:then", "state") == b"finished", 20)
        finally:
            r.close()

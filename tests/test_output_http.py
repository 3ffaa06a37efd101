"""GET /job/{id}/output: text, follow, the end of a follow, and followers that leave
(an in-process controller; tests/test_output.py runs real processes)."""

from __future__ import annotations

from pathlib import Path

import httpx
import trio

from controller import wire
from controller.doors.http import shell as http_module
from controller.journal import Journal
from gen import worker_protocol_pb2 as pb
from tests.helpers import exchange, send_raw, wait_until
from tests.test_http import Running, client, http_controller


def _waiting(ctl: Running, job_id: str) -> int:
    event = ctl.web._grew.get(job_id)
    return event.statistics().tasks_waiting if event is not None else 0


async def _follow(http: httpx.AsyncClient, job_id: str, into: list[str]) -> None:
    async with http.stream("GET", f"/job/{job_id}/output", params={"follow": 1}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"] == "text/plain; charset=utf-8"
        async for text in resp.aiter_text():
            into.append(text)
    into.append("<end>")


async def test_unknown_jobs_and_bad_flags_are_refused(sockdir: Path) -> None:
    async with http_controller(sockdir, workers=0) as ctl, client(ctl.url) as http:
        resp = await http.get("/job/nobody/output/")
        assert resp.status_code == 404 and resp.json()["code"] == 404
        await http.post("/job/", json={"id": "j"})
        resp = await http.get("/job/j/output", params={"follow": "maybe"})
        assert resp.status_code == 400
        resp = await http.get("/job/j/output")
        assert (resp.status_code, resp.text) == (200, "")
        assert resp.headers["content-type"] == "text/plain; charset=utf-8"


async def test_followers_share_one_event_see_each_piece_and_end_with_the_job(
    sockdir: Path,
) -> None:
    async with http_controller(sockdir, workers=0) as ctl, client(ctl.url) as http:
        await http.post("/job/", json={"id": "j"})  # no worker: it waits
        job = ctl.desk.book.get("j")
        assert job is not None
        ctl.desk.output(job, b"before\n")
        seen: list[list[str]] = [[], [], []]
        async with trio.open_nursery() as nursery:
            for into in seen:
                nursery.start_soon(_follow, http, "j", into)
            await wait_until(lambda: _waiting(ctl, "j") == 3)
            assert all("".join(into) == "before\n" for into in seen)
            ctl.desk.output(job, b"caf\xc3")  # half a character, then its end and a bad byte
            ctl.desk.output(job, b"\xa9 \xff\n")
            await wait_until(lambda: _waiting(ctl, "j") == 3 and "\n" in "".join(seen[0])[7:])
            resp = await http.delete("/job/j/")
            assert resp.status_code == 200
        for into in seen:
            assert "".join(into) == "before\ncafé \ufffd\n<end>"
        assert ctl.web._grew == {}
        # A deleted job's output is dropped with its payload.
        assert (await http.get("/job/j/output")).text == ""


async def test_a_follower_that_leaves_costs_nothing_afterwards(sockdir: Path) -> None:
    async with http_controller(sockdir, workers=0) as ctl, client(ctl.url) as http:
        await http.post("/job/", json={"id": "j"})
        seen: list[str] = []
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_follow, http, "j", seen)
                await wait_until(lambda: _waiting(ctl, "j") == 1)
                scope.cancel()  # the client goes away
        await wait_until(lambda: _waiting(ctl, "j") == 0)
        assert seen == []


async def test_output_is_journaled_and_read_back_after_a_restart(
    sockdir: Path, tmp_path: Path
) -> None:
    journal = tmp_path / "journal.sqlite3"
    settings = {"workers": 0, "journal": journal, "output_retention": 8}
    async with http_controller(sockdir, **settings) as ctl, client(ctl.url) as http:
        await http.post("/job/", json={"id": "j"})
        job = ctl.desk.book.get("j")
        assert job is not None
        ctl.desk.output(job, b"0123456789")
        ctl.desk.output(job, b"ab")
        assert (await http.get("/job/j/output")).text == "456789ab"
        await ctl.desk.write_ahead.committed()
    store = Journal.open(journal)
    [row] = store.load().jobs
    store.close()
    assert row.output == b"456789ab"
    async with http_controller(sockdir, **settings) as ctl, client(ctl.url) as http:
        assert (await http.get("/job/j/output")).text == "456789ab"


async def test_a_local_workers_output_is_kept_with_its_job(sockdir: Path) -> None:
    async with (
        http_controller(sockdir, workers=1, handler="tests.worker_handlers:says_hello") as ctl,
        client(ctl.url) as http,
    ):
        await http.post("/job/", json={"id": "j", "payload": "j"})
        assert (await http.get("/job/j/", params={"wait": 10})).json()["state"] == "finished"
        assert (await http.get("/job/j/output")).text == "hello from j\n"


async def test_hostile_output_pulses_change_nothing(sockdir: Path) -> None:
    async with http_controller(sockdir, workers=0) as ctl, client(ctl.url) as http:
        main = ctl.shell.config.main_socket
        resp, _ = await exchange(main, pb.WorkerPulse(type=pb.PULSE_REGISTER), pb.PulseResponse)
        assert resp.takes_output and resp.worker_id
        wid = resp.worker_id
        # More bytes announced than any pulse may carry: refused before any is read.
        header = pb.WorkerPulse(
            type=pb.PULSE_OUTPUT, worker_id=wid, task_id=1, extra_size=wire.MAX_PULSE_EXTRA + 1
        ).SerializeToString()
        answer = await send_raw(main, wire.encode_varint(len(header)) + header)
        frame = wire.whole_frame(pb.PulseResponse, answer, 0)
        assert frame is not None and frame[0].error == pb.CTRL_ERR_FAILED
        # Output for a job the worker does not hold is answered and dropped.
        await http.post("/job/", json={"id": "j"})
        task_id = (await http.get("/job/j/")).json()["task_id"]
        pulse = pb.WorkerPulse(type=pb.PULSE_OUTPUT, worker_id=wid, task_id=task_id)
        resp, _ = await exchange(main, pulse, pb.PulseResponse, b"forged\n")
        assert resp.error == pb.CTRL_ERR_OK
        unknown = pb.WorkerPulse(type=pb.PULSE_OUTPUT, worker_id=wid + 100, task_id=task_id)
        resp, _ = await exchange(main, unknown, pb.PulseResponse, b"forged\n")
        assert resp.error == pb.CTRL_ERR_UNKNOWN_ID
        assert (await http.get("/job/j/output")).text == ""
        assert (await http.get("/health/")).status_code == 200


async def test_a_follow_outlasts_the_idle_timeout(sockdir: Path, monkeypatch) -> None:
    """A follower's connection is busy answering, not idle: it stays open past the keep-alive
    and mid-request silences."""
    monkeypatch.setattr(http_module, "IDLE_TIMEOUT", 0.5)
    async with http_controller(sockdir, workers=0) as ctl, client(ctl.url) as http:
        await http.post("/job/", json={"id": "j"})
        job = ctl.desk.book.get("j")
        assert job is not None
        seen: list[str] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_follow, http, "j", seen)
            await wait_until(lambda: _waiting(ctl, "j") == 1)
            await trio.sleep(2)  # the time under test: past every idle timeout (0.5 s + 1 s)
            ctl.desk.output(job, b"late\n")
            await wait_until(lambda: "".join(seen) == "late\n")
            await http.delete("/job/j/")
        assert seen == ["late\n", "<end>"]


async def test_head_of_a_follow_answers_at_once(sockdir: Path) -> None:
    async with http_controller(sockdir, workers=0) as ctl, client(ctl.url) as http:
        await http.post("/job/", json={"id": "j"})
        job = ctl.desk.book.get("j")
        assert job is not None
        ctl.desk.output(job, b"abc")
        with trio.fail_after(5):
            resp = await http.head("/job/j/output", params={"follow": 1})
        assert resp.status_code == 200 and resp.headers["content-length"] == "3"

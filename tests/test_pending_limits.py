"""The bound on queued work (`max_pending`, `max_pending_bytes`) at the HTTP and UDP doors of an
in-process controller with no worker (so that every job stays pending), real sockets and a
real journal: a new job past either limit is refused (HTTP 503 with Retry-After, UDP `busy`),
a submission that makes no new job is answered as usual, the room comes back as jobs end, and
the count is rebuilt from the journal after a restart. (The Redis door's side is in
tests/test_redis_hostile.py.)"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import httpx
import trio

from controller.datagram import request
from controller.shell.desk import JobDesk
from tests.test_http import client, http_controller

LIMITS = {"max_pending": 3, "max_pending_bytes": 1000}


def counted(desk: JobDesk) -> tuple[int, int]:
    """What the desk's running count should say: its jobs not yet ended, and their bytes."""
    live = [job for job in desk.book if job.final is None]
    return len(live), sum(len(job.payload) for job in live)


def assert_refused(resp: httpx.Response, limit: str) -> None:
    assert resp.status_code == 503, resp.text
    body = resp.json()
    assert body["code"] == 503 and limit in body["message"]
    assert int(resp.headers["retry-after"]) >= 1


async def test_http_refuses_a_new_job_past_either_limit_and_takes_it_once_there_is_room(sockdir):
    async with http_controller(sockdir, workers=0, **LIMITS) as ctl, client(ctl.url) as http:
        for n in (1, 2, 3):
            resp = await http.post("/job/", json={"id": f"p-{n}", "payload": "x"})
            assert resp.status_code == 201, resp.text
        assert_refused(await http.post("/job/", json={"id": "p-4", "payload": "x"}), "max_pending")
        assert ctl.desk.book.get("p-4") is None
        # A submission that makes no new job is answered as usual.
        again = await http.post("/job/", json={"id": "p-1", "payload": "x"})
        assert again.status_code == 200 and again.json()["state"] == "pending"
        # An ended job frees its place: deleted, canceled, or (below) finished.
        assert (await http.delete("/job/p-1/")).status_code == 200
        assert (await http.post("/job/", json={"id": "p-4", "payload": "x"})).status_code == 201
        assert (await http.put("/job/p-2/", json={"state": "canceled"})).status_code == 200
        assert (await http.delete("/job/p-3/")).status_code == 200
        assert counted(ctl.desk) == (ctl.desk.live_jobs, ctl.desk.live_bytes) == (1, 1)
        # The bytes: 1 + 1000 would be over 1000; 1 + 999 is not.
        resp = await http.post("/job/", json={"id": "big", "payload": "y" * 1000})
        assert_refused(resp, "max_pending_bytes")
        resp = await http.post("/job/", json={"id": "big", "payload": "y" * 999})
        assert resp.status_code == 201, resp.text
        assert (await http.post("/job/", json={"id": "empty"})).status_code == 201
        assert_refused(await http.post("/job/", json={"id": "one-more"}), "max_pending")
        # A retried job is live again, and counted again.
        assert (await http.put("/job/big/", json={"state": "canceled"})).status_code == 200
        assert (await http.post("/job/p-2/retry/")).status_code == 200
        assert counted(ctl.desk) == (ctl.desk.live_jobs, ctl.desk.live_bytes) == (3, 2)


async def test_jobs_that_finish_free_their_place(sockdir):
    async with http_controller(sockdir, workers=1, **LIMITS) as ctl, client(ctl.url) as http:
        for n in range(10):  # one at a time: never more than one pending
            resp = await http.post("/job/", json={"payload": f"run {n}"})
            assert resp.status_code == 201, resp.text
            done = await http.get(f"/job/{resp.json()['id']}/", params={"wait": 10})
            assert done.json()["state"] == "finished"
        assert (ctl.desk.live_jobs, ctl.desk.live_bytes) == (0, 0)


class UdpClient:
    def __init__(self, port: int) -> None:
        self.sock = trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.port = port
        self.txid = 0

    async def add(self, task_id: int, payload: str = "x", txid: int | None = None) -> Any:
        """add_task and its acknowledgement (a fresh transmission id unless given)."""
        if txid is None:
            self.txid += 1
            txid = self.txid
        params = {"task_id": task_id, "payload": payload}
        await self.sock.sendto(request("add_task", params, txid), ("127.0.0.1", self.port))
        with trio.fail_after(5):
            while True:
                data = await self.sock.recv(65536)
                answer = json.loads(data)
                if answer.get("transmission_id") == txid:
                    return answer


async def test_udp_answers_busy_past_the_limit_and_repeats_as_usual(sockdir):
    async with http_controller(sockdir, workers=0, **LIMITS) as ctl:
        udp = UdpClient(ctl.udp_port)
        with udp.sock:
            for task_id in (1, 2, 3):
                answer = await udp.add(task_id)
                assert "error" not in answer, answer
            # (A datagram large enough for the whole message in its error acknowledgement.)
            refused = await udp.add(4, "w" * 200)
            assert refused["error"]["code"] == "busy"
            assert "max_pending is 3" in refused["error"]["message"]
            # The same task again (a fresh transmission) makes no new job: acknowledged.
            assert "error" not in await udp.add(1)
            # Past the bytes limit too.
            third = next(job for job in ctl.desk.book if job.task_id == 3)
            ctl.desk.cancel(third, trio.current_time())
            refused = await udp.add(5, "z" * 1000)
            assert refused["error"]["code"] == "busy"
            assert "max_pending_bytes" in refused["error"]["message"]
            assert "error" not in await udp.add(5, "z" * 998)
            assert counted(ctl.desk) == (ctl.desk.live_jobs, ctl.desk.live_bytes) == (3, 1000)


async def test_the_count_is_rebuilt_from_the_journal(sockdir, tmp_path: Path):
    journal = tmp_path / "journal.sqlite3"
    first = http_controller(sockdir, workers=0, journal=journal, **LIMITS)
    async with first as ctl, client(ctl.url) as http:
        for n in (1, 2):
            resp = await http.post("/job/", json={"id": f"j-{n}", "payload": "a" * 400})
            assert resp.status_code == 201
        assert (await http.post("/job/", json={"id": "gone", "payload": "b"})).status_code == 201
        assert (await http.delete("/job/gone/")).status_code == 200
    async with http_controller(sockdir, workers=0, journal=journal, **LIMITS) as ctl:
        assert (ctl.desk.live_jobs, ctl.desk.live_bytes) == (2, 800)
        async with client(ctl.url) as http:
            assert_refused(await http.post("/job/", json={"payload": "c" * 201}), "bytes")
            assert (await http.post("/job/", json={"payload": "c" * 200})).status_code == 201
            assert_refused(await http.post("/job/", json={}), "max_pending")

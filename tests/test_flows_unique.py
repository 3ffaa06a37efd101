"""Unique jobs (DESIGN.md section 17): the option `unique_key`, one key space for every queue
and door. While a job with a key has not ended, a submission with it makes nothing and answers
that job (HTTP 200, a UDP ack naming it, a Redis `state duplicate`); once it ended, was
canceled or deleted the key is free again; the rule holds across a restart on the journal."""

from __future__ import annotations

import json
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.app import assemble
from controller.client import AsyncClient, Client
from controller.config import Config, RedisSettings
from controller.job_ids import DoorName
from controller.job_states import JobState
from controller.options import DEFAULT, MAX_UNIQUE_KEY, parse
from controller.shell.desk import JobDesk
from tests.helpers import REDIS_SERVER, RedisServer, redis_server, wait_until
from tests.test_http import client, http_controller

BAD_KEYS = [
    "",
    "a b",
    "k" * (MAX_UNIQUE_KEY + 1),
    "caf\u00e9",
    "nul\x00",
    "line\nbreak",
    5,
    True,
    None,
    ["k"],
    {"k": 1},
]


def _udp(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.settimeout(10)
    sock.connect(("127.0.0.1", port))
    return sock


async def _ask(sock: socket.socket, txid: int, **params: Any) -> dict[str, Any]:
    """An add_task with `params`, and its acknowledgement."""
    packet = {"method": "add_task", "packet_type": 1, "transmission_id": txid, "params": params}
    sock.send(json.dumps(packet).encode())
    while True:  # a notify_task of an ended job may come first
        answer: dict[str, Any] = json.loads(await trio.to_thread.run_sync(sock.recv, 65536))
        if answer.get("method") == "ack":
            assert answer["transmission_id"] == txid
            return answer


# ---------------------------------------------------------------- HTTP


async def test_http_a_held_key_answers_200_and_the_live_job(sockdir):
    async with http_controller(sockdir, workers=0) as ctl, client(ctl.url) as http:
        first = await http.post("/job/", json={"payload": "one", "unique_key": "nightly:42"})
        assert first.status_code == 201, first.text
        assert first.json()["unique_key"] == "nightly:42"
        again = await http.post(
            "/job/", json={"payload": "two", "unique_key": "nightly:42", "queue": "other"}
        )
        assert again.status_code == 200
        assert again.json()["id"] == first.json()["id"] and again.json()["payload"] == "one"
        assert len((await http.get("/job/")).json()) == 1
        plain = (await http.post("/job/", json={"payload": "x"})).json()
        assert plain["unique_key"] is None
        other = await http.post("/job/", json={"payload": "y", "unique_key": "nightly:43"})
        assert other.status_code == 201


async def test_http_the_key_is_free_once_its_job_is_canceled_or_deleted(sockdir):
    async with http_controller(sockdir, workers=0) as ctl, client(ctl.url) as http:
        body = {"payload": "p", "unique_key": "k"}
        first = (await http.post("/job/", json=body)).json()
        await http.put(f"/job/{first['id']}/", json={"state": "canceled"})
        second = await http.post("/job/", json=body)
        assert second.status_code == 201 and second.json()["id"] != first["id"]
        # The canceled job is not retried while another live job holds its key.
        refused = await http.post(f"/job/{first['id']}/retry/")
        assert refused.status_code == 409
        assert "held by the live job" in refused.json()["message"]
        await http.delete(f"/job/{second.json()['id']}/")
        retried = await http.post(f"/job/{first['id']}/retry/")
        assert retried.status_code == 200 and retried.json()["state"] == "pending"
        # Retried, it holds its key again.
        held = await http.post("/job/", json=body)
        assert held.status_code == 200 and held.json()["id"] == first["id"]
        assert ctl.desk.holder("k") is ctl.desk.book.get(first["id"])


async def test_http_the_key_is_free_once_its_job_finished(sockdir):
    async with http_controller(sockdir, workers=1) as ctl, client(ctl.url) as http:
        body = {"payload": "p", "unique_key": "report"}
        first = (await http.post("/job/", json=body)).json()
        done = (await http.get(f"/job/{first['id']}/", params={"wait": 10})).json()
        assert done["state"] == "finished"
        second = await http.post("/job/", json=body)
        assert second.status_code == 201 and second.json()["id"] != first["id"]


@pytest.mark.parametrize("key", BAD_KEYS)
async def test_http_a_hostile_key_is_a_400(sockdir, key):
    async with http_controller(sockdir, workers=0) as ctl, client(ctl.url) as http:
        resp = await http.post("/job/", json={"payload": "x", "unique_key": key})
        assert resp.status_code == 400, resp.text
        assert resp.json()["message"].startswith(("unique_key must be", "unique_key must not"))
        assert (await http.get("/job/")).json() == {}


async def test_the_key_is_held_across_a_restart_on_the_journal(sockdir, tmp_path):
    journal = tmp_path / "journal.sqlite3"
    async with http_controller(sockdir, workers=0, journal=journal) as ctl, client(ctl.url) as h:
        first = (await h.post("/job/", json={"payload": "p", "unique_key": "kept"})).json()
        gone = (await h.post("/job/", json={"payload": "q", "unique_key": "freed"})).json()
        await h.put(f"/job/{gone['id']}/", json={"state": "canceled"})
    async with http_controller(sockdir, workers=0, journal=journal) as ctl, client(ctl.url) as h:
        again = await h.post("/job/", json={"payload": "other", "unique_key": "kept"})
        assert again.status_code == 200 and again.json()["id"] == first["id"]
        assert again.json()["unique_key"] == "kept"
        free = await h.post("/job/", json={"payload": "q", "unique_key": "freed"})
        assert free.status_code == 201


# ---------------------------------------------------------------- UDP


async def test_udp_a_held_key_is_acknowledged_with_the_live_jobs_id(sockdir):
    async with http_controller(sockdir, workers=0) as ctl, client(ctl.url) as http:
        with _udp(ctl.udp_port) as sock:
            port = sock.getsockname()[1]
            made = await _ask(sock, 1, task_id=1, payload="a", unique_key="sync/7")
            assert "error" not in made and "params" not in made
            dup = await _ask(sock, 2, task_id=2, payload="b", unique_key="sync/7")
            assert "error" not in dup
            assert dup["params"]["id"] == f"udp-127.0.0.1-{port}-1"
            assert ctl.desk.book.get(f"udp-127.0.0.1-{port}-2") is None
            # The same transmission again gets the same answer.
            assert await _ask(sock, 2, task_id=2, payload="b", unique_key="sync/7") == dup
            # One key space for every door: an HTTP job's key answers a UDP submission.
            held = (await http.post("/job/", json={"unique_key": "from-http"})).json()
            cross = await _ask(sock, 3, task_id=3, unique_key="from-http")
            assert cross["params"]["id"] == held["id"]
            back = await http.post("/job/", json={"unique_key": "sync/7"})
            assert back.status_code == 200 and back.json()["id"] == dup["params"]["id"]
            # Freed once canceled.
            await http.put(f"/job/{dup['params']['id']}/", json={"state": "canceled"})
            fresh = await _ask(sock, 4, task_id=4, unique_key="sync/7")
            assert "params" not in fresh and "error" not in fresh
            assert ctl.desk.holder("sync/7") is ctl.desk.book.get(f"udp-127.0.0.1-{port}-4")


@pytest.mark.parametrize("key", BAD_KEYS)
async def test_udp_a_hostile_key_is_an_error_ack(sockdir, key):
    async with http_controller(sockdir, workers=0) as ctl:
        with _udp(ctl.udp_port) as sock:
            answer = await _ask(sock, 1, task_id=1, unique_key=key)
            assert answer["error"]["code"] == "bad_option"
            assert answer["error"]["message"].startswith("unique_key")  # cut to the request
            assert len(ctl.desk.book) == 0


# ---------------------------------------------------------------- Redis

needs_redis = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path) as started:
        yield started


@needs_redis
async def test_redis_a_held_key_marks_the_entry_duplicate(sockdir, server, tmp_path):
    gate = tmp_path / "gate"
    r = redis.Redis.from_url(server.url)
    try:
        async with (
            http_controller(
                sockdir,
                workers=1,
                handler="tests.worker_handlers:wait_for_file",
                redis=RedisSettings(url=server.url),
            ) as ctl,
            client(ctl.url) as http,
        ):
            r.xadd("jobs", {"id": "first", "payload": str(gate), "unique_key": "rk"})
            await wait_until(lambda: ctl.desk.holder("rk") is not None, 20)
            r.xadd("jobs", {"id": "second", "payload": str(gate), "unique_key": "rk"})
            await wait_until(lambda: r.hget("job:second", "state") == b"duplicate", 20)
            assert r.hget("job:second", "duplicate_of") == b"first"
            results: Any = r.xrange("jobs:results")
            assert [(f[b"id"], f[b"state"]) for _, f in results] == [(b"second", b"duplicate")]
            assert ctl.desk.book.get("second") is None
            # An HTTP submission with the key gets the Redis job.
            via_http = await http.post("/job/", json={"unique_key": "rk"})
            assert via_http.status_code == 200 and via_http.json()["id"] == "first"
            gate.write_text("go")
            await wait_until(lambda: r.hget("job:first", "state") == b"finished", 20)
            # Ended: the key is free again.
            r.xadd("jobs", {"id": "third", "payload": str(gate), "unique_key": "rk"})
            await wait_until(lambda: r.hget("job:third", "state") == b"finished", 20)
            # A hostile key fails the entry alone.
            r.xadd("jobs", {"id": "bad", "payload": "x", "unique_key": "a b"})
            await wait_until(lambda: r.hget("job:bad", "state") == b"failed", 20)
            assert b"unique_key must be" in (r.hget("job:bad", "error") or b"")
    finally:
        r.close()


@needs_redis
async def test_redis_client_gets_the_live_job_for_a_duplicate(sockdir, server, tmp_path):
    gate = tmp_path / "gate"
    async with http_controller(
        sockdir,
        workers=1,
        handler="tests.worker_handlers:wait_for_file",
        redis=RedisSettings(url=server.url),
    ) as ctl:
        with Client(server.url) as redis_client, Client(ctl.url) as http_client:
            first = redis_client.submit(str(gate).encode(), id="r1", unique_key="one")
            await wait_until(lambda: ctl.desk.holder("one") is not None, 20)
            second = redis_client.submit(b"other", id="r2", unique_key="one")
            await wait_until(lambda: second.refresh() != "pending" or second.id == "r1", 20)
            assert second.id == "r1"
            dup = await trio.to_thread.run_sync(lambda: http_client.submit(b"x", unique_key="one"))
            assert dup.id == "r1"
            gate.write_text("go")
            result = await trio.to_thread.run_sync(lambda: second.result(timeout=20))
            assert result == b"plain:go"
            assert first.result(timeout=5) == b"plain:go"


# ---------------------------------------------------------------- the client


async def test_client_submit_takes_unique_key_and_checks_it(sockdir):
    async with http_controller(sockdir, workers=0) as ctl:

        def run() -> tuple[str, str, str]:
            with Client(ctl.url) as http_client, Client(f"udp://127.0.0.1:{ctl.udp_port}") as u:
                with pytest.raises(ValueError, match="unique_key must be"):
                    http_client.submit(b"x", unique_key="no spaces")
                first = http_client.submit(b"x", unique_key="c")
                second = http_client.submit(b"y", unique_key="c")
                over_udp = u.submit(b"z", unique_key="c")
                return first.id, second.id, over_udp.id

        first, second, over_udp = await trio.to_thread.run_sync(run)
        assert first == second == over_udp


# ---------------------------------------------------------------- the desk's rule


@st.composite
def _steps(draw: st.DrawFn) -> list[tuple[str, int]]:
    kinds = st.sampled_from(["submit", "cancel", "delete", "retry"])
    return draw(st.lists(st.tuples(kinds, st.integers(0, 7)), max_size=40))


def _check(desk: JobDesk) -> None:
    live: dict[str, list[str]] = {}
    for job in desk.book:
        if not job.state.final and job.options.unique_key:
            live.setdefault(job.options.unique_key, []).append(job.id)
    assert all(len(ids) == 1 for ids in live.values()), live
    assert {key: job.id for key, job in desk.unique.items()} == {
        key: ids[0] for key, ids in live.items()
    }


async def _play(steps: list[tuple[str, int]]) -> None:
    sockdir = Path(tempfile.mkdtemp(prefix="jc-"))
    ctl = assemble(Config(socket_dir=sockdir, journal=None))
    desk = ctl.desk
    async with trio.open_nursery() as nursery:
        await nursery.start(ctl.shell.serve)
        made: list[str] = []
        for kind, n in steps:
            now = trio.current_time()
            key = f"k{n % 3}"
            if kind == "submit":
                if desk.holder(key) is None:  # what every door asks first
                    options = parse({"unique_key": key}, DEFAULT, 0.0)
                    job_id = f"j{len(made)}"
                    task_id = desk.book.pick_task_id()
                    desk.submit(job_id, DoorName.HTTP, None, task_id, b"", now, options=options)
                    made.append(job_id)
                continue
            if not made:
                continue
            job = desk.book.get(made[n % len(made)])
            assert job is not None
            if kind == "cancel":
                desk.cancel(job, now)
            elif kind == "delete":
                desk.delete(job, now)
            else:
                desk.retry(job, now)
            _check(desk)
        _check(desk)
        assert all(job.state is not JobState.DELETED for job in desk.unique.values())
        nursery.cancel_scope.cancel()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_steps())
def test_at_most_one_live_job_per_key_whatever_the_sequence(steps):
    trio.run(_play, steps)


async def test_async_client_submit_takes_unique_key(sockdir):
    async with http_controller(sockdir, workers=0) as ctl, AsyncClient(ctl.url) as http_client:
        first = await http_client.submit(b"x", unique_key="async")
        again = await http_client.submit(b"y", unique_key="async")
        assert again.id == first.id and again.state == "pending"
        with pytest.raises(ValueError, match="unique_key must be"):
            await http_client.submit(b"x", unique_key="k" * 201)

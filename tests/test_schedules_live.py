"""Periodic jobs in real controller processes: an `every: 1` schedule makes its jobs, which run
on a worker; a due time missed while the controller was killed is made once at the next start
(the latest one only) and not again at the start after; and two controllers on one Redis make
each due time's job once in all."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import sqlite3
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import redis
import trio

from controller.doors.redis.periodic_claims import RedisClaims
from controller.schedules import Schedule
from tests.helpers import (
    REDIS_SERVER,
    RedisServer,
    free_tcp_port,
    live_controller,
    recording_exec,
    redis_server,
    wait_for_condition,
)

pytestmark = pytest.mark.slow


def listing(url: str) -> dict[str, dict[str, Any]]:
    with urllib.request.urlopen(f"{url}/job/?limit=1000", timeout=5) as resp:
        jobs: dict[str, dict[str, Any]] = json.load(resp)
    return {job_id: job for job_id, job in jobs.items() if job_id.startswith("cron-")}


def due_of(job_id: str) -> float:
    stamp = job_id.rsplit("-", 1)[1]
    return datetime.strptime(stamp, "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC).timestamp()


def finished(url: str) -> dict[str, dict[str, Any]]:
    return {k: v for k, v in listing(url).items() if v["state"] == "finished"}


def journaled(path: Path) -> list[str]:
    """The ids of the finished periodic jobs on disk in the journal at `path`."""
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        rows = db.execute("SELECT id FROM jobs WHERE id LIKE 'cron-%' AND state = 'finished'")
        return [row[0] for row in rows]


def test_an_every_second_schedule_makes_jobs_that_run_on_a_worker(tmp_path: Path) -> None:
    tick = {"name": "tick", "every": 1, "payload": "tock"}
    with live_controller(tmp_path, "--workers", "1", schedules=[tick]) as ctl:
        wait_for_condition(lambda: len(finished(ctl.url)) >= 3, timeout=20)
        jobs = finished(ctl.url)
    dues = sorted(due_of(job_id) for job_id in jobs)
    assert all(job_id.startswith("cron-tick-") for job_id in jobs)
    assert dues == [dues[0] + n for n in range(len(dues))], "one job a second, none left out"
    for job in jobs.values():
        assert (job["door"], job["result"], job["attempts"]) == ("http", "tock", 1)


def test_a_due_time_missed_while_killed_is_made_once_at_the_next_start(tmp_path: Path) -> None:
    every = 3
    schedule = Schedule("tick", every=every)
    settings: dict[str, Any] = {"schedules": [{"name": "tick", "every": every}]}
    execlog = tmp_path / "exec.log"
    worker_args = ("--workers", "1", "--", *recording_exec(execlog))

    with live_controller(tmp_path, *worker_args, **settings) as first:
        wait_for_condition(lambda: len(journaled(tmp_path / "journal.sqlite3")) >= 1, timeout=20)
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait()
        killed = time.time()

    def just_after_a_due_time() -> bool:
        now = time.time()
        return now >= killed + 2 * every and now - schedule.latest_due(now) < 0.3

    # Two due times or more pass while no controller runs; the next start comes just after
    # one, so that it is made at start, not at its time.
    wait_for_condition(just_after_a_due_time, timeout=3 * every + 5)
    restarted = time.time()
    caught_up = schedule.latest_due(restarted)
    with live_controller(tmp_path, *worker_args, **settings) as second:
        wait_for_condition(
            lambda: schedule.job_id(caught_up) in journaled(tmp_path / "journal.sqlite3"),
            timeout=20,
        )
        jobs = listing(second.url)
        second.proc.send_signal(signal.SIGKILL)  # and at once again: nothing is made twice
        second.proc.wait()
    with live_controller(tmp_path, *worker_args, **settings) as third:
        wait_for_condition(
            lambda: all(job in finished(third.url) for job in jobs if due_of(job) <= caught_up),
            timeout=20,
        )
        final = finished(third.url)

    made = sorted(due_of(job) for job in jobs)
    before = [due for due in made if due <= killed]
    assert before, "the first controller made a job"
    missed = [before[-1] + every * n for n in range(1, 100) if before[-1] + every * n < caught_up]
    assert len(missed) >= 1
    assert set(missed).isdisjoint(made), "a missed due time before the latest was made"
    assert caught_up in made
    # The third start found it made: the same job (a job made again has a new task_id).
    made_at_start = schedule.job_id(caught_up)
    assert final[made_at_start]["task_id"] == jobs[made_at_start]["task_id"]
    assert str(final[made_at_start]["task_id"]) in execlog.read_text().split()


@pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed")
def test_two_controllers_on_one_redis_make_each_due_time_once(tmp_path: Path) -> None:
    tick = {"name": "tick", "every": 1}
    with redis_server(tmp_path) as server:
        settings: dict[str, Any] = {"schedules": [tick], "redis": {"url": server.url}}
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        with (
            live_controller(tmp_path / "a", "--workers", "1", **settings) as one,
            live_controller(tmp_path / "b", "--workers", "1", **settings) as two,
        ):
            both_up = time.time()
            wait_for_condition(lambda: time.time() >= both_up + 6, timeout=10)
            window = range(int(both_up) + 2, int(time.time()) - 1)  # both long running
            wait_for_condition(
                lambda: all(
                    Schedule("tick", every=1).job_id(t) in {**listing(one.url), **listing(two.url)}
                    for t in window
                ),
                timeout=10,
            )
            first, second = listing(one.url), listing(two.url)
        r = redis.Redis.from_url(server.url)
        holders = {key.decode().removeprefix("cron:"): r.get(key) for key in r.keys("cron:*")}
    assert len(window) >= 3
    assert set(first).isdisjoint(second), "a due time made by both controllers"
    assert set(window) <= {due_of(job_id) for job_id in {**first, **second}}
    # Each job was claimed in Redis, by the controller that made it.
    for jobs, directory in ((first, tmp_path / "a"), (second, tmp_path / "b")):
        consumer = f"{socket.gethostname()}:{directory / 's'}".encode()
        assert {holders[job_id] for job_id in jobs} <= {consumer}


@pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed")
async def test_a_claim_waits_for_an_unreachable_redis_and_never_goes_without(
    tmp_path: Path,
) -> None:
    server = RedisServer(tmp_path / "redis", port=free_tcp_port())  # not started yet
    client = redis.Redis.from_url(server.url, socket_connect_timeout=1)
    claims = RedisClaims(client, "here", 60)
    try:
        # Down until the next due time: given up, not made without a claim.
        with trio.fail_after(10):
            assert await claims.claim("cron-x-1", time.time() + 1) is None
        # Down at the due time, back before the next: claimed then.
        async with trio.open_nursery() as nursery:

            async def start_soon() -> None:
                await trio.sleep(0.5)
                await trio.to_thread.run_sync(server.start)

            nursery.start_soon(start_soon)
            with trio.fail_after(20):
                assert await claims.claim("cron-x-2", time.time() + 15) is True
        assert client.get("cron:cron-x-2") == b"here"
        assert client.ttl("cron:cron-x-2") > 86400
        assert await claims.claim("cron-x-2", time.time() + 15) is True  # ours already
        assert await RedisClaims(client, "there", 60).claim("cron-x-2", time.time()) is False
    finally:
        client.close()
        server.stop()

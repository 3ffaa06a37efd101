"""The Redis door's queues and options against a real redis-server: an entry's fields become
the job's options, queue `q` is the stream `jobs.q` and is read only where a worker serves
it, and an entry whose `requires` no worker here has is left for a controller with one.

Workers say which queues they serve and which labels they have in their REGISTER; here the
controller is in-process and the test sets them on its `Worker` records, so that the
door's side is tested alone. Workers are real processes (the real clock, no autojump)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
import trio

from controller.app import assemble
from controller.config import Config, RedisSettings
from controller.core.model import Worker
from controller.doors.redis.door import RedisDoor
from controller.doors.redis.stream_calls import StreamCalls
from controller.job_states import JobState
from controller.jobs import Job
from controller.options import JobOptions
from controller.shell.core_shell import CoreShell
from controller.shell.desk import JobDesk
from tests.helpers import (
    REDIS_SERVER,
    LiveController,
    RedisServer,
    live_controller,
    recording_exec,
    redis_server,
    run_udp_client,
    wait_for_condition,
    wait_until,
    worker_argv,
)

pytestmark = pytest.mark.skipif(
    REDIS_SERVER is None, reason="redis-server is not installed (apt-get install redis-server)"
)

CLAIM_AFTER = 1.0


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path) as started:
        yield started


@pytest.fixture
def r(server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(server.url)
    yield client
    client.close()


class Here:
    """An in-process controller with the Redis door, and its real workers."""

    def __init__(self, shell: CoreShell, desk: JobDesk, door: RedisDoor, sockdir: Path) -> None:
        self.shell, self.desk, self.door, self.sockdir = shell, desk, door, sockdir
        self.procs: list[trio.Process] = []

    async def worker(
        self, *args: str, queues: set[str] | None = None, labels: set[str] | None = None
    ) -> Worker:
        """Start a real worker and, once it registered, give it these queues and labels."""
        known = set(self.shell.core.workers)
        self.procs.append(await trio.lowlevel.open_process(worker_argv(self.sockdir, *args)))
        await wait_until(lambda: set(self.shell.core.workers) - known != set(), 20)
        (worker_id,) = set(self.shell.core.workers) - known
        worker = self.shell.core.workers[worker_id]
        if queues is not None:
            worker.queues = frozenset(queues)
        if labels is not None:
            worker.labels = frozenset(labels)
        return worker

    async def finished(self, job_id: str, timeout: float = 20) -> Job:
        await wait_until(lambda: self.job_state(job_id) is JobState.FINISHED, timeout)
        job = self.desk.book.get(job_id)
        assert job is not None
        return job

    def job_state(self, job_id: str) -> JobState | None:
        job = self.desk.book.get(job_id)
        return job.state if job is not None else None


@asynccontextmanager
async def controller_here(sockdir: Path, url: str, **settings: Any) -> AsyncIterator[Here]:
    redis_settings = RedisSettings(url=url, claim_after=CLAIM_AFTER)
    config = Config(socket_dir=sockdir, journal=None, redis=redis_settings).replace(**settings)
    ctl = assemble(config)
    shell, desk, _ = ctl.shell, ctl.desk, ctl.udp
    door = ctl.redis
    assert door is not None
    here = Here(shell, desk, door, sockdir)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(desk.run)
            await nursery.start(shell.serve)
            await nursery.start(door.run)
            yield here
            nursery.cancel_scope.cancel()
    finally:
        for proc in here.procs:  # stopped by the pid the test started
            proc.kill()
            with trio.CancelScope(shield=True):
                await proc.wait()


def results_for(r: redis.Redis, job_id: str) -> list[bytes]:
    entries: Any = r.xrange("jobs:results")
    return [f[b"state"] for _, f in entries if f[b"id"] == job_id.encode()]


def groups_of(r: redis.Redis, stream: str) -> list[str]:
    if not r.exists(stream):
        return []
    return [g["name"].decode() for g in r.xinfo_groups(stream)]


async def test_the_fields_of_an_entry_are_the_options_of_its_job(
    sockdir: Path, server: RedisServer, r: redis.Redis
) -> None:
    async with controller_here(sockdir, server.url, max_retries=1, task_timeout=50) as here:
        await here.worker(labels={"ssd", "gpu"})
        fields = {
            "id": "opts-1",
            "payload": "with options",
            "priority": "7",
            "requires": "gpu, ssd",
            "delay": "0",
            "max_retries": "2",
            "retry_delay": "1.5",
            "timeout": "30",
            "placement_timeout": "60",
            "owner": "alice",
        }
        r.xadd("jobs", fields)
        r.xadd("jobs", {"id": "plain-1", "payload": "no options"})
        job = await here.finished("opts-1")
        assert job.options == JobOptions(
            queue="default",
            priority=7,
            requires=frozenset({"gpu", "ssd"}),
            run_at=None,
            max_retries=2,
            retry_delay=1.5,
            timeout=30.0,
            placement_timeout=60.0,
            owner="alice",
        )
        # An entry with none has the door's defaults: owner `redis`, no placement limit,
        # the config's retries and task timeout.
        plain = await here.finished("plain-1")
        assert plain.options == JobOptions(owner="redis", max_retries=1, timeout=50.0)
        await wait_until(lambda: r.hget("job:opts-1", "result") == b"with options")


async def test_a_queue_stream_runs_where_a_worker_serves_the_queue(
    sockdir: Path, server: RedisServer, r: redis.Redis
) -> None:
    async with controller_here(sockdir, server.url) as here:
        await here.worker(queues={"q"})
        # (It registered serving `default`: the door may have read that stream until now.)
        await wait_until(lambda: here.door.status()["streams"] == ["jobs.q"])
        r.xadd("jobs", {"id": "not-q", "payload": "for default"})
        r.xadd("jobs.q", {"id": "in-q", "payload": "for q"})
        r.xadd("jobs.q", {"id": "also-q", "payload": "q again", "queue": "q"})
        job = await here.finished("in-q")
        assert job.options.queue == "q" and job.result == b"for q"
        assert (await here.finished("also-q")).options.queue == "q"
        # Results of every queue go to the one results stream; both entries acknowledged.
        await wait_until(lambda: r.xinfo_groups("jobs.q")[0]["pending"] == 0)
        assert results_for(r, "in-q") == [b"finished"]
        # The default stream is nobody's queue here now: its entry is not read (or, read by
        # a blocking read from before the change, held aside for another controller).
        assert here.desk.book.get("not-q") is None
        # (No group on it at all: the door never read it, the worker's queue came first.)
        groups = r.xinfo_groups("jobs")
        unread = not groups or groups[0]["lag"] == 1
        assert unread or "not-q" in here.door.lanes.parked


async def test_the_stream_decides_the_queue_and_an_entry_naming_another_fails(
    sockdir: Path, server: RedisServer, r: redis.Redis
) -> None:
    async with controller_here(sockdir, server.url) as here:
        await here.worker()
        r.xadd("jobs", {"id": "elsewhere", "payload": "x", "queue": "q"})
        await wait_until(lambda: r.hget("job:elsewhere", "state") == b"failed")
        error = r.hget("job:elsewhere", "error")
        assert error is not None and b"'jobs.q'" in error
        assert here.desk.book.get("elsewhere") is None  # never a job here


async def test_a_controller_serving_two_queues_reads_both_streams(
    sockdir: Path, server: RedisServer, r: redis.Redis
) -> None:
    async with controller_here(sockdir, server.url) as here:
        await here.worker(queues={"default", "q"})
        await here.worker(queues={"q"})
        ids = [f"two-{n}" for n in range(30)]
        for n, job_id in enumerate(ids):
            r.xadd("jobs.q" if n % 2 else "jobs", {"id": job_id, "payload": job_id})
        for job_id in ids:
            job = await here.finished(job_id)
            assert job.options.queue == ("q" if int(job_id[4:]) % 2 else "default")
        assert sorted(here.door.status()["streams"]) == ["jobs", "jobs.q"]


def test_a_controller_without_a_worker_for_a_queue_never_reads_its_stream(
    tmp_path: Path, server: RedisServer, r: redis.Redis
) -> None:
    settings = {"url": server.url, "claim_after": CLAIM_AFTER}
    with live_controller(tmp_path, "--workers", "1", redis=settings):
        r.xadd("jobs.q", {"id": "nobody-serves-q", "payload": "x"})
        for n in range(3):  # jobs of the default queue run meanwhile: the door reads
            r.xadd("jobs", {"id": f"served-{n}", "payload": "y"})
        wait_for_condition(lambda: all(results_for(r, f"served-{n}") for n in range(3)), 20)
        assert groups_of(r, "jobs.q") == []  # never read, never claimed
        assert r.xlen("jobs.q") == 1 and not r.exists("job:nobody-serves-q")


async def test_an_entry_needing_a_label_goes_to_the_controller_whose_worker_has_it(
    tmp_path: Path, sockdir: Path, server: RedisServer, r: redis.Redis
) -> None:
    # Controller A, a process with one plain worker, reads the entry first.
    execlog = tmp_path / "a-exec.log"
    settings = {"url": server.url, "claim_after": CLAIM_AFTER}
    a_dir = tmp_path / "a"
    a_dir.mkdir()
    a_args = ("--workers", "1", "--", *recording_exec(execlog))
    with live_controller(a_dir, *a_args, redis=settings) as ctl:
        r.xadd("jobs", {"id": "needs-gpu", "payload": "on a gpu", "requires": "gpu"})
        await wait_until(lambda: bool(r.xinfo_groups("jobs")) and _pending_on(r) == 1, 20)
        (a_consumer,) = _consumers_holding(r)
        # A holds it without running or failing it, and does not keep it fresh.
        await wait_until(lambda: _idle_ms(r) > CLAIM_AFTER * 1000 * 1.5, 20)
        assert not r.exists("job:needs-gpu") and not results_for(r, "needs-gpu")
        assert _redis_status(ctl)["parked"] == 1
        # Controller B, with a gpu worker, claims it once it went stale, and runs it.
        async with controller_here(sockdir, server.url) as b:
            await b.worker(labels={"gpu"})
            job = await b.finished("needs-gpu")
            assert job.result == b"on a gpu"
            assert job.options.requires == frozenset({"gpu"})
            await wait_until(lambda: _pending_on(r) == 0)
            assert results_for(r, "needs-gpu") == [b"finished"]
            assert _consumers_holding(r) == []
        # A dropped it without running it: nothing in its worker's log, nothing failed.
        await wait_until(lambda: _redis_status(ctl)["held"] == 0, 20)
        status = _redis_status(ctl)
        assert (status["parked"], status["claimed_away"]) == (0, 1)
        ran = execlog.read_text().split() if execlog.exists() else []
        assert ran == []
        assert a_consumer != b.door.consumer


def _redis_status(ctl: LiveController) -> dict[str, Any]:
    status = json.loads(run_udp_client(ctl.udp_port, "status", "--json").stdout)
    return dict(status["redis"])


def _pending_on(r: redis.Redis) -> int:
    return int(r.xpending("jobs", "controllers")["pending"])


def _consumers_holding(r: redis.Redis) -> list[str]:
    return [c["name"].decode() for c in r.xinfo_consumers("jobs", "controllers") if c["pending"]]


def _idle_ms(r: redis.Redis) -> int:
    (entry,) = r.xpending_range("jobs", "controllers", "-", "+", 10)
    return int(entry["time_since_delivered"])


async def test_a_parked_entry_runs_here_once_a_suitable_worker_registers(
    sockdir: Path, server: RedisServer, r: redis.Redis
) -> None:
    async with controller_here(sockdir, server.url) as here:
        await here.worker()
        r.xadd("jobs", {"id": "later-gpu", "payload": "soon", "requires": "gpu"})
        await wait_until(lambda: "later-gpu" in here.door.lanes.parked)
        assert here.desk.book.get("later-gpu") is None  # not a job here while parked
        await here.worker(labels={"gpu"})
        job = await here.finished("later-gpu")
        assert job.result == b"soon" and not here.door.lanes.parked


async def test_a_parked_entry_canceled_by_a_user_is_acknowledged(
    sockdir: Path, server: RedisServer, r: redis.Redis
) -> None:
    from controller.client import Client

    async with controller_here(sockdir, server.url) as here:
        await here.worker()
        r.xadd("jobs", {"id": "parked-cancel", "payload": "x", "requires": "gpu"})
        await wait_until(lambda: "parked-cancel" in here.door.lanes.parked)
        with Client(server.url) as client:
            client.cancel("parked-cancel")  # one script on Redis: it does not wait for us
        await wait_until(lambda: _pending_on(r) == 0)
        assert r.hget("job:parked-cancel", "state") == b"canceled"
        assert results_for(r, "parked-cancel") == [b"canceled"]
        assert not here.door.lanes.parked and "parked-cancel" not in here.door.entries


def test_claiming_pages_over_other_consumers_entries_and_passes_over_its_own(
    server: RedisServer, r: redis.Redis
) -> None:
    settings = RedisSettings(url=server.url)
    calls = StreamCalls(settings, "me", retention_ms=60_000, claim_after_ms=1)
    try:
        calls.ensure_group("jobs")
        ids = [r.xadd("jobs", {"id": f"c-{n}", "payload": "x"}).decode() for n in range(5)]
        r.xreadgroup("controllers", "me", {"jobs": ">"}, count=2)  # ours: passed over
        r.xreadgroup("controllers", "stopped", {"jobs": ">"}, count=3)
        wait_for_condition(lambda: min(p["time_since_delivered"] for p in _pending(r)) > 1)
        claimed = [entry.entry_id for entry in calls.claim("jobs", 2)]
        assert claimed == ids[2:4]
        claimed += [entry.entry_id for entry in calls.claim("jobs", 2)]
        assert claimed == ids[2:5]  # the next page starts after the last one claimed
        assert calls.claim("jobs", 2) == []  # none left of another consumer
        assert {p["consumer"] for p in _pending(r)} == {b"me"}
    finally:
        calls.close()


def _pending(r: redis.Redis) -> list[dict[str, Any]]:
    return list(r.xpending_range("jobs", "controllers", "-", "+", 100))

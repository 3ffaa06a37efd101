"""Several controllers on one Redis stream, all real processes: three
controllers with one local worker each, 2,000 jobs from one producer; every job gets exactly
one final outcome in Redis and each controller runs some. Then the same with one controller
killed by SIGKILL mid-run and redis-server restarted: nothing lost. And a controller whose
Redis is down at start keeps its other doors serving, then catches up."""

from __future__ import annotations

import contextlib
import json
import subprocess
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from controller.client import Client, JobFailed
from tests.helpers import (
    REDIS_SERVER,
    RedisServer,
    controller_argv,
    free_tcp_port,
    free_udp_port,
    reap,
    recording_exec,
    redis_server,
    wait_for_condition,
    worker_argv,
    write_config,
)

pytestmark = pytest.mark.skipif(
    REDIS_SERVER is None, reason="redis-server is not installed (apt-get install redis-server)"
)

JOBS = 2000
CLAIM_AFTER = 2.0


@dataclass
class Host:
    """One controller and its one local worker (both started and stopped by the test)."""

    directory: Path
    controller: subprocess.Popen[bytes]
    worker: subprocess.Popen[bytes] | None
    http_port: int

    def start_worker(self, job: list[str] | None = None) -> None:
        args = job or recording_exec(self.execlog)
        self.worker = subprocess.Popen(worker_argv(self.directory / "s", *args))

    def stop(self) -> None:
        self.controller.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.controller.wait(timeout=20)
        reap(self.controller)
        if self.worker is not None:
            reap(self.worker)
        text = (self.directory / "controller.log").read_text(errors="replace")
        assert "Traceback" not in text, text[-5000:]

    @property
    def execlog(self) -> Path:
        return self.directory / "exec.log"

    def ran(self) -> int:
        return len(self.execlog.read_text().split()) if self.execlog.exists() else 0


def start_host(
    directory: Path,
    redis_url: str,
    *,
    http: bool = False,
    job: list[str] | None = None,
    worker: bool = True,
    claim_after: float = CLAIM_AFTER,
) -> Host:
    """A controller (and its worker, running `job` or the recording echo) in `directory`."""
    directory.mkdir(exist_ok=True)
    sockets = directory / "s"
    http_port = free_tcp_port()
    config = write_config(
        directory,
        socket_dir=str(sockets),
        journal=str(directory / "journal.sqlite3"),
        client_address={"host": "127.0.0.1", "port": free_udp_port()},
        http_address={"host": "127.0.0.1", "port": http_port} if http else None,
        redis={"url": redis_url, "claim_after": claim_after},
    )
    with (directory / "controller.log").open("ab") as sink:
        controller = subprocess.Popen(controller_argv(config, log_level="INFO"), stderr=sink)
    wait_for_condition(lambda: (sockets / "main.sock").exists() or controller.poll() is not None)
    assert controller.poll() is None, (directory / "controller.log").read_text()
    host = Host(directory, controller, None, http_port)
    if worker:
        host.start_worker(job)
    return host


@contextlib.contextmanager
def hosts(tmp: Path, redis_url: str, count: int) -> Iterator[list[Host]]:
    started: list[Host] = []
    try:
        for n in range(count):
            started.append(start_host(tmp / f"host{n}", redis_url))
        yield started
    finally:
        for host in started:
            host.stop()


def produce(url: str, prefix: str) -> list[str]:
    with Client(url) as client:
        return [client.submit(f"{prefix} {n}", id=f"{prefix}-{n}").id for n in range(JOBS)]


def results(r: redis.Redis) -> Counter[str]:
    entries: Any = r.xrange("jobs:results")
    return Counter(fields[b"id"].decode() for _, fields in entries)


def check_every_job_once(r: redis.Redis, ids: list[str], prefix: str) -> None:
    written = results(r)
    assert sorted(written) == sorted(ids), "a job without an outcome, or a stranger"
    assert max(written.values()) == 1, "a job with two outcomes"
    pipe = r.pipeline(transaction=False)
    for job_id in ids:
        pipe.hmget(f"job:{job_id}", "state", "result")
    for n, (state, result) in enumerate(pipe.execute()):
        assert state == b"finished" and result == f"{prefix} {n}".encode(), (n, state, result)
    info = r.xinfo_groups("jobs")[0]
    assert info["pending"] == 0 and info["lag"] == 0


def test_three_controllers_share_one_stream(tmp_path):
    with redis_server(tmp_path) as server, hosts(tmp_path, server.url, 3) as three:
        r = redis.Redis.from_url(server.url)
        ids = produce(server.url, "share")
        wait_for_condition(lambda: r.xlen("jobs:results") >= JOBS, timeout=120)
        wait_for_condition(lambda: r.xinfo_groups("jobs")[0]["pending"] == 0)
        check_every_job_once(r, ids, "share")
        ran = [host.ran() for host in three]
        assert all(ran), f"a controller ran nothing: {ran}"
        assert sum(ran) == JOBS  # nothing failed, so nothing ran twice
        r.close()


def test_a_controller_killed_and_redis_restarted_lose_nothing(tmp_path):
    with redis_server(tmp_path) as server, hosts(tmp_path, server.url, 3) as three:
        r = redis.Redis.from_url(server.url)
        ids = produce(server.url, "chaos")
        wait_for_condition(lambda: r.xlen("jobs:results") >= JOBS // 5, timeout=60)
        three[1].controller.kill()  # its held entries wait claim_after, then run elsewhere
        wait_for_condition(lambda: r.xlen("jobs:results") >= JOBS // 2, timeout=60)
        restart_redis(server)
        r = redis.Redis.from_url(server.url)
        wait_for_condition(lambda: r.xlen("jobs:results") >= JOBS, timeout=120)
        wait_for_condition(lambda: r.xinfo_groups("jobs")[0]["pending"] == 0, timeout=30)
        check_every_job_once(r, ids, "chaos")
        survivors = [three[0].ran(), three[2].ran()]
        assert all(survivors), survivors
        assert sum(host.ran() for host in three) >= JOBS
        logs = (three[0].directory / "controller.log").read_text()
        assert "redis: working again" in logs
        r.close()


def restart_redis(server: RedisServer) -> None:
    server.stop()
    server.start()


def test_redis_down_at_start_other_doors_serve_then_it_catches_up(tmp_path):
    server = RedisServer(tmp_path / "redis", port=free_tcp_port())
    host = start_host(tmp_path / "lone", server.url, http=True)
    try:
        # The HTTP door serves while Redis is down.
        with Client(f"http://127.0.0.1:{host.http_port}") as client:
            assert client.submit("over http").result(timeout=20) == b"over http"
        log = host.directory / "controller.log"
        wait_for_condition(lambda: "redis: redis://" in log.read_text())
        with urllib.request.urlopen(f"http://127.0.0.1:{host.http_port}/") as resp:
            assert "unreachable" in resp.read().decode()
        server.start()
        try:
            with Client(server.url) as client:
                job = client.submit("over redis")
                assert job.result(timeout=30) == b"over redis"
            text = log.read_text()
            assert text.count("redis: redis://") == 1, "one line per interval, not per retry"
            assert "redis: working again" in text
        finally:
            server.stop()
        with urllib.request.urlopen(f"http://127.0.0.1:{host.http_port}/job/") as resp:
            doors = {job["door"] for job in json.load(resp).values()}
        assert doors == {"http", "redis"}
    finally:
        host.stop()


def slow_job(execlog: Path) -> list[str]:
    return ["--exec", "sh", "-c", f'echo "$TASK_ID" >> {execlog}; sleep 3; cat']


def test_a_long_job_is_not_taken_from_a_live_controller(tmp_path):
    """claim_after 1 s (here 2 s) and a 3 s job: its controller keeps its entry fresh, so
    the idle second controller never claims it, and it runs once."""
    with redis_server(tmp_path) as server:
        busy_dir = tmp_path / "busy"
        busy = start_host(busy_dir, server.url, job=slow_job(busy_dir / "exec.log"))
        idle = None
        try:
            with Client(server.url) as client:
                job = client.submit("long", id="long-job")
                wait_for_condition(lambda: busy.execlog.exists())
                idle = start_host(tmp_path / "idle", server.url)
                assert job.result(timeout=30) == b"long"
            assert busy.ran() == 1 and idle.ran() == 0
            assert "claimed" not in (idle.directory / "controller.log").read_text()
        finally:
            busy.stop()
            if idle is not None:
                idle.stop()


def test_a_job_canceled_before_any_controller_read_it_never_runs(tmp_path):
    with redis_server(tmp_path) as server:
        host = start_host(tmp_path / "h", server.url, worker=False)  # no worker: reads nothing
        try:
            with Client(server.url) as client:
                job = client.submit("never", id="canceled-early")
                assert client.cancel("canceled-early").state == "canceled"
                host.start_worker()
                after = client.submit("after")
                assert after.result(timeout=30) == b"after"
                r = redis.Redis.from_url(server.url)
                wait_for_condition(lambda: r.xinfo_groups("jobs")[0]["pending"] == 0)
                with pytest.raises(JobFailed) as info:
                    job.result(timeout=5)
                assert info.value.state == "canceled"
            assert host.ran() == 1  # "after" only
            assert results(r)["canceled-early"] == 1
            r.close()
        finally:
            host.stop()


def test_a_restarted_controller_takes_its_own_entries_back(tmp_path):
    """SIGKILL mid-run and a restart (same consumer, same journal) well within claim_after:
    what it held is read again from its own pending entries; every job gets one outcome."""
    with redis_server(tmp_path) as server:
        r = redis.Redis.from_url(server.url)
        host = start_host(tmp_path / "h", server.url)
        try:
            ids = produce(server.url, "restart")
            wait_for_condition(lambda: r.xlen("jobs:results") >= JOBS // 4, timeout=60)
            host.controller.kill()
            host.controller.wait()
            restarted = start_host(tmp_path / "h", server.url, worker=False)
            host.controller = restarted.controller  # its worker registers again by itself
            wait_for_condition(lambda: r.xlen("jobs:results") >= JOBS, timeout=120)
            wait_for_condition(lambda: r.xinfo_groups("jobs")[0]["pending"] == 0)
            check_every_job_once(r, ids, "restart")
            assert host.ran() >= JOBS
        finally:
            host.stop()
            r.close()


def test_an_entry_deleted_while_held_is_acknowledged_after_a_restart(tmp_path):
    """XDEL of an entry a controller holds, then SIGKILL and a restart: its own pending list
    names the entry with no fields; it is acknowledged (not pending for ever), and the job,
    recovered from the journal, still ends with its outcome in Redis."""
    with redis_server(tmp_path) as server:
        r = redis.Redis.from_url(server.url)
        directory = tmp_path / "h"
        # claim_after 60 s: XAUTOCLAIM, which also drops deleted entries, does not run here.
        slow = slow_job(directory / "exec.log")
        host = start_host(directory, server.url, job=slow, claim_after=60)
        try:
            with Client(server.url) as client:
                job = client.submit("deleted", id="deleted-entry")
                wait_for_condition(lambda: host.ran() == 1)
                entry: Any = r.xrange("jobs")
                r.xdel("jobs", entry[0][0])
                host.controller.kill()
                host.controller.wait()
                again = start_host(directory, server.url, worker=False, claim_after=60)
                host.controller = again.controller
                wait_for_condition(lambda: r.xinfo_groups("jobs")[0]["pending"] == 0)
                assert job.result(timeout=30) == b"deleted"
            assert results(r)["deleted-entry"] == 1
            assert host.ran() == 1  # the deleted entry did not become a job of its own
        finally:
            host.stop()
            r.close()

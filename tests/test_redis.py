"""The Redis stream door against a real redis-server and a live controller: jobs in by XADD
(the client, or a raw producer), outcomes in `job:<id>` and `<stream>:results` before the
entry is acknowledged, final-state dedupe, bad entries, cancel, status, and the client."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import trio

from controller.client import AsyncClient, Client, ControllerError, JobFailed
from controller.doors.redis.codec import entry_job_id, shown_url
from tests.helpers import (
    REDIS_SERVER,
    LiveController,
    RedisServer,
    controller_argv,
    free_tcp_port,
    live_controller,
    redis_server,
    run_udp_client,
    wait_for_condition,
    write_config,
)

pytestmark = pytest.mark.skipif(
    REDIS_SERVER is None, reason="redis-server is not installed (apt-get install redis-server)"
)

JOB_SCRIPT = (
    '#!/bin/sh\necho "$TASK_ID" >> {log}\ninput=$(cat)\n'
    'case "$input" in sleep*) sleep 30;; fail*) echo "it failed" >&2; exit 3;; esac\n'
    'printf %s "$input"\n'
)
MAX_PAYLOAD = 1024 * 1024  # the controller's max_extra_size


@dataclass
class Setup:
    server: RedisServer
    controller: LiveController
    execlog: Path
    r: redis.Redis
    metrics_port: int
    tmp: Path

    @property
    def controller_log(self) -> Path:
        return self.tmp / "controller.log"

    @property
    def url(self) -> str:
        return self.server.url


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    tmp: Path = tmp_path_factory.mktemp("redis")
    execlog = tmp / "exec.log"
    script = tmp / "job.sh"
    script.write_text(JOB_SCRIPT.format(log=execlog))
    script.chmod(0o755)
    with redis_server(tmp) as server:
        settings = {"url": server.url, "claim_after": 2}
        args = ("--workers", "2", "--", "--exec", str(script))
        metrics_port = free_tcp_port()
        with live_controller(
            tmp,
            *args,
            max_retries=0,
            max_extra_size=MAX_PAYLOAD,
            redis=settings,
            metrics_address={"host": "127.0.0.1", "port": metrics_port},
        ) as ctl:
            r = redis.Redis.from_url(server.url)
            yield Setup(server, ctl, execlog, r, metrics_port, tmp)
            r.close()


def group(r: redis.Redis) -> dict[str, object]:
    info = r.xinfo_groups("jobs")
    return {str(k): v for k, v in info[0].items()}


def results_for(r: redis.Redis, job_id: str) -> list[bytes]:
    entries: Any = r.xrange("jobs:results")
    return [f[b"state"] for _, f in entries if f[b"id"] == job_id.encode()]


def test_client_submits_and_collects(setup):
    with Client(setup.url) as client:
        jobs = [client.submit(f"hello {n}", name="greeting") for n in range(20)]
        assert [job.result(timeout=20) for job in jobs] == [
            f"hello {n}".encode() for n in range(20)
        ]
        job = jobs[0]
        assert job.state == "finished"
        assert len(job.id) == 36 and job.id == job.id.upper()
    raw = setup.r.hgetall(f"job:{job.id}")
    assert raw[b"state"] == b"finished" and raw[b"result"] == b"hello 0"
    assert raw[b"updated_at"].endswith(b"Z")
    assert 0 < setup.r.ttl(f"job:{job.id}") <= 3600  # result_retention
    assert results_for(setup.r, job.id) == [b"finished"]
    # Every entry acknowledged once its outcome is in Redis; the HTTP API lists the jobs too.
    wait_for_condition(lambda: group(setup.r)["pending"] == 0)
    with urllib.request.urlopen(f"{setup.controller.url}/job/{job.id}/") as resp:
        listed = json.load(resp)
    assert listed["door"] == "redis" and listed["name"] == "greeting"


def test_raw_producer_entry_without_id(setup):
    entry = setup.r.xadd("jobs", {"payload": b"\xff\x00raw"}).decode()
    job_id = entry_job_id("jobs", entry)
    # No hash until a controller writes one (the client's submit writes `pending` at once).
    wait_for_condition(lambda: setup.r.exists(f"job:{job_id}") == 1)
    with Client(setup.url) as client:
        assert client.get(job_id).result(timeout=20) == b"\xffraw"  # sh drops NUL bytes


def test_entry_of_a_job_already_final_is_acknowledged_without_running(setup):
    setup.r.hset("job:done-before", mapping={"state": "finished", "result": "old"})
    setup.r.xadd("jobs", {"payload": "again", "id": "done-before"})
    with Client(setup.url) as client:  # a later entry: read after the first one
        assert client.submit("after").result(timeout=20) == b"after"
        wait_for_condition(lambda: group(setup.r)["pending"] == 0)
        assert client.get("done-before").result(timeout=5) == b"old"
    assert results_for(setup.r, "done-before") == []  # nothing written: the first outcome stays
    # It never ran: the controller's status counts it as skipped.
    status = json.loads(run_udp_client(setup.controller.udp_port, "status", "--json").stdout)
    assert status["redis"]["skipped"] >= 1


def test_the_same_id_twice_runs_once(setup):
    before = setup.execlog.read_text().count("\n") if setup.execlog.exists() else 0
    with Client(setup.url) as client:
        first = client.submit("twice", id="twice-1")
        second = client.submit("twice", id="twice-1")
        assert first.result(timeout=20) == second.result(timeout=20) == b"twice"
    wait_for_condition(lambda: group(setup.r)["pending"] == 0)
    assert setup.execlog.read_text().count("\n") == before + 1
    assert results_for(setup.r, "twice-1") == [b"finished"]


def test_bad_entries_fail_with_a_clear_error_and_nothing_is_lost(setup):
    big = b"x" * (MAX_PAYLOAD + 1)
    setup.r.xadd("jobs", {"payload": big, "id": "too-big"})
    setup.r.xadd("jobs", {"payload": "x", "id": "bad/id"})
    with Client(setup.url) as client:
        assert client.submit("fine").result(timeout=20) == b"fine"  # read after the bad ones
        with pytest.raises(JobFailed) as info:
            client.get("too-big").result(timeout=20)
        assert "over max_extra_size" in info.value.error
        failed = setup.r.hgetall("job:bad/id")
        assert failed[b"state"] == b"failed" and b"id must be" in failed[b"error"]
        with pytest.raises(ValueError, match="id must be"):
            client.submit("x", id="bad/id")
    wait_for_condition(lambda: group(setup.r)["pending"] == 0)


BAD_OPTIONS: dict[str, tuple[dict[str, str | bytes], str]] = {
    "opt-priority": ({"priority": "high"}, "priority must be an integer"),
    "opt-range": ({"priority": "101"}, "from -100 to 100"),
    "opt-delay": ({"delay": "-1"}, "delay must be a number of seconds from 0"),
    "opt-date": ({"run_at": "2026-02-30T00:00:00Z"}, "run_at is not an RFC 3339 time"),
    "opt-label": ({"requires": "GPU"}, "a label must match"),
    "opt-queue": ({"queue": ""}, "queue must match"),
    "opt-owner": ({"owner": b"\xff"}, "owner is not UTF-8 text"),
    "opt-both": ({"delay": "1", "run_at": "2030-01-01T00:00:00Z"}, "delay or run_at"),
    "opt-other-queue": ({"queue": "q"}, "its stream is 'jobs.q'"),
}


def test_bad_options_fail_their_entry_with_the_reason(setup):
    for job_id, (fields, _) in BAD_OPTIONS.items():
        setup.r.xadd("jobs", {"id": job_id, "payload": "x", **fields})
    with Client(setup.url) as client:
        assert client.submit("after them").result(timeout=20) == b"after them"
        for job_id, (_, reason) in BAD_OPTIONS.items():
            with pytest.raises(JobFailed) as info:
                client.get(job_id).result(timeout=20)
            assert reason in info.value.error, job_id
            assert results_for(setup.r, job_id) == [b"failed"]
    wait_for_condition(lambda: group(setup.r)["pending"] == 0)


def test_keys_of_the_wrong_type_fail_their_entry_alone(setup):
    setup.r.rpush("job:listy", "mine")  # someone's list where a job's hash would go
    setup.r.xadd("jobs", {"payload": "x", "id": "listy"})
    with Client(setup.url) as client:
        assert client.submit("after the list").result(timeout=20) == b"after the list"
    wait_for_condition(lambda: results_for(setup.r, "listy") == [b"failed"])
    wait_for_condition(lambda: group(setup.r)["pending"] == 0)
    assert setup.r.lrange("job:listy", 0, -1) == [b"mine"]  # left as it was
    assert "Traceback" not in setup.controller_log.read_text()


def test_an_oversized_name_fails_its_entry_alone(setup):
    setup.r.xadd("jobs", {"payload": "x", "id": "big-name", "name": "n" * 20_000})
    with Client(setup.url) as client:
        assert client.submit("after the name").result(timeout=20) == b"after the name"
        with pytest.raises(JobFailed) as info:
            client.get("big-name").result(timeout=20)
    assert "name is 20000 bytes" in info.value.error


def test_failed_job(setup):
    with Client(setup.url) as client:
        job = client.submit("fail now")
        with pytest.raises(JobFailed) as info:
            job.result(timeout=20)
        assert info.value.state == "failed" and "it failed" in info.value.error


def test_cancel_a_running_job_restarts_its_worker(setup):
    with Client(setup.url) as client:
        job = client.submit("sleep long", id="cancel-running")
        wait_for_condition(lambda: job.state == "working")
        assert client.cancel("cancel-running").state == "canceled"
        with pytest.raises(JobFailed) as info:
            job.result(timeout=10)
        assert info.value.state == "canceled"
        # The worker was restarted (not left sleeping 30 s): a new job runs at once on it.
        jobs = [client.submit(f"after cancel {n}") for n in range(4)]
        assert [j.result(timeout=10) for j in jobs] == [
            f"after cancel {n}".encode() for n in range(4)
        ]
    wait_for_condition(lambda: group(setup.r)["pending"] == 0)
    assert results_for(setup.r, "cancel-running") == [b"canceled"]
    with urllib.request.urlopen(f"{setup.controller.url}/job/cancel-running/") as resp:
        assert json.load(resp)["state"] == "canceled"


def test_get_unknown_and_timeouts(setup):
    with Client(setup.url) as client:
        with pytest.raises(KeyError):
            client.get("never-submitted")
        job = client.submit("sleep a bit", id="timeout-then-cancel")
        with pytest.raises(TimeoutError):
            job.result(timeout=0.2)
        client.cancel("timeout-then-cancel")
        assert client.cancel("timeout-then-cancel").state == "canceled"  # again: unchanged
    with pytest.raises(ValueError, match="redis://HOST:PORT/DB"):
        Client("redis://")


def test_status_page_metrics_and_udp_status_show_the_stream(setup):
    def shown() -> dict[str, object]:
        out = run_udp_client(setup.controller.udp_port, "status", "--json").stdout
        return dict(json.loads(out)["redis"])

    wait_for_condition(lambda: shown()["pending"] == 0)  # read once a second
    assert shown()["connected"] is True and shown()["stream"] == "jobs"
    assert shown()["lag"] == 0
    assert (shown()["streams"], shown()["parked"]) == (["jobs"], 0)  # default queue only

    def metrics() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{setup.metrics_port}/metrics") as resp:
            return str(resp.read().decode())

    wait_for_condition(lambda: "controller_redis_pending 0.0" in metrics())  # once a second
    assert "controller_redis_up 1.0" in metrics() and "controller_redis_lag 0.0" in metrics()
    human = run_udp_client(setup.controller.udp_port, "status").stdout.decode()
    assert "redis" in human and "lag 0" in human and "(parked 0)" in human
    with urllib.request.urlopen(f"{setup.controller.url}/") as resp:
        page = resp.read().decode()
    assert "Redis stream" in page and "lag (not yet read by any controller): <b>0</b>" in page
    assert "streams read (the queues of this controller's workers):\njobs<" in page


async def _async_round(url: str) -> list[bytes]:
    async with AsyncClient(url) as client:
        jobs = [await client.submit(f"a{n}") for n in range(5)]
        out = [await job.result(timeout=20) for job in jobs]
        assert await jobs[0].refresh() == "finished" and jobs[0].state == "finished"
        got = await client.get(jobs[1].id)
        assert got.state == "finished"
        slow = await client.submit("sleep async", id="async-cancel")
        assert (await client.cancel("async-cancel")).state == "canceled"
        with pytest.raises(JobFailed):
            await slow.result(timeout=10)
        return out


def test_async_client_under_asyncio_and_trio(setup):
    expected = [f"a{n}".encode() for n in range(5)]
    assert asyncio.run(_async_round(setup.url)) == expected
    setup.r.delete("job:async-cancel")
    assert trio.run(_async_round, setup.url) == expected


def test_unreachable_redis_is_a_clear_client_error():
    with (
        Client("redis://127.0.0.1:1/0", timeout=1) as client,
        pytest.raises(ControllerError) as info,
    ):
        client.submit("x")
    assert info.value.status == "redis"


def test_a_stream_deleted_or_of_the_wrong_type_is_ridden_out(setup):
    """It deletes the stream (the tests after it find it created again). A key `jobs` that is
    no stream stops that queue's stream (logged, the HTTP door serves on); once it is gone,
    the controller creates the stream and its group again and takes new jobs."""
    setup.r.delete("jobs")
    setup.r.set("jobs", "not a stream")
    log = setup.controller_log
    wait_for_condition(lambda: "WRONGTYPE" in log.read_text())
    with Client(setup.controller.url) as http:
        assert http.submit("over http meanwhile").result(timeout=20) == b"over http meanwhile"
    setup.r.delete("jobs")
    with Client(setup.url) as client:
        assert client.submit("after").result(timeout=30) == b"after"
    assert "stream 'jobs' can be used again" in log.read_text()


def test_an_async_wait_is_cancelled_at_once(setup):
    async def main() -> float:
        async with AsyncClient(setup.url) as client:
            job = await client.submit("sleep to cancel", id="async-wait-cancelled")
            start = trio.current_time()
            with trio.move_on_after(0.3):
                await job.result()  # no timeout: only the cancel ends it
            await client.cancel("async-wait-cancelled")
            return trio.current_time() - start

    assert trio.run(main) < 5


def test_redis_losing_everything_loses_no_held_job(setup):
    """FLUSHALL (a Redis restarted without persistence) while a job runs: its outcome is still
    written when it ends, the group is created again, and new jobs run."""
    with Client(setup.url) as client:
        job = client.submit("sleep briefly", id="held-through-flush")
        wait_for_condition(lambda: job.state == "working")
        setup.r.flushall()
        # The job sleeps 30 s: cancel it (by its hash) to end it now; its outcome lands.
        client.cancel("held-through-flush")
        with pytest.raises(JobFailed):
            job.result(timeout=20)
        assert client.submit("after the flush").result(timeout=30) == b"after the flush"
    wait_for_condition(lambda: group(setup.r)["pending"] == 0)


def test_a_password_in_the_url_never_reaches_the_log():
    assert shown_url("redis://:s3cret@db.example:6380/2") == "redis://:***@db.example:6380/2"
    assert shown_url("redis://app:s3cret@[::1]/0") == "redis://app:***@[::1]/0"
    assert shown_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def test_a_bad_redis_url_stops_the_start_with_a_clear_message(tmp_path):
    config = write_config(
        tmp_path,
        socket_dir=str(tmp_path / "s"),
        journal=None,
        client_address={"host": "127.0.0.1", "port": 0},
        redis={"url": "http://:pw@127.0.0.1:6379/0"},
    )
    done = subprocess.run(controller_argv(config), capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert "controller: redis url 'http://:***@127.0.0.1:6379/0'" in done.stderr
    assert "pw" not in done.stderr


OPENSSL = shutil.which("openssl")


@pytest.mark.skipif(OPENSSL is None, reason="openssl is not installed (it makes the test's cert)")
def test_a_tls_redis_serves_the_door_through_redis_py_in_threads(tmp_path):
    """rediss:// is not spoken by the loop's link: the same scripts go through redis-py in a
    thread, and jobs run and report as over redis://."""
    assert OPENSSL is not None
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    make_cert = [OPENSSL, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
    make_cert += ["-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1"]
    make_cert += ["-addext", "subjectAltName=IP:127.0.0.1"]
    subprocess.run(make_cert, check=True, capture_output=True)
    tls_port = free_tcp_port()
    tls = ["--tls-port", str(tls_port), "--tls-cert-file", str(cert), "--tls-key-file", str(key)]
    tls += ["--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no"]
    with redis_server(tmp_path, *tls) as server:
        url = f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={cert}"
        with live_controller(tmp_path, "--workers", "1", redis={"url": url}) as ctl:
            r = redis.Redis.from_url(url)
            for n in range(20):
                r.xadd("jobs", {"payload": f"tls {n}", "id": f"tls-{n}"})
            plain = redis.Redis.from_url(server.url)  # the same server, to look
            wait_for_condition(lambda: len(results_for(plain, "tls-19")) == 1, timeout=30)
            for n in range(20):
                job = plain.hgetall(f"job:tls-{n}")
                assert job[b"state"] == b"finished" and job[b"result"] == f"tls {n}".encode()
            wait_for_condition(lambda: group(plain)["pending"] == 0)
            status = json.loads(run_udp_client(ctl.udp_port, "status", "--json").stdout)
            assert status["redis"]["connected"] is True and status["redis"]["read"] == 20
            r.close()
            plain.close()


def test_acknowledged_entries_and_old_results_are_trimmed(tmp_path):
    # Small stream nodes, so that the approximate trim (MINID ~) removes whole nodes soon.
    with redis_server(tmp_path, "--stream-node-max-entries", "2") as server:
        settings = {"url": server.url, "claim_after": 2}
        with live_controller(tmp_path, "--workers", "1", redis=settings, result_retention=1) as ctl:
            del ctl
            r = redis.Redis.from_url(server.url)
            try:
                with Client(server.url) as client:
                    jobs = [client.submit(f"t{n}") for n in range(10)]
                    assert [j.result(timeout=20) for j in jobs] == [
                        f"t{n}".encode() for n in range(10)
                    ]
                assert r.xlen("jobs:results") >= 10
                # Acknowledged and past result_retention: gone from the stream, the set
                # that noted them empty, the results stream down to a node at most.
                wait_for_condition(lambda: r.xlen("jobs") == 0, 30)
                wait_for_condition(lambda: r.zcard("jobs:acked") == 0, 30)
                wait_for_condition(lambda: r.xlen("jobs:results") <= 2, 30)
                assert group(r)["pending"] == 0
                with Client(server.url) as client:  # and the door goes on
                    assert client.submit("later").result(timeout=20) == b"later"
            finally:
                r.close()


def test_an_unacknowledged_entry_is_never_trimmed(tmp_path):
    with redis_server(tmp_path, "--stream-node-max-entries", "2") as server:
        settings = {"url": server.url, "claim_after": 60}
        r = redis.Redis.from_url(server.url)
        try:
            # Read by a consumer that never acknowledges it (a controller that stopped).
            r.xgroup_create("jobs", "controllers", id="0", mkstream=True)
            held = r.xadd("jobs", {"payload": "held"})
            r.xreadgroup("controllers", "gone", {"jobs": ">"})
            with live_controller(tmp_path, "--workers", "1", redis=settings, result_retention=1):
                with Client(server.url) as client:
                    assert client.submit("other").result(timeout=20) == b"other"
                wait_for_condition(lambda: r.zcard("jobs:acked") == 0, 30)
                assert [entry for entry, _ in r.xrange("jobs")] == [held]
        finally:
            r.close()


# ---------------------------------------------------------------- retry announcements


@dataclass
class _HeldJob:
    id: str
    door: str
    state: Any
    error: str = "it failed"
    result: bytes = b""


class _RetryDesk:
    def __init__(self, allow: bool) -> None:
        self.allow = allow
        self.asked: list[str] = []

    def retry(self, job: _HeldJob, now: float) -> bool:
        self.asked.append(job.id)
        return self.allow


def _door_holding(jobs: list[_HeldJob], desk: _RetryDesk) -> Any:
    """A Redis door with only what hearing a retry touches (no Redis, no controller)."""
    from controller.doors.redis.door import RedisDoor

    door = RedisDoor.__new__(RedisDoor)
    door.book = {job.id: job for job in jobs}  # type: ignore[assignment]
    door.desk = desk  # type: ignore[assignment]
    door.entries, door.outbox, door.progress, door.reported = {}, {}, {}, {}
    door.counters = {"retried": 0}
    door._work = trio.Event()
    return door


async def test_a_heard_retry_puts_back_only_this_doors_ended_jobs():
    from controller.job_states import JobState

    jobs = [
        _HeldJob("failed", "redis", JobState.FAILED),
        _HeldJob("live", "redis", JobState.WORKING),
        _HeldJob("http-one", "http", JobState.FAILED),
    ]
    desk = _RetryDesk(allow=True)
    door = _door_holding(jobs, desk)
    for job_id in ("failed", "live", "http-one", "unknown"):
        door._retry(job_id)
    assert desk.asked == ["failed"]
    assert door.entries == {"failed": []}  # held again: its next outcome is written
    assert door.counters["retried"] == 1 and not door.outbox


async def test_a_retry_the_desk_refuses_writes_the_jobs_outcome_back():
    from controller.job_states import JobState

    desk = _RetryDesk(allow=False)
    door = _door_holding([_HeldJob("gone", "redis", JobState.CANCELED, error="")], desk)
    door._retry("gone")
    assert desk.asked == ["gone"]
    assert door.outbox["gone"].state == "canceled" and door.entries == {}

"""Probes of issues 38 and 39 as an attacker or a careful client would try them: job code
under `--job-user` (root only: numeric uids), hostile clients on loopback. Each test
reproduces one finding."""

from __future__ import annotations

import contextlib
import time

import pytest
import trio

from controller.joblimits import JobLimits
from gen import worker_protocol_pb2 as pb
from tests.helpers import wait_until
from tests.test_hostile_http import (  # noqa: F401 (the fixture closes what a test opened)
    _answer,
    _close_what_the_test_opened,
    _connect,
    _get,
)
from tests.test_http import http_controller
from tests.test_job_limits import PYTHON, worker


def test_a_jobs_own_limits_hold_on_a_worker_without_job_users_or_ceilings(tmp_path):
    """A job may ask for less than the configuration with its `limits` option, on every
    worker (section 15); a worker with no job user, ceilings or cgroup used to drop what the
    job asked for, so a job that asked for 1 s of CPU spun on."""
    # It spins for 3 s of CPU at most, so that without the limit it ends (and fails the test)
    # instead of spinning on.
    spin = [PYTHON, "-c", "import time\nwhile time.process_time() < 3: pass"]
    with worker(tmp_path, "--exec", *spin) as w:
        started = time.monotonic()
        answer, text = w.run(limits=JobLimits(cpu_time=1.0))
        assert answer.error == pb.WORKER_ERR_TASK_FAILED
        assert answer.reason == "limit" and text.startswith(b"CPU time limit 1 s"), text
        assert time.monotonic() - started < 30


@pytest.mark.xfail(
    strict=True,
    reason="section 12 counts max_connections_per_client by IP address; one host (any "
    "127.0.0.0/8 source, or an IPv6 /64) has many: reported, a contract question",
)
async def test_one_host_cannot_take_every_place_by_changing_its_source_address(sockdir):
    """A local user binds its connections to 127.0.0.2, .3, ... (an IPv6 client would use its
    /64): each source is a client of its own, so slow requests from one host still take every
    place, and /health/ from 127.0.0.1 is refused."""
    async with http_controller(
        sockdir, workers=0, max_connections=10, max_connections_per_client=3
    ) as ctl:
        conns = ctl.web.connections
        for n in range(2, 6):  # 4 sources x 3 places > 10
            for _ in range(3):
                stream = await _connect(ctl.url, source=f"127.0.0.{n}")
                with contextlib.suppress(trio.BrokenResourceError):
                    await stream.send_all(b"GET /health/ HTTP/1.1\r\n")  # and no more
        await wait_until(lambda: conns.open + conns.refused == 12)
        other = await _connect(ctl.url)
        with contextlib.suppress(trio.BrokenResourceError, AssertionError):
            answer = await _answer(other, _get())
            assert answer.startswith(b"HTTP/1.1 200")
            return
        raise AssertionError(f"refused: {conns.open} open of {conns.limit}, {conns.by_client}")

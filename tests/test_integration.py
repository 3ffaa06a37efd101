"""The real controller shell with real worker processes (real clock, small timeouts)."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
import trio

from controller.core import TaskState
from tests.helpers import reap, running_controller, wait_until, worker_argv


def spawn(sockdir, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(worker_argv(sockdir, *args, log_level="WARNING"))


async def test_tasks_flow_through_real_workers(sockdir):
    procs = [spawn(sockdir) for _ in range(2)]
    try:
        async with running_controller(sockdir) as (shell, outcomes):
            await wait_until(lambda: shell.core.idle_workers == 2)
            for i in range(1, 201):
                shell.submit(i, b"payload-%d" % i)
            done = await outcomes.wait(200)
            assert {d.task_id: d.result for d in done} == {
                i: b"payload-%d" % i for i in range(1, 201)
            }
            assert all(d.state is TaskState.SUCCESS for d in done)
    finally:
        for proc in procs:
            reap(proc)


@pytest.mark.parametrize("protocol", ["seed", "channel"])
async def test_kill_9_busy_worker_is_seen_at_once(sockdir, protocol):
    """The seed's worker is seen through its pidfd; a channel worker through its channel's
    end (or its pidfd, whichever comes first)."""
    seed = ["--seed-protocol"] if protocol == "seed" else []
    procs = [spawn(sockdir, "--pulse", "5", *seed, "--exec", "sh", "-c", "sleep 30")]
    try:
        async with running_controller(sockdir) as (shell, _outcomes):
            await wait_until(lambda: shell.core.idle_workers == 1)
            shell.submit(1, b"")
            [victim] = shell.core.workers.values()
            await wait_until(
                lambda: victim.task is not None and victim.task.state is TaskState.RUNNING
            )
            os.kill(victim.pid, signal.SIGKILL)
            start = trio.current_time()
            # next_pulse is 10 s: only the pidfd can notice within a second
            await wait_until(lambda: victim.worker_id not in shell.core.workers, timeout=1.0)
            assert trio.current_time() - start < 1.0
            assert shell.core.queued == 1
            losses = shell.core.counters.worker_losses
            if protocol == "seed":
                assert losses == {"process exited": 1}
            else:
                assert losses in ({"process exited": 1}, {"channel ended": 1})
    finally:
        for proc in procs:
            reap(proc)

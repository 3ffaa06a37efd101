"""Probes of issues 38 and 39 as an attacker or a careful client would try them: job code
under `--job-user` (root only: numeric uids), hostile clients on loopback. Each test
reproduces one finding."""

from __future__ import annotations

import time

from controller.joblimits import JobLimits
from gen import worker_protocol_pb2 as pb
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

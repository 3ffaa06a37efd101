"""The setrlimit side of a job's limits: which rlimits a job gets (`rlimit_plan`), and which
limit a failed job hit as far as the kernel's signals and its rusage tell (`rlimit_hit`)."""

from __future__ import annotations

import errno
import math
import os
import resource
import signal

from controller.joblimits import JobLimits, describe_size

# A job whose peak memory came this close to memory_max and failed hit it: RLIMIT_AS counts
# the address space, which is always more than the resident memory rusage reports.
MEMORY_SLACK = 64 * 1024 * 1024
_EAGAIN_TEXT = os.strerror(errno.EAGAIN).encode()  # "Resource temporarily unavailable"

RLIMITS: tuple[tuple[str, int], ...] = (
    ("memory_max", resource.RLIMIT_AS),
    ("cpu_time", resource.RLIMIT_CPU),
    ("file_size", resource.RLIMIT_FSIZE),
    ("open_files", resource.RLIMIT_NOFILE),
    ("tasks_max", resource.RLIMIT_NPROC),
)


def rlimit_plan(
    limits: JobLimits, hard: dict[int, int], *, per_user: bool
) -> list[tuple[int, tuple[int, int]]]:
    """The (resource, (soft, hard)) pairs a job gets; never above what the worker has
    (`hard`: only a process with CAP_SYS_RESOURCE may raise a hard limit). RLIMIT_NPROC
    counts every process of the job's real uid, so it is set only with a job user."""
    plan: list[tuple[int, tuple[int, int]]] = []
    for name, res in RLIMITS:
        value = getattr(limits, name)
        if value is None or (res == resource.RLIMIT_NPROC and not per_user):
            continue
        cap = hard[res]
        if res == resource.RLIMIT_CPU:
            soft = max(1, math.ceil(value))
            pair = (soft, soft + 1)  # SIGXCPU at the limit, SIGKILL a second later
        else:
            pair = (int(value), int(value))
        if cap != resource.RLIM_INFINITY:
            pair = (min(pair[0], cap), min(pair[1], cap))
        plan.append((res, pair))
    return plan


def rlimit_hit(
    code: int, cpu: float, max_rss: int, stderr: bytes, limits: JobLimits, per_user: bool
) -> str:
    """The limit a failed job hit, as far as setrlimit lets the worker know ("" if none)."""
    # A signal ends the job itself (negative code) or a command its shell ran (128 + it).
    signals = {-code, code - 128}
    if limits.cpu_time is not None and (
        # rusage counts CPU by ticks, a little short of the kernel's own limit check
        signal.SIGXCPU in signals or (signal.SIGKILL in signals and cpu >= 0.75 * limits.cpu_time)
    ):
        return f"CPU time limit {limits.cpu_time:g} s"
    if limits.file_size is not None and signal.SIGXFSZ in signals:
        return f"file size limit {describe_size(limits.file_size)}"
    if (
        limits.memory_max is not None
        and max_rss + min(MEMORY_SLACK, limits.memory_max // 4) >= limits.memory_max
    ):
        return (
            f"memory limit {describe_size(limits.memory_max)} reached "
            f"(peak {describe_size(max_rss)} resident)"
        )
    if limits.tasks_max is not None and per_user and _EAGAIN_TEXT in stderr:
        return f"process limit {limits.tasks_max}: a fork was refused"
    return ""

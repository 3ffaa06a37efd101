"""The job of `python -m bench.peers --lengths`: sleep, or keep a CPU busy, for a given time.

The same functions serve our `--handler` (`bench.work:run`, the payload `KIND SECONDS`) and
the peers' tasks (bench/peers_tasks.py imports this module as `work`); bench/work.sh is the
`--exec` job, for us and for Gearman's command worker. Nothing here imports the controller.
"""

from __future__ import annotations

import time

KINDS = ("sleep", "busy")


def spin(seconds: float) -> None:
    """Keep this thread's CPU busy until `seconds` have passed on the clock."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        pass


def do(kind: str, seconds: float) -> None:
    """One job: `sleep` (time.sleep) or `busy` (a CPU loop) for `seconds`."""
    if kind == "sleep":
        time.sleep(seconds)
    elif kind == "busy":
        spin(seconds)
    else:
        raise ValueError(f"unknown kind of job {kind!r} (expected sleep or busy)")


def run(payload: bytes) -> bytes:
    """The `--handler`: the payload is `KIND SECONDS`, e.g. `busy 0.001`."""
    kind, seconds = payload.decode().split()
    do(kind, float(seconds))
    return b""


def efficiency(jobs_per_s: float, workers: int, length: float) -> float:
    """Jobs/s as a share of what `workers` could do with no dispatcher at all: workers / length."""
    return jobs_per_s * length / workers


def loop_iterations(length: float, start: float, probe: int, probe_time: float) -> int:
    """The iterations of bench/work.sh's busy loop that last `length` seconds, from a probe:
    the script took `start` seconds with none and `probe_time` with `probe`."""
    per_iteration = (probe_time - start) / probe
    if per_iteration <= 0:
        raise ValueError("the probe took no longer than the script's start")
    return max(1, round(length / per_iteration))

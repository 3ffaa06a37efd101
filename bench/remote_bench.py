"""Remote workers: calculators (worker --udp) and pollers (worker --hub) beside local ones.

1. No-op jobs through the UDP door (udp-client's engine, 64 in flight) on 2 local
   workers, on 2 calculators, and on 2 pollers, each with its own controller,
   beside ProcessPoolExecutor(2) measured in the same run.
2. kill -9 of a calculator holding a job: the time until that job has finished on
   the other calculator, with calculator_timeout 1 s.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import trio

from bench.common import median, socket_dir
from bench.e2e_bench import HANDLER, drive, ppe_rate
from tests.helpers import LiveController, live_controller, reap, wait_for_condition

JOBS = 6000
WINDOW = 64


def _workers(url: str) -> int:
    try:
        with urllib.request.urlopen(f"{url}/health/", timeout=2) as resp:
            return int(json.loads(resp.read())["workers"])
    except OSError:
        return -1


def _remote(*args: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "worker", "--log-level", "ERROR", "--handler", HANDLER, *args]
    return subprocess.Popen(cmd, stderr=subprocess.DEVNULL)


@contextlib.contextmanager
def controller_with(
    kind: str, worker_args: tuple[str, ...] = ("--handler", HANDLER), **settings: Any
) -> Iterator[LiveController]:
    """A live controller with 2 workers of `kind` (local, calculator or poller), no-op ones
    unless `worker_args` (local workers only) says otherwise."""
    with socket_dir() as tmp:
        local = ["--workers", "2", "--", "--log-level", "ERROR", *worker_args]
        args = local if kind == "local" else []
        with live_controller(Path(tmp), *args, **settings) as ctl:
            procs = []
            if kind == "calculator":
                procs = [_remote("--udp", f"127.0.0.1:{ctl.udp_port}") for _ in range(2)]
            elif kind == "poller":
                procs = [_remote("--hub", ctl.url, "--name", f"p{n}") for n in range(2)]
            try:
                wait_for_condition(lambda: _workers(ctl.url) == 2, 30)
                yield ctl
            finally:
                for proc in procs:
                    reap(proc)


def _rate(kind: str, jobs: int) -> float:
    with controller_with(kind, journal=None) as ctl:
        trio.run(drive, ctl.udp_port, 200, 8, 50_000_000)  # warm up
        rate, _ = trio.run(drive, ctl.udp_port, jobs, WINDOW, 1)
    return rate


def _kill_to_elsewhere() -> float:
    """kill -9 of the calculator holding a job, to that job finished on the other one."""
    with (
        socket_dir() as tmp,
        live_controller(Path(tmp), journal=None, calculator_timeout=1.0) as ctl,
    ):
        slow = ["--exec", "sh", "-c", "sleep 0.5; cat"]
        cmd = [sys.executable, "-m", "worker", "--log-level", "ERROR", "--pulse", "0.2"]
        calcs = [
            subprocess.Popen(
                [*cmd, "--udp", f"127.0.0.1:{ctl.udp_port}", *slow], stderr=subprocess.DEVNULL
            )
            for _ in range(2)
        ]
        try:
            wait_for_condition(lambda: _workers(ctl.url) == 2, 30)
            request = urllib.request.Request(
                f"{ctl.url}/job/", data=b'{"id": "victim"}', method="POST"
            )
            urllib.request.urlopen(request, timeout=5).read()
            job: dict[str, Any] = {}

            def state() -> str:
                nonlocal job
                with urllib.request.urlopen(f"{ctl.url}/job/victim/", timeout=5) as resp:
                    job = json.loads(resp.read())
                return str(job["state"])

            wait_for_condition(lambda: state() == "working", 10)
            port = int(job["worker"].rsplit(":", 1)[1])
            victim = next(p for p in calcs if _local_port(p.pid) == port)
            start = time.monotonic()
            victim.send_signal(signal.SIGKILL)
            wait_for_condition(lambda: state() == "finished", 30)
            return time.monotonic() - start
        finally:
            for proc in calcs:
                reap(proc)


def _local_port(pid: int) -> int:
    """The UDP port a calculator process sends from (from /proc: its one UDP socket)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = str(fd.readlink()) if fd.is_symlink() else ""
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    for line in Path("/proc/net/udp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[9] in inodes:
            return int(fields[1].split(":")[1], 16)
    return -1


def main() -> dict[str, Any]:
    rates = {kind: _rate(kind, JOBS) for kind in ("local", "calculator", "poller")}
    ppe = ppe_rate(2, JOBS)
    kills = [_kill_to_elsewhere() for _ in range(3)]
    results = {
        "udp_door_jobs_per_s": {kind: round(rate) for kind, rate in rates.items()},
        "ppe_jobs_per_s": round(ppe),
        "calculator_kill_to_finished_elsewhere_s": round(median(kills), 3),
    }
    print(
        f"remote workers, no-op jobs through the UDP door: 2 calculators {rates['calculator']:,.0f}"
        f" jobs/s [target >= 2,000]; 2 pollers {rates['poller']:,.0f} jobs/s [target >= 800]; "
        f"2 local workers {rates['local']:,.0f} jobs/s; ProcessPoolExecutor(2) {ppe:,.0f} jobs/s",
        flush=True,
    )
    print(
        f"kill -9 of a busy calculator to its job finished elsewhere (calculator_timeout 1 s, "
        f"0.5 s job): median {median(kills):.2f} s of {len(kills)} [target: within 1 + 0.5 s "
        "to placed elsewhere]",
        flush=True,
    )
    return results


if __name__ == "__main__":
    main()

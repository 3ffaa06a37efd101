"""The Redis stream door: jobs submitted with `Client("redis://...")` and collected from Redis.

1. One controller, 2 local workers, no-op handler, the journal on: 10,000 jobs
   submitted by one thread (`client.submit`, an XADD each) while another collects
   each outcome (`job.result()`: the results stream, then `job:<id>`), beside the
   UDP door of the same controller (udp-client's engine, 64 in flight) in the same run.
2. The same in the tuned layout of the UDP door's figures: the controller alone on
   CPU 0 polling before it sleeps (`--cpus 0 --busy-poll 200`), its workers, the client
   and redis-server on CPU 1.
3. 1, 2 and 3 controllers, one local worker each, on one stream (this machine has
   2 CPUs, so this shows the door's overhead more than a second host's gain).
4. (`python -m bench.redis_bench links`) the door's busy-path links
   (controller/doors/redis/script_link.py) beside each other in one run: workload 1 with
   `LoopLink` (the reactor with hiredis) and with the controller forced to `ThreadLink`
   (redis-py in a thread), alternating, a fresh redis-server each: jobs/s and the
   controller's CPU per job, medians and each round.
"""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Any

import trio

from bench.common import cpu_while, median, socket_dir
from bench.e2e_bench import BUSY_POLL_US, CONTROLLER_CPUS, HANDLER, OTHER_CPUS, client_cpus, drive
from bench.http_bench import patched_controller
from controller.affinity import parse_cpus
from controller.client import Client, Job
from tests.helpers import REDIS_SERVER, live_controller, redis_server

JOBS = 10_000
WORKER = ["--", "--handler", HANDLER, "--log-level", "ERROR"]


def redis_rate(url: str, jobs: int) -> float:
    """Submit `jobs` in one thread while another collects each result; jobs per second."""
    done: queue.Queue[Job | None] = queue.Queue()
    failures: list[BaseException] = []

    def collect() -> None:
        try:
            while (job := done.get()) is not None:
                job.result(timeout=120)
        except BaseException as exc:  # reported below
            failures.append(exc)

    with Client(url) as client:
        collector = threading.Thread(target=collect)
        start = time.perf_counter()
        collector.start()
        for _ in range(jobs):
            done.put(client.submit(b""))
        done.put(None)
        collector.join()
        elapsed = time.perf_counter() - start
    if failures:
        raise failures[0]
    return jobs / elapsed


def _controllers(tmp: Path, url: str, count: int, workers: int) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    for n in range(count):
        directory = tmp / f"c{n}"
        directory.mkdir()
        args = ["--workers", str(workers), *WORKER]
        stack.enter_context(live_controller(directory, *args, redis={"url": url}))
    return stack


def main() -> dict[str, Any]:
    if REDIS_SERVER is None:
        print("Redis door: skipped, redis-server is not installed", flush=True)
        return {}
    results: dict[str, Any] = {}
    with socket_dir() as tmp, redis_server(tmp) as server:
        url = server.url
        with live_controller(tmp, "--workers", "2", *WORKER, redis={"url": url}) as ctl:
            redis_rate(url, 300)  # warm up
            trio.run(drive, ctl.udp_port, 300, 8, 50_000_000)
            rates = [redis_rate(url, JOBS) for _ in range(2)]
            udp_rate, _ = trio.run(drive, ctl.udp_port, JOBS, 64, 1)
        results["one_controller_2_workers"] = {
            "redis_jobs_per_s": round(max(rates)),
            "redis_runs": [round(r) for r in rates],
            "udp_door_jobs_per_s": round(udp_rate),
        }
        print(
            f"Redis door, 1 controller, 2 workers, no-op, journal on: {max(rates):,.0f} jobs/s "
            f"submitted with Client('redis://') and collected from Redis (runs: "
            f"{', '.join(f'{r:,.0f}' for r in rates)}) [target >= 2,500]; UDP door of the same "
            f"controller {udp_rate:,.0f} jobs/s",
            flush=True,
        )
    if len(os.sched_getaffinity(0)) >= 2:
        tuned = ["--cpus", CONTROLLER_CPUS, "--busy-poll", str(BUSY_POLL_US), "--workers", "2"]
        tuned += [*WORKER, "--cpus", OTHER_CPUS]
        with socket_dir() as tmp, redis_server(tmp) as server:
            assert server.proc is not None
            os.sched_setaffinity(server.proc.pid, parse_cpus(OTHER_CPUS))
            with live_controller(tmp, *tuned, redis={"url": server.url}), client_cpus(True):
                redis_rate(server.url, 300)
                rates = [redis_rate(server.url, JOBS) for _ in range(2)]
        results["tuned_layout_2_workers"] = {"redis_jobs_per_s": round(max(rates))}
        print(
            f"Redis door, the same, controller alone on CPU {CONTROLLER_CPUS} with --busy-poll "
            f"{BUSY_POLL_US}, workers, client and redis-server on CPU {OTHER_CPUS}: "
            f"{max(rates):,.0f} jobs/s (runs: {', '.join(f'{r:,.0f}' for r in rates)})",
            flush=True,
        )
    scaling = {}
    for count in (1, 2, 3):
        with (
            socket_dir() as tmp,
            redis_server(tmp) as server,
            _controllers(tmp, server.url, count, 1),
        ):
            redis_rate(server.url, 300)
            scaling[count] = round(redis_rate(server.url, JOBS // 2))
    results["controllers_1_worker_each"] = scaling
    print(
        "Redis door, N controllers with 1 worker each on one stream (2 CPUs in all): "
        + ", ".join(f"{n}: {rate:,} jobs/s" for n, rate in scaling.items()),
        flush=True,
    )
    return results


# The controller with every Redis URL's scripts on `ThreadLink` (patched before the door
# imports `link_for`).
_THREAD_LINK = patched_controller(
    "from controller.doors.redis import script_link as s; "
    "s.link_for = lambda url, reactor, timeout, fallback: s.ThreadLink(fallback, reactor)"
)


def links_comparison(jobs: int = JOBS, rounds: int = 3) -> dict[str, Any]:
    """Workload 1's jobs/s and the controller's CPU per job with `LoopLink` and with
    `ThreadLink`, alternating."""
    if REDIS_SERVER is None:
        print("Redis links: skipped, redis-server is not installed", flush=True)
        return {}
    figures: dict[str, list[tuple[float, float]]] = {"LoopLink": [], "ThreadLink": []}
    for _ in range(rounds):
        for label, launcher in (("LoopLink", ()), ("ThreadLink", _THREAD_LINK)):
            with (
                socket_dir() as tmp,
                redis_server(tmp) as server,
                live_controller(
                    tmp, "--workers", "2", *WORKER, launcher=launcher, redis={"url": server.url}
                ) as ctl,
            ):
                redis_rate(server.url, 300)  # warm up
                run = functools.partial(redis_rate, server.url, jobs)
                rate, cpu = cpu_while([ctl.proc.pid], jobs, run)
                figures[label].append((rate, cpu["controller_us"]))
    out = {}
    for label, runs in figures.items():
        rates = [rate for rate, _ in runs]
        cpus = [us for _, us in runs]
        print(
            f"Redis door, {label:<10} jobs/s median {median(rates):,.0f} "
            f"[{', '.join(f'{r:,.0f}' for r in rates)}]; controller CPU us/job median "
            f"{median(cpus):.0f} [{', '.join(f'{c:.0f}' for c in cpus)}]",
            flush=True,
        )
        out[label] = {"jobs_per_s": [round(r) for r in rates], "cpu_us": [round(c) for c in cpus]}
    return out


if __name__ == "__main__":
    if sys.argv[1:] == ["links"]:
        links_comparison()
    else:
        main()

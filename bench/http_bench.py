"""The HTTP door: jobs through the Python client beside the UDP door, and long-polls' cost.

1. 2 local workers, no-op handler: 10,000 jobs submitted and collected with
   `AsyncClient("http://...")` (64 in flight) and with the blocking
   `Client("http://...")` shared by 16 threads, beside the UDP door (udp-client's
   engine, 64 in flight) and ProcessPoolExecutor(2), in the same run.
2. One job at a time: POST then GET ?wait= (p50, p99), beside the UDP door.
3. Pulse latency on main.sock (a pulse exchange, p50/p99) with no long-poll open
   and with 1,000 `GET /job/{id}/?wait=60` open on jobs that stay pending.
4. (`python -m bench.http_bench keepalive`) controller/doors/http/keepalive.py's idle timer
   against hypercorn's own, beside each other in one run: the AsyncClient throughput and
   the controller's CPU per job, each controller measured twice, alternating.
"""

from __future__ import annotations

import concurrent.futures
import functools
import statistics
import sys
import time
from typing import Any

import trio

from bench.common import cpu_while, percentile, socket_dir
from bench.e2e_bench import HANDLER, drive, ppe_rate
from controller.client import AsyncClient, Client
from controller.client.http import AsyncHttpPool
from gen import worker_protocol_pb2 as pb
from tests.helpers import exchange, live_controller

JOBS = 10_000
WINDOW = 64
THREADS = 16


async def _async_throughput(url: str, jobs: int) -> float:
    async with AsyncClient(url) as client:
        numbers = iter(range(jobs))

        async def runner() -> None:
            for _ in numbers:
                job = await client.submit(b"")
                await job.result(timeout=60)

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(WINDOW):
                nursery.start_soon(runner)
        return jobs / (time.perf_counter() - start)


def _blocking_throughput(url: str, jobs: int) -> float:
    with Client(url) as client, concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
        start = time.perf_counter()
        list(pool.map(lambda _: client.submit(b"").result(timeout=60), range(jobs)))
        return jobs / (time.perf_counter() - start)


async def _one_at_a_time(url: str, jobs: int) -> list[float]:
    out = []
    http = _pool(url)
    for _ in range(jobs):
        start = time.perf_counter()
        job = (await http.request("POST", "/job/", json={})).json()
        if job["state"] != "finished":
            job = (await http.request("GET", f"/job/{job['id']}/", query={"wait": 60})).json()
        out.append(time.perf_counter() - start)
        assert job["state"] == "finished", job
    await http.aclose()
    return out


def _pool(url: str) -> AsyncHttpPool:
    return AsyncHttpPool(url, timeout=120)


async def _pulse_latency(sockdir: Any, pulses: int = 500) -> list[float]:
    msg = pb.WorkerPulse(type=pb.PULSE_OK, worker_id=999_999_999, next_pulse=2)
    out = []
    for _ in range(pulses):
        start = time.perf_counter()
        await exchange(sockdir / "s" / "main.sock", msg, pb.PulseResponse)
        out.append(time.perf_counter() - start)
        await trio.sleep(0.001)
    return out


async def _with_open_waits(url: str, sockdir: Any, waits: int) -> list[float]:
    http = _pool(url)
    try:
        ids = []
        for n in range(waits):
            body = {"id": f"held-{n}"}
            ids.append((await http.request("POST", "/job/", json=body)).json()["id"])
        opened = 0

        async def hold(job_id: str) -> None:
            nonlocal opened
            opened += 1
            await http.request("GET", f"/job/{job_id}/", query={"wait": 60})

        async with trio.open_nursery() as nursery:
            for job_id in ids:
                nursery.start_soon(hold, job_id)
            while opened < waits:
                await trio.sleep(0.01)
            await trio.sleep(0.5)  # let the requests reach the server and park
            samples = await _pulse_latency(sockdir)
            nursery.cancel_scope.cancel()
    finally:
        await http.aclose()
    return samples


def ms(values: list[float], q: float) -> float:
    return round(percentile(values, q) * 1000, 3)


def main() -> dict[str, Any]:
    results: dict[str, Any] = {}
    with (
        socket_dir() as tmp,
        live_controller(
            tmp, "--workers", "2", "--", "--handler", HANDLER, "--log-level", "ERROR", journal=None
        ) as ctl,
    ):
        trio.run(drive, ctl.udp_port, 300, 8, 50_000_000)  # warm up
        udp_rate, _ = trio.run(drive, ctl.udp_port, JOBS, WINDOW, 1)
        http_async = trio.run(_async_throughput, ctl.url, JOBS)
        http_blocking = _blocking_throughput(ctl.url, JOBS // 2)
        ppe = ppe_rate(2, JOBS)
        http_lat = trio.run(_one_at_a_time, ctl.url, 1000)
        _, udp_lat = trio.run(drive, ctl.udp_port, 1000, 1, 60_000_000)
    results["throughput"] = {
        "http_async_client_jobs_per_s": round(http_async),
        "http_blocking_client_16_threads_jobs_per_s": round(http_blocking),
        "udp_door_jobs_per_s": round(udp_rate),
        "ppe_jobs_per_s": round(ppe),
    }
    results["latency"] = {
        "http_p50_ms": ms(http_lat, 0.5),
        "http_p99_ms": ms(http_lat, 0.99),
        "udp_p50_ms": ms(udp_lat, 0.5),
        "udp_p99_ms": ms(udp_lat, 0.99),
    }
    print(
        f"HTTP door, 2 workers, no-op: AsyncClient {http_async:,.0f} jobs/s, blocking Client "
        f"(16 threads) {http_blocking:,.0f} jobs/s [target >= 1,000]; UDP door {udp_rate:,.0f}"
        f" jobs/s; ProcessPoolExecutor(2) {ppe:,.0f} jobs/s",
        flush=True,
    )
    print(
        f"HTTP one at a time (POST then GET ?wait=): p50 {ms(http_lat, 0.5)} ms, p99 "
        f"{ms(http_lat, 0.99)} ms [target p50 < 2 ms]; UDP door p50 {ms(udp_lat, 0.5)} ms",
        flush=True,
    )
    # No worker: the jobs wait. Room for the 1,000 long polls beside the pool's other
    # connections, all from this one address (max_connections and max_connections_per_client
    # would close the ones past their limits).
    with (
        socket_dir() as tmp,
        live_controller(
            tmp, journal=None, max_connections=1100, max_connections_per_client=1100
        ) as ctl,
    ):
        idle = trio.run(_pulse_latency, tmp)
        held = trio.run(_with_open_waits, ctl.url, tmp, 1000)
    results["pulse_latency"] = {
        "no_waits_p50_ms": ms(idle, 0.5),
        "no_waits_p99_ms": ms(idle, 0.99),
        "1000_waits_p50_ms": ms(held, 0.5),
        "1000_waits_p99_ms": ms(held, 0.99),
        "mean_ratio": round(statistics.mean(held) / statistics.mean(idle), 3),
    }
    print(
        f"pulse latency on main.sock: p50 {ms(idle, 0.5)} ms, p99 {ms(idle, 0.99)} ms with no "
        f"long-poll; p50 {ms(held, 0.5)} ms, p99 {ms(held, 0.99)} ms with 1,000 open ?wait=60",
        flush=True,
    )
    return results


def patched_controller(patch: str) -> tuple[str, ...]:
    """A `live_controller` launcher: runs the Python statements `patch`, then the controller
    (live_controller's launcher goes before its command line, which this strips: argv[4:]
    are the controller's)."""
    return (
        sys.executable,
        "-c",
        f"import sys; {patch}; from controller.main import main; sys.exit(main(sys.argv[4:]))",
    )


# The controller with hypercorn's own keep-alive timer.
_OWN_TIMER = patched_controller(
    "from controller.doors.http import keepalive; keepalive.usable = lambda: False"
)


def keepalive_comparison(jobs: int = JOBS, rounds: int = 2) -> dict[str, Any]:
    """AsyncClient jobs/s and the controller's CPU per job with keepalive.py's timer and with
    hypercorn's own, alternating."""
    figures: dict[str, list[tuple[float, float]]] = {"keepalive.py": [], "hypercorn's": []}
    for _ in range(rounds):
        for label, launcher in (("keepalive.py", ()), ("hypercorn's", _OWN_TIMER)):
            with (
                socket_dir() as tmp,
                live_controller(
                    tmp,
                    "--workers",
                    "2",
                    "--",
                    "--handler",
                    HANDLER,
                    "--log-level",
                    "ERROR",
                    launcher=launcher,
                    journal=None,
                    # hypercorn's own timer holds a closed connection's place until its
                    # keep-alive wait ends: the next client's 64 connections would pass
                    # max_connections_per_client (64) and be refused.
                    max_connections_per_client=1024,
                ) as ctl,
            ):
                trio.run(_async_throughput, ctl.url, 500)  # warm up
                run = functools.partial(trio.run, _async_throughput, ctl.url, jobs)
                rate, cpu = cpu_while([ctl.proc.pid], jobs, run)
                figures[label].append((rate, cpu["controller_us"]))
    out = {}
    for label, runs in figures.items():
        rates = ", ".join(f"{rate:,.0f}" for rate, _ in runs)
        cpus = ", ".join(f"{us:.0f}" for _, us in runs)
        print(f"idle timer {label:<13} AsyncClient jobs/s {rates}; controller CPU us/job {cpus}")
        out[label] = {
            "jobs_per_s": [round(r) for r, _ in runs],
            "cpu_us": [round(c) for _, c in runs],
        }
    return out


if __name__ == "__main__":
    if sys.argv[1:] == ["keepalive"]:
        keepalive_comparison()
    else:
        main()

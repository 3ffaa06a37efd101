"""Controller benchmarks: the controller alone against fake workers.

- pulses: COUNT simulated workers pulsing every second; the controller's CPU share.
- tasks: N tasks through W fake workers that answer at once; tasks/s and controller
  CPU microseconds per task (the controller runs in this process, the fakes in another).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from bench.common import process_cpu, rss_mb, self_cpu, socket_dir
from controller.config import Config
from controller.options import JobOptions
from controller.shell.core_shell import CoreShell
from tests.helpers import controller_argv, write_config


def start_fakes(sockdir: Path, *args: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "bench.fakeworkers", "--socket-dir", str(sockdir), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        raise RuntimeError("fake workers did not start")
    return proc


def bench_pulses(count: int = 5000, seconds: float = 10.0) -> dict[str, Any]:
    with socket_dir() as sockdir:
        config = write_config(
            sockdir,
            socket_dir=str(sockdir),
            journal=None,
            client_address={"host": "127.0.0.1", "port": 0},
        )
        ctl = subprocess.Popen(
            controller_argv(config, log_level="ERROR"),
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 10
            while not (sockdir / "main.sock").exists():
                if time.monotonic() > deadline:
                    raise RuntimeError("controller did not start")
                time.sleep(0.05)
            fakes = start_fakes(sockdir, "--mode", "pulse", "--count", str(count), "--period", "1")
            try:
                time.sleep(2.0)  # every worker has started pulsing
                cpu0, t0 = process_cpu(ctl.pid), time.monotonic()
                time.sleep(seconds)
                cpu1, t1 = process_cpu(ctl.pid), time.monotonic()
                fake_cpu = process_cpu(fakes.pid)
                memory = rss_mb(ctl.pid)
            finally:
                fakes.kill()
                fakes.wait()
        finally:
            ctl.terminate()
            ctl.wait()
    share = (cpu1 - cpu0) / (t1 - t0)
    return {
        "workers": count,
        "pulses_per_s": count,
        "controller_cpu_share": round(share, 3),
        "controller_us_per_pulse": round(1e6 * share / count, 1),
        "controller_rss_mb": round(memory, 1),
        "load_generator_cpu_s": round(fake_cpu, 1),
    }


async def _run_tasks(
    sockdir: Path,
    tasks: int,
    workers: int,
    options: Callable[[int], JobOptions | None] = lambda n: None,
    serves: tuple[frozenset[str], frozenset[str]] | None = None,
) -> dict[str, Any]:
    """Queue `tasks` at once (no await in between) for W fake workers that answer at once;
    tasks/s, controller CPU per task, and the controller's memory with all of them queued.
    `options(n)`: the n-th task's options; `serves`: the queues and labels every fake worker
    registers with (default: the default queue, no labels)."""
    done = 0
    finished = trio.Event()

    def on_finished(_: object) -> None:
        nonlocal done
        done += 1
        if done == tasks:
            finished.set()

    shell = CoreShell(Config(socket_dir=sockdir, journal=None))
    shell.connect(finished=on_finished)
    base = rss_mb(os.getpid())
    async with trio.open_nursery() as nursery:
        await nursery.start(shell.serve)
        declared = [
            f"--{flag}={name}"
            for flag, names in zip(("queue", "label"), serves or ((), ()), strict=True)
            for name in sorted(names)
        ]
        fakes = await trio.to_thread.run_sync(
            lambda: start_fakes(sockdir, "--mode", "answer", "--count", str(workers), *declared)
        )
        try:
            while shell.core.idle_workers < workers:
                await trio.sleep(0.01)
            made = [options(i) for i in range(tasks)]  # a door makes them as jobs arrive
            cpu0, t0 = self_cpu(), time.perf_counter()
            for i in range(tasks):
                shell.submit(i % 1_000_000 + 1, b"payload-%d" % i, None, made[i])
            submit_us = 1e6 * (time.perf_counter() - t0) / tasks
            peak = rss_mb(os.getpid())
            await finished.wait()
            cpu1, t1 = self_cpu(), time.perf_counter()
        finally:
            fakes.kill()
            fakes.wait()
        nursery.cancel_scope.cancel()
    return {
        "tasks": tasks,
        "fake_workers": workers,
        "tasks_per_s": round(tasks / (t1 - t0)),
        "controller_cpu_us_per_task": round(1e6 * (cpu1 - cpu0) / tasks, 1),
        "submit_us_per_task": round(submit_us, 1),
        "rss_mb": round(peak, 1),
        "rss_growth_mb": round(peak - base, 1),
    }


def bench_queued(
    sizes: tuple[int, ...] = (1_000, 10_000, 100_000), workers: int = 100
) -> list[dict[str, Any]]:
    rows = []
    for size in sizes:
        with socket_dir() as sockdir:
            rows.append(trio.run(_run_tasks, sockdir, size, workers))
        r = rows[-1]
        print(
            f"  {size:,} queued at once: {r['submit_us_per_task']} us to queue each, drained at "
            f"{r['tasks_per_s']:,} tasks/s, controller RSS {r['rss_mb']} MB (+{r['rss_growth_mb']})",
            flush=True,
        )
    return rows


def bench_tasks(tasks: int = 20_000, workers: int = 100) -> dict[str, Any]:
    with socket_dir() as sockdir:
        return trio.run(_run_tasks, sockdir, tasks, workers)


def main() -> dict[str, Any]:
    results = {"pulses": bench_pulses(), "tasks": bench_tasks()}
    p, t = results["pulses"], results["tasks"]
    print(
        f"controller, {p['workers']} workers pulsing every second: "
        f"{p['controller_cpu_share'] * 100:.1f}% of a core ({p['controller_us_per_pulse']} us/pulse), "
        f"RSS {p['controller_rss_mb']} MB  [target: under 50%]"
    )
    print(
        f"controller, {t['tasks']} tasks through {t['fake_workers']} fake workers: "
        f"{t['tasks_per_s']:,} tasks/s, {t['controller_cpu_us_per_task']} us CPU per task  "
        f"[target: at least 5,000 tasks/s]"
    )
    return results


if __name__ == "__main__":
    main()

"""The job-length section of `make bench-peers` (alone: `python -m bench.peers --lengths`).

Jobs of 1 ms and 10 ms, of two kinds: `sleep`, and `busy` (a CPU loop until the time is used).
Ours: `controller --workers 2`, default layout, journal on, through the UDP door with the
project's client (64 in flight), as `--handler bench.work:run` and as
`--exec /bin/sh bench/work.sh`. Gearman: its command worker (`gearman -w -f work_cmd --
/bin/sh bench/work.sh`, twice), the closest peer to `--exec`, and 2 python3-gearman workers
running the handler's function. Huey, Celery, Dramatiq and RQ: a task calling that function,
with the workers of the no-op section. Beside them, with no dispatcher of their own:
ProcessPoolExecutor(2) running the function, and 2 threads running bench/work.sh back to
back (`subprocess.run`), which is what the script's own start costs.

Efficiency is jobs/s divided by what the 2 workers could do with no dispatcher at all,
2 / length. bench/work.sh's busy loop is timed before each system that runs the script, so
that the loop alone lasts the job's length; the script's start (a /bin/sh, and for `sleep`
the sleep command it becomes) comes on top, and is printed. Each row is the median of
`ROUNDS` rounds.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import json
import math
import os
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from bench import work
from bench.common import children_of, cpu_while, importable_bench
from bench.e2e_bench import drive
from bench.peers_workers import VENV, process_group, worker_commands
from bench.remote_bench import controller_with

HERE = Path(__file__).parent
SCRIPT = HERE / "work.sh"
SCRIPT_ARGV = ["/bin/sh", str(SCRIPT)]
HANDLER = "bench.work:run"
WORKERS = 2
LENGTHS = (0.001, 0.01)
WINDOW = 64
ROUNDS = 3  # each row is the median of 3 rounds of a third of its jobs
RQ_JOBS = 100  # a fork per job: tens of jobs a second
PROBE = 20_000  # iterations of the busy loop timed at start
LABELS = {
    "ours-handler": "ours: --handler",
    "ours-exec": "ours: --exec work.sh",
    "gearman-cmd": "Gearman: gearman -w work.sh",
    "gearman": "Gearman: python3-gearman",
    "huey": "Huey",
    "celery": "Celery",
    "dramatiq": "Dramatiq",
    "rq": "RQ (100 jobs)",
    "ppe": "ProcessPoolExecutor(2)",
    "bare-script": "work.sh, 2 threads, no dispatcher",
}


def jobs_for(length: float, work_seconds: float) -> int:
    """Jobs that keep the 2 workers busy for `work_seconds` with no dispatcher."""
    return math.ceil(work_seconds * WORKERS / length)


def _ms(length: float) -> str:
    return f"{length * 1000:g} ms"


def script_time(
    line: str, runs: int, pick: Callable[[list[float]], float] = statistics.median
) -> float:
    """Wall time of bench/work.sh run alone with `line` on stdin: the median of `runs` (or
    what `pick` takes of them)."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(SCRIPT_ARGV, input=line.encode(), check=True)
        times.append(time.perf_counter() - start)
    return pick(times)


def calibrate(lengths: tuple[float, ...]) -> dict[str, Any]:
    """The busy loop's iterations for each length (the loop's speed: the fastest of a few runs,
    those the machine's other work did not slow), and what the script costs alone (medians)."""
    start_busy = script_time("busy 0", 30)
    start_sleep = script_time("sleep 0", 30)
    loop = script_time(f"busy {PROBE}", 10, min) - script_time("busy 0", 30, min)
    iterations = {_ms(length): work.loop_iterations(length, 0.0, PROBE, loop) for length in lengths}
    alone = {}
    for length in lengths:
        alone[f"sleep {_ms(length)}"] = script_time(f"sleep {length}", 10)
        alone[f"busy {_ms(length)}"] = script_time(f"busy {iterations[_ms(length)]}", 10)
    return {
        "start_ms": {
            "busy (sh alone)": round(start_busy * 1000, 3),
            "sleep (sh, then sleep)": round(start_sleep * 1000, 3),
        },
        "busy_iterations": iterations,
        "alone_ms": {name: round(t * 1000, 3) for name, t in alone.items()},
    }


def script_line(kind: str, length: float, script: dict[str, Any]) -> str:
    """bench/work.sh's stdin for a job of `kind` and `length`."""
    if kind == "sleep":
        return f"sleep {length}"
    return f"busy {script['busy_iterations'][_ms(length)]}"


def median_rate(measure: Callable[[int], float], jobs: int, rounds: int = ROUNDS) -> float:
    """The median of `rounds` calls of `measure(jobs // rounds)` (each a jobs/s)."""
    return statistics.median(measure(max(1, jobs // rounds)) for _ in range(rounds))


def bare_script_rate(line: str, jobs: int) -> float:
    """2 threads running bench/work.sh back to back, `jobs` in all: jobs/s."""

    def run(count: int) -> None:
        for _ in range(count):
            subprocess.run(SCRIPT_ARGV, input=line.encode(), check=True)

    each = max(1, jobs // WORKERS)
    threads = [threading.Thread(target=run, args=(each,)) for _ in range(WORKERS)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return each * WORKERS / (time.perf_counter() - start)


def ppe_rate(kind: str, length: float, jobs: int) -> float:
    """ProcessPoolExecutor(2) running bench/work.py's `do`, one future per job: jobs/s, the
    median of `ROUNDS` rounds."""
    with concurrent.futures.ProcessPoolExecutor(WORKERS) as pool:
        list(pool.map(work.do, ["sleep"] * 20, [0.0] * 20))  # warm up the pool

        def measure(count: int) -> float:
            start = time.perf_counter()
            futures = [pool.submit(work.do, kind, length) for _ in range(count)]
            for future in futures:
                future.result()
            return count / (time.perf_counter() - start)

        return median_rate(measure, jobs)


def measure_ours(
    worker_args: tuple[str, ...], cases: list[tuple[str, str, int]]
) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """Jobs/s of each (label, payload, jobs) in `cases`, through the UDP door of one controller
    with 2 local workers running `worker_args`; journal on. Each the median of `ROUNDS`
    rounds. Beside them, by label, the CPU microseconds per job of the controller, of the 2
    workers together (their commands not counted) and of the client, over those rounds."""
    rates: dict[str, float] = {}
    cpu: dict[str, dict[str, float]] = {}
    with importable_bench(), controller_with("local", worker_args) as ctl:
        next_id = 1

        def measure(payload: str, count: int, window: int = WINDOW) -> float:
            nonlocal next_id
            first, next_id = next_id, next_id + count
            return trio.run(drive, ctl.udp_port, count, window, first, payload)[0]

        pids = [ctl.proc.pid, *children_of(ctl.proc.pid)]
        for label, payload, jobs in cases:
            measure(payload, 20, 8)  # warm up
            ran = ROUNDS * max(1, jobs // ROUNDS)
            rates[label], used = cpu_while(
                pids, ran, functools.partial(median_rate, functools.partial(measure, payload), jobs)
            )
            cpu[label] = {name: round(us, 1) for name, us in used.items()}
    return rates, cpu


def measure_peer(
    system: str, cases: list[tuple[str, str, int]], env: dict[str, str], logs: Path
) -> dict[str, float]:
    """Jobs/s of each (label, payload, jobs) in `cases` on the peer's own 2 workers."""
    if system == "gearman-cmd":
        port = env["PEERS_GEARMAN_PORT"]
        argv = ["gearman", "-w", "-h", "127.0.0.1", "-p", port, "-f", "work_cmd", "--"]
        commands = [[*argv, *SCRIPT_ARGV] for _ in range(WORKERS)]
    else:
        commands = worker_commands(system, env["PEERS_REDIS"])
    with contextlib.ExitStack() as stack:
        for n, argv in enumerate(commands):
            stack.enter_context(process_group(argv, env, logs / f"{system}-len-worker{n}.log"))
        driver = [
            str(VENV / "bin" / "python"),
            "peers_tasks.py",
            "lengths",
            system,
            str(ROUNDS),
            json.dumps(cases),
        ]
        done = subprocess.run(
            driver, cwd=HERE, env=env, capture_output=True, text=True, timeout=900
        )
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip()[-500:])
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def run(
    systems: tuple[str, ...],
    env: dict[str, str],
    logs: Path,
    lengths: tuple[float, ...] = LENGTHS,
    work_seconds: float = 3.0,
) -> dict[str, Any]:
    """Every row, for each length and kind; the section of bench/peers.json."""
    load_before = os.getloadavg()
    grid = [(kind, length) for length in lengths for kind in work.KINDS]
    scripts: dict[str, dict[str, Any]] = {}

    def cases(system: str) -> list[tuple[str, str, int]]:
        """Each row's (label, payload, jobs); for a system running bench/work.sh, its busy
        loop is counted again just before (the machine's speed drifts under load)."""
        by_script = system in ("ours-exec", "gearman-cmd", "bare-script")
        if by_script and system not in scripts:
            scripts[system] = calibrate(lengths)
            print(f"  bench/work.sh alone: {json.dumps(scripts[system])}", flush=True)
        out = []
        for kind, length in grid:
            payload = (
                script_line(kind, length, scripts[system]) if by_script else f"{kind} {length}"
            )
            jobs = jobs_for(length, work_seconds)
            out.append(
                (f"{kind} {_ms(length)}", payload, min(jobs, RQ_JOBS) if system == "rq" else jobs)
            )
        return out

    rates: dict[str, dict[str, float]] = {}
    cpu: dict[str, dict[str, dict[str, float]]] = {}
    failed: dict[str, str] = {}
    for system, worker_args in (
        ("ours-handler", ("--handler", HANDLER)),
        ("ours-exec", ("--exec", *SCRIPT_ARGV)),
    ):
        print(f"measuring {LABELS[system]} ...", flush=True)
        rates[system], cpu[system] = measure_ours(worker_args, cases(system))
    peers = [
        s
        for s in ("gearman-cmd", "gearman", "huey", "celery", "dramatiq", "rq")
        if s.split("-")[0] in systems
    ]
    for system in peers:
        print(f"measuring {LABELS[system]} ...", flush=True)
        try:
            rates[system] = measure_peer(system, cases(system), env, logs)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            print(f"  {system}: failed: {str(exc).splitlines()[-1:]}", flush=True)
            failed[system] = str(exc)[-500:]
    print("measuring the baselines ...", flush=True)
    rates["ppe"] = {
        label: ppe_rate(kind, length, jobs_for(length, work_seconds))
        for (kind, length), (label, _, _) in zip(grid, cases("ppe"), strict=True)
    }
    rates["bare-script"] = {
        label: median_rate(functools.partial(bare_script_rate, payload), jobs)
        for label, payload, jobs in cases("bare-script")
    }
    rows = []
    for system, by_case in rates.items():
        for (kind, length), (label, _, jobs) in zip(grid, cases(system), strict=True):
            rate = by_case[label]
            rows.append(
                {
                    "system": LABELS[system],
                    "kind": kind,
                    "length_ms": length * 1000,
                    "jobs": jobs,
                    "jobs_per_s": round(rate, 1),
                    "efficiency": round(work.efficiency(rate, WORKERS, length), 3),
                }
            )
    return {
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "workers": WORKERS,
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "rounds": ROUNDS,
        "script": scripts,
        "rows": rows,
        "ours_cpu_us": {LABELS[system]: by_case for system, by_case in cpu.items()},
        "failed": failed,
    }


def print_tables(section: dict[str, Any]) -> None:
    rows = section["rows"]
    for length_ms in sorted({r["length_ms"] for r in rows}):
        ideal = WORKERS / (length_ms / 1000)
        print(
            f"\njobs of {length_ms:g} ms, {WORKERS} workers: efficiency = jobs/s / "
            f"({WORKERS} / {length_ms:g} ms) = jobs/s / {ideal:,.0f}"
        )
        print(f"{'system':<36} {'sleep jobs/s':>12} {'eff':>6} {'busy jobs/s':>12} {'eff':>6}")
        systems = dict.fromkeys(r["system"] for r in rows if r["length_ms"] == length_ms)
        for system in systems:
            cells = []
            for kind in work.KINDS:
                row = next(
                    r
                    for r in rows
                    if r["system"] == system and r["kind"] == kind and r["length_ms"] == length_ms
                )
                cells.append(f"{row['jobs_per_s']:>12,.0f} {row['efficiency']:>6.2f}")
            print(f"{system:<36} {' '.join(cells)}")
    print()
    for system, script in section["script"].items():
        start = script["start_ms"]
        print(
            f"bench/work.sh alone, before {LABELS[system]}: start {start['busy (sh alone)']} ms, "
            f"{start['sleep (sh, then sleep)']} ms with sleep; busy loop "
            + ", ".join(f"{n} iterations for {k}" for k, n in script["busy_iterations"].items())
            + "; whole runs "
            + ", ".join(f"{k} {v} ms" for k, v in script["alone_ms"].items())
        )
    for system, by_case in section.get("ours_cpu_us", {}).items():
        print(
            f"{system}, CPU per job (controller / 2 workers, with a handler's own work but "
            f"not a command's / client): "
            + "; ".join(
                f"{label} {c['controller_us']:,.0f} / {c['workers_us']:,.0f} / {c['client_us']:,.0f} us"
                for label, c in by_case.items()
            )
        )
    print(f"load average before {section['load_before']}, after {section['load_after']}")
    for system, error in section["failed"].items():
        print(f"{system}: failed: {error[-200:]}")

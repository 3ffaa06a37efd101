"""End-to-end no-op tasks: udp client -> front door -> controller -> N real workers and back.

Printed beside concurrent.futures.ProcessPoolExecutor(N) running the same no-op,
one future per task, measured in the same run (the machine is shared: medians).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import os
import socket as stdsocket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import trio

from bench.common import median, percentile, socket_dir
from bench.floor import client as floor_client
from bench.worker_bench import EXEC_TARGET
from controller.affinity import parse_cpus
from controller.client import Outcome, UdpSession
from tests.helpers import controller_argv, free_udp_port, write_config

HANDLER = "worker.runner:anoop"


def noop(payload: bytes) -> bytes:
    return b""


def ppe_rate(workers: int, tasks: int) -> float:
    with concurrent.futures.ProcessPoolExecutor(workers) as pool:
        list(pool.map(noop, [b""] * 200))  # warm up the pool
        start = time.perf_counter()
        futures = [pool.submit(noop, b"") for _ in range(tasks)]
        for future in futures:
            future.result()
        return tasks / (time.perf_counter() - start)


# The tuned layout on a 2-CPU machine: the controller alone on CPU 0; the workers and
# the client on CPU 1 (controller --cpus 0 --workers 2 -- --cpus 1), and with it polling
# for 200 us before it sleeps (--busy-poll 200).
CONTROLLER_CPUS = "0"
OTHER_CPUS = "1"
BUSY_POLL_US = 200
# The targets, as ratios to ProcessPoolExecutor(2) in the same run, and the default
# layout's one-at-a-time p50.
TARGETS = {"default": " [target >= 45%]", "pinned_busy_poll": " [target >= 55%]"}
P50_TARGET_MS = 0.27
LAYOUTS = {
    "default": (False, False),
    "pinned": (True, False),
    "pinned_busy_poll": (True, True),
}


def start_controller(
    sockdir: Path,
    port: int,
    workers: int,
    extra: dict[str, Any],
    pinned: bool = False,
    busy_poll: bool = False,
    worker_args: tuple[str, ...] = ("--handler", HANDLER),
) -> subprocess.Popen[bytes]:
    settings: dict[str, Any] = {"journal": None, **extra}
    config = write_config(
        sockdir,
        socket_dir=str(sockdir / "s"),
        client_address={"host": "127.0.0.1", "port": port},
        **settings,
    )
    cmd = controller_argv(
        config,
        "--workers",
        str(workers),
        *(["--cpus", CONTROLLER_CPUS] if pinned else []),
        *(["--busy-poll", str(BUSY_POLL_US)] if busy_poll else []),
        "--",
        "--log-level",
        "ERROR",
        *(["--cpus", OTHER_CPUS] if pinned else []),
        *worker_args,
        log_level="ERROR",
    )
    return subprocess.Popen(cmd, stderr=subprocess.DEVNULL)


async def drive(
    port: int, tasks: int, window: int, first_id: int, payload: str = ""
) -> tuple[float, list[float]]:
    """`tasks` jobs through the UDP door, `window` in flight, each with `payload` (if any):
    jobs/s and each job's latency."""
    sock = stdsocket.socket(stdsocket.AF_INET, stdsocket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    client = UdpSession(sock, ("127.0.0.1", port), timeout=60)
    latencies: list[float] = []

    def done(outcome: Outcome) -> None:
        assert outcome.status == "success", outcome
        latencies.append(outcome.latency)

    with sock:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.receive)
            start = time.perf_counter()
            fields = {"payload": payload} if payload else {}
            await client.run_many(range(first_id, first_id + tasks), fields, window, done)
            elapsed = time.perf_counter() - start
            nursery.cancel_scope.cancel()
    return tasks / elapsed, latencies


@contextlib.contextmanager
def client_cpus(pinned: bool) -> Iterator[None]:
    """Run this process (the client) beside the workers while measuring a pinned layout."""
    if not pinned:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, parse_cpus(OTHER_CPUS))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)  # ProcessPoolExecutor gets every CPU


def run(
    workers: int = 2,
    tasks: int = 5000,
    rounds: int = 3,
    extra: dict[str, Any] | None = None,
    layout: str = "default",
) -> dict[str, Any]:
    pinned, busy_poll = LAYOUTS[layout]
    port = free_udp_port()
    with socket_dir() as sockdir:
        proc = start_controller(sockdir, port, workers, extra or {}, pinned, busy_poll)
        try:
            with client_cpus(pinned):
                trio.run(drive, port, 200, 8, 10_000_000)  # warm up; waits for the workers
            rates, ppe = [], []
            for r in range(rounds):
                with client_cpus(pinned):
                    rate, _ = trio.run(drive, port, tasks, 64, 1 + r * tasks)
                rates.append(rate)
                ppe.append(ppe_rate(workers, tasks))
            with client_cpus(pinned):  # one at a time: round trip
                _, lat = trio.run(drive, port, 1000, 1, 20_000_000)
                # The same with a plain blocking socket loop (bench/floor.py's client), to show
                # how much of the round trip is the client engine's trio loop.
                _, plain = floor_client(port, 30_000_000, 1000, 1)
        finally:
            proc.terminate()
            proc.wait()
    return {
        "layout": describe(layout),
        "workers": workers,
        "tasks_per_s": round(median(rates)),
        "ppe_tasks_per_s": round(median(ppe)),
        "ratio_to_ppe": round(median(rates) / median(ppe), 3),
        "p50_ms": round(percentile(lat, 0.5) * 1000, 3),
        "p99_ms": round(percentile(lat, 0.99) * 1000, 3),
        "plain_client_p50_ms": round(percentile(plain, 0.5) * 1000, 3),
    }


def scaling(
    counts: tuple[int, ...] = (1, 2, 4, 8), tasks: int = 3000, rounds: int = 2
) -> list[dict[str, Any]]:
    """Throughput against worker count, each beside ProcessPoolExecutor(N) in the same run."""
    rows = []
    for n in counts:
        port = free_udp_port()
        with socket_dir() as sockdir:
            proc = start_controller(sockdir, port, n, {})
            try:
                trio.run(drive, port, 200, 8, 10_000_000)
                rates, ppe = [], []
                for r in range(rounds):
                    rates.append(trio.run(drive, port, tasks, 64, 1 + r * tasks)[0])
                    ppe.append(ppe_rate(n, tasks))
            finally:
                proc.terminate()
                proc.wait()
        rows.append(
            {
                "workers": n,
                "tasks_per_s": round(median(rates)),
                "ppe_tasks_per_s": round(median(ppe)),
                "ratio_to_ppe": round(median(rates) / median(ppe), 3),
            }
        )
        print(
            f"  N={n}: {rows[-1]['tasks_per_s']:,} tasks/s vs ProcessPoolExecutor({n}) "
            f"{rows[-1]['ppe_tasks_per_s']:,} ({rows[-1]['ratio_to_ppe']:.0%})",
            flush=True,
        )
    return rows


# Jobs in flight for the window curve, and what one local worker runs in it.
WINDOWS = (1, 4, 16, 64)
CURVE_WORKERS = {
    "--exec /usr/bin/true": ("--exec", "/usr/bin/true"),
    "no-op --handler": ("--handler", HANDLER),
}


def bare_true(count: int) -> float:
    start = time.perf_counter()
    for _ in range(count):
        subprocess.run(["/usr/bin/true"], check=True)
    return count / (time.perf_counter() - start)


def window_curve(tasks: int = 1000, rounds: int = 2) -> dict[str, Any]:
    """Jobs/s through one local worker as the client keeps 1, 4, 16 and 64 jobs in flight
    (journal off), for `--exec /usr/bin/true` and a no-op handler, beside a bare
    subprocess.run(["/usr/bin/true"]) loop in the same run; and one at a time p50."""
    rows: dict[str, Any] = {}
    bare: list[float] = []
    for name, args in CURVE_WORKERS.items():
        rates: dict[int, list[float]] = {window: [] for window in WINDOWS}
        port = free_udp_port()
        with socket_dir() as sockdir:
            proc = start_controller(sockdir, port, 1, {}, worker_args=args)
            try:
                trio.run(drive, port, 50, 4, 10_000_000)  # warm up; waits for the worker
                first = 1
                for r in range(rounds):
                    for window in WINDOWS if r % 2 == 0 else WINDOWS[::-1]:
                        rates[window].append(trio.run(drive, port, tasks, window, first)[0])
                        first += tasks
                    bare.append(bare_true(tasks // 2))
                _, lat = trio.run(drive, port, tasks // 2, 1, 20_000_000)
            finally:
                proc.terminate()
                proc.wait()
        rows[name] = {
            "tasks_per_s": {window: round(median(rates[window])) for window in WINDOWS},
            "p50_ms": round(percentile(lat, 0.5) * 1000, 3),
        }
    rows["bare_true_per_s"] = round(median(bare))
    return rows


def exec_two_workers(tasks: int = 1000, rounds: int = 2) -> dict[str, Any]:
    """`controller --workers 2 -- --exec /usr/bin/true` with 4 jobs in flight, beside a bare
    subprocess.run(["/usr/bin/true"]) loop, alternating."""
    rates, bare = [], []
    port = free_udp_port()
    with socket_dir() as sockdir:
        proc = start_controller(
            sockdir, port, 2, {}, worker_args=CURVE_WORKERS["--exec /usr/bin/true"]
        )
        try:
            trio.run(drive, port, 50, 4, 10_000_000)  # warm up; waits for the workers
            for r in range(rounds):
                rates.append(trio.run(drive, port, tasks, 4, 1 + r * tasks)[0])
                bare.append(bare_true(tasks // 2))
        finally:
            proc.terminate()
            proc.wait()
    return {"tasks_per_s": round(median(rates)), "bare_true_per_s": round(median(bare))}


def window_main() -> dict[str, Any]:
    curve = window_curve()
    bare = curve["bare_true_per_s"]
    for name in CURVE_WORKERS:
        row = curve[name]
        rates = row["tasks_per_s"]
        figures = ", ".join(f"{rates[w]:,} with {w}" for w in WINDOWS)
        rising = all(rates[a] <= rates[b] for a, b in itertools.pairwise(WINDOWS))
        print(
            f"one local worker, {name}, jobs/s against jobs in flight: {figures} "
            f"[target: never falls: {'met' if rising else 'NOT met'}]; one at a time p50 "
            f"{row['p50_ms']} ms"
        )
    exec4 = curve["--exec /usr/bin/true"]["tasks_per_s"][4]
    print(
        f"  --exec /usr/bin/true end to end with 4 in flight: {exec4:,} jobs/s beside bare "
        f"subprocess.run(['/usr/bin/true']) {bare:,}/s: ratio {exec4 / bare:.2f}x "
        f"[target >= {EXEC_TARGET}x]",
        flush=True,
    )
    two = curve["two_workers"] = exec_two_workers()
    print(
        f"  the same with controller --workers 2: {two['tasks_per_s']:,} jobs/s beside bare "
        f"{two['bare_true_per_s']:,}/s: ratio {two['tasks_per_s'] / two['bare_true_per_s']:.2f}x "
        f"[target >= {EXEC_TARGET}x]",
        flush=True,
    )
    return curve


def latency_samples(tasks: int = 2000) -> list[float]:
    """Round trips of one task at a time through 2 workers, for the histogram."""
    port = free_udp_port()
    with socket_dir() as sockdir:
        proc = start_controller(sockdir, port, 2, {})
        try:
            trio.run(drive, port, 200, 8, 10_000_000)
            _, lat = trio.run(drive, port, tasks, 1, 1)
        finally:
            proc.terminate()
            proc.wait()
    return lat


def journal_on_off(rounds: int = 3, tasks: int = 5000) -> dict[str, Any]:
    """Throughput with the journal off, on with journal_sync "full" and on with "normal",
    alternating, in the same run."""
    runs: dict[str, list[float]] = {"off": [], "full": [], "normal": []}
    with socket_dir() as tmp:
        for r in range(rounds):
            for kind, into in runs.items():
                port = free_udp_port()
                settings: dict[str, Any] = {"journal": None}
                if kind != "off":
                    path = str(tmp / f"journal-{kind}-{r}.sqlite3")
                    settings = {"journal": path, "journal_sync": kind}
                with socket_dir() as sockdir:
                    proc = start_controller(sockdir, port, 2, settings)
                    try:
                        trio.run(drive, port, 200, 8, 10_000_000)
                        rate, _ = trio.run(drive, port, tasks, 64, 1)
                        into.append(rate)
                    finally:
                        proc.terminate()
                        proc.wait()
    off, on, normal = (median(runs[kind]) for kind in ("off", "full", "normal"))
    return {
        "journal_off_tasks_per_s": round(off),
        "journal_on_tasks_per_s": round(on),
        "journal_cost": round(1 - on / off, 3),
        "journal_normal_tasks_per_s": round(normal),
        "journal_normal_cost": round(1 - normal / off, 3),
    }


def journal_size(tasks: int = 100_000, retention: float = 5.0) -> dict[str, Any]:
    """File size of the journal after many tasks, with records forgotten after `retention` s."""
    port = free_udp_port()
    with socket_dir() as sockdir:
        path = sockdir / "journal.sqlite3"
        proc = start_controller(
            sockdir, port, 2, {"journal": str(path), "result_retention": retention}
        )
        try:
            trio.run(drive, port, 200, 8, 10_000_000)
            start = time.perf_counter()
            rate, _ = trio.run(drive, port, tasks, 64, 1)
            elapsed = time.perf_counter() - start
            files = [path, path.with_name(path.name + "-wal")]
            size = sum(f.stat().st_size for f in files if f.exists())
        finally:
            proc.terminate()
            proc.wait()
    return {
        "tasks": tasks,
        "retention_s": retention,
        "journal_mb": round(size / 2**20, 2),
        "tasks_per_s": round(rate),
        "elapsed_s": round(elapsed, 1),
    }


def describe(layout: str) -> str:
    pinned, busy_poll = LAYOUTS[layout]
    if not pinned:
        return "default scheduling"
    where = f"controller on CPU {CONTROLLER_CPUS}, workers and client on CPU {OTHER_CPUS}"
    return where + (f", --busy-poll {BUSY_POLL_US}" if busy_poll else "")


def main() -> dict[str, Any]:
    results: dict[str, Any] = {}
    layouts = list(LAYOUTS) if len(os.sched_getaffinity(0)) >= 2 else ["default"]
    for layout in layouts:
        r = run(layout=layout)
        target = TARGETS.get(layout, "")
        results[layout] = r
        print(
            f"end to end, {r['workers']} workers (no-op --handler), {r['layout']}: "
            f"{r['tasks_per_s']:,} tasks/s; ProcessPoolExecutor({r['workers']}): "
            f"{r['ppe_tasks_per_s']:,} tasks/s; ratio {r['ratio_to_ppe']:.1%}{target}; "
            f"one at a time p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms"
            f"{f' [target p50 <= {P50_TARGET_MS} ms]' if layout == 'default' else ''} "
            "(udp-client's engine; "
            f"{r['plain_client_p50_ms']} ms with a plain blocking client)",
            flush=True,
        )
    return results


def journal_main() -> dict[str, Any]:
    j = journal_on_off()
    print(
        f"journal: {j['journal_on_tasks_per_s']:,} tasks/s on (journal_sync full) vs "
        f"{j['journal_off_tasks_per_s']:,} off (cost {j['journal_cost']:.1%}) [target: at most 10%]; "
        f"journal_sync normal {j['journal_normal_tasks_per_s']:,} tasks/s "
        f"(cost {j['journal_normal_cost']:.1%})"
    )
    size = journal_size()
    print(
        f"journal after {size['tasks']:,} tasks with result_retention {size['retention_s']:g} s: "
        f"{size['journal_mb']} MB (database + WAL) at {size['tasks_per_s']:,} tasks/s"
    )
    return {**j, "size": size}


if __name__ == "__main__":
    main()

"""What the pending order costs per job, with 10,000 jobs pending: one queue and one owner
(the baseline) against the same jobs over 100 owners and 10 queues (each owner in one queue,
and every owner in every queue), and with priorities and labels too.

- The scheduler alone (no sockets): placing the jobs on 8 workers that finish each at once,
  microseconds per job.
- The controller: the jobs queued at once in a real controller (journal off) and drained by
  100 fake workers over the Unix-socket protocol (bench/fakeworkers.py), the controller's
  CPU per job.

Each layout is measured several times, alternating, and the median kept. `python -m
bench.placement_bench` prints it alone.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

import trio

from bench.common import socket_dir
from bench.controller_bench import _run_tasks
from controller.core.model import Action, Task, Worker, WorkerEvent
from controller.core.scheduler import Scheduler
from controller.options import JobOptions

JOBS = 10_000
WORKERS = 8
ROUNDS = 7


class _Instant:
    """A worker kind whose workers take every job at once (the scheduler's side only)."""

    label = "bench"

    def place(self, worker: Worker, task: Task, actions: list[Action]) -> None:
        pass

    def take_back(self, worker: Worker, actions: list[Action]) -> None:
        pass

    def drop_next(self, worker: Worker, task: Task, actions: list[Action]) -> None:
        pass


def _options(layout: str, n: int, rng: random.Random) -> JobOptions:
    if layout == ONE:
        return JobOptions(owner="http")
    owner = f"owner-{n % 100}"
    if layout == SPREAD:
        return JobOptions(queue=f"q{n % 100 % 10}", owner=owner)
    queue = f"q{rng.randrange(10)}"
    if layout == MIXED:
        return JobOptions(queue=queue, owner=owner)
    return JobOptions(  # and priorities and labels
        queue=queue,
        owner=owner,
        priority=rng.choice((-1, 0, 0, 0, 1)),
        requires=frozenset({"gpu"}) if rng.random() < 0.2 else frozenset(),
    )


def placing(layout: str, seed: int = 1) -> float:
    """Microseconds per job to place and finish JOBS pending jobs in `layout`."""
    rng = random.Random(seed)
    scheduler = Scheduler(timeout_task_placement=0.0)
    kind = _Instant()
    queues = frozenset({"default", *(f"q{n}" for n in range(10))})
    workers = []
    for wid in range(1, WORKERS + 1):
        worker = Worker(wid, kind, None, None, 0.0, queues=queues, labels=frozenset({"gpu"}))
        scheduler.add_worker(worker)
        workers.append(worker)
    # The options objects, made before timing (a door makes them as jobs arrive), equal ones
    # shared as a door shares its defaults.
    shared: dict[JobOptions, JobOptions] = {}
    made = [shared.setdefault(o, o) for o in (_options(layout, n, rng) for n in range(JOBS))]
    for n in range(JOBS):
        scheduler.submit(n + 1, b"", None, 0.0, made[n])
    actions: list[Action] = []
    start = time.perf_counter()
    for worker in workers:
        scheduler.ready(worker)
    scheduler.dispatch(actions, 0.0)
    done = 0
    while done < JOBS:
        for worker in workers:
            if worker.task is None:
                continue
            scheduler.accepted(worker, 0.0, actions)
            worker.advance(WorkerEvent.FETCH)
            scheduler.finished(worker, b"", 0.0, actions)
            done += 1
        scheduler.dispatch(actions, 0.0)
        actions.clear()
    elapsed = time.perf_counter() - start
    return elapsed / JOBS * 1e6


def in_controller(layout: str, seed: int = 1) -> float:
    """The controller's CPU microseconds per job, JOBS queued at once, 100 fake workers."""
    rng = random.Random(seed)
    made: dict[JobOptions, JobOptions] = {}

    def options(n: int) -> JobOptions:
        chosen = _options(layout, n, rng)
        return made.setdefault(chosen, chosen)

    queues = frozenset({"default", *(f"q{n}" for n in range(10))})
    with socket_dir() as sockdir:
        row = trio.run(_run_tasks, sockdir, JOBS, 100, options, (queues, frozenset({"gpu"})))
    return float(row["controller_cpu_us_per_task"])


ONE = "one queue, one owner"
SPREAD = "100 owners, each in one of 10 queues"
MIXED = "100 owners, all in all 10 queues"
LAYOUTS = (ONE, SPREAD, MIXED, MIXED + ", priorities, labels")


def _report(title: str, times: dict[str, list[float]], unit: str) -> dict[str, Any]:
    base = statistics.median(times[ONE])
    print(title)
    out: dict[str, Any] = {}
    for layout in LAYOUTS:
        value = statistics.median(times[layout])
        ratio = value / base
        print(f"  {layout:<50} {value:7.2f} {unit}  {ratio:5.2f}x the one-queue baseline")
        out[layout] = {unit.replace(" ", "_"): round(value, 3), "vs_one_queue": round(ratio, 3)}
    return out


def main(controller_rounds: int = 3) -> dict[str, Any]:
    alone: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
    for round_ in range(ROUNDS):
        for layout in LAYOUTS:
            alone[layout].append(placing(layout, seed=round_))
    results = {
        "scheduler": _report(
            f"placement cost, {JOBS:,} jobs pending, the scheduler alone on {WORKERS} "
            f"workers (median of {ROUNDS}):",
            alone,
            "us a job",
        )
    }
    whole: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
    for round_ in range(controller_rounds):
        for layout in LAYOUTS:
            whole[layout].append(in_controller(layout, seed=round_))
    results["controller"] = _report(
        f"placement cost, {JOBS:,} jobs queued at once in a controller, 100 fake workers, "
        f"controller CPU (median of {controller_rounds}):",
        whole,
        "us CPU a job",
    )
    return results


if __name__ == "__main__":
    main()

"""What each queue holds now: the report `GET /queue/` answers and the console's pages show."""

from __future__ import annotations

from typing import Any

from controller.core import Core
from controller.job_states import JobState
from controller.jobs import live_state


def idle_queue() -> dict[str, Any]:
    return {
        "pending": 0,
        "scheduled": 0,
        "working": 0,
        "workers": 0,
        "paused": False,
        "concurrency": None,
        "rate": None,
    }


def queue_report(core: Core) -> dict[str, dict[str, Any]]:
    """Each queue that has jobs, workers, a pause or a limit: its jobs pending, scheduled and
    working (requested too), its live workers, whether it is paused, and its limits (null:
    none). (It looks at every live job: an operator's question.)"""
    report: dict[str, dict[str, Any]] = {}

    def entry(name: str) -> dict[str, Any]:
        found = report.get(name)
        if found is None:
            found = report[name] = idle_queue()
        return found

    for task in core.tasks.values():
        state = live_state(task.state)
        word = "working" if state is JobState.REQUESTED else state.value
        entry(task.opts.queue)[word] += 1
    for worker in core.workers.values():
        for name in worker.queues:
            entry(name)["workers"] += 1
    for name in core.paused:
        entry(name)["paused"] = True
    for name in core.limited:
        concurrency, rate = core.limits(name)
        found = entry(name)
        found["concurrency"] = concurrency
        found["rate"] = None if rate is None else str(rate)
    return dict(sorted(report.items()))

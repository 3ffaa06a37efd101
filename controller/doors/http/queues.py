"""What each queue holds now: the report `GET /queue/` answers and the console's pages show."""

from __future__ import annotations

from typing import Any

from controller.core import Core
from controller.job_states import JobState
from controller.jobs import live_state


def idle_queue(paused: bool = False) -> dict[str, Any]:
    return {"pending": 0, "scheduled": 0, "working": 0, "workers": 0, "paused": paused}


def queue_report(core: Core) -> dict[str, dict[str, Any]]:
    """Each queue that has jobs, workers or a pause: its jobs pending, scheduled and working
    (requested too), its live workers, and whether it is paused. (It looks at every live job:
    an operator's question.)"""
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
    return dict(sorted(report.items()))

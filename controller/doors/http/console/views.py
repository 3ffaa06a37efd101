"""What the console shows, as plain data read from the core and the job book (the pages
render it). Each function is an operator's question: it may look at every worker, and the
job list at every kept job, but nothing here runs on a job's path."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

from controller.declared import shown
from controller.job_states import JobState
from controller.jobs import Job, JobBook
from controller.options import rfc3339
from controller.usage import Usage

MAX_WORKERS_SHOWN = 200
# Characters of a worker's queues, and of its labels, shown in its row.
NAMES_SHOWN = 120
LATEST_JOBS = 25
# Jobs a bulk retry or delete takes at a time.
BULK_LIMIT = 10_000


def worker_data(core: Any, now: float) -> tuple[list[dict[str, Any]], int]:
    """The first MAX_WORKERS_SHOWN workers, and how many more there are."""
    rows = []
    for worker in itertools.islice(core.workers.values(), MAX_WORKERS_SHOWN):
        task = worker.task
        rows.append(
            {
                "id": core.worker_name(worker.worker_id),
                "kind": worker.kind.label,
                "state": worker.state.value,
                "job": str(task.job) if task is not None else "",
                "pulse_ago": now - worker.last_pulse,
                "done": worker.done,
                "queues": shown(worker.queues, NAMES_SHOWN),
                "labels": shown(worker.labels, NAMES_SHOWN),
            }
        )
    return rows, len(core.workers) - len(rows)


def summary(core: Any, book: JobBook) -> dict[str, int]:
    return {
        "workers": len(core.workers),
        "idle": core.idle_workers,
        "pending": core.queued,
        "scheduled": core.scheduled,
        "running": len(core.tasks) - core.queued - core.scheduled,
        "kept": len(book),
    }


def counters(core: Any, http: dict[str, int], refused: int) -> list[tuple[str, int]]:
    c = core.counters
    return [
        ("submitted", c.submitted),
        ("finished", c.succeeded),
        ("failed", c.errors),
        ("failed_post", c.placement_timeouts),
        ("canceled", c.canceled),
        ("retries", c.retries),
        ("restarts sent", c.restarts_sent),
        ("HTTP requests", http.get("requests", 0)),
        ("HTTP jobs added", http.get("jobs_added", 0)),
        ("HTTP errors", http.get("errors", 0)),
        ("HTTP refused", refused),
    ]


def job_row(job: Job, now: float, wall_offset: float) -> dict[str, Any]:
    """A job's line in a list."""
    return {
        "id": job.id,
        "door": job.door,
        "name": job.name,
        "queue": job.options.queue,
        "state": job.state.value,
        "age": now - job.added_at,
        "added_at": rfc3339(job.added_at + wall_offset),
        "attempts": job.task.attempts if job.task is not None else job.attempts,
        "error": job.error,
        # (progress, status) its worker last reported, or None
        "progress": (job.progress, job.progress_status) if job.progress is not None else None,
    }


def matching(
    book: JobBook, state: JobState | None, queue: str | None, search: str
) -> Iterator[Job]:
    """The jobs of a filter, newest first (see JobBook.matching)."""
    return book.matching(state, queue, search)


def attempts_data(
    job: Job, wall_offset: float, name_of: Callable[[int], str]
) -> list[dict[str, str]]:
    """Each attempt: worker, start and end (wall clock), outcome, error, and what it used
    (wall and CPU seconds, peak memory; "" where its worker did not say)."""
    out = []
    for attempt in job.attempts_made():
        out.append(
            {
                "worker": name_of(attempt.worker) if attempt.worker else "?",
                "started": rfc3339(attempt.started + wall_offset) if attempt.started else "?",
                "ended": rfc3339(attempt.ended + wall_offset) if attempt.ended else "",
                "outcome": attempt.outcome,
                "error": attempt.error,
                **usage_cells(attempt.usage),
            }
        )
    return out


def usage_cells(usage: Usage | None) -> dict[str, str]:
    """An attempt's usage as the attempts table shows it."""
    if usage is None:
        return {"wall": "", "cpu": "", "max_rss": "", "memory_peak": ""}
    peak = usage.memory_peak
    return {
        "wall": f"{usage.wall:.3f} s",
        "cpu": f"{usage.cpu:.3f} s",
        "max_rss": size_text(usage.max_rss),
        "memory_peak": size_text(peak) if peak is not None else "",
    }


def size_text(size: int) -> str:
    """Bytes as a person reads them: 512 B, 12.3 KiB, 4.0 MiB, 1.5 GiB."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{size} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"


def actions_of(job: Job) -> list[str]:
    """The buttons a job's state allows: cancel (live), retry (failed or canceled), delete
    (not deleted)."""
    state = job.state
    out = []
    if not state.final:
        out.append("cancel")
    if state in (JobState.FAILED, JobState.CANCELED):
        out.append("retry")
    if state is not JobState.DELETED:
        out.append("delete")
    return out

"""The jobs in state `waiting` (DESIGN.md section 17: the option `after`), by the jobs they wait
for. The job desk holds them out of the scheduler until every job they wait for has ended.

`dependents` maps a job's id to the waiting jobs that name it, and `unmet` counts, for each
waiting job, how many of them have not ended yet: a job that ends looks at its own dependents
only (`ended` pops them), so releasing costs O(dependents), whatever else waits."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from controller.core import TaskFinished, TaskState
from controller.job_states import JobState
from controller.jobs import Job, JobBook
from controller.options import JobOptions

if TYPE_CHECKING:
    from controller.core import Core
    from controller.journal import Journal


class Scheduling(Protocol):
    @property
    def core(self) -> Core: ...

    def execute(self, actions: list[Any]) -> None: ...


class JobDesk(Protocol):
    """What these functions need of the job desk (controller/shell/desk.py, which holds the
    `Waits` and calls them)."""

    @property
    def book(self) -> JobBook: ...

    @property
    def journal(self) -> Journal | None: ...

    @property
    def scheduling(self) -> Scheduling: ...

    @property
    def waits(self) -> Waits: ...

    @property
    def on_change(self) -> Callable[[Job], None] | None: ...

    def came(self, job: Job) -> None: ...

    def finished(self, action: TaskFinished) -> None: ...


class Waits:
    def __init__(self) -> None:
        self.dependents: dict[str, list[Job]] = {}
        self.unmet: dict[str, int] = {}
        self.looked_at = 0  # dependents looked at, ever (the tests count the work)
        # Jobs that ended whose dependents are still to be looked at (`let_go`).
        self.to_look_at: deque[Job] = deque()
        self.looking = False
        # Batches (POST /batch/): a batch's id -> its `then` job's id; that job's `after` holds
        # the batch's jobs. Kept while the book holds the `then` job (rebuilt at start).
        self.batches: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self.unmet)

    def hold(self, job: Job, waiting_for: list[str]) -> None:
        """`job` waits for the live jobs `waiting_for` (each named once)."""
        for named in waiting_for:
            self.dependents.setdefault(named, []).append(job)
        self.unmet[job.id] = len(waiting_for)

    def holds(self, job: Job) -> bool:
        return job.id in self.unmet

    def ended(self, job_id: str) -> list[Job]:
        """The jobs still waiting that waited for `job_id`, which just ended (or was deleted)."""
        found = self.dependents.pop(job_id, None)
        if not found:
            return []
        self.looked_at += len(found)
        return [job for job in found if job.id in self.unmet and job.final is None]

    def met(self, job: Job) -> bool:
        """One of the jobs `job` waits for ended well: True once none is left (it is let go)."""
        left = self.unmet[job.id] - 1
        if left:
            self.unmet[job.id] = left
            return False
        del self.unmet[job.id]
        return True

    def drop(self, job: Job) -> None:
        """`job` no longer waits (it was canceled or deleted): its entries under the jobs it
        waited for are skipped when those end."""
        self.unmet.pop(job.id, None)


# ------------------------------------------------------------ the desk's side


def submit(desk: JobDesk, job: Job, options: JobOptions, now: float) -> Job:
    """A new job whose `options` name jobs to wait for: in the book and staged for the journal
    in state `waiting`, under a ref the scheduler will queue it with, then held (`hold`)."""
    job.ref = desk.scheduling.core.reserve_ref()
    job.options = options
    desk.book.add(job)
    desk.came(job)
    if desk.journal is not None:
        desk.journal.job_added(job)
    if desk.on_change is not None:  # made: waiting (an event of GET /events/)
        desk.on_change(job)
    hold(desk, job, now)
    return job


def hold(desk: JobDesk, job: Job, now: float) -> None:
    """A new (or recovered) job in the book, in state `waiting`: held until every job its
    `after` names has ended; let go at once when they all have, canceled at once when one
    ended badly (unless `after_any`)."""
    book = desk.book
    options = job.options
    waiting_for = []
    for named in options.after:
        other = book.get(named)
        if other is not None and other.final is None:
            waiting_for.append(named)
            continue
        why = "" if options.after_any else _ended_badly(named, other)
        if why:
            cancel(desk, job, now, why)
            return
    if waiting_for:
        desk.waits.hold(job, waiting_for)
    else:
        release(desk, job, now)


def _ended_badly(named: str, other: Job | None) -> str:
    """Why a job that waited for `named` (`other`: that job, None once forgotten) is canceled
    ("": it finished)."""
    if other is None:
        return f"job {named[:200]!r}, which it waited for, is no longer known"
    state = other.state
    if state is JobState.FINISHED:
        return ""
    said = "failed" if state is JobState.FAILED else f"was {state.value}"
    return f"job {named[:200]!r}, which it waited for, {said}"


def release(desk: JobDesk, job: Job, now: float) -> None:
    """The jobs `job` waited for have ended: it is queued (scheduled, when its run_at is
    ahead), journaled as such."""
    options = job.options
    wait = 0.0 if options.run_at is None else options.run_at - time.time()
    scheduling = desk.scheduling
    task, actions = scheduling.core.release(
        job.ref, job.task_id, job.payload, job.id, options, now, wait
    )
    job.task = task
    job.updated_at = now
    journal = desk.journal
    if journal is not None:
        if task.state is TaskState.SCHEDULED:
            due = task.deadline + desk.book.wall_offset
            journal.job_progress(job.ref, "scheduled", 0, (), due)
        else:
            journal.job_progress(job.ref, "pending", 0, ())
    if desk.on_change is not None:  # let go: pending or scheduled
        desk.on_change(job)
    if actions:
        scheduling.execute(actions)


def cancel(desk: JobDesk, job: Job, now: float, error: str = "") -> bool:
    """A waiting job is canceled (by a user, or because a job it waited for ended badly): it
    ends as a job canceled in the scheduler would, and the jobs waiting for it go on."""
    desk.waits.drop(job)
    desk.finished(TaskFinished(job.ref, job.task_id, job.id, TaskState.CANCELED, error=error))
    return True


def let_go(desk: JobDesk, job: Job, now: float) -> None:
    """`job` ended (or was deleted): each job that waited for it is canceled (it ended badly,
    and the waiter does not run whatever the outcome) or counts one fewer to wait for, and
    runs when none is left. A loop, not recursion: a chain of 10,000 jobs, each waiting for
    the one before, ends one link at a time."""
    waits = desk.waits
    if not waits.dependents:
        return
    waits.to_look_at.append(job)
    if waits.looking:
        return  # the loop below, further up the stack, takes it
    waits.looking = True
    try:
        while waits.to_look_at:
            ended = waits.to_look_at.popleft()
            for dependent in waits.ended(ended.id):
                if dependent.final is not None or not waits.holds(dependent):
                    continue
                why = "" if dependent.options.after_any else _ended_badly(ended.id, ended)
                if why:
                    cancel(desk, dependent, now, why)
                elif waits.met(dependent):
                    release(desk, dependent, now)
    finally:
        waits.looking = False

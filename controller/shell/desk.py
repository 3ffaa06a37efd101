"""The job desk: where every door's jobs meet the job book, the journal and the scheduler.

Every door calls the same methods, whatever its wire: `submit` a new job, `delivered`
(its submitter has the outcome: retention starts), `cancel`, `retry`, `delete`, `pause`, `limit`;
and `answer_after_commit` holds a door's answers until the journal has what they announce
(`WriteAhead`), so a door makes its state changes first, then hands its answers here.
Doors never touch the scheduler or the journal themselves. Going the other way, a job
that ends in the scheduler is recorded in the book and the journal here, and its door
(`doors`, by `DoorName`) is asked to tell the submitter (`Door.job_finished`).
Retention (forgetting old outcomes) runs here too. Putting the journal's jobs back at
start is recovery.py's; settling the changes the journal refuses is refusals.py's.

The desk also owns the bound on queued work (`max_pending`, `max_pending_bytes`): it counts
the jobs not yet ended and the bytes of their payloads as they come and go (added where a job
is made, revived or recovered, taken away where it ends, is canceled or deleted), and every
door asks it (`room`, `entries_room`) before making one. It keeps the unique jobs' rule in the
same places: the live jobs by `unique_key` (`unique`); every door asks `holder` before making a
job (a key held answers the holder instead), and a job is not retried while another live job
holds its key (`no_retry`): one live job a key.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import trio

from controller.core import TaskFinished, TaskProgress, TaskState
from controller.core.limits import Rate
from controller.job_ids import DoorName
from controller.job_states import JobState
from controller.jobs import (
    DEFAULT_MAX_LOG_SIZE,
    DEFAULT_OUTPUT_RETENTION,
    Job,
    JobBook,
    history_to_json,
    notes_of,
)
from controller.journal import Journal
from controller.options import JobOptions
from controller.shell import waits
from controller.shell.desk_ports import AnswerT, Door, Scheduling
from controller.shell.durability import WriteAhead
from controller.shell.timer import DeadlineTimer
from controller.usage import Usage

log = logging.getLogger("controller")

# What a refusal for want of room asks the client to wait before trying again (seconds).
RETRY_AFTER = 5

_FINAL = {
    TaskState.SUCCESS: JobState.FINISHED,
    TaskState.ERROR: JobState.FAILED,
    TaskState.FAILED_POST: JobState.FAILED,
    TaskState.CANCELED: JobState.CANCELED,
}


class JobDesk:
    def __init__(
        self,
        book: JobBook,
        scheduling: Scheduling,
        journal: Journal | None = None,
        write_ahead: WriteAhead | None = None,
        max_log_size: int = DEFAULT_MAX_LOG_SIZE,
        output_retention: int = DEFAULT_OUTPUT_RETENTION,
        max_pending: int = 1000000,
        max_pending_bytes: int = 1073741824,
    ) -> None:
        self.book = book
        self.max_pending = max_pending
        self.max_pending_bytes = max_pending_bytes
        # Jobs not yet ended and the bytes of their payloads: kept as jobs come and go,
        # never counted over.
        self.live_jobs = 0
        self.live_bytes = 0
        # The live jobs that have a unique_key, by it: at most one per key.
        self.unique: dict[str, Job] = {}
        self.max_log_size = max_log_size
        self.output_retention = output_retention
        # Told when a job ends (`on_finished`) or its output grows (`on_output`), and of every
        # change of its state or progress (`on_change`: made, started, back to pending or
        # scheduled, ended, deleted, retried, progressed): the HTTP door, which wakes those who
        # follow it and streams the events. Connected by the assembly, with the doors.
        self.on_finished: Callable[[Job], None] | None = None
        self.on_output: Callable[[Job], None] | None = None
        self.on_change: Callable[[Job], None] | None = None
        self.scheduling = scheduling
        self.journal = journal
        self.write_ahead = write_ahead if write_ahead is not None else WriteAhead(journal)
        self.doors: dict[DoorName, Door] = {}
        self.leased_refs: set[int] = set()  # refs of live jobs with a lease in the journal
        self.timer = DeadlineTimer(book.next_deadline, self._expire)
        # Jobs that lost a change the journal could not store, by id: (it was the job's first
        # record, why). Marked and settled by the journal's refusals (refusals.py).
        self.refused: dict[str, tuple[bool, str]] = {}
        self.waits = waits.Waits()  # jobs `waiting` (option `after`), out of the scheduler

    def connect(
        self,
        *,
        doors: Mapping[DoorName, Door],
        on_finished: Callable[[Job], None] | None = None,
        on_output: Callable[[Job], None] | None = None,
        on_change: Callable[[Job], None] | None = None,
    ) -> None:
        """The doors that tell their submitters how jobs ended (a job of a door not here is
        kept for retention untold), and who is told of every job's end, output and change."""
        self.doors = dict(doors)
        self.on_finished = on_finished
        self.on_output = on_output
        self.on_change = on_change

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Forget jobs past their retention, until cancelled."""
        task_status.started()
        await self.timer.run()

    def refusal(self) -> str:
        """Why new jobs must be refused now ("" when they are welcome)."""
        return self.journal.refusal_reason() if self.journal is not None else ""

    def room(self, size: int, count: int = 1) -> bool:
        """Whether `count` new jobs with payloads of `size` bytes in all fit within
        `max_pending` and `max_pending_bytes` (a door refuses them when not: see `busy`)."""
        return (
            self.live_jobs + count <= self.max_pending
            and self.live_bytes + size <= self.max_pending_bytes
        )

    def busy(self, size: int, count: int = 1) -> str:
        """Why `count` new jobs with payloads of `size` bytes in all do not fit now (the
        message of a door's refusal)."""
        if self.live_jobs + count > self.max_pending:
            jobs = "" if count == 1 else f"{count} new jobs beside "
            return (
                f"{jobs}{self.live_jobs} jobs are not yet ended, max_pending is "
                f"{self.max_pending}: try again in a while"
            )
        return (
            f"a payload of {size} bytes beside the {self.live_bytes} bytes of the jobs not "
            f"yet ended is over max_pending_bytes ({self.max_pending_bytes}): try again in a while"
        )

    def refusal_for(self, size: int) -> str:
        """Why a job with a `size`-byte payload is refused for want of room ("" if it fits)."""
        return "" if self.room(size) else self.busy(size)

    def entries_room(self) -> int:
        """How many jobs whose sizes are not known yet may be asked for (the Redis door's
        reads): the room left under `max_pending`, none once the payloads fill
        `max_pending_bytes`. The asker counts what it asked for and has not had yet."""
        if self.live_bytes >= self.max_pending_bytes:
            return 0
        return max(0, self.max_pending - self.live_jobs)

    def came(self, job: Job) -> None:
        """A job not yet ended joins the count of queued work (and holds its unique_key)."""
        self.live_jobs += 1
        self.live_bytes += len(job.payload)
        key = job.options.unique_key
        if key:
            self.unique.setdefault(key, job)

    def went(self, job: Job) -> None:
        """A job ended, was canceled or deleted: out of the queued work's count (frees its key)."""
        self.live_jobs -= 1
        self.live_bytes -= len(job.payload)
        key = job.options.unique_key
        if key and self.unique.get(key) is job:
            del self.unique[key]

    def holder(self, unique_key: str) -> Job | None:
        """The live job holding `unique_key` (None: free, or ""): a door answers it instead."""
        return self.unique.get(unique_key) if unique_key and self.unique else None

    def no_retry(self, job: Job) -> str:
        """Why `job` cannot be retried now ("" when it can): only a failed or canceled job is,
        and only while no other live job holds its unique_key."""
        if job.state not in (JobState.FAILED, JobState.CANCELED):
            return f"the job is {job.state.value}: only a failed or canceled job is retried"
        holder = self.holder(job.options.unique_key)
        if holder is not None and holder is not job:
            return (
                f"its unique_key {job.options.unique_key!r} is held by the live job "
                f"{holder.id}: retry it once that job has ended"
            )
        return ""

    # ------------------------------------------------------------ from the doors

    def answer_after_commit(
        self, transmit: Callable[[list[AnswerT]], None], answers: list[AnswerT]
    ) -> None:
        """`transmit(answers)` once everything the journal has staged so far is on disk (now,
        if it is): a door calls it after the state changes its answers announce. Answers
        about a job the journal could not record are replaced by their `refused()`, or
        dropped."""
        if answers:
            self.write_ahead.after_commit(self._release, (transmit, answers))

    def _release(self, held: tuple[Callable[[list[Any]], None], list[Any]]) -> None:
        transmit, answers = held
        if self.refused:
            screened = []
            for answer in answers:
                if answer.job_id in self.refused:
                    instead = answer.refused()
                    if instead is not None:
                        screened.append(instead)
                else:
                    screened.append(answer)
            answers = screened
        transmit(answers)

    def submit(
        self,
        job_id: str,
        door: DoorName,
        key: object,
        task_id: int,
        payload: bytes,
        now: float,
        *,
        journal_first: bool = False,
        name: str = "",
        info_url: str = "",
        download_url: str = "",
        options: JobOptions | None = None,
    ) -> Job:
        """Record a new job and queue it (with what a person gave it: a name, links). The job is
        in the book and staged for the journal before the scheduler's actions run (one of
        them may hand it out at once); with `journal_first` they wait until it is on disk
        (the Redis door: the job is not acknowledged to anyone, so nothing else waits)."""
        if options is not None and options.after:  # it waits for others first (waits.py)
            notes = notes_of(name, info_url, download_url)
            job = Job(job_id, 0, task_id, door, key, payload, notes, added_at=now, updated_at=now)
            return waits.submit(self, job, options, now)
        run_at = options.run_at if options is not None else None
        wait = 0.0 if run_at is None else run_at - time.time()
        # With `journal_first` the task is handed out once the job is on disk (or earlier, by
        # another event: a SET_TASK is written when the scheduler decides it, so that what a
        # worker reads is in the order the scheduler decided it).
        task, actions = self.scheduling.queue(
            task_id, payload, job_id, options, wait, now, dispatch=not journal_first
        )
        notes = notes_of(name, info_url, download_url)
        job = Job(
            job_id, task.ref, task_id, door, key, payload, notes, added_at=now, updated_at=now
        )
        job.options = task.opts
        job.task = task
        self.book.add(job)
        self.live_jobs += 1
        self.live_bytes += len(payload)
        if task.opts.unique_key:  # a door asked `holder` first: the key is free
            self.unique.setdefault(task.opts.unique_key, job)
        if self.journal is not None:
            self.journal.job_added(job)
        if self.on_change is not None:
            self.on_change(job)
        if journal_first:
            self.write_ahead.after_commit(lambda _: self.scheduling.dispatch(), None)
        else:
            self.scheduling.execute(actions)
        return job

    def logged(self, job: Job, line: str, now: float) -> None:
        """Append `line` to the job's log, keeping at most `max_log_size` bytes of it
        (journaled: it is there after a restart). A log entry is output too: it is appended
        to the job's output as a line of its own."""
        job.add_log(line, self.max_log_size)
        job.updated_at = now
        if self.journal is not None:
            self.journal.job_logged(job.ref, job.log)
        if line:
            raw = line.encode("utf-8", "surrogatepass")
            self.output(job, raw if raw.endswith(b"\n") else raw + b"\n")

    def output(self, job: Job, data: bytes) -> None:
        """Append to what the job wrote to stderr, keeping its newest `output_retention`
        bytes (journaled), and wake those who follow it."""
        if not data or job.state is JobState.DELETED:
            return
        kept = job.add_output(data, self.output_retention)
        if self.journal is not None:
            self.journal.job_output(job.ref, kept, self.output_retention)
        if self.on_output is not None:
            self.on_output(job)

    def progressed(self, job: Job, progress: object, status: object, ref: int = 0) -> None:
        """A worker's report of its job's progress: the one place it changes (Job.reported)."""
        if job.reported(progress, status, ref) and self.on_change is not None:
            self.on_change(job)

    def task_usage(self, ref: int, job_id: object, usage: Usage) -> None:
        """What the running attempt of task `ref` used, as its worker reported with its outcome
        (which follows): kept with that attempt."""
        job = self.book.get(str(job_id))
        if job is not None and job.ref == ref:
            job.usage = usage

    def task_output(self, ref: int, job_id: object, data: bytes) -> None:
        """Output from the worker holding task `ref` (the task's `job` is the job's id)."""
        job = self.book.get(str(job_id))
        if job is not None and job.ref == ref:
            self.output(job, data)

    def delivered(self, job_id: str, now: float) -> None:
        """The job's submitter has its outcome (or never will): the job is kept for
        result_retention, then forgotten."""
        job = self.book.get(job_id)
        if job is None:
            return
        self.book.retain(job, now)
        if self.journal is not None:
            self.journal.job_delivered(job.ref, self.book.result_retention)
        self.timer.poke_at(job.expires_at)

    def cancel(self, job: Job, now: float) -> bool:
        """Cancel a live job (a local worker holding it gets RESTART); False if it ended."""
        if job.state.final:
            return False
        if job.task is None:  # waiting for others: the scheduler has not seen it (waits.py)
            return waits.cancel(self, job, now)
        actions = self.scheduling.core.cancel(job.ref, now)
        if actions:
            self.scheduling.execute(actions)  # its TaskFinished comes back through `finished`
        return True

    def retry(self, job: Job, now: float) -> bool:
        """Put a failed or canceled job back to pending with a fresh max_retries (its
        attempts go on counting); False for a job in any other state, or one whose unique_key
        another live job holds (`no_retry` says why)."""
        if self.no_retry(job):
            return False
        task, actions = self.scheduling.core.resubmit(
            job.ref, job.task_id, job.payload, job.id, job.options, job.attempts, now
        )
        self.book.revive(job, task, now)
        self.came(job)
        if self.journal is not None:
            self.journal.job_retried(job.ref, job.attempts)
        if self.on_change is not None:
            self.on_change(job)
        door = self.doors.get(job.door)
        if door is not None:
            door.forget(job)  # its old outcome is no longer news
        self.scheduling.execute(actions)
        return True

    def pause(self, queue: str, paused: bool) -> None:
        """Stop (or resume) handing out `queue`'s jobs; journaled."""
        core = self.scheduling.core
        if paused == (queue in core.paused):
            return
        if self.journal is not None:
            self.journal.queue_paused(queue, paused)
        if paused:
            core.pause(queue)
            return
        self.scheduling.execute(core.resume(queue, trio.current_time()))

    def limit(self, queue: str, concurrency: int | None, rate: Rate | None) -> None:
        """Set `queue`'s concurrency and rate (None: none); journaled."""
        core = self.scheduling.core
        if (concurrency, rate) == core.limits(queue):
            return
        if self.journal is not None:
            self.journal.queue_limited(queue, concurrency, None if rate is None else str(rate))
        self.scheduling.execute(core.limit(queue, concurrency, rate, trio.current_time()))

    def delete(self, job: Job, now: float) -> None:
        """Soft delete (canceling it first if it is live); deleting twice changes nothing."""
        if job.state is JobState.DELETED:
            return
        self.cancel(job, now)
        ended_here = job.final is None  # its end did not come back at once: it ends here
        if ended_here:
            self.went(job)
        self.book.delete(job, now)
        if ended_here:
            waits.let_go(self, job, now)  # those waiting for it go on
        job.drop_output()
        if self.journal is not None:
            self.journal.job_deleted(job.ref)
        if self.on_change is not None:
            self.on_change(job)
        if self.on_finished is not None:
            self.on_finished(job)

    def leased(self, ref: int, lease: str) -> None:
        """A remote worker holds job `ref` under `lease` (a poller's token, a calculator's
        address): journaled, so that only that holder can keep the job across a restart."""
        if self.journal is not None:
            self.journal.job_leased(ref, lease)
            self.leased_refs.add(ref)

    # ------------------------------------------------------------ from the scheduler

    def progress(self, action: TaskProgress) -> None:
        """A job started running, went back to the queue, or waits for its time."""
        task = self.scheduling.core.tasks.get(action.ref)
        job = self.book.get(str(task.job)) if task is not None else None
        if job is not None and task is not None:
            if action.state is TaskState.RUNNING:
                job.attempt_started(task.worker_id, trio.current_time())
            elif job.started_at:
                job.attempt_ended(task.last_error, trio.current_time())
                if self.journal is not None:
                    text = history_to_json(job.history or [], self.book.wall_offset)
                    self.journal.job_history(job.ref, text)
            if self.on_change is not None:
                self.on_change(job)
        if self.journal is None:
            return
        if action.state is TaskState.SCHEDULED:
            task = self.scheduling.core.tasks[action.ref]
            due = task.deadline + self.book.wall_offset
            self.journal.job_progress(
                action.ref, "scheduled", action.attempts, action.failed_on, due
            )
            return
        state = "working" if action.state is TaskState.RUNNING else "pending"
        self.journal.job_progress(action.ref, state, action.attempts, action.failed_on)

    def finished(self, action: TaskFinished) -> None:
        now = trio.current_time()
        job = self.book.finish(
            str(action.job),  # the desk queues every task with its job's id as its `job`
            _FINAL[action.state],
            now,
            result=action.result,
            error=action.error,
            failed_post=action.state is TaskState.FAILED_POST,
        )
        if job is None:
            return
        job.reason = action.reason
        self.went(job)
        if self.journal is not None:
            self.journal.job_finished(job)
            if job.ref in self.leased_refs:
                self.leased_refs.discard(job.ref)
                self.journal.job_unleased(job.ref)
        if self.on_change is not None:
            self.on_change(job)
        if self.on_finished is not None:
            self.on_finished(job)
        self.tell(job, now)
        if self.waits.dependents:  # jobs wait for others (waits.py)
            waits.let_go(self, job, now)

    def tell(self, job: Job, now: float) -> None:
        """Ask the job's door to tell its submitter how it ended."""
        door = self.doors.get(job.door)
        if door is None:
            self.delivered(job.id, now)  # nobody to tell: keep it for retention
        else:
            door.job_finished(job, now)

    def _expire(self, now: float) -> None:
        for job in self.book.expire(now):
            if self.journal is not None:
                self.journal.job_forgotten(job.ref)
            door = self.doors.get(job.door)
            if door is not None:
                door.forget(job)

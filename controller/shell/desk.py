"""The job desk: where every door's jobs meet the job book, the journal and the scheduler.

Doors are codecs: they turn requests into actions (`Submit`, `Delivered`,
`Send`) and never touch the scheduler or the journal. The desk carries the
actions out, state changes first (book, journal, scheduler), then the
answers, which go through `WriteAhead` so that none leaves before what it
announces is on disk. Going the other way, a job that ends in the scheduler
is recorded in the book and the journal here, and its door is asked to tell
the submitter. Retention (forgetting old outcomes) runs here too, and so
does recovery from the journal at start.

The desk also owns the bound on queued work (`max_pending`, `max_pending_bytes`): it
counts the jobs not yet ended and the bytes of their payloads as they come and go (one
addition where a job is made, revived or recovered, one subtraction where it ends, is
canceled or deleted), and every door asks it (`room`, `entries_room`) before making one.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import trio

from controller.calclink import Completed, Heartbeat, PerformAcked, PerformUnacked
from controller.core import Core, Task, TaskFinished, TaskProgress, TaskState
from controller.frontdoor import Delivered, DoorAction, Evict, Send, Submit
from controller.jobs import (
    DEFAULT_MAX_LOG_SIZE,
    DEFAULT_OUTPUT_RETENTION,
    Job,
    JobBook,
    JobState,
    Usage,
    history_from_json,
    history_to_json,
    notes_of,
    usage_from_text,
)
from controller.journal import Journal, Recovered, Rejected
from controller.options import JobOptions, from_json
from controller.shell.durability import WriteAhead
from controller.shell.timer import DeadlineTimer

log = logging.getLogger("controller")

# Numbers the controller picks for the worker wire (`task_id`) of jobs that come with none
# (HTTP, Redis): above what UDP clients usually number their tasks with, unique among live jobs.
FIRST_PICKED_TASK_ID = 1 << 32

# What a refusal for want of room asks the client to wait before trying again (seconds).
RETRY_AFTER = 5

# After a restart, how long a job that was running waits for its worker to re-register
# and claim it before it is placed again: a little over one default pulse deadline (2 s).
RECOVERY_GRACE = 3.0

_FINAL = {
    TaskState.SUCCESS: JobState.FINISHED,
    TaskState.ERROR: JobState.FAILED,
    TaskState.FAILED_POST: JobState.FAILED,
    TaskState.CANCELED: JobState.CANCELED,
}


class Door(Protocol):
    """What the desk needs of a door's shell."""

    def job_finished(self, job: Job, now: float) -> list[DoorAction]: ...

    def forget(self, job: Job) -> None: ...

    def transmit(self, sends: Sequence[Send]) -> None: ...


class Scheduling(Protocol):
    """What the desk needs of the scheduler's shell (controller/shell/core_shell.py)."""

    core: Core

    def queue(
        self,
        task_id: int,
        payload: bytes,
        owner: object,
        options: JobOptions | None = ...,
        wait: float = ...,
        now: float | None = ...,
    ) -> tuple[Task, list[Any]]: ...

    def execute(self, actions: list[Any]) -> None: ...

    def attempt_used(self, ref: int, owner: object, usage: Usage) -> None: ...


class JobDesk:
    def __init__(
        self,
        book: JobBook,
        scheduling: Scheduling,
        journal: Journal | None = None,
        on_finished: Callable[[Job], None] | None = None,
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
        self.max_log_size = max_log_size
        self.output_retention = output_retention
        # Told when a job's output grew (the HTTP door wakes those who follow it).
        self.on_output: Callable[[Job], None] | None = None
        self.scheduling = scheduling
        self.journal = journal
        self.write_ahead = WriteAhead(journal)
        self.on_finished = on_finished
        self.doors: dict[str, Door] = {}
        self._picked = itertools.count(FIRST_PICKED_TASK_ID)
        self._leased: set[int] = set()  # refs of live jobs with a lease in the journal
        self._timer = DeadlineTimer(book.next_deadline, self._expire)
        # Jobs that lost a change the journal could not store, by id: (it was the job's first
        # record, why). Marked by `rejected`, settled by `committed` (see there).
        self._refused: dict[str, tuple[bool, str]] = {}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Forget jobs past their retention, until cancelled."""
        task_status.started()
        await self._timer.run()

    def refusal(self) -> str:
        """Why new jobs must be refused now ("" when they are welcome)."""
        return self.journal.refusal_reason() if self.journal is not None else ""

    def room(self, size: int) -> bool:
        """Whether a new job with a payload of `size` bytes fits within `max_pending` and
        `max_pending_bytes` (a door refuses it when not: see `busy`)."""
        return (
            self.live_jobs < self.max_pending and self.live_bytes + size <= self.max_pending_bytes
        )

    def busy(self, size: int) -> str:
        """Why a new job with a payload of `size` bytes does not fit now (the message of a
        door's refusal)."""
        if self.live_jobs >= self.max_pending:
            return (
                f"{self.live_jobs} jobs are not yet ended, max_pending is {self.max_pending}: "
                f"try again in a while"
            )
        return (
            f"a payload of {size} bytes beside the {self.live_bytes} bytes of the jobs not "
            f"yet ended is over max_pending_bytes ({self.max_pending_bytes}): try again in a while"
        )

    def refusal_for(self, size: int) -> str:
        """Why a new job with a payload of `size` bytes is refused for want of room ("" when
        it fits)."""
        return "" if self.room(size) else self.busy(size)

    def entries_room(self) -> int:
        """How many jobs whose sizes are not known yet may be asked for (the Redis door's
        reads): the room left under `max_pending`, none once the payloads fill
        `max_pending_bytes`. The asker counts what it asked for and has not had yet."""
        if self.live_bytes >= self.max_pending_bytes:
            return 0
        return max(0, self.max_pending - self.live_jobs)

    def _came(self, job: Job) -> None:
        self.live_jobs += 1
        self.live_bytes += len(job.payload)

    def _went(self, job: Job) -> None:
        self.live_jobs -= 1
        self.live_bytes -= len(job.payload)

    # ------------------------------------------------------------ from the doors

    def apply(self, door: Door, actions: Sequence[DoorAction], now: float) -> None:
        """Carry out a door's actions: state changes first, then the answers."""
        if not actions:
            return
        sends: list[Send] = []
        for action in actions:
            if isinstance(action, Send):
                if action.independent:  # reveals nothing recorded: it need not wait
                    door.transmit((action,))
                else:
                    sends.append(action)
            elif isinstance(action, Submit):
                self.submit(
                    action.job_id,
                    "udp",
                    action.addr,
                    action.task_id,
                    action.payload,
                    now,
                    options=action.options,
                )
            elif isinstance(action, Delivered):
                self.delivered(action.job_id, now)
            elif isinstance(action, Evict):
                self.evict(action.job_id)
            else:
                self.scheduling.execute(self._calculator(action, now))
        if sends:
            self.write_ahead.after_commit(self._release, (door, sends))

    def _release(self, held: tuple[Door, list[Send]]) -> None:
        """Answers whose journal commit is done go out (those about a job the journal could
        not record are replaced by their refusal, or dropped)."""
        door, sends = held
        if self._refused:
            screened = []
            for send in sends:
                if send.job_id in self._refused:
                    instead = send.refused()
                    if instead is not None:
                        screened.append(instead)
                else:
                    screened.append(send)
            sends = screened
        door.transmit(sends)

    def pick_task_id(self) -> int:
        """A wire number for a job whose door gives none."""
        return next(self._picked)

    def _calculator(
        self, action: Heartbeat | Completed | PerformAcked | PerformUnacked, now: float
    ) -> list[Any]:
        """What a calculator said, for the calculator worker kind."""
        kind = self.scheduling.core.calculators
        if isinstance(action, Heartbeat):
            return kind.heartbeat(action.address, action.ready, now, action.serves)
        if isinstance(action, Completed):
            task = kind.held(action.address, action.task_id)
            if task is not None:  # kept with the job first: its followers see it before its end
                if action.job_output:
                    self.task_output(task.ref, task.owner, action.job_output)
                if action.usage is not None:
                    self.scheduling.attempt_used(task.ref, task.owner, action.usage)
            return kind.completed(
                action.address, action.task_id, action.ok, action.output, action.error, now
            )
        if isinstance(action, PerformAcked) and not action.refused:
            return kind.acknowledged(action.address, action.ref, now)
        return kind.unacknowledged(action.address, action.ref, now)

    def submit(
        self,
        job_id: str,
        door: str,
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
        run_at = options.run_at if options is not None else None
        wait = 0.0 if run_at is None else run_at - time.time()
        task, actions = self.scheduling.queue(task_id, payload, job_id, options, wait, now)
        notes = notes_of(name, info_url, download_url)
        job = Job(
            job_id, task.ref, task_id, door, key, payload, notes, added_at=now, updated_at=now
        )
        job.options = task.opts
        job.task = task
        self.book.add(job)
        self.live_jobs += 1
        self.live_bytes += len(payload)
        if self.journal is not None:
            self.journal.job_added(job)
        if journal_first:
            self.write_ahead.after_commit(self.scheduling.execute, actions)
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

    def task_usage(self, ref: int, owner: object, usage: Usage) -> None:
        """What the running attempt of task `ref` used, as its worker reported with its outcome
        (which follows): kept with that attempt."""
        job = self.book.get(str(owner))
        if job is not None and job.ref == ref:
            job.usage = usage

    def task_output(self, ref: int, owner: object, data: bytes) -> None:
        """Output from the worker holding task `ref` (the scheduler's owner is the job's id)."""
        job = self.book.get(str(owner))
        if job is not None and job.ref == ref:
            self.output(job, data)

    def delivered(self, job_id: str, now: float) -> None:
        job = self.book.get(job_id)
        if job is None:
            return
        self.book.retain(job, now)
        if self.journal is not None:
            self.journal.job_delivered(job.ref, self.book.result_retention)
        self._timer.poke_at(job.expires_at)

    def evict(self, job_id: str) -> None:
        """Forget a delivered job before its retention ends (its door is over its memory)."""
        job = self.book.get(job_id)
        if job is None or not job.delivered:
            return
        self.book.forget(job)
        if self.journal is not None:
            self.journal.job_forgotten(job.ref)
        door = self.doors.get(job.door)
        if door is not None:
            door.forget(job)

    def cancel(self, job: Job, now: float) -> bool:
        """Cancel a live job (a local worker holding it gets RESTART); False if it ended."""
        if job.state.final:
            return False
        actions = self.scheduling.core.cancel(job.ref, now)
        if actions:
            self.scheduling.execute(actions)  # its TaskFinished comes back through `finished`
        return True

    def retry(self, job: Job, now: float) -> bool:
        """Put a failed or canceled job back to pending with a fresh max_retries (its
        attempts go on counting); False for a job in any other state."""
        if job.state not in (JobState.FAILED, JobState.CANCELED):
            return False
        task, actions = self.scheduling.core.resubmit(
            job.ref, job.task_id, job.payload, job.id, job.options, job.attempts, now
        )
        self.book.revive(job, task, now)
        self._came(job)
        if self.journal is not None:
            self.journal.job_retried(job.ref, job.attempts)
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
        self.scheduling.execute(core.resume(queue))

    def delete(self, job: Job, now: float) -> None:
        """Soft delete (canceling it first if it is live); deleting twice changes nothing."""
        if job.state is JobState.DELETED:
            return
        self.cancel(job, now)
        if job.final is None:  # its end did not come back at once: it ends here
            self._went(job)
        self.book.delete(job, now)
        job.drop_output()
        if self.journal is not None:
            self.journal.job_deleted(job.ref)
        if self.on_finished is not None:
            self.on_finished(job)

    def leased(self, ref: int, lease: str) -> None:
        """A remote worker holds job `ref` under `lease` (a poller's token, a calculator's
        address): journaled, so that only that holder can keep the job across a restart."""
        if self.journal is not None:
            self.journal.job_leased(ref, lease)
            self._leased.add(ref)

    # ------------------------------------------------------------ from the scheduler

    def progress(self, action: TaskProgress) -> None:
        """A job started running, went back to the queue, or waits for its time."""
        task = self.scheduling.core.tasks.get(action.ref)
        job = self.book.get(str(task.owner)) if task is not None else None
        if job is not None and task is not None:
            if action.state is TaskState.RUNNING:
                job.attempt_started(task.worker_id, trio.current_time())
            elif job.started_at:
                job.attempt_ended(task.last_error, trio.current_time())
                if self.journal is not None:
                    text = history_to_json(job.history or [], self.book.wall_offset)
                    self.journal.job_history(job.ref, text)
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
            str(action.owner),  # the desk queues every task with its job's id as owner
            _FINAL[action.state],
            now,
            result=action.result,
            error=action.error,
            failed_post=action.state is TaskState.FAILED_POST,
        )
        if job is None:
            return
        job.reason = action.reason
        self._went(job)
        if self.journal is not None:
            self.journal.job_finished(job)
            if job.ref in self._leased:
                self._leased.discard(job.ref)
                self.journal.job_unleased(job.ref)
        if self.on_finished is not None:
            self.on_finished(job)
        self._tell(job, now)

    def _tell(self, job: Job, now: float) -> None:
        door = self.doors.get(job.door)
        if door is None:
            self.delivered(job.id, now)  # nobody to tell: keep it for retention
        else:
            self.apply(door, door.job_finished(job, now), now)

    def _expire(self, now: float) -> None:
        for job in self.book.expire(now):
            if self.journal is not None:
                self.journal.job_forgotten(job.ref)
            door = self.doors.get(job.door)
            if door is not None:
                door.forget(job)

    # ------------------------------------------------------------ refused by the journal

    def rejected(self, changes: list[Rejected]) -> None:
        """The committer's hook: the journal could not store these changes (their values; the
        rest of their batch is written). Marks their jobs; `committed` settles them."""
        for change in changes:
            job = self._job_by_ref(change.ref) if change.ref else None
            if job is None:
                continue
            added = change.added or self._refused.get(job.id, (False, ""))[0]
            self._refused[job.id] = (added, change.reason)

    def committed(self) -> None:
        """The committer's hook after each commit: release the answers that waited for it
        (those about a refused job are screened), then settle the refused jobs: a job whose
        first record could not be stored is refused at its door (UDP: an `internal` error
        acknowledgement instead of the acknowledgement; HTTP: 500; Redis: a `failed`
        outcome) and taken back from any worker; a job that lost a later change fails,
        with an error saying why."""
        self.write_ahead.release()
        if not self._refused:
            return
        refused, self._refused = self._refused, {}
        now = trio.current_time()
        for job_id, (added, reason) in refused.items():
            job = self.book.get(job_id)
            if job is not None:
                self._refuse(job, added, reason, now)

    def _refuse(self, job: Job, added: bool, reason: str, now: float) -> None:
        if added:
            error = f"the journal cannot record this job ({reason})"
        else:
            error = f"the journal cannot record a change of this job ({reason})"
        log.warning("job %r refused: %s", job.id[:200], error)
        live = job.final is None
        if live:
            self.book.finish(job.id, JobState.FAILED, now, error=error)
            self._went(job)
        else:
            job.final = JobState.FAILED
            job.result = b""
            job.error = error
            job.updated_at = now
        job.reason = "error"
        actions = self.scheduling.core.cancel(job.ref, now) if live else []
        if actions:
            self.scheduling.execute(actions)  # a worker holding it gets it taken back
        if self.on_finished is not None:
            self.on_finished(job)
        door = self.doors.get(job.door)
        if door is not None:
            door.forget(job)  # nothing more goes out about what it was
        if added and job.door != "redis":
            self.book.discard(job)  # the submitter was told it failed: it never was
            return
        if not added and self.journal is not None:
            self.journal.job_finished(job)
        if job.delivered:
            return
        self._tell(job, now)

    def _job_by_ref(self, ref: int) -> Job | None:
        task = self.scheduling.core.tasks.get(ref)
        if task is not None:
            return self.book.get(str(task.owner))
        return next((job for job in self.book if job.ref == ref), None)  # ended: rare

    # ------------------------------------------------------------ recovery

    def recover(self, recovered: Recovered, now: float) -> None:
        """Put the journal's jobs back: pending ones in the queue, working ones up for
        adoption by their re-registering worker, ended ones in the book (with outcomes
        not yet delivered told again)."""
        wall = time.time()
        core = self.scheduling.core
        self.book.wall_offset = wall - now
        core.continue_numbering(recovered.first_worker_id, recovered.next_ref)
        counts: dict[str, int] = {}
        picked = [row.task_id for row in recovered.jobs if row.door != "udp"]
        if picked:  # numbers the controller picks stay unique among live jobs after a restart
            self._picked = itertools.count(max(FIRST_PICKED_TASK_ID, max(picked) + 1))
        defaults = core.defaults
        for queue in recovered.paused:
            core.pause(queue)
        for row in recovered.jobs:
            counts[row.state] = counts.get(row.state, 0) + 1
            options = from_json(row.options, defaults) if row.options else defaults
            key: object = (row.host, row.port) if row.door == "udp" else None
            job = Job(
                id=row.id,
                ref=row.ref,
                task_id=row.task_id,
                door=row.door,
                key=key,
                payload=row.payload,
                notes=notes_of(row.name, row.info_url, row.download_url),
                added_at=row.added_at - self.book.wall_offset,
                updated_at=now,
                attempts=row.attempts,
                options=options,
            )
            job.ran_on = row.ran_on
            job.history = history_from_json(row.history, self.book.wall_offset)
            for line in row.log:
                job.add_log(line, self.max_log_size)
            if row.output:
                job.add_output(row.output, self.output_retention)
            if row.state in ("scheduled", "pending", "working"):
                left = options.placement_timeout - (wall - row.queued_at)
                core.recover(
                    row.ref,
                    row.task_id,
                    row.payload,
                    row.id,
                    now,
                    running=row.state == "working",
                    attempts=row.attempts,
                    failed_on=tuple(row.failed_on),
                    placement_left=left,
                    # A poller's job waits a lease_timeout for its holder to renew.
                    grace=max(RECOVERY_GRACE, core.pollers.lease_timeout)
                    if row.lease
                    else RECOVERY_GRACE,
                    lease=row.lease,
                    options=options,
                    base=row.base,
                    wait=row.queued_at - wall if row.state == "scheduled" else None,
                )
                if row.lease:
                    self._leased.add(row.ref)
                job.task = core.tasks[row.ref]
                self.book.add(job)
                self._came(job)
                continue
            job.final = JobState(row.state)
            job.result = row.result
            job.error = row.error
            job.usage = usage_from_text(row.usage)
            job.reason = row.reason
            job.failed_post = row.failed_post
            self.book.add(job)
            if row.notified:
                retain = None if row.expires_at is None else row.expires_at - wall
                self.book.retain(job, now, retain)
            else:
                self._tell(job, now)
        if recovered.jobs or recovered.pruned:
            summary = ", ".join(f"{n} {state}" for state, n in sorted(counts.items())) or "none"
            log.info(
                "journal: recovered %d jobs (%s), pruned %d expired; worker ids continue at %d",
                len(recovered.jobs),
                summary,
                recovered.pruned,
                recovered.first_worker_id,
            )
        self._timer.poke()

"""The job book: the one record of every job, whatever door it came in by. Pure.

Every door (UDP, HTTP, Redis) turns its requests into jobs here, and reads
them back here: duplicate detection (a job's `id` is unique while its record
is kept), status questions, results. The book also picks the wire numbers
(`task_id`) of jobs whose door gives none. The journal persists exactly these
records, and recovery rebuilds the book from it.

A job's state uses the state names of docs/http-api.md ("States"): scheduled, pending,
requested, working, finished, failed, canceled, deleted. While a job is
live its state is read from the scheduler's task it is attached to (so the
book costs nothing per placement); once it ends, the book stores the final
state, the result or error, and when the record may be forgotten.

Time is an argument (`now`, the shells' trio clock); `wall_offset` turns it
into wall-clock seconds for the timestamps a person reads.
"""

from __future__ import annotations

import itertools
import json
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from controller.core.model import WAITING, Task, TaskState
from controller.deadlines import Deadlines
from controller.job_ids import DoorName
from controller.job_states import JobState
from controller.options import DEFAULT as DEFAULT_OPTIONS
from controller.options import JobOptions
from controller.progress import clean as clean_progress
from controller.usage import Usage, usage_from_row

# Records forgotten per expire() call: deletes reach the journal in bounded batches,
# and a backlog after a restart does not stall the event loop.
MAX_FORGET_PER_CALL = 1000


# A live job's state, from its scheduler task's: the one mapping of task states to job states.
_FROM_TASK = {
    TaskState.SCHEDULED: JobState.SCHEDULED,
    TaskState.QUEUED: JobState.PENDING,
    TaskState.ASSIGNING: JobState.REQUESTED,
    TaskState.RUNNING: JobState.WORKING,
    TaskState.ORPHAN: JobState.WORKING,
    TaskState.SUCCESS: JobState.FINISHED,
    TaskState.ERROR: JobState.FAILED,
    TaskState.FAILED_POST: JobState.FAILED,
    TaskState.CANCELED: JobState.CANCELED,
}


def live_state(task_state: TaskState) -> JobState:
    """A live job's state, from the state of its scheduler task."""
    return _FROM_TASK[task_state]


def udp_job_id(host: str, port: int, task_id: int) -> str:
    """A UDP job's id: the submitter's address and number (its duplicate-detection key)."""
    return f"udp-{host}-{port}-{task_id}"


# Numbers the controller picks for the worker wire (`task_id`) of jobs that come with none
# (HTTP, Redis): above what UDP clients usually number their tasks with, unique among live jobs.
FIRST_PICKED_TASK_ID = 1 << 32

# Bytes of log text a job keeps by default (config: max_log_size).
DEFAULT_MAX_LOG_SIZE = 65536
# Bytes of output a job keeps by default (config: output_retention).
DEFAULT_OUTPUT_RETENTION = 1048576


@dataclass(eq=False, slots=True)
class JobNotes:
    """What a person gave a job or was told about it, kept apart from `Job` because most
    jobs have none of it: one field where four cost 24 bytes on every queued job."""

    name: str = ""
    info_url: str = ""
    download_url: str = ""
    log: deque[str] = field(default_factory=deque)
    log_size: int = 0  # bytes of `log` (UTF-8)
    output: bytearray | None = None  # what it wrote to stderr: the newest output_retention bytes
    output_total: int = 0  # bytes of output ever appended (what a follower has seen is counted so)
    # What its worker last reported of its running attempt (controller/progress.py): shown,
    # not journaled; None until it reports.
    progress: float | None = None
    status: str = ""


def notes_of(name: str = "", info_url: str = "", download_url: str = "") -> JobNotes | None:
    """The notes for a new job (None when it has none)."""
    if not (name or info_url or download_url):
        return None
    return JobNotes(name, info_url, download_url)


# Why a job failed (the job object's `reason`); None while it has not failed.
REASONS = ("limit", "error", "timeout", "lost", "placement")


@dataclass(eq=False, slots=True)
class Attempt:
    """One time a worker had the job: who, from when to when (trio clock; 0: unknown, or
    not ended), how it ended (`finished`, `failed`, `canceled`, or "" while it runs), the
    error it gave and what it used (None: not measured)."""

    worker: int
    started: float
    ended: float = 0.0
    outcome: str = ""
    error: str = ""
    usage: Usage | None = None


@dataclass(eq=False, slots=True)
class Job:
    id: str
    ref: int  # the scheduler's and the journal's handle
    task_id: int  # the number on the worker wire
    door: DoorName
    key: object  # the door's own handle: a UDP job's client address
    payload: bytes = b""
    notes: JobNotes | None = None  # name, links, log lines: None for most (UDP, Redis) jobs
    added_at: float = 0.0  # trio clock
    updated_at: float = 0.0
    attempts: int = 0
    result: bytes = b""
    error: str = ""
    failed_post: bool = False
    ran_on: int = 0  # the worker that held it last (kept once it ended)
    task: Task | None = None  # the scheduler's record while the job is live
    final: JobState | None = None  # set once the job ended
    expires_at: float = 0.0  # 0: kept until its outcome is delivered
    delivered: bool = False  # the submitter has the outcome (or repeats ran out)
    options: JobOptions = DEFAULT_OPTIONS  # queue, priority, labels, time, retry rules
    started_at: float = 0.0  # when its latest attempt started (0: none, or unknown)
    # Its attempts that ended without ending the job (None for most jobs: kept only then).
    history: list[Attempt] | None = None
    # What its latest attempt used, once its worker said (None: not measured, or none ran).
    usage: Usage | None = None
    # Why it failed: one of REASONS; "" while it has not (the job object shows null).
    reason: str = ""

    def attempts_made(self) -> list[Attempt]:
        """Every attempt, oldest first: the ended ones, then the latest (running, or the one
        that ended the job)."""
        made = list(self.history or ())
        if self.started_at or (self.final is not None and self.ran_on):
            if self.final is None:
                made.append(Attempt(self.worker, self.started_at))
            elif self.final is not JobState.DELETED or self.ran_on:
                outcome = self.final.value
                made.append(
                    Attempt(
                        self.ran_on,
                        self.started_at,
                        self.updated_at,
                        outcome,
                        self.error,
                        self.usage,
                    )
                )
        return made

    def attempt_started(self, worker: int, now: float) -> None:
        self.ran_on = worker
        self.started_at = now
        self.usage = None  # this attempt's comes with its outcome

    def attempt_ended(self, error: str, now: float) -> None:
        """Its running attempt ended without ending the job (it failed, or its worker was
        lost): kept in `history`."""
        if not self.started_at and not self.ran_on:
            return
        if self.history is None:
            self.history = []
        self.history.append(Attempt(self.ran_on, self.started_at, now, "failed", error, self.usage))
        if self.notes is not None:  # its progress was that attempt's
            self.notes.progress, self.notes.status = None, ""
        self.started_at = 0.0

    @property
    def name(self) -> str:
        return self.notes.name if self.notes is not None else ""

    @property
    def info_url(self) -> str:
        return self.notes.info_url if self.notes is not None else ""

    @property
    def download_url(self) -> str:
        return self.notes.download_url if self.notes is not None else ""

    @property
    def log(self) -> list[str]:
        """The lines pollers sent about it (a copy)."""
        return list(self.notes.log) if self.notes is not None else []

    def add_log(self, line: str, limit: int = DEFAULT_MAX_LOG_SIZE) -> None:
        """Append a log entry, keeping at most `limit` bytes of log text (UTF-8): the oldest
        entries go first, whole; an entry longer than `limit` keeps its newest bytes."""
        if self.notes is None:
            self.notes = JobNotes()
        notes = self.notes
        raw = line.encode("utf-8", "surrogatepass")
        if len(raw) > limit:
            raw = raw[len(raw) - limit :]
            start = 0
            while start < len(raw) and raw[start] & 0xC0 == 0x80:  # a cut character's tail
                start += 1
            raw = raw[start:]
            line = raw.decode("utf-8", "surrogatepass")
        while notes.log and notes.log_size + len(raw) > limit:
            notes.log_size -= len(notes.log.popleft().encode("utf-8", "surrogatepass"))
        notes.log.append(line)
        notes.log_size += len(raw)

    @property
    def output(self) -> bytes:
        """What it wrote to stderr (the newest bytes kept)."""
        notes = self.notes
        return bytes(notes.output) if notes is not None and notes.output is not None else b""

    def add_output(self, data: bytes, limit: int = DEFAULT_OUTPUT_RETENTION) -> bytes:
        """Append to its output, keeping the newest `limit` bytes; what was appended (the
        newest `limit` bytes of `data`)."""
        if self.notes is None:
            self.notes = JobNotes()
        notes = self.notes
        notes.output_total += len(data)
        if len(data) > limit:
            data = data[len(data) - limit :]
        if notes.output is None:
            notes.output = bytearray(data)
        else:
            notes.output += data
            over = len(notes.output) - limit
            if over > 0:
                del notes.output[:over]
        return data

    def output_since(self, seen: int) -> tuple[int, bytes]:
        """(bytes of output ever appended, those after the first `seen` that are still kept)."""
        notes = self.notes
        if notes is None or notes.output is None:
            return seen, b""
        total = notes.output_total
        if total <= seen:
            return total, b""
        return total, bytes(notes.output[-(total - seen) :])

    @property
    def progress(self) -> float | None:
        """How far it is (0 to 1), as its worker last reported; None when it has not."""
        return self.notes.progress if self.notes is not None else None

    @property
    def progress_status(self) -> str:
        """What its worker last said it does, with its progress ("" when nothing)."""
        return self.notes.status if self.notes is not None else ""

    def reported(self, progress: object, status: object, ref: int = 0) -> bool:
        """Its worker's report (hostile: cleaned by controller/progress.py; `ref`: the task
        the worker holds, when not 0), kept unless it is bad, not its running task's, or the
        job has ended (it keeps its last values); whether it was kept."""
        value = clean_progress(progress, status)
        if value is None or self.state.final or (ref and ref != self.ref):
            return False
        if self.notes is None:
            self.notes = JobNotes()
        self.notes.progress, self.notes.status = value
        return True

    def drop_output(self) -> None:
        if self.notes is not None:
            self.notes.output = None

    @property
    def state(self) -> JobState:
        if self.final is not None:
            return self.final
        task = self.task
        if task is not None:
            return _FROM_TASK[task.state]
        # No task yet: it waits for the jobs its option `after` names (the desk holds it).
        return JobState.WAITING if self.options.after else JobState.PENDING

    @property
    def worker(self) -> int:
        """The worker that holds it from `requested` on; once it ended, the one that held it
        last (0: none; a job back to pending or scheduled names none)."""
        task = self.task
        if task is None:
            return self.ran_on if self.final is not None else 0
        if task.worker_id or task.state in WAITING:
            return task.worker_id
        return self.ran_on  # recovered after a restart: its holder has not spoken yet


class JobBook:
    """Every job by id, and the retention deadlines of finished ones. (A job is found by its
    ref only while live, and then its scheduler task names its id: no second index, which
    cost ~52 bytes a job.)"""

    def __init__(self, *, result_retention: float = 3600.0) -> None:
        self.result_retention = result_retention
        self.wall_offset = 0.0  # wall-clock seconds = now + wall_offset
        self._by_id: dict[str, Job] = {}
        self._deadlines: Deadlines[Job] = Deadlines()
        self.next_deadline = self._deadlines.next
        self._picked = itertools.count(FIRST_PICKED_TASK_ID)

    def pick_task_id(self) -> int:
        """A wire number for a job whose door gives none."""
        return next(self._picked)

    def continue_picking(self, highest: int) -> None:
        """Pick numbers above `highest`, a number a previous run picked (after a restart)."""
        self._picked = itertools.count(max(FIRST_PICKED_TASK_ID, highest + 1))

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[Job]:
        return iter(self._by_id.values())

    def get(self, job_id: str) -> Job | None:
        return self._by_id.get(job_id)

    def add(self, job: Job) -> Job:
        """Record a new job (its id must not be taken: doors check with `get` first)."""
        if job.id in self._by_id:
            raise ValueError(f"job {job.id!r} already exists")
        self._by_id[job.id] = job
        return job

    def discard(self, job: Job) -> None:
        """Forget `job` at once: it was refused after all (the journal could not record it)."""
        if self._by_id.get(job.id) is job:
            del self._by_id[job.id]

    def finish(
        self,
        job_id: str,
        state: JobState,
        now: float,
        *,
        result: bytes = b"",
        error: str = "",
        failed_post: bool = False,
    ) -> Job | None:
        """The job ended: keep its outcome. None for an unknown or an ended job."""
        job = self._by_id.get(job_id)
        if job is None or job.final is not None:
            return None
        task = job.task
        if task is not None:
            job.attempts = task.attempts
            if task.worker_id:
                job.ran_on = task.worker_id
        job.final = state
        job.task = None
        job.result = result
        job.error = error
        job.failed_post = failed_post
        job.updated_at = now
        return job

    def revive(self, job: Job, task: Task, now: float) -> None:
        """An ended job runs again (a user retried it): live, attached to `task`, its outcome
        and retention gone."""
        job.final = None
        job.task = task
        job.result = b""
        job.error = ""
        job.reason = ""
        job.failed_post = False
        job.delivered = False
        job.expires_at = 0.0  # a retention deadline already in the heap is skipped
        job.updated_at = now

    def delete(self, job: Job, now: float) -> None:
        """Soft delete: payload and result dropped, the record kept until its retention."""
        job.final = JobState.DELETED
        job.payload = b""
        job.result = b""
        job.updated_at = now

    def latest(
        self, limit: int, state: JobState | None = None, queue: str | None = None
    ) -> list[Job]:
        """The newest jobs first, at most `limit`, in `state` and `queue` if given; deleted
        ones only when asked for (an operator's query: it may look at many records)."""
        return list(itertools.islice(self.matching(state, queue), limit))

    def matching(
        self, state: JobState | None = None, queue: str | None = None, search: str = ""
    ) -> Iterator[Job]:
        """The jobs of a filter, newest first: in `state` (deleted ones only when asked for),
        in `queue`, whose id or name holds `search` (case aside). Do not change the book
        while reading it."""
        needle = search.casefold()
        for job in reversed(self._by_id.values()):
            if queue is not None and job.options.queue != queue:
                continue
            job_state = job.state
            if state is None:
                if job_state is JobState.DELETED:
                    continue
            elif job_state is not state:
                continue
            if needle and needle not in job.id.casefold() and needle not in job.name.casefold():
                continue
            yield job

    def count(self, state: JobState) -> int:
        """How many jobs are in `state` now (for status views)."""
        return sum(1 for job in self._by_id.values() if job.state is state)

    def retain(self, job: Job, now: float, retain_for: float | None = None) -> None:
        """Its outcome was delivered (or given up on): forget it after `result_retention`."""
        job.delivered = True
        keep = self.result_retention if retain_for is None else max(0.0, retain_for)
        job.expires_at = now + keep
        self._deadlines.push(job.expires_at, job)

    def forget(self, job: Job) -> None:
        """Forget a job now (its retention deadline, if any, is then skipped)."""
        if self._by_id.get(job.id) is job:
            del self._by_id[job.id]

    def expire(self, now: float) -> list[Job]:
        """Forget the jobs whose retention is over (at most MAX_FORGET_PER_CALL a call)."""
        gone: list[Job] = []
        deadlines = self._deadlines
        while len(gone) < MAX_FORGET_PER_CALL:
            due = deadlines.pop_due(now)
            if due is None:
                break
            when, job = due
            if self._by_id.get(job.id) is not job or job.expires_at != when:
                continue
            del self._by_id[job.id]
            gone.append(job)
        return gone


def history_to_json(history: list[Attempt], wall_offset: float) -> str:
    """Ended attempts as the journal keeps them (wall-clock times)."""
    return json.dumps(
        [
            [
                a.worker,
                a.started + wall_offset if a.started else 0,
                a.ended + wall_offset,
                a.outcome,
                a.error,
                *([a.usage.to_row()] if a.usage is not None else []),
            ]
            for a in history
        ],
        separators=(",", ":"),
    )


def history_from_json(text: str, wall_offset: float) -> list[Attempt] | None:
    """The journal's ended attempts back on the trio clock (None: there are none)."""
    if not text:
        return None
    rows = json.loads(text)
    return [
        Attempt(
            int(worker),
            float(started) - wall_offset if started else 0.0,
            float(ended) - wall_offset,
            str(outcome),
            str(error),
            usage_from_row(usage[0]) if usage else None,  # (journals before usage: none)
        )
        for worker, started, ended, outcome, error, *usage in rows
    ] or None

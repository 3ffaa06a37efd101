"""The scheduler: one queue of tasks, placed on workers of any kind. No I/O, no clock.

How it works: tasks wait in a FIFO queue and idle workers in an
insertion-ordered dict, the most recently idle taken first (under light
load one worker stays warm instead of all taking turns). `_dispatch` pairs them and
asks the worker's kind to hand the task over (`WorkerKind.place`: a SET_TASK
dial for a local worker). The kind reports back through the methods under
"what the worker kinds report": accepted, refused, finished, failed, lost.
Retries, `max_retries`, "prefer a worker it has not failed on", the
placement timeout and `task_timeout` are decided here once, for every kind.

Deadlines of every part of the core live in one heap (`controller.deadlines`)
with lazy deletion: each entry names its handler, and the handler checks the
record it names when it comes due. Lookups are dicts; nothing scans all
workers or all tasks.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from controller.core.model import (
    Action,
    Task,
    TaskEvent,
    TaskFinished,
    TaskProgress,
    TaskState,
    Worker,
    WorkerEvent,
)
from controller.deadlines import Deadlines
from controller.options import DEFAULT as DEFAULT_OPTIONS
from controller.options import JobOptions

log = logging.getLogger("controller.core")

# A deadline's handler: (the time it was due, its record, now, actions to add to).
Handler = Callable[[float, object, float, list[Action]], None]


@dataclass
class Counters:
    """Running totals for status and metrics."""

    submitted: int = 0
    succeeded: int = 0
    errors: int = 0
    failed_post: int = 0
    canceled: int = 0
    retries: int = 0
    restarts_sent: int = 0
    registered: int = 0
    worker_losses: dict[str, int] = field(default_factory=dict)


class Scheduler:
    def __init__(
        self,
        *,
        max_retries: int = 3,
        timeout_task_placement: float = 30.0,
        task_timeout: float = 0.0,
    ) -> None:
        self.max_retries = max_retries
        self.timeout_task_placement = timeout_task_placement
        self.task_timeout = task_timeout
        self.workers: dict[int, Worker] = {}
        self.tasks: dict[int, Task] = {}  # live (unfinished) tasks by ref
        self.counters = Counters()
        self.deadlines: Deadlines[tuple[Handler, object]] = Deadlines()
        # Placement deadlines, one per queued task, the task found by its ref when due. Most
        # come in order (now + the same timeout): those go in two deques side by side, the
        # deadline and the ref (two pointers to objects the task holds anyway: 16 bytes an
        # entry); the rest (a task back in the queue with the time it had left) in a heap of
        # (when, ref) pairs (72). With 100,000 jobs queued the pairs alone were 6 MB.
        self._when_in_order: deque[float] = deque()
        self._ref_in_order: deque[int] = deque()
        self._placements: list[tuple[float, int]] = []
        self.next_ref = 1
        # Called for every task that is placed on a worker or ends: it can no longer be
        # claimed by a worker that held it before a restart (see recovery.py).
        self.on_settled: Callable[[Task], None] | None = None
        self._queue: deque[Task] = deque()
        self._queued = 0  # tasks in state QUEUED (the deque may hold stale entries)
        self._idle: dict[int, Worker] = {}

    # ------------------------------------------------------------ queries

    @property
    def queued(self) -> int:
        return self._queued

    @property
    def idle_workers(self) -> int:
        return len(self._idle)

    def task_state(self, ref: int) -> TaskState | None:
        """State of a live task, None once it has finished."""
        task = self.tasks.get(ref)
        return task.state if task is not None else None

    def next_deadline(self) -> float:
        first = self.deadlines.next()
        if self._placements:
            first = min(first, self._placements[0][0])
        if self._when_in_order:
            first = min(first, self._when_in_order[0])
        return first

    # ------------------------------------------------------------ tasks in

    def submit(
        self,
        task_id: int,
        payload: bytes,
        owner: object,
        now: float,
        options: JobOptions = DEFAULT_OPTIONS,
        wait: float = 0.0,
    ) -> Task:
        """Queue a new task (the caller dispatches); with `wait` > 0 it is scheduled."""
        if task_id < 1:
            raise ValueError(f"task_id must be >= 1, got {task_id}")
        task = Task(ref=self.next_ref, task_id=task_id, payload=payload, owner=owner)
        task.opts = options
        task.created_at = now
        self.next_ref += 1
        self.tasks[task.ref] = task
        self.counters.submitted += 1
        self.enqueue(task, now)
        return task

    def expire(self, now: float, actions: list[Action]) -> None:
        """Run every deadline at or before `now`, then place what can be placed."""
        deadlines = self.deadlines
        while (due := deadlines.pop_due(now)) is not None:
            when, (handler, obj) = due
            handler(when, obj, now, actions)
        placements, whens, refs = self._placements, self._when_in_order, self._ref_in_order
        while True:  # the two kinds of placement deadline merged, earliest first
            if whens and whens[0] <= now and not (placements and placements[0][0] < whens[0]):
                when, ref = whens.popleft(), refs.popleft()
            elif placements and placements[0][0] <= now:
                when, ref = heapq.heappop(placements)
            else:
                break
            task = self.tasks.get(ref)
            if task is not None:
                self._placement_due(when, task, now, actions)
        self.dispatch(actions)

    def at(self, when: float, handler: Handler, obj: object) -> None:
        """Call `handler` once `when` has come (it must check that `obj` still needs it)."""
        self.deadlines.push(when, (handler, obj))

    # ------------------------------------------------------------ what the worker kinds report

    def add_worker(self, worker: Worker) -> None:
        self.workers[worker.worker_id] = worker
        self.counters.registered += 1

    def ready(self, worker: Worker) -> None:
        """The worker can take a task (the caller dispatches)."""
        worker.advance(WorkerEvent.READY)
        self._idle[worker.worker_id] = worker

    def accepted(self, worker: Worker, now: float, actions: list[Action]) -> None:
        task = worker.task
        assert task is not None
        task.attempts += 1
        worker.advance(WorkerEvent.ACCEPTED)
        task.advance(TaskEvent.ACCEPTED)
        actions.append(progress(task, waited=now - task.queued_at))
        if self.task_timeout > 0:
            self.start_clock(task, now)

    def refused(self, worker: Worker, now: float, actions: list[Action]) -> None:
        """The worker was busy: the task goes back to the head of the queue, no attempt used."""
        task = worker.task
        assert task is not None
        worker.advance(WorkerEvent.REFUSED)
        worker.task = None
        self._requeue(task, now, actions)

    def finished(self, worker: Worker, result: bytes, now: float, actions: list[Action]) -> None:
        task = self._release(worker)
        worker.done += 1
        task.advance(TaskEvent.SUCCEED)
        self.counters.succeeded += 1
        self._finish(task, actions, now, result=result)

    def failed(self, worker: Worker, error: str, now: float, actions: list[Action]) -> None:
        """The task failed on the worker (which stays usable): retry it elsewhere."""
        task = self._release(worker)
        task.failed_on_worker(worker.worker_id)
        task.last_error = error
        log.info("task %d failed on worker %d: %s", task.task_id, worker.worker_id, error[-200:])
        self.retry(task, now, actions)

    def lost(
        self,
        worker: Worker,
        now: float,
        actions: list[Action],
        *,
        cause: str,
        blame: bool = True,
    ) -> None:
        """Forget the worker; re-place its task (`blame`: the task counts it as a failure)."""
        del self.workers[worker.worker_id]
        self._idle.pop(worker.worker_id, None)
        if cause != "shutdown":
            losses = self.counters.worker_losses
            losses[cause] = losses.get(cause, 0) + 1
        task = worker.task
        worker.task = None
        if task is None:
            return
        if blame and task.state is TaskState.RUNNING:
            task.failed_on_worker(worker.worker_id)
            if not task.last_error:
                task.last_error = f"worker {worker.worker_id} lost ({cause})"
            self.retry(task, now, actions)
        else:
            self._requeue(task, now, actions)

    def take_back(self, worker: Worker, now: float, actions: list[Action], cause: str) -> None:
        """Stop the worker's task by force and count the worker lost."""
        self.counters.restarts_sent += 1
        worker.kind.take_back(worker, actions)
        self.lost(worker, now, actions, cause=cause)

    def cancel(self, ref: int, now: float, actions: list[Action]) -> bool:
        """A user canceled the task: it ends now and is never placed again. A worker that
        holds it has it taken back (a local worker gets RESTART). False: no such live task."""
        task = self.tasks.get(ref)
        if task is None:
            return False
        if task.state is TaskState.QUEUED:
            self.unqueue(task)
        worker = self.workers.get(task.worker_id) if task.worker_id else None
        task.advance(TaskEvent.CANCEL)
        task.worker_id = 0
        if worker is not None and worker.task is task:
            worker.task = None
            self.counters.restarts_sent += 1
            worker.kind.take_back(worker, actions)
            self.lost(worker, now, actions, cause="its job was canceled")
        self.counters.canceled += 1
        self._finish(task, actions, now, error="canceled")
        return True

    def holds(self, worker: Worker, task: Task, now: float) -> None:
        """`worker` turned out to hold `task` already (recovery): it runs there."""
        self._idle.pop(worker.worker_id, None)
        worker.advance(WorkerEvent.ADOPT)
        task.advance(TaskEvent.ADOPT)
        worker.task = task
        task.worker_id = worker.worker_id
        if self.task_timeout > 0:
            self.start_clock(task, now)

    # ------------------------------------------------------------ the queue

    def enqueue(
        self, task: Task, now: float, front: bool = False, placement_left: float | None = None
    ) -> None:
        left = self.timeout_task_placement if placement_left is None else max(0.0, placement_left)
        task.queued_at = now
        task.deadline = when = now + left
        whens = self._when_in_order
        if not whens or when >= whens[-1]:
            whens.append(when)
            self._ref_in_order.append(task.ref)
        else:
            heapq.heappush(self._placements, (when, task.ref))
        self._queued += 1
        if front:
            self._queue.appendleft(task)
        else:
            self._queue.append(task)

    def unqueue(self, task: Task) -> None:
        """A queued task leaves the queue other than by dispatch (its entry is skipped lazily)."""
        self._queued -= 1

    def dispatch(self, actions: list[Action]) -> None:
        """Give queued tasks to idle workers, oldest task first."""
        queue = self._queue
        idle = self._idle
        while queue and idle:
            task = queue.popleft()
            if task.state is not TaskState.QUEUED:
                continue  # timed out or adopted while queued
            worker = self._pick(task)
            if self.on_settled is not None:
                self.on_settled(task)
            del idle[worker.worker_id]
            self._queued -= 1
            worker.advance(WorkerEvent.ASSIGN)
            task.advance(TaskEvent.PLACE)
            worker.task = task
            task.worker_id = worker.worker_id
            worker.kind.place(worker, task, actions)

    def _pick(self, task: Task) -> Worker:
        """The most recently idle worker, skipping those this task already failed on if
        possible."""
        idle = self._idle
        if not task.failed_on:
            return next(reversed(idle.values()))
        # At most len(failed_on) idle workers can be excluded, so this looks at few.
        for worker in itertools.islice(reversed(idle.values()), len(task.failed_on) + 1):
            if worker.worker_id not in task.failed_on:
                return worker
        return next(reversed(idle.values()))

    # ------------------------------------------------------------ endings and retries

    def retry(self, task: Task, now: float, actions: list[Action]) -> None:
        """The task's attempt failed: queue it again, or end it once retries are used up."""
        if task.attempts > self.max_retries:
            task.worker_id = 0
            task.advance(TaskEvent.FAIL)
            self.counters.errors += 1
            self._finish(
                task,
                actions,
                now,
                error=f"failed {task.attempts} times; last error: {task.last_error}",
            )
            return
        self.counters.retries += 1
        self._requeue(task, now, actions)

    def _requeue(self, task: Task, now: float, actions: list[Action]) -> None:
        was_running = task.state is not TaskState.ASSIGNING
        task.advance(TaskEvent.REQUEUE)
        task.worker_id = 0
        self.enqueue(task, now, front=True)
        if was_running:
            actions.append(progress(task))

    def _release(self, worker: Worker) -> Task:
        task = worker.task
        assert task is not None
        worker.advance(WorkerEvent.FETCHED)
        worker.task = None
        self._idle[worker.worker_id] = worker
        return task

    def _finish(
        self,
        task: Task,
        actions: list[Action],
        now: float,
        *,
        result: bytes = b"",
        error: str = "",
    ) -> None:
        del self.tasks[task.ref]
        if self.on_settled is not None:
            self.on_settled(task)
        task.payload = b""
        actions.append(
            TaskFinished(
                task.ref,
                task.task_id,
                task.owner,
                task.state,
                result=result,
                error=error,
                age=now - task.created_at,
            )
        )

    def start_clock(self, task: Task, now: float) -> None:
        """The task runs from now on: arm its task_timeout (callers check there is one)."""
        task.deadline = now + self.task_timeout
        self.at(task.deadline, self._running_due, task)

    # ------------------------------------------------------------ deadlines

    def _placement_due(self, when: float, task: Task, now: float, actions: list[Action]) -> None:
        if task.state is TaskState.QUEUED and task.deadline == when:
            self._queued -= 1
            task.advance(TaskEvent.PLACEMENT_TIMEOUT)
            self.counters.failed_post += 1
            limit = f"{self.timeout_task_placement:g}"
            self._finish(task, actions, now, error=f"no free worker within {limit} s")

    def _running_due(self, when: float, obj: object, now: float, actions: list[Action]) -> None:
        assert isinstance(obj, Task)
        if obj.state is TaskState.RUNNING and obj.deadline == when:
            worker = self.workers[obj.worker_id]
            log.warning(
                "task %d ran longer than task_timeout %g s on worker %d; restarting it",
                obj.task_id,
                self.task_timeout,
                worker.worker_id,
            )
            obj.last_error = f"exceeded task_timeout of {self.task_timeout:g} s"
            self.take_back(worker, now, actions, cause="task timeout")


def progress(task: Task, waited: float = 0.0) -> TaskProgress:
    """The journal's and the metrics' view of a task that started or went back to the queue."""
    failed_on = tuple(sorted(task.failed_on))
    return TaskProgress(task.ref, task.state, task.attempts, failed_on, waited)

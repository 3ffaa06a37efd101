"""The scheduler: pending tasks placed on workers of any kind. No I/O, no clock.

How it works: pending tasks wait in `Pending` (pending.py: queues and labels filter,
priority orders, owners take turns) and idle workers in an insertion-ordered dict, the
most recently idle taken first (under light load one worker stays warm instead of all
taking turns). `dispatch` pairs them and asks the worker's kind to hand the task over
(`WorkerKind.place`: a SET_TASK dial for a local worker). The kind reports back through
the methods under "what the worker kinds report": accepted, refused, finished, failed,
lost. Each task's options (`Task.opts`) say its retries, retry delay, placement timeout
and timeout; "prefer a worker it has not failed on" and the times are decided here once,
for every kind. A task waiting for its time (a delay, run_at, or a retry's delay) is
SCHEDULED: a deadline puts it back among the pending. Queue limits (limits.py) count the
tasks placed per queue and hold a queue at its concurrency or out of tokens.

A busy channel worker may also hold the task after its running one (next_tasks.py).
Deadlines of every part of the core wait in one heap (`controller.deadlines`), except
placement deadlines, which have their own (placements.py: two deques and a heap). Both
delete lazily: each entry names its record (and in the heap its handler), which is checked
when it comes due. Lookups are dicts; nothing scans all workers or all tasks.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

from controller.core.limits import Limits
from controller.core.model import (
    Action,
    Counters,
    Task,
    TaskEvent,
    TaskFinished,
    TaskState,
    Worker,
    WorkerEvent,
    progress,
)
from controller.core.next_tasks import NextTasks
from controller.core.pending import Pending
from controller.core.placements import PlacementDeadlines
from controller.deadlines import Deadlines
from controller.options import JobOptions

log = logging.getLogger("controller.core")

# A deadline's handler: (the time it was due, its record, now, actions to add to).
Handler = Callable[[float, object, float, list[Action]], None]


class Scheduler:
    def __init__(
        self,
        *,
        max_retries: int = 3,
        timeout_task_placement: float = 30.0,
        task_timeout: float = 0.0,
        retry_delay: float = 0.0,
        rng: random.Random | None = None,
    ) -> None:
        # The options of a task submitted without any (the core's own tests, recovery of a
        # journal that kept none): the configuration's.
        self.defaults = JobOptions(
            max_retries=max_retries,
            placement_timeout=timeout_task_placement,
            timeout=task_timeout,
            retry_delay=retry_delay,
        )
        self.workers: dict[int, Worker] = {}
        self.live_by_kind: dict[str, int] = {}  # workers now, by their kind's label
        self.tasks: dict[int, Task] = {}  # live (unfinished) tasks by ref
        self.counters = Counters()
        self.deadlines: Deadlines[tuple[Handler, object]] = Deadlines()
        # Placement deadlines of the pending tasks that have one, by the task's ref.
        self.placements = PlacementDeadlines()
        self.next_ref = 1
        # Called for every task that is placed on a worker or ends: it can no longer be
        # claimed by a worker that held it before a restart (see recovery.py).
        self.on_settled: Callable[[Task], None] | None = None
        self.pending = Pending()
        self.limits = Limits(self.pending, self.at)
        self.scheduled = 0  # tasks waiting for their time
        # Grows whenever a worker arrives, leaves or changes what it serves.
        self.serving_version = 0
        self._idle: dict[int, Worker] = {}
        self._new_idle: list[Worker] = []  # idle since the last dispatch
        self.next_tasks = NextTasks(self)
        self._rng = rng if rng is not None else random.Random()

    # ------------------------------------------------------------ queries

    @property
    def queued(self) -> int:
        """Tasks pending (waiting for a worker)."""
        return self.pending.count

    @property
    def idle_workers(self) -> int:
        return len(self._idle)

    def task_state(self, ref: int) -> TaskState | None:
        """State of a live task, None once it has finished."""
        task = self.tasks.get(ref)
        return task.state if task is not None else None

    def next_deadline(self) -> float:
        return min(self.deadlines.next(), self.placements.next())

    # ------------------------------------------------------------ tasks in

    def submit(
        self,
        task_id: int,
        payload: bytes,
        job: object,
        now: float,
        options: JobOptions | None = None,
        wait: float = 0.0,
    ) -> Task:
        """Queue a new task (the caller dispatches); with `wait` > 0 it is scheduled that
        many seconds ahead. `options` None: the configuration's defaults."""
        if task_id < 1:
            raise ValueError(f"task_id must be >= 1, got {task_id}")
        task = Task(ref=self.next_ref, task_id=task_id, payload=payload, job=job)
        task.opts = self.defaults if options is None else options
        task.created_at = now
        self.next_ref += 1
        self.tasks[task.ref] = task
        self.counters.submitted += 1
        if wait > 0:
            self.schedule(task, now + wait)
        else:
            self.enqueue(task, now)
        return task

    def schedule(self, task: Task, when: float) -> None:
        """The task waits in state SCHEDULED until `when`, then is pending."""
        if task.state is not TaskState.SCHEDULED:
            task.advance(TaskEvent.WAIT)
            self.scheduled += 1
        task.deadline = when
        self.at(when, self._scheduled_due, task)

    def resubmit(self, task: Task, now: float) -> None:
        """A job that ended failed or canceled is back as `task` (its ref, its attempts so
        far), pending, with a fresh max_retries. The caller dispatches."""
        task.retried_at = task.attempts
        task.created_at = now
        self.tasks[task.ref] = task
        self.enqueue(task, now)

    def expire(self, now: float, actions: list[Action]) -> None:
        """Run every deadline at or before `now`, then place what can be placed."""
        deadlines = self.deadlines
        while (due := deadlines.pop_due(now)) is not None:
            when, (handler, obj) = due
            handler(when, obj, now, actions)
        placements = self.placements
        while (placement := placements.pop_due(now)) is not None:
            when, ref = placement
            task = self.tasks.get(ref)
            if task is not None:
                self.placement_due(when, task, now, actions)
        self.dispatch(actions, now)

    def at(self, when: float, handler: Handler, obj: object) -> None:
        """Call `handler` once `when` has come (it must check that `obj` still needs it)."""
        self.deadlines.push(when, (handler, obj))

    # ------------------------------------------------------------ what the worker kinds report

    def add_worker(self, worker: Worker) -> None:
        self.workers[worker.worker_id] = worker
        label = worker.kind.label
        self.live_by_kind[label] = self.live_by_kind.get(label, 0) + 1
        self.serving_version += 1
        self.counters.registered += 1

    def ready(self, worker: Worker) -> None:
        """The worker can take a task (the caller dispatches)."""
        worker.advance(WorkerEvent.READY)
        self._idle[worker.worker_id] = worker
        self._new_idle.append(worker)

    def serves(self, worker: Worker, queues: frozenset[str], labels: frozenset[str]) -> None:
        """What `worker` takes changed (a calculator's heartbeat said so)."""
        if worker.queues != queues or worker.labels != labels:
            worker.queues = queues
            worker.labels = labels
            worker.starved = -1
            self.serving_version += 1

    def accepted(self, worker: Worker, now: float, actions: list[Action]) -> None:
        task = worker.task
        assert task is not None
        task.attempts += 1
        worker.advance(WorkerEvent.ACCEPTED)
        task.advance(TaskEvent.ACCEPTED)
        actions.append(progress(task, waited=now - task.queued_at))
        if task.opts.timeout > 0:
            self.start_clock(task, now)
        self.next_tasks.offer(worker)

    def refused(self, worker: Worker, now: float, actions: list[Action]) -> None:
        """The worker was busy: the task goes back to the head of the queue, no attempt used."""
        task = worker.task
        assert task is not None
        worker.advance(WorkerEvent.REFUSED)
        worker.task = None
        self._requeue(task, now, actions)

    def finished(self, worker: Worker, result: bytes, now: float, actions: list[Action]) -> None:
        task = self._release(worker, now, actions)
        worker.done += 1
        task.advance(TaskEvent.SUCCEED)
        self.counters.succeeded += 1
        self._finish(task, actions, now, result=result)

    def failed(
        self, worker: Worker, error: str, now: float, actions: list[Action], *, limit: bool = False
    ) -> None:
        """The task failed on the worker (which stays usable): retry it elsewhere, after its
        retry_delay; one that hit a limit of its own (`limit`) ends now, since it would hit
        it again."""
        task = self._release(worker, now, actions)
        task.failed_on_worker(worker.worker_id)
        task.last_error = error
        log.info("task %d failed on worker %d: %s", task.task_id, worker.worker_id, error[-200:])
        if limit:
            task.worker_id = 0
            task.advance(TaskEvent.FAIL)
            self.counters.errors += 1
            self._finish(task, actions, now, error=error, reason="limit")
            return
        self.retry(task, now, actions, failed=True, reason="error")

    def lost(
        self,
        worker: Worker,
        now: float,
        actions: list[Action],
        *,
        cause: str,
        blame: bool = True,
        failed: bool = False,
    ) -> None:
        """Forget the worker; re-place its task (`blame`: the task counts it as an attempt;
        `failed`: as a failure too, so its retry_delay applies)."""
        del self.workers[worker.worker_id]
        self.live_by_kind[worker.kind.label] -= 1
        self.serving_version += 1
        self._idle.pop(worker.worker_id, None)
        self.next_tasks.lost(worker, now)
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
            reason = "timeout" if cause == "task timeout" else "lost"
            self.retry(task, now, actions, failed=failed, reason=reason)
        else:
            self._requeue(task, now, actions)

    def take_back(
        self, worker: Worker, now: float, actions: list[Action], cause: str, failed: bool = False
    ) -> None:
        """Stop the worker's task by force and count the worker lost."""
        self.counters.restarts_sent += 1
        worker.kind.take_back(worker, actions)
        self.lost(worker, now, actions, cause=cause, failed=failed)

    def cancel(self, ref: int, now: float, actions: list[Action]) -> bool:
        """A user canceled the task: it ends now and is never placed again. A worker that
        holds it has it taken back (a local worker gets RESTART). False: no such live task."""
        task = self.tasks.get(ref)
        if task is None:
            return False
        if task.state is TaskState.QUEUED:
            self.unqueue(task)
        elif task.state is TaskState.SCHEDULED:
            self.scheduled -= 1
        worker = self.workers.get(task.worker_id) if task.worker_id else None
        task.advance(TaskEvent.CANCEL)
        task.worker_id = 0
        if worker is not None and worker.task is task:
            worker.task = None
            self.take_back(worker, now, actions, cause="its job was canceled")
        elif worker is not None and worker.next is task:
            # Not started yet: the worker is asked to forget it (if it started meanwhile,
            # the outcome of the task before it says so, and the worker is restarted then).
            self.next_tasks.cancel(worker, task, actions)
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
        if not task.limited and task.opts.queue in self.limits.queues:
            self.limits.started(task, now)
        if task.opts.timeout > 0:
            self.start_clock(task, now)

    # ------------------------------------------------------------ the queue

    def enqueue(
        self, task: Task, now: float, front: bool = False, placement_left: float | None = None
    ) -> None:
        """The task is pending from now (`placement_left`: what is left of its placement
        timeout, after a restart)."""
        if task.limited:
            self.limits.ended(task, now)
        if task.state is not TaskState.QUEUED:
            task.advance(TaskEvent.DUE)
            self.scheduled -= 1
        task.queued_at = now
        limit = task.opts.placement_timeout
        if limit > 0:
            left = limit if placement_left is None else max(0.0, placement_left)
            task.deadline = when = now + left
            self.placements.push(when, task.ref)
        else:
            task.deadline = 0.0
        self.pending.add(task, front)

    def unqueue(self, task: Task) -> None:
        """A pending task leaves the queue other than by dispatch."""
        self.pending.remove(task)

    def dispatch(self, actions: list[Action], now: float) -> None:
        """Give pending tasks to idle workers: the most recently idle worker first, each the
        task the pending order gives it (see pending.py)."""
        pending = self.pending
        idle = self._idle
        limited = self.limits.queues
        while pending.count and idle:
            version = pending.version
            worker = None
            for candidate in reversed(idle.values()):
                if candidate.starved != version:
                    worker = candidate
                    break
            if worker is None:
                break  # nothing pending fits any idle worker
            task = pending.pick(worker)
            if task is None:
                worker.starved = version
                continue
            if task.failed_on and worker.worker_id in task.failed_on:
                worker = pending.other(task, worker, idle)
            if self.on_settled is not None:
                self.on_settled(task)
            del idle[worker.worker_id]
            worker.advance(WorkerEvent.ASSIGN)
            task.advance(TaskEvent.PLACE)
            worker.task = task
            task.worker_id = worker.worker_id
            if limited and task.opts.queue in limited:
                self.limits.started(task, now)
            worker.kind.place(worker, task, actions)
        nexts = self.next_tasks
        if self._new_idle or nexts.ahead or nexts.look_again:  # what after_dispatch acts on
            new_idle, self._new_idle = self._new_idle, []
            nexts.after_dispatch(new_idle, idle, actions, now)

    # ------------------------------------------------------------ endings and retries

    def retry(
        self,
        task: Task,
        now: float,
        actions: list[Action],
        *,
        failed: bool = False,
        reason: str = "lost",
    ) -> None:
        """The task's attempt failed (`failed`) or its worker was lost: queue it again (a
        failure after its retry_delay, a loss at once), or end it once retries are used up
        (`reason`: why this attempt ended, the job's once it ends so)."""
        tries = task.attempts - task.retried_at
        if tries > task.opts.max_retries:
            task.worker_id = 0
            task.advance(TaskEvent.FAIL)
            self.counters.errors += 1
            error = f"failed {task.attempts} times; last error: {task.last_error}"
            self._finish(task, actions, now, error=error, reason=reason)
            return
        self.counters.retries += 1
        wait = task.opts.retry_wait(tries, self._rng.uniform(0.8, 1.2)) if failed else 0.0
        if wait > 0:
            if task.limited:
                self.limits.ended(task, now)
            task.worker_id = 0
            self.schedule(task, now + wait)
            actions.append(progress(task))
            return
        self._requeue(task, now, actions)

    def _requeue(self, task: Task, now: float, actions: list[Action]) -> None:
        was_running = task.state is not TaskState.ASSIGNING
        task.advance(TaskEvent.REQUEUE)
        task.worker_id = 0
        self.enqueue(task, now, front=True)
        if was_running:
            actions.append(progress(task))

    def _release(self, worker: Worker, now: float, actions: list[Action]) -> Task:
        """The worker's task ended there: its next task runs now, else it is idle."""
        task = worker.task
        assert task is not None
        worker.last_done = task.task_id
        if self.next_tasks.promote(worker, now, actions):
            return task
        worker.advance(WorkerEvent.FETCHED)
        worker.task = None
        self.next_tasks.ahead.pop(worker.worker_id, None)
        if worker.dropping:  # it started its canceled next task: stop it
            worker.dropping = 0
            self.take_back(worker, now, actions, cause="its job was canceled")
            return task
        self._idle[worker.worker_id] = worker
        self._new_idle.append(worker)
        return task

    def _finish(
        self,
        task: Task,
        actions: list[Action],
        now: float,
        *,
        result: bytes = b"",
        error: str = "",
        reason: str = "",
    ) -> None:
        del self.tasks[task.ref]
        if task.limited:
            self.limits.ended(task, now)
        if self.on_settled is not None:
            self.on_settled(task)
        task.payload = b""
        actions.append(
            TaskFinished(
                task.ref,
                task.task_id,
                task.job,
                task.state,
                result=result,
                error=error,
                age=now - task.created_at,
                reason=reason,
            )
        )

    def start_clock(self, task: Task, now: float) -> None:
        """The task runs from now on: arm its timeout (callers check there is one)."""
        task.deadline = now + task.opts.timeout
        self.at(task.deadline, self._running_due, task)

    # ------------------------------------------------------------ deadlines

    def placement_due(self, when: float, task: Task, now: float, actions: list[Action]) -> None:
        """The placement deadline `when` of `task` came: it fails if it still waits."""
        if task.deadline == when and task.state is TaskState.ASSIGNING:
            self.next_tasks.placement_due(task, actions)  # a worker's next task, if held
        elif task.deadline == when and task.state is TaskState.QUEUED:
            self.pending.remove(task)
            task.advance(TaskEvent.PLACEMENT_TIMEOUT)
            self.counters.placement_timeouts += 1
            why = f"no free worker within {task.opts.placement_timeout:g} s"
            self._finish(task, actions, now, error=why, reason="placement")

    def _scheduled_due(self, when: float, obj: object, now: float, actions: list[Action]) -> None:
        assert isinstance(obj, Task)
        if obj.state is TaskState.SCHEDULED and obj.deadline == when:
            self.enqueue(obj, now)
            actions.append(progress(obj))

    def _running_due(self, when: float, obj: object, now: float, actions: list[Action]) -> None:
        assert isinstance(obj, Task)
        if obj.state is TaskState.RUNNING and obj.deadline == when:
            worker = self.workers[obj.worker_id]
            limit = obj.opts.timeout
            log.warning(
                "task %d ran longer than its timeout of %g s on worker %d; restarting it",
                obj.task_id,
                limit,
                worker.worker_id,
            )
            obj.last_error = f"exceeded its timeout of {limit:g} s"
            self.take_back(worker, now, actions, cause="task timeout", failed=True)

"""`Core`: the scheduler, the local worker kind and recovery, behind one face. No I/O, no clock.

The shells feed events with the current time and carry out the actions that
come back; `expire(now)` handles the deadlines that passed and
`next_deadline()` says when to call it next (the style of h11 and wsproto).
"""

from __future__ import annotations

import itertools
from collections.abc import Set

from controller import declared
from controller.core.calculators import Calculators
from controller.core.limits import Rate
from controller.core.local import LocalWorkers
from controller.core.model import (
    WAITING,
    Action,
    Counters,
    DialDone,
    Event,
    PulseReceived,
    Task,
    TaskState,
    Worker,
    WorkerExited,
    WorkerState,
)
from controller.core.pollers import Pollers
from controller.core.recovery import Recovery
from controller.core.scheduler import Scheduler
from controller.options import JobOptions

# Characters of a worker's queues, and of its labels, in the status report (which must fit
# one datagram): past it the list ends with ",...".
STATUS_NAMES = 40


class Core:
    def __init__(
        self,
        *,
        max_retries: int = 3,
        timeout_task_placement: float = 30.0,
        task_timeout: float = 0.0,
        retry_delay: float = 0.0,
        first_worker_id: int = 1,
        claim_timeout: float = 300.0,
        lease_timeout: float = 30.0,
        calculator_timeout: float = 5.0,
        forget_remote_after: float = 3600.0,
    ) -> None:
        self.scheduler = Scheduler(
            max_retries=max_retries,
            timeout_task_placement=timeout_task_placement,
            task_timeout=task_timeout,
            retry_delay=retry_delay,
        )
        self.recovery = Recovery(self.scheduler)
        self.local = LocalWorkers(self.scheduler, self.recovery, first_worker_id)
        # Remote workers' names and addresses are forgotten forget_remote_after seconds after
        # they were last heard (the shell passes result_retention).
        self.pollers = Pollers(
            self.scheduler, self.recovery, claim_timeout, lease_timeout, forget_remote_after
        )
        self.calculators = Calculators(
            self.scheduler, self.recovery, calculator_timeout, forget_remote_after
        )
        # The shells' hot paths call these directly: no dispatch on the event's type,
        # no extra frame (`handle` does the same for any event).
        self.pulse = self.local.pulse
        self.dial_done = self.local.dial_done
        self.exited = self.local.exited
        self.next_deadline = self.scheduler.next_deadline
        # Put back a task a previous run had accepted but not finished (see recovery.py).
        self.recover = self.recovery.recover

    # ------------------------------------------------------------ the shared records

    @property
    def workers(self) -> dict[int, Worker]:
        return self.scheduler.workers

    @property
    def tasks(self) -> dict[int, Task]:
        return self.scheduler.tasks

    @property
    def counters(self) -> Counters:
        return self.scheduler.counters

    @property
    def queued(self) -> int:
        return self.scheduler.queued

    @property
    def scheduled(self) -> int:
        """Tasks waiting for their time (a delay, run_at, or a retry's delay)."""
        return self.scheduler.scheduled

    @property
    def idle_workers(self) -> int:
        return self.scheduler.idle_workers

    @property
    def next_worker_id(self) -> int:
        return self.local.next_worker_id

    def worker_name(self, worker_id: int) -> str:
        """How status views name a worker: a poller's name, a calculator's host:port, a local
        worker's number."""
        return (
            self.pollers.names.get(worker_id)
            or self.calculators.names.get(worker_id)
            or str(worker_id)
        )

    def task_state(self, ref: int) -> TaskState | None:
        return self.scheduler.task_state(ref)

    @property
    def defaults(self) -> JobOptions:
        """The options of a task that comes with none (the configuration's)."""
        return self.scheduler.defaults

    @property
    def paused(self) -> Set[str]:
        """The queues whose tasks are not handed out now."""
        return self.scheduler.pending.paused

    @property
    def serving_version(self) -> int:
        """Grows whenever a worker arrives, leaves or changes what it serves."""
        return self.scheduler.serving_version

    # ------------------------------------------------------------ driving it

    def handle(self, event: Event, now: float) -> list[Action]:
        """Apply one event; return what the shells must do."""
        if isinstance(event, PulseReceived):
            return self.local.pulse(event, now)
        if isinstance(event, DialDone):
            return self.local.dial_done(event, now)
        if isinstance(event, WorkerExited):
            return self.local.exited(event, now)
        raise TypeError(f"not a core event: {event!r}")

    def submit(
        self,
        task_id: int,
        payload: bytes,
        job: object,
        now: float,
        options: JobOptions | None = None,
        wait: float = 0.0,
        dispatch: bool = True,
    ) -> tuple[Task, list[Action]]:
        """Queue a new task (after `wait` seconds when > 0: scheduled); returns it and the
        actions (a SET_TASK when a worker is free; none without `dispatch`: the caller
        calls `dispatch` when it may go)."""
        task = self.scheduler.submit(task_id, payload, job, now, options, wait)
        actions: list[Action] = []
        if dispatch:
            self.scheduler.dispatch(actions, now)
        return task, actions

    def dispatch(self, now: float) -> list[Action]:
        """Hand pending tasks to the workers free to take them."""
        actions: list[Action] = []
        self.scheduler.dispatch(actions, now)
        return actions

    def reserve_ref(self) -> int:
        """A ref for a job that is not queued yet (it waits for others: `release` queues it)."""
        ref = self.scheduler.next_ref
        self.scheduler.next_ref += 1
        return ref

    def release(
        self,
        ref: int,
        task_id: int,
        payload: bytes,
        job: object,
        options: JobOptions,
        now: float,
        wait: float = 0.0,
    ) -> tuple[Task, list[Action]]:
        """Queue, under the ref `reserve_ref` gave, a job whose wait for others is over (after
        `wait` seconds when > 0: scheduled); returns its task and the actions."""
        scheduler = self.scheduler
        task = Task(ref=ref, task_id=task_id, payload=payload, job=job)
        task.opts = options
        task.created_at = now
        scheduler.tasks[ref] = task
        scheduler.counters.submitted += 1
        if wait > 0:
            scheduler.schedule(task, now + wait)
        else:
            scheduler.enqueue(task, now)
        actions: list[Action] = []
        scheduler.dispatch(actions, now)
        return task, actions

    def resubmit(
        self,
        ref: int,
        task_id: int,
        payload: bytes,
        job: object,
        options: JobOptions,
        attempts: int,
        now: float,
    ) -> tuple[Task, list[Action]]:
        """Put a task that ended failed or canceled back to pending with a fresh max_retries
        (its attempts go on counting) and the same ref; returns it and the actions."""
        task = Task(ref=ref, task_id=task_id, payload=payload, job=job, attempts=attempts)
        task.opts = options
        self.scheduler.resubmit(task, now)
        actions: list[Action] = []
        self.scheduler.dispatch(actions, now)
        return task, actions

    def cancel(self, ref: int, now: float) -> list[Action]:
        """End live task `ref` now, never to be placed again (a worker holding it has it
        taken back: a local worker gets RESTART); nothing when it is not live."""
        actions: list[Action] = []
        if self.scheduler.cancel(ref, now, actions):
            self.scheduler.dispatch(actions, now)  # a worker it freed, a queue limit's room
        return actions

    def pause(self, queue: str) -> None:
        """Hand out none of `queue`'s tasks until `resume` (they stay pending)."""
        self.scheduler.pending.pause(queue)

    def resume(self, queue: str, now: float) -> list[Action]:
        """Hand out `queue`'s tasks again; returns the placements that follow."""
        self.scheduler.pending.resume(queue)
        actions: list[Action] = []
        self.scheduler.dispatch(actions, now)
        return actions

    def limit(
        self, queue: str, concurrency: int | None, rate: Rate | None, now: float
    ) -> list[Action]:
        """Set `queue`'s limits (None: none): at most `concurrency` of its tasks held by
        workers at once, and `rate` starts (a token bucket, full now); returns the placements
        that follow (a limit raised or removed lets more start). An operator's action: it looks
        at every live task once, to count the queue's running ones."""
        sched = self.scheduler
        held = [  # on workers, or running on one before a restart (an orphan: it counts)
            task
            for task in sched.tasks.values()
            if task.opts.queue == queue
            and (task.worker_id or task.state is TaskState.ORPHAN)
            and task.state not in WAITING
        ]
        sched.limits.set(queue, concurrency, rate, now, held)
        actions: list[Action] = []
        sched.dispatch(actions, now)
        return actions

    def limits(self, queue: str) -> tuple[int | None, Rate | None]:
        """`queue`'s (concurrency, rate), None for none."""
        return self.scheduler.limits.get(queue)

    @property
    def limited(self) -> Set[str]:
        """The queues with a limit."""
        return self.scheduler.limits.queues.keys()

    def expire(self, now: float) -> list[Action]:
        """Handle every deadline at or before `now`."""
        actions: list[Action] = []
        self.scheduler.expire(now, actions)
        return actions

    def continue_numbering(self, first_worker_id: int, next_ref: int) -> None:
        """Continue worker ids and task refs after those a previous run used."""
        self.local.next_worker_id = max(self.local.next_worker_id, first_worker_id)
        self.scheduler.next_ref = max(self.scheduler.next_ref, next_ref)

    def status(self, now: float, max_workers: int = 200) -> dict[str, object]:
        """What `udp-client status` shows: workers, and tasks by state (an operator's query,
        so it may look at every record)."""
        waiting = held = 0  # live tasks waiting for a worker, and those a worker holds
        for task in self.tasks.values():
            if task.state in WAITING:
                waiting += 1
            elif not task.state.finished:
                held += 1
        c = self.counters
        workers = [
            {
                "id": w.worker_id,
                "kind": w.kind.label,
                "name": self.worker_name(w.worker_id),
                "pid": w.pid,
                "state": w.state.value,
                "task": w.task.task_id if w.task is not None else 0,
                "last_pulse_s": round(now - w.last_pulse, 2),
                "done": w.done,
                "queues": declared.shown(w.queues, STATUS_NAMES),
                "labels": declared.shown(w.labels, STATUS_NAMES),
            }
            for w in itertools.islice(self.workers.values(), max_workers)
        ]
        kinds: dict[str, dict[str, int]] = {}
        for w in self.workers.values():
            kind = kinds.setdefault(w.kind.label, {"workers": 0, "idle": 0, "done": 0})
            kind["workers"] += 1
            kind["idle"] += w.state is WorkerState.IDLE
            kind["done"] += w.done
        # Remote workers that are not workers right now (a poller between jobs) did jobs too.
        for kind_of in (self.pollers, self.calculators):
            live = {w.worker_id for w in self.workers.values() if w.kind is kind_of}
            away = sum(n for wid, n in kind_of.roster.done.items() if wid not in live)
            if away:
                entry = kinds.setdefault(kind_of.label, {"workers": 0, "idle": 0, "done": 0})
                entry["done"] += away
        return {
            "workers": workers,
            "workers_total": len(self.workers),
            "kinds": kinds,
            "tasks": {
                "queued": waiting,
                "running": held,
                "success": c.succeeded,
                "error": c.errors,
                "failed_post": c.placement_timeouts,
            },
            "submitted": c.submitted,
            "registered": c.registered,
            "retries": c.retries,
            "restarts_sent": c.restarts_sent,
            "worker_losses": dict(c.worker_losses),
        }

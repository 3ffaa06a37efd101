"""Recovery after a controller restart: jobs a re-registering worker may still hold. Pure.

The journal gives back every task that was queued or running. A running one
becomes an orphan: it waits `grace` seconds for a worker whose pulse reports
its task_id, which then simply keeps it (no RESTART, no second run), and is
placed again otherwise. A queued one re-enters the queue but can be claimed
the same way, because the journal may be one commit behind a SET_TASK the
worker accepted. Two recovered tasks with the same number are never guessed
between: both are placed again.
"""

from __future__ import annotations

import logging

from controller.core.model import Action, Task, TaskState, Worker, progress
from controller.core.scheduler import Scheduler
from controller.options import JobOptions

log = logging.getLogger("controller.core")


class Recovery:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        # Recovered tasks a re-registering worker may still hold, by task_id, until they
        # are claimed, placed elsewhere or finished.
        self._orphans: dict[int, list[Task]] = {}

    def recover(
        self,
        ref: int,
        task_id: int,
        payload: bytes,
        job: object,
        now: float,
        *,
        running: bool,
        attempts: int = 0,
        failed_on: tuple[int, ...] = (),
        placement_left: float | None = None,
        grace: float = 3.0,
        lease: str = "",
        options: JobOptions | None = None,
        retried_at: int = 0,
        wait: float | None = None,
    ) -> None:
        """Put back a task a previous run had accepted but not finished (`lease`: the
        token its poller holds, which it must show to keep it; `wait`: it was scheduled,
        due that many seconds from now)."""
        sched = self.scheduler
        task = Task(ref=ref, task_id=task_id, payload=payload, job=job, attempts=attempts)
        task.opts = sched.defaults if options is None else options
        task.retried_at = retried_at
        task.lease = lease
        task.created_at = now
        task.failed_on = frozenset(failed_on)
        sched.tasks[ref] = task
        sched.next_ref = max(sched.next_ref, ref + 1)
        if wait is not None:  # waiting for its time: no worker can hold it
            sched.schedule(task, now + max(0.0, wait))
            return
        self._orphans.setdefault(task_id, []).append(task)
        sched.on_settled = self._settled  # until the last orphan is settled
        if running:
            task.state = TaskState.ORPHAN
            if task.opts.queue in sched.limits.queues:  # it may still run: it counts
                sched.limits.started(task, now, token=False)
            sched.at(now + grace, self._grace_due, task)
        else:
            sched.enqueue(task, now, placement_left=placement_left)

    def orphan(self, task_id: int) -> Task | None:
        """The one recovered task with this number that a worker may still claim, if any."""
        candidates = self._orphans.get(task_id)
        return candidates[0] if candidates is not None and len(candidates) == 1 else None

    def claim(self, worker: Worker, task_id: int, now: float, actions: list[Action]) -> bool:
        """`worker` reports holding `task_id`: give it the recovered task if that is unambiguous."""
        candidates = self._orphans.get(task_id)
        if candidates is None:
            return False
        if len(candidates) != 1:
            log.warning(
                "worker %d holds task %d, but %d recovered tasks have that number; "
                "not guessing: they will be placed again",
                worker.worker_id,
                task_id,
                len(candidates),
            )
            return False
        task = candidates[0]
        self._settled(task)
        if task.state is TaskState.QUEUED:
            self.scheduler.unqueue(task)
        self.scheduler.holds(worker, task, now)
        log.info("worker %d took over task %d after the restart", worker.worker_id, task_id)
        actions.append(progress(task))
        return True

    def _settled(self, task: Task) -> None:
        """The task was placed or ended: no worker can claim it any more."""
        if not self._orphans:
            return
        same = self._orphans.get(task.task_id)
        if same is None:
            return
        if task in same:
            same.remove(task)
        if not same:
            del self._orphans[task.task_id]
            if not self._orphans:
                self.scheduler.on_settled = None  # nothing left to claim: off the hot path

    def _grace_due(self, when: float, obj: object, now: float, actions: list[Action]) -> None:
        assert isinstance(obj, Task)
        if obj.state is TaskState.ORPHAN:
            self._settled(obj)
            log.info(
                "task %d was running before the restart and no worker claimed it; placing it again",
                obj.task_id,
            )
            obj.last_error = "its worker did not come back after a controller restart"
            self.scheduler.retry(obj, now, actions)

"""Next tasks: a busy channel worker holds the task after its running one. No I/O, no clock.

How it works (docs/protocol.md, "A next task"): a worker granted `takes_next` whose task is
running is in `ahead`; while tasks are pending that no idle worker can take, `hand` writes
each such worker one more (`WorkerKind.place`, a SET_TASK on its channel). The task is held
there in state ASSIGNING (the job is "requested"); when the running task's outcome comes,
`promote` makes it the worker's task, and only then does it count as an attempt, start its
timeout and report itself started. A held task is taken back with CTRL_DROP
(`WorkerKind.drop_next`): when the user cancels it (`dropping`), or when it should not wait
there any longer (`reclaiming`): a worker that can take it became idle, or its placement
timeout passed. The worker forgets it and answers, or, having started it already (the
outcome before it crossed the CTRL_DROP), says nothing: the outcome, read with the CTRL_DROP
unanswered, says it runs. A canceled task that runs is stopped with the worker (RESTART); a
reclaimed one simply runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from controller.core.limits import Limits
from controller.core.model import (
    Action,
    Task,
    TaskEvent,
    Worker,
    WorkerEvent,
    WorkerState,
    progress,
)
from controller.core.pending import Pending


class Host(Protocol):
    """What next tasks need of the scheduler (controller/core/scheduler.py)."""

    pending: Pending
    limits: Limits
    on_settled: Callable[[Task], None] | None

    def enqueue(
        self, task: Task, now: float, front: bool = False, placement_left: float | None = None
    ) -> None: ...

    def start_clock(self, task: Task, now: float) -> None: ...

    def placement_due(self, when: float, task: Task, now: float, actions: list[Action]) -> None: ...


class NextTasks:
    """The workers that may take a next task, and those that hold one."""

    def __init__(self, host: Host) -> None:
        self.host = host
        # Busy workers that take a next task and hold none, by id.
        self.ahead: dict[int, Worker] = {}
        # Workers that hold one not being taken back, by id.
        self.holding: dict[int, Worker] = {}
        # Workers whose next task is being taken back (CTRL_DROP on its way), by id.
        self.reclaims: set[int] = set()
        # A take-back came to nothing (the task started, or was canceled): the idle workers
        # look again at what is held.
        self.look_again = False

    def offer(self, worker: Worker) -> None:
        """`worker` may be handed a next task now, if it takes them and is free to."""
        if (
            worker.takes_next
            and worker.next is None
            and not worker.dropping
            and worker.state is WorkerState.BUSY
        ):
            self.ahead[worker.worker_id] = worker

    def after_dispatch(
        self, new_idle: list[Worker], idle: dict[int, Worker], actions: list[Action], now: float
    ) -> None:
        """After the scheduler gave idle workers what they can take: the workers that became
        idle since take back held tasks they can take; busy ones get next tasks."""
        if self.holding and (new_idle or self.look_again):
            if self.look_again:  # every idle worker not already waiting for one taken back
                self.look_again = False
                free = list(idle.values())[len(self.reclaims) :]
            else:
                free = [w for w in new_idle if w.worker_id in idle]
            self.reclaim_for(free, actions)
        if self.ahead and self.host.pending.count:
            self.hand(actions, now)

    def hand(self, actions: list[Action], now: float) -> None:
        """Give busy workers that take a next task one each, while tasks are pending that no
        idle worker can take (the scheduler's `dispatch` gave the idle ones all they could
        take just before)."""
        host = self.host
        pending = host.pending
        ahead = self.ahead
        limited = host.limits.queues
        version = pending.version
        for worker in list(ahead.values()):
            if not pending.count:
                return
            if worker.starved == version:
                continue
            task = pending.pick(worker)
            if task is None:
                worker.starved = version
                continue
            if task.failed_on and worker.worker_id in task.failed_on:
                pending.add(task, front=True)  # not where it failed: it waits for another
                worker.starved = version
                continue
            if host.on_settled is not None:
                host.on_settled(task)
            del ahead[worker.worker_id]
            task.advance(TaskEvent.PLACE)
            worker.next = task
            self.holding[worker.worker_id] = worker
            task.worker_id = worker.worker_id
            if limited and task.opts.queue in limited:
                host.limits.started(task, now)
            worker.kind.place(worker, task, actions)

    def reclaim_for(self, free: list[Worker], actions: list[Action]) -> None:
        """Workers that became idle found nothing pending: take back each held task one of
        them can take (one each), so that it does not wait behind a running one."""
        fits = self.host.pending.fits
        for worker in list(self.holding.values()):
            task = worker.next
            assert task is not None
            for other in free:
                if fits(other, task) and other.worker_id not in task.failed_on:
                    free.remove(other)
                    self._reclaim(worker, task, actions)
                    break
            if not free:
                return

    def placement_due(self, task: Task, actions: list[Action]) -> bool:
        """The placement timeout of `task` passed: taken back if it is held (it fails once
        the worker says it forgot it). False: it is not a held task."""
        worker = self.holding.get(task.worker_id)
        if worker is None or worker.next is not task:
            return False
        self._reclaim(worker, task, actions)
        return True

    def _reclaim(self, worker: Worker, task: Task, actions: list[Action]) -> None:
        del self.holding[worker.worker_id]
        worker.reclaiming = True
        self.reclaims.add(worker.worker_id)
        worker.kind.drop_next(worker, task, actions)

    def promote(self, worker: Worker, now: float, actions: list[Action]) -> bool:
        """The worker's task ended there: its next task (if any) runs now, and counts from
        now. False: it holds none."""
        task = worker.next
        if task is None:
            return False
        worker.advance(WorkerEvent.NEXT)
        worker.next = None
        self._reclaim_ended(worker)
        self.holding.pop(worker.worker_id, None)
        worker.task = task
        worker.unread = True  # a pulse may still name the task before, or none
        task.attempts += 1
        task.advance(TaskEvent.ACCEPTED)
        actions.append(progress(task, waited=now - task.queued_at))
        if task.opts.timeout > 0:
            self.host.start_clock(task, now)
        self.offer(worker)
        return True

    def answered(
        self, worker: Worker, refused: bool, task_id: int, now: float, actions: list[Action]
    ) -> None:
        """The worker forgot its next task `task_id` (a CTRL_DROP answer), or would not hold
        it (`refused`: a SET_TASK answered BUSY; it is handed no more)."""
        if refused:
            worker.takes_next = False
            self.ahead.pop(worker.worker_id, None)
        if worker.dropping and task_id == worker.dropping:
            worker.dropping = 0
            self.offer(worker)
            return
        task = worker.next
        if task is None or task.task_id != task_id or not (refused or worker.reclaiming):
            return
        worker.next = None
        worker.reclaiming = False
        self.reclaims.discard(worker.worker_id)
        self.holding.pop(worker.worker_id, None)
        self.offer(worker)
        # Back at the head of its queue with what is left of its placement timeout; none
        # left: it fails now (not handed to a busy worker again).
        self._requeue(task, now)
        if task.opts.placement_timeout > 0 and task.deadline <= now:
            self.host.placement_due(task.deadline, task, now, actions)

    def cancel(self, worker: Worker, task: Task, actions: list[Action]) -> None:
        """The user canceled `task`, the worker's next: the worker is asked to forget it (the
        CTRL_DROP of a reclaim on its way asks already)."""
        worker.next = None
        self.holding.pop(worker.worker_id, None)
        self.ahead.pop(worker.worker_id, None)
        worker.dropping = task.task_id
        if worker.reclaiming:
            self._reclaim_ended(worker)
        else:
            worker.kind.drop_next(worker, task, actions)

    def lost(self, worker: Worker, now: float) -> None:
        """The worker is gone: its next task, never started, is pending again at the head."""
        self.ahead.pop(worker.worker_id, None)
        self.holding.pop(worker.worker_id, None)
        task = worker.next
        if task is None:
            return
        worker.next = None
        worker.reclaiming = False
        self.reclaims.discard(worker.worker_id)
        self._requeue(task, now)

    def _reclaim_ended(self, worker: Worker) -> None:
        """The take-back of the worker's next task came to nothing."""
        if worker.reclaiming:
            worker.reclaiming = False
            self.reclaims.discard(worker.worker_id)
            self.look_again = True

    def _requeue(self, task: Task, now: float) -> None:
        """A held task, never started, is pending again at the head of its queue with what is
        left of its placement timeout."""
        task.advance(TaskEvent.REQUEUE)
        task.worker_id = 0
        left = task.deadline - now if task.opts.placement_timeout > 0 else None
        self.host.enqueue(task, now, front=True, placement_left=left)

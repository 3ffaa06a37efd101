"""Pollers: workers that ask the HTTP door for work (`GET /ping/`). Pure.

A poller exists for the scheduler while it waits in `/ping/` or holds a job.
Each `/ping/` names the queues it serves and the labels it has (the latest
counts). `ping` makes it an idle worker (its number is kept per name, so that "prefer a
worker the job has not failed on" works for pollers too); when the scheduler
places a job on it, the kind emits `HandOut` and the shell answers the waiting
request with that job (now `requested`). The poller confirms with
`PUT state=working` (accepted; then the same PUT renews its lease), and ends
with `finished` or `failed`. The claim carries a lease, a random token the
shell makes (`handed`): a report is taken only from the named poller holding
the job and showing that token (`holds`), so nobody who merely knows a
poller's name can report for it. A job not confirmed within `claim_timeout`, or
whose poller is silent for `lease_timeout`, is placed again (one attempt
used). A ping that ends with no job (`gave_up`) removes the idle poller.
"""

from __future__ import annotations

import hmac
import logging

from controller import declared
from controller.core.model import Action, HandOut, Task, Worker, WorkerEvent, WorkerState
from controller.core.recovery import Recovery
from controller.core.roster import Roster
from controller.core.scheduler import Scheduler

log = logging.getLogger("controller.core")

# Poller numbers live apart from local workers' (which the journal reserves in blocks).
FIRST_POLLER_ID = 1 << 40


class Pollers:
    """The poller worker kind."""

    label = "poller"

    def __init__(
        self,
        scheduler: Scheduler,
        recovery: Recovery,
        claim_timeout: float,
        lease_timeout: float,
        forget_after: float = 3600.0,
    ) -> None:
        self.scheduler = scheduler
        self.recovery = recovery
        self.claim_timeout = claim_timeout
        self.lease_timeout = lease_timeout
        self._by_name: dict[str, Worker] = {}
        # Numbers, names and done counts by name, forgotten forget_after seconds after the
        # poller was last heard (the HTTP door passes result_retention).
        self.roster: Roster[str] = Roster(
            scheduler, FIRST_POLLER_ID, forget_after, str, self._forget
        )
        self.names = self.roster.names

    # ------------------------------------------------------------ the scheduler's side

    def place(self, worker: Worker, task: Task, actions: list[Action]) -> None:
        """The shell answers the poller's waiting request, then calls `handed` (or
        `undeliverable` if that request is gone)."""
        actions.append(HandOut(self.names[worker.worker_id], task.ref, task.job))

    def take_back(self, worker: Worker, actions: list[Action]) -> None:
        """Nothing to send: the poller learns it at its next PUT (409)."""

    def drop_next(self, worker: Worker, task: Task, actions: list[Action]) -> None:
        """Never asked: a remote worker holds one task at a time."""

    # ------------------------------------------------------------ the HTTP door's side

    def ping(
        self, name: str, now: float, serves: declared.Declared = declared.DEFAULT
    ) -> list[Action]:
        """Poller `name` asks for work, serving `serves`' queues with its labels: it is an
        idle worker until it gets a job or gives up. (A poller already known stays as it
        is: idle, or holding its job; what it declares is updated.)"""
        sched = self.scheduler
        live = self._live(name)
        if live is not None:
            self.roster.heard(name, now)
            sched.serves(live, serves.queues, serves.labels)
            actions: list[Action] = []
            sched.dispatch(actions, now)  # what it serves may have changed
            return actions
        worker = self._new(name, now, serves)
        sched.ready(worker)
        actions = []
        sched.dispatch(actions, now)
        return actions

    def adopt(self, name: str, task_id: int, lease: str, now: float) -> bool:
        """Poller `name` reports on a job it held before the controller restarted: it keeps
        it (no second run) if that job is waiting to be claimed and `lease` is its lease."""
        if self._live(name) is not None:
            return False
        orphan = self.recovery.orphan(task_id)
        if orphan is None or not same_lease(orphan.lease, lease):
            return False
        worker = self._new(name, now)
        actions: list[Action] = []
        if self.recovery.claim(worker, task_id, now, actions):
            worker.deadline = now + self.lease_timeout
            self.scheduler.at(worker.deadline, self._deadline_due, worker)
            return True
        self.scheduler.lost(worker, now, actions, cause="shutdown")
        return False

    def _new(self, name: str, now: float, serves: declared.Declared = declared.DEFAULT) -> Worker:
        worker = self.roster.enlist(name, self, now, serves.queues, serves.labels)
        self._by_name[name] = worker
        return worker

    def gave_up(self, name: str, now: float) -> list[Action]:
        """Its /ping/ ended without a job (the wait ran out, or the client left)."""
        worker = self._live(name)
        actions: list[Action] = []
        if worker is not None and worker.state is WorkerState.IDLE:
            self.scheduler.lost(worker, now, actions, cause="shutdown")
        return actions

    def handed(self, name: str, now: float, lease: str) -> None:
        """The job went out in the /ping/ answer with `lease`: it must be confirmed within
        claim_timeout, and every report on it must show that lease."""
        worker = self._live(name)
        if worker is not None and worker.state is WorkerState.ASSIGNING:
            assert worker.task is not None
            worker.task.lease = lease
            worker.deadline = now + self.claim_timeout
            self.scheduler.at(worker.deadline, self._deadline_due, worker)

    def undeliverable(self, name: str, now: float) -> list[Action]:
        """The poller's request was gone: the job goes back to the head of the queue (no
        attempt used) and the poller is forgotten until it asks again."""
        worker = self._live(name)
        actions: list[Action] = []
        if worker is not None:
            if worker.state is WorkerState.ASSIGNING:
                self.scheduler.refused(worker, now, actions)
            self.scheduler.lost(worker, now, actions, cause="shutdown")
            self.scheduler.dispatch(actions, now)
        return actions

    def holds(self, name: str, ref: int, lease: str) -> bool:
        """Poller `name` holds job `ref` under `lease`."""
        worker = self._live(name)
        if worker is None or worker.task is None or worker.task.ref != ref:
            return False
        return same_lease(worker.task.lease, lease)

    def working(self, name: str, ref: int, now: float) -> list[Action]:
        """`PUT state=working`: the first confirms the job, the next ones renew the lease."""
        worker = self._held(name, ref)
        actions: list[Action] = []
        worker.last_pulse = now
        self.roster.heard(name, now)
        if worker.state is WorkerState.ASSIGNING:
            self.scheduler.accepted(worker, now, actions)
        worker.deadline = now + self.lease_timeout
        self.scheduler.at(worker.deadline, self._deadline_due, worker)
        return actions

    def finished(self, name: str, ref: int, result: bytes, now: float) -> list[Action]:
        worker = self._held(name, ref)
        actions: list[Action] = []
        if worker.state is WorkerState.ASSIGNING:  # finished without a working first
            self.scheduler.accepted(worker, now, actions)
        worker.advance(WorkerEvent.FETCH)
        self.scheduler.finished(worker, result, now, actions)
        self._ended(name, worker, now)
        self.scheduler.lost(worker, now, actions, cause="shutdown")  # it pings again for more
        self.scheduler.dispatch(actions, now)
        return actions

    def failed(self, name: str, ref: int, error: str, now: float) -> list[Action]:
        worker = self._held(name, ref)
        actions: list[Action] = []
        if worker.state is WorkerState.ASSIGNING:
            self.scheduler.accepted(worker, now, actions)
        worker.advance(WorkerEvent.FETCH)
        self.scheduler.failed(worker, error or f"poller {name} reported failure", now, actions)
        self._ended(name, worker, now)
        self.scheduler.lost(worker, now, actions, cause="shutdown")
        self.scheduler.dispatch(actions, now)
        return actions

    # ------------------------------------------------------------ helpers

    def _ended(self, name: str, worker: Worker, now: float) -> None:
        """A job ended on it: its done count outlives this life as a worker."""
        self.roster.heard(name, now)
        self.roster.done[worker.worker_id] = worker.done

    def _forget(self, name: str) -> None:
        self._by_name.pop(name, None)

    def _live(self, name: str) -> Worker | None:
        worker = self._by_name.get(name)
        if worker is None or self.scheduler.workers.get(worker.worker_id) is not worker:
            return None
        return worker

    def _held(self, name: str, ref: int) -> Worker:
        worker = self._live(name)
        assert worker is not None and worker.task is not None and worker.task.ref == ref, (
            "check holds() first"
        )
        return worker

    def _deadline_due(self, when: float, obj: object, now: float, actions: list[Action]) -> None:
        assert isinstance(obj, Worker)
        worker = obj
        sched = self.scheduler
        if sched.workers.get(worker.worker_id) is not worker or worker.deadline != when:
            return
        task = worker.task
        name = self.names[worker.worker_id]
        if worker.state is WorkerState.ASSIGNING and task is not None:
            log.warning(
                "poller %s did not confirm job %d in time; placing it again", name, task.ref
            )
            task.attempts += 1  # it may have started it: one attempt used
            task.failed_on_worker(worker.worker_id)
            task.last_error = f"poller {name} did not confirm within claim_timeout"
            worker.task = None
            sched.lost(worker, now, actions, cause="claim timeout")
            sched.retry(task, now, actions)
        elif worker.state is WorkerState.BUSY:
            log.warning("poller %s silent for lease_timeout; placing its job again", name)
            if task is not None:
                task.last_error = f"poller {name} silent for lease_timeout"
            sched.lost(worker, now, actions, cause="lease timeout")


def same_lease(expected: str, given: str) -> bool:
    """`given` is the lease `expected` (never when no lease was issued), compared in
    constant time."""
    return bool(expected) and hmac.compare_digest(
        expected.encode("utf-8", "surrogatepass"), given.encode("utf-8", "surrogatepass")
    )

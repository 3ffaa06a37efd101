"""Calculators: workers that speak the UDP door's datagrams (`worker --udp`). Pure.

A calculator registers (and stays alive) by `heartbeat`, keyed by its
(host, port); `ready` makes it an idle worker, `busy` keeps it out of the way.
Every heartbeat names the queues it serves and the labels it has; the latest
one counts.
A job placed on it goes out as `perform_task` (the `PerformTask` action; the
UDP door sends and repeats it). Its acknowledgement means the calculator has
the job (accepted); no acknowledgement within `dial_timeout` means it is
unavailable until its next `ready` heartbeat, and the job goes elsewhere
without using an attempt. Its `completed_task` ends the job, once: a report
for a job it does not hold is acknowledged by the door and ignored here. A
calculator silent for `calculator_timeout` is dead: its job is placed again
(one attempt used).
"""

from __future__ import annotations

import logging
import math

from controller import declared
from controller.core.model import (
    Action,
    PerformTask,
    Task,
    Worker,
    WorkerEvent,
    WorkerState,
)
from controller.core.recovery import Recovery
from controller.core.roster import Roster
from controller.core.scheduler import Scheduler

log = logging.getLogger("controller.core")

Address = tuple[str, int]

# Calculator numbers live apart from local workers' and pollers'.
FIRST_CALCULATOR_ID = 1 << 41
# Idle calculators gone silent are reported at most once per this many seconds, with a count:
# anyone who can send heartbeats from many ports must not be able to flood the log.
SILENT_REPORT_INTERVAL = 30.0


class Calculators:
    """The calculator worker kind."""

    label = "calculator"

    def __init__(
        self,
        scheduler: Scheduler,
        recovery: Recovery,
        timeout: float,
        forget_after: float = 3600.0,
    ) -> None:
        self.scheduler = scheduler
        self.recovery = recovery
        self.timeout = timeout
        self._by_addr: dict[Address, Worker] = {}
        # Numbers and names by address, forgotten forget_after seconds after the calculator
        # was last heard (result_retention).
        self.roster: Roster[Address] = Roster(
            scheduler, FIRST_CALCULATOR_ID, forget_after, _name, self._forget
        )
        self.addresses = self.roster.keys
        self.names = self.roster.names
        self.ignored_reports = 0
        self.silent_dropped = 0  # idle calculators dropped for silence, in all
        self._silent_unreported = 0
        self._silent_report_at = -math.inf

    # ------------------------------------------------------------ the scheduler's side

    def place(self, worker: Worker, task: Task, actions: list[Action]) -> None:
        address = self.addresses[worker.worker_id]
        task.lease = self.names[worker.worker_id]  # only this address may report on it
        actions.append(PerformTask(address, task.ref, task.task_id, task.payload))

    def take_back(self, worker: Worker, actions: list[Action]) -> None:
        """Nothing to send: a later report for the job is acknowledged and dropped."""

    def drop_next(self, worker: Worker, task: Task, actions: list[Action]) -> None:
        """Never asked: a remote worker holds one task at a time."""

    # ------------------------------------------------------------ the UDP door's side

    def heartbeat(
        self,
        address: Address,
        ready: bool,
        now: float,
        serves: declared.Declared = declared.DEFAULT,
    ) -> list[Action]:
        """A heartbeat: registers the calculator or refreshes it, with what it declares."""
        sched = self.scheduler
        worker = self._live(address)
        if worker is not None:
            self.roster.heard(address, now)
            sched.serves(worker, serves.queues, serves.labels)
        else:
            worker = self.roster.enlist(address, self, now, serves.queues, serves.labels)
            self._by_addr[address] = worker
            log.info("calculator %s registered", self.names[worker.worker_id])
        worker.last_pulse = now
        worker.deadline = now + self.timeout
        if not worker.armed:
            worker.armed = True
            sched.at(worker.deadline, self._deadline_due, worker)
        actions: list[Action] = []
        if ready and worker.state in (WorkerState.STARTING, WorkerState.UNSURE):
            sched.ready(worker)
            sched.dispatch(actions, now)
        elif worker.state is WorkerState.IDLE and worker.starved < 0:
            sched.dispatch(actions, now)  # what it serves changed: it may take a job now
        return actions

    def acknowledged(self, address: Address, ref: int, now: float) -> list[Action]:
        """It acknowledged `perform_task`: it has the job."""
        worker = self._holding(address, ref)
        actions: list[Action] = []
        if worker is not None and worker.state is WorkerState.ASSIGNING:
            self.scheduler.accepted(worker, now, actions)
        return actions

    def unacknowledged(self, address: Address, ref: int, now: float) -> list[Action]:
        """No acknowledgement within dial_timeout: unavailable until its next `ready`; the job
        goes to another worker without using an attempt."""
        worker = self._holding(address, ref)
        actions: list[Action] = []
        if worker is not None and worker.state is WorkerState.ASSIGNING:
            log.info(
                "calculator %s did not take its job (no acknowledgement, or busy); "
                "trying another worker",
                self.names[worker.worker_id],
            )
            self.scheduler.refused(worker, now, actions)
            self.scheduler.dispatch(actions, now)
        return actions

    def holding(self, address: Address) -> Task | None:
        """The task the calculator at `address` holds now, if any."""
        worker = self._live(address)
        return worker.task if worker is not None else None

    def held(self, address: Address, task_id: int) -> Task | None:
        """The task the calculator at `address` holds, if its number is `task_id`."""
        worker = self._live(address)
        task = worker.task if worker is not None else None
        return task if task is not None and task.task_id == task_id else None

    def completed(
        self, address: Address, task_id: int, ok: bool, output: bytes, error: str, now: float
    ) -> list[Action]:
        """Its `completed_task`; ignored (and counted) unless it holds that job."""
        worker = self._live(address)
        task = worker.task if worker is not None else None
        actions: list[Action] = []
        orphan = self.recovery.orphan(task_id) if worker is not None and task is None else None
        held_before_restart = (
            worker is not None
            and orphan is not None
            and orphan.lease == self.names[worker.worker_id]  # perform_task went here
            and worker.state is not WorkerState.ASSIGNING
            and self.recovery.claim(worker, task_id, now, actions)
        )
        if held_before_restart:  # a job it held before the controller restarted: its to report
            assert worker is not None
            task = worker.task
        if worker is None or task is None or task.task_id != task_id:
            self.ignored_reports += 1
            return []
        sched = self.scheduler
        if worker.state is WorkerState.ASSIGNING:  # the acknowledgement was lost
            sched.accepted(worker, now, actions)
        worker.advance(WorkerEvent.FETCH)
        if ok:
            sched.finished(worker, output, now, actions)
        else:
            sched.failed(worker, error or "the calculator reported an error", now, actions)
        self.roster.done[worker.worker_id] = worker.done
        sched.dispatch(actions, now)
        return actions

    # ------------------------------------------------------------ helpers

    def _forget(self, address: Address) -> None:
        self._by_addr.pop(address, None)

    def _live(self, address: Address) -> Worker | None:
        worker = self._by_addr.get(address)
        if worker is None or self.scheduler.workers.get(worker.worker_id) is not worker:
            return None
        return worker

    def _holding(self, address: Address, ref: int) -> Worker | None:
        worker = self._live(address)
        if worker is None or worker.task is None or worker.task.ref != ref:
            return None
        return worker

    def _deadline_due(self, when: float, obj: object, now: float, actions: list[Action]) -> None:
        assert isinstance(obj, Worker)
        worker = obj
        worker.armed = False
        if self.scheduler.workers.get(worker.worker_id) is not worker:
            return
        if worker.deadline > now:
            worker.armed = True
            self.scheduler.at(worker.deadline, self._deadline_due, worker)
            return
        name = self.names[worker.worker_id]
        if worker.task is not None:  # one line per job placed again (jobs are few)
            log.warning("calculator %s silent for calculator_timeout; dropping it", name)
        else:
            self._report_silent(name, now)
        self.scheduler.lost(worker, now, actions, cause="calculator silent")

    def _report_silent(self, name: str, now: float) -> None:
        """An idle calculator went silent: the first is logged, then one line with a count
        per SILENT_REPORT_INTERVAL."""
        self.silent_dropped += 1
        self._silent_unreported += 1
        if now < self._silent_report_at:
            return
        if self._silent_unreported == 1:
            log.warning("calculator %s silent for calculator_timeout; dropping it", name)
        else:
            log.warning(
                "%d idle calculators silent for calculator_timeout dropped since the last "
                "report (the latest %s)",
                self._silent_unreported,
                name,
            )
        self._silent_unreported = 0
        self._silent_report_at = now + SILENT_REPORT_INTERVAL


def _name(address: Address) -> str:
    """host:port, with an IPv6 host in brackets."""
    host = f"[{address[0]}]" if ":" in address[0] else address[0]
    return f"{host}:{address[1]}"

"""The calculators' side of the UDP door: what they say reaches the calculator worker kind.

The door's codec routes a calculator's datagrams here as actions (`Heartbeat`,
`Completed`, `CalculatorAck`); this shell calls the calculator kind of the core
(controller/core/calculators.py) with them and executes what it answers, as the HTTP
door does for pollers. Going out, a job the core places on a calculator becomes a
`perform_task` (`perform`), repeated by the `CalculatorLink` until it is acknowledged
or `dial_timeout` runs out (`expire`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import trio

from controller.config import Config
from controller.core import Action, PerformTask
from controller.doors.udp.actions import Send
from controller.doors.udp.calclink import (
    Address,
    CalculatorAction,
    CalculatorLink,
    Completed,
    Heartbeat,
)
from controller.shell.core_shell import CoreShell
from controller.shell.desk import JobDesk

# Transmission ids of perform_tasks: from the wall clock in ms (unique across restarts),
# far above the door's own notify_task ids.
TXID_OFFSET = 1 << 50


class CalculatorShell:
    """The calculators' traffic on the UDP door: into the core, perform_tasks out."""

    def __init__(
        self,
        config: Config,
        shell: CoreShell,
        desk: JobDesk,
        transmit: Callable[[Sequence[Send]], None],
        poke: Callable[[], None],
    ) -> None:
        """`transmit` sends datagrams from the door's socket; `poke` tells the door's timer
        that `next_deadline` may be earlier."""
        self.shell = shell
        self.desk = desk
        self.kind = shell.core.calculators
        self.link = CalculatorLink(
            dial_timeout=config.dial_timeout, first_txid=int(time.time() * 1000) + TXID_OFFSET
        )
        self.next_deadline = self.link.next_deadline
        self._transmit = transmit
        self._poke = poke
        self._live_tasks = shell.core.tasks

    def handle(self, action: CalculatorAction, now: float) -> None:
        """What a calculator said, for the calculator worker kind."""
        self.shell.execute(self._answer(action, now))

    def _answer(self, action: CalculatorAction, now: float) -> list[Action]:
        kind = self.kind
        if isinstance(action, Heartbeat):
            actions = kind.heartbeat(action.address, action.ready, now, action.serves)
            if action.progress is not None:
                self._progressed(action.address, *action.progress)
            return actions
        if isinstance(action, Completed):
            task = kind.held(action.address, action.task_id)
            if task is not None:  # kept with the job first: its followers see it before its end
                if action.job_output:
                    self.desk.task_output(task.ref, task.job, action.job_output)
                if action.usage is not None:
                    self.shell.attempt_used(task.ref, task.job, action.usage)
            return kind.completed(
                action.address, action.task_id, action.ok, action.output, action.error, now
            )
        acked = self.link.acked(action)
        if acked is None:  # not one of ours (or a copy)
            return []
        if not acked.refused:
            return kind.acknowledged(acked.address, acked.ref, now)
        return kind.unacknowledged(acked.address, acked.ref, now)

    def _progressed(self, address: Address, progress: object, status: object) -> None:
        """A busy heartbeat's progress, for the job the calculator holds."""
        task = self.kind.holding(address)
        job = self.desk.book.get(str(task.job)) if task is not None else None
        if job is not None and task is not None:
            self.desk.progressed(job, progress, status, task.ref)

    def perform(self, action: PerformTask) -> None:
        """A job placed on a calculator: perform_task now (the repeats come from `expire`).
        It reveals nothing a crash could take back from its submitter, so it does not wait
        for the journal."""
        now = trio.current_time()
        task = self._live_tasks.get(action.ref)
        if task is not None and task.lease:  # its holder's address, for after a restart
            self.desk.leased(action.ref, task.lease)
        data = self.link.perform(action.address, action.ref, action.task_id, action.payload, now)
        self._transmit((Send(data, action.address),))
        self._poke()

    def expire(self, now: float) -> list[Send]:
        """The perform_tasks to send again; those out of time go to another worker."""
        again, gave_up = self.link.expire(now)
        for unacked in gave_up:
            self.shell.execute(self.kind.unacknowledged(unacked.address, unacked.ref, now))
        return [Send(data, address) for data, address in again]

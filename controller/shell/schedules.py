"""Periodic jobs: at each due time of each schedule (config `schedules`), one job.

One task per schedule sleeps on trio's clock until its next due time, which is
wall-clock time (controller/schedules.py): it wakes, checks the wall clock, and
sleeps again if it woke early. Then it makes the job through the job desk like
the HTTP door does (door `http`, so the HTTP API lists and serves it), with the
schedule's queue and priority, owner `schedule-<name>`, no placement limit, and
the configured retries and timeout.

- A due time is made at most once: a job whose id is already in the job book is
  not made again, and the latest due time made (or skipped) is journaled per
  schedule, staged right after its job.
- At start a schedule with a journaled due time makes the latest due time at or
  before now if that is later (one job, however many were missed while no
  controller ran). A schedule without one starts from its next due time and
  journals the latest past one as its start, so that it too is caught up after
  a crash.
- A running controller that finds it fell behind (a stalled loop, a clock set
  forward) makes the due times it passed, in order, up to CATCH_UP of them;
  past that only the latest, as after a stop.
- With Redis, the job's id is claimed there first (`Claims`): only the
  controller whose claim succeeds makes it, so several controllers make one
  job per due time in all. While Redis cannot be reached the claim is retried
  until the next due time; then that due time is given up, and logged.
- Whatever is not made is logged: a journal that refuses new jobs, a job the
  journal could not record, a failure while making it (contained: the next due
  time comes all the same).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Protocol

import trio

from controller.config import Config
from controller.containment import contained
from controller.job_ids import DoorName
from controller.journal import Journal
from controller.options import rfc3339
from controller.schedules import Schedule
from controller.shell.desk import JobDesk

log = logging.getLogger("controller.schedules")

# Due times a running controller makes when it finds it fell behind by several; past that it
# makes only the latest, as after a stop (a clock set a day forward is not 86,400 jobs).
CATCH_UP = 10


class Claims(Protocol):
    """Where several controllers agree on who makes a due time's job (Redis)."""

    async def claim(self, job_id: str, until: float) -> bool | None:
        """True: this controller makes `job_id`; False: another does. None: nobody could be
        asked before wall-clock time `until` (the next due time)."""
        ...


class PeriodicJobs:
    """Makes the jobs of every schedule at their due times."""

    def __init__(
        self,
        config: Config,
        desk: JobDesk,
        journal: Journal | None = None,
        last_due: Mapping[str, float] | None = None,
        claims: Claims | None = None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        """`last_due`: the journal's latest due time per schedule name (recovered at start);
        `wall`: the wall clock (tests pass a fake one that follows trio's clock)."""
        self.schedules = config.schedules
        self.desk = desk
        self.journal = journal
        self.last_due = dict(last_due or {})
        self.claims = claims
        self.wall = wall
        self.made = 0
        defaults = config.job_options(DoorName.HTTP)
        self._options = {
            schedule.name: replace(
                defaults,
                queue=schedule.queue,
                priority=schedule.priority,
                owner=f"schedule-{schedule.name}",
            )
            for schedule in self.schedules
        }

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep every schedule, until cancelled. Start after the journal's jobs are back in
        the book (a due time made before a crash is not made again)."""
        async with trio.open_nursery() as nursery:
            for schedule in self.schedules:
                await nursery.start(self._keep, schedule)
            task_status.started()

    async def _keep(
        self, schedule: Schedule, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        now = self.wall()
        latest = schedule.latest_due(now)
        last = self.last_due.get(schedule.name)
        if last is None:
            self._done(schedule, latest)  # new: nothing before now is made
            log.info(
                "schedule %r: first job due at %s",
                schedule.name,
                rfc3339(schedule.next_due(now)),
            )
            task_status.started()
        elif latest > last:
            task_status.started()
            log.info(
                "schedule %r: making the job due at %s, missed while no controller ran",
                schedule.name,
                rfc3339(latest),
            )
            await self._contained(schedule, latest)
        else:
            task_status.started()
        due = schedule.next_due(now)
        while True:
            await self._sleep_until(due)
            for passed in self._passed(schedule, due):
                await self._contained(schedule, passed)
                due = schedule.next_due(passed)

    def _passed(self, schedule: Schedule, due: float) -> list[float]:
        """The due times from `due` to now, in order: more than one when the controller fell
        behind (a stalled loop, a clock set forward); past CATCH_UP of them, only the latest,
        as after a stop."""
        latest = schedule.latest_due(self.wall())
        passed = [due]
        while passed[-1] < latest:
            if len(passed) == CATCH_UP:
                log.warning(
                    "schedule %r: over %d due times passed at once (the clock was set forward?):"
                    " making only the latest, at %s",
                    schedule.name,
                    CATCH_UP,
                    rfc3339(latest),
                )
                return [latest]
            passed.append(schedule.next_due(passed[-1]))
        return passed

    async def _sleep_until(self, due: float) -> None:
        """Sleep on trio's clock until the wall clock reads `due` (again, if woken early:
        the two clocks drift apart, and the wall clock may be set back)."""
        left = due - self.wall()
        while left > 0:
            await trio.sleep(left)
            left = due - self.wall()

    def _done(self, schedule: Schedule, due: float) -> None:
        """`due` is made (or left to another controller): never again."""
        self.last_due[schedule.name] = due
        if self.journal is not None:
            self.journal.schedule_due(schedule.name, due)

    async def _contained(self, schedule: Schedule, due: float) -> None:
        """`_make`, where a failure (a bug) costs that due time alone."""
        try:
            await self._make(schedule, due)
        except Exception as exc:
            contained("making a periodic job", exc, trio.current_time(), schedule.job_id(due))

    async def _make(self, schedule: Schedule, due: float) -> None:
        name = schedule.name
        if due <= self.last_due.get(name, float("-inf")):
            return
        job_id = schedule.job_id(due)
        if self.desk.book.get(job_id) is not None:
            log.info("schedule %r: job %s exists already", name, job_id)
            self._done(schedule, due)
            return
        # A periodic job counts against max_pending and max_pending_bytes as any door's does;
        # refused before the claim, so that another controller with room may make it.
        full = self.desk.refusal_for(len(schedule.payload.encode()))
        if full:
            log.warning("schedule %r: job %s not made: %s", name, job_id, full)
            return
        if self.claims is not None:
            claimed = await self.claims.claim(job_id, schedule.next_due(due))
            if claimed is None:
                log.error(
                    "schedule %r: job %s not made: Redis could not be reached to claim it"
                    " before the next due time",
                    name,
                    job_id,
                )
                return
            if not claimed or self.desk.book.get(job_id) is not None:
                log.debug("schedule %r: job %s is made by another controller", name, job_id)
                self._done(schedule, due)
                return
        refusal = self.desk.refusal()
        if refusal:
            log.warning(
                "schedule %r: job %s not made: the journal cannot record new jobs now: %s",
                name,
                job_id,
                refusal,
            )
            return
        job = self.desk.submit(
            job_id,
            DoorName.HTTP,
            None,
            self.desk.book.pick_task_id(),
            schedule.payload.encode(),
            trio.current_time(),
            options=self._options[name],
        )
        self._done(schedule, due)
        await self.desk.write_ahead.committed()
        if self.desk.book.get(job_id) is not job:
            log.warning(
                "schedule %r: job %s not made: the journal could not record it: %s",
                name,
                job_id,
                job.error,
            )
            return
        self.made += 1
        log.debug("schedule %r: made job %s", name, job_id)

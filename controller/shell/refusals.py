"""The journal's refusals: jobs whose changes the journal could not store, settled.

The committer reports the changes a batch could not write (`rejected`: the rest of the
batch is written); the desk's held answers about those jobs are screened when they are
released (`JobDesk.refused`), and after the commit each job is settled here: a job whose
first record could not be stored is refused at its door (UDP: an `internal` error
acknowledgement instead of the acknowledgement; HTTP: 500; Redis: a `failed` outcome)
and taken back from any worker; a job that lost a later change fails, with an error
saying why.
"""

from __future__ import annotations

import logging

import trio

from controller.job_ids import DoorName
from controller.job_states import JobState
from controller.jobs import Job
from controller.journal import Rejected
from controller.shell.desk import JobDesk

log = logging.getLogger("controller")


class JournalRefusals:
    """The committer's two hooks (`rejected`, `committed`) for the desk's jobs."""

    def __init__(self, desk: JobDesk) -> None:
        self.desk = desk

    def rejected(self, changes: list[Rejected]) -> None:
        """The journal could not store these changes (their values; the rest of their batch
        is written). Marks their jobs; `committed` settles them."""
        refused = self.desk.refused
        for change in changes:
            job = self._job_by_ref(change.ref) if change.ref else None
            if job is None:
                continue
            added = change.added or refused.get(job.id, (False, ""))[0]
            refused[job.id] = (added, change.reason)

    def committed(self) -> None:
        """After each commit: release the answers that waited for it (those about a refused
        job are screened), then settle the refused jobs."""
        desk = self.desk
        desk.write_ahead.release()
        if not desk.refused:
            return
        refused, desk.refused = desk.refused, {}
        now = trio.current_time()
        for job_id, (added, reason) in refused.items():
            job = desk.book.get(job_id)
            if job is not None:
                self._refuse(job, added, reason, now)

    def _refuse(self, job: Job, added: bool, reason: str, now: float) -> None:
        desk = self.desk
        if added:
            error = f"the journal cannot record this job ({reason})"
        else:
            error = f"the journal cannot record a change of this job ({reason})"
        log.warning("job %r refused: %s", job.id[:200], error)
        live = job.final is None
        if live:
            desk.book.finish(job.id, JobState.FAILED, now, error=error)
            desk.went(job)
        else:
            job.final = JobState.FAILED
            job.result = b""
            job.error = error
            job.updated_at = now
        job.reason = "error"
        actions = desk.scheduling.core.cancel(job.ref, now) if live else []
        if actions:
            desk.scheduling.execute(actions)  # a worker holding it gets it taken back
        if desk.on_finished is not None:
            desk.on_finished(job)
        door = desk.doors.get(job.door)
        if door is not None:
            door.forget(job)  # nothing more goes out about what it was
        if added and job.door != DoorName.REDIS:
            desk.book.discard(job)  # the submitter was told it failed: it never was
            return
        if not added and desk.journal is not None:
            desk.journal.job_finished(job)
        if job.delivered:
            return
        desk.tell(job, now)

    def _job_by_ref(self, ref: int) -> Job | None:
        desk = self.desk
        task = desk.scheduling.core.tasks.get(ref)
        if task is not None:
            return desk.book.get(str(task.job))
        return next((job for job in desk.book if job.ref == ref), None)  # ended: rare

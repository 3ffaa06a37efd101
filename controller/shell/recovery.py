"""Recovery at start: the journal's jobs put back in the desk's book and the scheduler.

Pending jobs go back in the queue, waiting ones (option `after`) are held again (or let
go: what they waited for ended), jobs that were running wait a grace time for their
re-registering worker to claim them (`Core.recover`), ended jobs go back in the book,
and outcomes not yet delivered are told again.
"""

from __future__ import annotations

import logging
import time

from controller.core.limits import parse_rate
from controller.job_ids import DoorName
from controller.job_states import JobState
from controller.jobs import (
    Job,
    history_from_json,
    notes_of,
)
from controller.journal_file import Recovered
from controller.options import from_json
from controller.shell import waits
from controller.shell.desk import JobDesk
from controller.usage import usage_from_text

log = logging.getLogger("controller")

# After a restart, how long a job that was running waits for its worker to re-register
# and claim it before it is placed again: a little over one default pulse deadline (2 s).
RECOVERY_GRACE = 3.0


def recover(desk: JobDesk, recovered: Recovered, now: float) -> None:
    """Put the journal's jobs back: pending ones in the queue, working ones up for
    adoption by their re-registering worker, ended ones in the book (with outcomes
    not yet delivered told again)."""
    wall = time.time()
    core = desk.scheduling.core
    desk.book.wall_offset = wall - now
    core.continue_numbering(recovered.first_worker_id, recovered.next_ref)
    counts: dict[str, int] = {}
    picked = [row.task_id for row in recovered.jobs if row.door != DoorName.UDP]
    if picked:  # numbers the controller picks stay unique among live jobs after a restart
        desk.book.continue_picking(max(picked))
    defaults = core.defaults
    for queue in recovered.paused:
        core.pause(queue)
    for queue, (concurrency, rate) in recovered.limits.items():
        try:
            core.limit(queue, concurrency, parse_rate(rate) if rate else None, now)
        except ValueError:
            log.warning("journal: queue %r: a bad rate %r is left out", queue[:80], str(rate)[:80])
    waiting: list[Job] = []
    for row in recovered.jobs:
        counts[row.state] = counts.get(row.state, 0) + 1
        options = from_json(row.options, defaults) if row.options else defaults
        key: object = (row.host, row.port) if row.door == DoorName.UDP else None
        job = Job(
            id=row.id,
            ref=row.ref,
            task_id=row.task_id,
            door=row.door,
            key=key,
            payload=row.payload,
            notes=notes_of(row.name, row.info_url, row.download_url),
            added_at=row.added_at - desk.book.wall_offset,
            updated_at=now,
            attempts=row.attempts,
            options=options,
        )
        job.ran_on = row.ran_on
        if options.batch:  # the `then` job of a batch (POST /batch/)
            desk.waits.batches[options.batch] = row.id
        job.history = history_from_json(row.history, desk.book.wall_offset)
        for line in row.log:
            job.add_log(line, desk.max_log_size)
        if row.output:
            job.add_output(row.output, desk.output_retention)
        if row.state == "waiting":  # held again once every job is back (below)
            desk.book.add(job)
            desk.came(job)
            waiting.append(job)
            continue
        if row.state in ("scheduled", "pending", "working"):
            left = options.placement_timeout - (wall - row.queued_at)
            core.recover(
                row.ref,
                row.task_id,
                row.payload,
                row.id,
                now,
                running=row.state == "working",
                attempts=row.attempts,
                failed_on=tuple(row.failed_on),
                placement_left=left,
                # A poller's job waits a lease_timeout for its holder to renew.
                grace=max(RECOVERY_GRACE, core.pollers.lease_timeout)
                if row.lease
                else RECOVERY_GRACE,
                lease=row.lease,
                options=options,
                retried_at=row.retried_at,
                wait=row.queued_at - wall if row.state == "scheduled" else None,
            )
            if row.lease:
                desk.leased_refs.add(row.ref)
            job.task = core.tasks[row.ref]
            desk.book.add(job)
            desk.came(job)
            continue
        job.final = JobState(row.state)
        job.result = row.result
        job.error = row.error
        job.usage = usage_from_text(row.usage)
        job.reason = row.reason
        job.failed_post = row.failed_post
        desk.book.add(job)
        if row.notified:
            retain = None if row.expires_at is None else row.expires_at - wall
            desk.book.retain(job, now, retain)
        else:
            desk.tell(job, now)
    for job in waiting:  # still waiting, or let go: what it waited for ended while down
        waits.hold(desk, job, now)
    if recovered.jobs or recovered.pruned:
        summary = ", ".join(f"{n} {state}" for state, n in sorted(counts.items())) or "none"
        log.info(
            "journal: recovered %d jobs (%s), pruned %d expired; worker ids continue at %d",
            len(recovered.jobs),
            summary,
            recovered.pruned,
            recovered.first_worker_id,
        )
    desk.timer.poke()

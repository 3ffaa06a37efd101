"""The Redis door's listener: cancels heard on `<stream>:cancel` and retries heard on
`<stream>:retry` (both announced by the client's scripts, `codec.CANCEL_SCRIPT` and
`codec.RETRY_SCRIPT`) act at once on the jobs this controller holds.
"""

from __future__ import annotations

import logging

import trio

from controller.doors.redis import codec
from controller.doors.redis.base import DoorBase, outcome_of
from controller.doors.redis.stream_calls import Outcome
from controller.job_ids import DoorName

log = logging.getLogger("controller.redis")


class DoorListener(DoorBase):
    """The listener task, and what a heard cancel or retry does."""

    async def _listen_loop(self) -> None:
        pubsub = self.calls.pubsub()
        cancels = codec.cancel_channel(self.settings.stream)
        retries = codec.retry_channel(self.settings.stream)
        try:
            await self._call(pubsub.subscribe, cancels, retries)
            while True:
                heard = await self._call(self.calls.heard, pubsub, mostly_waits=True)
                for channel, job_id in heard:
                    if channel == retries:
                        self._retry(job_id)
                    else:
                        self._cancel(job_id)
        finally:
            pubsub.close()

    def _cancel(self, job_id: str) -> None:
        """A user canceled a job through Redis: only this door's jobs are canceled so."""
        if self.lanes.parked.pop(job_id, None) is not None:  # its hash says so already
            self.counters["canceled"] += 1
            self._queue_outcome(job_id, Outcome("canceled", b"", codec.CANCEL_ERROR))
            return
        job = self.book.get(job_id)
        if job is not None and job.door == DoorName.REDIS and not job.state.final:
            self.counters["canceled"] += 1
            log.info("redis: job %s canceled by a user", job_id)
            self.desk.cancel(job, trio.current_time())

    def _retry(self, job_id: str) -> None:
        """A user retried a failed or canceled Redis job (its hash says `pending` now): the
        controller that holds it puts it back, and writes its outcome when it ends again.
        Refused here, the job's outcome is written back over the hash."""
        job = self.book.get(job_id)
        if job is None or job.door != DoorName.REDIS or not job.state.final:
            return  # not ours (another controller ran it) or live already
        # JobDesk.retry(job, now) -> bool: False when the job's state does not allow it.
        if self.desk.retry(job, trio.current_time()):
            self.counters["retried"] += 1
            log.info("redis: job %s retried by a user", job_id)
            self.entries.setdefault(job_id, [])  # held again: progress and outcome are written
            self.reported.pop(job_id, None)
        else:
            self._queue_outcome(job_id, outcome_of(job))

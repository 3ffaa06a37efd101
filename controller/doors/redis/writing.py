"""The Redis door's writer: each outcome goes to `job:<id>` and `<stream>:results`, and its
entries are acknowledged, in one script (`codec.OUTCOMES_SCRIPT`), batched; a live job's
state changes (started, back in its queue) are written too.

While other held jobs are live, a write waits a few milliseconds for more outcomes, so that
one round trip carries several; a lone job's outcome is written at once.
"""

from __future__ import annotations

import itertools
import time

import trio

from controller.doors.redis import codec
from controller.doors.redis.reading import DoorReader
from controller.doors.redis.stream_calls import WRITE_BATCH, EntryRef, Outcome
from controller.job_ids import DoorName
from controller.options import rfc3339

# While other held jobs are live, every write waits up to WRITE_GATHER_WAIT seconds for this
# many outcomes (a lone job's outcome is written at once).
WRITE_GATHER = 32
WRITE_GATHER_WAIT = 0.005


class DoorWriter(DoorReader):
    """The writer task."""

    async def _write_loop(self) -> None:
        while True:
            if not (self.outbox or self.progress):
                await self._work.wait()
            self._work = trio.Event()
            if len(self.outbox) < WRITE_GATHER and len(self.entries) > len(self.outbox):
                # Other held jobs are still running: one round trip for several outcomes.
                with trio.move_on_after(WRITE_GATHER_WAIT):
                    while len(self.outbox) < WRITE_GATHER:
                        await self._work.wait()
                        self._work = trio.Event()
            if self.outbox or self.progress:
                outcomes = dict(itertools.islice(self.outbox.items(), WRITE_BATCH))
                for job_id in outcomes:
                    del self.outbox[job_id]
                progress, self.progress = self.progress, {}
                acks = {job_id: list(self.entries.get(job_id, ())) for job_id in outcomes}
                stamp = rfc3339(time.time())
                for job_id, word in progress.items():  # rare: jobs live for over a second
                    key = codec.job_key(job_id)
                    await self._script(codec.PROGRESS_SCRIPT, [key], [word, stamp])
                if outcomes:
                    keys, args = self.calls.outcomes_request(outcomes, acks, stamp)
                    await self._script(codec.OUTCOMES_SCRIPT, keys, args)
                self._written(outcomes, acks)

    def _written(self, outcomes: dict[str, Outcome], acks: dict[str, list[EntryRef]]) -> None:
        now = trio.current_time()
        self.counters["written"] += len(outcomes)
        for job_id, acked in acks.items():
            held = self.entries.get(job_id, [])
            left = [entry for entry in held if entry not in acked]
            if left:  # an entry with the same id came meanwhile: acknowledge it too
                self.entries[job_id] = left
                self.outbox.setdefault(job_id, outcomes[job_id])
            else:
                self.entries.pop(job_id, None)
            job = self.book.get(job_id)
            if job is not None and job.door == DoorName.REDIS:
                self.desk.delivered(job_id, now)
        if outcomes:
            self.look_for_room()

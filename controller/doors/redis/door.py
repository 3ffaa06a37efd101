"""The Redis stream door (docs/redis.md): one queue for several controllers, one per host.

redis-py is a blocking (or asyncio) client, and the controller runs on trio, so the door's
Redis calls (stream_calls.py) run in a worker thread (`Reactor.in_thread`), except the two
made per batch of jobs under load (new entries, outcomes), which go on a connection served
by the loop itself (script_link.py; a thread call costs several times more while the loop
is busy). Each queue has its own stream, read only while a worker here serves that queue
(queue_lanes.py). Four tasks, one module each:

- the reader (reading.py) takes new entries within the room this controller has and hands
  them to the job desk;
- the writer (writing.py) writes each outcome and acknowledges its entries;
- the keeper (keeping.py) re-claims the entries this controller holds, claims those of
  stopped consumers and reads the groups' lag;
- the listener (listening.py) hears cancels and retries at once.

They share what the door holds and its retried calls (base.py): each task's class adds its
methods to the one below it (DoorBase, DoorListener, DoorReader, then DoorWriter and
DoorKeeper), and `RedisDoor` is the whole. While Redis is unreachable
each task retries with backoff (capped at 5 s), a log line says so (at most one per
interval), and the other doors go on. A queue's stream key that holds another type
(WRONGTYPE) stops that lane alone: it is left out of reads and claims and tried again with
its own backoff, the other lanes go on, and it takes up again by itself once the key is a
stream (or gone).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from controller.containment import contained
from controller.doors.redis import codec
from controller.doors.redis.base import BACKOFF_CAP, outcome_of
from controller.doors.redis.keeping import DoorKeeper
from controller.doors.redis.writing import DoorWriter
from controller.jobs import Job

log = logging.getLogger("controller.redis")


class RedisDoor(DoorKeeper, DoorWriter):
    """The Redis door's shell: its four tasks, run together, and the job desk's side."""

    # ------------------------------------------------------------ running

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        log.info(
            "redis: taking jobs from stream %r (group %r, consumer %r) at %s",
            self.settings.stream,
            self.settings.group,
            self.consumer,
            codec.shown_url(self.settings.url),
        )
        try:
            async with trio.open_nursery() as nursery:
                for loop in (self._read_loop, self._write_loop, self._keep_loop, self._listen_loop):
                    nursery.start_soon(self._contained, loop)
                task_status.started()
        finally:
            self.link.close()
            self.calls.close()

    async def _contained(self, loop: Callable[[], Awaitable[None]]) -> None:
        """Run `loop`; a failure that escapes it (a bug an entry or key reached) is logged
        and the loop starts again after a pause, so that the other doors go on."""
        while True:
            try:
                await loop()
            except Exception as exc:
                contained("the Redis door", exc, trio.current_time(), loop.__name__.strip("_"))
                self._reread = True
                await trio.sleep(BACKOFF_CAP)

    # ------------------------------------------------------------ the desk's side

    def job_finished(self, job: Job, now: float) -> None:
        """A job of this door ended: write its outcome, then acknowledge its entries."""
        self._queue_outcome(job.id, outcome_of(job))

    def forget(self, job: Job) -> None:
        pass

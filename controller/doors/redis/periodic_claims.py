"""Claims of periodic jobs in Redis: one controller of several makes each due time's job.

Before making the job `<id>` of a due time, a controller sets `cron:<id>` to its
consumer name with `SET ... NX EX`; only the one whose SET succeeds makes the
job. A controller that finds its own name there (it claimed, then crashed
before its journal held the job) makes it. The key lives a day past the next
due time (and at least `result_retention`): after that no controller asks for
this due time again, since a start makes only the latest due time.

The calls are redis-py's, in a worker thread, on the Redis door's connection
pool. While Redis cannot be reached the claim is retried with backoff (capped
at 5 s), up to the next due time: a job is never made without its claim.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis
import trio

log = logging.getLogger("controller.redis")

KEY_PREFIX = "cron:"
# How long a claim outlives the next due time: covers clocks a little apart and a
# controller that retried its claim until then.
CLAIM_MARGIN = 86400
# Backoff while Redis cannot be reached: first wait, cap (as the Redis door's).
BACKOFF_FIRST = 0.1
BACKOFF_CAP = 5.0

InThread = Callable[..., Awaitable[Any]]


class RedisClaims:
    """`Claims` (controller/shell/schedules.py) over one Redis."""

    def __init__(
        self,
        client: redis.Redis,
        consumer: str,
        retention: float,
        in_thread: InThread | None = None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        """`in_thread(fn, *args, abandon_on_cancel=True)` runs a blocking call (the reactor's,
        which stops polling meanwhile); `wall`: the wall clock."""
        self.client = client
        self.consumer = consumer
        self.retention = retention
        self.in_thread: InThread = in_thread or trio.to_thread.run_sync
        self.wall = wall

    async def claim(self, job_id: str, until: float) -> bool | None:
        """True: ours to make; False: another controller's; None: Redis could not be reached
        before wall-clock time `until`."""
        delay = BACKOFF_FIRST
        failures = 0
        while True:
            ttl = max(math.ceil(until - self.wall()) + CLAIM_MARGIN, math.ceil(self.retention))
            try:
                mine: bool = await self.in_thread(self._claim, job_id, ttl, abandon_on_cancel=True)
            except redis.RedisError as exc:
                failures += 1
                if failures == 1:
                    log.warning("redis: cannot claim periodic job %s (%s); retrying", job_id, exc)
                left = until - self.wall()
                if left <= 0:
                    return None
                await trio.sleep(min(delay, left))
                delay = min(delay * 2, BACKOFF_CAP)
                continue
            if failures:
                log.info("redis: claimed periodic job %s after %d failures", job_id, failures)
            return mine

    def _claim(self, job_id: str, ttl: int) -> bool:
        """Blocking: SET NX, else whether the holder is this controller."""
        key = KEY_PREFIX + job_id
        if self.client.set(key, self.consumer, nx=True, ex=ttl):
            return True
        holder: Any = self.client.get(key)
        return holder is not None and bytes(holder).decode("utf-8", "replace") == self.consumer

"""The base of the Redis door's shell: what the door holds, and its calls to Redis, which
ride out Redis failures.

The door's state (which entries this controller holds, which outcomes and live states wait
to be written) lives in the trio loop alone; a call to Redis shares nothing with a thread
but its arguments and its answer. Every call is retried with backoff (capped at 5 s) while
Redis fails, with a log line when it starts failing and at most one per LOG_INTERVAL after,
so that the other doors go on. A call on a queue's stream that fails for its key alone
(another type: WRONGTYPE) is not retried: that lane waits with its own backoff
(`queue_lanes.Lane`), and the caller goes on with the others.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import redis
import trio

from controller.config import Config
from controller.doors.redis import codec
from controller.doors.redis.queue_lanes import Lane, Lanes
from controller.doors.redis.script_link import link_for
from controller.doors.redis.stream_calls import EntryRef, Outcome, StreamCalls, wrong_type
from controller.errors import StartupError
from controller.job_ids import DoorName
from controller.job_states import JobState
from controller.jobs import Job
from controller.shell.core_shell import CoreShell
from controller.shell.desk import JobDesk

log = logging.getLogger("controller.redis")

T = TypeVar("T")

# Backoff while Redis is unreachable: first wait, cap.
BACKOFF_FIRST = 0.1
BACKOFF_CAP = 5.0
# At most one "still unreachable" log line per this many seconds.
LOG_INTERVAL = 30.0
# Seconds a script's answer may take before its connection is given up as broken.
ANSWER_TIMEOUT = 10.0
# A lane whose stream key holds another type is tried again after this long, doubled at
# each failure in a row up to BACKOFF_CAP.
LANE_BACKOFF_FIRST = 1.0


class LaneStopped(Exception):
    """A call on the streams of some lanes failed for their keys alone (another type): they
    are marked, and the caller goes on with the others."""


class DoorBase:
    """What the Redis door holds, its calls to Redis, and what it shows of itself."""

    def __init__(self, config: Config, desk: JobDesk, shell: CoreShell) -> None:
        settings = config.redis
        assert settings is not None
        self.settings = settings
        self.consumer = settings.consumer or f"{socket.gethostname()}:{config.socket_dir}"
        self.max_payload = config.max_extra_size
        try:
            self.calls = StreamCalls(
                settings,
                self.consumer,
                retention_ms=max(1, int(config.result_retention * 1000)),
                claim_after_ms=max(1, int(settings.claim_after * 1000)),
            )
        except ValueError as exc:
            raise StartupError(f"redis url {codec.shown_url(settings.url)!r}: {exc}") from None
        self.link = link_for(settings.url, shell.reactor, ANSWER_TIMEOUT, self.calls.redis)
        self.desk = desk
        self.book = desk.book
        self.core = shell.core
        self.in_thread = shell.reactor.in_thread  # no polling while a Redis call runs
        self.defaults = config.job_options(DoorName.REDIS)
        self.lanes = Lanes(settings.stream, self.defaults)
        self._served: list[Lane] = []  # the lanes of the queues our workers serve
        self._served_of = -1  # the core's serving_version when _served was made
        self.entries: dict[str, list[EntryRef]] = {}  # job id -> its entries not yet acknowledged
        self.outbox: dict[str, Outcome] = {}  # job id -> outcome to write
        self.progress: dict[str, str] = {}  # job id -> live state to write
        self.reported: dict[str, str] = {}  # job id -> the live state its hash has (by us)
        self._room = trio.Event()
        self._work = trio.Event()
        self._reread = True  # read our own pending entries again before new ones
        self.down_since: float | None = None
        self._last_log = 0.0
        self.last_error = ""
        self.lag: int | None = None
        self.pending: int | None = None
        self.counters = {
            "read": 0,
            "claimed": 0,
            "skipped": 0,
            "written": 0,
            "canceled": 0,
            "retried": 0,
            "trimmed": 0,  # acknowledged entries deleted from the stream
            "claimed_away": 0,  # parked entries of ours another controller claimed
            "stream_errors": 0,  # calls on a queue's stream that failed for its key alone
            "duplicates": 0,  # entries whose unique_key a live job held: `state duplicate`
        }
        self._asked = 0  # entries asked for by reads and claims not yet answered

    # ------------------------------------------------------------ calling Redis

    async def _call(
        self,
        fn: Callable[..., T],
        *args: Any,
        mostly_waits: bool = False,
        lanes: Sequence[Lane] = (),
    ) -> T:
        """A blocking Redis call in a thread, retried as `_retrying` says (`mostly_waits`: see
        `Reactor.in_thread`; `lanes`: the lanes whose streams it works on)."""
        return await self._retrying(
            lambda: self.in_thread(fn, *args, abandon_on_cancel=True, mostly_waits=mostly_waits),
            lanes,
        )

    async def _script(self, source: str, keys: list[Any], args: list[Any]) -> Any:
        """A script of codec.py through the link, retried as `_retrying` says."""
        return await self._retrying(lambda: self.link.script(source, keys, args))

    async def _retrying(self, call: Callable[[], Awaitable[T]], lanes: Sequence[Lane] = ()) -> T:
        """`await call()`; while Redis fails, retry with backoff.

        Any Redis error is ridden out this way, not only a lost connection: a Redis that
        refuses commands (read-only replica, out of memory) must not stop the controller's
        other doors. A stream or group deleted under us (NOGROUP: also a Redis restarted
        without persistence) is created again. A call on the streams of `lanes` that fails
        for a key of another type is not retried: LaneStopped, with one lane marked failing
        (several are set up again one by one, where the wrong one fails alone)."""
        backoff = BACKOFF_FIRST
        while True:
            try:
                answer = await call()
            except redis.RedisError as exc:
                if lanes and wrong_type(exc):
                    if len(lanes) == 1:
                        self._lane_failed(lanes[0], str(exc))
                    else:
                        for lane in lanes:
                            lane.ready = False
                    raise LaneStopped from None
                self._failed(exc)
                if "NOGROUP" in str(exc):
                    for stream in list(self.lanes.by_stream):
                        with contextlib.suppress(redis.RedisError):
                            await self.in_thread(
                                self.calls.ensure_group, stream, abandon_on_cancel=True
                            )
            else:
                if self.down_since is not None:
                    log.warning(
                        "redis: working again after %.1f s", time.monotonic() - self.down_since
                    )
                    self.down_since = None
                    self.last_error = ""
                return answer
            await trio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_CAP)

    def _failed(self, exc: Exception) -> None:
        self._reread = True
        self.last_error = str(exc) or type(exc).__name__
        now = time.monotonic()
        if self.down_since is None:
            self.down_since = self._last_log = now
            log.warning(
                "redis: %s: %s; the other doors go on, retrying (backoff up to %g s)",
                codec.shown_url(self.settings.url),
                self.last_error,
                BACKOFF_CAP,
            )
        elif now - self._last_log >= LOG_INTERVAL:
            self._last_log = now
            log.warning(
                "redis: still failing after %.0f s: %s", now - self.down_since, self.last_error
            )

    def _lane_failed(self, lane: Lane, error: str) -> None:
        """A call on the lane's stream failed for its key alone: the lane waits (doubling
        its backoff) and is set up again; the first failure is logged, then one line per
        LOG_INTERVAL at most."""
        now = trio.current_time()
        lane.ready = False
        lane.backoff = min(lane.backoff * 2, BACKOFF_CAP) if lane.failing else LANE_BACKOFF_FIRST
        lane.retry_at = now + lane.backoff
        lane.failures += 1
        self.counters["stream_errors"] += 1
        error = error[:300]
        if not lane.failing:
            log.warning(
                "redis: stream %r (queue %r) cannot be used: %s; its queue's entries wait, "
                "the other streams go on (retrying)",
                lane.stream,
                lane.queue,
                error,
            )
        elif lane.failures % max(1, int(LOG_INTERVAL / BACKOFF_CAP)) == 0:
            log.warning(
                "redis: stream %r still cannot be used (%d times in a row): %s",
                lane.stream,
                lane.failures,
                error,
            )
        lane.failing = error

    def _lane_working(self, lane: Lane) -> None:
        """The lane is set up: a failing one is working again."""
        if lane.failing:
            log.warning("redis: stream %r can be used again", lane.stream)
        lane.failing = ""
        lane.backoff = 0.0
        lane.failures = 0

    # ------------------------------------------------------------ what it holds

    def status(self) -> dict[str, Any]:
        """What `udp-client status`, the console and the metrics show of this door."""
        return {
            "connected": self.down_since is None,
            "stream": self.settings.stream,
            "streams": [lane.stream for lane in self._served],
            "group": self.settings.group,
            "consumer": self.consumer,
            "lag": self.lag,
            "pending": self.pending,
            "held": len(self.entries),
            "parked": len(self.lanes.parked),  # held, but no worker here can take them
            "failing_streams": sorted(lane.stream for lane in self._served if lane.failing),
            "last_error": self.last_error,
            **self.counters,
        }

    def _queue_outcome(self, job_id: str, outcome: Outcome) -> None:
        self.outbox[job_id] = outcome
        self.progress.pop(job_id, None)
        self.reported.pop(job_id, None)
        self._work.set()


def outcome_of(job: Job) -> Outcome:
    state = job.state
    if state is JobState.CANCELED:
        return Outcome("canceled", b"", job.error or codec.CANCEL_ERROR)
    return Outcome(state.value, job.result, job.error)

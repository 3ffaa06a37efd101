"""The Redis stream door (docs/redis.md): one queue for several controllers, one per host.

redis-py is a blocking (or asyncio) client, and the controller runs on trio, so
the door's Redis calls (controller/shell/redis_calls.py) run in a worker thread
(`trio.to_thread.run_sync`), except the two made per batch of jobs under load
(new entries, outcomes), which go on a connection served by the loop itself
(controller/shell/redis_link.py; a thread call costs several times more while
the loop is busy). The state (which entries this controller holds, which
outcomes wait to be written) lives in the trio loop alone, so nothing is
shared with a thread but the call's arguments and its answer. Each queue has
its own stream, read only while a worker here serves that queue
(controller/shell/redis_lanes.py). Four tasks:

- the reader takes from each stream only as many entries as it can start soon
  (the queue's idle workers plus a prefetch), reads each entry's options,
  checks it against its `job:<id>` hash (an entry whose job already ended
  elsewhere is acknowledged without running) and hands the rest to the job
  desk, which journals each before it runs; an entry no worker here can take
  (its `requires`) is parked instead; after a start or a lost connection it
  first reads its own pending entries again;
- the writer puts each outcome in `job:<id>` and `<stream>:results` and
  acknowledges the entry, in one script (controller/streams.py), batched;
- the keeper re-claims held entries well within `claim_after` (parked ones
  are left to go stale, so that a controller with a suitable worker claims
  them; one claimed away is dropped here, never taken back), claims those of
  stopped consumers, checks for cancels and reads the groups' lag;
- the listener hears cancels on `<stream>:cancel` and retries on `<stream>:retry` at once.

While Redis is unreachable each task retries with backoff (capped at 5 s), a
log line says so (at most one per interval), and the other doors go on. A queue's
stream key that holds another type (WRONGTYPE) stops that lane alone: it is left
out of reads and claims and tried again with its own backoff, the other lanes go
on, and it takes up again by itself once the key is a stream (or gone).

The reader also keeps within the desk's bound on queued work (`max_pending`): it
asks for no more entries than `JobDesk.entries_room` leaves, less what its reads
and claims still in flight asked for; the entries that come are never refused
for it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import redis
import trio

from controller import streams
from controller.config import Config
from controller.containment import INTERNAL_MESSAGE, contained
from controller.httpapi import ID_RULE, MAX_TEXT, UDP_ID_PREFIX, UDP_ID_RULE, valid_id
from controller.jobs import Job, JobState
from controller.options import BadOption, JobOptions, rfc3339
from controller.shell.core_shell import CoreShell, StartupError
from controller.shell.desk import JobDesk
from controller.shell.door_actions import DoorAction, Send
from controller.shell.redis_calls import (
    WRITE_BATCH,
    Entry,
    EntryRef,
    Outcome,
    StreamCalls,
    wrong_type,
)
from controller.shell.redis_lanes import (
    PREFETCH,
    Lane,
    Lanes,
    Parked,
    can_take,
    entry_options,
)
from controller.shell.redis_link import link_for

log = logging.getLogger("controller.redis")

T = TypeVar("T")

# While jobs are queued, entries are read when there is room for at least this many.
READ_AT_LEAST = PREFETCH // 2
# Backoff while Redis is unreachable: first wait, cap.
BACKOFF_FIRST = 0.1
BACKOFF_CAP = 5.0
# At most one "still unreachable" log line per this many seconds.
LOG_INTERVAL = 30.0
# While other held jobs are live, every write waits up to WRITE_GATHER_WAIT seconds for this
# many outcomes (a lone job's outcome is written at once).
WRITE_GATHER = 32
WRITE_GATHER_WAIT = 0.005
# Seconds a script's answer may take before its connection is given up as broken.
ANSWER_TIMEOUT = 10.0
# How often the lag and pending count are read (and stopped consumers' entries looked for).
KEEP_INTERVAL = 1.0
# How often acknowledged entries past result_retention are deleted (and results trimmed).
TRIM_INTERVAL = 10.0
# A lane whose stream key holds another type is tried again after this long, doubled at
# each failure in a row up to BACKOFF_CAP.
LANE_BACKOFF_FIRST = 1.0


class LaneStopped(Exception):
    """A call on the streams of some lanes failed for their keys alone (another type): they
    are marked, and the caller goes on with the others."""


class RedisDoor:
    """The Redis door's shell: its four tasks and what this controller holds."""

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
            raise StartupError(f"redis url {streams.shown_url(settings.url)!r}: {exc}") from None
        self.link = link_for(settings.url, shell.reactor, ANSWER_TIMEOUT, self.calls.redis)
        self.desk = desk
        self.book = desk.book
        self.core = shell.core
        self.in_thread = shell.reactor.in_thread  # no polling while a Redis call runs
        self.defaults = config.job_options("redis")
        self.lanes = Lanes(settings.stream, self.defaults)
        self._served: list[Lane] = []  # the lanes of the queues our workers serve
        self._served_of = -1  # the scheduler's serving_version when _served was made
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
        }
        self._asked = 0  # entries asked for by reads and claims not yet answered
        desk.doors["redis"] = self
        shell.on_room = self._maybe_room

    # ------------------------------------------------------------ running

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        log.info(
            "redis: taking jobs from stream %r (group %r, consumer %r) at %s",
            self.settings.stream,
            self.settings.group,
            self.consumer,
            streams.shown_url(self.settings.url),
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
        """A script of controller/streams.py through the link, retried as `_retrying` says."""
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
                streams.shown_url(self.settings.url),
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

    # ------------------------------------------------------------ reading

    def served(self) -> list[Lane]:
        """The lanes of the queues our workers serve (looked at again when a worker came,
        left or changed what it serves)."""
        if self.core.scheduler.serving_version != self._served_of:
            self._look_at_workers()
        return self._served

    def _look_at_workers(self) -> None:
        workers = self.core.workers
        self._served = self.lanes.served(workers.values()) if workers else []
        self._served_of = self.core.scheduler.serving_version

    def rooms(self) -> dict[Lane, tuple[int, int]]:
        """Per lane read: how many more entries this controller can start soon, and how many
        of that queue wait here (not started, or parked)."""
        served = self.served()
        if len(served) < 2:  # none, or one queue (most controllers): the scheduler's counts
            return self.lanes.rooms(served, self.core, ())
        held = (self.book.get(job_id) for job_id in self.entries)
        return self.lanes.rooms(served, self.core, held)

    def _wanted(self) -> dict[Lane, int]:
        """The lanes worth a read now, and how many entries each may bring. While jobs of a
        queue wait here, its stream is read in batches of a few (a read costs a thread hop
        and a round trip, whatever it brings); with none waiting, at once. A failing lane is
        left out until its time to try again."""
        now = trio.current_time()
        return {
            lane: room
            for lane, (room, waiting) in self.rooms().items()
            if room >= (READ_AT_LEAST if waiting else 1)
            and not (lane.failing and now < lane.retry_at)
        }

    def _within_room(self, counts: dict[Lane, int]) -> dict[Lane, int]:
        """`counts` cut to the room the desk leaves for new jobs (max_pending), less what
        reads and claims in flight asked for: the first lanes get theirs first."""
        room = self.desk.entries_room() - self._asked
        cut: dict[Lane, int] = {}
        for lane, count in counts.items():
            if room <= 0:
                break
            cut[lane] = min(count, room)
            room -= cut[lane]
        return cut

    def _maybe_room(self) -> None:
        if not self._room.is_set() and self._wanted():
            self._room.set()

    async def _read_loop(self) -> None:
        while True:
            wanted = self._wanted()
            if wanted and not self.desk.refusal():
                if self._reread:
                    self._reread = False
                    self.lanes.unready()
                fresh = [lane for lane in wanted if not lane.ready]
                if fresh:  # a queue served for the first time here, or again after a failure
                    for lane in fresh:
                        with contextlib.suppress(LaneStopped):  # it waits, the others go on
                            await self._call(self.calls.ensure_group, lane.stream, lanes=[lane])
                            await self._take_own(lane)
                            lane.ready = True
                            self._lane_working(lane)
                    continue
                wanted = self._within_room(wanted)
            if not wanted or self.desk.refusal():
                self._room = trio.Event()
                # The journal's refusal clearing, jobs ending (room under max_pending) and a
                # failing lane's time to try again come without an event.
                with trio.move_on_after(1.0):
                    await self._room.wait()
                self._look_at_workers()
                continue
            counts = {lane.stream: room for lane, room in wanted.items()}
            asked = sum(counts.values())
            self._asked += asked
            try:
                batch = await self._read(wanted, counts)
            finally:
                self._asked -= asked
            self._take(batch, claimed=False)

    async def _read(self, wanted: dict[Lane, int], counts: dict[str, int]) -> list[Entry]:
        """New entries of these lanes, up to `counts` of each: what waits, else the first
        that come within a blocking read. A lane whose stream fails alone is marked and the
        others' entries are given."""
        keys, args = self.calls.read_request(counts)
        waiting = await self._script(streams.READ_SCRIPT, keys, args)
        if waiting:
            batch, failed = self.calls.entries_of(waiting, keys)
            for stream, error in failed.items():
                lane = self.lanes.by_stream[stream]
                if wrong_type(error):
                    self._lane_failed(lane, error)
                elif "NOGROUP" in error:  # its group (or stream) was deleted: set up again
                    lane.ready = False
                else:  # not that key's fault (e.g. a read-only replica): Redis fails
                    self._failed(redis.ResponseError(error))
                    await trio.sleep(BACKOFF_FIRST)
            return batch
        # None waits: wait for the next in a blocking read.
        try:
            return await self._call(
                self.calls.read_blocking, keys, min(counts.values()), lanes=list(wanted)
            )
        except LaneStopped:
            return []

    async def _take_own(self, lane: Lane) -> None:
        """Our own pending entries of a lane (read before a restart or a lost answer): take
        each once."""
        start = "0"
        while True:
            batch, last = await self._call(self.calls.read_own, lane.stream, start, lanes=[lane])
            if not last:
                return
            self._take(batch, claimed=False)
            start = last

    def _take(self, batch: list[Entry], *, claimed: bool) -> None:
        now = trio.current_time()
        for entry in batch:
            try:
                self._take_one(entry, claimed, now)
            except Exception as exc:  # a bug this entry reached: it alone fails
                contained("a Redis entry", exc, now, entry.entry_id)
                self.lanes.parked.pop(entry.job_id, None)
                held = self.entries.setdefault(entry.job_id, [])
                if (entry.stream, entry.entry_id) not in held:
                    held.append((entry.stream, entry.entry_id))
                job = self.book.get(entry.job_id)
                if job is None or job.door != "redis":
                    self._queue_outcome(entry.job_id, Outcome("failed", b"", INTERNAL_MESSAGE))

    def _take_one(self, entry: Entry, claimed: bool, now: float) -> None:
        job_id = entry.job_id
        ref = (entry.stream, entry.entry_id)
        held = self.entries.get(job_id)
        if held is not None:  # ours already (read again, or the same id added twice)
            if ref not in held:
                held.append(ref)
                self._settle_if_ended(job_id)
            return
        self.entries[job_id] = [ref]
        job = self.book.get(job_id)
        if job is not None and job.door != "redis":  # another door's: changes nothing
            self.counters["claimed" if claimed else "read"] += 1
            bad = f"id in use by a job of the {job.door} door"
            log.warning("redis: entry %s refused: %s", entry.entry_id, bad)
            self._queue_outcome(job_id, Outcome("failed", b"", bad))
            return
        if entry.hash_state in streams.FINAL_STATES:  # ended elsewhere: just acknowledge
            self.counters["skipped"] += 1
            if entry.hash_state == "canceled":  # e.g. recovered from our journal, live
                self._cancel(job_id)
            self._queue_outcome(job_id, Outcome(entry.hash_state, b"", ""))
            return
        if job is not None:  # known here: from the journal
            self._settle_if_ended(job_id)
            return
        self.counters["claimed" if claimed else "read"] += 1
        lane = self.lanes.by_stream[entry.stream]
        bad = self._check(entry, job_id)
        options = lane.defaults
        if not bad:
            try:
                options = entry_options(entry.fields, lane, self.settings.stream, time.time())
            except BadOption as exc:
                bad = str(exc)
        if bad:
            log.warning("redis: entry %s refused: %s", entry.entry_id, bad)
            self._queue_outcome(job_id, Outcome("failed", b"", bad))
            return
        if not can_take(self.core.workers.values(), options):
            # Not refused and not run: left to go stale here, for a controller that can.
            self.lanes.parked[job_id] = Parked(entry, options, lane)
            log.info(
                "redis: job %s waits for a controller with a worker for queue %r and labels %s",
                job_id[:200],
                options.queue,
                ",".join(sorted(options.requires)) or "(none)",
            )
            return
        self._submit(entry, options, now)

    def _submit(self, entry: Entry, options: JobOptions, now: float) -> None:
        fields = entry.fields
        # surrogateescape: bytes that are not UTF-8 come back as they were sent.
        name = fields.get(b"name", b"").decode("utf-8", "surrogateescape")
        self.desk.submit(
            entry.job_id,
            "redis",
            entry.entry_id,
            self.desk.pick_task_id(),
            fields.get(b"payload", b""),
            now,
            journal_first=True,
            name=name,
            options=options,
        )

    def _check(self, entry: Entry, job_id: str) -> str:
        """Why an entry cannot become a job ("" when it can)."""
        if b"id" in entry.fields and not valid_id(job_id):
            return ID_RULE
        if entry.hash_state == streams.WRONG_TYPE:
            return f"{streams.job_key(job_id)} is not a hash: it cannot hold this job's state"
        if job_id.startswith(UDP_ID_PREFIX):
            return UDP_ID_RULE
        size = len(entry.fields.get(b"payload", b""))
        if size > self.max_payload:
            return f"payload is {size} bytes, over max_extra_size ({self.max_payload})"
        name = len(entry.fields.get(b"name", b""))
        if name > MAX_TEXT:
            return f"name is {name} bytes, over {MAX_TEXT}"
        return ""

    def _settle_if_ended(self, job_id: str) -> None:
        job = self.book.get(job_id)
        if job is not None and job.door == "redis" and job.state.final:
            self._queue_outcome(job_id, _outcome_of(job))

    # ------------------------------------------------------------ the desk's side

    def job_finished(self, job: Job, now: float) -> list[DoorAction]:
        """A job of this door ended: write its outcome, then acknowledge its entries."""
        self._queue_outcome(job.id, _outcome_of(job))
        return []

    def forget(self, job: Job) -> None:
        pass

    def transmit(self, sends: Sequence[Send]) -> None:
        pass

    def _queue_outcome(self, job_id: str, outcome: Outcome) -> None:
        self.outbox[job_id] = outcome
        self.progress.pop(job_id, None)
        self.reported.pop(job_id, None)
        self._work.set()

    # ------------------------------------------------------------ writing

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
                    key = streams.job_key(job_id)
                    await self._script(streams.PROGRESS_SCRIPT, [key], [word, stamp])
                if outcomes:
                    keys, args = self.calls.outcomes_request(outcomes, acks, stamp)
                    await self._script(streams.OUTCOMES_SCRIPT, keys, args)
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
            if job is not None and job.door == "redis":
                self.desk.delivered(job_id, now)
        if outcomes:
            self._maybe_room()

    # ------------------------------------------------------------ keeping

    async def _keep_loop(self) -> None:
        refresh_every = self.settings.claim_after / 3
        # A short result_retention (tests) is trimmed more often than every TRIM_INTERVAL.
        trim_every = min(TRIM_INTERVAL, max(self.calls.retention_ms / 4000, KEEP_INTERVAL))
        refreshed = trimmed = trio.current_time()
        while True:
            await trio.sleep(min(KEEP_INTERVAL, refresh_every))
            if self._reread:  # the reader sets the groups up first
                continue
            self._look_at_workers()
            self._look_over_held()
            lanes = [lane for lane in self._served if lane.ready]
            now = trio.current_time()
            if now - trimmed >= trim_every:
                trimmed = now
                for lane in lanes:
                    self.counters["trimmed"] += await self._call(self.calls.trim, lane.stream)
            if now - refreshed >= refresh_every:
                refreshed = now
                await self._keep_held()
            rooms = {lane: room for lane, (room, _) in self.rooms().items() if lane.ready}
            for lane, room in self._within_room(rooms).items():
                if room > 0 and lane.ready:
                    self._asked += room
                    try:
                        batch = await self._call(self.calls.claim, lane.stream, room, lanes=[lane])
                    except LaneStopped:
                        continue
                    finally:
                        self._asked -= room
                    self._take(batch, claimed=True)
            lag = pending = None
            for lane in lanes:
                try:
                    info = await self._call(self.calls.group_info, lane.stream, lanes=[lane])
                except LaneStopped:
                    continue
                lag = _plus(lag, info[0])
                pending = _plus(pending, info[1])
            self.lag, self.pending = lag, pending

    async def _keep_held(self) -> None:
        """Re-claim the entries we hold (their idle time starts again), but not the parked
        ones: those are only looked at, and go stale for a controller that can run them. A
        parked one that a worker here can take now is re-claimed and runs here. Whatever
        another controller claimed meanwhile is never taken back: a parked job is dropped."""
        workers = self.core.workers.values()
        parked = self.lanes.parked
        held: dict[str, list[tuple[str, bool]]] = {}
        owners: dict[EntryRef, str] = {}
        live: list[str] = []
        takeable: list[str] = []  # parked jobs a worker here can take now
        for job_id, refs in self.entries.items():
            claim = True
            waiting = parked.get(job_id)
            if waiting is not None:
                claim = can_take(workers, waiting.options)
                if claim:
                    takeable.append(job_id)
            elif job_id not in self.outbox:
                live.append(job_id)
            for ref in refs:
                held.setdefault(ref[0], []).append((ref[1], claim))
                owners[ref] = job_id
        if not held:
            return
        gone, states, wrong = await self._call(self.calls.refresh, held, live + takeable)
        for stream, error in wrong.items():  # its entries are left as they are meanwhile
            lane = self.lanes.by_stream.get(stream)
            if lane is not None and not lane.failing:
                self._lane_failed(lane, error)
        for job_id, state in zip(live, states, strict=False):
            if state == "canceled":
                self._cancel(job_id)
        for ref in gone:
            self._claimed_away(owners[ref], ref)
        for job_id, state in zip(takeable, states[len(live) :], strict=True):
            self._unpark(job_id, state)

    def _claimed_away(self, job_id: str, ref: EntryRef) -> None:
        """An entry of ours is ours no more (another controller claimed it, or it was
        acknowledged). A parked job is dropped, neither run nor failed. A job that runs here
        goes on, its entry not taken back: its outcome is written as usual (the first
        outcome wins), and acknowledging the entry then is right whoever holds it."""
        refs = self.entries.get(job_id)
        if job_id not in self.lanes.parked or refs is None or ref not in refs:
            return
        refs.remove(ref)
        if refs:  # the same id in another entry of ours: that one still holds it here
            return
        self.counters["claimed_away"] += 1
        del self.lanes.parked[job_id]
        del self.entries[job_id]
        log.info("redis: job %s was claimed by another controller: dropped here", job_id[:200])
        self._maybe_room()

    def _unpark(self, job_id: str, state: str) -> None:
        """A parked job that a worker here can take, its entry still ours: it runs here (or,
        ended meanwhile, is acknowledged)."""
        parked = self.lanes.parked.pop(job_id, None)
        if parked is None:
            return
        if not self.entries.get(job_id):  # claimed away meanwhile
            self.entries.pop(job_id, None)
            return
        if state in streams.FINAL_STATES:
            self.counters["skipped"] += 1
            self._queue_outcome(job_id, Outcome(state, b"", ""))
            return
        self._submit(parked.entry, parked.options, trio.current_time())

    def _look_over_held(self) -> None:
        """Once a second: a held job that ended without telling this door (another door's job
        with the same id) is settled; a live one whose state changed since it was last
        written (it started, or went back to the queue) is written. Jobs that end within a
        second cost no progress write at all."""
        for job_id in list(self.entries):
            if job_id in self.outbox:
                continue
            job = self.book.get(job_id)
            if job is None or job.door != "redis":  # another door's job: not ours to write
                continue
            state = job.state
            if state.final:
                self._queue_outcome(job_id, _outcome_of(job))
                continue
            word = state.value  # pending, requested or working
            if self.reported.get(job_id, "pending") != word:
                self.reported[job_id] = self.progress[job_id] = word
                self._work.set()

    # ------------------------------------------------------------ canceling

    async def _listen_loop(self) -> None:
        pubsub = self.calls.pubsub()
        cancels = streams.cancel_channel(self.settings.stream)
        retries = streams.retry_channel(self.settings.stream)
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
            self._queue_outcome(job_id, Outcome("canceled", b"", streams.CANCEL_ERROR))
            return
        job = self.book.get(job_id)
        if job is not None and job.door == "redis" and not job.state.final:
            self.counters["canceled"] += 1
            log.info("redis: job %s canceled by a user", job_id)
            self.desk.cancel(job, trio.current_time())

    def _retry(self, job_id: str) -> None:
        """A user retried a failed or canceled Redis job (its hash says `pending` now): the
        controller that holds it puts it back, and writes its outcome when it ends again.
        Refused here, the job's outcome is written back over the hash."""
        job = self.book.get(job_id)
        if job is None or job.door != "redis" or not job.state.final:
            return  # not ours (another controller ran it) or live already
        # JobDesk.retry(job, now) -> bool: False when the job's state does not allow it.
        if self.desk.retry(job, trio.current_time()):
            self.counters["retried"] += 1
            log.info("redis: job %s retried by a user", job_id)
            self.entries.setdefault(job_id, [])  # held again: progress and outcome are written
            self.reported.pop(job_id, None)
        else:
            self._queue_outcome(job_id, _outcome_of(job))


def _plus(total: int | None, more: int | None) -> int | None:
    """A sum of counts that Redis may not give (None: unknown)."""
    if more is None:
        return total
    return more if total is None else total + more


def _outcome_of(job: Job) -> Outcome:
    state = job.state
    if state is JobState.CANCELED:
        return Outcome("canceled", b"", job.error or streams.CANCEL_ERROR)
    return Outcome(state.value, job.result, job.error)

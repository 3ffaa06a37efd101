"""The Redis door's reader: new entries of the streams of the queues this controller's
workers serve, each checked and handed to the job desk.

The reader takes from each stream only as many entries as it can start soon (the queue's
idle workers plus a prefetch, `queue_lanes.PREFETCH`), reads each entry's options, checks
it against its `job:<id>` hash (an entry whose job already ended elsewhere is acknowledged
without running) and hands the rest to the job desk, which journals each before it runs;
an entry no worker here can take (its `requires`) is parked instead. After a start or a
lost connection it first reads its own pending entries again.

It also keeps within the desk's bound on queued work (`max_pending`): it asks for no more
entries than `JobDesk.entries_room` leaves, less what its reads and the keeper's claims
still in flight asked for; the entries that come are never refused for it.
"""

from __future__ import annotations

import contextlib
import logging
import time

import redis
import trio

from controller.containment import INTERNAL_MESSAGE, contained
from controller.dependencies import after_refusal
from controller.doors.redis import codec
from controller.doors.redis.base import BACKOFF_FIRST, LaneStopped, outcome_of
from controller.doors.redis.listening import DoorListener
from controller.doors.redis.queue_lanes import PREFETCH, Lane, Parked, can_take, entry_options
from controller.doors.redis.stream_calls import Entry, Outcome, wrong_type
from controller.job_ids import ID_RULE, MAX_TEXT, UDP_ID_PREFIX, UDP_ID_RULE, DoorName, valid_id
from controller.options import BadOption, JobOptions

log = logging.getLogger("controller.redis")

# While jobs are queued, entries are read when there is room for at least this many.
READ_AT_LEAST = PREFETCH // 2


class DoorReader(DoorListener):
    """The reader task, and the rooms it reads within."""

    def served(self) -> list[Lane]:
        """The lanes of the queues our workers serve (looked at again when a worker came,
        left or changed what it serves)."""
        if self.core.serving_version != self._served_of:
            self._look_at_workers()
        return self._served

    def _look_at_workers(self) -> None:
        workers = self.core.workers
        self._served = self.lanes.served(workers.values()) if workers else []
        self._served_of = self.core.serving_version

    def rooms(self) -> dict[Lane, tuple[int, int]]:
        """Per lane read: how many more entries this controller can start soon, and how many
        of that queue wait here (not started, or parked)."""
        served = self.served()
        if len(served) < 2:  # none, or one queue (most controllers): the core's counts
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

    def look_for_room(self) -> None:
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
        waiting = await self._script(codec.READ_SCRIPT, keys, args)
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
                if job is None or job.door != DoorName.REDIS:
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
        if job is not None and job.door != DoorName.REDIS:  # another door's: changes nothing
            self.counters["claimed" if claimed else "read"] += 1
            bad = f"id in use by a job of the {job.door} door"
            log.warning("redis: entry %s refused: %s", entry.entry_id, bad)
            self._queue_outcome(job_id, Outcome("failed", b"", bad))
            return
        if entry.hash_state in codec.FINAL_STATES:  # ended elsewhere: just acknowledge
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
        why = after_refusal(options.after, entry.job_id, self.desk.book) if options.after else ""
        if why:  # a bad option: the entry fails, as for any other
            log.warning("redis: entry %s refused: %s", entry.entry_id, why)
            self._queue_outcome(entry.job_id, Outcome("failed", b"", why))
            return
        holder = self.desk.holder(options.unique_key)
        if holder is not None:  # a live job holds its unique_key: nothing made
            self.counters["duplicates"] += 1
            log.info(
                "redis: entry %s is a duplicate of job %s (unique_key %r)",
                entry.entry_id,
                holder.id[:200],
                options.unique_key,
            )
            self._queue_outcome(
                entry.job_id, Outcome(codec.DUPLICATE, b"", "", duplicate_of=holder.id)
            )
            return
        fields = entry.fields
        # surrogateescape: bytes that are not UTF-8 come back as they were sent.
        name = fields.get(b"name", b"").decode("utf-8", "surrogateescape")
        self.desk.submit(
            entry.job_id,
            DoorName.REDIS,
            entry.entry_id,
            self.desk.book.pick_task_id(),
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
        if entry.hash_state == codec.WRONG_TYPE:
            return f"{codec.job_key(job_id)} is not a hash: it cannot hold this job's state"
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
        if job is not None and job.door == DoorName.REDIS and job.state.final:
            self._queue_outcome(job_id, outcome_of(job))

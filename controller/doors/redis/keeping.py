"""The Redis door's keeper: what this controller holds stays its own, and what stopped
consumers held comes to it.

Every KEEP_INTERVAL (sooner when `claim_after` is short) the keeper settles held jobs that
ended and hands the writer the live states that changed, claims the entries of stopped
consumers within the reader's room, and reads the groups' lag and pending counts. Every
third of `claim_after` it re-claims the entries this controller holds (parked ones are only
looked at and left to go stale, so that a controller with a suitable worker claims them;
one claimed away is dropped here, never taken back) and reads the hashes of live held jobs
for a cancel whose announcement was missed. Every TRIM_INTERVAL it deletes acknowledged
entries past `result_retention`.
"""

from __future__ import annotations

import logging

import trio

from controller.doors.redis import codec
from controller.doors.redis.base import LaneStopped, outcome_of
from controller.doors.redis.queue_lanes import can_take
from controller.doors.redis.reading import DoorReader
from controller.doors.redis.stream_calls import EntryRef, Outcome
from controller.job_ids import DoorName

log = logging.getLogger("controller.redis")

# How often the lag and pending count are read (and stopped consumers' entries looked for).
KEEP_INTERVAL = 1.0
# How often acknowledged entries past result_retention are deleted (and results trimmed).
TRIM_INTERVAL = 10.0


class DoorKeeper(DoorReader):
    """The keeper task."""

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
        self.look_for_room()

    def _unpark(self, job_id: str, state: str) -> None:
        """A parked job that a worker here can take, its entry still ours: it runs here (or,
        ended meanwhile, is acknowledged)."""
        parked = self.lanes.parked.pop(job_id, None)
        if parked is None:
            return
        if not self.entries.get(job_id):  # claimed away meanwhile
            self.entries.pop(job_id, None)
            return
        if state in codec.FINAL_STATES:
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
            if job is None or job.door != DoorName.REDIS:  # another door's job: not ours to write
                continue
            state = job.state
            if state.final:
                self._queue_outcome(job_id, outcome_of(job))
                continue
            word = state.value  # pending, requested or working
            if self.reported.get(job_id, "pending") != word:
                self.reported[job_id] = self.progress[job_id] = word
                self._work.set()


def _plus(total: int | None, more: int | None) -> int | None:
    """A sum of counts that Redis may not give (None: unknown)."""
    if more is None:
        return total
    return more if total is None else total + more

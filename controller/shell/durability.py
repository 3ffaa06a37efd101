"""Which answer waits for which journal commit: the one rule, in one place.

The rule: an answer that tells a peer something was recorded (an `add_task`
acknowledgement, a `notify_task`, a repeat of either, a new worker id)
leaves only once every journal change staged before it is on disk. So the
answer is tagged with the journal's latest generation at the moment it is
produced, and released, in order, when the committer reports that
generation written. While nothing is staged or held it goes out at once.

The HTTP door's answers that confirm a change (`POST /job/` 201, `PUT` 200,
`DELETE` 200, and the poller's claim: a `GET /ping/` that answers with a
job) await `committed()` after making the change, so each leaves only once
that change is on disk: a controller killed before then has confirmed
nothing.

An answer that reveals nothing recorded (an error acknowledgement, a pulse
answer) does not wait: the doors mark those `independent` and send them
directly. Without a journal (`journal: null`) nothing waits for a commit.

And the rule of batches (`batch_delay`): while more than a few jobs are in
flight (for a commit: running, or waiting for it, `commit_load`), a commit waits a
little for more changes, and without a journal the
UDP door's answers to submitters wait as long for company, so that each
fsync, and each wake-up of a client, is shared by more jobs. A lone job, or a
handful, waits for nothing; and the UDP door's answers wait only while they come
close enough together for company to arrive in the wait (`Pace`).

The doors' state changes (a job added, an outcome delivered) must be staged
before the answers that depend on them are handed here: a door makes them with
the job desk first, then hands its answers to the desk's `answer_after_commit`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Any

import trio

from controller.journal import Journal

# How long a batch waits for more: nothing while at most BATCH_AFTER jobs are in flight
# (a batch of two or three saves little and delays all of them), then this for each job
# beyond, and at most that. An fsync costs ~100 us of CPU here whatever it carries, and a
# client's wake-up tens of microseconds whatever it reads (docs/operations.md, "Tuning").
BATCH_AFTER = 4
BATCH_DELAY_PER_JOB = 60e-6
BATCH_DELAY_MAX = 0.004


def batch_delay(in_flight: int) -> float:
    """Seconds a batch of journal changes or answers waits for more while `in_flight` jobs
    are queued or running: 0 for a few."""
    return min(BATCH_DELAY_MAX, max(0, in_flight - BATCH_AFTER) * BATCH_DELAY_PER_JOB)


def commit_load(tasks: int, queued: int, scheduled: int, held: int) -> int:
    """What a journal commit's `batch_delay` is told: the jobs that can add a change to it
    soon. Of the `tasks` queued or running, the running ones (`queued` wait for a worker and
    `scheduled` for their time: they change only when one frees up or their time comes), and
    the `held` answers already waiting for it, each from a submitter or a caller (a poller's
    claim, an HTTP POST) that goes on once it is written. So 2 pollers with 5,000 jobs queued
    do not wait 4 ms for company at each claim (104 against 267 jobs/s)."""
    return max(0, tasks - queued - scheduled) + held


# A batch waits only when at least this many more are expected within its wait.
COMPANY = 2.0
# How much each new gap weighs in the running mean of gaps.
PACE_WEIGHT = 0.125


class Pace:
    """How far apart the things a batch gathers come (a running mean of the gaps), so that
    a batch waits only when company is coming: jobs that take a millisecond each gain
    nothing from a wait sized for no-op jobs, and lose the time they wait."""

    __slots__ = ("_last", "gap")

    def __init__(self) -> None:
        self._last = -math.inf
        self.gap = 0.0  # until the gaps say otherwise, company is coming (the rule before)

    def note(self, now: float) -> None:
        """One more came at `now`."""
        gap = min(now - self._last, BATCH_DELAY_MAX)  # a long pause counts as the longest wait
        self._last = now
        self.gap += (gap - self.gap) * PACE_WEIGHT

    def delay(self, in_flight: int) -> float:
        """`batch_delay(in_flight)`, or 0 when fewer than COMPANY are expected in it."""
        wait = batch_delay(in_flight)
        return wait if wait >= COMPANY * self.gap else 0.0


class WriteAhead:
    """Holds answers until the journal batch they depend on is committed."""

    def __init__(self, journal: Journal | None) -> None:
        self.journal = journal
        self._held: deque[tuple[int, Callable[[Any], None], Any]] = deque()

    def __len__(self) -> int:
        return len(self._held)

    def after_commit(self, send: Callable[[Any], None], answer: Any) -> None:
        """Call `send(answer)` once everything staged so far is on disk (now, if it is)."""
        journal = self.journal
        if journal is not None:
            generation = journal.latest_generation()
            if generation > journal.committed or self._held:
                self._held.append((generation, send, answer))
                return
        send(answer)

    def new_worker_id(
        self, worker_id: int, next_free: int, send: Callable[[Any], None], answer: Any
    ) -> None:
        """A REGISTER answer carrying `worker_id` (`next_free` is the next one to hand out).

        Ids are reserved in blocks committed ahead of use (journal.reserve_worker_ids),
        so the answer waits only when its id's block is not on disk yet: no crash can
        hand the same id out twice.
        """
        journal = self.journal
        if journal is not None:
            journal.reserve_worker_ids(next_free)
            if not journal.worker_id_durable(worker_id):
                self.after_commit(send, answer)
                return
        send(answer)

    async def committed(self) -> None:
        """Return once everything staged so far is on disk (at once without a journal)."""
        done = trio.Event()
        self.after_commit(lambda _: done.set(), None)
        await done.wait()

    def release(self) -> None:
        """A commit finished: send, in order, what was waiting for it."""
        assert self.journal is not None
        committed = self.journal.committed
        held = self._held
        while held and held[0][0] <= committed:
            _, send, answer = held.popleft()
            send(answer)

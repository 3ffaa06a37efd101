"""What the UDP door remembers about transmissions, both ways. Pure.

`Seen`: requests already answered, by (sender, transmission_id), so that every
copy of a repeated request gets the same acknowledgement and is acted on
once. `Repeats`: success notifications not yet acknowledged, re-sent at
doubling intervals until the client acknowledges or the repeats run out.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from controller import datagram as dg
from controller.deadlines import Deadlines

Address = tuple[str, int]

# How long a (sender, transmission_id) is remembered to answer repeats without acting twice.
TRANSMISSION_MEMORY = 120.0
# What `Seen` stores for an acknowledgement without params (the common one): it is
# rebuilt from the transmission id for a repeat.
PLAIN_ACK = b"ack"
# Cap on remembered transmissions, so a flood of distinct ids cannot grow memory without bound.
MAX_TRANSMISSIONS = 200_000
# What one remembered transmission costs besides its answer: a dict slot, the key's tuple.
SEEN_OVERHEAD = 100
# First interval between repeats of an unacknowledged success notification (then doubling).
NOTIFY_FIRST_INTERVAL = 0.5


class Seen:
    """Answers already given, kept for at least TRANSMISSION_MEMORY seconds (and at most twice
    that), MAX_TRANSMISSIONS at most, `memory` bytes at most (then the oldest go first, and
    a repeat of a request whose answer went is answered afresh).

    Two generations: answers go into the new one; every TRANSMISSION_MEMORY (or once the
    new one holds half of MAX_TRANSMISSIONS, or half of `memory`) the old generation is
    dropped whole and the new one becomes the old. Forgetting costs nothing per entry, and
    an entry is a dict slot and its (sender, id) key: the front door keeps none for an
    accepted add_task, whose job the book holds longer (controller/doors/udp/codec.py), so
    100,000 queued jobs cost none.
    A plain acknowledgement is stored as `PLAIN_ACK` and rebuilt for a repeat.
    """

    def __init__(self, memory: float = math.inf) -> None:
        self.memory = memory
        self._new: dict[tuple[Address, int], bytes | None] = {}
        self._old: dict[tuple[Address, int], bytes | None] = {}
        self._turn_at = math.inf  # when the new generation becomes the old one
        self._new_bytes = 0  # the answers each generation holds (for the door's memory cap)
        self._old_bytes = 0

    def __len__(self) -> int:
        return len(self._new) + len(self._old)

    @property
    def held_bytes(self) -> int:
        """Bytes of the answers held (a plain acknowledgement, rebuilt, counts as its key)."""
        return self._new_bytes + self._old_bytes

    def get(self, addr: Address, txid: int) -> tuple[bytes | None] | None:
        """(the answer given, or None for silence) if this request was seen; else None."""
        key = (addr, txid)
        if key in self._new:
            answer = self._new[key]
        elif key in self._old:
            answer = self._old[key]
        else:
            return None
        return (dg.ack(txid) if answer is PLAIN_ACK else answer,)

    def remember(self, addr: Address, txid: int, answer: bytes | None, now: float) -> None:
        if not self._new and not self._old:
            self._turn_at = now + TRANSMISSION_MEMORY
        key = (addr, txid)
        if key not in self._new:
            size = SEEN_OVERHEAD + (len(answer) if answer is not None else 0)
            if 2 * size > self.memory:  # more than a generation may hold: no copy is kept
                return
            if 2 * (self._new_bytes + size) > self.memory:  # the older generation goes
                self._turn(now)
            self._new_bytes += size
        self._new[key] = answer
        if len(self._new) >= MAX_TRANSMISSIONS // 2:
            self._turn(now)

    def expire(self, now: float) -> None:
        if now >= self._turn_at:
            self._turn(now)

    def next_deadline(self) -> float:
        return self._turn_at

    def _turn(self, now: float) -> None:
        self._old = self._new
        self._old_bytes = self._new_bytes
        self._new = {}
        self._new_bytes = 0
        self._turn_at = now + TRANSMISSION_MEMORY if self._old else math.inf


@dataclass(eq=False, slots=True)
class Pending:
    """One success notification waiting for its acknowledgement."""

    job_id: str
    addr: Address
    txid: int
    left: int  # repeats still allowed
    at: float  # when the next repeat is due
    interval: float = NOTIFY_FIRST_INTERVAL


class Repeats:
    """Unacknowledged success notifications by transmission id and by job."""

    def __init__(self, retries: int, first_txid: int = 1) -> None:
        self.retries = retries
        self._txid = itertools.count(first_txid)
        self._by_txid: dict[int, Pending] = {}
        self._by_job: dict[str, Pending] = {}
        self._deadlines: Deadlines[Pending] = Deadlines()
        self.next_deadline = self._deadlines.next

    def __len__(self) -> int:
        return len(self._by_txid)

    def start(self, job_id: str, addr: Address, now: float) -> int:
        """A new notification (replacing any earlier one for the job); its transmission id."""
        if job_id in self._by_job:
            self.cancel(job_id)
        pending = Pending(job_id, addr, next(self._txid), self.retries, now + NOTIFY_FIRST_INTERVAL)
        self._by_txid[pending.txid] = pending
        self._by_job[job_id] = pending
        self._deadlines.push(pending.at, pending)
        return pending.txid

    def acked(self, txid: int, addr: Address) -> str | None:
        """The job whose notification `addr` acknowledged (None: unknown, or not its client)."""
        pending = self._by_txid.get(txid)
        if pending is None or pending.addr != addr:
            return None
        self._forget(pending)
        return pending.job_id

    def cancel(self, job_id: str) -> None:
        pending = self._by_job.get(job_id)
        if pending is not None:
            self._forget(pending)

    def due(self, now: float) -> tuple[list[Pending], list[str]]:
        """(notifications to send again now, jobs whose repeats ran out)."""
        again: list[Pending] = []
        gave_up: list[str] = []
        while (item := self._deadlines.pop_due(now)) is not None:
            when, pending = item
            if self._by_txid.get(pending.txid) is not pending or pending.at != when:
                continue
            if pending.left > 0:
                pending.left -= 1
                pending.interval *= 2
                pending.at = now + pending.interval
                self._deadlines.push(pending.at, pending)
                again.append(pending)
            else:
                self._forget(pending)
                gave_up.append(pending.job_id)
        return again, gave_up

    def _forget(self, pending: Pending) -> None:
        del self._by_txid[pending.txid]
        if self._by_job.get(pending.job_id) is pending:
            del self._by_job[pending.job_id]

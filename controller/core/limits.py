"""Queue limits: at most `concurrency` of a queue's tasks held by workers at once, and a
token bucket of `rate` starts per `per` seconds. Pure: no clock, no I/O (time is an argument).

A task counts against its queue from the moment it is placed on a worker until it ends or
goes back to waiting (pending or scheduled: a retry, a refusal, its worker lost); placing it
takes one token. A queue at its concurrency, or without a token, is `blocked` in the pending
order (pending.py), like a paused one: its tasks stay pending and other queues' go on. It is
unblocked when a task of it stops counting, or when its next token is due (a deadline in the
scheduler's heap, so the shell's timer wakes for it without any new event).

The bucket holds up to `rate` tokens, full when a rate is set or changed, and gains rate/per
tokens a second. Queues with no limit cost the hot path one attribute test per placement and
per end (`Task.limited`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from controller.core.model import Task
from controller.core.pending import Pending

# Seconds per rate unit, by the unit's letter ("N/s", "N/m").
PERIODS = {"s": 1.0, "m": 60.0}
# N/s or N/m: N below a billion (an int the journal and any client read alike), no leading 0.
RATE_RULE = re.compile(r"[1-9][0-9]{0,8}/[sm]")
# A token due at t is there at t: float rounding must not push it a hair later.
EPSILON = 1e-9


@dataclass(frozen=True, slots=True)
class Rate:
    """`count` starts per `unit` ("s" or "m")."""

    count: int
    unit: str

    @property
    def per(self) -> float:
        return PERIODS[self.unit]

    def __str__(self) -> str:
        return f"{self.count}/{self.unit}"


@dataclass(eq=False, slots=True)
class QueueLimit:
    concurrency: int = 0  # 0: none
    rate: Rate | None = None
    running: int = 0  # its tasks held by workers now
    tokens: float = 0.0  # as of `stamp`
    stamp: float = 0.0
    due: float = 0.0  # when its next token is due while it has none (0: not waiting)

    def refill(self, now: float) -> None:
        rate = self.rate
        if rate is None:
            return
        if now > self.stamp:
            gained = (now - self.stamp) * rate.count / rate.per
            self.tokens = min(float(rate.count), self.tokens + gained)
            self.stamp = now

    @property
    def full(self) -> bool:
        """At its concurrency."""
        return 0 < self.concurrency <= self.running


class Limits:
    """Every queue's limits, and the count of its tasks held by workers."""

    def __init__(
        self, pending: Pending, at: Callable[[float, Callable[..., None], object], None]
    ) -> None:
        self.queues: dict[str, QueueLimit] = {}
        self._pending = pending
        self._at = at  # the scheduler's `at`: wake me then

    def get(self, queue: str) -> tuple[int | None, Rate | None]:
        """(concurrency, rate) of `queue`, None for none."""
        limit = self.queues.get(queue)
        if limit is None:
            return None, None
        return limit.concurrency or None, limit.rate

    def set(
        self,
        queue: str,
        concurrency: int | None,
        rate: Rate | None,
        now: float,
        held: list[Task],
    ) -> None:
        """Set (None: remove) `queue`'s limits; `held` are its tasks on workers now (they count
        when a limit is new)."""
        limit = self.queues.get(queue)
        if concurrency is None and rate is None:
            if limit is not None:
                del self.queues[queue]
                for task in held:
                    task.limited = False
                self._pending.unblock(queue)
            return
        if limit is None:
            limit = self.queues[queue] = QueueLimit()
            for task in held:
                task.limited = True
            limit.running = len(held)
        limit.concurrency = concurrency or 0
        if rate != limit.rate:
            if rate is None:
                limit.due = 0.0
            else:  # a new rate: a full bucket of its own
                limit.tokens, limit.stamp = float(rate.count), now
            limit.rate = rate
        self._check(queue, limit, now)

    def started(self, task: Task, now: float, token: bool = True) -> None:
        """`task`, of a limited queue, was placed on a worker: it counts, and takes a token
        (not `token`: it was placed before a restart, and may still run on its worker)."""
        queue = task.opts.queue
        limit = self.queues[queue]
        task.limited = True
        limit.running += 1
        if token and limit.rate is not None:
            limit.refill(now)
            limit.tokens -= 1.0
        self._check(queue, limit, now)

    def ended(self, task: Task, now: float) -> None:
        """`task` no longer counts against its queue (ended, or waiting again)."""
        task.limited = False
        queue = task.opts.queue
        limit = self.queues.get(queue)
        if limit is not None:
            limit.running -= 1
            self._check(queue, limit, now)

    def _check(self, queue: str, limit: QueueLimit, now: float) -> None:
        """Block or unblock `queue` for what its limits say now; a queue out of tokens is
        woken when the next one is due."""
        dry = False
        rate = limit.rate
        if rate is not None:
            limit.refill(now)
            if limit.tokens < 1.0 - EPSILON:
                dry = True
                when = now + (1.0 - limit.tokens) * rate.per / rate.count
                if limit.due == 0.0 or when < limit.due:
                    limit.due = when
                    self._at(when, self._token_due, queue)
        if dry or limit.full:
            self._pending.block(queue)
        else:
            self._pending.unblock(queue)

    def _token_due(self, when: float, obj: object, now: float, actions: list[object]) -> None:
        assert isinstance(obj, str)
        limit = self.queues.get(obj)
        if limit is None or limit.due != when:
            return
        limit.due = 0.0
        self._check(obj, limit, now)


def parse_rate(text: object) -> Rate:
    """`"N/s"` or `"N/m"`, N a whole number 1..999,999,999 written without leading zeros
    (RATE_RULE); ValueError otherwise."""
    if not isinstance(text, str) or len(text) > 20:
        raise ValueError("a rate is text N/s or N/m")
    if RATE_RULE.fullmatch(text) is None:
        raise ValueError(f"a rate is N/s or N/m, N a whole number >= 1, got {text!r}")
    count, _, unit = text.partition("/")
    return Rate(int(count), unit)

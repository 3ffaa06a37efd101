"""Sleep until a pure object's next deadline, waking early when an earlier one appears.

The deadline heaps delete lazily (controller/deadlines.py): every job leaves
entries behind that come due long after they stopped mattering (a placement
timeout, a notification repeat, a transmission to forget). Firing for each
would wake the controller once or more per job, so a timer fires at most
once per COALESCE: what comes due in between is handled together, at most
COALESCE late. Every deadline it serves is a timeout of a tenth of a second
or more.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import trio

from controller.containment import contained

# The shortest time between two firings of one timer.
COALESCE = 0.01


class DeadlineTimer:
    """Calls `fire(now)` whenever `next_deadline()` has come (at most once per COALESCE).

    Code that may have moved the deadline earlier calls `poke()`; it costs
    one comparison when nothing changed.
    """

    def __init__(self, next_deadline: Callable[[], float], fire: Callable[[float], None]) -> None:
        self._next_deadline = next_deadline
        self._fire = fire
        self._due = math.inf  # the earliest deadline known when the timer last looked
        self._wake = trio.Event()

    def poke(self) -> None:
        if self._next_deadline() < self._due:
            self._wake.set()

    def poke_at(self, when: float) -> None:
        """`poke` for a caller that knows the one deadline it may have moved earlier."""
        if when < self._due:
            self._wake.set()

    async def run(self) -> None:
        fired = -math.inf
        while True:
            self._due = self._next_deadline()
            at = max(self._due, fired + COALESCE)
            if at > trio.current_time():
                with trio.move_on_at(at):
                    await self._wake.wait()
                self._wake = trio.Event()
                if trio.current_time() < max(self._next_deadline(), fired + COALESCE):
                    continue  # poked for a deadline that has not come yet
            # While firing, nothing pokes: everything fire() schedules is later than now.
            self._due = -math.inf
            fired = trio.current_time()
            try:
                self._fire(fired)
            except Exception as exc:  # what failed is retried at its next deadline, or dropped
                contained("a deadline", exc, fired)

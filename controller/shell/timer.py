"""Sleep until a pure object's next deadline, waking early when an earlier one appears."""

from __future__ import annotations

import math
from collections.abc import Callable

import trio


class DeadlineTimer:
    """Calls `fire(now)` whenever `next_deadline()` has come.

    Code that may have moved the deadline earlier calls `poke()`; it costs
    one comparison when nothing changed.
    """

    def __init__(self, next_deadline: Callable[[], float], fire: Callable[[float], None]) -> None:
        self._next_deadline = next_deadline
        self._fire = fire
        self._at = math.inf
        self._wake = trio.Event()

    def poke(self) -> None:
        if self._next_deadline() < self._at:
            self._wake.set()

    def poke_at(self, when: float) -> None:
        """`poke` for a caller that knows the one deadline it may have moved earlier."""
        if when < self._at:
            self._wake.set()

    async def run(self) -> None:
        while True:
            self._at = self._next_deadline()
            with trio.move_on_at(self._at):
                await self._wake.wait()
            self._wake = trio.Event()
            # While firing, _at still holds a time <= now, and everything fire()
            # schedules is later than now: its pokes do not wake us again.
            self._fire(trio.current_time())

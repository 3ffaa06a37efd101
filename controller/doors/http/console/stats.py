"""Jobs finished and failed per second over the last 10 minutes, for the overview's chart.

A ring of one slot per second: a job's end adds one to the slot of its second (a slot
found holding an older second is cleared first), so recording costs O(1) and the memory is
fixed. Reading walks the ring once. Time is an argument (the trio clock); `wall_offset`
turns a second into wall-clock time for the JSON.
"""

from __future__ import annotations

from typing import Any

# The chart's span: 10 minutes of one-second slots.
SPAN_SECONDS = 600


class EndRate:
    """Per-second counts of jobs that finished and that failed."""

    __slots__ = ("_failed", "_finished", "_second")

    def __init__(self) -> None:
        self._second = [-1] * SPAN_SECONDS  # which second each slot holds (-1: none yet)
        self._finished = [0] * SPAN_SECONDS
        self._failed = [0] * SPAN_SECONDS

    def record(self, now: float, failed: bool) -> None:
        """A job ended at `now`: finished, or failed."""
        second = int(now)
        slot = second % SPAN_SECONDS
        if self._second[slot] != second:
            self._second[slot] = second
            self._finished[slot] = 0
            self._failed[slot] = 0
        if failed:
            self._failed[slot] += 1
        else:
            self._finished[slot] += 1

    def series(self, now: float) -> tuple[list[int], list[int]]:
        """Finished and failed counts of the last SPAN_SECONDS seconds, oldest first (the
        last entry is the current second)."""
        last = int(now)
        finished = [0] * SPAN_SECONDS
        failed = [0] * SPAN_SECONDS
        for index in range(SPAN_SECONDS):
            second = last - SPAN_SECONDS + 1 + index
            slot = second % SPAN_SECONDS
            if self._second[slot] == second:
                finished[index] = self._finished[slot]
                failed[index] = self._failed[slot]
        return finished, failed

    def as_json(self, now: float, wall_offset: float) -> dict[str, Any]:
        """What /ui/stats answers: `end` is the wall-clock second of the last entry."""
        finished, failed = self.series(now)
        return {
            "end": int(now + wall_offset),
            "seconds": SPAN_SECONDS,
            "finished": finished,
            "failed": failed,
        }

    def per_minute(self, now: float) -> list[tuple[int, int, int]]:
        """(minutes ago, finished, failed) for each of the last 10 minutes, newest first: the
        table shown without JavaScript."""
        finished, failed = self.series(now)
        rows = []
        for minute in range(SPAN_SECONDS // 60):
            end = SPAN_SECONDS - minute * 60
            rows.append((minute, sum(finished[end - 60 : end]), sum(failed[end - 60 : end])))
        return rows

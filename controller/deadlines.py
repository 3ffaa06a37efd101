"""One deadline heap for everything that waits on the clock: scheduler, doors, reactor.

A min-heap of (when, item) with lazy deletion: nothing is ever removed
early. Whoever pops an item checks it against the record it names (is the
worker still registered, is that still the task's deadline?) and skips it
when it is stale. That keeps moving a deadline O(log n) and cancelling free,
which matters because most deadlines (pulses, timeouts) never fire. Pure:
time is whatever number the caller passes.
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import Generic, TypeVar

T = TypeVar("T")


class Deadlines(Generic[T]):
    """Items ordered by when they are due; ties keep the order they were pushed in."""

    __slots__ = ("_seq", "heap")

    def __init__(self) -> None:
        # (when, sequence, item), heap-ordered: read `heap[0]` in a hot loop, change it
        # only through the methods.
        self.heap: list[tuple[float, int, T]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self.heap)

    def push(self, when: float, item: T) -> None:
        heapq.heappush(self.heap, (when, next(self._seq), item))

    def next(self) -> float:
        """When the earliest item is due (inf when there is none)."""
        return self.heap[0][0] if self.heap else math.inf

    def peek(self) -> T | None:
        """The earliest item, left in place."""
        return self.heap[0][2] if self.heap else None

    def pop_due(self, now: float) -> tuple[float, T] | None:
        """The earliest item if it is due at `now`, with the time it was due; else None."""
        heap = self.heap
        if heap and heap[0][0] <= now:
            when, _, item = heapq.heappop(heap)
            return when, item
        return None

    def pop(self) -> T:
        """Remove the earliest item whatever its time (IndexError when empty)."""
        return heapq.heappop(self.heap)[2]

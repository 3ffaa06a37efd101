"""Placement deadlines: when each pending task with a placement timeout gives up waiting
for a worker. Pure: time is whatever number the caller passes.

Most come in order (now + the same timeout): those go in two deques side by side, the
deadline and the task's ref (two pointers to objects the task holds anyway: 16 bytes an
entry); the rest (a task back in the queue with the time it had left, or another timeout)
in a heap of (when, ref) pairs (72). With 100,000 jobs queued the pairs alone were 6 MB.
Like `controller.deadlines`, nothing is removed early: whoever pops an entry checks that
the task is still pending with that deadline.
"""

from __future__ import annotations

import heapq
import math
from collections import deque


class PlacementDeadlines:
    """(when, ref) entries, popped earliest first."""

    __slots__ = ("_heap", "_refs", "_whens")

    def __init__(self) -> None:
        self._whens: deque[float] = deque()
        self._refs: deque[int] = deque()
        self._heap: list[tuple[float, int]] = []

    def push(self, when: float, ref: int) -> None:
        whens = self._whens
        if not whens or when >= whens[-1]:
            whens.append(when)
            self._refs.append(ref)
        else:
            heapq.heappush(self._heap, (when, ref))

    def next(self) -> float:
        """When the earliest entry is due (inf when there is none)."""
        first = math.inf
        if self._heap:
            first = self._heap[0][0]
        if self._whens:
            first = min(first, self._whens[0])
        return first

    def pop_due(self, now: float) -> tuple[float, int] | None:
        """The earliest entry if it is due at `now` (the two kinds merged); else None."""
        heap, whens = self._heap, self._whens
        if whens and whens[0] <= now and not (heap and heap[0][0] < whens[0]):
            return whens.popleft(), self._refs.popleft()
        if heap and heap[0][0] <= now:
            return heapq.heappop(heap)
        return None

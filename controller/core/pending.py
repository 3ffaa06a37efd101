"""The pending tasks, in the order free workers take them. Pure: no clock, no I/O.

The order: a free worker takes, among the tasks of the queues it serves (and that are not
paused) whose `requires` labels it has, one of the highest priority; among equals, owners
take turns (round robin), and one owner's tasks go in submission order.

How it is indexed: priority level -> owner -> bucket -> deque of tasks, where a bucket is
one (queue, requires) pair. The levels are kept in a list sorted high to low (there are
few); each level's owners are a dict in round-robin order (the owner served last moves to
the end); each owner's buckets a dict. A worker looks at the highest level first, and in
it at owners in turn until one has a bucket the worker can take; of that owner's buckets
it takes the head that was submitted first (the smallest ref). With one queue, one owner
and no labels (the common case) that is a few dict lookups; with W owners and B buckets a
pick looks at no more than W x B heads, and usually at one owner's B.

`version` grows whenever a task arrives or a queue resumes: a worker that found nothing at
version v finds nothing until it changes, so the scheduler does not ask again.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator

from controller.core.model import Task, Worker

Bucket = tuple[str, frozenset[str]]  # (queue, requires)


class Pending:
    def __init__(self) -> None:
        self._levels: dict[int, dict[str, dict[Bucket, deque[Task]]]] = {}
        self._order: list[int] = []  # the levels' priorities, negated (ascending = high first)
        self.count = 0
        self.paused: set[str] = set()
        self.version = 0

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[Task]:
        for level in self._levels.values():
            for buckets in level.values():
                for tasks in buckets.values():
                    yield from tasks

    def add(self, task: Task, front: bool = False) -> None:
        """A task is pending (`front`: ahead of its owner's others in its bucket, as a task
        that was already handed out and came back)."""
        opts = task.opts
        level = self._levels.get(opts.priority)
        if level is None:
            level = self._levels[opts.priority] = {}
            bisect.insort(self._order, -opts.priority)
        buckets = level.get(opts.owner)
        if buckets is None:
            buckets = level[opts.owner] = {}
        key = (opts.queue, opts.requires)
        tasks = buckets.get(key)
        if tasks is None:
            tasks = buckets[key] = deque()
        if front:
            tasks.appendleft(task)
        else:
            tasks.append(task)
        self.count += 1
        self.version += 1

    def remove(self, task: Task) -> None:
        """Take out a pending task that leaves other than by `pick` (canceled, timed out,
        claimed by a worker after a restart)."""
        opts = task.opts
        level = self._levels[opts.priority]
        buckets = level[opts.owner]
        key = (opts.queue, opts.requires)
        tasks = buckets[key]
        if tasks[0] is task:  # the usual case: the oldest goes first
            tasks.popleft()
        else:
            tasks.remove(task)
        self.count -= 1
        if not tasks:
            del buckets[key]
            if not buckets:
                del level[opts.owner]
                if not level:
                    del self._levels[opts.priority]
                    self._order.remove(-opts.priority)

    def pick(self, worker: Worker) -> Task | None:
        """Take the task `worker` should run next, or None when it can take none."""
        serves, labels, paused = worker.queues, worker.labels, self.paused
        levels = self._levels
        for negated in self._order:
            level = levels[-negated]
            for owner, buckets in level.items():
                best: deque[Task] | None = None
                first = 0
                for key, tasks in buckets.items():
                    queue = key[0]
                    if queue not in serves or (paused and queue in paused):
                        continue
                    if key[1] and not key[1] <= labels:
                        continue
                    ref = tasks[0].ref
                    if best is None or ref < first:
                        best, first, chosen = tasks, ref, key
                if best is None:
                    continue
                task = best.popleft()
                self.count -= 1
                if best:
                    if len(level) > 1:  # the owner had its turn: to the end of the round
                        del level[owner]
                        level[owner] = buckets
                    return task
                del buckets[chosen]
                if buckets:
                    if len(level) > 1:
                        del level[owner]
                        level[owner] = buckets
                    return task
                del level[owner]
                if not level:
                    del levels[-negated]
                    self._order.remove(negated)
                return task
        return None

    def fits(self, worker: Worker, task: Task) -> bool:
        """Whether `worker` may take `task` (it serves its queue and has its labels)."""
        opts = task.opts
        return opts.queue in worker.queues and opts.requires <= worker.labels

    def pause(self, queue: str) -> None:
        self.paused.add(queue)

    def resume(self, queue: str) -> None:
        if queue in self.paused:
            self.paused.discard(queue)
            self.version += 1

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
        self.by_queue: dict[str, int] = {}
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
        self.by_queue[opts.queue] = self.by_queue.get(opts.queue, 0) + 1
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
        self._taken(opts.priority, level, opts.owner, buckets, key, tasks, rotate=False)

    def pick(self, worker: Worker) -> Task | None:
        """Take the task `worker` should run next, or None when it can take none."""
        serves, labels, paused = worker.queues, worker.labels, self.paused
        for negated in self._order:
            level = self._levels[-negated]
            for owner, buckets in level.items():
                best: deque[Task] | None = None
                best_key: Bucket | None = None
                for key, tasks in buckets.items():
                    queue, requires = key
                    if queue not in serves or queue in paused:
                        continue
                    if requires and not requires <= labels:
                        continue
                    if best is None or tasks[0].ref < best[0].ref:
                        best, best_key = tasks, key
                if best is not None and best_key is not None:
                    task = best.popleft()
                    self._taken(-negated, level, owner, buckets, best_key, best, rotate=True)
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

    def _taken(
        self,
        priority: int,
        level: dict[str, dict[Bucket, deque[Task]]],
        owner: str,
        buckets: dict[Bucket, deque[Task]],
        key: Bucket,
        tasks: deque[Task],
        *,
        rotate: bool,
    ) -> None:
        """One task left `tasks`: drop what is now empty; `rotate`: the owner had its turn."""
        self.count -= 1
        queue = key[0]
        left = self.by_queue[queue] - 1
        if left:
            self.by_queue[queue] = left
        else:
            del self.by_queue[queue]
        if not tasks:
            del buckets[key]
        if not buckets:
            del level[owner]
        elif rotate and len(level) > 1:
            del level[owner]
            level[owner] = buckets  # to the end of the round
        if not level:
            del self._levels[priority]
            self._order.remove(-priority)

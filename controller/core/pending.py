"""The pending tasks, in the order free workers take them. Pure: no clock, no I/O.

The order: a free worker takes, among the tasks of the queues it serves (and that are not
paused, nor held by a limit: limits.py) whose `requires` labels it has, one of the highest
priority; among equals, owners take turns (round robin), and one owner's tasks go in
submission order.

How it is indexed: priority level -> owner -> bucket -> deque of tasks, where a bucket is
one (queue, requires) pair. The levels are kept in a list sorted high to low (there are
few); each level's owners are a dict in round-robin order (the owner served last moves to
the end); each owner keeps its buckets and their heads as (ref, bucket) pairs sorted by ref.
A worker looks at the highest level first, and in it at owners in turn until one has a
bucket the worker can take; of that owner's heads it takes the first it may take, which is
the oldest (usually the very first: a pick is a few dict lookups and one sorted insert into
a list as long as the owner has buckets). With W owners and B buckets a pick looks at no
more than W x B heads, and a worker that serves everything at one.

`version` grows whenever a task arrives or a queue resumes (or a limit lets it go on): a
worker that found nothing at version v finds nothing until it changes, so the scheduler does
not ask again.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator

from controller.core.model import Task, Worker

Bucket = tuple[str, frozenset[str]]  # (queue, requires)


class _Owner:
    """One owner's pending tasks at one priority: a deque per bucket, and the buckets'
    heads as (ref, bucket) pairs sorted by ref, so that the oldest head a worker may take is
    the first one it may take."""

    __slots__ = ("buckets", "heads")

    def __init__(self) -> None:
        self.buckets: dict[Bucket, deque[Task]] = {}
        self.heads: list[tuple[int, Bucket]] = []


class Pending:
    def __init__(self) -> None:
        self._levels: dict[int, dict[str, _Owner]] = {}
        self._order: list[int] = []  # the levels' priorities, negated (ascending = high first)
        self.count = 0
        self.paused: set[str] = set()
        self.blocked: set[str] = set()  # queues a limit holds (limits.py)
        self.held: set[str] = set()  # paused or blocked: none of their tasks is handed out
        self.version = 0

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[Task]:
        for level in self._levels.values():
            for owner in level.values():
                for tasks in owner.buckets.values():
                    yield from tasks

    def add(self, task: Task, front: bool = False) -> None:
        """A task is pending (`front`: ahead of its owner's others in its bucket, as a task
        that was already handed out and came back)."""
        opts = task.opts
        level = self._levels.get(opts.priority)
        if level is None:
            level = self._levels[opts.priority] = {}
            bisect.insort(self._order, -opts.priority)
        owner = level.get(opts.owner)
        if owner is None:
            owner = level[opts.owner] = _Owner()
        key = (opts.queue, opts.requires)
        tasks = owner.buckets.get(key)
        if tasks is None:
            owner.buckets[key] = deque((task,))
            bisect.insort(owner.heads, (task.ref, key))
        elif front:
            owner.heads.remove((tasks[0].ref, key))
            tasks.appendleft(task)
            bisect.insort(owner.heads, (task.ref, key))
        else:
            tasks.append(task)
        self.count += 1
        self.version += 1

    def remove(self, task: Task) -> None:
        """Take out a pending task that leaves other than by `pick` (canceled, timed out,
        claimed by a worker after a restart)."""
        opts = task.opts
        level = self._levels[opts.priority]
        owner = level[opts.owner]
        key = (opts.queue, opts.requires)
        tasks = owner.buckets[key]
        if tasks[0] is task:  # the usual case: the oldest goes first
            owner.heads.remove((task.ref, key))
            tasks.popleft()
            if tasks:
                bisect.insort(owner.heads, (tasks[0].ref, key))
        else:
            tasks.remove(task)
        self.count -= 1
        if not tasks:
            del owner.buckets[key]
            if not owner.buckets:
                del level[opts.owner]
                if not level:
                    del self._levels[opts.priority]
                    self._order.remove(-opts.priority)

    def pick(self, worker: Worker) -> Task | None:
        """Take the task `worker` should run next, or None when it can take none."""
        serves, labels, paused = worker.queues, worker.labels, self.held
        levels = self._levels
        for negated in self._order:
            level = levels[-negated]
            for name, owner in level.items():
                heads = owner.heads
                key = heads[0][1]  # most often the one: its oldest job, of a queue served
                if (
                    key[0] in serves
                    and not (paused and key[0] in paused)
                    and (not key[1] or key[1] <= labels)
                ):
                    index = 0
                else:
                    for index in range(1, len(heads)):
                        key = heads[index][1]
                        queue = key[0]
                        if queue not in serves or (paused and queue in paused):
                            continue
                        if key[1] and not key[1] <= labels:
                            continue
                        break
                    else:
                        continue  # nothing of this owner's for this worker
                tasks = owner.buckets[key]
                task = tasks.popleft()
                self.count -= 1
                if tasks:
                    if len(heads) == 1:
                        heads[0] = (tasks[0].ref, key)
                    else:
                        del heads[index]
                        bisect.insort(heads, (tasks[0].ref, key))
                    if len(level) > 1:  # the owner had its turn: to the end of the round
                        del level[name]
                        level[name] = owner
                    return task
                del heads[index]
                del owner.buckets[key]
                if heads:
                    if len(level) > 1:
                        del level[name]
                        level[name] = owner
                    return task
                del level[name]
                if not level:
                    del levels[-negated]
                    self._order.remove(negated)
                return task
        return None

    def fits(self, worker: Worker, task: Task) -> bool:
        """Whether `worker` may take `task` (it serves its queue and has its labels)."""
        opts = task.opts
        return opts.queue in worker.queues and opts.requires <= worker.labels

    def other(self, task: Task, worker: Worker, idle: dict[int, Worker]) -> Worker:
        """An idle worker that may take `task` and that it has not failed on, else `worker`.
        (At most len(failed_on) idle workers can be excluded, so this looks at few.)"""
        looked = 0
        for other in reversed(idle.values()):
            if other.worker_id in task.failed_on:
                looked += 1
                if looked > len(task.failed_on):
                    break
                continue
            if self.fits(other, task):
                return other
        return worker

    def pause(self, queue: str) -> None:
        self.paused.add(queue)
        self.held.add(queue)

    def resume(self, queue: str) -> None:
        if queue in self.paused:
            self.paused.discard(queue)
            self._release(queue)

    def block(self, queue: str) -> None:
        """A limit holds `queue` (at its concurrency, or out of tokens)."""
        self.blocked.add(queue)
        self.held.add(queue)

    def unblock(self, queue: str) -> None:
        if queue in self.blocked:
            self.blocked.discard(queue)
            self._release(queue)

    def _release(self, queue: str) -> None:
        if queue in self.held and queue not in self.paused and queue not in self.blocked:
            self.held.discard(queue)
            self.version += 1

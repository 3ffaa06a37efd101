"""The roster of remote workers: their numbers, names and done counts, by key. Pure.

Pollers are known by name and calculators by address, and anyone on the
network can invent new ones. A remote worker's number (which "prefer a worker
the job has not failed on" and the status views use) and its count of jobs
done outlive its comings and goings (a poller is a worker only while it waits
in /ping/ or holds a job), but not its silence: `forget_after` seconds after
it was last heard, and not live, it is forgotten, and past `MAX_REMEMBERED`
entries the one heard longest ago that is not live goes first, so a stream of
new names or addresses cannot grow these dicts (nor the deadline heap) without
end, even within `forget_after`. Entries are kept in the order they are due to
be looked at, and the roster holds one deadline in the scheduler's heap at a
time: the first entry's.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from controller.core.model import Action, Worker, WorkerKind
from controller.core.scheduler import Scheduler

K = TypeVar("K", bound=Hashable)

# A live worker is never forgotten; its entry is looked at again after this many seconds at
# least (with a forget_after of 0 too).
RECHECK_LIVE = 1.0
# Entries kept per roster: past it a new key makes the one heard longest ago (not live) go.
MAX_REMEMBERED = 10_000
# Live entries looked past, at most, to find one to forget for a new key (past that the
# roster holds one more: live workers are bounded by their doors).
EVICT_SCAN = 8


class Roster(Generic[K]):
    def __init__(
        self,
        scheduler: Scheduler,
        first_id: int,
        forget_after: float,
        name_of: Callable[[K], str],
        on_forget: Callable[[K], None] = lambda key: None,
        limit: int = MAX_REMEMBERED,
    ) -> None:
        self.scheduler = scheduler
        self.forget_after = forget_after
        self.limit = limit
        self._name_of = name_of
        self._on_forget = on_forget  # the kind drops what else it keeps by key
        self._next_id = itertools.count(first_id)
        self.ids: dict[K, int] = {}
        self.keys: dict[int, K] = {}
        self.names: dict[int, str] = {}
        self.done: dict[int, int] = {}  # jobs ended on it, over its lives as a worker
        # When each entry is to be looked at again, in the order they were set (which is
        # that order but for a live entry's recheck, when forget_after < RECHECK_LIVE).
        # (An OrderedDict: a plain dict slows down as entries leave its front and come back.)
        self._due_at: OrderedDict[int, float] = OrderedDict()
        self._armed = math.inf  # when the roster's one deadline in the heap is due

    def __len__(self) -> int:
        return len(self.ids)

    def enlist(
        self, key: K, kind: WorkerKind, now: float, queues: frozenset[str], labels: frozenset[str]
    ) -> Worker:
        """A live worker for `key` (heard now), with its number and its jobs done over its
        earlier lives, added to the scheduler."""
        wid = self.heard(key, now)
        worker = Worker(
            worker_id=wid,
            kind=kind,
            pid=None,
            uid=None,
            deadline=0.0,
            queues=queues,
            labels=labels,
        )
        worker.done = self.done.get(wid, 0)
        worker.last_pulse = now
        self.scheduler.add_worker(worker)
        return worker

    def heard(self, key: K, now: float) -> int:
        """`key` spoke now: its number (a new one for a key not known)."""
        wid = self.ids.get(key)
        if wid is None:
            if len(self.ids) >= self.limit:
                self._make_room(now)
            wid = self.ids[key] = next(self._next_id)
            self.keys[wid] = key
            self.names[wid] = self._name_of(key)
        self._due_at[wid] = now + self.forget_after
        self._due_at.move_to_end(wid)  # the latest heard
        self._arm()
        return wid

    def _arm(self) -> None:
        """Keep one deadline in the heap, for the first entry."""
        first = next(iter(self._due_at.values()), math.inf)
        if first < self._armed:
            self._armed = first
            self.scheduler.at(first, self._due, None)

    def _make_room(self, now: float) -> None:
        """Forget the entry heard longest ago that is not live (a live one met on the way
        is looked at again later)."""
        for _ in range(EVICT_SCAN):
            wid = next(iter(self._due_at), None)
            if wid is None:
                return
            if wid not in self.scheduler.workers:
                self._drop(wid)
                return
            self._recheck(wid, now)

    def _recheck(self, wid: int, now: float) -> None:
        self._due_at[wid] = now + max(self.forget_after, RECHECK_LIVE)
        self._due_at.move_to_end(wid)

    def _drop(self, wid: int) -> None:
        del self._due_at[wid]
        key = self.keys.pop(wid)
        del self.ids[key], self.names[wid]
        self.done.pop(wid, None)
        self._on_forget(key)

    def _due(self, when: float, obj: object, now: float, actions: list[Action]) -> None:
        if when != self._armed:  # a deadline an earlier one replaced
            return
        self._armed = math.inf
        due_at = self._due_at
        for _ in range(len(due_at)):  # each entry looked at once at most
            wid = next(iter(due_at), None)
            if wid is None or due_at[wid] > now:
                break
            if wid in self.scheduler.workers:  # live: look again later
                self._recheck(wid, now)
            else:
                self._drop(wid)
        self._arm()

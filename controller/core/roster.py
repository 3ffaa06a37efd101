"""The roster of remote workers: their numbers, names and done counts, by key. Pure.

Pollers are known by name and calculators by address, and anyone on the
network can invent new ones. A remote worker's number (which "prefer a worker
the job has not failed on" and the status views use) and its count of jobs
done outlive its comings and goings (a poller is a worker only while it waits
in /ping/ or holds a job), but not its silence: `forget_after` seconds after
it was last heard, and not live, it is forgotten, so a stream of new names or
addresses cannot grow these dicts without end. Each entry has at most one
deadline in the scheduler's heap at a time.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from controller.core.model import Action
from controller.core.scheduler import Scheduler

K = TypeVar("K", bound=Hashable)

# A live worker is never forgotten; its entry is looked at again after this many seconds at
# least (with a forget_after of 0 too).
RECHECK_LIVE = 1.0


class Roster(Generic[K]):
    def __init__(
        self,
        scheduler: Scheduler,
        first_id: int,
        forget_after: float,
        name_of: Callable[[K], str],
        on_forget: Callable[[K], None] = lambda key: None,
    ) -> None:
        self.scheduler = scheduler
        self.forget_after = forget_after
        self._name_of = name_of
        self._on_forget = on_forget  # the kind drops what else it keeps by key
        self._next_id = itertools.count(first_id)
        self.ids: dict[K, int] = {}
        self.keys: dict[int, K] = {}
        self.names: dict[int, str] = {}
        self.done: dict[int, int] = {}  # jobs ended on it, over its lives as a worker
        self._heard: dict[int, float] = {}
        self._armed: set[int] = set()

    def __len__(self) -> int:
        return len(self.ids)

    def heard(self, key: K, now: float) -> int:
        """`key` spoke now: its number (a new one for a key not known)."""
        wid = self.ids.get(key)
        if wid is None:
            wid = self.ids[key] = next(self._next_id)
            self.keys[wid] = key
            self.names[wid] = self._name_of(key)
        self._heard[wid] = now
        if wid not in self._armed:
            self._armed.add(wid)
            self.scheduler.at(now + self.forget_after, self._due, wid)
        return wid

    def _due(self, when: float, obj: object, now: float, actions: list[Action]) -> None:
        assert isinstance(obj, int)
        wid = obj
        if wid not in self._heard:
            self._armed.discard(wid)
            return
        later = self._heard[wid] + self.forget_after
        if wid in self.scheduler.workers:  # live: look again later
            later = max(later, now + max(self.forget_after, RECHECK_LIVE))
        if later > now:
            self.scheduler.at(later, self._due, wid)
            return
        self._armed.discard(wid)
        key = self.keys.pop(wid)
        del self.ids[key], self.names[wid], self._heard[wid]
        self.done.pop(wid, None)
        self._on_forget(key)

"""Periodic jobs (config `schedules`): entries, their due times and their jobs' ids. Pure.

A schedule is due at the times of a five-field cron expression read in UTC, or at
every multiple of `every` seconds since the Unix epoch. Both depend on the time
alone, never on when a controller started, so every controller sharing a Redis
agrees on them, and each due time names its job:
`cron-<name>-<UTC time as YYYYMMDDTHHMMSSZ>`. A shell (controller/shell/schedules.py)
asks for "the latest due time at or before now" and "the next due time after t"
and makes the jobs.

Cron expressions are read by cronsim: a small pure-Python library without
dependencies that takes standard five-field expressions (names of months and
days, ranges, steps, L, LW and #) and walks both forwards and backwards. A
six-field expression (seconds first), which cronsim also reads, is refused
here: job ids name a second, and due times stay on whole minutes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from cronsim import CronSim, CronSimError

from controller.options import (
    DEFAULT_QUEUE,
    MAX_PRIORITY,
    MAX_SECONDS,
    MIN_PRIORITY,
    NAME_RULE,
    valid_name,
)

ID_PREFIX = "cron-"
ID_TIME_FORMAT = "%Y%m%dT%H%M%SZ"
MEMBERS = ("name", "cron", "every", "payload", "queue", "priority")
# A payload is text in the config file; the job's payload is its UTF-8. Bounded so that a
# mistaken file cannot hold the controller's memory: the HTTP door's own default cap.
MAX_PAYLOAD = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Schedule:
    """One entry of `schedules`: exactly one of `cron` and `every` is set."""

    name: str
    cron: str | None = None
    every: int | None = None  # whole seconds, at least 1
    payload: str = ""
    queue: str = DEFAULT_QUEUE
    priority: int = 0

    def latest_due(self, now: float) -> float:
        """The latest due time at or before `now` (wall-clock seconds)."""
        if self.every is not None:
            k = math.floor(now / self.every)
            while k * self.every > now:  # the division rounded up across a due time
                k -= 1
            while (k + 1) * self.every <= now:
                k += 1
            return float(k * self.every)
        assert self.cron is not None
        # Reversed, cronsim first steps one second back from a whole second: start one past.
        start = _utc(math.floor(now) + 1)
        return next(CronSim(self.cron, start, reverse=True)).timestamp()

    def next_due(self, after: float) -> float:
        """The first due time after `after` (strictly)."""
        if self.every is not None:
            return self.latest_due(after) + self.every
        assert self.cron is not None
        return next(CronSim(self.cron, _utc(math.floor(after)))).timestamp()

    def job_id(self, due: float) -> str:
        """The id of the job made for due time `due`."""
        return f"{ID_PREFIX}{self.name}-{_utc(round(due)).strftime(ID_TIME_FORMAT)}"


def _utc(seconds: int) -> datetime:
    # datetime arithmetic from the epoch, not fromtimestamp: exact for every whole second.
    return datetime(1970, 1, 1, tzinfo=UTC) + timedelta(seconds=seconds)


def _cron(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"cron must be a five-field cron expression as text, got {value!r}")
    fields = value.split()
    if len(fields) != 5:
        raise ValueError(
            f'cron must have five fields (minute hour day month weekday, e.g. "0 3 * * *"),'
            f" got {value[:80]!r}"
        )
    expression = " ".join(fields)
    try:
        probe = CronSim(expression, _utc(0))
        next(probe)
    except (CronSimError, StopIteration) as exc:
        reason = str(exc) or "it never matches"
        raise ValueError(f"cron {value[:80]!r} is not a valid expression: {reason}") from None
    return expression


def _every(value: Any) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"every must be a whole number of seconds, got {value!r}")
    if not 1 <= value <= MAX_SECONDS:
        raise ValueError(f"every must be from 1 to {MAX_SECONDS:g} seconds, got {value}")
    return value


def parse_entry(entry: Any) -> Schedule:
    """One entry of `schedules` as given in the config file; ValueError saying what is wrong."""
    if not isinstance(entry, Mapping):
        raise ValueError(
            f'must be an object like {{"name": "nightly", "cron": "0 3 * * *"}}, got {entry!r}'
        )
    unknown = sorted(set(entry) - set(MEMBERS))
    if unknown:
        raise ValueError(f"unknown member {unknown[0]!r} (expected {', '.join(MEMBERS)})")
    name = entry.get("name")
    if not valid_name(name):
        raise ValueError(f"name must match {NAME_RULE}, got {name!r}")
    if ("cron" in entry) == ("every" in entry):
        raise ValueError("give exactly one of cron and every")
    cron = _cron(entry["cron"]) if "cron" in entry else None
    every = _every(entry["every"]) if "every" in entry else None
    payload = entry.get("payload", "")
    if not isinstance(payload, str):
        raise ValueError(f"payload must be text, got {type(payload).__name__}")
    try:
        size = len(payload.encode())
    except UnicodeEncodeError:
        raise ValueError("payload holds a lone surrogate, which is not text") from None
    if size > MAX_PAYLOAD:
        raise ValueError(f"payload must be at most {MAX_PAYLOAD} bytes")
    queue = entry.get("queue", DEFAULT_QUEUE)
    if not valid_name(queue):
        raise ValueError(f"queue must match {NAME_RULE}, got {queue!r}")
    priority = entry.get("priority", 0)
    if (
        isinstance(priority, bool)
        or not isinstance(priority, int)
        or not MIN_PRIORITY <= priority <= MAX_PRIORITY
    ):
        raise ValueError(
            f"priority must be an integer from {MIN_PRIORITY} to {MAX_PRIORITY}, got {priority!r}"
        )
    return Schedule(str(name), cron, every, payload, queue, priority)


def parse_entries(value: Any) -> tuple[Schedule, ...]:
    """The whole `schedules` list; ValueError naming the entry that is wrong."""
    if not isinstance(value, list):
        raise ValueError(
            f'must be a list of objects like {{"name": "nightly", "cron": "0 3 * * *"}},'
            f" got {value!r}"
        )
    schedules: list[Schedule] = []
    seen: set[str] = set()
    for index, entry in enumerate(value):
        try:
            schedule = parse_entry(entry)
        except ValueError as exc:
            name = entry.get("name") if isinstance(entry, Mapping) else None
            which = f"entry {index}" + (f" ({name!r})" if isinstance(name, str) else "")
            raise ValueError(f"{which}: {exc}") from None
        if schedule.name in seen:
            raise ValueError(f"entry {index}: the name {schedule.name!r} is used twice")
        seen.add(schedule.name)
        schedules.append(schedule)
    return tuple(schedules)

"""Ceilings for one job (DESIGN.md section 15): what they are, how they are written, how two
of them combine.

The same six keys appear in the config's `job_limits`, as worker flags (`--memory-max`...),
as a job's own `limits` option and in SET_TASK's `JobLimits` message. Sizes are bytes, or a
number with a K, M or G suffix (1024, 1024², 1024³); `cpu_time` is seconds; `cpu_quota` is a
fraction of one CPU (cgroup only). A job may only ask for less than the config allows. Pure:
the worker applies the result with setrlimit and cgroups (worker/limits/).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gen import worker_protocol_pb2 as pb

_SIZE = re.compile(r"^\s*(\d+)\s*([KMG]?)i?B?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}
# Far beyond any real ceiling; keeps every value inside the 64-bit fields of the wire.
_MAX_BYTES = 2**62
_MAX_COUNT = 2**31 - 1
# One year of CPU: more is a typo, not a limit.
_MAX_SECONDS = 365 * 86400.0


class LimitError(ValueError):
    """A limit that is malformed, unknown, or above what is allowed; already phrased."""


@dataclass(frozen=True)
class JobLimits:
    """Each ceiling or None (no limit)."""

    memory_max: int | None = None
    tasks_max: int | None = None
    cpu_time: float | None = None
    file_size: int | None = None
    open_files: int | None = None
    cpu_quota: float | None = None

    def is_empty(self) -> bool:
        return all(getattr(self, name) is None for name in KEYS)

    def tighter(self, other: JobLimits) -> JobLimits:
        """Each ceiling the lower of the two (a missing one yields to the other)."""
        values: dict[str, Any] = {}
        for name in KEYS:
            mine, theirs = getattr(self, name), getattr(other, name)
            values[name] = theirs if mine is None else mine if theirs is None else min(mine, theirs)
        return JobLimits(**values)

    def exceeding(self, ceiling: JobLimits) -> str | None:
        """The first key of these set above `ceiling`'s (where `ceiling` sets it), else None."""
        for name in KEYS:
            mine, cap = getattr(self, name), getattr(ceiling, name)
            if mine is not None and cap is not None and mine > cap:
                return name
        return None

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in KEYS if getattr(self, name) is not None}

    def to_proto(self) -> pb.JobLimits:
        message = pb.JobLimits()
        for name in KEYS:
            value = getattr(self, name)
            if value is not None:
                setattr(message, name, value)
        return message


KEYS = tuple(field.name for field in dataclasses.fields(JobLimits))
_SIZES = ("memory_max", "file_size")
_COUNTS = ("tasks_max", "open_files")
NO_LIMITS = JobLimits()


def parse_size(value: Any) -> int:
    """Bytes from an integer or a text like "256M" (K, M, G: powers of 1024)."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str) and (match := _SIZE.match(value)):
        size = int(match.group(1)) * _UNITS[match.group(2).upper()]
    else:
        raise LimitError(f"must be a size in bytes or like '256M' (K, M, G), got {value!r}")
    if not 1 <= size <= _MAX_BYTES:
        raise LimitError(f"must be from 1 byte to {_MAX_BYTES} bytes, got {value!r}")
    return size


def _count(value: Any) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= _MAX_COUNT:
        raise LimitError(f"must be a whole number from 1 to {_MAX_COUNT}, got {value!r}")
    return value


def _seconds(value: Any) -> float:
    return _finite(
        value,
        "must be a number of seconds",
        lambda v: 0 < v <= _MAX_SECONDS,
        f"must be seconds above 0, at most {_MAX_SECONDS:g}",
    )


def _quota(value: Any) -> float:
    return _finite(
        value,
        "must be a fraction of one CPU like 0.5",
        lambda v: 0.01 <= v <= 4096,
        "must be a fraction of one CPU from 0.01 to 4096",
    )


def _finite(
    value: Any, unreadable: str, in_range: Callable[[float], bool], out_of_range: str
) -> float:
    """A finite number (text is read as one) for which `in_range` holds. LimitError: the
    message `unreadable` for text that is no number, else `out_of_range`; each names `value`."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise LimitError(f"{unreadable}, got {value!r}") from None
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or not in_range(value)
    ):
        raise LimitError(f"{out_of_range}, got {value!r}")
    return float(value)


def parse_value(name: str, value: Any) -> int | float:
    """One limit's value, checked; `name` must be one of KEYS."""
    if name in _SIZES:
        return parse_size(value)
    if name in _COUNTS:
        return _count(value)
    if name == "cpu_time":
        return _seconds(value)
    if name == "cpu_quota":
        return _quota(value)
    raise LimitError(f"unknown limit {name!r} (known: {', '.join(KEYS)})")


def parse_limits(value: Any) -> JobLimits:
    """A JSON object of limits (config `job_limits`, a job's `limits`); null is none."""
    if value is None:
        return NO_LIMITS
    if not isinstance(value, Mapping):
        raise LimitError(f'must be an object like {{"memory_max": "256M"}}, got {value!r}')
    values: dict[str, Any] = {}
    for name, raw in value.items():
        if name not in KEYS:
            raise LimitError(f"unknown limit {name!r} (known: {', '.join(KEYS)})")
        if raw is None:
            continue
        try:
            values[name] = parse_value(name, raw)
        except LimitError as exc:
            raise LimitError(f"{name} {exc}") from None
    return JobLimits(**values)


def from_proto(message: pb.JobLimits) -> JobLimits:
    """The limits a SET_TASK carries (0 means not set); values past the caps are dropped."""
    values: dict[str, Any] = {}
    for name in KEYS:
        raw = getattr(message, name)
        if raw:
            try:
                values[name] = parse_value(name, raw)
            except LimitError:
                continue
    return JobLimits(**values)


def describe_size(size: int) -> str:
    """'256 MiB' for an exact MiB, else bytes; used in limit errors."""
    for unit, factor in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if size % factor == 0:
            return f"{size // factor} {unit}"
    return f"{size} bytes"

"""What one attempt of a job used, as its worker measured it: the `Usage` record, the checks
a worker's report passes, and its forms in a remote worker's JSON and in the journal."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Usage:
    """What one attempt used, as its worker measured it (DESIGN.md section 15): seconds of
    wall clock and of CPU (user + system, the job and its children), its peak resident
    memory in bytes, and under a cgroup the cgroup's peak (None: not measured)."""

    wall: float
    cpu: float
    max_rss: int
    memory_peak: int | None = None

    def to_json(self) -> dict[str, float | int]:
        out: dict[str, float | int] = {"wall": self.wall, "cpu": self.cpu, "max_rss": self.max_rss}
        if self.memory_peak is not None:
            out["memory_peak"] = self.memory_peak
        return out

    def to_row(self) -> list[float | int | None]:
        """As the journal keeps it: [wall, cpu, max_rss, memory_peak or null]."""
        return [self.wall, self.cpu, self.max_rss, self.memory_peak]


# The largest byte count a usage report may carry (a larger one is a lie, and SQLite's
# integers stop here).
MAX_USAGE_BYTES = 2**63 - 1


def checked_usage(wall: object, cpu: object, max_rss: object, peak: object = None) -> Usage | None:
    """A worker's report of what an attempt used, from any kind of worker; None when a value
    cannot be true (not a number, NaN, negative, too large)."""
    if not (
        _seconds(wall) and _seconds(cpu) and _bytes(max_rss) and (peak is None or _bytes(peak))
    ):
        return None
    assert isinstance(wall, int | float) and isinstance(cpu, int | float)
    assert isinstance(max_rss, int) and (peak is None or isinstance(peak, int))
    return Usage(float(wall), float(cpu), max_rss, peak or None)


def _seconds(value: object) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


def _bytes(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_USAGE_BYTES


def usage_from_json(value: object) -> Usage | None:
    """A remote worker's `usage` object ({"wall", "cpu", "max_rss"[, "memory_peak"]}):
    ValueError when it is not one."""
    if (
        not isinstance(value, dict)
        or not {"wall", "cpu", "max_rss"} <= set(value)
        or (set(value) - {"wall", "cpu", "max_rss", "memory_peak"})
    ):
        raise ValueError("usage must be {wall, cpu, max_rss[, memory_peak]}")
    usage = checked_usage(value["wall"], value["cpu"], value["max_rss"], value.get("memory_peak"))
    if usage is None:
        raise ValueError("usage holds a value that cannot be true")
    return usage


def usage_from_row(row: object) -> Usage | None:
    """`Usage.to_row` read back (None for anything else: an older journal has none)."""
    if not isinstance(row, list) or len(row) != 4:
        return None
    wall, cpu, max_rss, peak = row
    return Usage(float(wall), float(cpu), int(max_rss), None if peak is None else int(peak))


def usage_to_text(usage: Usage | None) -> str:
    """The journal's column: JSON, or "" for none."""
    return "" if usage is None else json.dumps(usage.to_row(), separators=(",", ":"))


def usage_from_text(text: str) -> Usage | None:
    return usage_from_row(json.loads(text)) if text else None

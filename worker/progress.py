"""A job's progress on the worker side: what its handler or command reports, kept for the
controller (DESIGN.md section 17, docs/workers.md "Progress").

How this works. Each worker holds one `Reporter` and makes it the current one
(`REPORTER`, a context variable) wherever a job runs, as it does its output
sink (worker/output.py). A `--handler` that takes a second argument gets
`report`, which hands (progress, status) to the current reporter; an
`--exec` command writes lines `progress 0.4 copying files` to the descriptor
named by `JOB_PROGRESS_FD`, which the worker reads like its stderr and feeds
through `ProgressLines`. The reporter keeps the latest value only: a job that
reports a thousand times a second costs the controller at most one report
every `SEND_SECONDS`, and the last one always goes. Nothing here runs for a
job that reports nothing.
"""

from __future__ import annotations

import contextvars
import math
import threading
from collections.abc import Callable

# How often a job's progress leaves a worker at most (the latest value; the last one goes
# when the job ends).
SEND_SECONDS = 0.25
# Characters of status text sent at most (the controller keeps as many: controller/progress.py).
MAX_STATUS = 200
# The descriptor an `--exec` command writes its progress lines to (JOB_PROGRESS_FD).
PROGRESS_FD = 3
# Bytes of one progress line read at most; a longer line is dropped whole.
MAX_LINE = 1024


class Reporter:
    """The latest progress a job reported, waiting to be sent; set from any thread."""

    __slots__ = ("_lock", "_value", "on_report")

    def __init__(self, on_report: Callable[[], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._value: tuple[float, str] | None = None
        self.on_report = on_report  # told when a value arrives and none waited

    def set(self, progress: float, status: str) -> None:
        with self._lock:
            wake = self._value is None
            self._value = (progress, status)
        if wake and self.on_report is not None:
            self.on_report()

    def take(self) -> tuple[float, str] | None:
        """The latest value, and forgotten (None: nothing new)."""
        with self._lock:
            value, self._value = self._value, None
        return value

    def clear(self) -> None:
        with self._lock:
            self._value = None


# The reporter of the job running in this context (thread or trio task); None outside jobs.
REPORTER: contextvars.ContextVar[Reporter | None] = contextvars.ContextVar("REPORTER", default=None)


def checked(progress: object, status: object = "") -> tuple[float, str]:
    """(progress clamped to 0..1, status cut to MAX_STATUS characters); ValueError for a
    progress that is not a finite number."""
    if isinstance(progress, bool) or not isinstance(progress, int | float):
        raise ValueError(f"progress must be a number from 0 to 1, not {progress!r}")
    value = float(progress)
    if not math.isfinite(value):
        raise ValueError(f"progress must be a number from 0 to 1, not {progress!r}")
    return min(1.0, max(0.0, value)), str(status)[:MAX_STATUS]


def report(progress: float, status: str = "") -> None:
    """What a `--handler` taking a second argument is given: say how far the job is (0 to 1)
    and what it does now. Outside a job, or on a worker whose controller does not take
    progress, it does nothing."""
    value = checked(progress, status)
    reporter = REPORTER.get()
    if reporter is not None:
        reporter.set(*value)


def parse_line(line: bytes) -> tuple[float, str] | None:
    """`progress 0.4 copying files` as (0.4, "copying files"); None for any other line."""
    try:
        text = line.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None
    word, _, rest = text.partition(" ")
    if word != "progress":
        return None
    number, _, status = rest.strip().partition(" ")
    try:
        return checked(float(number), status.strip())
    except ValueError:
        return None


class ProgressLines:
    """Bytes read from a command's progress descriptor, cut into lines, each good one handed
    to `sink` (bad lines, and lines over MAX_LINE bytes, are dropped)."""

    __slots__ = ("_buf", "_skipping", "sink")

    def __init__(self, sink: Callable[[float, str], None]) -> None:
        self._buf = bytearray()
        self._skipping = False  # inside a line too long to keep
        self.sink = sink

    def feed(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        last: tuple[float, str] | None = None
        while (end := buf.find(b"\n")) >= 0:
            line = bytes(buf[:end])
            del buf[: end + 1]
            if self._skipping:
                self._skipping = False
                continue
            value = parse_line(line)
            if value is not None:
                last = value
        if len(buf) > MAX_LINE:
            buf.clear()
            self._skipping = True
        if last is not None:  # a burst of lines: the latest is the one that counts
            self.sink(*last)

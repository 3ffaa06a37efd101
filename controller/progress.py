"""A running job's progress: a fraction from 0 to 1 and a short status text, as any worker
reports it (DESIGN.md section 17, docs/flows.md "Progress").

Every report is hostile input. What the doors and the worker wire do with a bad one:
`clean` answers None for a progress that is not a finite number (the report is dropped,
the worker's pulse or heartbeat still counts), clamps a number outside 0..1 into it, and
keeps the first `MAX_STATUS` characters of the status, its control characters turned into
spaces. The HTTP door refuses instead (400, `check_http`): its caller gets an answer.
"""

from __future__ import annotations

import math

# Characters of status text kept at most.
MAX_STATUS = 200
_CONTROL = {c: " " for c in range(32)} | {127: " "}


def clean(progress: object, status: object) -> tuple[float, str] | None:
    """(progress within 0..1, status of at most MAX_STATUS characters), or None when
    `progress` is not a finite number (a bool is not one)."""
    if isinstance(progress, bool) or not isinstance(progress, int | float):
        return None
    value = float(progress)
    if not math.isfinite(value):
        return None
    text = status if isinstance(status, str) else ""
    return min(1.0, max(0.0, value)), text[:MAX_STATUS].translate(_CONTROL)


def check_http(progress: object, status: object) -> str | None:
    """Why a poller's `progress` / `status` is refused (None: they are good): progress a
    number from 0 to 1, status text of at most MAX_STATUS characters."""
    if isinstance(progress, bool) or not isinstance(progress, int | float):
        return "progress must be a number from 0 to 1"
    if not math.isfinite(progress) or not 0 <= progress <= 1:
        return "progress must be a number from 0 to 1"
    if not isinstance(status, str):
        return "status must be text"
    if len(status) > MAX_STATUS:
        return f"status is over {MAX_STATUS} characters"
    return None

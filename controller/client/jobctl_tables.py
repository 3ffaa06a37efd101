"""What `jobctl` prints without --json: tables of jobs and queues, and one job's details
(controller/client/jobctl.py runs the commands)."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterable
from typing import Any

# Widest a table cell gets before it is cut (a UUID4 id is 36 characters).
CELL = 36
# The most of a payload, a result or an error that `show` prints.
SHOWN = 400


def when(text: Any, now: dt.datetime | None = None) -> str:
    """An RFC 3339 time in the local zone, shortened: the time of day for today, the date and
    minute for this year, else the date."""
    if not isinstance(text, str) or not text:
        return "-"
    try:
        moment = dt.datetime.fromisoformat(text).astimezone()
    except (ValueError, OverflowError):  # not a time, or beyond the years the zone can show
        return text
    now = now or dt.datetime.now().astimezone()
    if moment.date() == now.date():
        return moment.strftime("%H:%M:%S")
    if moment.year == now.year:
        return moment.strftime("%b %d %H:%M")
    return moment.strftime("%Y-%m-%d")


def cut(value: Any, width: int = CELL) -> str:
    """A cell: one line, at most `width` characters (… marks a cut)."""
    text = "-" if value is None or value == "" else str(value)
    text = " ".join(text.split()) if any(c in text for c in "\r\n\t") else text
    return text if len(text) <= width else text[: width - 1] + "…"


def table(header: list[str], rows: Iterable[list[str]]) -> str:
    rows = list(rows)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]
    return "\n".join(lines)


def jobs_table(jobs: Iterable[dict[str, Any]]) -> str:
    header = ["ID", "STATE", "QUEUE", "PRI", "TRIES", "WORKER", "NAME", "UPDATED"]
    return table(
        header,
        (
            [
                cut(job.get("id")),
                cut(job.get("state"), 9),
                cut(job.get("queue", "default"), 16),
                cut(job.get("priority", 0), 4),
                cut(job.get("attempts", 0), 5),
                cut(job.get("worker"), 21),
                cut(job.get("name"), 24),
                when(job.get("updated_at")),
            ]
            for job in jobs
        ),
    )


def queues_table(queues: dict[str, Any]) -> str:
    header = ["QUEUE", "PENDING", "SCHEDULED", "WORKING", "WORKERS", "PAUSED"]
    header += ["CONCURRENCY", "RATE"]  # a queue's limits, "-" for none
    return table(
        header,
        (
            [
                cut(name, 64),
                str(row.get("pending", 0)),
                str(row.get("scheduled", 0)),
                str(row.get("working", 0)),
                str(row.get("workers", 0)),
                "yes" if row.get("paused") else "no",
                cut(row.get("concurrency"), 11),
                cut(row.get("rate"), 14),
            ]
            for name, row in sorted(queues.items())
        ),
    )


def usage_line(usage: dict[str, Any]) -> str:
    """What a job's latest attempt used, in one line: 'wall 1.234 s, cpu 0.500 s, max_rss
    12.0 MiB' (and memory_peak under a cgroup)."""
    parts = []
    for name, unit in (("wall", "s"), ("cpu", "s"), ("max_rss", ""), ("memory_peak", "")):
        value = usage.get(name)
        if not isinstance(value, int | float) or isinstance(value, bool):
            continue
        if unit:
            parts.append(f"{name} {value:.3f} s")
        else:
            parts.append(f"{name} {value / 1048576:.1f} MiB")
    return ", ".join(parts) or "-"


def job_details(job: dict[str, Any]) -> str:
    """Every field of a job, one a line; long texts cut, bytes as their size."""
    lines = []
    for key, value in job.items():
        if key in ("added_at", "updated_at", "run_at") and isinstance(value, str):
            shown = f"{when(value)}  ({value})"
        elif key in ("payload_b64", "result_b64") and isinstance(value, str):
            shown = f"{len(value) * 3 // 4 - value.count('=')} bytes (base64 in --json)"
        elif key == "progress" and isinstance(value, int | float) and value is not True:
            shown = f"{value * 100:.0f}%"  # as far as its worker last said (0..1)
        elif key == "usage" and isinstance(value, dict):
            shown = usage_line(value)
        elif key == "limits" and isinstance(value, dict):
            shown = ", ".join(f"{name} {limit}" for name, limit in value.items()) or "-"
        elif key == "log" and isinstance(value, list):
            lines.append(f"{'log':<18} {len(value)} line(s)")
            lines.extend(f"  {cut(entry, 200)}" for entry in value[-20:])
            continue
        elif isinstance(value, list):
            shown = ",".join(str(v) for v in value) or "-"
        elif isinstance(value, bool):
            shown = json.dumps(value)
        else:
            shown = cut(value, SHOWN)
        lines.append(f"{key:<18} {shown}")
    return "\n".join(lines)

"""What udp-client prints on a terminal: the progress line, the summary, the status table."""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from typing import Any

from controller.client.udp_engine import Outcome
from controller.datagram import put_bytes


class Progress:
    """A progress line on a terminal, a plain line every few seconds elsewhere."""

    def __init__(self, total: int, stream: Any = sys.stderr) -> None:
        self.total = total
        self.done = 0
        self.failed = 0
        self.stream = stream
        self.tty = stream.isatty()
        self.start = time.monotonic()
        self._last = 0.0
        self._finished = False

    def step(self, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        now = time.monotonic()
        if now - self._last < (0.1 if self.tty else 5.0) and self.done < self.total:
            return
        self._last = now
        elapsed = max(now - self.start, 1e-9)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate else math.inf
        if self.tty:
            width = 30
            filled = width * self.done // self.total
            bar = "#" * filled + "-" * (width - filled)
            # \x1b[K clears what a longer earlier line left at the end.
            print(
                f"\r[{bar}] {self.done}/{self.total} {rate:,.0f}/s "
                f"ETA {eta:,.0f}s failed {self.failed}\x1b[K",
                end="",
                file=self.stream,
                flush=True,
            )
            if self.done == self.total:
                self.finish()
        else:
            print(
                f"progress: {self.done}/{self.total} done, {rate:,.0f}/s, "
                f"ETA {eta:,.0f} s, {self.failed} failed",
                file=self.stream,
                flush=True,
            )

    def finish(self) -> None:
        """End the progress line (on a terminal), so that what follows starts on its own."""
        if self.tty and not self._finished:
            self._finished = True
            print(file=self.stream, flush=True)


def outcome_json(outcome: Outcome, job_id: str) -> str:
    """One JSON line for one job: id, task_id, status, and result (or result_b64) or error."""
    line: dict[str, Any] = {"id": job_id, "task_id": outcome.task_id, "status": outcome.status}
    if outcome.status == "success":
        put_bytes(line, "result", outcome.result)
    else:
        line["error"] = outcome.error
    return json.dumps(line, ensure_ascii=False)


def summary(outcomes: list[Outcome], duplicates: int, elapsed: float) -> str:
    counts = {status: 0 for status in ("success", "error", "failed_post", "refused", "timeout")}
    for outcome in outcomes:
        counts[outcome.status] = counts.get(outcome.status, 0) + 1
    latencies = sorted(o.latency for o in outcomes if o.status == "success")
    lines = [
        f"tasks: {len(outcomes)} in {elapsed:.2f} s ({len(outcomes) / max(elapsed, 1e-9):,.0f}/s)",
        f"succeeded: {counts['success']}  failed: {counts['error']}"
        f"  failed_post: {counts['failed_post']}  refused: {counts['refused']}"
        f"  no answer: {counts['timeout']}",
        f"duplicates suppressed: {duplicates}",
    ]
    if latencies:
        p50 = statistics.median(latencies)
        p99 = latencies[min(len(latencies) - 1, math.ceil(0.99 * len(latencies)) - 1)]
        lines.append(f"latency p50 {p50 * 1000:.2f} ms  p99 {p99 * 1000:.2f} ms")
    return "\n".join(lines)


def _declared(worker: dict[str, Any]) -> str:
    """`  queues / labels` of a worker (a controller older than these shows nothing)."""
    queues, labels = worker.get("queues"), worker.get("labels")
    if queues is None:
        return ""
    return f"  {queues} / {labels or '-'}"


def format_status(report: dict[str, Any]) -> str:
    workers = report.get("workers", [])
    total = report.get("workers_total", len(workers))
    lines = [f"workers: {total}"]
    kinds = report.get("kinds")
    if kinds:
        lines.append(
            "  by kind: "
            + ", ".join(
                f"{kind} {k.get('workers', 0)} ({k.get('idle', 0)} idle, done {k.get('done', 0)})"
                for kind, k in kinds.items()
            )
        )
    if workers:
        lines.append(
            f"  {'worker':<22} {'kind':<10} {'pid':>8}  {'state':<9} {'task':>8}"
            f" {'last pulse':>11} {'done':>8}  queues / labels"
        )
        for w in workers:
            name = str(w.get("name", w["id"]))
            lines.append(
                f"  {name:<22} {w.get('kind', 'local'):<10} {w['pid'] or '-':>8}  "
                f"{w['state']:<9} {w['task']:>8} {w['last_pulse_s']:>9.1f} s {w['done']:>8}"
                + _declared(w)
            )
        if isinstance(total, int) and total > len(workers):
            lines.append(f"  ... and {total - len(workers)} more (the answer has room for few)")
    tasks = report.get("tasks", {})
    lines.append("tasks: " + ", ".join(f"{k} {v}" for k, v in tasks.items()))
    lines.append(
        f"retries {report.get('retries', 0)}, restarts sent {report.get('restarts_sent', 0)}, "
        f"workers lost {report.get('worker_losses', {}) or 'none'}"
    )
    door = report.get("front_door")
    if door:
        lines.append("front door: " + ", ".join(f"{k} {v}" for k, v in door.items()))
    redis = report.get("redis")
    if redis:
        link = "connected" if redis.get("connected") else f"UNREACHABLE ({redis.get('last_error')})"

        def shown(key: str) -> str:
            value = redis.get(key)
            return "?" if value is None else str(value)

        lines.append(
            f"redis stream {redis.get('stream')} (group {redis.get('group')}, consumer "
            f"{redis.get('consumer')}): {link}; lag {shown('lag')}, pending {shown('pending')}, "
            f"held here {redis.get('held')} (parked {shown('parked')}), read {redis.get('read')}, "
            f"claimed {redis.get('claimed')}, skipped {redis.get('skipped')}, "
            f"written {redis.get('written')}"
        )
    return "\n".join(lines)

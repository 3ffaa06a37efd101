"""PNG plots of the benchmark results (matplotlib, installed by `make bench`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def throughput(rows: list[dict[str, Any]], path: Path) -> None:
    counts = [r["workers"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(
        counts, [r["tasks_per_s"] for r in rows], "o-", label="job-controller (UDP, end to end)"
    )
    ax.plot(counts, [r["ppe_tasks_per_s"] for r in rows], "s--", label="ProcessPoolExecutor(N)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(counts, [str(c) for c in counts])
    ax.set_xlabel("workers (2-core machine)")
    ax.set_ylabel("no-op tasks per second")
    ax.set_title("Throughput against worker count (default scheduling)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def latency(samples: list[float], path: Path) -> None:
    ms = [s * 1000 for s in samples]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.hist(ms, bins=60, color="tab:blue")
    ordered = sorted(ms)
    p50 = ordered[len(ordered) // 2]
    p99 = ordered[int(0.99 * (len(ordered) - 1))]
    for value, name in ((p50, "p50"), (p99, "p99")):
        ax.axvline(value, color="tab:red", linestyle="--")
        ax.text(value, ax.get_ylim()[1] * 0.9, f" {name} {value:.2f} ms", color="tab:red")
    ax.set_xlabel("round trip of one task at a time (ms)")
    ax.set_ylabel("tasks")
    ax.set_title("End-to-end latency, 2 workers, no-op handler, default scheduling")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

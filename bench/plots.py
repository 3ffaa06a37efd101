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


def efficiency_by_length(
    rows: list[dict[str, Any]], path: Path, baselines: tuple[str, ...] = ()
) -> None:
    """`python -m bench.peers --lengths`: efficiency against job length, a line per system
    (`baselines` dashed), one panel per kind of job (sleep, busy)."""
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    fig, axes = plt.subplots(1, len(kinds), figsize=(5 * len(kinds) + 3, 4.5), squeeze=False)
    for ax, kind in zip(axes[0], kinds, strict=True):
        for system in dict.fromkeys(r["system"] for r in rows):
            points = sorted(
                (r["length_ms"], r["efficiency"])
                for r in rows
                if r["system"] == system and r["kind"] == kind
            )
            style = "o-" if system.startswith("ours") else "s--" if system in baselines else ".:"
            ax.plot([p[0] for p in points], [p[1] for p in points], style, label=system)
        lengths = sorted({r["length_ms"] for r in rows})
        ax.set_xscale("log")
        ax.set_xticks(lengths, [f"{ms:g} ms" for ms in lengths])
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("job length")
        ax.set_ylabel("efficiency: jobs/s / (2 workers / length)")
        ax.set_title(f"{kind} jobs")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1))
    fig.suptitle("What the dispatcher leaves of 2 workers, same run, this 2-core machine")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def scale(rows: list[dict[str, Any]], path: Path, cpus: int) -> None:
    """`make bench-scale`: jobs/s against workers, a panel per job length; a line per protocol
    and journal setting, ProcessPoolExecutor(n) dashed."""
    lengths = sorted({r["length_ms"] for r in rows})
    fig, axes = plt.subplots(1, len(lengths), figsize=(5 * len(lengths), 4), squeeze=False)
    for ax, length in zip(axes[0], lengths, strict=True):
        mine = [r for r in rows if r["length_ms"] == length]
        counts = sorted({r["workers"] for r in mine})
        for protocol in sorted({r["protocol"] for r in mine}):
            for journal in (False, True):
                line = [r for r in mine if r["protocol"] == protocol and r["journal"] == journal]
                if line:
                    label = f"ours, {protocol}, journal {'on' if journal else 'off'}"
                    ax.plot(
                        [r["workers"] for r in line], [r["jobs_per_s"] for r in line], "o-",
                        label=label,
                    )  # fmt: skip
        ppe = {r["workers"]: r["ppe_jobs_per_s"] for r in mine}
        ax.plot(
            counts, [ppe[c] for c in counts], "s--", color="gray", label="ProcessPoolExecutor(n)"
        )
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts, [str(c) for c in counts])
        ax.set_xlabel(f"workers ({cpus}-CPU host)")
        ax.set_ylabel("jobs per second")
        ax.set_title("no-op jobs" if length == 0 else f"jobs of {length:g} ms")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

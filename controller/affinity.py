"""`--cpus LIST`: which CPUs a process may run on (a list like `0`, `0,2` or `1-3`).

With tiny tasks the controller is the one serial stage: every task passes
through it three times, and each time a worker waits for its answer. On a
machine shared with busy workers it answers faster with a CPU of its own
(`controller --cpus 0 --workers 2 -- --cpus 1`, or `CPUAffinity=` in the
systemd units). With long tasks it is idle and pinning only takes a CPU from
the workers, so nothing is pinned unless asked.
"""

from __future__ import annotations

import argparse
import os

from controller.errors import CannotStart


def parse_cpus(text: str) -> frozenset[int]:
    """The CPU numbers in `text`; ArgumentTypeError (a usage error) if it is not a CPU list
    or names a CPU this machine does not have."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, sep, last = part.strip().partition("-")
        if not first.isdigit() or (sep and not last.isdigit()):
            raise argparse.ArgumentTypeError(
                f"expected a CPU list such as 0 or 0,2-3, got {text!r}"
            )
        low, high = int(first), int(last) if sep else int(first)
        if high < low:
            raise argparse.ArgumentTypeError(f"empty CPU range {part.strip()!r} in {text!r}")
        cpus.update(range(low, high + 1))
    # Checked against the machine, not this process's current CPUs: a worker started
    # by a pinned controller may move to a CPU its parent does not use.
    present = set(range(os.cpu_count() or 1))
    missing = sorted(cpus - present)
    if missing:
        raise argparse.ArgumentTypeError(
            f"CPU {', '.join(map(str, missing))} not available here "
            f"(this machine has {format_cpus(present)})"
        )
    return frozenset(cpus)


def format_cpus(cpus: set[int] | frozenset[int]) -> str:
    """`0-3,6`: the short form, for messages and logs."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and runs[-1][1] == cpu - 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(low) if low == high else f"{low}-{high}" for low, high in runs)


class AffinityError(CannotStart):
    """The system refused the CPU list (for example, a cgroup that excludes those CPUs)."""


def pin(cpus: frozenset[int]) -> frozenset[int]:
    """Run this process on `cpus` from now on; returns the CPUs it was allowed before."""
    before = frozenset(os.sched_getaffinity(0))
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        raise AffinityError(
            f"--cpus {format_cpus(cpus)}: the system refused it ({exc.strerror}); "
            f"this process may use {format_cpus(before)}"
        ) from None
    return before

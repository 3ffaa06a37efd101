"""`--nice ADJUSTMENT`: run the controller ahead of (or behind) its workers for the CPU.

With very short jobs the controller is the one serial stage: every job
passes through it three times, and each time a worker (or a client) waits
for its answer. When they share its CPUs, an answer that waits for a time
slice holds them all up, and `--nice -10` (nice(1)'s adjustment: negative
is ahead) lets it answer at once: with the journal off it was +20-45% no-op
jobs a second on 2 CPUs, and since the answers to clients leave in batches
(one wake-up of a client per batch) it is +1.5%. With the journal on (the
packaged default) the controller's own work is what bounds it, and running
it ahead takes CPU from the workers, the client and a redis-server on the
same host: measured from no change to -28%. So it runs as started unless
asked; with an adjustment it lowers its nice value when it may (root, or
CAP_SYS_NICE) and its local workers start at the level it was started
with. docs/operations.md ("Tuning") has the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os

log = logging.getLogger("controller")

DEFAULT_ADJUSTMENT = 0


def parse_adjustment(text: str) -> int:
    """A nice adjustment, -39 to 39 (the result is kept within -20..19)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a whole number such as -5, got {text!r}"
        ) from None
    if not -39 <= value <= 39:
        raise argparse.ArgumentTypeError(f"must be -39 to 39, got {value}")
    return value


def adjust(adjustment: int) -> int | None:
    """Add `adjustment` to this process's nice value; the value it had before (for the
    workers it starts), or None when it is unchanged (0, or refused: logged).

    Call it before any thread starts: Linux keeps a nice value per thread, and new
    threads take their creator's."""
    before = os.getpriority(os.PRIO_PROCESS, 0)
    if adjustment == 0:
        return None
    wanted = max(-20, min(19, before + adjustment))
    try:
        os.setpriority(os.PRIO_PROCESS, 0, wanted)
    except PermissionError:  # asked for and not given: worth a warning
        log.warning(
            "staying at nice %d: raising the controller's priority (--nice %d) needs root or "
            "CAP_SYS_NICE",
            before,
            adjustment,
        )
        return None
    log.info("running at nice %d (started at %d; local workers run at %d)", wanted, before, before)
    return before


def restore(pid: int, nice: int) -> None:
    """Give a child that inherited the controller's nice value the one it started with
    (nothing if it is gone, or if this is not allowed: a positive adjustment)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.setpriority(os.PRIO_PROCESS, pid, nice)

"""Containment: a failure while handling one input is logged and refused, never fatal.

The controller serves the network as root, so a bug that one input reaches
(a datagram, a request, a Redis entry, a worker's message, a value the
journal cannot store) must cost that input alone. Every place that handles
one input (the reactor's callbacks and timers, each door's handler, each
journal batch) catches what escapes it and calls `failed()`: the first
failure of a kind is logged with its traceback, later ones are counted and
summed up in one line per `REPORT_INTERVAL`, so a flood of one bad input
cannot flood the log either. The caller then refuses that input in its
door's words (UDP error code `internal`, HTTP 500, a `failed` Redis outcome,
a closed worker connection) and goes on.
"""

from __future__ import annotations

import logging

log = logging.getLogger("controller")

# Seconds between two summary lines about contained failures.
REPORT_INTERVAL = 30.0
# Kinds of failure remembered (each keeps its first traceback); past it the memory starts again.
MAX_KINDS = 256

# What a refused input is told: the details are in the controller's log only.
INTERNAL_MESSAGE = "the controller failed while handling this; see its log"


class Failures:
    """Counts contained failures and says so in the log, rate-limited."""

    def __init__(self, interval: float = REPORT_INTERVAL) -> None:
        self.interval = interval
        self.total = 0
        self._seen: set[str] = set()
        self._unreported = 0
        self._last_report = -interval

    def failed(self, where: str, exc: BaseException, now: float, detail: str = "") -> None:
        """`exc` escaped the handling of one input at `where` (a fixed phrase: with the
        exception's type it names the kind of failure); `detail` names the input (a peer,
        a path); `now` is the trio clock."""
        self.total += 1
        kind = f"{where}: {type(exc).__name__}"  # not the detail: a flood of peers is one kind
        where = f"{where} ({detail[:200]})" if detail else where
        if kind not in self._seen:
            if len(self._seen) >= MAX_KINDS:
                self._seen.clear()
            self._seen.add(kind)
            log.error("%s failed; that input is refused, the rest goes on", where, exc_info=exc)
            return
        self._unreported += 1
        if now - self._last_report >= self.interval:
            log.error(
                "%d more inputs failed and were refused since the last report (latest at %s: %s)",
                self._unreported,
                where,
                f"{type(exc).__name__}: {exc}"[:200],
            )
            self._unreported = 0
            self._last_report = now


# The one counter of the process: every door, the reactor and the journal report to it.
FAILURES = Failures()


def contained(where: str, exc: BaseException, now: float, detail: str = "") -> None:
    """Report a contained failure to the process's counter (see `Failures.failed`)."""
    FAILURES.failed(where, exc, now, detail)

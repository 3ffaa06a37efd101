"""`worker --exit-with-parent PID`: the worker's tie to the process that started it.

At start the worker asks the kernel for `PARENT_DEATH_SIGNAL` when its parent ends (prctl
PR_SET_PDEATHSIG), then checks that its parent is still the one it was started by: a parent
that ended before the request was made sends nothing, and the worker has been handed to
init or a subreaper instead (it exits at once then). The signal's handler does nothing: the
kernel also sends the signal when the parent *thread* that forked the worker ends (trio and
other libraries start processes from worker threads) while the parent process lives on, and
that must not kill the worker. A worker learns of its parent's real end from a pidfd on it:
a local worker watches it in its loop (worker/local/base.py), a calculator or a poller in
worker/leaving.py.
"""

from __future__ import annotations

import ctypes
import os
import signal

# Not SIGTERM: a drain asked for by an operator or systemd is told apart from the parent's end.
PARENT_DEATH_SIGNAL = signal.SIGHUP
_PR_SET_PDEATHSIG = 1


def tie_to_parent(expected: int) -> bool:
    """Ask for PARENT_DEATH_SIGNAL when the parent ends; False if `expected` is no longer the
    parent (it ended before the request took effect, so the signal will never come)."""
    # A handler, not SIG_IGN: job commands the worker starts get the default back at exec.
    signal.signal(PARENT_DEATH_SIGNAL, _ignore)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(PARENT_DEATH_SIGNAL), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return parent_alive(expected)


def parent_alive(expected: int) -> bool:
    """Whether the process that started the worker is still its parent (pids of ended
    parents are not reused while we are their child; once orphaned we have another)."""
    return expected > 1 and os.getppid() == expected


def _ignore(signum: int, frame: object) -> None:
    """PARENT_DEATH_SIGNAL: nothing (a parent thread's end must not kill the worker)."""

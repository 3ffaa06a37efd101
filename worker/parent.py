"""`worker --exit-with-parent PID`: a local worker never outlives the process that started it.

The worker asks the kernel for `PARENT_DEATH_SIGNAL` when its parent ends
(prctl PR_SET_PDEATHSIG), then checks that its parent is still the one it was
started by: a parent that ended before the request was made sends nothing,
and the worker has been handed to init or a subreaper instead. The kernel
also sends the signal when the parent *thread* that forked the worker ends
(trio and other libraries start processes from worker threads) while the
parent process lives on; the parent is checked again on every signal, so
only its real end counts. Until the shell listens for the signal, a handler
that does nothing keeps a thread's end from killing the worker; the shell
checks the parent once it listens, so a real end in between is not missed.
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
    signal.signal(PARENT_DEATH_SIGNAL, _not_yet)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(PARENT_DEATH_SIGNAL), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return parent_alive(expected)


def parent_alive(expected: int) -> bool:
    """Whether the process that started the worker is still its parent (pids of ended
    parents are not reused while we are their child; once orphaned we have another)."""
    return expected > 1 and os.getppid() == expected


def _not_yet(signum: int, frame: object) -> None:
    """Until the shell listens: it checks the parent itself when it starts to."""

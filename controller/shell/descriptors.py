"""Running out of descriptors is never fatal.

The controller serves the network as root, so anyone who can open connections
can try to use up its descriptors. At start it raises its soft RLIMIT_NOFILE to
the hard limit (`raise_nofile_limit`). When accept(2) still fails for want of a
descriptor or of kernel memory (EMFILE, ENFILE, ENOBUFS, ENOMEM: any error that is not
about the one connection, `one_connection`), the listener is left alone for `ACCEPT_PAUSE`
and tried again (the pending connections wait in the kernel's backlog), and the
failure is logged at most once per `LOG_EVERY` seconds with a count
(`Throttled`): the controller keeps running, and every other socket keeps its
events flowing meanwhile.
"""

from __future__ import annotations

import errno
import logging
import resource

# accept(2) errors that concern one connection only (it was aborted before it was taken):
# the next accept is tried at once. Any other error rests the listener as above.
PEER_ERRORS = frozenset(
    {errno.ECONNABORTED, errno.EPROTO, errno.EPERM, errno.EINTR, errno.ENETDOWN, errno.ENONET}
)
# Seconds a listener rests after any other failure: long enough not to spin on a full table,
# short enough that a pulse waiting in the backlog is served well within dial_timeout.
ACCEPT_PAUSE = 0.1
# At most one log line per this many seconds for one kind of failure.
LOG_EVERY = 30.0


def one_connection(exc: OSError) -> bool:
    """True when an accept error concerns that connection alone (try the next at once)."""
    return exc.errno in PEER_ERRORS


def raise_nofile_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit; (soft before, soft now)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (OSError, ValueError):  # a hard limit the kernel refuses as soft (nr_open)
        return soft, soft
    return soft, hard


class Throttled:
    """A warning logged the first time, then at most once per LOG_EVERY with a count."""

    def __init__(self, logger: logging.Logger, what: str) -> None:
        self.log = logger
        self.what = what
        self.count = 0  # failures in all
        self._unlogged = 0
        self._next = -float("inf")

    def __call__(self, reason: object, now: float) -> None:
        self.count += 1
        self._unlogged += 1
        if now < self._next:
            return
        if self._unlogged == 1:
            self.log.warning("%s: %s; retrying", self.what, reason)
        else:
            self.log.warning(
                "%s: %s (%d times since the last report); retrying",
                self.what,
                reason,
                self._unlogged,
            )
        self._unlogged = 0
        self._next = now + LOG_EVERY

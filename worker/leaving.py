"""How a remote worker (calculator, poller) leaves: on SIGTERM/SIGINT, or when the process it
is tied to with --exit-with-parent ends, it finishes and reports its job, then exits."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Awaitable, Callable

import trio

from worker.parent import parent_alive

log = logging.getLogger("worker")


async def leave_on_signals(
    scope: trio.CancelScope,
    drain: Callable[[], Awaitable[None]],
    timeout: float,
    parent: int | None = None,
) -> None:
    """SIGTERM/SIGINT, or the end of `parent` (a pid; None: not watched): `drain()` (finish
    and report the running job) for at most `timeout` seconds, then cancel `scope`; a signal
    during the drain cancels it at once."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as waiting:

            async def first_signal() -> None:
                async for signum in signals:
                    name = signal.Signals(signum).name
                    log.info("%s: finishing the current job, then leaving", name)
                    break
                waiting.cancel_scope.cancel()

            waiting.start_soon(first_signal)
            if parent is not None:
                waiting.start_soon(_parent_end, parent, waiting.cancel_scope)
        async with trio.open_nursery() as nursery:

            async def second_signal() -> None:
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(second_signal)
            with trio.move_on_after(timeout):
                await drain()
            nursery.cancel_scope.cancel()
    scope.cancel()


async def _parent_end(pid: int, ended: trio.CancelScope) -> None:
    """Cancel `ended` when the process `pid` ends, watched through a pidfd (without one: not
    watched, the worker stays up on its own)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        fd = -1
    except OSError as exc:  # no pidfd here (old kernel, seccomp)
        log.warning("cannot watch parent pid %d (%s); staying up on its own", pid, exc)
        return
    try:
        if fd >= 0 and parent_alive(pid):  # else it died before we looked (its pid may be reused)
            await trio.lowlevel.wait_readable(fd)
    finally:
        if fd >= 0:
            trio.lowlevel.notify_closing(fd)
            os.close(fd)
    log.warning("parent process %d ended", pid)
    ended.cancel()

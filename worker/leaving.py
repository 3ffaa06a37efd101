"""How a remote worker (calculator, poller) leaves on SIGTERM/SIGINT: finish, report, exit."""

from __future__ import annotations

import logging
import signal
from collections.abc import Awaitable, Callable

import trio

log = logging.getLogger("worker")


async def leave_on_signals(
    scope: trio.CancelScope, drain: Callable[[], Awaitable[None]], timeout: float
) -> None:
    """SIGTERM/SIGINT: `drain()` (finish and report the running job) for at most `timeout`
    seconds, then cancel `scope`; a second signal cancels it at once."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("%s: finishing the current job, then leaving", signal.Signals(signum).name)
            break
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

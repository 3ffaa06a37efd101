"""hypercorn's keep-alive timer at one task per connection instead of one per request.

hypercorn's trio `TCPServer` keeps an idle timer per connection as a `SingleTask`
(hypercorn/typing.py: `restart(task_group, action)`, `stop()`): `restart` when
the connection turns idle, `stop` when a request comes. Its `TrioSingleTask`
starts a new task for every `restart` (`nursery.start`) and cancels it at the
next `stop`, so every request costs a task started and one cancelled. With the
HTTP door busy that was ~20% of the controller's CPU, and the controller's one
thread is the door's ceiling (docs/performance.md, "What bounds the figures"). Measured
again against hypercorn 0.18.0 (`python -m bench.http_bench keepalive`, both
timers in one run, 5,000 jobs each, twice, on a shared 2-CPU machine):
AsyncClient 259 and 231 jobs/s with this timer against 182 and 178 with
hypercorn's own; the controller's CPU 1,594-1,598 against 2,142-2,172 us a job.
The cost: the replacement depends on hypercorn's `TrioSingleTask` and a
server's `idle_task`, checked by tests/test_keepalive.py and falling back to
hypercorn's own timer when they differ.

`IdleTimer` keeps the protocol with one watching task per connection: `stop`
and `restart` only move a deadline, and the watcher, waking about once per
`GRACE`, looks at it. Once the connection has been idle for `GRACE` seconds, it
runs hypercorn's own `action` (which waits the keep-alive timeout, or the
server's end, and closes the connection); a request meanwhile cancels that. So an idle connection is
closed after `GRACE` plus hypercorn's `keep_alive_timeout`: the HTTP door sets
the latter to its idle time minus `GRACE`. Once the connection has ended (`end`,
told by controller/doors/http/connections.py), the watcher leaves at once: hypercorn
waits for it before it lets the connection go, and the connection's place in
`max_connections` with it.

`fit(server)` puts one in place of a hypercorn `TCPServer`'s own timer (its
`idle_task` attribute), only when that timer is the class this module was
written against (`usable()`: hypercorn's trio `TrioSingleTask`, with
`restart(task_group, action)` and `stop()`); otherwise hypercorn's own stays,
slower but correct. Nothing of hypercorn is changed for other users of it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import trio

log = logging.getLogger("controller.http")

# Idle this long before hypercorn's own keep-alive wait starts: the watcher wakes about
# once per GRACE per connection, whatever the request rate.
GRACE = 1.0
# The key of the connection's state (each request's scope["state"]) that holds when the
# request's first byte came (trio clock): its body must end `head_limit` after it.
REQUEST_SINCE = "request_since"


def request_deadline(scope: Mapping[str, Any], seconds: float) -> float:
    """When a request must have ended, `seconds` after its first byte (trio clock): the time
    its IdleTimer noted, or now when none did (hypercorn's own timer kept, see `usable`)."""
    since = scope.get("state", {}).get(REQUEST_SINCE)
    return (trio.current_time() if since is None else since) + seconds


class IdleTimer:
    """hypercorn's `SingleTask` for the keep-alive timeout: one watching task per connection
    at a time."""

    def __init__(
        self,
        head_limit: float = math.inf,
        state: dict[str, Any] | None = None,
        close: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """`head_limit`: the seconds a request may take from its first byte to its last; a
        head not whole by then has the connection closed (`close`). `state`: the connection's
        state, where each request's first byte's time is written (REQUEST_SINCE)."""
        self._deadline = math.inf  # idle since GRACE before this; inf: a request runs
        self._watching = False
        self._restarts = 0
        self._acting: trio.CancelScope | None = None  # hypercorn's action, once running
        # How long a request's head may keep coming (http_body_timeout), and since when it
        # does (None: no byte of it yet).
        self.head_limit = head_limit
        self._head_from: float | None = None
        self._ended = False  # the connection ended: no more watching
        self._watching_scope: trio.CancelScope | None = None
        self._state = state
        self._close = close

    async def restart(self, task_group: Any, action: Callable[[], Awaitable[None]]) -> None:
        """The connection is idle from now (opened, or a request ended)."""
        self._interrupt()
        self._deadline = trio.current_time() + GRACE
        self._head_from = None
        self._restarts += 1
        if not self._watching and not self._ended:
            self._watching = True
            task_group.spawn(self._watch, action)

    async def stop(self) -> None:
        """A request came: the connection is not idle (hypercorn calls this before it makes
        the request's scope, which copies the state)."""
        self._interrupt()
        self._deadline = math.inf
        if self._state is not None:
            since = self._head_from
            self._state[REQUEST_SINCE] = trio.current_time() if since is None else since
        self._head_from = None

    def heard(self) -> None:
        """Bytes arrived. Before a request's head is whole that is not silence: the idle
        time starts again, for at most `head_limit` seconds from the head's first byte
        (hypercorn itself only stops the timer once the head is whole)."""
        if self._deadline == math.inf:
            return  # a request runs: its body has rules of its own
        now = trio.current_time()
        if self._head_from is None:
            self._head_from = now
        cut = self._head_from + self.head_limit
        self._interrupt()  # past the cut too: the watcher then closes the connection at once
        self._deadline = min(now + GRACE, cut)

    def _overdue(self, now: float) -> bool:
        """A head has been coming for head_limit seconds and is not whole."""
        return self._head_from is not None and now >= self._head_from + self.head_limit

    def end(self) -> None:
        """The connection ended (the client closed it, or the server did): the watcher, and
        hypercorn's action if it runs, stop now."""
        self._ended = True
        if self._watching_scope is not None:
            self._watching_scope.cancel()

    def _interrupt(self) -> None:
        if self._acting is not None:
            self._acting.cancel()
            self._acting = None

    async def _watch(self, action: Callable[[], Awaitable[None]]) -> None:
        try:
            with trio.CancelScope() as self._watching_scope:
                await self._watch_until_closed(action)
        finally:
            self._watching = False
            self._watching_scope = None

    async def _watch_until_closed(self, action: Callable[[], Awaitable[None]]) -> None:
        while True:
            deadline = self._deadline
            if deadline == math.inf:  # a request runs
                seen = self._restarts
                await trio.sleep(GRACE)
                if self._deadline == math.inf and self._restarts == seen:
                    # Busy all along, or the connection ended mid-request (hypercorn
                    # then never restarts): leave, so as not to hold its task group
                    # open; the next restart starts another watcher.
                    return
            elif trio.current_time() < deadline:
                await trio.sleep_until(deadline)  # then look again: it may have moved
            elif self._close is not None and self._overdue(trio.current_time()):
                await self._close()  # its head's time is up: no answer, the close
                return
            else:
                with trio.CancelScope() as self._acting:  # idle for GRACE: hypercorn's wait
                    if self._head_from is not None:  # no longer than the head may take
                        self._acting.deadline = self._head_from + self.head_limit
                    await action()
                    return  # it closed the connection
                # cancelled by a request, or the head's time is up: look again


def usable() -> bool:
    """True when hypercorn's trio TCPServer keeps the timer this module replaces (a
    `TrioSingleTask` with `restart` and `stop`); else hypercorn's own timer stays."""
    try:
        from hypercorn.trio import tcp_server, worker_context
    except ImportError:
        return False
    current = getattr(tcp_server, "TrioSingleTask", None)
    if (
        current is None
        or current is not getattr(worker_context, "TrioSingleTask", None)
        or not callable(getattr(current, "restart", None))
        or not callable(getattr(current, "stop", None))
    ):
        log.warning("this hypercorn has no TrioSingleTask to replace: its own idle timer stays")
        return False
    return True


def fit(
    server: Any,
    head_limit: float = math.inf,
    state: dict[str, Any] | None = None,
    close: Callable[[], Awaitable[None]] | None = None,
) -> IdleTimer | None:
    """Give one hypercorn TCPServer an IdleTimer in place of its own and return it; None
    (and its own timer kept) when it does not hold the timer this module replaces."""
    from hypercorn.trio.worker_context import TrioSingleTask

    if type(getattr(server, "idle_task", None)) is not TrioSingleTask:
        return None
    timer = IdleTimer(head_limit, state, close)
    server.idle_task = timer
    return timer

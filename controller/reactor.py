"""One epoll set and one timer heap, driven by a single trio task.

Every task crosses three Unix connections (SET_TASK, FETCH_ME, FETCH), each a
connect or accept, one frame each way and a close. Giving each of them its own
trio task, cancel scope and `wait_readable` costs several times the system
calls themselves (docs/architecture.md, "Decisions"). So the hot
paths register their sockets in one level-triggered epoll set owned by a
`Reactor`; one trio task waits for that set to become readable (an epoll fd
is pollable) and runs the ready sockets' callbacks in the order the events
arrived. Timers (mostly timeouts that never fire) live in a second task, so a
round needs no cancel scope. With `busy_poll` the reactor keeps looking for a
while before it sleeps (for a process on a CPU of its own); with
`busy_poll=None` it does so adaptively, only while events come close together
(see `_poll_adaptively`).

The exchanges themselves (dial, send, read the answer) are in
controller/transport.py. Callbacks run in the reactor's task and must not
block.
"""

from __future__ import annotations

import _socket
import math
import select
import time
from collections.abc import Callable
from typing import TypeVar

import trio

from controller.containment import contained
from controller.deadlines import Deadlines

T = TypeVar("T")

# The timer task looks at the heap at least this often (see _timer_task).
TIMER_TICK = 0.5
# Adaptive polling (busy_poll=None): the window starts here after a short sleep, doubles
# after each sleep no longer than the longest window, and drops to 0 after a longer one.
ADAPTIVE_START = 25e-6
ADAPTIVE_MAX = 200e-6


class Timer:
    """A pending `Reactor.call_at`; `cancel()` makes it a no-op."""

    __slots__ = ("callback",)

    def __init__(self, callback: Callable[[float], None]) -> None:
        self.callback: Callable[[float], None] | None = callback

    def cancel(self) -> None:
        self.callback = None


class Reactor:
    """One epoll set and one timer heap, serviced by `run` in a single trio task."""

    def __init__(self, busy_poll: float | None = 0.0) -> None:
        """`busy_poll`: seconds to keep polling after the last event before sleeping (0: never;
        None: adaptively, up to ADAPTIVE_MAX).

        A process that sleeps must be woken by the kernel for its next event,
        which costs both sides tens of microseconds on some machines (virtual
        CPUs); one that polls sees the event at once. A fixed window is worth it
        only on a CPU of its own: polling takes that CPU while traffic flows. The
        adaptive window polls only while the sleeps it would replace are short,
        so a quiet controller, or one whose jobs take milliseconds, never polls.
        """
        self.busy_poll = busy_poll
        self._window = 0.0  # the adaptive poll window now
        self._threads = 0  # calls running in threads (see in_thread): no polling meanwhile
        self._epoll = select.epoll()
        self._watched: dict[int, tuple[_socket.socket, Callable[[int], None]]] = {}
        self._last: set[int] = set()  # served after the others in each round
        self._listeners: set[int] = set()  # kept open when their callback fails
        self._timers: Deadlines[Timer] = Deadlines()
        self._wake = trio.Event()
        self._timer_at = math.inf  # when the timer task wakes up next

    def watch(
        self,
        sock: _socket.socket,
        events: int,
        callback: Callable[[int], None],
        *,
        last: bool = False,
        listener: bool = False,
    ) -> None:
        """Call `callback(events)` while `sock` is ready for `events` (level-triggered).

        With `last`, the socket is served after the others that are ready in the
        same round (new work waits; answers from workers do not). A socket still
        watched when the reactor stops is closed by it. A callback that raises is
        logged (controller/containment.py) and its socket closed, unless it is a
        `listener` or `last` (a door's socket serves every peer: it stays).
        """
        fd = sock.fileno()
        if last:
            self._last.add(fd)
        if listener:
            self._listeners.add(fd)
        if fd in self._watched:
            self._epoll.modify(fd, events)
        else:
            self._epoll.register(fd, events)
        self._watched[fd] = (sock, callback)

    def unwatch(self, sock: _socket.socket) -> None:
        """Stop watching `sock` (before it is closed)."""
        fd = sock.fileno()
        if self._watched.pop(fd, None) is not None:
            self._last.discard(fd)
            self._listeners.discard(fd)
            if not self._epoll.closed:
                self._epoll.unregister(fd)

    def forget(self, sock: _socket.socket) -> None:
        """Stop watching `sock`, which the caller closes right away: closing it takes it out
        of the epoll set, so this saves an epoll_ctl call."""
        fd = sock.fileno()
        if self._watched.pop(fd, None) is not None:
            self._last.discard(fd)
            self._listeners.discard(fd)

    async def in_thread(
        self,
        fn: Callable[..., T],
        *args: object,
        abandon_on_cancel: bool = False,
        mostly_waits: bool = False,
    ) -> T:
        """`trio.to_thread.run_sync(fn, *args)`, with no polling until it returns.

        A thread that runs Python needs the GIL, and a polling loop lets go of it only
        for the microseconds of each system call, too briefly for a thread woken on
        another CPU to take it: the thread waits for the interpreter's switch interval
        (5 ms) instead. So while such a call runs, the reactor sleeps between events and
        the thread gets the GIL. A call that `mostly_waits` (seconds in one system call,
        then a little Python whose delay does not matter, as the Redis door's cancel
        listener) does not stop polling: while it counted, a controller with a Redis
        door never polled at all.
        """
        if mostly_waits:
            return await trio.to_thread.run_sync(fn, *args, abandon_on_cancel=abandon_on_cancel)
        self._threads += 1
        try:
            return await trio.to_thread.run_sync(fn, *args, abandon_on_cancel=abandon_on_cancel)
        finally:
            self._threads -= 1

    def call_at(self, when: float, callback: Callable[[float], None]) -> Timer:
        """Call `callback(now)` once the trio clock reaches `when`."""
        timer = Timer(callback)
        self._timers.push(when, timer)
        if when < self._timer_at:
            self._wake.set()
        return timer

    def call_soon(self, callback: Callable[[float], None]) -> Timer:
        """Call `callback(now)` on the reactor's next turn."""
        return self.call_at(-math.inf, callback)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve callbacks and timers until cancelled."""
        epfd = self._epoll.fileno()
        poll = self._epoll.poll
        watched = self._watched
        last = self._last
        try:
            async with trio.open_nursery() as nursery:
                # Timers live in their own task, so that waiting for sockets needs no
                # cancel scope per round (most timers are timeouts that never fire).
                nursery.start_soon(self._timer_task)
                task_status.started()
                while True:
                    if self.busy_poll is None:
                        ready = await self._poll_adaptively()
                    elif self.busy_poll:
                        ready = await self._poll_busily(self.busy_poll)
                    else:
                        await trio.lowlevel.wait_readable(epfd)
                        ready = poll(0)
                    if last:  # a stable sort: arrival order, the `last` sockets at the end
                        ready.sort(key=lambda item: item[0] in last)
                    for fd, events in ready:
                        entry = watched.get(fd)
                        if entry is not None:  # not unwatched by an earlier callback
                            try:
                                entry[1](events)
                            except Exception as exc:
                                self._failed(fd, entry[0], exc)
        finally:
            self._epoll.close()
            for sock, _ in watched.values():
                sock.close()
            watched.clear()

    def _failed(self, fd: int, sock: _socket.socket, exc: Exception) -> None:
        """A socket's callback raised: contained. A connection (one peer's exchange) is
        closed; a listening socket (`last`, or one a door serves many peers on) stays."""
        contained("a socket callback", exc, trio.current_time())
        if fd in self._last or fd in self._listeners:
            return
        self.forget(sock)
        sock.close()

    async def _look(self, window: float) -> list[tuple[int, int]]:
        """Events that come within `window` seconds, looked for without sleeping ([]: none)."""
        give_up = time.perf_counter() + window
        while True:
            await trio.lowlevel.checkpoint()  # the other tasks run between looks
            ready = self._epoll.poll(0)
            if ready or self._threads or time.perf_counter() >= give_up:
                return ready

    async def _poll_busily(self, window: float) -> list[tuple[int, int]]:
        """The next events: look without sleeping for `window` seconds, then sleep."""
        if not self._threads:
            ready = await self._look(window)
            if ready:
                return ready
        await trio.lowlevel.wait_readable(self._epoll.fileno())
        return self._epoll.poll(0)

    async def _poll_adaptively(self) -> list[tuple[int, int]]:
        """The next events: look for the current window, then sleep; then size the window.

        The rule of Linux's KVM halt polling: a sleep no longer than the longest
        window could have been a poll, so the window grows (doubles); a longer
        one means events are far apart, and the window closes. Idle, or with
        jobs that take milliseconds, every sleep is long and nothing polls.
        """
        window = self._window
        if window and not self._threads:
            ready = await self._look(window)
            if ready:
                return ready
        asleep = time.perf_counter()
        await trio.lowlevel.wait_readable(self._epoll.fileno())
        if time.perf_counter() - asleep <= ADAPTIVE_MAX:
            self._window = min(ADAPTIVE_MAX, max(ADAPTIVE_START, 2 * window))
        else:
            self._window = 0.0
        return self._epoll.poll(0)

    async def _timer_task(self) -> None:
        timers = self._timers
        while True:
            heap = timers.heap
            while heap and heap[0][2].callback is None:
                timers.pop()  # cancelled: must not wake us up
            # Look again at least every TIMER_TICK, so that a new timeout (seconds
            # away) does not have to wake this task: only an earlier one does.
            horizon = trio.current_time() + TIMER_TICK
            self._timer_at = min(timers.next(), horizon)
            with trio.move_on_at(self._timer_at):
                await self._wake.wait()
            self._wake = trio.Event()
            self._timer_at = -math.inf  # firing: what the callbacks add is seen below
            self._run_timers(trio.current_time())

    def _run_timers(self, now: float) -> None:
        timers = self._timers
        while (due := timers.pop_due(now)) is not None:
            timer = due[1]
            callback = timer.callback
            if callback is not None:
                timer.callback = None
                try:
                    callback(now)
                except Exception as exc:
                    contained("a timer callback", exc, now)

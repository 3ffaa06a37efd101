"""Many short Unix-socket exchanges on one epoll set, driven by a single trio task.

Every task crosses three Unix connections (SET_TASK, FETCH_ME, FETCH), each a
connect or accept, one frame each way and a close. Giving each of them its own
trio task, cancel scope and `wait_readable` costs several times the system
calls themselves (docs/design-notes.md has the measurements). So the hot
paths register their sockets in one level-triggered epoll set owned by a
`Reactor`; one trio task waits for that set to become readable (an epoll fd
is pollable) and runs the ready sockets' callbacks in the order the events
arrived. Timers (mostly timeouts that never fire) live in a second task, so a
round needs no cancel scope. With `busy_poll` the reactor keeps looking for a
while before it sleeps (for a process on a CPU of its own).

`Outgoing` dials, sends one frame and reads the one frame that answers it;
`Incoming` reads one frame from an accepted connection, hands it on, writes
the answer and closes. Both read with `wire.FrameReader`, as
`wire.recv_frame` does, and report every failure as a
`wire.RemoteProtocolError` (or the `OSError` of a failed dial), exactly as
`wire.recv_frame` / `sockets.exchange` do. Callbacks run in the reactor's
task and must not block; a done callback never runs inside the call that
started the exchange (a dial that fails at once reports on the next turn),
so callers never see themselves re-entered.
"""

from __future__ import annotations

import math
import select
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Generic

import trio

from controller import wire
from controller.deadlines import Deadlines
from controller.sockets import CONNECT_RETRY

# The timer task looks at the heap at least this often (see _timer_task).
TIMER_TICK = 0.5
_IN = select.EPOLLIN
_OUT = select.EPOLLOUT

Result = tuple[wire.M, bytes] | wire.RemoteProtocolError | OSError


class Timer:
    """A pending `Reactor.call_at`; `cancel()` makes it a no-op."""

    __slots__ = ("callback",)

    def __init__(self, callback: Callable[[float], None]) -> None:
        self.callback: Callable[[float], None] | None = callback

    def cancel(self) -> None:
        self.callback = None


class Reactor:
    """One epoll set and one timer heap, serviced by `run` in a single trio task."""

    def __init__(self, busy_poll: float = 0.0) -> None:
        """`busy_poll`: seconds to keep polling after the last event before sleeping (0: never).

        A process that sleeps must be woken by the kernel for its next event,
        which costs both sides tens of microseconds on some machines (virtual
        CPUs); one that polls sees the event at once. Worth it only on a CPU of
        its own: polling takes that CPU while traffic flows.
        """
        self.busy_poll = busy_poll
        self._epoll = select.epoll()
        self._watched: dict[int, tuple[socket.socket, Callable[[int], None]]] = {}
        self._last: set[int] = set()  # served after the others in each round
        self._timers: Deadlines[Timer] = Deadlines()
        self._wake = trio.Event()
        self._timer_at = math.inf  # when the timer task wakes up next

    def watch(
        self,
        sock: socket.socket,
        events: int,
        callback: Callable[[int], None],
        *,
        last: bool = False,
    ) -> None:
        """Call `callback(events)` while `sock` is ready for `events` (level-triggered).

        With `last`, the socket is served after the others that are ready in the
        same round (new work waits; answers from workers do not). A socket still
        watched when the reactor stops is closed by it.
        """
        fd = sock.fileno()
        if last:
            self._last.add(fd)
        if fd in self._watched:
            self._epoll.modify(fd, events)
        else:
            self._epoll.register(fd, events)
        self._watched[fd] = (sock, callback)

    def unwatch(self, sock: socket.socket) -> None:
        """Stop watching `sock` (before it is closed)."""
        fd = sock.fileno()
        if self._watched.pop(fd, None) is not None:
            self._last.discard(fd)
            if not self._epoll.closed:
                self._epoll.unregister(fd)

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
                    if self.busy_poll:
                        ready = await self._poll_busily()
                    else:
                        await trio.lowlevel.wait_readable(epfd)
                        ready = poll(0)
                    if last:  # a stable sort: arrival order, the `last` sockets at the end
                        ready.sort(key=lambda item: item[0] in last)
                    for fd, events in ready:
                        entry = watched.get(fd)
                        if entry is not None:  # not unwatched by an earlier callback
                            entry[1](events)
        finally:
            self._epoll.close()
            for sock, _ in watched.values():
                sock.close()
            watched.clear()

    async def _poll_busily(self) -> list[tuple[int, int]]:
        """The next events: look without sleeping for `busy_poll` seconds, then sleep."""
        give_up = time.perf_counter() + self.busy_poll
        while True:
            await trio.lowlevel.checkpoint()  # the other tasks run between looks
            ready = self._epoll.poll(0)
            if ready:
                return ready
            if time.perf_counter() >= give_up:
                await trio.lowlevel.wait_readable(self._epoll.fileno())
                return self._epoll.poll(0)

    async def _timer_task(self) -> None:
        timers = self._timers
        while True:
            while (first := timers.peek()) is not None and first.callback is None:
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
                callback(now)


class Outgoing(Generic[wire.M]):
    """Dial `path`, send one frame, read the frame that answers it, close, report `done`.

    `timeout` bounds each silence, as in `wire.recv_frame`.
    """

    __slots__ = (
        "_data",
        "_deadline",
        "_done",
        "_path",
        "_reactor",
        "_reader",
        "_sock",
        "_started",
        "_timeout",
        "_timer",
        "_type",
    )

    def __init__(
        self,
        reactor: Reactor,
        path: str | Path,
        data: bytes,
        answer_type: type[wire.M],
        done: Callable[[Result[wire.M]], None],
        *,
        timeout: float,
        max_extra_size: int = wire.DEFAULT_MAX_EXTRA_SIZE,
    ) -> None:
        self._reactor = reactor
        self._path = str(path)
        self._data = data
        self._type = answer_type
        self._reader = wire.FrameReader(answer_type, max_extra_size)
        self._done = done
        self._timeout = timeout
        now = trio.current_time()
        self._deadline = now + timeout
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
        self._started = False
        self._timer = reactor.call_at(self._deadline, self._on_timer)
        self._connect(now)
        self._started = True

    def _connect(self, now: float) -> None:
        try:
            self._sock.connect(self._path)
        except BlockingIOError:  # listen backlog full
            self._timer.cancel()
            if now >= self._deadline:
                self._finish(
                    wire.PeerTimeout(f"{self._path}: listen backlog full for {self._timeout:g} s")
                )
            else:
                self._timer = self._reactor.call_at(now + CONNECT_RETRY, self._connect)
            return
        except OSError as exc:
            self._finish(exc)
            return
        if self._timer.callback is None:  # came back from a backlog retry
            self._timer = self._reactor.call_at(self._deadline, self._on_timer)
        try:
            sent = self._sock.send(self._data)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            self._finish(wire.ConnectionLost(f"sending a request: {exc}"))
            return
        if sent == len(self._data):
            self._data = b""
            self._reactor.watch(self._sock, _IN, self._receive)
        else:  # a big request: the rest as the peer reads
            self._data = self._data[sent:]
            self._reactor.watch(self._sock, _OUT, self._send)

    def _send(self, events: int) -> None:
        try:
            sent = self._sock.send(self._data)
        except BlockingIOError:
            return
        except OSError as exc:
            self._finish(wire.ConnectionLost(f"sending a request: {exc}"))
            return
        self._data = self._data[sent:]
        self._deadline = trio.current_time() + self._timeout
        if not self._data:
            self._reactor.watch(self._sock, _IN, self._receive)

    def _receive(self, events: int) -> None:
        try:
            frame = self._reader.read(self._sock)
        except wire.RemoteProtocolError as exc:
            self._finish(exc)
            return
        if frame is not None:
            self._finish(frame)
        else:
            self._deadline = trio.current_time() + self._timeout

    def _on_timer(self, now: float) -> None:
        if now < self._deadline:  # progress since: wait for the rest
            self._timer = self._reactor.call_at(self._deadline, self._on_timer)
            return
        if self._data:
            why = f"peer did not read the request within {self._timeout:g} s"
        else:
            why = f"peer silent for {self._timeout:g} s while sending a {self._type.__name__}"
        self._finish(wire.PeerTimeout(why))

    def _finish(self, result: Result[wire.M]) -> None:
        self._timer.cancel()
        self._reactor.unwatch(self._sock)
        self._sock.close()
        done = self._done
        if self._started:
            done(result)  # in event order: an answer is handled before what came after it
        else:
            self._reactor.call_soon(lambda now: done(result))


class Incoming(Generic[wire.M]):
    """One accepted connection: read a frame, hand it to `on_frame`, write the answer, close.

    `on_frame(conn, msg, extra)` answers with `conn.reply(data)`, now or later;
    `on_error(conn, exc)` hears about a bad or missing frame and may still
    `reply` when `exc.can_reply`. A peer that does not read its answer within
    `timeout` is dropped.
    """

    __slots__ = (
        "_on_error",
        "_on_frame",
        "_out",
        "_reactor",
        "_reader",
        "_reading",
        "_sent",
        "_timeout",
        "_timer",
        "_type",
        "sock",
    )

    def __init__(
        self,
        reactor: Reactor,
        sock: socket.socket,
        request_type: type[wire.M],
        on_frame: Callable[[Incoming[wire.M], wire.M, bytes], None],
        on_error: Callable[[Incoming[wire.M], wire.RemoteProtocolError], None],
        *,
        timeout: float,
        max_extra_size: int = wire.DEFAULT_MAX_EXTRA_SIZE,
    ) -> None:
        self._reactor = reactor
        self.sock = sock
        self._type = request_type
        self._reader = wire.FrameReader(request_type, max_extra_size)
        self._on_frame = on_frame
        self._on_error = on_error
        self._timeout = timeout
        self._out = b""
        self._sent: Callable[[], None] | None = None
        self._timer: Timer | None = None
        self._reading = True
        self._receive(_IN)  # the request has often arrived with the connection
        if self._reading:
            self._rearm()
            reactor.watch(sock, _IN, self._receive)

    def reply(self, data: bytes, sent: Callable[[], None] | None = None) -> None:
        """Send `data` and close; `sent()` once all of it is written.

        A peer that stops reading is dropped (and `sent` is not called).
        """
        if self.sock.fileno() < 0:
            return
        self._out = data
        self._sent = sent
        self._send(_OUT)

    def close(self) -> None:
        if self.sock.fileno() >= 0:
            if self._timer is not None:
                self._timer.cancel()
            self._reactor.unwatch(self.sock)
            self.sock.close()

    def _receive(self, events: int) -> None:
        if not self._reading:
            return
        try:
            frame = self._reader.read(self.sock)
        except wire.RemoteProtocolError as exc:
            self._fail(exc)
            return
        if frame is None:
            self._rearm()
            return
        self._request_done()
        self._on_frame(self, *frame)

    def _send(self, events: int) -> None:
        try:
            while self._out:
                self._out = self._out[self.sock.send(self._out) :]
        except BlockingIOError:
            self._reactor.watch(self.sock, _OUT, self._send)
            self._rearm()
            return
        except OSError:
            self.close()  # the peer went away: nothing else to do for it
            return
        self.close()
        if self._sent is not None:
            self._sent()

    def _request_done(self) -> None:
        self._reading = False
        if self._timer is not None:
            self._timer.cancel()
        self._reactor.unwatch(self.sock)

    def _fail(self, exc: wire.RemoteProtocolError) -> None:
        self._request_done()
        self._on_error(self, exc)  # may answer when exc.can_reply
        if not self._out:  # on_error did not answer, or the answer is already out
            self.close()

    def _rearm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._reactor.call_at(trio.current_time() + self._timeout, self._on_timer)

    def _on_timer(self, now: float) -> None:
        if self._reading:
            self._fail(
                wire.PeerTimeout(
                    f"peer silent for {self._timeout:g} s while sending a {self._type.__name__}"
                )
            )
        else:
            self.close()  # the peer stopped reading its answer

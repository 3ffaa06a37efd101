"""A worker's channel on the controller's side: one connection for the worker's life.

The channel (docs/protocol.md, "The channel") carries every message between the
controller and one worker, both ways, as ChannelFrames (`wire.encode_channel`,
`wire.StreamDecoder`). `ChannelConn` owns the connection on the `Reactor`: it reads
frames as they arrive and hands each to `on_frame`, writes what it is given in order
(buffering what the kernel does not take at once), and reports its end once to `on_end`
with the reason. What the frames mean is the caller's (controller/shell/worker_links.py).

Every peer is hostile: a header or an extra size over its cap, a frame cut off, a peer
that stops in the middle of a frame or stops reading what is written to it for `timeout`
seconds, or one that sends more than MAX_FRAMES_PER_SECOND frames in a second ends this
channel alone. One read takes at most `wire.FIRST_READ` bytes, so a peer that floods is
served its share of each reactor round and no more.
"""

from __future__ import annotations

import _socket
import select
from collections.abc import Callable
from typing import Generic

import trio

from controller import wire
from controller.containment import contained
from controller.reactor import Reactor, Timer

_IN = select.EPOLLIN
_OUT = select.EPOLLOUT
# A worker sends a pulse a second, one outcome per job, and its job's output in chunks of at
# most 16 KiB: far fewer frames than this in any second. Past it the channel ends.
MAX_FRAMES_PER_SECOND = 20_000


class ChannelConn(Generic[wire.M]):
    """One channel connection: frames of `frame_type` in, bytes out, one end."""

    __slots__ = (
        "_budget",
        "_budget_at",
        "_check",
        "_decoder",
        "_ended",
        "_on_end",
        "_on_frame",
        "_out",
        "_progress",
        "_reactor",
        "_timeout",
        "_timer",
        "closing",
        "sock",
    )

    def __init__(
        self,
        reactor: Reactor,
        sock: _socket.socket,
        frame_type: type[wire.M],
        on_frame: Callable[[wire.M, bytes], None],
        on_end: Callable[[str], None],
        *,
        timeout: float,
        now: float,
        max_extra_size: int = wire.DEFAULT_MAX_EXTRA_SIZE,
        check: Callable[[wire.M, int], None] | None = None,
    ) -> None:
        self._reactor = reactor
        self.sock = sock
        self._decoder = wire.StreamDecoder(frame_type, max_extra_size, check)
        self._on_frame = on_frame
        self._on_end = on_end
        self._timeout = timeout
        self._out = b""
        self._ended = False
        self.closing = False  # ends once what is written is out
        self._progress = now  # the last time a partial frame moved, either way
        self._timer: Timer | None = None
        self._budget = MAX_FRAMES_PER_SECOND
        self._budget_at = now + 1.0
        reactor.watch(sock, _IN, self._ready)

    @property
    def ended(self) -> bool:
        return self._ended

    def send(self, data: bytes) -> None:
        """Write `data` after what is already on its way."""
        if self._ended or self.closing:
            return
        if self._out:
            self._out += data
            return
        try:
            sent = self.sock.send(data, wire.DONTWAIT)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            self.end(f"sending: {exc.strerror or exc}")
            return
        if sent < len(data):
            self._out = data[sent:]
            self._progress = self._now()
            self._reactor.watch(self.sock, _IN | _OUT, self._ready)
            self._arm()

    def close_after_send(self) -> None:
        """End the channel once what was written has left (at once when nothing waits)."""
        self.closing = True
        if not self._out:
            self.end("closed by the controller")

    def end(self, why: str) -> None:
        """Close the connection and report `why`, once."""
        if self._ended:
            return
        self._ended = True
        if self._timer is not None:
            self._timer.cancel()
        self._reactor.forget(self.sock)
        self.sock.close()
        self._on_end(why)

    # ------------------------------------------------------------ the reactor's side

    def _now(self) -> float:
        return trio.current_time()

    def _ready(self, events: int) -> None:
        try:
            if events & _OUT and self._out:
                self._flush()
            if not self._ended and events & (_IN | select.EPOLLHUP | select.EPOLLERR):
                self._read()
        except Exception as exc:  # this channel alone ends
            contained("a worker's channel", exc, self._now())
            self.end(f"internal error: {type(exc).__name__}")

    def _flush(self) -> None:
        try:
            sent = self.sock.send(self._out, wire.DONTWAIT)
        except BlockingIOError:
            return
        except OSError as exc:
            self.end(f"sending: {exc.strerror or exc}")
            return
        self._out = self._out[sent:]
        self._progress = self._now()
        if not self._out:
            if self.closing:
                self.end("closed by the controller")
                return
            self._reactor.watch(self.sock, _IN, self._ready)

    def _read(self) -> None:
        try:
            data = self.sock.recv(wire.FIRST_READ, wire.DONTWAIT)
        except BlockingIOError:
            return
        except OSError as exc:
            self.end(f"receiving: {exc.strerror or exc}")
            return
        if not data:
            if self._decoder.pending:
                self.end("the worker closed it in the middle of a frame")
            else:
                self.end("the worker closed it")
            return
        try:
            frames = self._decoder.feed(data)
        except wire.RemoteProtocolError as exc:
            self.end(f"bad frame: {exc}")
            return
        if frames:
            now = self._now()
            if now >= self._budget_at:
                self._budget = MAX_FRAMES_PER_SECOND
                self._budget_at = now + 1.0
            self._budget -= len(frames)
            if self._budget < 0:
                self.end(f"more than {MAX_FRAMES_PER_SECOND} frames in a second")
                return
        if self._decoder.pending:
            self._progress = self._now()
            self._arm()
        for frame, extra in frames:
            if self._ended or self.closing:
                return
            self._on_frame(frame, extra)

    def _arm(self) -> None:
        """Look again `timeout` after the last progress: a peer still in the middle of a frame,
        or not reading what waits for it, by then has stalled."""
        if self._timer is None or self._timer.callback is None:
            self._timer = self._reactor.call_at(self._progress + self._timeout, self._on_timer)

    def _on_timer(self, now: float) -> None:
        self._timer = None
        if self._ended or not (self._out or self._decoder.pending):
            return
        if now < self._progress + self._timeout:
            self._arm()
            return
        if self._out:
            self.end(f"the worker read nothing for {self._timeout:g} s")
        else:
            self.end(f"the worker stopped in the middle of a frame for {self._timeout:g} s")

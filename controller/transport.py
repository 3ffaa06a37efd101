"""Unix-socket exchanges, the one way both controller and worker make them.

Every job crosses three Unix connections (SET_TASK, FETCH_ME, FETCH), each a
connect or accept, one frame each way and a close, all on one `Reactor`
(controller/reactor.py) instead of a trio task per connection.

`Outgoing` dials, sends one frame and reads the one frame that answers it;
`Incoming` reads one frame from an accepted connection, hands it on, writes
the answer and closes; `exchange` is `Outgoing` for a trio task that wants
to await the answer (the worker's periodic pulse). All read with
`wire.FrameReader` and report every failure as a `wire.RemoteProtocolError`
(or the `OSError` of a failed dial). A done callback never runs inside the
call that started the exchange (a dial that fails at once reports on the
next turn), so callers never see themselves re-entered.
"""

from __future__ import annotations

import _socket
import errno
import os
import select
import socket
import stat
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Generic

import trio

from controller import wire
from controller.reactor import Reactor, Timer

# A full listen backlog makes a non-blocking Unix connect fail with EAGAIN and no
# completion event: retry after this pause until the timeout.
CONNECT_RETRY = 0.001
_IN = select.EPOLLIN
_OUT = select.EPOLLOUT

Result = tuple[wire.M, bytes] | wire.RemoteProtocolError | OSError


# accept(2) giving the new descriptor: the C method socket.accept wraps (typeshed omits it).
_accept_fd: Callable[[socket.socket], tuple[int, object]] = socket.socket._accept  # type: ignore[attr-defined]


def accept_unix(listener: socket.socket) -> _socket.socket:
    """One connection from a Unix listener, as the low-level socket type (socket.accept's
    Python wrapper costs per connection), left blocking: `Incoming` uses MSG_DONTWAIT.
    BlockingIOError when none is waiting."""
    fd, _ = _accept_fd(listener)
    return _socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, 0, fd)


_PEERCRED = struct.Struct("3i")


class WrongPeer(PermissionError):
    """The process listening on a dialled socket is not the one expected: nothing was sent."""


def peer_credentials(sock: _socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket (for a dialled one:
    the process that listens on it)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    pid, uid, gid = _PEERCRED.unpack(raw)
    return pid, uid, gid


def chmod_socket_file(path: str | Path, mode: int) -> os.stat_result:
    """Give the socket file at `path` mode `mode` without following a symlink there (one put
    in its place since the bind is refused: ELOOP), and return its stat. The file is opened
    with O_PATH | O_NOFOLLOW and changed through /proc/self/fd, so that the file looked at is
    the one changed."""
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISSOCK(st.st_mode):
            raise OSError(errno.ELOOP, f"{path} is no longer the socket just bound")
        try:
            os.chmod(f"/proc/self/fd/{fd}", mode)
        except FileNotFoundError:  # no /proc: the C library's no-follow chmod
            os.chmod(path, mode, follow_symlinks=False)
        return os.fstat(fd)
    finally:
        os.close(fd)


def listen_unix(path: Path, backlog: int, mode: int = 0o660) -> socket.socket:
    """Bind and listen on `path` with file mode `mode` (synchronously: a local bind
    takes microseconds, and trio's own bind hops to a thread, letting a MockClock jump).
    The mode is set on the file bound, never through a symlink put in its place."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        os.fchmod(sock.fileno(), mode)  # the file is bound with this mode less the umask
        sock.bind(str(path))
        chmod_socket_file(path, mode)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class Outgoing(Generic[wire.M]):
    """Dial `path`, send one frame, read the frame that answers it, close, report `done`.

    `timeout` bounds each silence, as in `wire.recv_frame`. `expect`: (uid, pid or None) the
    listening process must have (SO_PEERCRED); any other is reported as `WrongPeer` and
    sent nothing.
    """

    __slots__ = (
        "_data",
        "_deadline",
        "_done",
        "_expect",
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
        expect: tuple[int, int | None] | None = None,
    ) -> None:
        self._reactor = reactor
        self._expect = expect
        self._path = str(path)
        self._data = data
        self._type = answer_type
        self._reader = wire.FrameReader(answer_type, max_extra_size)
        self._done = done
        self._timeout = timeout
        now = trio.current_time()
        self._deadline = now + timeout
        # The low-level type: socket.socket's Python wrapper costs per connection.
        self._sock = _socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
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
        if self._expect is not None:
            wrong = self._wrong_peer()
            if wrong is not None:
                self._finish(wrong)
                return
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

    def _wrong_peer(self) -> WrongPeer | None:
        """Who listens on the socket dialled, unless it is the process expected."""
        assert self._expect is not None
        uid, pid = self._expect
        try:
            peer_pid, peer_uid, _ = peer_credentials(self._sock)
        except OSError as exc:
            return WrongPeer(exc.errno or errno.EACCES, f"{self._path}: {exc.strerror}")
        if peer_uid != uid or (pid is not None and peer_pid != pid):
            return WrongPeer(
                errno.EACCES,
                f"{self._path} is served by pid {peer_pid} uid {peer_uid}, not the worker's "
                f"pid {pid} uid {uid}",
            )
        return None

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
        self._reactor.forget(self._sock)
        done = self._done
        if self._started:
            try:
                done(result)  # in event order: an answer is handled before what came after it
            finally:
                self._sock.close()
        else:
            self._sock.close()
            self._reactor.call_soon(lambda now: done(result))


class Incoming(Generic[wire.M]):
    """One accepted connection: read a frame, hand it to `on_frame`, write the answer, close.

    The socket may be left in blocking mode, as `accept` gives it: every call on it
    says `wire.DONTWAIT`.

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
        sock: _socket.socket,
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
            self._reactor.forget(self.sock)
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
                self._out = self._out[self.sock.send(self._out, wire.DONTWAIT) :]
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


async def exchange(
    reactor: Reactor,
    path: str | Path,
    data: bytes,
    answer_type: type[wire.M],
    *,
    timeout: float,
    max_extra_size: int = wire.DEFAULT_MAX_EXTRA_SIZE,
) -> tuple[wire.M, bytes]:
    """Dial `path`, send the encoded frame `data`, and return the frame that answers it.

    Raises what `Outgoing` reports: `OSError` (nobody listens) or `wire.RemoteProtocolError`.
    """
    done = trio.Event()
    outcome: list[Result[wire.M]] = []

    def finished(result: Result[wire.M]) -> None:
        outcome.append(result)
        done.set()

    Outgoing(
        reactor, path, data, answer_type, finished, timeout=timeout, max_extra_size=max_extra_size
    )
    await done.wait()
    result = outcome[0]
    if isinstance(result, BaseException):
        raise result
    return result

"""The dials on main.sock and the seed's exchange (docs/protocol.md; `worker
--seed-protocol`, or a controller that grants no channel). A dial is a connection of its own
to main.sock (connect, one frame, its answer, close), made without blocking: REGISTER goes
this way whichever side follows, and so does every message of the seed's exchange. The
controller's own messages come on the control socket `<worker_id>.sock` the worker listens
on, one connection each (one frame in, one answer out, close), from the controller's uid
only."""

from __future__ import annotations

import _socket
import functools
import logging
import os
import select
import socket
import struct
import time
from collections.abc import Callable
from pathlib import Path

from controller import wire
from controller.transport import CONNECT_RETRY, accept_unix, listen_unix
from gen import worker_protocol_pb2 as pb
from worker.core import Effect
from worker.local.base import EXIT_RESTART, Settings
from worker.local.job import JobSlot

log = logging.getLogger("worker")

_IN = select.EPOLLIN
_OUT = select.EPOLLOUT

# The controller dials one connection at a time per worker, plus an occasional GET_STATUS.
CONTROL_BACKLOG = 64

# The longest error text a bad control frame is answered with.
BAD_FRAME_TEXT = 1024
# A refused peer on the control socket is logged at most this often (a count in between).
REFUSED_LOG_SECONDS = 30.0

_PEERCRED = struct.Struct("3i")


def peer_uid(sock: _socket.socket) -> int:
    """The uid of the process at the other end of an accepted Unix connection (SO_PEERCRED;
    -2, nobody's, when the kernel gives none)."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    except OSError:
        return -2
    uid: int = _PEERCRED.unpack(raw)[1]
    return uid


class _Dial:
    """One exchange on main.sock: connect, send a frame, read the answer, close."""

    __slots__ = ("connect_at", "data", "deadline", "done", "reader", "sock")

    def __init__(
        self, data: bytes, deadline: float, done: Callable[[pb.PulseResponse | None, str], None]
    ) -> None:
        self.sock = _socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
        self.data = data
        self.deadline = deadline
        self.done = done  # (the answer or None, why not)
        self.reader = wire.FrameReader(pb.PulseResponse)
        self.connect_at = 0.0  # when to try connecting again (backlog full); 0: connected


class _Conn:
    """One accepted control connection: a request to read, then an answer to write."""

    __slots__ = ("deadline", "out", "reader", "sent", "sock")

    def __init__(self, sock: _socket.socket, deadline: float, max_extra: int) -> None:
        self.sock = sock
        self.deadline = deadline
        self.reader: wire.FrameReader[pb.ControlMsg] | None = wire.FrameReader(
            pb.ControlMsg, max_extra
        )
        self.out = b""
        self.sent: Callable[[], None] | None = None


class SeedExchange(JobSlot):
    """Dials on main.sock and the control socket's connections."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self._dials: dict[int, _Dial] = {}
        self._conns: dict[int, _Conn] = {}
        self._listener: socket.socket | None = None
        self._path: Path | None = None
        self._controller_uid = -1  # main.sock's owner, known once registered
        self._refusals = 0
        self._refused_log_at = 0.0
        self._controller_ok = True

    def _dial(
        self,
        msg: pb.WorkerPulse,
        done: Callable[[pb.PulseResponse | None, str], None],
        extra: bytes = b"",
    ) -> None:
        now = time.monotonic()
        dial = _Dial(wire.encode_frame(msg, extra), now + self.dial_timeout, done)
        self._dials[dial.sock.fileno()] = dial
        self._connect(dial, now)

    def _connect(self, dial: _Dial, now: float) -> None:
        try:
            dial.sock.connect(self._main_socket)
        except BlockingIOError:  # listen backlog full
            if now >= dial.deadline:
                self._dial_done(dial, None, "listen backlog full")
            else:
                dial.connect_at = now + CONNECT_RETRY
            return
        except OSError as exc:
            self._dial_done(dial, None, exc.strerror or str(exc))
            return
        dial.connect_at = 0.0
        try:
            sent = dial.sock.send(dial.data)
        except OSError as exc:
            self._dial_done(dial, None, f"sending a pulse: {exc}")
            return
        # A pulse is a few bytes (with output, at most CHUNK more, well within a Unix socket's
        # buffer): a socket that takes less is broken.
        if sent < len(dial.data):
            self._dial_done(dial, None, "sending a pulse: short write")
            return
        self._watch(dial.sock.fileno(), _IN, lambda events: self._dial_read(dial))

    def _dial_read(self, dial: _Dial) -> None:
        try:
            frame = dial.reader.read(dial.sock)
        except wire.RemoteProtocolError as exc:
            self._dial_done(dial, None, str(exc))
            return
        if frame is not None:
            self._dial_done(dial, frame[0], "")

    def _dial_done(self, dial: _Dial, answer: pb.PulseResponse | None, why: str) -> None:
        fd = dial.sock.fileno()
        self._dials.pop(fd, None)
        self._unwatch(fd)
        dial.sock.close()
        if answer is None:
            if self._controller_ok:
                log.warning("controller unreachable on %s: %s", self._main_socket, why)
            self._controller_ok = False
        elif not self._controller_ok:
            log.info("controller reachable again")
            self._controller_ok = True
        dial.done(answer, why)

    def _listen(self, worker_id: int) -> None:
        # The controller is main.sock's owner: the one uid the control socket answers.
        try:
            self._controller_uid = os.stat(self._main_socket).st_uid
        except OSError as exc:
            log.warning(
                "cannot stat %s (%s): the control socket answers only root", self._main_socket, exc
            )
            self._controller_uid = 0
        path = self.socket_dir / f"{worker_id}.sock"
        path.unlink(missing_ok=True)
        listener = listen_unix(path, CONTROL_BACKLOG, 0o660)
        self._listener, self._path = listener, path
        self.session.worker_id = worker_id
        self._watch(listener.fileno(), _IN, self._accept)
        self._pulse_at = 0.0  # the first OK goes out as soon as the socket listens

    def _unlisten(self) -> None:
        if self._listener is not None:
            self._unwatch(self._listener.fileno())
            self._listener.close()
            self._listener = None
        if self._path is not None:
            self._path.unlink(missing_ok=True)
            self._path = None

    def _accept(self, events: int) -> None:
        # One per readiness event: the controller dials a worker one connection at a time;
        # the epoll set is level-triggered, so one more waiting is served next round.
        assert self._listener is not None
        try:
            sock = accept_unix(self._listener)
        except BlockingIOError:
            return
        uid = peer_uid(sock)
        if uid != self._controller_uid:  # only the controller may ask anything of us
            sock.close()
            self._refused(uid)
            return
        conn = _Conn(sock, time.monotonic() + self.dial_timeout, self.max_extra_size)
        self._conns[sock.fileno()] = conn
        if not self._conn_read(conn):  # the request has often arrived with the connection
            self._watch(sock.fileno(), _IN, functools.partial(self._conn_readable, conn))

    def _refused(self, uid: int) -> None:
        """A connection from another uid than the controller's was closed: logged with its
        uid, then counted, at most every REFUSED_LOG_SECONDS."""
        self._refusals += 1
        now = time.monotonic()
        if now >= self._refused_log_at:
            log.warning(
                "control socket: refused %d connection(s) from uids other than the "
                "controller's (%d); the last from uid %d",
                self._refusals,
                self._controller_uid,
                uid,
            )
            self._refusals = 0
            self._refused_log_at = now + REFUSED_LOG_SECONDS

    def _conn_readable(self, conn: _Conn, events: int) -> None:
        if conn.reader is not None:
            self._conn_read(conn)

    def _conn_read(self, conn: _Conn) -> bool:
        """Read the request and answer it; False while it is still on its way."""
        assert conn.reader is not None
        try:
            frame = conn.reader.read(conn.sock)
        except wire.RemoteProtocolError as exc:
            conn.reader = None
            log.warning("control socket: bad message: %s", exc)
            if exc.can_reply:
                response = pb.WorkerResponse(
                    error=pb.WORKER_ERR_FAILED, task_id=self.session.task_id
                )
                self._reply(conn, wire.encode_frame(response, str(exc).encode()[:BAD_FRAME_TEXT]))
            else:
                self._close_conn(conn)
            return True
        if frame is None:
            return False
        conn.reader = None
        self._on_control(conn, *frame)
        return True

    def _on_control(self, conn: _Conn, msg: pb.ControlMsg, extra: bytes) -> None:
        answer = self.session.on_control(msg, extra)
        effect = answer.effect
        data = wire.encode_frame(answer.response, answer.extra)
        if effect is Effect.START:
            self._reply(conn, data)  # first: the controller is waiting, and the job can start after
            self._start_job(msg.task_id, extra)
        elif effect is Effect.RESTART:
            log.warning("controller sent RESTART: stopping and exiting %d", EXIT_RESTART)
            self._abandon_job()
            self._reply(conn, data)
            self._unlisten()
            self._stop(EXIT_RESTART)
        elif effect is Effect.FETCHED:
            task_id = answer.response.task_id
            self._reply(conn, data, lambda: self.session.fetched(task_id))
        else:
            self._reply(conn, data)

    def _reply(self, conn: _Conn, data: bytes, sent: Callable[[], None] | None = None) -> None:
        conn.out, conn.sent = data, sent
        self._conn_write(conn)

    def _conn_write(self, conn: _Conn) -> None:
        try:
            while conn.out:
                conn.out = conn.out[conn.sock.send(conn.out, wire.DONTWAIT) :]
        except BlockingIOError:  # a big answer: the rest as the peer reads
            conn.deadline = time.monotonic() + self.dial_timeout
            self._watch(conn.sock.fileno(), _OUT, lambda events: self._conn_write(conn))
            return
        except OSError:
            self._close_conn(conn)  # the peer went away (`sent` is not called)
            return
        self._close_conn(conn)
        if conn.sent is not None:
            conn.sent()

    def _close_conn(self, conn: _Conn) -> None:
        fd = conn.sock.fileno()
        if fd >= 0:
            self._conns.pop(fd, None)
            self._unwatch(fd)
            conn.sock.close()

    def _seed_shutdown(self) -> None:
        """SHUTDOWN on a connection of its own to main.sock, waiting for its answer (bounded by
        the dial timeout)."""
        session = self.session
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(self.dial_timeout)
                sock.connect(self._main_socket)
                sock.sendall(
                    wire.encode_frame(
                        pb.WorkerPulse(type=pb.PULSE_SHUTDOWN, worker_id=session.worker_id)
                    )
                )
                reader = wire.FrameReader(pb.PulseResponse)
                while reader.read(sock) is None:
                    select.select([sock], [], [], self.dial_timeout)
        except (OSError, wire.RemoteProtocolError) as exc:
            log.warning("SHUTDOWN not delivered: %s", exc)

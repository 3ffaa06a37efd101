"""The local worker's loop: one epoll set served in plain Python, no event loop per job.

How this works. A local worker runs one job at a time, so its hot path
(SET_TASK in, the job, FETCH_ME out, FETCH in) needs no scheduler: one
level-triggered epoll set holds everything the worker waits for, and one
loop serves it in plain Python:

- its channel (docs/protocol.md, "The channel"): one connection to main.sock
  for the worker's life, asked for at REGISTER, on which tasks come in and
  outcomes, output and pulses go out; or, with `channel=False`
  (`worker --seed-protocol`) or a controller that does not grant it, the
  listening socket `<worker_id>.sock` and the control connections accepted
  from it (one frame in, one answer out, close);
- the exchanges on main.sock (REGISTER, the periodic pulse, FETCH_ME the
  moment a job ends, SHUTDOWN), dialled without blocking, so that a
  controller that dials us while we wait for its answer is served;
- the running `--exec` command's stdin, stdout, stderr and pidfd
  (worker/spawn.py's `Command`);
- a wake-up pipe written by the SIGTERM/SIGINT handlers and by a plain
  `--handler` running in the worker's one handler thread;
- with --exit-with-parent, a pidfd on the parent.

Timers (the next pulse, the drain deadline, each connection's silence) are
a handful of numbers looked at once a round: the epoll wait sleeps until the
earliest. An async `--handler` (or any other async runner) runs in a trio
task parked between jobs: the loop runs inside `trio.run`, gives that task
its turns when it hands it a job (a no-op handler ends in them), and while a
job goes on waits on the epoll set through trio. A plain `--handler` runs
in a thread of its own, so that the loop answers the controller meanwhile.

What it saves a job against a trio task per exchange: no cancel scope or
trio I/O wait per exchange, and for `--exec` no trio wait on the command at
all (worker/spawn.py's `Command`).

What to answer and what to pulse is decided by `WorkerSession`
(worker/core.py), the pure session. Frames are read and written with
controller/wire.py. Behaviour: REGISTER on main.sock (retrying with
capped, jittered backoff), pulse OK at once and then every period, FETCH_ME as
soon as a job ends, re-register on UNKNOWN_ID keeping the job and its
outcome, RESTART kills the job and exits 75, SIGTERM/SIGINT drain (bounded
by the drain timeout, then SHUTDOWN, exit 0) and a second signal exits at
once.
"""

from __future__ import annotations

import _socket
import contextlib
import functools
import logging
import math
import os
import queue
import random
import resource
import select
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import trio
from outcome import Value

from controller import wire
from controller.declared import DEFAULT as DECLARED_DEFAULT
from controller.declared import Declared
from controller.joblimits import NO_LIMITS, from_proto
from controller.transport import accept_unix, listen_unix
from gen import worker_protocol_pb2 as pb
from worker.core import Effect, Phase, WorkerSession
from worker.output import BATCH_SECONDS, CHUNK, SINK, OutputSink
from worker.runner import (
    READ_CHUNK,
    STDERR_TAIL,
    ExecRunner,
    HandlerRunner,
    Runner,
    TaskFailed,
    command_outcome,
)
from worker.spawn import Command

log = logging.getLogger("worker")

EXIT_RESTART = 75  # EX_TEMPFAIL: the supervisor starts us again
# Registration retry backoff: quick at first (the controller may be starting), capped
# so that a worker waiting for a long-gone controller still notices it within seconds.
REGISTER_BACKOFF_START = 0.05
REGISTER_BACKOFF_MAX = 5.0
# Each wait is drawn from delay x (1 +- this), so that a crowd of workers spreads out.
REGISTER_JITTER = 0.5
# The controller dials one connection at a time per worker, plus an occasional GET_STATUS.
CONTROL_BACKLOG = 64


def promised_next_pulse(period: float) -> int:
    """What the worker promises in `next_pulse`: whole seconds, twice the real period."""
    return max(1, math.ceil(2 * period))


# A full listen backlog on main.sock makes a non-blocking connect fail with EAGAIN:
# try again after this pause, until the exchange's timeout.
CONNECT_RETRY = 0.001
# The longest error text a bad control frame is answered with.
BAD_FRAME_TEXT = 1024
_IN = select.EPOLLIN
_OUT = select.EPOLLOUT

# (ok, the result or the error text, what the job used, "limit" when it hit one of its limits)
Outcome = tuple[bool, bytes, pb.Usage | None, str]
# A refused peer on the control socket is logged at most this often (a count in between).
REFUSED_LOG_SECONDS = 30.0


_FETCH = pb.ControlMsg(type=pb.CTRL_FETCH)
_CHANNEL_OK = pb.PulseResponse(error=pb.CTRL_ERR_OK)


def _read_one(sock: socket.socket, msg_type: type[wire.M]) -> wire.M:
    """One delimited message of `msg_type` from a blocking socket, read to its last byte and
    no further (what follows it belongs to the channel)."""
    length = shift = 0
    for _ in range(wire.MAX_VARINT_BYTES):
        byte = sock.recv(1)
        if not byte:
            raise wire.Truncated("the controller closed before answering")
        length |= (byte[0] & 0x7F) << shift
        if not byte[0] & 0x80:
            break
        shift += 7
    else:
        raise wire.VarintTooLong("length prefix longer than 10 bytes")
    if length > wire.MAX_HEADER_SIZE:
        raise wire.HeaderTooLarge(f"an answer of {length} bytes")
    body = b""
    while len(body) < length:
        chunk = sock.recv(length - len(body))
        if not chunk:
            raise wire.Truncated("the controller closed in the middle of its answer")
        body += chunk
    try:
        return msg_type.FromString(body)
    except Exception as exc:
        raise wire.MalformedMessage(f"not a valid {msg_type.__name__}: {exc}") from None


def _parked_abort(raise_cancel: Any) -> trio.lowlevel.Abort:
    return trio.lowlevel.Abort.SUCCEEDED  # cancelled between jobs: the worker is leaving


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


def handler_usage(start_wall: float, start_cpu: float, cpu_now: Callable[[], float]) -> pb.Usage:
    """A --handler job's usage: its wall and CPU time (the thread's, or the process's for an
    async one) and the worker's peak resident memory."""
    return pb.Usage(
        wall=time.perf_counter() - start_wall,
        cpu=max(0.0, cpu_now() - start_cpu),
        max_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    )


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


class LocalWorker:
    """A local worker on `socket_dir`/main.sock; `run()` inside `trio.run` gives its exit
    status."""

    def __init__(
        self,
        socket_dir: Path,
        runner: Runner,
        *,
        pulse_period: float = 1.0,
        drain_timeout: float = 30.0,
        dial_timeout: float = 2.0,
        max_extra_size: int = wire.DEFAULT_MAX_EXTRA_SIZE,
        parent_pid: int | None = None,
        declared: Declared = DECLARED_DEFAULT,
        channel: bool = True,
    ) -> None:
        """`channel`: ask for a channel at REGISTER (False: the seed's exchange)."""
        self.socket_dir = socket_dir
        self.ask_channel = channel
        self.runner = runner
        self.pulse_period = pulse_period
        self.next_pulse = promised_next_pulse(pulse_period)
        self.drain_timeout = drain_timeout
        self.dial_timeout = dial_timeout
        self.max_extra_size = max_extra_size
        self.parent_pid = parent_pid
        self.session = WorkerSession(declared)
        self.exit_code = 0
        self._main_socket = str(socket_dir / "main.sock")
        self._epoll = select.epoll()
        self._handlers: dict[int, Callable[[int], None]] = {}
        self._dials: dict[int, _Dial] = {}
        self._conns: dict[int, _Conn] = {}
        self._listener: socket.socket | None = None
        self._path: Path | None = None
        self._controller_uid = -1  # main.sock's owner, known once registered
        self._refusals = 0
        self._refused_log_at = 0.0
        self._done = False
        self._controller_ok = True
        # Registration: the next attempt and the backoff; pulses: the next one, and whether
        # one (periodic or FETCH_ME) is on its way.
        self._register_at = 0.0
        self._backoff = REGISTER_BACKOFF_START
        self._registering = False
        self._pulse_at = math.inf
        self._pulsing = False
        self._drain_deadline = math.inf
        self._signals: list[int] = []
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        # The running job: a command, a trio task, or a call in the handler thread.
        self._command: Command | None = None
        self._command_fds: set[int] = set()  # its descriptors the loop has handlers for
        self._job_id = 0
        self._outcome: Outcome | None = None  # set by a job that ended outside the loop
        self._job_task: trio.lowlevel.Task | None = None  # runs async jobs (see _job_runner)
        self._async_busy = False  # it runs one now
        self._in_trio = False  # the loop waits through trio (a job's task may wake it)
        self._thread_jobs: queue.SimpleQueue[tuple[int, bytes] | None] | None = None
        self._parent_fd = -1
        # Job output (what the job writes to stderr), for a controller that takes it (its
        # REGISTER answer says so): gathered in the sink, sent in PULSE_OUTPUTs at most every
        # BATCH_SECONDS; a job's outcome waits until its last output is sent.
        self._takes_output = False
        self._sink = OutputSink(self._output_arrived)
        self._output_due = False  # the sink may hold bytes (set from any thread)
        self._output_at = math.inf  # when to send them
        self._sending_output = False  # a PULSE_OUTPUT is on its way
        self._ending: tuple[int, Outcome] | None = None  # an outcome waiting for its output
        # The channel (docs/protocol.md), once granted and open: every message goes on it.
        self._chan: _socket.socket | None = None
        self._chan_decoder = wire.StreamDecoder(pb.ChannelFrame, max_extra_size)
        self._chan_out = b""  # written, not yet taken by the kernel
        self._chan_flushed: list[Callable[[], None]] = []  # told once _chan_out is empty

    # ------------------------------------------------------------ lifecycle

    async def run(self, *, handle_signals: bool = True) -> int:
        """Run until SHUTDOWN or RESTART (or a second signal); the exit status."""
        self._watch(self._wake_r, _IN, self._on_wake)
        previous: dict[signal.Signals, Any] = {}
        if handle_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, self._on_signal)
        parent_fd = self._open_parent()
        try:
            async with trio.open_nursery() as nursery:
                if not isinstance(self.runner, ExecRunner) and not (
                    isinstance(self.runner, HandlerRunner) and not self.runner.is_async
                ):
                    await nursery.start(self._job_runner)
                await self._loop()
                nursery.cancel_scope.cancel()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._abandon_job()
            if isinstance(self.runner, ExecRunner) and self.runner.jail is not None:
                self.runner.jail.close()
            if self._thread_jobs is not None:
                self._thread_jobs.put(None)
            self._unlisten()
            for dial in self._dials.values():
                dial.sock.close()
            for conn in self._conns.values():
                conn.sock.close()
            if self._chan is not None:
                self._chan.close()
            if parent_fd is not None:
                os.close(parent_fd)
            self._epoll.close()
            os.close(self._wake_r)
            os.close(self._wake_w)
        return self.exit_code

    async def _loop(self) -> None:
        poll = self._epoll.poll
        handlers = self._handlers
        while not self._done:
            timeout = self._timers(time.monotonic())
            if self._done:
                return
            if self._async_busy:
                # The job's trio task needs turns: give it one (most handlers end in it; trio
                # runs the tasks of a turn in either order, hence two), then wait through trio.
                await trio.lowlevel.checkpoint()
                if self._outcome is None:
                    await trio.lowlevel.checkpoint()
                if self._outcome is not None:
                    self._job_ended()
                    continue
                self._in_trio = True
                with trio.move_on_after(timeout if timeout >= 0 else math.inf):
                    await trio.lowlevel.wait_readable(self._epoll.fileno())
                self._in_trio = False
                events = poll(0)
            else:
                events = poll(timeout)
            for fd, mask in events:
                handler = handlers.get(fd)
                if handler is not None:  # not closed by an earlier handler this round
                    handler(mask)
            if self._outcome is not None:
                self._job_ended()

    def drain(self) -> None:
        """Stop taking jobs; finish and hand over the current one, then leave."""
        if not self.session.draining:
            log.info("draining: finishing the current task, then shutting down")
            self.session.draining = True
            self._drain_deadline = time.monotonic() + self.drain_timeout
            self._pulse_at = 0.0

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Runs between bytecodes of the loop (an epoll wait interrupted by the signal runs
        # it and retries): note it and wake the loop, which acts on it.
        self._signals.append(signum)
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"s")

    def _on_wake(self, events: int) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self._wake_r, 4096)
        while self._signals:
            signum = self._signals.pop(0)
            if self.session.draining:
                log.warning("second %s: exiting now", signal.Signals(signum).name)
                self._stop(128 + signum)
                return
            self.drain()

    def _stop(self, code: int) -> None:
        self.exit_code = code
        self._abandon_job()
        self._done = True

    def _open_parent(self) -> int | None:
        """A pidfd on the parent, watched: its end drains the worker. None: not watched."""
        pid = self.parent_pid
        if pid is None or pid <= 1:
            return None
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._parent_ended(0)
            return None
        except OSError as exc:  # no pidfd here (old kernel, seccomp): carry on unwatched
            log.warning("cannot watch parent pid %d (%s); staying up on its own", pid, exc)
            return None
        if os.getppid() != pid:  # it died before we looked, and the pid may be reused
            os.close(fd)
            self._parent_ended(0)
            return None
        self._parent_fd = fd
        self._watch(fd, _IN, self._parent_ended)
        return fd

    def _parent_ended(self, events: int) -> None:
        self._unwatch(self._parent_fd)  # readable for good
        log.warning("parent process %s ended", self.parent_pid)
        self.drain()

    # ------------------------------------------------------------ timers

    def _timers(self, now: float) -> float:
        """Act on what is due; then the seconds until the next timer (-1: none), from the
        state as acting left it (a dial that failed at once sets the next try)."""
        session = self.session
        if session.draining and (session.phase is Phase.IDLE or now >= self._drain_deadline):
            self._shutdown()
            return -1
        if session.worker_id == 0:
            if not self._registering and now >= self._register_at:
                self._register(now)
        elif not self._pulsing and now >= self._pulse_at:
            self._pulse(now)
        if self._output_due and not self._sending_output:
            if self._output_at == math.inf:
                self._output_at = now if len(self._sink) >= CHUNK else now + BATCH_SECONDS
            if now >= self._output_at:
                self._send_output()
        if self._dials or self._conns:
            for dial in list(self._dials.values()):
                if dial.connect_at and now >= dial.connect_at:
                    self._connect(dial, now)
                elif now >= dial.deadline:
                    self._dial_done(dial, None, f"no answer within {self.dial_timeout:g} s")
            for conn in list(self._conns.values()):
                if now >= conn.deadline:
                    self._close_conn(conn)
        wake = math.inf
        if session.worker_id == 0:
            if not self._registering:
                wake = self._register_at
        elif not self._pulsing:
            wake = self._pulse_at
        if session.draining:
            wake = min(wake, self._drain_deadline)
        if self._output_due and not self._sending_output:
            wake = min(wake, self._output_at)
        for dial in self._dials.values():  # those on their way, backlog retries included
            wake = min(wake, dial.connect_at or dial.deadline)
        for conn in self._conns.values():
            wake = min(wake, conn.deadline)
        return -1 if wake == math.inf else max(0.0, wake - now)

    # ------------------------------------------------------------ main.sock

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

    def _register(self, now: float) -> None:
        self._registering = True
        msg = self.session.register(self.next_pulse)
        msg.channel = self.ask_channel
        self._dial(msg, self._registered)

    def _registered(self, resp: pb.PulseResponse | None, why: str) -> None:
        self._registering = False
        if resp is not None and resp.error == pb.CTRL_ERR_OK and resp.HasField("worker_id"):
            log.info("registered as worker %d", resp.worker_id)
            self._takes_output = resp.takes_output
            if self.ask_channel and resp.channel:
                if self._open_channel(resp.worker_id):
                    self._backoff = REGISTER_BACKOFF_START
                    return
                resp = None
            else:
                self._backoff = REGISTER_BACKOFF_START
                self._listen(resp.worker_id)
                return
        if resp is not None:
            error = resp.error
            name = pb.ControllerError.Name(error) if error in pb.ControllerError.values() else error
            log.warning("registration refused (%s); retrying in %.2g s", name, self._backoff)
        # Jitter: workers started together (a restart of all units) do not retry in step.
        jitter = random.uniform(1 - REGISTER_JITTER, 1 + REGISTER_JITTER)
        self._register_at = time.monotonic() + self._backoff * jitter
        self._backoff = min(self._backoff * 2, REGISTER_BACKOFF_MAX)

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

    def _pulse(self, now: float) -> None:
        """The periodic pulse, or FETCH_ME: one on its way at a time."""
        if self._chan is not None:  # on the channel: PULSE_OK, answered only by an error
            pulse = self.session.pulse(self.next_pulse)
            pulse.type = pb.PULSE_OK
            self._chan_send(wire.encode_channel(wire.CHANNEL_PULSE, pulse))
            self._pulse_at = now + self.pulse_period
            return
        self._pulsing = True
        self._pulse_at = math.inf
        self._dial(self.session.pulse(self.next_pulse), self._pulsed)

    def _pulsed(self, resp: pb.PulseResponse | None, why: str) -> None:
        self._pulsing = False
        if self._pulse_at == math.inf:  # not brought forward meanwhile
            self._pulse_at = time.monotonic() + self.pulse_period
        if resp is None:
            return
        if resp.error == pb.CTRL_ERR_UNKNOWN_ID:
            session = self.session
            log.warning(
                "controller does not know worker %d; registering again (keeping task %d)",
                session.worker_id,
                session.task_id,
            )
            self._unlisten()
            session.worker_id = 0
            self._register_at = 0.0
            self._pulse_at = math.inf
        elif resp.error != pb.CTRL_ERR_OK:
            log.warning("pulse answered with error %d", resp.error)
            self._pulse_at = time.monotonic() + self.pulse_period

    def _fetch_me(self) -> None:
        """Say FETCH_ME now, not at the next period (the periodic pulse repeats it if lost).
        On the channel: send the outcome itself."""
        if self._chan is not None:
            self._send_outcome()
            return
        if self.session.worker_id == 0 or self.session.draining:
            return  # registration, or the drain, pulses next
        if self._pulsing:
            self._pulse_at = 0.0  # right after the pulse on its way
        else:
            self._pulse(time.monotonic())

    # ------------------------------------------------------------ job output

    def _output_arrived(self) -> None:
        """The sink's hook (any thread): bytes wait to be sent; the loop looks at its timers."""
        self._output_due = True
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"o")

    def _send_output(self) -> None:
        """One PULSE_OUTPUT with what waits (at most CHUNK bytes)."""
        self._output_at = math.inf
        self._output_due = False  # cleared before looking: a write from now on sets it again
        session = self.session
        if not len(self._sink):
            self._output_settled()
            return
        if session.worker_id == 0 or not self._takes_output or not session.task_id:
            self._sink.clear()  # nobody to send it to
            self._output_settled()
            return
        self._output_due = True  # the rest, if any, after this one's answer
        self._sending_output = True
        pulse = pb.WorkerPulse(
            type=pb.PULSE_OUTPUT, worker_id=session.worker_id, task_id=session.task_id
        )
        if self._chan is not None:  # no answer on the channel: the next piece may follow
            self._chan_send(wire.encode_channel(wire.CHANNEL_PULSE, pulse, self._sink.take(CHUNK)))
            self._output_sent(_CHANNEL_OK, "")
            return
        self._dial(pulse, self._output_sent, self._sink.take(CHUNK))

    def _output_sent(self, resp: pb.PulseResponse | None, why: str) -> None:
        self._sending_output = False
        if resp is None:  # the controller is away: this output is lost, the job goes on
            self._sink.clear()
        self._output_due = False
        if len(self._sink):
            self._output_due = True
            if self._ending is not None or len(self._sink) >= CHUNK:
                self._output_at = 0.0
        else:
            self._output_settled()

    def _output_settled(self) -> None:
        """Nothing waits to be sent: an outcome held for its output goes out now."""
        if self._ending is not None and not self._sending_output:
            task_id, (ok, result, usage, reason) = self._ending
            self._ending = None
            self.session.finished(task_id, ok, result, usage, reason)
            self._fetch_me()

    def _shutdown(self) -> None:
        session = self.session
        self._done = True
        if session.worker_id == 0:
            return  # never registered, or forgotten: nobody to tell
        if session.phase is Phase.RUNNING:
            log.warning("drain timeout: abandoning task %d", session.task_id)
            self._abandon_job()
        self._unlisten()
        if self._chan is not None:
            self._chan_shutdown()
            log.info("worker %d shut down", session.worker_id)
            return
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
        log.info("worker %d shut down", session.worker_id)

    # ------------------------------------------------------------ the channel

    def _open_channel(self, worker_id: int) -> bool:
        """Open the channel granted at REGISTER: a new connection to main.sock, a PULSE_OK
        (FETCH_ME while an outcome waits) with `channel` set, its answer; then ChannelFrames
        both ways. Done blocking (bounded by the dial timeout): it happens once a
        registration. False: not open (the worker registers again)."""
        session = self.session
        session.worker_id = worker_id
        pulse = session.pulse(self.next_pulse)
        pulse.channel = True
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.dial_timeout)
            sock.connect(self._main_socket)
            sock.sendall(wire.encode_frame(pulse))
            answer = _read_one(sock, pb.PulseResponse)
        except (OSError, wire.RemoteProtocolError) as exc:
            sock.close()
            session.worker_id = 0
            log.warning("cannot open the channel on %s: %s", self._main_socket, exc)
            return False
        if answer.error != pb.CTRL_ERR_OK or not answer.channel:
            sock.close()
            session.worker_id = 0
            log.warning("channel refused (error %d)", answer.error)
            return False
        sock.setblocking(False)
        self._chan = sock
        self._chan_decoder = wire.StreamDecoder(pb.ChannelFrame, self.max_extra_size)
        self._chan_out = b""
        self._chan_flushed = []
        self._watch(sock.fileno(), _IN, self._chan_ready)
        self._pulse_at = time.monotonic() + self.pulse_period
        log.info("channel open for worker %d", worker_id)
        return True

    def _chan_send(self, data: bytes, flushed: Callable[[], None] | None = None) -> None:
        """Write `data` on the channel after what waits; `flushed()` once all of it is out."""
        sock = self._chan
        if sock is None:
            return
        if flushed is not None:
            self._chan_flushed.append(flushed)
        if self._chan_out:
            self._chan_out += data
            return
        try:
            sent = sock.send(data, wire.DONTWAIT)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            self._chan_lost(f"sending: {exc}")
            return
        if sent < len(data):
            self._chan_out = data[sent:]
            self._watch(sock.fileno(), _IN | _OUT, self._chan_ready)
            return
        self._chan_done_writing()

    def _chan_done_writing(self) -> None:
        flushed, self._chan_flushed = self._chan_flushed, []
        for call in flushed:
            call()

    def _chan_ready(self, events: int) -> None:
        sock = self._chan
        if sock is None:
            return
        if events & _OUT and self._chan_out:  # first: what it frees may be answered below
            try:
                sent = sock.send(self._chan_out, wire.DONTWAIT)
            except BlockingIOError:
                sent = 0
            except OSError as exc:
                self._chan_lost(f"sending: {exc}")
                return
            self._chan_out = self._chan_out[sent:]
            if not self._chan_out:
                self._watch(sock.fileno(), _IN, self._chan_ready)
                self._chan_done_writing()
        if not events & (_IN | select.EPOLLHUP | select.EPOLLERR) or self._chan is not sock:
            return
        try:
            data = sock.recv(wire.FIRST_READ, wire.DONTWAIT)
        except BlockingIOError:
            return
        except OSError as exc:
            self._chan_lost(f"receiving: {exc}")
            return
        if not data:
            self._chan_lost("the controller closed it")
            return
        try:
            frames = self._chan_decoder.feed(data)
        except wire.RemoteProtocolError as exc:
            self._chan_lost(f"bad frame: {exc}")
            return
        for frame, extra in frames:
            if self._chan is not sock or self._done:
                return
            self._chan_frame(frame, extra)

    def _chan_frame(self, frame: pb.ChannelFrame, extra: bytes) -> None:
        which = frame.WhichOneof("msg")
        if which == "control":
            msg = frame.control
            answer = self.session.on_control(msg, extra)
            effect = answer.effect
            if effect is Effect.START:  # taken: the outcome is the answer
                self._start_job(msg.task_id, extra)
            elif effect is Effect.RESTART:
                log.warning("controller sent RESTART: stopping and exiting %d", EXIT_RESTART)
                self._abandon_job()
                self._stop(EXIT_RESTART)
            else:
                task_id = answer.response.task_id
                data = wire.encode_channel(
                    wire.CHANNEL_RESPONSE, answer.response, answer.extra, msg.type
                )
                if effect is Effect.FETCHED:
                    self._chan_send(data, lambda: self.session.fetched(task_id))
                else:
                    self._chan_send(data)
        elif which == "pulse_response":
            error = frame.pulse_response.error
            if error != pb.CTRL_ERR_OK:
                self._chan_lost(f"the controller answered a pulse with error {error}")

    def _send_outcome(self) -> None:
        """The job's outcome, on the channel, the moment it is known (its output went first)."""
        session = self.session
        if not session.has_outcome:
            return
        answer = session.on_control(_FETCH, b"")
        task_id = answer.response.task_id
        self._chan_send(
            wire.encode_channel(
                wire.CHANNEL_RESPONSE, answer.response, answer.extra, pb.CTRL_FETCH
            ),
            lambda: self.session.fetched(task_id),
        )

    def _chan_lost(self, why: str) -> None:
        """The channel ended: register again, keeping the job and an outcome not sent whole."""
        sock = self._chan
        if sock is None:
            return
        self._unwatch(sock.fileno())
        sock.close()
        self._chan = None
        self._chan_out = b""
        self._chan_flushed = []
        session = self.session
        log.warning(
            "channel of worker %d ended (%s); registering again (keeping task %d)",
            session.worker_id,
            why,
            session.task_id,
        )
        session.worker_id = 0
        self._register_at = 0.0
        self._pulse_at = math.inf

    def _chan_shutdown(self) -> None:
        """SHUTDOWN on the channel after what waits there, then close it."""
        sock = self._chan
        assert sock is not None
        pulse = pb.WorkerPulse(type=pb.PULSE_SHUTDOWN, worker_id=self.session.worker_id)
        data = self._chan_out + wire.encode_channel(wire.CHANNEL_PULSE, pulse)
        self._unwatch(sock.fileno())
        self._chan = None
        try:
            sock.settimeout(self.dial_timeout)
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            # The controller closes its end once it has read the SHUTDOWN.
            while sock.recv(4096):
                pass
        except OSError as exc:
            log.warning("SHUTDOWN not delivered: %s", exc)
        finally:
            sock.close()

    # ------------------------------------------------------------ control socket

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

    def _watch(self, fd: int, events: int, handler: Callable[[int], None]) -> None:
        if fd in self._handlers:
            self._epoll.modify(fd, events)
        else:
            self._epoll.register(fd, events)
        self._handlers[fd] = handler

    def _unwatch(self, fd: int) -> None:
        """Take `fd` out of the epoll set before it is closed: closing alone leaves it in
        while another reference to the same file lives (a command started meanwhile holds
        one for a moment), and the set would go on reporting it."""
        if self._handlers.pop(fd, None) is not None:
            with contextlib.suppress(OSError):
                self._epoll.unregister(fd)

    # ------------------------------------------------------------ the job

    def _start_job(self, task_id: int, payload: bytes) -> None:
        self._job_id = task_id
        runner = self.runner
        if isinstance(runner, ExecRunner):
            self._start_command(runner, task_id, payload)
        elif isinstance(runner, HandlerRunner) and not runner.is_async:
            if self._thread_jobs is None:
                self._thread_jobs = queue.SimpleQueue()
                threading.Thread(
                    target=self._handler_thread, args=(runner, self._thread_jobs), daemon=True
                ).start()
            self._thread_jobs.put((task_id, payload))
        else:
            assert self._job_task is not None
            self._async_busy = True
            trio.lowlevel.reschedule(self._job_task, Value((task_id, payload)))

    def _start_command(self, runner: ExecRunner, task_id: int, payload: bytes) -> None:
        jail, limits = runner.jail, NO_LIMITS
        asked = self.session.limits
        if jail is None and asked.ListFields():
            jail = runner.plain_jail  # the job asked for limits of its own: they hold
        if jail is not None:
            jail.clean()  # what the last job left: its TMPDIR files, its orphans
            limits = jail.limits_for(from_proto(asked) if asked.ListFields() else NO_LIMITS)
        try:
            command = Command(
                self._epoll,
                runner.program,
                runner.argv,
                runner.env(task_id),
                payload,
                max_output=runner.max_output,
                stderr_keep=STDERR_TAIL,
                read_chunk=READ_CHUNK,
                on_stderr=self._sink.write if self._takes_output else None,
                jail=jail,
                limits=limits,
            )
        except OSError as exc:
            why = f"cannot run {runner.argv[0]}: {exc.strerror or exc}".encode()
            self._outcome = (False, why, None, "")
            return
        self._command = command
        self._watch_command(command, runner)

    def _watch_command(self, command: Command, runner: ExecRunner) -> None:
        """Keep the loop's handlers in step with the command's descriptors (each closed one
        is forgotten at once: its number may come back for something else)."""
        live = command.watched
        for fd in self._command_fds - live:
            self._handlers.pop(fd, None)
        for fd in live - self._command_fds:
            self._handlers[fd] = functools.partial(self._command_event, command, runner, fd)
        self._command_fds = live

    def _command_event(self, command: Command, runner: ExecRunner, fd: int, events: int) -> None:
        command.on_event(fd)
        if command.running:
            self._watch_command(command, runner)
            return
        done = command.reap()
        self._watch_command(command, runner)
        self._command = None
        try:
            result = command_outcome(runner.argv[0], done, runner.max_output)
            self._outcome = (True, result, done.usage, "")
        except TaskFailed as exc:
            self._outcome = (False, str(exc).encode(), done.usage, exc.reason)

    def _handler_thread(
        self, runner: HandlerRunner, jobs: queue.SimpleQueue[tuple[int, bytes] | None]
    ) -> None:
        """The plain handler's thread: one job after the other, each outcome handed to the
        loop through the wake-up pipe."""
        while (job := jobs.get()) is not None:
            task_id, payload = job
            SINK.set(self._sink if self._takes_output else None)  # its stderr and logging
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                result = runner.result(runner.func(payload))
                usage = handler_usage(wall, cpu, time.thread_time)
                outcome: Outcome = (True, result, usage, "")
            except Exception as exc:  # the handler's, or its result's: the job failed
                usage = handler_usage(wall, cpu, time.thread_time)
                outcome = (False, str(runner.failure(exc)).encode(), usage, "")
            self._hand_over(task_id, outcome)

    def _hand_over(self, task_id: int, outcome: Outcome, *, wake: bool = True) -> None:
        """A job's outcome for the loop; `wake`: through the wake-up pipe (from the handler
        thread, or a trio task while the loop waits in trio)."""
        if task_id == self._job_id:  # not a job abandoned since
            self._outcome = outcome
            if wake:
                with contextlib.suppress(BlockingIOError):
                    os.write(self._wake_w, b"j")

    async def _job_runner(self, *, task_status: trio.TaskStatus[None]) -> None:
        """The async jobs, one after the other, for the worker's life: one trio task parked
        between jobs rather than one spawned per job (a spawn costs more than a no-op job),
        and no cancel scope per job: a job is abandoned only when the worker leaves, and
        the nursery's end cancels it."""
        self._job_task = trio.lowlevel.current_task()
        task_status.started()
        while True:
            task_id, payload = await trio.lowlevel.wait_task_rescheduled(_parked_abort)
            SINK.set(self._sink if self._takes_output else None)  # its stderr and logging
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                result = await self.runner(task_id, payload)
                outcome: Outcome = (True, result, handler_usage(wall, cpu, time.process_time), "")
            except TaskFailed as exc:
                usage = handler_usage(wall, cpu, time.process_time)
                outcome = (False, str(exc).encode(), usage, exc.reason)
            except Exception as exc:  # a bug in a runner must not kill the worker
                SINK.set(None)  # the worker's own line, not the job's
                log.exception("task %d: runner crashed", task_id)
                why = f"worker error: {type(exc).__name__}: {exc}".encode()
                outcome = (False, why, None, "")
            self._async_busy = False
            # A job that ended in the turns the loop gave it is seen without a wake-up.
            self._hand_over(task_id, outcome, wake=self._in_trio)

    def _job_ended(self) -> None:
        outcome, self._outcome = self._outcome, None
        assert outcome is not None
        ok, result, usage, reason = outcome
        task_id, self._job_id = self._job_id, 0
        if not ok:
            log.info("task %d failed: %s", task_id, result.decode("utf-8", "replace"))
        if self._output_due or self._sending_output:  # its last output goes first
            self._ending = (task_id, outcome)
            if not self._sending_output:
                self._output_at = 0.0
            return
        self.session.finished(task_id, ok, result, usage, reason)
        self._fetch_me()

    def _abandon_job(self) -> None:
        """Stop the running job (RESTART, the drain's deadline, a second signal: the worker
        leaves, and a handler's trio task ends with the nursery)."""
        self._job_id = 0
        self._outcome = None
        self._ending = None
        self._sink.clear()
        if self._command is not None:
            self._command.kill()
            for fd in self._command_fds:
                self._handlers.pop(fd, None)
            self._command_fds = set()
            self._command = None

"""The worker's trio shell: registration, pulses, the control socket, the running task.

The same local worker as worker/lean.py, as a trio task for a program that runs one
inside its own trio loop (the tests, an embedding); the `worker` command runs
worker/lean.py's blocking loop, which makes fewer system calls and trio turns a job.

Life of a worker: REGISTER on main.sock (retrying with capped backoff while
the controller is away), listen on `<worker_id>.sock`, pulse OK at once and
then every period, answer control messages one per connection, run at most
one task at a time beside all that, and send FETCH_ME the moment it ends. An
UNKNOWN_ID answer means the controller forgot us (it restarted, or declared
us dead): register again under a new id, keeping the task and its result.
RESTART stops the task and exits 75; SIGTERM/SIGINT drains, sends SHUTDOWN
and exits 0; a second signal exits at once.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import math
import os
import random
import select
import signal
import socket
from pathlib import Path

import trio

from controller import wire
from controller.declared import DEFAULT as DECLARED_DEFAULT
from controller.declared import Declared
from controller.reactor import Reactor
from controller.transport import Incoming, Outgoing, Result, accept_unix, exchange, listen_unix
from gen import worker_protocol_pb2 as pb
from worker.core import Effect, Phase, WorkerSession
from worker.limits import peer_uid
from worker.output import BATCH_SECONDS, CHUNK, SINK, OutputSink
from worker.parent import PARENT_DEATH_SIGNAL, parent_alive
from worker.runner import Runner, TaskFailed

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


class WorkerShell:
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
    ) -> None:
        self.socket_dir = socket_dir
        self.parent_pid = parent_pid
        self.runner = runner
        self.pulse_period = pulse_period
        self.next_pulse = promised_next_pulse(pulse_period)
        self.drain_timeout = drain_timeout
        self.dial_timeout = dial_timeout
        self.max_extra_size = max_extra_size
        self.session = WorkerSession(declared)
        self.exit_code = 0
        self.registrations = 0
        self._pulse_now = trio.Event()
        self._task_scope: trio.CancelScope | None = None
        self._top: trio.Nursery | None = None
        self._drain_deadline = math.inf
        self._controller_ok = True
        self._reactor = Reactor()
        self._main_socket = str(socket_dir / "main.sock")
        self._controller_uid = -1  # main.sock's owner, known once registered
        self._next_task: collections.deque[tuple[int, bytes]] = collections.deque()
        self._task_arrived = trio.lowlevel.ParkingLot()
        # Job output, for a controller that takes it (its REGISTER answer says so): sent in
        # PULSE_OUTPUTs at most every BATCH_SECONDS, and all of it before the job's outcome.
        self.takes_output = False
        self._sink = OutputSink(self._output_arrived)
        self._output_wake = trio.Event()
        self._output_lock = trio.Lock()
        self._token: trio.lowlevel.TrioToken | None = None

    # ------------------------------------------------------------ lifecycle

    async def run(self, *, handle_signals: bool = True) -> int:
        """Run until SHUTDOWN or RESTART; returns the exit status."""
        async with trio.open_nursery() as nursery:
            self._top = nursery
            self._token = trio.lowlevel.current_trio_token()
            await nursery.start(self._reactor.run)
            nursery.start_soon(self._tasks)
            nursery.start_soon(self._output_loop)
            if handle_signals:
                nursery.start_soon(self._signals)
            if self.parent_pid is not None:
                nursery.start_soon(self._watch_parent, self.parent_pid)
            await self._sessions()
            nursery.cancel_scope.cancel()
        return self.exit_code

    def drain(self) -> None:
        """Stop taking tasks; finish and hand over the current one, then leave."""
        if not self.session.draining:
            log.info("draining: finishing the current task, then shutting down")
            self.session.draining = True
            self._drain_deadline = trio.current_time() + self.drain_timeout
            self._pulse_now.set()

    def _stop(self, code: int) -> None:
        self.exit_code = code
        if self._task_scope is not None:
            self._task_scope.cancel()
        assert self._top is not None
        self._top.cancel_scope.cancel()

    async def _signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                if self.session.draining:
                    log.warning("second %s: exiting now", signal.Signals(signum).name)
                    self._stop(128 + signum)
                    return
                self.drain()

    async def _watch_parent(self, pid: int) -> None:
        """A supervised worker leaves with its supervisor, even one killed with SIGKILL."""
        with trio.open_signal_receiver(PARENT_DEATH_SIGNAL) as signals:
            # It may have ended before the receiver was there (the signal then came and went).
            if parent_alive(pid):
                async for _ in signals:
                    if not parent_alive(pid):
                        break
                    log.debug("a thread of the parent ended; the parent lives on")
            log.warning("parent process %d ended", pid)
            self.drain()
            # Held while draining: a late signal (another of its threads ending) changes nothing.
            async for _ in signals:
                pass

    async def _sessions(self) -> None:
        while True:
            wid = await self._register()
            if wid is None:
                return
            self.session.worker_id = wid
            path = self.socket_dir / f"{wid}.sock"
            path.unlink(missing_ok=True)
            listener = listen_unix(path, CONTROL_BACKLOG, 0o660)
            self._reactor.watch(listener, select.EPOLLIN, functools.partial(self._accept, listener))
            try:
                again = await self._pulse_loop()
            finally:
                self._reactor.unwatch(listener)
                listener.close()
                path.unlink(missing_ok=True)
            if not again:
                return

    # ------------------------------------------------------------ main.sock

    async def _send_pulse(self, pulse: pb.WorkerPulse) -> pb.PulseResponse | None:
        """One exchange on main.sock; None when the controller could not be reached."""
        try:
            resp, _ = await exchange(
                self._reactor,
                self._main_socket,
                wire.encode_frame(pulse),
                pb.PulseResponse,
                timeout=self.dial_timeout,
            )
        except (OSError, wire.RemoteProtocolError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            self._reachable(False, reason)
            return None
        self._reachable(True, "")
        return resp

    def _reachable(self, ok: bool, reason: str) -> None:
        # One log line per change, not one per failed pulse.
        if ok and not self._controller_ok:
            log.info("controller reachable again")
        elif not ok and self._controller_ok:
            log.warning("controller unreachable on %s: %s", self.socket_dir / "main.sock", reason)
        self._controller_ok = ok

    async def _register(self) -> int | None:
        delay = REGISTER_BACKOFF_START
        while not self.session.draining:
            resp = await self._send_pulse(self.session.register(self.next_pulse))
            if resp is not None and resp.error == pb.CTRL_ERR_OK and resp.HasField("worker_id"):
                self.registrations += 1
                self.takes_output = resp.takes_output
                log.info("registered as worker %d", resp.worker_id)
                # The controller is main.sock's owner: the one uid the control socket answers.
                try:
                    self._controller_uid = os.stat(self._main_socket).st_uid
                except OSError:
                    self._controller_uid = 0
                return resp.worker_id
            if resp is not None:
                log.warning(
                    "registration refused (%s); retrying in %.2g s",
                    pb.ControllerError.Name(resp.error)
                    if resp.error in pb.ControllerError.values()
                    else resp.error,
                    delay,
                )
            # Jitter: workers started together (a restart of all units) do not retry in step.
            with trio.move_on_after(
                delay * random.uniform(1 - REGISTER_JITTER, 1 + REGISTER_JITTER)
            ):
                await self._pulse_now.wait()
            self._pulse_now = trio.Event()
            delay = min(delay * 2, REGISTER_BACKOFF_MAX)
        return None

    async def _pulse_loop(self) -> bool:
        """Pulse until the controller forgets us (True: register again) or we leave (False)."""
        session = self.session
        next_at = trio.current_time()  # the first OK goes out as soon as the socket listens
        while True:
            if session.draining and (
                session.phase is Phase.IDLE or trio.current_time() >= self._drain_deadline
            ):
                await self._shutdown()
                return False
            with trio.move_on_at(min(next_at, self._drain_deadline)):
                await self._pulse_now.wait()
            self._pulse_now = trio.Event()
            if session.draining and trio.current_time() >= self._drain_deadline:
                continue
            resp = await self._send_pulse(session.pulse(self.next_pulse))
            next_at = trio.current_time() + self.pulse_period
            if resp is None:
                continue
            if resp.error == pb.CTRL_ERR_UNKNOWN_ID:
                log.warning(
                    "controller does not know worker %d; registering again (keeping task %d)",
                    session.worker_id,
                    session.task_id,
                )
                return True
            if resp.error != pb.CTRL_ERR_OK:
                log.warning("pulse answered with error %d", resp.error)

    async def _shutdown(self) -> None:
        session = self.session
        if session.phase is Phase.RUNNING:
            log.warning("drain timeout: abandoning task %d", session.task_id)
            if self._task_scope is not None:
                self._task_scope.cancel()
        await self._send_pulse(pb.WorkerPulse(type=pb.PULSE_SHUTDOWN, worker_id=session.worker_id))
        log.info("worker %d shut down", session.worker_id)

    # ------------------------------------------------------------ control socket

    def _accept(self, listener: socket.socket, events: int) -> None:
        # One per readiness event: the controller dials a worker one connection at a time,
        # so a second accept would almost always fail with EAGAIN; the epoll set is
        # level-triggered, so one more waiting is served in the next round.
        try:
            conn = accept_unix(listener)
        except BlockingIOError:
            return
        uid = peer_uid(conn)
        if uid != self._controller_uid:  # only the controller may ask anything of us
            conn.close()
            log.warning("control socket: refused a connection from uid %d", uid)
            return
        Incoming(
            self._reactor,
            conn,
            pb.ControlMsg,
            self._on_control,
            self._on_bad_control,
            timeout=self.dial_timeout,
            max_extra_size=self.max_extra_size,
        )

    def _on_bad_control(self, conn: Incoming[pb.ControlMsg], exc: wire.RemoteProtocolError) -> None:
        log.warning("control socket: bad message: %s", exc)
        if exc.can_reply:
            response = pb.WorkerResponse(error=pb.WORKER_ERR_FAILED, task_id=self.session.task_id)
            conn.reply(wire.encode_frame(response, str(exc).encode()[:1024]))

    def _on_control(self, conn: Incoming[pb.ControlMsg], msg: pb.ControlMsg, extra: bytes) -> None:
        answer = self.session.on_control(msg, extra)
        effect = answer.effect
        data = wire.encode_frame(answer.response, answer.extra)
        if effect is Effect.START:
            conn.reply(data)  # first: the controller is waiting, and the task can start after
            self._next_task.append((msg.task_id, extra))
            self._task_arrived.unpark()
            return
        if effect is Effect.RESTART:
            log.warning("controller sent RESTART: stopping and exiting %d", EXIT_RESTART)
            if self._task_scope is not None:
                self._task_scope.cancel()
            conn.reply(data)
            self._stop(EXIT_RESTART)
            return
        elif effect is Effect.FETCHED:
            conn.reply(data, functools.partial(self._fetched, answer.response.task_id))
            return
        conn.reply(data)

    def _fetched(self, task_id: int) -> None:
        """The outcome went out whole: back to idle."""
        self.session.fetched(task_id)
        if self.session.draining:
            self._pulse_now.set()

    # ------------------------------------------------------------ the task

    def _fetch_me(self) -> None:
        """Say FETCH_ME now, not at the next period (the periodic pulse repeats it if lost)."""
        session = self.session
        if session.draining or not session.has_outcome:
            self._pulse_now.set()  # the pulse loop also decides when to leave
            return
        Outgoing(
            self._reactor,
            self._main_socket,
            wire.encode_frame(session.pulse(self.next_pulse)),
            pb.PulseResponse,
            self._fetch_me_answered,
            timeout=self.dial_timeout,
        )

    def _fetch_me_answered(self, result: Result[pb.PulseResponse]) -> None:
        if not isinstance(result, tuple) or result[0].error != pb.CTRL_ERR_OK:
            self._pulse_now.set()  # the pulse loop retries, logs, or registers again

    # ------------------------------------------------------------ job output

    def _output_arrived(self) -> None:
        """The sink's hook, from any thread (a plain handler runs in one)."""
        if self._token is not None:
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(self._output_wake.set)

    async def _output_loop(self) -> None:
        while True:
            await self._output_wake.wait()
            self._output_wake = trio.Event()
            # The sink wakes this loop only when bytes come where there were none (or a chunk
            # fills): whatever is left after a send goes after the next batch's wait.
            while len(self._sink):
                if len(self._sink) < CHUNK:
                    await trio.sleep(BATCH_SECONDS)
                await self._send_output(everything=False)

    async def _send_output(self, *, everything: bool) -> None:
        """Send what waits in PULSE_OUTPUTs of at most CHUNK bytes (`everything`: until none
        waits; else a chunk at a time while whole chunks wait)."""
        async with self._output_lock:
            session = self.session
            while len(self._sink):
                if not (self.takes_output and session.worker_id and session.task_id):
                    self._sink.clear()
                    return
                pulse = pb.WorkerPulse(
                    type=pb.PULSE_OUTPUT, worker_id=session.worker_id, task_id=session.task_id
                )
                try:
                    await exchange(
                        self._reactor,
                        self._main_socket,
                        wire.encode_frame(pulse, self._sink.take(CHUNK)),
                        pb.PulseResponse,
                        timeout=self.dial_timeout,
                    )
                except (OSError, wire.RemoteProtocolError):
                    self._sink.clear()  # the controller is away: this output is lost
                    return
                if not everything and len(self._sink) < CHUNK:
                    return  # the rest after the next batch's wait

    async def _tasks(self) -> None:
        """Run the tasks SET_TASK hands over, one after the other, for the worker's life: one
        trio task waiting, not one spawned per task (a spawn and its exit cost ~5 us of
        the worker's CPU per job)."""
        while True:
            while not self._next_task:
                await self._task_arrived.park()
            await self._run_task(*self._next_task.popleft())

    async def _run_task(self, task_id: int, payload: bytes) -> None:
        with trio.CancelScope() as scope:
            self._task_scope = scope
            SINK.set(self._sink if self.takes_output else None)  # its stderr and logging
            reason = ""
            try:
                result = await self.runner(task_id, payload)
                ok = True
            except TaskFailed as exc:
                result, ok, reason = str(exc).encode(), False, exc.reason
                SINK.set(None)  # the worker's own line, not the job's
                log.info("task %d failed: %s", task_id, exc)
            except Exception as exc:  # a bug in a runner must not kill the worker
                SINK.set(None)
                log.exception("task %d: runner crashed", task_id)
                result, ok = f"worker error: {type(exc).__name__}: {exc}".encode(), False
            SINK.set(None)
            if len(self._sink):
                await self._send_output(everything=True)  # all its output before its outcome
            self.session.finished(task_id, ok, result, reason=reason)
            self._fetch_me()
        if self._task_scope is scope:
            self._task_scope = None

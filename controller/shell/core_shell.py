"""The core's trio shell: the pure `Core` against main.sock, the worker sockets and the clock.

It accepts pulses on main.sock (bound by main_socket.py, and bound again when its
file is removed or replaced), reaches the workers through their sockets and
channels (worker_links.py), sleeps until the core's next deadline, watches worker
pids, and hands each event to the core with `now=trio.current_time()`. Whatever
the core returns is carried out by `execute`; what it says of jobs and remote workers
leaves through the outlets the assembly connects once (`connect`, controller/app.py):
the job desk, the doors, or a test.
"""

from __future__ import annotations

import _socket
import contextlib
import functools
import logging
import os
import select
import socket
from collections.abc import Callable
from pathlib import Path

import trio

from controller import wire
from controller.config import Config
from controller.containment import contained
from controller.core import (
    Action,
    Core,
    Dial,
    HandOut,
    PerformTask,
    PulseReceived,
    Reply,
    TaskFinished,
    TaskProgress,
    WatchPid,
    WorkerExited,
)
from controller.core.model import Task
from controller.options import JobOptions
from controller.reactor import Reactor
from controller.shell.descriptors import ACCEPT_PAUSE, Throttled, one_connection
from controller.shell.durability import WriteAhead
from controller.shell.main_socket import (
    LISTEN_BACKLOG,
    bind_main_socket,
    file_identity,
    prepare_socket_dir,
)
from controller.shell.metrics import Metrics
from controller.shell.timer import DeadlineTimer
from controller.shell.worker_links import FAILED, WorkerLinks
from controller.transport import (
    Incoming,
    accept_unix,
    listen_unix,
    peer_credentials,
)
from controller.usage import Usage
from gen import worker_protocol_pb2 as pb

log = logging.getLogger("controller")

# How often the path of main.sock is looked at: one removed or replaced is bound again
# within this (DESIGN.md section 15 asks within a second).
MAIN_SOCKET_CHECK = 0.25
# How long a worker waits for an answer on main.sock by default (worker --dial-timeout).
WORKER_DIAL_TIMEOUT = 2.0


class CoreShell:
    """Runs a `Core` against real sockets and the trio clock."""

    def __init__(
        self,
        config: Config,
        core: Core | None = None,
        write_ahead: WriteAhead | None = None,
        metrics: Metrics | None = None,
        busy_poll: float | None = 0.0,
    ) -> None:
        self.config = config
        self.write_ahead = write_ahead or WriteAhead(None)
        self.metrics = metrics
        self.core = core or Core(
            max_retries=config.max_retries,
            timeout_task_placement=config.timeout_task_placement,
            task_timeout=config.task_timeout,
            retry_delay=config.retry_delay,
            claim_timeout=config.claim_timeout,
            lease_timeout=config.lease_timeout,
            calculator_timeout=config.calculator_timeout,
            forget_remote_after=config.result_retention,
        )
        # The core's outlets, connected once by the assembly (controller/app.py, `connect`).
        self.on_finished: Callable[[TaskFinished], None] = lambda finished: None
        self.on_progress: Callable[[TaskProgress], None] | None = None
        self.on_output: Callable[[int, object, bytes], None] | None = None
        # A local worker's progress report: task ref, task job, progress, status (unchecked).
        self.on_reported: Callable[[int, object, float, str], None] | None = None
        self.on_usage: Callable[[int, object, Usage], None] | None = None
        self.on_perform: Callable[[PerformTask], None] | None = None
        self.on_hand_out: Callable[[HandOut], None] | None = None
        self.on_room: Callable[[], None] | None = None
        self.refused_peers = 0
        self._nursery: trio.Nursery | None = None
        self.reactor = Reactor(busy_poll=busy_poll)
        self._timer = DeadlineTimer(self.core.next_deadline, self._expire)
        self._watched: dict[int, set[int]] = {}
        self._own_uid = os.getuid()
        self._dir_gid = -1
        self._sock: socket.socket | None = None
        self._sock_identity: tuple[int, int] | None = None  # main.sock's (device, inode)
        self.rebinds = 0  # times main.sock was found removed or replaced and bound again
        self._accept_failed = Throttled(log, "main.sock: cannot accept a connection")
        self.links = WorkerLinks(self)

    def connect(
        self,
        *,
        finished: Callable[[TaskFinished], None],
        progress: Callable[[TaskProgress], None] | None = None,
        output: Callable[[int, object, bytes], None] | None = None,
        usage: Callable[[int, object, Usage], None] | None = None,
        perform: Callable[[PerformTask], None] | None = None,
        hand_out: Callable[[HandOut], None] | None = None,
        room: Callable[[], None] | None = None,
    ) -> None:
        """Where the core's actions go: a task that ended (`finished`), started, went back to
        the queue or waits for its time (`progress`); a local worker's job output
        (`output`: task ref, task job, bytes) and what an attempt used, just before its
        outcome (`usage`); a job for a calculator (`perform`: the UDP door sends perform_task)
        or a poller (`hand_out`: the HTTP door answers its waiting /ping/); and, after every
        batch of actions, a door that reads only what it can start soon (`room`: Redis)."""
        self.on_finished = finished
        self.on_progress = progress
        self.on_output = output
        self.on_usage = usage
        self.on_perform = perform
        self.on_hand_out = hand_out
        self.on_room = room

    # ------------------------------------------------------------ running

    async def bind(self) -> None:
        """Check the socket directory and listen on main.sock; StartupError if that fails.

        Call it before opening the nursery that runs `serve`, so that a start-up
        error reaches the caller as itself, not inside an exception group.
        """
        if self._sock is None:
            self._dir_gid = prepare_socket_dir(self.config.socket_dir).st_gid
            path = self.config.main_socket
            self._sock = bind_main_socket(path, self.config.dial_timeout)
            self._sock_identity = file_identity(path)

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve main.sock until cancelled; `started()` once it accepts connections."""
        cfg = self.config
        await self.bind()
        sock = self._sock
        assert sock is not None
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._timer.run)
                await nursery.start(self.reactor.run)
                self.reactor.watch(sock, select.EPOLLIN, self._accept, listener=True)
                log.info("listening for workers on %s", cfg.main_socket)
                nursery.start_soon(self._guard_main_socket)
                task_status.started()
        finally:
            sock = self._sock or sock
            self.reactor.unwatch(sock)
            sock.close()
            self._sock = None
            # Only our own file: one another process put there since is not ours to remove.
            if file_identity(cfg.main_socket) == self._sock_identity:
                with contextlib.suppress(OSError):
                    cfg.main_socket.unlink()

    async def _guard_main_socket(self) -> None:
        """Look at main.sock's path every MAIN_SOCKET_CHECK seconds: removed, or replaced by
        another file, it is bound again (workers' next pulses reach the controller again)."""
        path = self.config.main_socket
        while True:
            await trio.sleep(MAIN_SOCKET_CHECK)
            if self._sock is not None and file_identity(path) != self._sock_identity:
                self._rebind_main_socket(path)
            self.links.close_forgotten_channels()

    def _rebind_main_socket(self, path: Path) -> None:
        found = "removed" if not os.path.lexists(path) else "replaced by another file"
        old = self._sock
        try:
            path.unlink(missing_ok=True)
            sock = listen_unix(path, LISTEN_BACKLOG, 0o660)
        except OSError as exc:  # looked at again at the next check
            log.error("%s was %s and cannot be bound again: %s", path, found, exc.strerror)
            return
        self.rebinds += 1
        log.error("%s was %s while the controller ran; bound again", path, found)
        if old is not None:
            self.reactor.unwatch(old)
            old.close()
        self._sock = sock
        self._sock_identity = file_identity(path)
        self.reactor.watch(sock, select.EPOLLIN, self._accept, listener=True)
        self._excuse_swallowed_pulses(trio.current_time())

    def _excuse_swallowed_pulses(self, now: float) -> None:
        """A pulse sent to whatever stood in main.sock's place waits there for its worker's
        dial timeout before the worker tries again: each local worker's deadline gets that
        long once more, so that none is dropped for a pulse that could not arrive."""
        grace = max(self.config.dial_timeout, WORKER_DIAL_TIMEOUT)
        local = self.core.local
        for worker in self.core.workers.values():
            if worker.kind is local:
                promise = max(worker.deadline - worker.last_pulse, 1.0)
                worker.deadline = max(worker.deadline, now + promise + grace)

    def submit(
        self, task_id: int, payload: bytes, job: object = None, options: JobOptions | None = None
    ) -> Task:
        """The internal API: queue a task now; returns its record. Must run inside `serve`."""
        task, actions = self.queue(task_id, payload, job, options)
        self.execute(actions)
        return task

    def queue(
        self,
        task_id: int,
        payload: bytes,
        job: object,
        options: JobOptions | None = None,
        wait: float = 0.0,
        now: float | None = None,
        dispatch: bool = True,
    ) -> tuple[Task, list[Action]]:
        """Queue a task (scheduled `wait` seconds ahead when > 0); the caller records it, then
        carries out the actions (`execute`). `now`: the trio clock the caller read (its job's
        times and the task's are then one float, not one each: 100,000 queued jobs, 3 MB).
        Without `dispatch` it waits for the caller's `dispatch`, or any other event's."""
        if now is None:
            now = trio.current_time()
        return self.core.submit(task_id, payload, job, now, options, wait, dispatch)

    def dispatch(self) -> None:
        """Hand pending tasks to the workers free to take them, now."""
        self.execute(self.core.dispatch(trio.current_time()))

    def execute(self, actions: list[Action]) -> None:
        """Carry out what the core asked for."""
        assert self._nursery is not None, "execute() before serve() started"
        # Dials first: a worker waiting for its next task is the scarce resource, and
        # a finished task's notification can go out a few microseconds later.
        for action in actions:
            if isinstance(action, Dial):
                self.links.dial(action)
        for action in actions:
            if isinstance(action, Dial):
                continue
            if isinstance(action, TaskFinished):
                if self.metrics is not None:
                    self.metrics.task_finished(action)
                self.on_finished(action)
            elif isinstance(action, WatchPid):
                self._watch(action)
            elif isinstance(action, TaskProgress):
                if self.metrics is not None:
                    self.metrics.task_started(action)
                if self.on_progress is not None:
                    self.on_progress(action)
            elif isinstance(action, HandOut):
                if self.on_hand_out is not None:
                    self.on_hand_out(action)
                else:  # no HTTP door: nobody to hand it to
                    self.execute(self.core.pollers.undeliverable(action.name, trio.current_time()))
            elif isinstance(action, PerformTask):
                if self.on_perform is not None:
                    self.on_perform(action)
            elif isinstance(action, Reply):
                raise AssertionError("a Reply outside a pulse exchange")
        self.links.taken_done()
        self._timer.poke()
        if self.on_room is not None:
            self.on_room()

    # ------------------------------------------------------------ main.sock

    def _allowed(self, uid: int, gid: int) -> bool:
        return uid == self._own_uid or uid in self.config.allowed_uids or gid == self._dir_gid

    def _accept(self, events: int) -> None:
        sock = self._sock
        assert sock is not None
        while True:
            try:
                conn = accept_unix(sock)
            except BlockingIOError:
                return
            except OSError as exc:
                if one_connection(exc):  # that peer's trouble (ECONNABORTED...)
                    continue
                # Out of descriptors (or worse): the pulses wait in the backlog; look again
                # after a pause.
                now = trio.current_time()
                self._accept_failed(exc.strerror or exc, now)
                self.reactor.unwatch(sock)
                self.reactor.call_at(now + ACCEPT_PAUSE, self._resume_accept)
                return
            try:
                self._serve_pulse(conn)
            except Exception as exc:  # that worker's connection alone is closed
                contained("a worker's connection on main.sock", exc, trio.current_time())
                self.reactor.forget(conn)
                conn.close()

    def _resume_accept(self, now: float) -> None:
        if self._sock is not None:
            self.reactor.watch(self._sock, select.EPOLLIN, self._accept)

    def _serve_pulse(self, conn: _socket.socket) -> None:
        cfg = self.config
        pid, uid, gid = peer_credentials(conn)
        if not self._allowed(uid, gid):
            self.refused_peers += 1
            log.warning("main.sock: refused a connection from uid %d (pid %d)", uid, pid)
            # Read its pulse first, so that it gets the answer rather than a broken pipe.
            Incoming(
                self.reactor,
                conn,
                pb.WorkerPulse,
                lambda c, pulse, extra: c.reply(FAILED),
                lambda c, exc: c.reply(FAILED) if exc.can_reply else None,
                timeout=cfg.dial_timeout,
                max_extra_size=wire.MAX_PULSE_EXTRA,
            )
            return
        Incoming(
            self.reactor,
            conn,
            pb.WorkerPulse,
            functools.partial(self._on_pulse, pid, uid),
            functools.partial(self._on_bad_pulse, pid),
            timeout=cfg.dial_timeout,
            max_extra_size=wire.MAX_PULSE_EXTRA,
        )

    def _on_pulse(
        self,
        pid: int,
        uid: int,
        conn: Incoming[pb.WorkerPulse],
        pulse: pb.WorkerPulse,
        extra: bytes,
    ) -> None:
        try:
            if pulse.type == pb.PULSE_OUTPUT or pulse.type == pb.PULSE_PROGRESS:
                self._output(uid, conn, pulse, extra)
                return
            if pulse.channel and pulse.type != pb.PULSE_REGISTER:
                self.links.open_channel(pid, uid, conn, pulse)
                return
            self._pulse(pid, uid, conn, pulse)
        except Exception as exc:  # that worker's connection alone is closed
            contained("a worker's pulse", exc, trio.current_time(), f"pid {pid}")
            conn.close()

    def _pulse(
        self, pid: int, uid: int, conn: Incoming[pb.WorkerPulse], pulse: pb.WorkerPulse
    ) -> None:
        actions = self.core.pulse(PulseReceived(pulse, pid or None, uid), trio.current_time())
        reply = actions[0]
        assert isinstance(reply, Reply)
        # Dials first: a FETCH is on its way before the FETCH_ME answer wakes the worker.
        self.execute(actions[1:])
        response = reply.response
        if pulse.type == pb.PULSE_REGISTER and response.HasField("worker_id"):
            self.write_ahead.new_worker_id(
                response.worker_id,
                self.core.next_worker_id,
                conn.reply,
                wire.encode_frame(response),
            )
            return
        conn.reply(wire.encode_frame(response))

    def _output(
        self, uid: int, conn: Incoming[pb.WorkerPulse], pulse: pb.WorkerPulse, extra: bytes
    ) -> None:
        """What a local worker's job wrote to stderr, or its progress: kept with the job it
        holds."""
        reply, task = self.core.local.output(PulseReceived(pulse, None, uid))
        if task is None:
            pass
        elif pulse.type == pb.PULSE_PROGRESS:
            if self.on_reported is not None:
                self.on_reported(task.ref, task.job, pulse.progress, pulse.status)
        elif extra and self.on_output is not None:
            self.on_output(task.ref, task.job, extra)
        conn.reply(wire.encode_frame(reply.response))

    def _on_bad_pulse(
        self, pid: int, conn: Incoming[pb.WorkerPulse], exc: wire.RemoteProtocolError
    ) -> None:
        log.warning("main.sock: bad pulse from pid %d: %s", pid, exc)
        if exc.can_reply:
            conn.reply(FAILED)

    def attempt_used(self, ref: int, job: object, usage: Usage) -> None:
        """What the running attempt of task `ref` used, from a worker of any kind, before its
        outcome: counted in the metrics and kept with the attempt."""
        if self.metrics is not None:
            self.metrics.attempt_used(usage)
        if self.on_usage is not None:
            self.on_usage(ref, job, usage)

    # ------------------------------------------------------------ deadlines

    def lag(self) -> float:
        """How far the scheduler is behind its earliest deadline (0 when on time)."""
        return max(0.0, trio.current_time() - self.core.next_deadline())

    def _expire(self, now: float) -> None:
        self.execute(self.core.expire(now))

    # ------------------------------------------------------------ pids

    def _watch(self, action: WatchPid) -> None:
        wids = self._watched.get(action.pid)
        if wids is not None:
            wids.add(action.worker_id)
            return
        try:
            fd = os.pidfd_open(action.pid)
        except OSError as exc:
            log.debug("cannot watch pid %d: %s", action.pid, exc)
            return
        self._watched[action.pid] = {action.worker_id}
        assert self._nursery is not None
        self._nursery.start_soon(self._wait_pid, action.pid, fd)

    async def _wait_pid(self, pid: int, fd: int) -> None:
        try:
            await trio.lowlevel.wait_readable(fd)
        finally:
            os.close(fd)
        now = trio.current_time()
        wids = sorted(w for w in self._watched.pop(pid, ()) if w in self.core.workers)
        if wids:
            shown = ", ".join(map(str, wids[:5])) + (
                f" and {len(wids) - 5} more" if len(wids) > 5 else ""
            )
            log.warning("pid %d exited: dropping worker %s", pid, shown)
        for wid in wids:
            try:
                self.execute(self.core.exited(WorkerExited(wid), now))
            except Exception as exc:  # the others are still dropped
                contained("a worker's exit", exc, now, f"worker {wid}")

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

Where each part lives: worker/local/base.py holds the epoll set, the signals,
the parent, the drain and registering again; worker/local/job.py the running
job and its output, which goes out before the job's outcome;
worker/local/seed.py the seed's exchange (dials on main.sock, the control
socket); worker/local/channel.py the channel. This module holds the loop, its
timers, registration, the pulses and the SHUTDOWN.
"""

from __future__ import annotations

import logging
import math
import os
import random
import select
import signal
import time
from pathlib import Path
from typing import Any

import trio

from controller import wire
from controller.declared import DEFAULT as DECLARED_DEFAULT
from controller.declared import Declared
from gen import worker_protocol_pb2 as pb
from worker.core import Phase
from worker.local.base import Settings
from worker.local.channel import ChannelLink
from worker.local.seed import SeedExchange
from worker.output import BATCH_SECONDS, CHUNK
from worker.progress import SEND_SECONDS
from worker.runner import ExecRunner, HandlerRunner, Runner

log = logging.getLogger("worker")

_IN = select.EPOLLIN

# Registration retry backoff: quick at first (the controller may be starting), capped
# so that a worker waiting for a long-gone controller still notices it within seconds.
REGISTER_BACKOFF_START = 0.05
REGISTER_BACKOFF_MAX = 5.0
# Each wait is drawn from delay x (1 +- this), so that a crowd of workers spreads out.
REGISTER_JITTER = 0.5
_CHANNEL_OK = pb.PulseResponse(error=pb.CTRL_ERR_OK)


class LocalWorker(ChannelLink, SeedExchange):
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
        next_task: bool = True,
    ) -> None:
        """`channel`: ask for a channel at REGISTER (False: the seed's exchange);
        `next_task`: on it, take a next task while one runs."""
        super().__init__(
            Settings(
                socket_dir,
                runner,
                pulse_period,
                drain_timeout,
                dial_timeout,
                max_extra_size,
                parent_pid,
                declared,
                channel,
                next_task,
            )
        )
        # Registration: the backoff, and whether an attempt is on its way; pulses: whether
        # one (periodic or FETCH_ME) is on its way.
        self._backoff = REGISTER_BACKOFF_START
        self._registering = False
        self._pulsing = False

    async def run(self) -> int:
        """Run until SHUTDOWN or RESTART (or a second signal); the exit status."""
        self._watch(self._wake_r, _IN, self._on_wake)
        previous: dict[signal.Signals, Any] = {}
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
        if self._progress_due and not self._sending_progress and now >= self._progress_next:
            self._send_progress(now)
        stall = self._chan_check_stall(now)
        if self._dials or self._conns:
            for dial in list(self._dials.values()):
                if dial.connect_at and now >= dial.connect_at:
                    self._connect(dial, now)
                elif now >= dial.deadline:
                    self._dial_done(dial, None, f"no answer within {self.dial_timeout:g} s")
            for conn in list(self._conns.values()):
                if now >= conn.deadline:
                    self._close_conn(conn)
        wake = stall
        if session.worker_id == 0:
            if not self._registering:
                wake = min(wake, self._register_at)
        elif not self._pulsing:
            wake = min(wake, self._pulse_at)
        if session.draining:
            wake = min(wake, self._drain_deadline)
        if self._output_due and not self._sending_output:
            wake = min(wake, self._output_at)
        if self._progress_due and not self._sending_progress:
            wake = min(wake, self._progress_next)
        for dial in self._dials.values():  # those on their way, backlog retries included
            wake = min(wake, dial.connect_at or dial.deadline)
        for conn in self._conns.values():
            wake = min(wake, conn.deadline)
        return -1 if wake == math.inf else max(0.0, wake - now)

    def _register(self, now: float) -> None:
        self._registering = True
        msg = self.session.register(self.next_pulse)
        msg.channel = self.ask_channel
        msg.takes_next = self.ask_channel and self.ask_next
        self._dial(msg, self._registered)

    def _registered(self, resp: pb.PulseResponse | None, why: str) -> None:
        self._registering = False
        if resp is not None and resp.error == pb.CTRL_ERR_OK and resp.HasField("worker_id"):
            log.info("registered as worker %d", resp.worker_id)
            self._takes_output = resp.takes_output
            self._takes_progress = resp.takes_progress
            if self.ask_channel and resp.channel:
                self.session.takes_next = resp.takes_next
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
            self._register_again()
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

    def _send_progress(self, now: float, task_id: int = 0) -> None:
        """One PULSE_PROGRESS with the latest value the job reported (none: nothing)."""
        self._progress_due = False  # cleared before looking: a report from now on sets it again
        value = self._reporter.take()
        session = self.session
        task_id = task_id or session.task_id
        if value is None or session.worker_id == 0 or not self._takes_progress or not task_id:
            return
        self._progress_next = now + SEND_SECONDS
        pulse = pb.WorkerPulse(
            type=pb.PULSE_PROGRESS,
            worker_id=session.worker_id,
            task_id=task_id,
            progress=value[0],
            status=value[1],
        )
        if self._chan is not None:  # no answer on the channel
            self._chan_send(wire.encode_channel(wire.CHANNEL_PULSE, pulse))
            return
        self._sending_progress = True
        self._dial(pulse, self._progress_sent)

    def _shutdown(self) -> None:
        """The drain's end (its job handed over, or its deadline passed): SHUTDOWN to the
        controller, on whichever side the worker speaks, and leave the loop."""
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
        self._seed_shutdown()
        log.info("worker %d shut down", session.worker_id)

"""The job a local worker runs, one at a time: an `--exec` command watched in the epoll set
(worker/spawn.py's `Command`), a plain `--handler` in the worker's one handler thread, or an
async runner in one trio task parked between jobs; and its output (what the job writes to
stderr), which goes to the controller before the job's outcome does."""

from __future__ import annotations

import abc
import contextlib
import functools
import logging
import math
import os
import queue
import resource
import threading
import time
from collections.abc import Callable
from typing import Any

import trio
from outcome import Value

from controller.joblimits import NO_LIMITS, from_proto
from gen import worker_protocol_pb2 as pb
from worker.local.base import LoopBase, Outcome, Settings
from worker.output import CHUNK, SINK, OutputSink
from worker.progress import REPORTER, ProgressLines, Reporter
from worker.runner import (
    READ_CHUNK,
    STDERR_TAIL,
    ExecRunner,
    HandlerRunner,
    TaskFailed,
    command_outcome,
)
from worker.spawn import Command

log = logging.getLogger("worker")


def handler_usage(start_wall: float, start_cpu: float, cpu_now: Callable[[], float]) -> pb.Usage:
    """A --handler job's usage: its wall and CPU time (the thread's, or the process's for an
    async one) and the worker's peak resident memory."""
    return pb.Usage(
        wall=time.perf_counter() - start_wall,
        cpu=max(0.0, cpu_now() - start_cpu),
        max_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    )


def _parked_abort(raise_cancel: Any) -> trio.lowlevel.Abort:
    return trio.lowlevel.Abort.SUCCEEDED  # cancelled between jobs: the worker is leaving


class JobSlot(LoopBase):
    """The running job and its output; `_fetch_me` is how the side the worker speaks on
    hands an outcome over."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        # The running job: a command, a trio task, or a call in the handler thread.
        self._command: Command | None = None
        self._command_fds: set[int] = set()  # its descriptors the loop has handlers for
        self._job_id = 0
        self._outcome: Outcome | None = None  # set by a job that ended outside the loop
        self._job_task: trio.lowlevel.Task | None = None  # runs async jobs (see _job_runner)
        self._async_busy = False  # it runs one now
        self._in_trio = False  # the loop waits through trio (a job's task may wake it)
        self._thread_jobs: queue.SimpleQueue[tuple[int, bytes] | None] | None = None
        # Job output (what the job writes to stderr), for a controller that takes it (its
        # REGISTER answer says so): gathered in the sink, sent in PULSE_OUTPUTs at most every
        # BATCH_SECONDS; a job's outcome waits until its last output is sent.
        self._takes_output = False
        self._sink = OutputSink(self._output_arrived)
        self._output_due = False  # the sink may hold bytes (set from any thread)
        self._output_at = math.inf  # when to send them
        self._sending_output = False  # a PULSE_OUTPUT is on its way
        self._ending: tuple[int, Outcome] | None = None  # an outcome waiting for its output
        # Its progress (worker/progress.py), for a controller that takes it: the latest
        # value, sent in a PULSE_PROGRESS at most every SEND_SECONDS, and before its outcome.
        self._takes_progress = False
        self._reporter = Reporter(self._progress_arrived)
        self._progress_due = False  # the reporter may hold a value (set from any thread)
        self._progress_next = 0.0  # the earliest time the next may go
        self._sending_progress = False  # one is on its way on the seed's exchange

    @abc.abstractmethod
    def _fetch_me(self) -> None:
        """Hand the outcome the session now holds to the controller."""

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
                runner.env(task_id, self.session.batch_id),
                payload,
                max_output=runner.max_output,
                stderr_keep=STDERR_TAIL,
                read_chunk=READ_CHUNK,
                on_stderr=self._sink.write if self._takes_output else None,
                on_progress=(
                    ProgressLines(self._reporter.set).feed if self._takes_progress else None
                ),
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
            REPORTER.set(self._reporter if self._takes_progress else None)
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
            REPORTER.set(self._reporter if self._takes_progress else None)
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
        if self._progress_due:  # its last progress goes now, before its outcome
            self._send_progress(time.monotonic(), task_id)
        if self._output_due or self._sending_output or self._sending_progress:
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
        self._reporter.clear()
        self._progress_due = False
        if self._command is not None:
            self._command.kill()
            for fd in self._command_fds:
                self._handlers.pop(fd, None)
            self._command_fds = set()
            self._command = None

    def _output_arrived(self) -> None:
        """The sink's hook (any thread): bytes wait to be sent; the loop looks at its timers."""
        self._output_due = True
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"o")

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

    def _progress_arrived(self) -> None:
        """The reporter's hook (any thread): a value waits to be sent."""
        self._progress_due = True
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"p")

    @abc.abstractmethod
    def _send_progress(self, now: float, task_id: int = 0) -> None:
        """One PULSE_PROGRESS with the latest value, for `task_id` (0: the running job)."""

    def _progress_sent(self, resp: pb.PulseResponse | None, why: str) -> None:
        self._sending_progress = False
        if not self._output_due:
            self._output_settled()

    def _output_settled(self) -> None:
        """Nothing waits to be sent: an outcome held for its output goes out now."""
        if self._ending is not None and not self._sending_output and not self._sending_progress:
            task_id, (ok, result, usage, reason) = self._ending
            self._ending = None
            self.session.finished(task_id, ok, result, usage, reason)
            self._fetch_me()

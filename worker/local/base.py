"""The ground floor of the local worker (worker/local/worker.py): its settings, its one
level-triggered epoll set and the handler each watched descriptor has, the wake-up pipe the
SIGTERM/SIGINT handlers write to, the parent it may drain with, and the rules every side
shares: the drain, registering again, stopping with an exit status."""

from __future__ import annotations

import abc
import contextlib
import logging
import math
import os
import select
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from controller.declared import Declared
from gen import worker_protocol_pb2 as pb
from worker.core import WorkerSession
from worker.runner import Runner

log = logging.getLogger("worker")

_IN = select.EPOLLIN

EXIT_RESTART = 75  # EX_TEMPFAIL: the supervisor starts us again

# (ok, the result or the error text, what the job used, "limit" when it hit one of its limits)
Outcome = tuple[bool, bytes, pb.Usage | None, str]


def promised_next_pulse(period: float) -> int:
    """What the worker promises in `next_pulse`: whole seconds, twice the real period."""
    return max(1, math.ceil(2 * period))


@dataclass(frozen=True, slots=True)
class Settings:
    """What a local worker is started with (`LocalWorker`'s arguments)."""

    socket_dir: Path
    runner: Runner
    pulse_period: float
    drain_timeout: float
    dial_timeout: float
    max_extra_size: int
    parent_pid: int | None
    declared: Declared
    channel: bool
    next_task: bool = True  # on a channel, take a next task while one runs


class LoopBase(abc.ABC):
    """The epoll set and the state every side of the local worker reads: its session, when it
    registers and pulses next, the drain's deadline, whether it is done."""

    def __init__(self, settings: Settings) -> None:
        socket_dir = settings.socket_dir
        self.socket_dir = socket_dir
        self.ask_channel = settings.channel
        self.ask_next = settings.next_task
        self.runner = settings.runner
        self.pulse_period = settings.pulse_period
        self.next_pulse = promised_next_pulse(settings.pulse_period)
        self.drain_timeout = settings.drain_timeout
        self.dial_timeout = settings.dial_timeout
        self.max_extra_size = settings.max_extra_size
        self.parent_pid = settings.parent_pid
        self.session = WorkerSession(settings.declared)
        self.exit_code = 0
        self._main_socket = str(socket_dir / "main.sock")
        self._epoll = select.epoll()
        self._handlers: dict[int, Callable[[int], None]] = {}
        self._done = False
        # Registration: the next attempt; pulses: the next one.
        self._register_at = 0.0
        self._pulse_at = math.inf
        self._drain_deadline = math.inf
        self._signals: list[int] = []
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._parent_fd = -1

    @abc.abstractmethod
    def _abandon_job(self) -> None:
        """Stop the running job: the worker leaves."""

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

    def _register_again(self) -> None:
        """The controller has forgotten this worker (UNKNOWN_ID, or its channel ended):
        register again at once, keeping the job and an outcome not yet handed over."""
        self.session.worker_id = 0
        self._register_at = 0.0
        self._pulse_at = math.inf

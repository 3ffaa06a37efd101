"""One `--exec` command per job, started and watched with as few system calls as it takes.

`os.posix_spawn` (glibc starts the child with vfork semantics: no copy of the
worker's memory, no thread hop) in a session of its own, a pidfd for its exit,
and its stdin, stdout, stderr, progress pipe (its descriptor 3, `JOB_PROGRESS_FD`) and
pidfd in an epoll set: `Command` in the
local worker's own loop (worker/local/job.py), `spawn_and_wait` in a trio task
(calculators, pollers). No process object, no task per pipe. Stopping a job
early (RESTART, task_timeout, SIGTERM past the drain) kills the whole
process group (and the job's cgroup, if it has one) and reaps it; so does the end of its
main process, for whatever it left behind. With a `Jail` (worker/limits/jail.py) the command
runs as the slot's job user under its limits, and its usage and any limit it hit come back
in `Finished`.
"""

from __future__ import annotations

import contextlib
import os
import resource
import select
import signal
import time
from collections.abc import Callable
from pathlib import Path

import trio

from controller.joblimits import NO_LIMITS, JobLimits
from gen import worker_protocol_pb2 as pb
from worker.limits.jail import Jail
from worker.progress import PROGRESS_FD

# Bytes read from a command's progress pipe at once (its lines are short).
PROGRESS_READ = 4096

# Signals Python ignores that a command expects at their default (as subprocess does).
_DEFAULT_SIGNALS = {signal.SIGPIPE, signal.SIGXFSZ, signal.SIGXCPU}
_IN = select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR
_OUT = select.EPOLLOUT | select.EPOLLERR


class Finished:
    """What a command did: exit code (negative: killed by that signal), stdout, stderr tail,
    what it used, and the limit it hit ("" if none)."""

    __slots__ = ("code", "limit", "stderr", "stdout", "too_big", "usage")

    def __init__(self) -> None:
        self.code = 0
        self.stdout = bytearray()
        self.stderr = bytearray()
        self.too_big = False
        self.usage: pb.Usage | None = None
        self.limit = ""


class Command:
    """One started command, served from an epoll set the caller owns.

    The constructor starts it and registers its stdin (while there is payload
    to write), stdout, stderr and a pidfd in `epoll`; the caller hands every
    event on `fds` to `on_event` until `running` is False, then calls `reap`.
    `kill` ends it early (its whole process group) and reaps it. OSError from
    the constructor: it could not be started.
    """

    __slots__ = (
        "_cgroup",
        "_epoll",
        "_exited",
        "_jail",
        "_limits",
        "_max_output",
        "_on_progress",
        "_on_stderr",
        "_open",
        "_read_chunk",
        "_started",
        "_stderr_keep",
        "_view",
        "done",
        "err_r",
        "in_w",
        "out_r",
        "pid",
        "pidfd",
        "prog_r",
    )

    def __init__(
        self,
        epoll: select.epoll,
        program: str,
        argv: list[str],
        env: dict[str, str],
        payload: bytes,
        *,
        max_output: int,
        stderr_keep: int,
        read_chunk: int,
        on_stderr: Callable[[bytes], None] | None = None,
        on_progress: Callable[[bytes], None] | None = None,
        jail: Jail | None = None,
        limits: JobLimits = NO_LIMITS,
    ) -> None:
        self._epoll = epoll
        self._jail = jail
        self._limits = limits
        self._started = time.perf_counter()
        self.pid, self.in_w, self.out_r, self.err_r, self.prog_r, self._cgroup = _start(
            program, argv, env, jail, limits
        )
        self._open = {self.in_w, self.out_r, self.err_r, self.prog_r}
        try:
            self.pidfd = os.pidfd_open(self.pid)
        except BaseException:  # out of descriptors: stop it, reap it, and say so
            _kill_group(self.pid)
            with contextlib.suppress(ChildProcessError):
                _reap(self.pid)
            self._abandon()
            raise
        self._max_output = max_output
        self._stderr_keep = stderr_keep
        self._read_chunk = read_chunk
        self._on_stderr = on_stderr
        self._on_progress = on_progress
        self._exited = False
        self.done = Finished()
        self._view = memoryview(payload)
        if self._view:
            os.set_blocking(self.in_w, False)  # the outputs stay blocking: read once per event
            epoll.register(self.in_w, _OUT)
        else:
            self._close(self.in_w)
        epoll.register(self.out_r, _IN)
        epoll.register(self.err_r, _IN)
        epoll.register(self.prog_r, _IN)
        epoll.register(self.pidfd, select.EPOLLIN)

    @property
    def watched(self) -> set[int]:
        """The descriptors still in the caller's epoll set."""
        live = set(self._open)
        if not self._exited:
            live.add(self.pidfd)
        return live

    @property
    def running(self) -> bool:
        """Until it has exited and both its outputs are closed."""
        opened = self._open
        return (
            not self._exited
            or self.out_r in opened
            or self.err_r in opened
            or self.prog_r in opened
        )

    def on_event(self, fd: int) -> None:
        done = self.done
        if fd == self.pidfd:
            if not self._exited:
                self._exited = True
                self._epoll.unregister(fd)
                # Whatever it left in its process group goes with it (its pid, a zombie
                # until reaped, still names the group), and what left the group for a
                # session of its own and came back to the worker (job users' jobs).
                _kill_group(self.pid)
                if self._jail is not None:
                    self._jail.ended(self.pid)
        elif fd == self.in_w:
            self._feed()
        elif fd == self.out_r:
            if self._drain(fd, done.stdout) and len(done.stdout) > self._max_output:
                done.too_big = True
                _kill_group(self.pid)
                self._close(fd)
        elif fd == self.err_r:
            before = len(done.stderr)
            self._drain(fd, done.stderr)
            if self._on_stderr is not None and len(done.stderr) > before:
                self._on_stderr(bytes(done.stderr[before:]))
            if len(done.stderr) > 2 * self._stderr_keep:
                del done.stderr[: -self._stderr_keep]
        elif fd == self.prog_r:
            data = os.read(fd, PROGRESS_READ)
            if not data:
                self._close(fd)
            elif self._on_progress is not None:
                self._on_progress(data)

    def reap(self) -> Finished:
        """Once it is no longer `running`: its exit code, what it used, and its descriptors
        closed."""
        done = self.done
        done.code, rusage = _reap(self.pid)
        wall = time.perf_counter() - self._started
        if self._jail is not None:
            ended = self._jail.finish(
                done.code, rusage, wall, bytes(done.stderr), self._limits, self._cgroup
            )
            done.usage, done.limit = ended.usage, ended.limit
        else:
            done.usage = pb.Usage(
                wall=wall,
                cpu=rusage.ru_utime + rusage.ru_stime,
                max_rss=rusage.ru_maxrss * 1024,
            )
        self._release()
        return done

    def kill(self) -> None:
        """Kill its process group (and cgroup), wait for it and reap it (no zombie left)."""
        _kill_group(self.pid)
        if self._jail is not None and self._jail.cgroup is not None and self._cgroup is not None:
            self._jail.cgroup.kill(self._cgroup)
        select.select([self.pidfd], [], [])  # SIGKILL: it exits at its next instruction
        with contextlib.suppress(ChildProcessError):
            _reap(self.pid)
        if self._jail is not None and self._jail.cgroup is not None and self._cgroup is not None:
            self._jail.cgroup.remove(self._cgroup)
        self._release()

    def _release(self) -> None:
        if not self._exited:
            self._exited = True
            self._epoll.unregister(self.pidfd)
        os.close(self.pidfd)
        self._abandon()

    def _abandon(self) -> None:
        for fd in self._open:
            self._forget(fd)
        self._open.clear()

    def _feed(self) -> None:
        try:
            self._view = self._view[os.write(self.in_w, self._view) :]
        except BlockingIOError:
            return
        except OSError:  # it closed its stdin early (EPIPE): the rest is its business
            self._view = self._view[:0]
        if not self._view:
            self._close(self.in_w)

    def _drain(self, fd: int, into: bytearray) -> bool:
        """Read once from a pipe the epoll set says is readable (it stays blocking, so a
        second read could wait; the level-triggered set reports what is left); False once
        it closed."""
        if fd not in self._open:
            return False
        data = os.read(fd, self._read_chunk)
        if not data:
            self._close(fd)
            return False
        into += data
        return True

    def _close(self, fd: int) -> None:
        if fd in self._open:
            self._open.discard(fd)
            self._forget(fd)

    def _forget(self, fd: int) -> None:
        """Out of the epoll set, then closed. Closing alone is not enough: the set keeps
        watching a pipe until every reference to it is gone, and the kernel may drop the
        last one later (seen: stdin's pipe kept reporting writable, hundreds of wake-ups a
        job, until the command exited)."""
        with contextlib.suppress(OSError):  # not registered yet (a failed start)
            self._epoll.unregister(fd)
        os.close(fd)


async def spawn_and_wait(
    program: str,
    argv: list[str],
    env: dict[str, str],
    payload: bytes,
    *,
    max_output: int,
    stderr_keep: int,
    read_chunk: int,
    on_stderr: Callable[[bytes], None] | None = None,
    on_progress: Callable[[bytes], None] | None = None,
    jail: Jail | None = None,
    limits: JobLimits = NO_LIMITS,
) -> Finished:
    """Run `program` (a path) as `argv` with `payload` on its stdin, in the calling trio
    task; OSError if it cannot be started."""
    epoll = select.epoll()
    try:
        command = Command(
            epoll,
            program,
            argv,
            env,
            payload,
            max_output=max_output,
            stderr_keep=stderr_keep,
            read_chunk=read_chunk,
            on_stderr=on_stderr,
            on_progress=on_progress,
            jail=jail,
            limits=limits,
        )
        try:
            while command.running:
                events = epoll.poll(0)
                if not events:
                    await trio.lowlevel.wait_readable(epoll.fileno())
                    continue
                for fd, _ in events:
                    command.on_event(fd)
                await trio.lowlevel.checkpoint_if_cancelled()
        except BaseException:
            command.kill()
            raise
        return command.reap()
    finally:
        epoll.close()


def _start(
    program: str, argv: list[str], env: dict[str, str], jail: Jail | None, limits: JobLimits
) -> tuple[int, int, int, int, int, Path | None]:
    """Start it (posix_spawn returns as soon as the child has exec'd: no blocking wait);
    (pid, its stdin, its stdout, its stderr, its progress pipe, its cgroup)."""
    in_r, in_w = os.pipe2(os.O_CLOEXEC)
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    prog_r, prog_w = os.pipe2(os.O_CLOEXEC)

    def spawn(resetids: bool = False) -> int:
        return os.posix_spawn(
            program,
            argv,
            env,
            file_actions=[
                (os.POSIX_SPAWN_DUP2, in_r, 0),
                (os.POSIX_SPAWN_DUP2, out_w, 1),
                (os.POSIX_SPAWN_DUP2, err_w, 2),
                (os.POSIX_SPAWN_DUP2, prog_w, PROGRESS_FD),  # JOB_PROGRESS_FD
            ],
            setsid=True,  # its own process group, so RESTART can kill it all
            setsigdef=_DEFAULT_SIGNALS,
            setsigmask=set(),
            resetids=resetids,  # the job user's: see worker/limits/jail.py
        )

    cgroup = None
    try:
        if jail is None:
            pid = spawn()
        else:
            pid, cgroup = jail.spawn(spawn, limits)
    except BaseException:
        for fd in (in_r, in_w, out_r, out_w, err_r, err_w, prog_r, prog_w):
            os.close(fd)
        raise
    for fd in (in_r, out_w, err_w, prog_w):
        os.close(fd)
    return pid, in_w, out_r, err_r, prog_r, cgroup


def _reap(pid: int) -> tuple[int, resource.struct_rusage]:
    """Its exit code (negative: the signal) and what it used (with the descendants it
    waited for); called once its pidfd says it has exited, so wait4 returns at once."""
    _, status, rusage = os.wait4(pid, 0)
    return os.waitstatus_to_exitcode(status), rusage


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)

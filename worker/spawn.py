"""One `--exec` command per job, started and watched with as few system calls as it takes.

`os.posix_spawnp` (glibc starts the child with vfork semantics: no copy of the
worker's memory, no thread hop) in a session of its own, a pidfd for its exit,
and one epoll set over its stdin, stdout, stderr and pidfd, served by the
calling trio task: no process object, no task per pipe. Cancelling the
caller (RESTART, task_timeout, SIGTERM past the drain) kills the whole
process group and reaps it.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
from collections.abc import Callable

import trio

# Signals Python ignores that a command expects at their default (as subprocess does).
_DEFAULT_SIGNALS = {signal.SIGPIPE, signal.SIGXFSZ}
_IN = select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR
_OUT = select.EPOLLOUT | select.EPOLLERR


class Finished:
    """What a command did: exit code (negative: killed by that signal), stdout, stderr tail."""

    __slots__ = ("code", "stderr", "stdout", "too_big")

    def __init__(self) -> None:
        self.code = 0
        self.stdout = bytearray()
        self.stderr = bytearray()
        self.too_big = False


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
) -> Finished:
    """Run `program` (a path) as `argv` with `payload` on its stdin; OSError if it cannot
    be started."""
    pid, in_w, out_r, err_r = _start(program, argv, env)
    done = Finished()
    pidfd = os.pidfd_open(pid)
    epoll = select.epoll()
    open_fds = {in_w, out_r, err_r}
    try:
        view = memoryview(payload)
        if view:
            os.set_blocking(in_w, False)  # the outputs stay blocking: read once per event
            epoll.register(in_w, _OUT)
        else:
            os.close(in_w)
            open_fds.discard(in_w)
        epoll.register(out_r, _IN)
        epoll.register(err_r, _IN)
        epoll.register(pidfd, select.EPOLLIN)
        exited = False
        while not exited or out_r in open_fds or err_r in open_fds:
            events = epoll.poll(0)
            if not events:
                await trio.lowlevel.wait_readable(epoll.fileno())
                continue
            for fd, _ in events:
                if fd == pidfd:
                    exited = True
                    epoll.unregister(pidfd)
                elif fd == in_w:
                    view = _feed(in_w, view, epoll, open_fds)
                elif fd == out_r:
                    if not _drain(out_r, done.stdout, read_chunk, epoll, open_fds):
                        continue
                    if len(done.stdout) > max_output:
                        done.too_big = True
                        _kill_group(pid)
                        _close(out_r, epoll, open_fds)
                elif fd == err_r:
                    before = len(done.stderr)
                    _drain(err_r, done.stderr, read_chunk, epoll, open_fds)
                    if on_stderr is not None and len(done.stderr) > before:
                        on_stderr(bytes(done.stderr[before:]))
                    if len(done.stderr) > 2 * stderr_keep:
                        del done.stderr[:-stderr_keep]
            await trio.lowlevel.checkpoint_if_cancelled()
        done.code = _reap(pid)
        return done
    except BaseException:
        _kill_group(pid)
        with trio.CancelScope(shield=True):
            await trio.lowlevel.wait_readable(pidfd)
        with contextlib.suppress(ChildProcessError):
            _reap(pid)
        raise
    finally:
        epoll.close()
        os.close(pidfd)
        for fd in open_fds:
            os.close(fd)


def _start(program: str, argv: list[str], env: dict[str, str]) -> tuple[int, int, int, int]:
    """Start it (posix_spawn returns as soon as the child has exec'd: no blocking wait);
    (pid, its stdin, its stdout, its stderr)."""
    in_r, in_w = os.pipe2(os.O_CLOEXEC)
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    try:
        pid = os.posix_spawn(
            program,
            argv,
            env,
            file_actions=[
                (os.POSIX_SPAWN_DUP2, in_r, 0),
                (os.POSIX_SPAWN_DUP2, out_w, 1),
                (os.POSIX_SPAWN_DUP2, err_w, 2),
            ],
            setsid=True,  # its own process group, so RESTART can kill it all
            setsigdef=_DEFAULT_SIGNALS,
            setsigmask=set(),
        )
    except BaseException:
        for fd in (in_r, in_w, out_r, out_w, err_r, err_w):
            os.close(fd)
        raise
    for fd in (in_r, out_w, err_w):
        os.close(fd)
    return pid, in_w, out_r, err_r


def _reap(pid: int) -> int:
    """Its exit code (negative: the signal); called once its pidfd says it has exited, so
    waitpid returns at once."""
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _feed(fd: int, view: memoryview, epoll: select.epoll, open_fds: set[int]) -> memoryview:
    try:
        view = view[os.write(fd, view) :]
    except BlockingIOError:
        return view
    except OSError:  # it closed its stdin early (EPIPE): the rest is its business
        view = view[:0]
    if not view:
        _close(fd, epoll, open_fds)
    return view


def _drain(fd: int, into: bytearray, chunk: int, epoll: select.epoll, open_fds: set[int]) -> bool:
    """Read once from a pipe the epoll set says is readable (it stays blocking, so a second
    read could wait; the level-triggered set reports what is left); False once it closed."""
    data = os.read(fd, chunk)
    if not data:
        _close(fd, epoll, open_fds)
        return False
    into += data
    return True


def _close(fd: int, epoll: select.epoll, open_fds: set[int]) -> None:
    if fd in open_fds:
        open_fds.discard(fd)
        os.close(fd)  # closing removes it from the epoll set


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)

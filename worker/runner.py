"""Runs one task: a command (`--exec`), a Python callable (`--handler`), or the echo default.

Every runner is `async (task_id, payload) -> result bytes` and raises
`TaskFailed` with a one-line, operator-readable reason for anything that goes
wrong in the task itself. Cancelling a runner stops the task: a command is
killed together with its whole process group.
"""

from __future__ import annotations

import contextvars
import importlib
import inspect
import os
import resource
import shutil
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from controller.joblimits import NO_LIMITS, JobLimits
from gen import worker_protocol_pb2 as pb
from worker.errors import SetupError
from worker.limits.jail import Jail
from worker.output import SINK
from worker.progress import PROGRESS_FD, REPORTER, ProgressLines, report
from worker.spawn import Finished, spawn_and_wait

Runner = Callable[[int, bytes], Awaitable[bytes]]

LIMIT = "limit"  # WorkerResponse.reason of a job that hit one of its limits

# What the last job run in this context used (a runner called by a calculator or a poller,
# which read it after the call); None when it was not measured.
USAGE: contextvars.ContextVar[pb.Usage | None] = contextvars.ContextVar("usage", default=None)


def take_usage() -> dict[str, float | int] | None:
    """What the job just run in this context used, as remote workers report it (a
    calculator's `params.usage`, a poller's `usage`), and forgotten; None if not measured."""
    usage = USAGE.get()
    if usage is None:
        return None
    USAGE.set(None)
    found: dict[str, float | int] = {"wall": usage.wall, "cpu": usage.cpu, "max_rss": usage.max_rss}
    if usage.memory_peak:
        found["memory_peak"] = usage.memory_peak
    return found


# How much of a failed command's stderr goes back as the error text.
STDERR_TAIL = 4096
# Pipe read size: big enough that a large result takes few reads.
READ_CHUNK = 256 * 1024


class TaskFailed(Exception):
    """The task did not produce a result; the message says why, `reason` is "limit" when it
    hit one of its limits (WorkerResponse.reason), else ""."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason


async def echo(payload: bytes) -> bytes:
    """The built-in demo handler: the result is the payload."""
    return payload


def noop(payload: bytes) -> bytes:
    """A handler that does nothing, for benchmarks (`--handler worker.runner:noop`)."""
    return b""


async def anoop(payload: bytes) -> bytes:
    """The async no-op handler: runs in the worker's loop, no thread hop."""
    return b""


async def anoop_line(payload: bytes) -> bytes:
    """anoop that writes one line to stderr: what job output costs a job (benchmarks)."""
    sys.stderr.write("a line\n")
    return b""


def _as_bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    raise TaskFailed(f"handler returned {type(value).__name__}, not bytes")


def load_handler(spec: str) -> Callable[[bytes], Any]:
    """Import `module:func` (func may be dotted), checking it is callable."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise SetupError(f"--handler {spec!r}: expected MODULE:FUNC, e.g. mypkg.jobs:run")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise SetupError(f"--handler {spec!r}: cannot import {module_name}: {exc}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise SetupError(f"--handler {spec!r}: {module_name} has no {attr}") from None
    if not callable(obj):
        raise SetupError(f"--handler {spec!r}: {attr} is not callable")
    return obj  # type: ignore[no-any-return]


def takes_report(func: Callable[..., Any]) -> bool:
    """Whether a handler takes a second positional argument (`report`, worker/progress.py)."""
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: called with the payload
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return True
    return sum(1 for p in params if p.kind in positional) >= 2


class HandlerRunner:
    """A `--handler` callable as a runner: async callables run in the caller's trio loop,
    plain ones in a thread; one that takes a second argument gets `report` (its progress).
    `failure` and `result` turn what it did into the task's outcome (the local worker calls
    them when it runs a plain handler in a thread of its own)."""

    __slots__ = ("func", "is_async", "max_output")

    def __init__(self, func: Callable[..., Any], max_output: int) -> None:
        self.is_async = inspect.iscoroutinefunction(func)
        # Called with the payload alone; one that takes `report` gets it (an async one's
        # coroutine is awaited all the same).
        self.func: Callable[[bytes], Any] = (
            (lambda payload: func(payload, report)) if takes_report(func) else func
        )
        self.max_output = max_output

    async def __call__(self, task_id: int, payload: bytes) -> bytes:
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            if self.is_async:
                value = await self.func(payload)
            else:
                value = await trio.to_thread.run_sync(self.func, payload, abandon_on_cancel=True)
        except TaskFailed:
            raise
        except Exception as exc:
            raise self.failure(exc) from None
        finally:
            USAGE.set(
                pb.Usage(
                    wall=time.perf_counter() - wall,
                    cpu=max(0.0, time.process_time() - cpu),
                    max_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                )
            )
        return self.result(value)

    @staticmethod
    def failure(exc: Exception) -> TaskFailed:
        """What a handler's exception tells the controller: its type and first line."""
        if isinstance(exc, TaskFailed):
            return exc
        summary = str(exc).splitlines()[0] if str(exc) else ""
        return TaskFailed(f"{type(exc).__name__}: {summary}".rstrip(": "))

    def result(self, value: Any) -> bytes:
        """The handler's return value as the result; TaskFailed when it is not bytes-like or
        too big."""
        result = _as_bytes(value)
        if len(result) > self.max_output:
            raise TaskFailed(
                f"result of {len(result)} bytes exceeds max_extra_size ({self.max_output})"
            )
        return result


def handler_runner(func: Callable[[bytes], Any], max_output: int) -> Runner:
    """Async callables run in the worker's loop, plain ones in a thread."""
    return HandlerRunner(func, max_output)


class ExecRunner:
    """`--exec`: one process per task (payload on stdin, TASK_ID in the environment, stdout
    is the result). The local worker starts `Command`s itself (`program`, `env`, `outcome`);
    calling it runs one in the caller's trio task."""

    __slots__ = ("argv", "environ", "jail", "max_output", "plain_jail", "program")

    def __init__(self, argv: list[str], max_output: int, jail: Jail | None = None) -> None:
        if not argv:
            raise SetupError("--exec needs a command")
        program = shutil.which(argv[0])
        if program is None:
            raise SetupError(f"--exec: command not found or not executable: {argv[0]}")
        self.argv = argv
        self.program = program  # looked up once, not per job
        # The worker's environment, read once: os.environ decodes every variable on each copy.
        self.environ = {**os.environ, "JOB_PROGRESS_FD": str(PROGRESS_FD)}
        self.max_output = max_output
        # The job user, limits and cgroup of its commands (worker/limits/jail.py); None: plain.
        self.jail = jail if jail is not None and jail.active else None
        # What applies the limits a job asks for itself where the worker sets none of its own
        # (no job user, ceilings or cgroup): a job's `limits` hold on every worker.
        self.plain_jail = jail if jail is not None else Jail()

    async def __call__(self, task_id: int, payload: bytes) -> bytes:
        if self.jail is not None:
            self.jail.clean()
        return await run_command(
            self.argv,
            task_id,
            payload,
            self.max_output,
            self.program,
            self.env(task_id) if self.jail is not None else self.environ,
            jail=self.jail,
            limits=self.jail.ceilings if self.jail is not None else NO_LIMITS,
        )

    def env(self, task_id: int, batch_id: str = "") -> dict[str, str]:
        """The command's environment: TASK_ID, and BATCH_ID for a batch's then job."""
        env = {**self.environ, "TASK_ID": str(task_id)}
        if batch_id:
            env["BATCH_ID"] = batch_id
        return self.jail.env(env) if self.jail is not None else env


def exec_runner(argv: list[str], max_output: int, jail: Jail | None = None) -> Runner:
    """One process per task: payload on stdin, TASK_ID in the environment, stdout is the result."""
    return ExecRunner(argv, max_output, jail)


async def run_command(
    argv: list[str],
    task_id: int,
    payload: bytes,
    max_output: int,
    program: str | None = None,
    environ: dict[str, str] | None = None,
    *,
    jail: Jail | None = None,
    limits: JobLimits = NO_LIMITS,
) -> bytes:
    """Run one `--exec` job (`program`: argv[0]'s path, looked up here when not given;
    `environ`: the command's environment before TASK_ID, os.environ when not given)."""
    env = {**(os.environ if environ is None else environ), "TASK_ID": str(task_id)}
    env["JOB_PROGRESS_FD"] = str(PROGRESS_FD)
    if program is None:
        program = shutil.which(argv[0]) or argv[0]
    sink = SINK.get()  # the job's output: its stderr as it comes
    reporter = REPORTER.get()  # its progress: lines on JOB_PROGRESS_FD
    lines = ProgressLines(reporter.set) if reporter is not None else None
    try:
        done = await spawn_and_wait(
            program,
            argv,
            env,
            payload,
            max_output=max_output,
            stderr_keep=STDERR_TAIL,
            read_chunk=READ_CHUNK,
            on_stderr=sink.write if sink is not None else None,
            on_progress=lines.feed if lines is not None else None,
            jail=jail,
            limits=limits,
        )
    except OSError as exc:
        raise TaskFailed(f"cannot run {argv[0]}: {exc.strerror or exc}") from None
    USAGE.set(done.usage)
    return command_outcome(argv[0], done, max_output)


def command_outcome(name: str, done: Finished, max_output: int) -> bytes:
    """A finished command's result (its stdout); TaskFailed for a non-zero exit, a signal
    (with the tail of its stderr) or output over the limit; one that hit a limit names it
    first ("CPU time limit 60 s: spin killed by SIGKILL"), with reason "limit"."""
    if done.too_big:
        raise TaskFailed(f"output exceeded max_extra_size ({max_output} bytes); command killed")
    code = done.code
    if code != 0 or done.limit:
        if code < 0:
            try:
                how = f"killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"killed by signal {-code}"
        else:
            how = f"exited with status {code}"
        tail = bytes(done.stderr[-STDERR_TAIL:]).decode("utf-8", "replace").strip()
        text = f"{name} {how}" + (f": {tail}" if tail else "")
        if done.limit:
            raise TaskFailed(f"{done.limit}: {text}", LIMIT)
        raise TaskFailed(text)
    return bytes(done.stdout)


def build_runner(
    exec_argv: list[str] | None, handler: str | None, max_output: int, jail: Jail | None = None
) -> Runner:
    """The runner the flags ask for; SetupError when they are unusable."""
    if exec_argv is not None and handler is not None:
        raise SetupError("--exec and --handler cannot be used together")
    if exec_argv is not None:
        return exec_runner(exec_argv, max_output, jail)
    if handler is not None:
        return handler_runner(load_handler(handler), max_output)
    return handler_runner(echo, max_output)

"""Runs one task: a command (`--exec`), a Python callable (`--handler`), or the echo default.

Every runner is `async (task_id, payload) -> result bytes` and raises
`TaskFailed` with a one-line, operator-readable reason for anything that goes
wrong in the task itself. Cancelling a runner stops the task: a command is
killed together with its whole process group.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import inspect
import os
import shutil
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from worker.spawn import spawn_and_wait

Runner = Callable[[int, bytes], Awaitable[bytes]]

# How much of a failed command's stderr goes back as the error text.
STDERR_TAIL = 4096
# Pipe read size: big enough that a large result takes few reads.
READ_CHUNK = 256 * 1024


class TaskFailed(Exception):
    """The task did not produce a result; the message says why."""


class SetupError(Exception):
    """The runner cannot be built (bad --exec or --handler); exit status 2."""


async def echo(payload: bytes) -> bytes:
    """The built-in demo handler: the result is the payload."""
    return payload


def noop(payload: bytes) -> bytes:
    """A handler that does nothing, for benchmarks (`--handler worker.runner:noop`)."""
    return b""


async def anoop(payload: bytes) -> bytes:
    """The async no-op handler: runs in the worker's loop, no thread hop."""
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


def handler_runner(func: Callable[[bytes], Any], max_output: int) -> Runner:
    """Async callables run in the worker's loop, plain ones in a thread."""
    is_async = inspect.iscoroutinefunction(func)

    async def run(task_id: int, payload: bytes) -> bytes:
        try:
            if is_async:
                value = await func(payload)
            else:
                value = await trio.to_thread.run_sync(func, payload, abandon_on_cancel=True)
        except TaskFailed:
            raise
        except Exception as exc:
            summary = str(exc).splitlines()[0] if str(exc) else ""
            raise TaskFailed(f"{type(exc).__name__}: {summary}".rstrip(": ")) from None
        result = _as_bytes(value)
        if len(result) > max_output:
            raise TaskFailed(f"result of {len(result)} bytes exceeds max_extra_size ({max_output})")
        return result

    return run


# A list that a caller who wants the command's stderr as it comes (the poller, for its lease
# PUTs) sets for the task that runs the job; chunks are appended as they arrive.
STDERR_LINES: contextvars.ContextVar[list[bytes] | None] = contextvars.ContextVar(
    "STDERR_LINES", default=None
)


def exec_runner(argv: list[str], max_output: int) -> Runner:
    """One process per task: payload on stdin, TASK_ID in the environment, stdout is the result."""
    if not argv:
        raise SetupError("--exec needs a command")
    if shutil.which(argv[0]) is None:
        raise SetupError(f"--exec: command not found or not executable: {argv[0]}")

    program = shutil.which(argv[0]) or argv[0]  # looked up once, not per job
    # The worker's environment, read once: os.environ decodes every variable on each copy.
    environ = dict(os.environ)

    async def run(task_id: int, payload: bytes) -> bytes:
        return await run_command(argv, task_id, payload, max_output, program, environ)

    return run


async def run_command(
    argv: list[str],
    task_id: int,
    payload: bytes,
    max_output: int,
    program: str | None = None,
    environ: dict[str, str] | None = None,
) -> bytes:
    """Run one `--exec` job (`program`: argv[0]'s path, looked up here when not given;
    `environ`: the command's environment before TASK_ID, os.environ when not given)."""
    env = {**(os.environ if environ is None else environ), "TASK_ID": str(task_id)}
    if program is None:
        program = shutil.which(argv[0]) or argv[0]
    lines = STDERR_LINES.get()
    try:
        done = await spawn_and_wait(
            program,
            argv,
            env,
            payload,
            max_output=max_output,
            stderr_keep=STDERR_TAIL,
            read_chunk=READ_CHUNK,
            on_stderr=lines.append if lines is not None else None,
        )
    except OSError as exc:
        raise TaskFailed(f"cannot run {argv[0]}: {exc.strerror or exc}") from None
    if done.too_big:
        raise TaskFailed(f"output exceeded max_extra_size ({max_output} bytes); command killed")
    code = done.code
    if code != 0:
        if code < 0:
            how = f"killed by {signal.Signals(-code).name}"
        else:
            how = f"exited with status {code}"
        tail = bytes(done.stderr[-STDERR_TAIL:]).decode("utf-8", "replace").strip()
        raise TaskFailed(f"{argv[0]} {how}" + (f": {tail}" if tail else ""))
    return bytes(done.stdout)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def build_runner(exec_argv: list[str] | None, handler: str | None, max_output: int) -> Runner:
    """The runner the flags ask for; SetupError when they are unusable."""
    if exec_argv is not None and handler is not None:
        raise SetupError("--exec and --handler cannot be used together")
    if exec_argv is not None:
        return exec_runner(exec_argv, max_output)
    if handler is not None:
        return handler_runner(load_handler(handler), max_output)
    return handler_runner(echo, max_output)

"""Handlers the real-process worker tests load with `--handler tests.worker_handlers:NAME`,
and `start_workers`, which starts such workers for a test.

A waiting handler's payload names a file (or, for `gated`, a gate in the directory that
$TEST_WORKER_GATES names); it returns once that file exists (bounded), so a test decides
when the job ends without sleeping. The counted handlers note each run as a file in the
directory $TEST_WORKER_EXECUTIONS names, which `executions` reads back.
"""

from __future__ import annotations

import collections
import functools
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import trio

WAIT = 20.0  # seconds a handler waits for its file before it fails
EXECUTIONS = "TEST_WORKER_EXECUTIONS"
GATES = "TEST_WORKER_GATES"


async def _kill(proc: trio.Process) -> None:
    proc.kill()


async def start_workers(
    nursery: trio.Nursery, socket_dir: Path, *args: str, count: int = 1, **env: str
) -> None:
    """`count` real worker processes on `socket_dir` (with `args`, and `env` added to the
    environment), each killed when `nursery` is cancelled."""
    argv = [sys.executable, "-m", "worker", "--socket-dir", str(socket_dir)]
    argv += ["--log-level", "ERROR", *args]
    for _ in range(count):
        run = functools.partial(
            trio.run_process, argv, env=os.environ | env, check=False, deliver_cancel=_kill
        )
        await nursery.start(run)


def executions(directory: Path) -> collections.Counter[bytes]:
    """How many times the counted handlers ran each payload, noted in `directory`."""
    return collections.Counter(path.read_bytes() for path in directory.iterdir())


def _note(payload: bytes) -> None:
    fd, _ = tempfile.mkstemp(dir=os.environ[EXECUTIONS])
    try:
        os.write(fd, payload)
    finally:
        os.close(fd)


def counted_echo(payload: bytes) -> bytes:
    _note(payload)
    return payload


def counted_done(payload: bytes) -> bytes:
    _note(payload)
    return b"done:" + payload


def large(payload: bytes) -> bytes:
    return bytes(range(256)) * 1000


def gated(payload: bytes) -> bytes:
    """Marks `<payload>.running` in $TEST_WORKER_GATES, then waits for `<payload>.go`."""
    gates = Path(os.environ[GATES])
    name = payload.decode()
    (gates / f"{name}.running").touch()
    go = gates / f"{name}.go"
    deadline = time.monotonic() + WAIT
    while not go.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{go} never appeared")
        time.sleep(0.002)
    return b"done:" + payload


def wait_for_file(payload: bytes) -> bytes:
    path = Path(payload.decode())
    deadline = time.monotonic() + WAIT
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.005)
    return b"plain:" + path.read_bytes()


async def await_file(payload: bytes) -> bytes:
    path = Path(payload.decode())
    with trio.fail_after(WAIT):
        while not path.exists():
            await trio.sleep(0.005)
    return b"async:" + path.read_bytes()


async def block_until_file(payload: bytes) -> bytes:
    """An async handler that holds the worker's whole loop (a blocking wait inside a
    coroutine, as careless code does) until the file its payload names exists (bounded)."""
    path = Path(payload.decode())
    deadline = time.monotonic() + WAIT
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.005)  # noqa: ASYNC251 (holding the loop is the point)
    return b"held"


def chatty(payload: bytes) -> bytes:
    """Prints to stderr and logs (a plain handler: it runs in a thread), then echoes."""
    import logging
    import sys

    print(f"printed {payload.decode()}", file=sys.stderr)
    logging.getLogger("job").warning("logged %s", payload.decode())
    return payload


async def achatty(payload: bytes) -> bytes:
    """chatty as an async handler (it runs in the worker's trio loop)."""
    import logging
    import sys

    print(f"printed {payload.decode()}", file=sys.stderr)
    logging.getLogger("job").warning("logged %s", payload.decode())
    return payload


def boom(payload: bytes) -> bytes:
    raise ValueError("bad payload\nsecond line")


async def upper(payload: bytes) -> bytes:
    await trio.lowlevel.checkpoint()
    return payload.upper()


def bad_payload(payload: bytes) -> bytes:
    """Fails a job whose payload is `bad`, echoes the others."""
    if payload == b"bad":
        raise RuntimeError("bad payload")
    return payload


def fail_when_asked(payload: bytes) -> bytes:
    """Fails a job whose payload starts with `fail` (each run noted), echoes the others."""
    _note(payload)
    if payload.startswith(b"fail"):
        raise RuntimeError("asked to fail")
    return payload


def fails_first_time(payload: bytes) -> bytes:
    """Fails each payload's first run (noted in $TEST_WORKER_EXECUTIONS), echoes later ones."""
    tried = Path(os.environ[EXECUTIONS]) / f"tried-{payload.hex()}"
    if not tried.exists():
        tried.touch()
        raise RuntimeError("first time unlucky")
    return payload


def fails_until_passed(payload: bytes) -> bytes:
    """Fails ("not yet") until the file `passed` exists beside $TEST_WORKER_EXECUTIONS."""
    if not (Path(os.environ[EXECUTIONS]).parent / "passed").exists():
        raise RuntimeError("not yet")
    return payload


def sleeps_a_minute(payload: bytes) -> bytes:
    time.sleep(60)
    return payload


def says_hello(payload: bytes) -> bytes:
    """Writes a line to stderr (the job's output), echoes."""
    sys.stderr.write(f"hello from {payload.decode()}\n")
    sys.stderr.flush()
    return payload


def cannot_do(payload: bytes) -> bytes:
    raise RuntimeError(f"cannot do {payload!r}")


def _gate_open(payload: bytes) -> bool:
    return os.path.exists(payload.decode())


def progressing(payload: bytes, report: Callable[..., None]) -> bytes:
    """Reports progress, waits until the file named by the payload exists, reports again."""
    report(0.25, "started")
    while not _gate_open(payload):
        time.sleep(0.01)
    for step in range(2000):  # a flood: the worker sends a few of these, the last one last
        report(0.5 + step / 4000)
    report(0.75, "almost")
    return b"done"


async def aprogressing(payload: bytes, report: Callable[..., None]) -> bytes:
    """progressing, async."""
    report(0.25, "started")
    while not _gate_open(payload):
        await trio.sleep(0.01)
    for step in range(2000):
        report(0.5 + step / 4000)
    report(0.75, "almost")
    return b"done"

"""`worker --exit-with-parent` for calculators and pollers: a real parent process starts the
worker and is killed (SIGKILL: no chance to stop its child itself); the worker leaves."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable

WAIT = 20.0


def start_under_parent(*args: str) -> tuple[subprocess.Popen[bytes], int]:
    """A shell that starts `worker ARGS --exit-with-parent <the shell>` and waits: the shell,
    and the worker's pid. The worker writes its log to the shell's stderr pipe."""
    worker = " ".join([sys.executable, "-m", "worker", "--log-level", "INFO", *args])
    shell = subprocess.Popen(
        ["sh", "-c", f"{worker} --exit-with-parent $$ & echo $!; wait"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert shell.stdout is not None
    return shell, int(shell.stdout.readline())


def log_to_the_end(shell: subprocess.Popen[bytes], timeout: float) -> str:
    """What the shell and the worker wrote to stderr, once both have ended (the pipe's end)."""
    assert shell.stderr is not None
    fd = shell.stderr.fileno()
    deadline = time.monotonic() + timeout
    out = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise TimeoutError(f"the worker is still running; its log: {out!r}")
        chunk = os.read(fd, 65536)
        if not chunk:
            return out.decode(errors="replace")
        out += chunk


def killed_parent_ends_worker(args: list[str], started: Callable[[], None]) -> str:
    shell, worker = start_under_parent(*args)
    try:
        started()  # the worker runs: tied to its parent by now
        shell.kill()
        shell.wait()
        return log_to_the_end(shell, WAIT)
    finally:
        shell.kill()
        shell.wait()
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGKILL)  # only if it stayed (the test has failed then)
        for stream in (shell.stdout, shell.stderr):
            assert stream is not None
            stream.close()


def test_a_calculator_leaves_when_its_parent_is_killed() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as controller:
        controller.bind(("127.0.0.1", 0))
        controller.settimeout(WAIT)
        port = controller.getsockname()[1]
        log = killed_parent_ends_worker(
            ["--udp", f"127.0.0.1:{port}", "--pulse", "0.1"],
            lambda: controller.recv(65536) and None,  # its first heartbeat
        )
    assert "parent process" in log and "ended" in log, log


def test_a_poller_leaves_when_its_parent_is_killed() -> None:
    """The poller's /ping/ is open (the hub never answers) when its parent dies."""
    with socket.socket() as hub:
        hub.bind(("127.0.0.1", 0))
        hub.listen()
        hub.settimeout(WAIT)
        port = hub.getsockname()[1]
        held: list[socket.socket] = []
        try:
            log = killed_parent_ends_worker(
                ["--hub", f"http://127.0.0.1:{port}", "--pulse", "0.1"],
                lambda: held.append(hub.accept()[0]),  # its first /ping/
            )
        finally:
            for conn in held:
                conn.close()
    assert "parent process" in log and "ended" in log, log

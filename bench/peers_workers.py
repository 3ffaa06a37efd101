"""The peers' venv (.venv-peers) and how `make bench-peers` starts their servers and workers:
each in a session of its own, stopped with its children by pid (bench/peers.py and
bench/peers_lengths.py both run them)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).parent
VENV = HERE.parent / ".venv-peers"


@contextlib.contextmanager
def process_group(
    argv: list[str], env: dict[str, str], log: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """A server or worker in a session of its own, stopped with its children by pid."""
    with log.open("ab") as sink:
        proc = subprocess.Popen(
            argv, cwd=HERE, env=env, stdout=sink, stderr=sink, start_new_session=True
        )
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def worker_commands(system: str, redis_url: str) -> list[list[str]]:
    """The peer's own way of running 2 workers."""
    bin_ = VENV / "bin"
    if system == "huey":
        return [[str(bin_ / "huey_consumer"), "peers_tasks.huey", "-w", "2", "-k", "process", "-q"]]
    if system == "celery":
        return [
            [
                str(bin_ / "celery"),
                "-A",
                "peers_tasks",
                "worker",
                "-c",
                "2",
                "-P",
                "prefork",
                "-l",
                "WARNING",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ]
        ]
    if system == "dramatiq":
        return [[str(bin_ / "dramatiq"), "peers_tasks", "--processes", "2", "--threads", "1"]]
    if system == "rq":
        url = f"{redis_url}/4"
        return [[str(bin_ / "rq"), "worker", "--url", url, "bench"] for _ in range(2)]
    return [[str(bin_ / "python"), "peers_tasks.py", "gearman-worker"] for _ in range(2)]

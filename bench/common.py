"""Small helpers shared by the benchmarks."""

from __future__ import annotations

import json
import os
import resource
import shutil
import socket
import statistics
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


def write_config(directory: Path, **settings: object) -> Path:
    """A controller.json in `directory` with these settings (tests and benchmarks)."""
    path = directory / "controller.json"
    path.write_text(json.dumps(settings))
    return path


def recording_exec(execlog: Path) -> list[str]:
    """`--exec` arguments for a job that logs its TASK_ID (to count executions) and echoes."""
    return ["--exec", "sh", "-c", f'echo "$TASK_ID" >> {execlog}; cat']


def controller_argv(config: Path, *args: str, log_level: str | None = None) -> list[str]:
    """The command line of a real controller with this config file, plus `args`."""
    level = ["--log-level", log_level] if log_level is not None else []
    return [sys.executable, "-m", "controller", "--config", str(config), *level, *args]


def worker_argv(socket_dir: Path, *args: str, log_level: str = "ERROR") -> list[str]:
    """The command line of one real worker on `socket_dir` (quiet by default), plus `args`."""
    return [
        sys.executable,
        "-m",
        "worker",
        "--socket-dir",
        str(socket_dir),
        "--log-level",
        log_level,
        *args,
    ]


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def self_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@contextmanager
def socket_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="jcb-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def median(values: list[float]) -> float:
    return statistics.median(values)

"""Small helpers of the benchmarks alone (those shared with the tests are in tests/helpers.py)."""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import statistics
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

TICKS = os.sysconf("SC_CLK_TCK")


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def self_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def cpu_while(pids: list[int], tasks: int, run: Callable[[], T]) -> tuple[T, dict[str, float]]:
    """`run()`'s result and, while it ran `tasks` jobs, the microseconds of CPU per job of
    `pids[0]` (the controller), of the other `pids` together (the workers) and of this
    process (the client)."""
    before = [process_cpu(pid) for pid in pids]
    own = self_cpu()
    result = run()
    own = self_cpu() - own
    spent = [process_cpu(pid) - b for pid, b in zip(pids, before, strict=True)]
    return result, {
        "controller_us": 1e6 * spent[0] / tasks,
        "workers_us": 1e6 * sum(spent[1:]) / tasks,
        "client_us": 1e6 * own / tasks,
    }


def children_of(pid: int) -> list[int]:
    """The pids whose parent is `pid` (a controller's local workers), from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stat = (entry / "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
    return found


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


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def median(values: list[float]) -> float:
    return statistics.median(values)


@contextmanager
def importable_bench() -> Iterator[None]:
    """bench/ importable by the workers a controller starts (`--handler bench.work:run`)."""
    before = os.environ.get("PYTHONPATH")
    here = str(Path(__file__).resolve().parent.parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, before) if p)
    try:
        yield
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before

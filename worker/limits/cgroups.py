"""A delegated cgroup v2 subtree: a cgroup per job with its limits written (memory.max,
pids.max, cpu.max), what the job used (memory.peak), and the limit its events say it hit."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
from pathlib import Path

from controller.joblimits import JobLimits, describe_size
from worker.errors import SetupError

CGROUP_ROOT = Path("/sys/fs/cgroup")


class Cgroup:
    """A delegated cgroup v2 subtree: the worker in a leaf of its own (`worker`), each job in
    `job-N` beside it. Every path is under `root`, so a plain directory stands in for
    cgroupfs in tests."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.home = root / "worker"
        self._count = 0

    @staticmethod
    def find(proc_cgroup: Path = Path("/proc/self/cgroup"), mount: Path = CGROUP_ROOT) -> Path:
        """This process's cgroup v2 directory, if it is delegated to us (writable, with the
        memory and pids controllers available); SetupError saying why not."""
        try:
            lines = proc_cgroup.read_text().splitlines()
        except OSError as exc:
            raise SetupError(f"cannot read {proc_cgroup}: {exc.strerror}") from None
        unified = [line[3:] for line in lines if line.startswith("0::")]
        if not unified:
            raise SetupError("no cgroup v2 hierarchy (cgroup v1 only)")
        if not (mount / "cgroup.controllers").exists():
            raise SetupError(f"{mount} is not a cgroup v2 mount")
        path = mount / unified[0].lstrip("/")
        try:
            available = (path / "cgroup.controllers").read_text().split()
        except OSError as exc:
            raise SetupError(f"cannot read {path}/cgroup.controllers: {exc.strerror}") from None
        missing = {"memory", "pids"} - set(available)
        if missing:
            raise SetupError(f"{path}: no {' or '.join(sorted(missing))} controller delegated")
        if not os.access(path, os.W_OK) or not os.access(path / "cgroup.procs", os.W_OK):
            raise SetupError(f"{path} is not delegated to this worker (not writable)")
        try:
            members = (path / "cgroup.procs").read_text().split()
        except OSError as exc:
            raise SetupError(f"cannot read {path}/cgroup.procs: {exc.strerror}") from None
        if members != [str(os.getpid())]:
            raise SetupError(f"{path} holds other processes than this worker: not its own")
        return path

    def setup(self) -> None:
        """Move the worker into its own leaf and give job cgroups the controllers."""
        self.home.mkdir(exist_ok=True)
        (self.home / "cgroup.procs").write_text(str(os.getpid()))
        available = set((self.root / "cgroup.controllers").read_text().split())
        wanted = [f"+{name}" for name in ("memory", "pids", "cpu") if name in available]
        (self.root / "cgroup.subtree_control").write_text(" ".join(wanted))

    def create(self, limits: JobLimits) -> Path:
        """A new cgroup for one job, its limits written."""
        self._count += 1
        path = self.root / f"job-{self._count}"
        path.mkdir(exist_ok=True)
        if limits.memory_max is not None:
            _write(path / "memory.max", str(limits.memory_max))
            _write(path / "memory.swap.max", "0")
            _write(path / "memory.oom.group", "1")
        if limits.tasks_max is not None:
            _write(path / "pids.max", str(limits.tasks_max))
        if limits.cpu_quota is not None:
            period = 100_000
            _write(path / "cpu.max", f"{max(1000, round(limits.cpu_quota * period))} {period}")
        return path

    def enter(self, path: Path) -> None:
        """Move the worker there (what it spawns is born there)."""
        (path / "cgroup.procs").write_text(str(os.getpid()))

    def leave(self) -> None:
        (self.home / "cgroup.procs").write_text(str(os.getpid()))

    @staticmethod
    def events(path: Path, name: str) -> dict[str, int]:
        """A flat keyed file (memory.events, pids.events) as numbers; {} if unreadable."""
        counts: dict[str, int] = {}
        with contextlib.suppress(OSError):
            for line in (path / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if value.strip().isdigit():
                    counts[key] = int(value)
        return counts

    @staticmethod
    def peak(path: Path) -> int:
        """memory.peak in bytes (0: unknown, before Linux 5.19)."""
        with contextlib.suppress(OSError, ValueError):
            return int((path / "memory.peak").read_text().split()[0])
        return 0

    @staticmethod
    def kill(path: Path) -> None:
        """Every process in it, at once (cgroup.kill, Linux 5.14), else one by one."""
        try:
            (path / "cgroup.kill").write_text("1")
            return
        except OSError:
            pass
        with contextlib.suppress(OSError):
            for pid in (path / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    os.kill(int(pid), signal.SIGKILL)

    @staticmethod
    def remove(path: Path) -> None:
        """rmdir once it is empty (cgroupfs refuses before); a stand-in directory holds the
        interface files the test wrote, which go first."""
        with contextlib.suppress(OSError):
            path.rmdir()
            return
        if not str(path).startswith(str(CGROUP_ROOT)):
            shutil.rmtree(path, ignore_errors=True)


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot write {path}: {exc.strerror}") from None


def cgroup_limit(path: Path, limits: JobLimits) -> str:
    """The limit a job's cgroup says it hit ("" if none)."""
    memory = Cgroup.events(path, "memory.events")
    if limits.memory_max is not None and memory.get("oom_kill", 0) > 0:
        return (
            f"memory limit {describe_size(limits.memory_max)} reached: killed by the kernel (OOM)"
        )
    pids = Cgroup.events(path, "pids.events")
    if limits.tasks_max is not None and pids.get("max", 0) > 0:
        return f"process limit {limits.tasks_max}: {pids['max']} forks refused"
    return ""

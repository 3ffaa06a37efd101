"""Jobs as strangers (DESIGN.md section 15): the user a job runs as, its kernel limits, the
cgroup it may get, and what it used.

How an `--exec` job starts under a job user and limits, and why this way. Measured on a
2-CPU VM (`--exec true`): `os.posix_spawn` (vfork semantics) costs about 0.6 ms a job,
`os.fork` of the worker about 1.5 ms before the exec even starts (the copy of its page
tables and the faults after it), an exec wrapper (`prlimit`, `setpriv`, even a static one)
0.4 ms or more. So the job is started by posix_spawn and nothing else:

- The user: for the moment of the spawn the worker takes the job user as its *real* uid and
  gid (its effective ones stay its own), and posix_spawn's `resetids` makes the child's
  effective ids the real ones before the exec, which then sets the saved ones: the job runs
  with every uid and gid the job user's, no supplementary group (the worker drops its own),
  and no capability. The worker takes its own real ids back right after, so a job can
  signal neither its worker nor another slot's job.
- The limits: set on the child with prlimit(2) right after posix_spawn returns, while the
  worker's real ids still match the child's (what prlimit on another process asks). The
  ceilings that cannot hurt the worker (`tasks_max` with a job user, `file_size`) are
  also the worker's own hard limits from the start, so that even the first microseconds of
  a job, before its own limits land, stay under them. What the job forked or cloned in those
  microseconds (with the worker's limits) is found right after, from /proc (its threads'
  children, the orphans that came back to the worker, their children), and given the limits
  too (`Jail._catch_up`: about 14 us of CPU a job that has not forked, 20 with
  memory_max).
- A cgroup v2 per job where the worker's subtree is delegated: the worker moves itself into
  the job's cgroup for the spawn, so the child is born there, and back.

Without a cgroup a hit is known from the kernel's signal (SIGXCPU, SIGKILL past the CPU
time, SIGXFSZ), from the job's peak memory (its rusage) against `memory_max`, or, with a job
user, from a fork refused for `tasks_max`; with one, from memory.events and pids.events.
"""

from __future__ import annotations

import _socket
import contextlib
import ctypes
import errno
import logging
import math
import os
import pwd
import resource
import shutil
import signal
import socket
import stat
import struct
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controller.joblimits import NO_LIMITS, JobLimits, describe_size
from gen import worker_protocol_pb2 as pb

log = logging.getLogger("worker")

LIMIT = "limit"  # WorkerResponse.reason of a job that hit one of its limits
# A job whose peak memory came this close to memory_max and failed hit it: RLIMIT_AS counts
# the address space, which is always more than the resident memory rusage reports.
MEMORY_SLACK = 64 * 1024 * 1024
_EAGAIN_TEXT = os.strerror(errno.EAGAIN).encode()  # "Resource temporarily unavailable"
_CGROUP_ROOT = Path("/sys/fs/cgroup")


class SetupError(Exception):
    """A job user, a limit or --user that cannot be used; the worker exits 2."""


# ------------------------------------------------------------------ who may talk to us

_PEERCRED = struct.Struct("3i")


def peer_uid(sock: _socket.socket) -> int:
    """The uid of the process at the other end of an accepted Unix connection (SO_PEERCRED;
    -2, nobody's, when the kernel gives none)."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    except OSError:
        return -2
    uid: int = _PEERCRED.unpack(raw)[1]
    return uid


# ------------------------------------------------------------------ users


@dataclass(frozen=True, slots=True)
class JobUser:
    """Who a slot's jobs run as: a uid and its own gid, no supplementary group."""

    uid: int
    gid: int
    name: str


def resolve_job_user(text: str) -> JobUser:
    """A user name, or a uid (digits); a uid with no passwd entry runs with gid = uid."""
    text = text.strip()
    if text.isdigit():
        uid = int(text)
        try:
            entry = pwd.getpwuid(uid)
        except KeyError:
            return _checked(JobUser(uid, uid, text))
        return _checked(JobUser(uid, entry.pw_gid, entry.pw_name))
    try:
        entry = pwd.getpwnam(text)
    except KeyError:
        raise SetupError(f"--job-user {text!r}: no such user") from None
    return _checked(JobUser(entry.pw_uid, entry.pw_gid, entry.pw_name))


def _checked(user: JobUser) -> JobUser:
    if user.uid == 0 or user.gid == 0:
        raise SetupError(f"--job-user {user.name!r}: a job never runs as root (uid or gid 0)")
    if user.uid >= 2**32 - 1:
        raise SetupError(f"--job-user {user.name!r}: not a valid uid")
    return user


# ------------------------------------------------------------------ capabilities (--user)

_PR_SET_KEEPCAPS = 8
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_PR_SET_CHILD_SUBREAPER = 36
_CAP_VERSION_3 = 0x20080522
CAP_KILL, CAP_SETGID, CAP_SETUID = 5, 6, 7


class _CapHeader(ctypes.Structure):
    _fields_ = (("version", ctypes.c_uint32), ("pid", ctypes.c_int))


class _CapData(ctypes.Structure):
    _fields_ = (
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    )


def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, arg: int, arg3: int = 0) -> None:
    if _libc().prctl(option, arg, arg3, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def set_capabilities(caps: Sequence[int]) -> None:
    """Keep exactly `caps` (effective and permitted; none inheritable, none ambient)."""
    mask = 0
    for cap in caps:
        mask |= 1 << cap
    header = _CapHeader(_CAP_VERSION_3, 0)
    data = (_CapData * 2)(_CapData(mask, mask, 0), _CapData(0, 0, 0))
    if _libc().capset(ctypes.byref(header), data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"capset: {os.strerror(err)}")
    with contextlib.suppress(OSError):  # no ambient set before Linux 4.3: nothing to clear
        _prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL)


def capabilities() -> tuple[int, int]:
    """(effective, permitted) capability masks of this process, from /proc."""
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return int(fields.get("CapEff", "0"), 16), int(fields.get("CapPrm", "0"), 16)


def become(user: str, *, keep_job_caps: bool) -> None:
    """`worker --user USER`: a worker started as root runs as USER from here on, keeping
    CAP_SETUID, CAP_SETGID and CAP_KILL when it starts jobs as job users, nothing else."""
    name: str | None = None
    try:
        entry = pwd.getpwnam(user) if not user.isdigit() else pwd.getpwuid(int(user))
        uid, gid, name = entry.pw_uid, entry.pw_gid, entry.pw_name
    except KeyError:
        if not user.isdigit():
            raise SetupError(f"--user {user!r}: no such user") from None
        uid = gid = int(user)  # a uid with no passwd entry: gid = uid, no groups
    if os.geteuid() != 0:
        if os.geteuid() == uid:
            return  # already that user (started by systemd's User=, or by hand)
        raise SetupError(f"--user {user!r}: only a worker started as root can switch users")
    if uid == 0:
        raise SetupError(f"--user {user!r} is root: give the user the worker runs as")
    try:
        if keep_job_caps:
            _prctl(_PR_SET_KEEPCAPS, 1)
        if keep_job_caps or name is None:
            os.setgroups([])  # what a job would inherit: nothing
        else:
            os.initgroups(name, gid)
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        if keep_job_caps:
            set_capabilities((CAP_KILL, CAP_SETGID, CAP_SETUID))
            _prctl(_PR_SET_KEEPCAPS, 0)
    except OSError as exc:
        raise SetupError(f"--user {user!r}: cannot switch: {exc}") from None


# ------------------------------------------------------------------ rlimits

_RLIMITS: tuple[tuple[str, int], ...] = (
    ("memory_max", resource.RLIMIT_AS),
    ("cpu_time", resource.RLIMIT_CPU),
    ("file_size", resource.RLIMIT_FSIZE),
    ("open_files", resource.RLIMIT_NOFILE),
    ("tasks_max", resource.RLIMIT_NPROC),
)


def rlimit_plan(
    limits: JobLimits, hard: dict[int, int], *, per_user: bool
) -> list[tuple[int, tuple[int, int]]]:
    """The (resource, (soft, hard)) pairs a job gets; never above what the worker has
    (`hard`: only a process with CAP_SYS_RESOURCE may raise a hard limit). RLIMIT_NPROC
    counts every process of the job's real uid, so it is set only with a job user."""
    plan: list[tuple[int, tuple[int, int]]] = []
    for name, res in _RLIMITS:
        value = getattr(limits, name)
        if value is None or (res == resource.RLIMIT_NPROC and not per_user):
            continue
        cap = hard[res]
        if res == resource.RLIMIT_CPU:
            soft = max(1, math.ceil(value))
            pair = (soft, soft + 1)  # SIGXCPU at the limit, SIGKILL a second later
        else:
            pair = (int(value), int(value))
        if cap != resource.RLIM_INFINITY:
            pair = (min(pair[0], cap), min(pair[1], cap))
        plan.append((res, pair))
    return plan


# ------------------------------------------------------------------ cgroup v2


class Cgroup:
    """A delegated cgroup v2 subtree: the worker in a leaf of its own (`worker`), each job in
    `job-N` beside it. Every path is under `root`, so a plain directory stands in for
    cgroupfs in tests."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.home = root / "worker"
        self._count = 0

    @staticmethod
    def find(proc_cgroup: Path = Path("/proc/self/cgroup"), mount: Path = _CGROUP_ROOT) -> Path:
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
        if not str(path).startswith(str(_CGROUP_ROOT)):
            shutil.rmtree(path, ignore_errors=True)


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot write {path}: {exc.strerror}") from None


# ------------------------------------------------------------------ the jail


@dataclass(slots=True)
class Outcome:
    """What the jail says about one finished command: usage, and the limit it hit."""

    usage: pb.Usage
    limit: str = ""  # "CPU time limit 60 s", or "" when no limit was hit


class Jail:
    """How a worker's `--exec` jobs start: as whom, under which ceilings, in which cgroup.

    `spawn` starts one job (posix_spawn under the job user, limits applied, its cgroup
    entered); `finish` reads what it used and whether it hit a limit; `clean` empties the
    slot's private TMPDIR before the next job. Without a job user, ceilings or cgroup it
    does nothing a plain posix_spawn would not."""

    def __init__(
        self,
        job_user: JobUser | None = None,
        ceilings: JobLimits = NO_LIMITS,
        cgroup: Cgroup | None = None,
        tmp_base: str | None = None,
    ) -> None:
        self.job_user = job_user
        self.ceilings = ceilings
        self.cgroup = cgroup
        self.tmpdir: str | None = None
        # SHARED_TEMP_DIRS' mtimes when last looked at, and when (see _remove_owned).
        self._shared_seen: dict[str, tuple[int, float] | None] = {}
        self._hard = {res: resource.getrlimit(res)[1] for _, res in _RLIMITS}
        self._own_uids = os.getresuid()  # real and saved taken back after each spawn
        self._own_gids = os.getresgid()
        self._tmp_base = tmp_base
        self._dirty = False
        self._children = -1  # /proc/self/task/PID/children, kept open: re-read per job
        # What a job inherits from the worker as it is (set on the worker itself in setup):
        # no prlimit needed for those.
        self._inherited: dict[int, tuple[int, int]] = {}
        self._plans: dict[JobLimits, list[tuple[int, tuple[int, int]]]] = {}
        self._mapped_early = False  # the last job mapped past memory_max before it landed

    @property
    def active(self) -> bool:
        return self.job_user is not None or not self.ceilings.is_empty() or self.cgroup is not None

    def describe(self) -> str:
        """The start line: `limits: setrlimit` or `limits: cgroup v2 PATH`."""
        if self.cgroup is not None:
            return f"limits: cgroup v2 {self.cgroup.root}"
        return "limits: setrlimit"

    def setup(self) -> None:
        """Once, before any job: the worker's own groups and hard ceilings, its subreaper
        role, and the job user's TMPDIR. SetupError when the job user cannot be taken."""
        user = self.job_user
        if user is not None:
            if user.uid == os.geteuid() or user.uid == os.getuid():
                raise SetupError(f"--job-user {user.name!r} is the worker's own user")
            if user.gid in (os.getegid(), os.getgid()):
                raise SetupError(
                    f"--job-user {user.name!r}: its group {user.gid} is the worker's own "
                    "(the socket directory's): a job user needs a group of its own"
                )
            try:
                if os.getgroups():
                    os.setgroups([])  # a job inherits the worker's supplementary groups
                os.setresgid(user.gid, -1, -1)
                os.setresuid(user.uid, -1, -1)
            except OSError as exc:
                raise SetupError(
                    f"--job-user {user.name!r}: cannot take its uid ({exc.strerror}); "
                    "the worker needs root, or CAP_SETUID and CAP_SETGID"
                ) from None
            finally:
                self._restore()
            # Orphans a job leaves (a daemon that left its process group) come back to us.
            with contextlib.suppress(OSError):
                _prctl(_PR_SET_CHILD_SUBREAPER, 1)
                self._children = os.open(
                    f"/proc/self/task/{os.getpid()}/children", os.O_RDONLY | os.O_CLOEXEC
                )
            self._make_tmpdir(user)
        # Ceilings the worker carries itself, so that a job's first moments stay under them.
        own = [("file_size", resource.RLIMIT_FSIZE)]
        if user is not None:
            own.append(("tasks_max", resource.RLIMIT_NPROC))
        for name, res in own:
            value = getattr(self.ceilings, name)
            if value is not None:
                hard = resource.getrlimit(res)[1]
                if hard == resource.RLIM_INFINITY or value < hard:
                    with contextlib.suppress(OSError, ValueError):
                        resource.setrlimit(res, (value, value))
                        self._hard[res] = value
                        self._inherited[res] = (value, value)
        if user is None and self.ceilings.tasks_max is not None and self.cgroup is None:
            log.warning(
                "tasks_max is not enforced: without a job user RLIMIT_NPROC would count "
                "every process of the worker's user, and there is no cgroup"
            )

    def limits_for(self, asked: JobLimits) -> JobLimits:
        """The tighter of the worker's ceilings and what the job asked for."""
        if asked.is_empty():
            return self.ceilings
        return self.ceilings.tighter(asked)

    def env(self, env: dict[str, str]) -> dict[str, str]:
        if self.tmpdir is not None:
            env["TMPDIR"] = self.tmpdir
        return env

    def spawn(self, start: Callable[[bool], int], limits: JobLimits) -> tuple[int, Path | None]:
        """Start one job with `start(resetids)` (a posix_spawn); (its pid, its cgroup)."""
        user = self.job_user
        cgroup_path = None
        if self.cgroup is not None:
            cgroup_path = self.cgroup.create(limits)
            self.cgroup.enter(cgroup_path)
        try:
            if user is not None:
                # Real and saved: posix_spawn may return while the child still has the
                # worker's ids (its exec commits the job user's a moment later), and
                # prlimit asks for the same real, effective and saved ids on both sides.
                os.setresgid(user.gid, -1, user.gid)
                os.setresuid(user.uid, -1, user.uid)
            try:
                pid = start(user is not None)
                self._dirty = True
                self._mapped_early = False
                plan = self._plans.get(limits)
                if plan is None:
                    plan = self._plan(limits)
                try:
                    for res, pair in plan:
                        resource.prlimit(pid, res, pair)
                    if plan:
                        self._catch_up(pid, plan)
                except ProcessLookupError:
                    pass  # it has already ended
                except PermissionError:
                    if not _ended(pid):
                        _kill_now(pid)
                        raise
                except BaseException:
                    _kill_now(pid)
                    raise
            finally:
                if user is not None:
                    self._restore()
        except BaseException:
            if self.cgroup is not None and cgroup_path is not None:
                self.cgroup.leave()
                self.cgroup.remove(cgroup_path)
            raise
        if self.cgroup is not None:
            self.cgroup.leave()
        return pid, cgroup_path

    def _catch_up(self, pid: int, plan: list[tuple[int, tuple[int, int]]]) -> None:
        """The limits of `plan` on every process the job made before they landed on its main
        process `pid` (a fork in its first microseconds inherits the worker's): its threads'
        children, the worker's own children other than `pid` (orphans that came back to it
        as their subreaper, or made with CLONE_PARENT), and their children in turn. Each pass
        reads the children of the main process, of every process found without the limits
        (limited then) and of those new in the last pass; it ends when a pass finds no new
        process. What a process forks once it has the limits inherits them, so only a job
        forking faster than the passes (a fork bomb) keeps them going: after CATCH_UP_ROUNDS
        its processes are killed and the start fails. Called with the job user's real and
        saved ids (what prlimit on its processes asks). A process that cannot be limited (a
        set-user-ID program's) is killed."""
        space = dict(plan).get(resource.RLIMIT_AS, (resource.RLIM_INFINITY,) * 2)[1]
        if space != resource.RLIM_INFINITY and _mapped(pid) > space:
            self._mapped_early = True  # past memory_max before its limit landed: it stops
            os.kill(pid, signal.SIGKILL)  # reaped by its owner, who is watching its pidfd
            return
        seen = {pid}
        escaped = [pid]  # read every pass: an orphan may come back to one of them
        new: list[int] = []
        for _ in range(CATCH_UP_ROUNDS):
            found: list[int] = []
            for parent in escaped + new:
                found += _children(parent)
            if self._children >= 0:  # after them: what their ended children left to us
                with contextlib.suppress(OSError):
                    found += [int(p) for p in os.pread(self._children, 65536, 0).split()]
            new = []
            fresh = False
            for child in found:
                if child in seen:
                    continue
                seen.add(child)
                fresh = True
                if _within(child, plan):
                    # Its children, once: it may have forked before setting them itself.
                    new.append(child)
                    continue
                try:
                    for res, pair in plan:
                        resource.prlimit(child, res, pair)
                except ProcessLookupError:
                    continue  # gone: its children came back to us, or went with it
                except OSError:
                    _kill_now(child)
                    continue
                if space != resource.RLIM_INFINITY and _mapped(child) > space:
                    self._mapped_early = True
                    _kill_now(child)
                    continue
                escaped.append(child)
            if not fresh:
                return
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
        for child in [*escaped, *new]:
            _kill_now(child)
        raise OSError(errno.EAGAIN, "the job forked faster than its limits could be set")

    def _plan(self, limits: JobLimits) -> list[tuple[int, tuple[int, int]]]:
        """The prlimit calls a job with these limits needs (what it inherits from the worker
        left out), kept: most jobs have the same limits."""
        plan = [
            (res, pair)
            for res, pair in rlimit_plan(limits, self._hard, per_user=self.job_user is not None)
            if self._inherited.get(res) != pair
        ]
        if len(self._plans) < 64:
            self._plans[limits] = plan
        return plan

    def _restore(self) -> None:
        ruid, _, suid = self._own_uids
        rgid, _, sgid = self._own_gids
        os.setresuid(ruid, -1, suid)
        os.setresgid(rgid, -1, sgid)

    def finish(
        self,
        code: int,
        rusage: Any,
        wall: float,
        stderr: bytes,
        limits: JobLimits,
        cgroup_path: Path | None,
    ) -> Outcome:
        """What one ended job used, and the limit it hit ("" if none)."""
        cpu = rusage.ru_utime + rusage.ru_stime if rusage is not None else 0.0
        max_rss = rusage.ru_maxrss * 1024 if rusage is not None else 0
        usage = pb.Usage(wall=wall, cpu=cpu, max_rss=max_rss)
        limit = ""
        if cgroup_path is not None and self.cgroup is not None:
            usage.memory_peak = self.cgroup.peak(cgroup_path)
            limit = cgroup_limit(cgroup_path, limits)
            self.cgroup.kill(cgroup_path)
            self.cgroup.remove(cgroup_path)
        if not limit and code != 0:
            limit = rlimit_hit(code, cpu, max_rss, stderr, limits, self.job_user is not None)
        if not limit and code != 0 and self._mapped_early and limits.memory_max is not None:
            limit = (
                f"memory limit {describe_size(limits.memory_max)} reached: mapped past it "
                "before its limit landed, killed"
            )
        self._sweep()  # those already back; the rest before the next job
        return Outcome(usage, limit)

    # -------------------------------------------------------------- TMPDIR

    def _make_tmpdir(self, user: JobUser) -> None:
        base = self._tmp_base or tempfile.gettempdir()
        try:
            with self._as_job_user(user):
                self.tmpdir = tempfile.mkdtemp(prefix=f"job-{user.uid}-", dir=base)
        except OSError as exc:
            log.warning("no private TMPDIR for jobs under %s: %s", base, exc)

    @contextlib.contextmanager
    def _as_job_user(self, user: JobUser) -> Any:
        """File system access as the job user (effective ids), back to our own after."""
        euid, egid = os.geteuid(), os.getegid()
        os.setresgid(-1, user.gid, -1)
        os.setresuid(-1, user.uid, -1)
        try:
            yield
        finally:
            os.setresuid(-1, euid, -1)
            os.setresgid(-1, egid, -1)

    def clean(self) -> None:
        """Before the next job: empty the slot's TMPDIR (as the job user, which owns what is
        in it), and stop whatever the last job left that came back to us as an orphan."""
        if not self._dirty:
            return
        self._dirty = False
        self._sweep()
        if self.tmpdir is None or self.job_user is None:
            return
        # Looked at every time: a timestamp would not do (a file made within the same clock
        # tick as the last cleaning leaves the directory's ctime as it was).
        with self._as_job_user(self.job_user):
            _empty(self.tmpdir)
            for shared in SHARED_TEMP_DIRS:
                self._shared_seen[shared] = _remove_owned(
                    shared, self.job_user.uid, self._shared_seen.get(shared), self.tmpdir
                )

    def ended(self, pid: int) -> None:
        """The job's main process `pid` has exited (not reaped yet): stop what it left that
        came back to us, so that nothing of it holds its stdout open."""
        self._sweep(keep=pid)

    def _sweep(self, keep: int = 0) -> None:
        """Stop the orphans a job left (not `keep`, its main process); if they keep coming
        faster than they are stopped, every process of the job user."""
        if self._children >= 0 and not reap_orphans(self._children, keep):
            log.warning("a job's processes outran the cleaning: stopping all of its user's")
            if self.job_user is not None:
                kill_user(self.job_user.uid)
            reap_orphans(self._children, keep)

    def close(self) -> None:
        """At the worker's end: every process of its job user is stopped (the worker is no
        longer there to be their subreaper), and its TMPDIR goes."""
        if self.job_user is not None:
            kill_user(self.job_user.uid)
        self._dirty = True
        self.clean()
        if self._children >= 0:
            os.close(self._children)
            self._children = -1
        if self.tmpdir is not None and self.job_user is not None:
            with contextlib.suppress(OSError), self._as_job_user(self.job_user):
                os.rmdir(self.tmpdir)
            self.tmpdir = None


# The temporary directories every user may write to: what a job user leaves there (outside
# its TMPDIR) is removed before the slot's next job too, so that job cannot read it.
SHARED_TEMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm")


# Seconds a directory's mtime must be older than a look at it before an unchanged mtime
# proves that nothing was made in it since: a timestamp moves in clock ticks, at most 10 ms
# apart (HZ 100) where they are coarse.
SETTLED = 0.05


def _remove_owned(
    directory: str, uid: int, seen: tuple[int, float] | None, keep: str | None = None
) -> tuple[int, float] | None:
    """Remove the entries of `directory` that `uid` owns (run as that uid: in a sticky
    directory it can remove only its own, and nothing is followed through a symlink).
    `seen`: (its mtime, when we looked) at the last look, which is skipped when nothing was
    made there since; returns what to pass next time. `keep`: a path left alone (the slot's
    own TMPDIR, emptied apart)."""
    try:
        mtime = os.stat(directory).st_mtime_ns
    except OSError:
        return None
    if seen is not None and seen[0] == mtime and mtime / 1e9 < seen[1] - SETTLED:
        return seen
    looked = time.time()
    try:
        with os.scandir(directory) as entries:
            owned = [
                e for e in entries if e.path != keep and e.stat(follow_symlinks=False).st_uid == uid
            ]
    except OSError:
        return None
    for entry in owned:
        try:
            if entry.is_dir(follow_symlinks=False):
                _make_writable(entry.path)
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                os.unlink(entry.path)
        except OSError as exc:
            log.warning("cannot remove %s a job left: %s", entry.path, exc)
    if owned:  # removing changed the mtime: look again next time
        return None
    return mtime, looked


def _empty(directory: str) -> None:
    try:
        entries = os.listdir(directory)
    except OSError:
        return
    for name in entries:
        path = os.path.join(directory, name)
        try:
            if stat.S_ISDIR(os.lstat(path).st_mode):
                _make_writable(path)
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
        except OSError as exc:
            log.warning("cannot remove %s a job left: %s", path, exc)


def _make_writable(top: str) -> None:
    """A job may leave directories it made unreadable or unwritable: open them up (their
    owner may) so that rmtree can go through."""
    with contextlib.suppress(OSError):
        os.chmod(top, 0o700)
    for root, dirs, _ in os.walk(top):
        for name in dirs:
            with contextlib.suppress(OSError, NotImplementedError):
                os.chmod(os.path.join(root, name), 0o700, follow_symlinks=False)


# Rounds of reap_orphans before it gives up: a chain of processes, each the parent of the
# next, comes back one link a round (a kill reaped, its child is ours).
ORPHAN_ROUNDS = 20_000


def reap_orphans(children_fd: int, keep: int = 0) -> bool:
    """Kill and reap what came back to us as a subreaper: processes a job started and left
    running outside its process group (its own processes are gone by now). `children_fd`:
    /proc/self/task/PID/children, read again from its start; `keep`: a child left alone.
    False if some were still coming after ORPHAN_ROUNDS."""
    mine = str(keep).encode()
    for _ in range(ORPHAN_ROUNDS):  # each round takes the orphans the last round's kills made
        try:
            children = [pid for pid in os.pread(children_fd, 65536, 0).split() if pid != mine]
        except OSError:
            return True
        if not children:
            return True
        for pid in children:
            _kill_now(int(pid))
    return False


def kill_user(uid: int) -> None:
    """SIGKILL every process running as `uid` (a job user's: nothing else runs as it)."""
    me = os.getpid()
    for _ in range(8):  # a process forking meanwhile: its child is found next round
        found = False
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit() or int(entry.name) == me:
                continue
            try:
                if entry.stat().st_uid != uid:
                    continue
                os.kill(int(entry.name), signal.SIGKILL)
                found = True
            except OSError:
                continue
        if not found:
            return


# Passes of Jail._catch_up before a job is given up (each finds what the last one's prlimit
# calls raced with; a pass that finds nothing ends it, most often the first).
CATCH_UP_ROUNDS = 1000


def _children(pid: int) -> list[int]:
    """The children of every thread of process `pid` ([] once it has ended). A thread that
    ends while it is read hands its children to another: read again then."""
    for _ in range(100):
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return []
        found: list[int] = []
        for tid in tasks:
            try:
                fd = os.open(f"/proc/{pid}/task/{tid}/children", os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                break  # that thread ended: its children moved, maybe to one already read
            try:
                data = chunk = os.read(fd, 65536)  # one read, unless it filled the buffer
                while len(chunk) > 65536 - 32:
                    chunk = os.read(fd, 65536)
                    data += chunk
            finally:
                os.close(fd)
            found += [int(child) for child in data.split()]
        else:
            return found
    return found


def _mapped(pid: int) -> int:
    """The bytes of address space process `pid` has mapped (0 once it has ended)."""
    try:
        fd = os.open(f"/proc/{pid}/statm", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        return int(os.read(fd, 256).split(maxsplit=1)[0]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0
    finally:
        os.close(fd)


_PAGE = os.sysconf("SC_PAGE_SIZE")


def _within(pid: int, plan: list[tuple[int, tuple[int, int]]]) -> bool:
    """Whether process `pid` already runs at or under every limit of `plan` (inherited from
    a parent that had them, or set by itself); True once it has ended."""
    try:
        for res, (soft, hard) in plan:
            now_soft, now_hard = resource.prlimit(pid, res)
            if _above(now_soft, soft) or _above(now_hard, hard):
                return False
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return True


def _above(value: int, limit: int) -> bool:
    if value == resource.RLIM_INFINITY:
        return limit != resource.RLIM_INFINITY
    return limit != resource.RLIM_INFINITY and value > limit


def _ended(pid: int) -> bool:
    """Whether the child has already exited (left for its owner to reap)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_now(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


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


def rlimit_hit(
    code: int, cpu: float, max_rss: int, stderr: bytes, limits: JobLimits, per_user: bool
) -> str:
    """The limit a failed job hit, as far as setrlimit lets the worker know ("" if none)."""
    # A signal ends the job itself (negative code) or a command its shell ran (128 + it).
    signals = {-code, code - 128}
    if limits.cpu_time is not None and (
        # rusage counts CPU by ticks, a little short of the kernel's own limit check
        signal.SIGXCPU in signals or (signal.SIGKILL in signals and cpu >= 0.75 * limits.cpu_time)
    ):
        return f"CPU time limit {limits.cpu_time:g} s"
    if limits.file_size is not None and signal.SIGXFSZ in signals:
        return f"file size limit {describe_size(limits.file_size)}"
    if (
        limits.memory_max is not None
        and max_rss + min(MEMORY_SLACK, limits.memory_max // 4) >= limits.memory_max
    ):
        return (
            f"memory limit {describe_size(limits.memory_max)} reached "
            f"(peak {describe_size(max_rss)} resident)"
        )
    if limits.tasks_max is not None and per_user and _EAGAIN_TEXT in stderr:
        return f"process limit {limits.tasks_max}: a fork was refused"
    return ""


def handler_usage(start_wall: float, start_cpu: float, cpu_now: Callable[[], float]) -> pb.Usage:
    """A --handler job's usage: its wall and CPU time (the thread's, or the process's for an
    async one) and the worker's peak resident memory."""
    return pb.Usage(
        wall=time.perf_counter() - start_wall,
        cpu=max(0.0, cpu_now() - start_cpu),
        max_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    )

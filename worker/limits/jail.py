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

import contextlib
import errno
import logging
import os
import resource
import signal
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controller.joblimits import NO_LIMITS, JobLimits, describe_size
from gen import worker_protocol_pb2 as pb
from worker.errors import SetupError
from worker.limits.cgroups import Cgroup, cgroup_limit
from worker.limits.leftovers import SHARED_TEMP_DIRS, empty_dir, remove_owned
from worker.limits.processes import (
    children_of,
    exited,
    kill_now,
    kill_user,
    mapped_bytes,
    reap_orphans,
    within_plan,
)
from worker.limits.rlimits import RLIMITS, rlimit_hit, rlimit_plan
from worker.limits.users import PR_SET_CHILD_SUBREAPER, JobUser, prctl

log = logging.getLogger("worker")

# Passes of Jail._catch_up before a job is given up (each finds what the last one's prlimit
# calls raced with; a pass that finds nothing ends it, most often the first).
CATCH_UP_ROUNDS = 1000


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
        # SHARED_TEMP_DIRS' mtimes when last looked at, and when (see remove_owned).
        self._shared_seen: dict[str, tuple[int, float] | None] = {}
        self._hard = {res: resource.getrlimit(res)[1] for _, res in RLIMITS}
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
                prctl(PR_SET_CHILD_SUBREAPER, 1)
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
                    if not exited(pid):
                        kill_now(pid)
                        raise
                except BaseException:
                    kill_now(pid)
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
        if space != resource.RLIM_INFINITY and mapped_bytes(pid) > space:
            self._mapped_early = True  # past memory_max before its limit landed: it stops
            os.kill(pid, signal.SIGKILL)  # reaped by its owner, who is watching its pidfd
            return
        seen = {pid}
        escaped = [pid]  # read every pass: an orphan may come back to one of them
        new: list[int] = []
        for _ in range(CATCH_UP_ROUNDS):
            found: list[int] = []
            for parent in escaped + new:
                found += children_of(parent)
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
                if within_plan(child, plan):
                    # Its children, once: it may have forked before setting them itself.
                    new.append(child)
                    continue
                try:
                    for res, pair in plan:
                        resource.prlimit(child, res, pair)
                except ProcessLookupError:
                    continue  # gone: its children came back to us, or went with it
                except OSError:
                    kill_now(child)
                    continue
                if space != resource.RLIM_INFINITY and mapped_bytes(child) > space:
                    self._mapped_early = True
                    kill_now(child)
                    continue
                escaped.append(child)
            if not fresh:
                return
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
        for child in [*escaped, *new]:
            kill_now(child)
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
            empty_dir(self.tmpdir)
            for shared in SHARED_TEMP_DIRS:
                self._shared_seen[shared] = remove_owned(
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

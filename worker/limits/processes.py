"""A job's processes, found and stopped through /proc: the children of every thread of a
process, the orphans that come back to the worker as their subreaper, every process of a job
user, and whether one already runs under a plan of rlimits."""

from __future__ import annotations

import contextlib
import os
import resource
import signal

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
            kill_now(int(pid))
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


def children_of(pid: int) -> list[int]:
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


def mapped_bytes(pid: int) -> int:
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


def within_plan(pid: int, plan: list[tuple[int, tuple[int, int]]]) -> bool:
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


def exited(pid: int) -> bool:
    """Whether the child has already exited (left for its owner to reap)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def kill_now(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)

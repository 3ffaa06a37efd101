"""Who a job runs as, and who the worker becomes: `--job-user` (a uid and its own gid, never
root), `--user` (a worker started as root switches to it, keeping only the capabilities it
needs to start jobs as the job user), and the prctl calls both use."""

from __future__ import annotations

import contextlib
import ctypes
import os
import pwd
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from worker.errors import SetupError


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
PR_SET_CHILD_SUBREAPER = 36
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


def prctl(option: int, arg: int, arg3: int = 0) -> None:
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
        prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL)


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
            prctl(_PR_SET_KEEPCAPS, 1)
        if keep_job_caps or name is None:
            os.setgroups([])  # what a job would inherit: nothing
        else:
            os.initgroups(name, gid)
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        if keep_job_caps:
            set_capabilities((CAP_KILL, CAP_SETGID, CAP_SETUID))
            prctl(_PR_SET_KEEPCAPS, 0)
    except OSError as exc:
        raise SetupError(f"--user {user!r}: cannot switch: {exc}") from None

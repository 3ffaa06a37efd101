"""What a job user leaves in the shared temporary directories and the slot's TMPDIR,
removed before the slot's next job."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import time

log = logging.getLogger("worker")

# The temporary directories every user may write to: what a job user leaves there (outside
# its TMPDIR) is removed before the slot's next job too, so that job cannot read it.
SHARED_TEMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm")


# Seconds a directory's mtime must be older than a look at it before an unchanged mtime
# proves that nothing was made in it since: a timestamp moves in clock ticks, at most 10 ms
# apart (HZ 100) where they are coarse.
SETTLED = 0.05


def remove_owned(
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


def empty_dir(directory: str) -> None:
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

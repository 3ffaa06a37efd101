"""main.sock's place: the socket directory checked before serving, and main.sock bound
without ever taking the place of a live controller.

A socket directory that others may write to is refused; a main.sock file already there is
replaced only when nobody answers a pulse on it.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
from pathlib import Path

from controller import wire
from controller.errors import StartupError
from controller.transport import listen_unix
from gen import worker_protocol_pb2 as pb

log = logging.getLogger("controller")

# Pending connections the kernel queues on main.sock; a burst of workers starting
# at once (or a flood) should not see ECONNREFUSED.
LISTEN_BACKLOG = 1024


def prepare_socket_dir(path: Path) -> os.stat_result:
    """Create the socket directory if needed and check it is safe to serve from: a directory
    that others may write to (sticky or not) would let anyone put a socket of their own
    where workers or the controller look for one."""
    try:
        path.mkdir(mode=0o750, parents=True, exist_ok=True)
        st = path.stat()
    except OSError as exc:
        raise StartupError(f"socket_dir {path}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise StartupError(f"socket_dir {path} is not a directory")
    if st.st_mode & stat.S_IWOTH:
        raise StartupError(
            f"socket_dir {path} is world-writable (mode {stat.S_IMODE(st.st_mode):o}); "
            "anyone could replace the sockets in it: chmod o-w it"
        )
    return st


def answers_a_pulse(path: Path, timeout: float) -> bool:
    """Whether a controller serves `path`: it answers a pulse (one for worker id 0, which
    no worker has, so nothing changes) within `timeout` seconds. A socket nobody listens
    on, or one that accepts and stays silent, does not."""
    probe = pb.WorkerPulse(type=pb.PULSE_OK, worker_id=0, next_pulse=1)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(str(path))
            sock.sendall(wire.encode_frame(probe))
            data = b""
            while wire.whole_frame(pb.PulseResponse, data, wire.MAX_PULSE_EXTRA) is None:
                chunk = sock.recv(4096)
                if not chunk or len(data) > 4096:
                    return False
                data += chunk
        except (OSError, wire.RemoteProtocolError):
            return False
    return True


def bind_main_socket(path: Path, timeout: float = 2.0) -> socket.socket:
    """Listen on main.sock, replacing a stale file (nobody answers a pulse there within
    `timeout`) but never a live controller."""
    if path.exists() or path.is_symlink():
        if answers_a_pulse(path, timeout):
            raise StartupError(f"another controller is already serving on {path}")
        log.info("removing stale %s", path)
        path.unlink(missing_ok=True)
    try:
        # Workers in the socket directory's group must be able to connect.
        return listen_unix(path, LISTEN_BACKLOG, 0o660)
    except OSError as exc:
        # strerror is None for a path longer than a Unix socket's address (107 bytes).
        raise StartupError(f"socket_dir: cannot listen on {path}: {exc.strerror or exc}") from None


def file_identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the file at `path`, not following a symlink (None: none there)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino

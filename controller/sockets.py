"""Unix-socket helpers shared by the controller, the worker and the tests."""

from __future__ import annotations

import os
import socket as stdsocket
from pathlib import Path

import trio


def listen_unix(path: Path, backlog: int, mode: int = 0o660) -> trio.socket.SocketType:
    """Bind and listen on `path` with file mode `mode`.

    Binds synchronously: a local bind takes microseconds, and trio's own
    `bind` hops to a thread for it, which also lets a MockClock jump meanwhile.
    """
    sock = stdsocket.socket(stdsocket.AF_UNIX, stdsocket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        os.chmod(path, mode)
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return trio.socket.from_stdlib_socket(sock)

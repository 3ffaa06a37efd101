"""Unix-socket transport: listen, accept, dial, and one request/answer exchange.

Sockets are plain non-blocking stdlib sockets; waiting goes through
`trio.lowlevel.wait_readable` / `wait_writable` only when the kernel says
"not yet". On a Unix socket most operations complete at once, and this path
costs about half of trio's SocketStream with a cancel scope per read.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import trio
from google.protobuf.message import Message

from controller import wire

# A full listen backlog makes a non-blocking Unix connect fail with EAGAIN and no
# completion event: retry after this pause until the timeout.
CONNECT_RETRY = 0.001


def listen_unix(path: Path, backlog: int, mode: int = 0o660) -> socket.socket:
    """Bind and listen on `path` with file mode `mode` (synchronously: a local bind
    takes microseconds, and trio's own bind hops to a thread, letting a MockClock jump)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        os.chmod(path, mode)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


async def accept(listener: socket.socket) -> socket.socket:
    """The next connection, non-blocking."""
    while True:
        try:
            conn, _ = listener.accept()
        except BlockingIOError:
            await trio.lowlevel.wait_readable(listener)
            continue
        conn.setblocking(False)
        return conn


async def connect_unix(path: str | Path, timeout: float) -> socket.socket:
    """A connected non-blocking socket; OSError when nobody listens, PeerTimeout when full."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    deadline = trio.current_time() + timeout
    try:
        while True:
            try:
                sock.connect(str(path))
                return sock
            except BlockingIOError:
                if trio.current_time() >= deadline:
                    raise wire.PeerTimeout(
                        f"{path}: listen backlog full for {timeout:g} s"
                    ) from None
                await trio.sleep(CONNECT_RETRY)
    except BaseException:
        sock.close()
        raise


async def exchange(
    path: str | Path,
    msg: Message,
    answer_type: type[wire.M],
    extra: bytes = b"",
    *,
    timeout: float,
    max_extra_size: int = wire.DEFAULT_MAX_EXTRA_SIZE,
) -> tuple[wire.M, bytes]:
    """Dial `path`, send one frame, read the one frame that answers it, close."""
    sock = await connect_unix(path, timeout)
    with sock:
        await wire.send_frame(sock, msg, extra, timeout=timeout)
        return await wire.recv_frame(
            sock, answer_type, timeout=timeout, max_extra_size=max_extra_size
        )

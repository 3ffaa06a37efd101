"""The HTTP door's connections: accepting them, counting them, and HTTP/1.1 only.

hypercorn speaks HTTP on each connection (its `TCPServer`); this module owns
the rest, so that nobody on the network can stop the controller or starve it:

- `serve_connections` accepts on the listening sockets itself. At most
  `max_connections` are open at once; one past that is accepted and closed at
  once. An accept that fails for want of a descriptor (or of kernel memory) is
  logged, at most once per 30 s, and tried again after a pause
  (controller/shell/descriptors.py); the controller goes on. A connection
  whose handling fails is closed alone, and the failure is contained
  (controller/containment.py: the first of a kind with its traceback, then a
  count every 30 s), so no client can flood the log.
- `OneOneStream` sits under hypercorn on each connection and keeps it at
  HTTP/1.1: a connection that opens with the HTTP/2 preface ("PRI *
  HTTP/2.0") is closed before hypercorn sees it, and a `101 Switching
  Protocols` (hypercorn's answer to `Upgrade: h2c`) is never sent: the
  connection is closed instead. Over TLS only "http/1.1" is offered by ALPN.
  It also takes its senders one at a time: hypercorn sends its answers under a
  lock but its end of stream (`send_eof`, when it closes the connection) without
  it, so a client whose broken request makes hypercorn answer and close while
  the handler answers too would otherwise fail the connection (trio's "another
  task is currently sending") with a traceback in the log.

hypercorn's names used here are `TCPServer(app, config, context, state,
stream)`, `WorkerContext(max_requests)` and a server's `idle_task` (the
keep-alive timer that keepalive.py may replace); tests/test_http_conn.py
fails when they change.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from controller.containment import contained
from controller.shell.descriptors import ACCEPT_PAUSE, Throttled, one_connection

log = logging.getLogger("controller.http")

# How a connection that asks for HTTP/2 by prior knowledge begins (RFC 9113, 3.4).
H2_PREFACE = b"PRI * HTTP/2.0\r\n"
# The status line hypercorn writes to switch protocols (h2c upgrade).
SWITCHING = b"HTTP/1.1 101 "


class OneOneStream(trio.abc.HalfCloseableStream):
    """A connection (TCP, or TLS over TCP) that never leaves HTTP/1.1 (see the module's
    docstring).

    Other attributes are the wrapped stream's: hypercorn reads a TCP stream's
    `socket`, and a TLS stream's `do_handshake`, `selected_alpn_protocol` and
    `transport_stream`.
    """

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.transport: Any = stream
        self._head = b""  # the connection's first bytes, until they can be told apart
        self._sending = False  # a send_all or send_eof is under way
        self._turns = trio.lowlevel.ParkingLot()  # senders waiting for it to end
        self.on_receive: Callable[[], None] | None = None  # told of every byte that arrives

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        data: bytes | bytearray = await self.transport.receive_some(max_bytes)
        if data and self.on_receive is not None:
            self.on_receive()
        if len(self._head) < len(H2_PREFACE) and data:
            self._head += bytes(data[: len(H2_PREFACE) - len(self._head)])
            if self._head == H2_PREFACE:
                await self.transport.aclose()
                return b""  # end of stream: hypercorn closes its side
        return data

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if bytes(data[: len(SWITCHING)]) == SWITCHING:
            await self.transport.aclose()
            raise trio.BrokenResourceError("no protocol switch: only HTTP/1.1 is served")
        await self._one_at_a_time(self.transport.send_all, data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.transport.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self._one_at_a_time(self.transport.send_eof)

    async def _one_at_a_time(self, send: Callable[..., Awaitable[None]], *args: Any) -> None:
        """Run one send of the wrapped stream once no other is under way (no checkpoint
        of its own when none is: the common case costs nothing)."""
        while self._sending:
            await self._turns.park()
        self._sending = True
        try:
            await send(*args)
        finally:
            self._sending = False
            self._turns.unpark()

    async def aclose(self) -> None:
        await self.transport.aclose()


Handler = Callable[[trio.abc.Stream], Awaitable[None]]


class Connections:
    """The open connections' count, its cap, and what was refused."""

    def __init__(self, max_connections: int) -> None:
        self.limit = max_connections
        self.open = 0
        self.refused = 0  # closed at once: over the limit
        self.accept_failed = Throttled(log, "HTTP: cannot accept a connection")


async def serve_connections(
    listeners: list[tuple[trio.socket.SocketType, ssl.SSLContext | None]],
    handler: Handler,
    connections: Connections,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Accept on every listener until cancelled; each connection runs `handler` in its
    own task, in TLS where its listener has an SSL context, wrapped in OneOneStream."""
    try:
        async with trio.open_nursery() as nursery:
            for listener, ssl_context in listeners:
                nursery.start_soon(
                    _accept_loop, listener, handler, connections, ssl_context, nursery
                )
            task_status.started()
    finally:
        for listener, _ in listeners:
            listener.close()


async def _accept_loop(
    listener: trio.socket.SocketType,
    handler: Handler,
    connections: Connections,
    ssl_context: ssl.SSLContext | None,
    nursery: trio.Nursery,
) -> None:
    while True:
        try:
            sock, _ = await listener.accept()
        except OSError as exc:
            if one_connection(exc):  # that peer's trouble (ECONNABORTED...)
                continue
            connections.accept_failed(exc.strerror or exc, trio.current_time())
            await trio.sleep(ACCEPT_PAUSE)
            continue
        if connections.open >= connections.limit:
            connections.refused += 1
            sock.close()
            continue
        connections.open += 1
        nursery.start_soon(_run, sock, handler, connections, ssl_context)


async def _run(
    sock: trio.socket.SocketType,
    handler: Handler,
    connections: Connections,
    ssl_context: ssl.SSLContext | None,
) -> None:
    try:
        stream: trio.abc.Stream = trio.SocketStream(sock)
        if ssl_context is not None:
            stream = trio.SSLStream(stream, ssl_context, server_side=True, https_compatible=True)
        await handler(OneOneStream(stream))
    except Exception as exc:  # one connection's failure is that connection's alone
        contained("an HTTP connection", exc, trio.current_time())
    finally:
        connections.open -= 1
        sock.close()

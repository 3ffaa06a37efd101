"""The HTTP door's connections: accepting them, counting them, and HTTP/1.1 only.

hypercorn speaks HTTP on each connection (its `TCPServer`); this module owns
the rest, so that nobody on the network can stop the controller or starve it:

- `serve_connections` accepts on the listening sockets itself. At most
  `max_connections` are open at once, and at most `max_connections_per_client`
  from one IP address; one past either is accepted and closed at once (a dict
  lookup: nothing scales with the connections open). An accept that fails for
  want of a descriptor (or of kernel memory) is logged, at most once per 30 s,
  and tried again after a pause (controller/shell/descriptors.py); the
  controller goes on. A connection whose handling fails is closed alone, and
  the failure is contained (controller/containment.py: the first of a kind
  with its traceback, then a count every 30 s), so no client can flood the log.
- A connection counts until it has ended: the client closed it (end of stream,
  or a reset) or the controller did (an answer with `Connection: close`, an
  idle timeout). hypercorn itself waits for every task of the connection
  before it returns, its keep-alive timer included, which would hold the
  place for the whole idle time after a one-request connection; so at the end
  the timer stops at once (`OneOneServer`, keepalive.IdleTimer.end), and
  whatever else still runs gets `END_GRACE` to finish (a client that
  half-closes after its request still gets its answer) and is then cancelled.
- `OneOneStream` sits under hypercorn on each connection and keeps it at
  HTTP/1.1: a connection that opens with the HTTP/2 preface ("PRI *
  HTTP/2.0") is closed before hypercorn sees it, and a `101 Switching
  Protocols` is never sent (the connection would be closed instead). Over TLS
  only "http/1.1" is offered by ALPN.
  It also takes its senders one at a time: hypercorn sends its answers under a
  lock but its end of stream (`send_eof`, when it closes the connection) without
  it, so a client whose broken request makes hypercorn answer and close while
  the handler answers too would otherwise fail the connection (trio's "another
  task is currently sending") with a traceback in the log.
- `OneOneProtocol` is hypercorn's HTTP/1.1 protocol less its protocol switches:
  a request with `Upgrade: h2c` is answered as any other (RFC 9110 lets a
  server ignore the header: `curl --http2 http://...` gets its HTTP/1.1
  answer), so is one offering a WebSocket, and a "PRI * HTTP/2.0" request
  later in a connection reaches the router, which answers 505. The answers
  hypercorn makes itself to a request it cannot read (400, 431, 501) carry the
  JSON error object, as every error does.

hypercorn's names used here are `TCPServer(app, config, context, state,
stream)` with its `protocol` (a `ProtocolWrapper` holding an `H11Protocol` as
its `protocol`), `H11Protocol._check_protocol(request)`,
`_create_stream(request)`, `_send_error_response(status)` and `_send_h11_event(event)`,
`WorkerContext(max_requests)` and a server's `idle_task` (the keep-alive timer
that keepalive.py may replace); tests/test_http_conn.py and tests/test_hostile_http.py
fail when they change.
"""

from __future__ import annotations

import functools
import json
import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

import h11
import trio
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.tcp_server import TCPServer

from controller.containment import contained
from controller.shell.descriptors import ACCEPT_PAUSE, Throttled, one_connection

log = logging.getLogger("controller.http")

# How a connection that asks for HTTP/2 by prior knowledge begins (RFC 9113, 3.4).
H2_PREFACE = b"PRI * HTTP/2.0\r\n"
# The status line hypercorn would write to switch protocols (h2c upgrade).
SWITCHING = b"HTTP/1.1 101 "
# Seconds what still runs on a connection that ended may take to finish (a client that
# half-closed after its request still reads its answer); then it is cancelled, so that a
# connection frees its place well within a second of its end.
END_GRACE = 0.5
# What the answers hypercorn makes itself say (a request it cannot read).
PROTOCOL_ERRORS = {
    400: "the request is not well-formed HTTP/1.1",
    431: "the request's head is too large",
    501: "the request's transfer coding is not supported (chunked is)",
}


class OneOneStream(trio.abc.HalfCloseableStream):
    """A connection (TCP, or TLS over TCP) that never leaves HTTP/1.1 (see the module's
    docstring), and that tells `on_end` once it has ended.

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
        # Each called once, when the connection ends: end of stream or a failed read (the
        # client closed it), or closed here (the controller did).
        self.on_end: list[Callable[[], None]] = []
        self.ended = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        try:
            data: bytes | bytearray = await self.transport.receive_some(max_bytes)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self._end()
            raise
        if not data:
            self._end()
            return data
        if self.on_receive is not None:
            self.on_receive()
        if len(self._head) < len(H2_PREFACE):
            self._head += bytes(data[: len(H2_PREFACE) - len(self._head)])
            if self._head == H2_PREFACE:
                await self.aclose()
                return b""  # end of stream: hypercorn closes its side
        return data

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if bytes(data[: len(SWITCHING)]) == SWITCHING:
            await self.aclose()
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
        try:
            await self.transport.aclose()
        finally:
            self._end()

    def _end(self) -> None:
        if self.ended:
            return
        self.ended = True
        for hook in self.on_end:
            hook()


class OneOneProtocol(H11Protocol):
    """hypercorn's HTTP/1.1 protocol that never switches to HTTP/2 (see the module's
    docstring). A connection's protocol becomes one by `OneOneServer`."""

    async def _check_protocol(self, event: h11.Request) -> None:
        """hypercorn's own switches to HTTP/2 here (h2c, "PRI *"): none is made."""

    async def _create_stream(self, request: h11.Request) -> None:
        """hypercorn's own, less its WebSocket upgrade: a request offering one is answered
        as plain HTTP/1.1 (its Upgrade header left out), as an h2c one is."""
        headers = request.headers
        if any(name == b"upgrade" for name, _ in headers):
            request = h11.Request(
                method=request.method,
                target=request.target,
                http_version=request.http_version,
                headers=[(n, v) for n, v in headers.raw_items() if n.lower() != b"upgrade"],
            )
        await super()._create_stream(request)

    async def _send_error_response(self, status_code: int) -> None:
        """hypercorn's answer to a request it cannot read, with the JSON error object."""
        message = PROTOCOL_ERRORS.get(status_code, "the request cannot be read")
        body = json.dumps({"code": status_code, "message": message}, separators=(",", ":"))
        data = body.encode()
        headers = [
            (b"content-length", b"%d" % len(data)),
            (b"content-type", b"application/json"),
            (b"connection", b"close"),
            *self.config.response_headers("h11"),
        ]
        await self._send_h11_event(h11.Response(status_code=status_code, headers=headers))
        await self._send_h11_event(h11.Data(data=data))
        await self._send_h11_event(h11.EndOfMessage())


class OneOneServer(TCPServer):
    """hypercorn's TCPServer speaking `OneOneProtocol`, whose keep-alive timer stops once
    the connection has ended (keepalive.IdleTimer.end, when the timer is one)."""

    @property
    def protocol(self) -> Any:
        return self._wrapper

    @protocol.setter
    def protocol(self, wrapper: Any) -> None:
        # TCPServer.run makes the connection's ProtocolWrapper, which holds an H11Protocol
        # (or an H2Protocol, never chosen here: ALPN offers only http/1.1).
        if type(wrapper.protocol) is H11Protocol:
            wrapper.protocol.__class__ = OneOneProtocol
        self._wrapper = wrapper

    async def run(self) -> None:
        stream: Any = self.stream
        if isinstance(stream, OneOneStream):
            stream.on_end.append(self._ended)
        await super().run()

    def _ended(self) -> None:
        end = getattr(self.idle_task, "end", None)
        if end is not None:
            end()


Handler = Callable[[trio.abc.Stream], Awaitable[None]]


class Connections:
    """The open connections' count, in all and by client address, their caps, and what was
    refused."""

    def __init__(self, max_connections: int, max_per_client: int = 64) -> None:
        self.limit = max_connections
        self.per_client = max_per_client
        self.open = 0
        self.by_client: dict[str, int] = {}  # open connections by IP address (none: absent)
        self.refused = 0  # closed at once: over a limit
        self.accept_failed = Throttled(log, "HTTP: cannot accept a connection")

    def admit(self, client: str) -> bool:
        """Count a new connection from `client` in, or False when it is over a limit."""
        held = self.by_client.get(client, 0)
        if self.open >= self.limit or held >= self.per_client:
            self.refused += 1
            return False
        self.open += 1
        self.by_client[client] = held + 1
        return True

    def release(self, client: str) -> None:
        """A connection from `client` has been closed."""
        self.open -= 1
        held = self.by_client[client] - 1
        if held:
            self.by_client[client] = held
        else:
            del self.by_client[client]


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
            sock, address = await listener.accept()
        except OSError as exc:
            if one_connection(exc):  # that peer's trouble (ECONNABORTED...)
                continue
            connections.accept_failed(exc.strerror or exc, trio.current_time())
            await trio.sleep(ACCEPT_PAUSE)
            continue
        client = address[0] if isinstance(address, tuple) else str(address)
        if not connections.admit(client):
            sock.close()
            continue
        nursery.start_soon(_run, sock, handler, connections, ssl_context, client)


async def _run(
    sock: trio.socket.SocketType,
    handler: Handler,
    connections: Connections,
    ssl_context: ssl.SSLContext | None,
    client: str,
) -> None:
    try:
        stream: trio.abc.Stream = trio.SocketStream(sock)
        if ssl_context is not None:
            stream = trio.SSLStream(stream, ssl_context, server_side=True, https_compatible=True)
        connection = OneOneStream(stream)
        with trio.CancelScope() as scope:
            connection.on_end.append(functools.partial(_wind_down, scope))
            await handler(connection)
    except Exception as exc:  # one connection's failure is that connection's alone
        contained("an HTTP connection", exc, trio.current_time())
    finally:
        connections.release(client)
        sock.close()


def _wind_down(scope: trio.CancelScope) -> None:
    """The connection ended: what still runs on it has END_GRACE to finish."""
    scope.deadline = min(scope.deadline, trio.current_time() + END_GRACE)

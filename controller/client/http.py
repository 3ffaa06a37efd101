"""HTTP/1.1 for the client library and the poller: requests over kept connections, plain
or TLS, directly or through a proxy.

`HttpPool` (blocking, shared by threads) and `AsyncHttpPool` (anyio: asyncio or
trio) send a request and return the whole answer as an `Answer` (status and
body bytes). Both keep idle connections for the next request, so a job's
`POST` and its `GET ?wait=` cost no TCP (or TLS) handshake. The protocol is
controller/client/httpwire.py (sans-IO); the two pools only move its bytes.

Where they go is an `Endpoint` (controller/client/http_endpoint.py): the server, the
path prefix, TLS and the proxy a URL and the environment name.

Why not httpx: it spent ~550 us of CPU per request here, more than the
controller's server side (docs/client.md).

A kept connection the server has closed meanwhile (its keep-alive timeout) is
noticed before use by a zero-timeout poll, and a request on a reused
connection that fails before any byte of an answer came back is sent once more
on a new connection: the server closed it without reading the request.
Failures raise `OSError`s: `ConnectionError` (refused, reset, closed early, a
proxy's refusal, a certificate not trusted), `TimeoutError` (no answer within
`timeout` seconds).
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import anyio
import anyio.abc
from anyio.streams.tls import TLSStream

from controller.client.http_endpoint import Endpoint, connection_error, endpoint
from controller.client.httpwire import (
    Answer,
    Exchange,
    Headers,
    StreamedAnswer,
    Tunnel,
    encode_json,
    head_lines,
    target,
)
from controller.tokens import token_problem

__all__ = ["Answer", "AsyncHttpPool", "HttpPool", "Streamed"]

# What one recv asks for.
READ_SIZE = 64 * 1024
# A connection idle this long is closed rather than reused: the controller drops
# idle connections after 5 s, and a request should not race that.
KEEP_IDLE = 4.0
# Idle connections kept per pool (more are closed after use).
MAX_IDLE = 64


def _peer_closed(fd: int) -> bool:
    """Whether the server closed an idle kept connection (or wrote to it unasked): it is
    readable then (one poll; poll, not select, which fails for descriptors over 1023)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    try:
        return bool(poller.poll(0))
    except OSError:
        return True


class _Base:
    def __init__(
        self,
        url: str | Endpoint,
        *,
        token: str | None,
        timeout: float,
        ca_file: str | None,
    ) -> None:
        self.endpoint = where = url if isinstance(url, Endpoint) else endpoint(url, ca_file=ca_file)
        self.timeout = timeout
        self.where = str(where)
        head: Headers = [(b"Host", where.authority.encode("idna"))]
        if token:
            why = token_problem(token)
            if why:
                raise ValueError(why)
            head.append((b"Authorization", f"Bearer {token}".encode("ascii")))
        self._head = head_lines(head)
        self._json_head = head_lines([*head, (b"Content-Type", b"application/json")])
        self._tunnel_head: Headers = []
        if where.proxy is not None and where.proxy.authorization:
            self._tunnel_head = [(b"Proxy-Authorization", where.proxy.authorization.encode())]

    def _prepare(
        self, path: str, json: Any, query: dict[str, Any] | None, timeout: float | None
    ) -> tuple[str, bytes, bytes, float]:
        """A request's target (under the prefix), header lines, body and timeout."""
        body = encode_json(json)
        limit = self.timeout if timeout is None else timeout
        path = self.endpoint.prefix + target(path, query)
        return path, self._json_head if body else self._head, body, limit

    def _dialed(self) -> tuple[str, int]:
        """The address a new connection goes to: the proxy's, or the server's."""
        proxy = self.endpoint.proxy
        return (proxy.host, proxy.port) if proxy else (self.endpoint.host, self.endpoint.port)

    def _tunnel(self) -> tuple[Tunnel, bytes]:
        where = self.endpoint
        assert where.proxy is not None
        tunnel = Tunnel(where.authority, str(where.proxy))
        return tunnel, tunnel.request(self._tunnel_head)

    def _failure(
        self, exc: BaseException, reused: bool, exchange: Exchange, limit: float
    ) -> OSError | None:
        """What a failed exchange raises; None: send it again on a new connection (a reused
        one the server had closed before it read the request)."""
        # A blocking socket's SO_RCVTIMEO/SO_SNDTIMEO running out is EAGAIN.
        timed_out = isinstance(exc, TimeoutError | BlockingIOError)
        if timed_out:
            return TimeoutError(f"{self.where}: no answer within {limit:g} s")
        if reused and not exchange.got_bytes:
            return None
        return connection_error(exc, self.where)


class _Kept:
    """A blocking connection: its socket, when it was last used, and the timeout it holds."""

    __slots__ = ("since", "sock", "timeout")

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        self.sock = sock
        self.since = 0.0
        self.timeout = -1.0
        self.set_timeout(timeout)

    def set_timeout(self, timeout: float) -> None:
        """The timeout as SO_RCVTIMEO/SO_SNDTIMEO on a blocking socket: Python's own socket
        timeout would poll() before every send and recv, a system call each. A TLS socket
        takes Python's (OpenSSL reads a kernel timeout as a want-read, not a timeout)."""
        if timeout != self.timeout:
            self.timeout = timeout
            if isinstance(self.sock, ssl.SSLSocket):
                self.sock.settimeout(timeout)
                return
            # 0 would mean "no timeout" to the kernel; past 10^6 s is as good as none.
            timeout = min(max(timeout, 0.001), 1e6)
            whole = int(timeout)
            value = struct.pack("ll", whole, int((timeout - whole) * 1e6))
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


class HttpPool(_Base):
    """Blocking requests over kept connections; one pool may be shared by threads."""

    def __init__(
        self,
        url: str | Endpoint,
        *,
        token: str | None = None,
        timeout: float = 60.0,
        ca_file: str | None = None,
    ) -> None:
        super().__init__(url, token=token, timeout=timeout, ca_file=ca_file)
        self._idle: list[_Kept] = []
        self._lock = threading.Lock()
        self._closed = False
        self._pid = os.getpid()

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        query: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> Answer:
        target, headers, body, limit = self._prepare(path, json, query, timeout)
        while True:
            kept, reused = self._take(limit)
            sock = kept.sock
            exchange = Exchange()
            try:
                kept.set_timeout(limit)
                sock.sendall(exchange.request(method, target, headers, body))
                answer = None
                while answer is None:
                    answer = exchange.feed(sock.recv(READ_SIZE))
            except OSError as exc:  # ConnectionError, TimeoutError and the like
                sock.close()
                failure = self._failure(exc, reused, exchange, limit)
                if failure is None:
                    continue
                raise failure from None
            except BaseException:
                sock.close()
                raise
            self._give_back(kept, exchange)
            return answer

    @contextlib.contextmanager
    def stream(
        self,
        method: str,
        path: str,
        *,
        query: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> Iterator[Streamed]:
        """A request whose answer's body is read as it comes (a followed job output), on a
        connection of its own, closed at the end: `timeout` bounds the connection and the
        answer's head; the body then takes as long as the server keeps it open."""
        target, headers, body, limit = self._prepare(path, None, query, timeout)
        sock = self._connect(limit)
        with sock:
            answer = StreamedAnswer(method)
            first = bytearray()
            try:
                sock.settimeout(limit)
                sock.sendall(Exchange().request(method, target, headers, body))
                while not answer.status:
                    first += answer.feed(sock.recv(READ_SIZE))
                sock.settimeout(None)
            except TimeoutError:
                raise TimeoutError(f"{self.where}: no answer within {limit:g} s") from None
            except OSError as exc:
                raise connection_error(exc, self.where) from None
            yield Streamed(sock, answer, bytes(first), self.where)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for kept in idle:
            kept.sock.close()

    def _take(self, timeout: float) -> tuple[_Kept, bool]:
        if self._pid != os.getpid():
            self._forked()
        now = time.monotonic()
        while True:
            with self._lock:
                if self._closed:
                    raise ValueError("the client is closed")
                kept = self._idle.pop() if self._idle else None
            if kept is None:
                break
            if now - kept.since < KEEP_IDLE and not _peer_closed(kept.sock.fileno()):
                return kept, True
            kept.sock.close()
        return _Kept(self._connect(timeout), timeout), False

    def _connect(self, timeout: float) -> socket.socket:
        """A new connection (see `_open`), its failures said as the client says them."""
        try:
            return self._open(timeout)
        except TimeoutError:
            raise TimeoutError(f"{self.where}: no connection within {timeout:g} s") from None
        except OSError as exc:
            raise connection_error(exc, self.where) from None

    def _open(self, timeout: float) -> socket.socket:
        """A new connection, through the proxy's tunnel and TLS when they are asked for; the
        whole set-up within `timeout`."""
        sock = socket.create_connection(self._dialed(), timeout=timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.endpoint.proxy is not None:
                tunnel, data = self._tunnel()
                sock.sendall(data)
                while not tunnel.feed(sock.recv(READ_SIZE)):
                    pass
            if self.endpoint.tls is not None:
                sock = self.endpoint.tls.wrap_socket(sock, server_hostname=self.endpoint.host)
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)
        return sock

    def _forked(self) -> None:
        """In a child after fork(): the kept connections are the parent's (two processes
        on one connection would read each other's answers); close this process's copies."""
        self._pid = os.getpid()
        self._lock = threading.Lock()  # a fork may copy it held by a thread that is gone
        idle, self._idle = self._idle, []
        for kept in idle:
            kept.sock.close()

    def _give_back(self, kept: _Kept, exchange: Exchange) -> None:
        if exchange.reusable():
            with self._lock:
                if not self._closed and len(self._idle) < MAX_IDLE:
                    kept.since = time.monotonic()
                    self._idle.append(kept)
                    return
        kept.sock.close()


class Streamed:
    """An answer whose body is read as it comes (`HttpPool.stream`): `status`, then its
    body's bytes by iterating; a connection that fails midway raises ConnectionError."""

    def __init__(self, sock: socket.socket, answer: StreamedAnswer, first: bytes, where: str):
        self._sock = sock
        self._answer = answer
        self._first = first
        self._where = where
        self.status = answer.status

    def __iter__(self) -> Iterator[bytes]:
        if self._first:
            yield self._first
        while not self._answer.ended:
            try:
                piece = self._answer.feed(self._sock.recv(READ_SIZE))
            except OSError as exc:
                raise connection_error(exc, self._where) from None
            if piece:
                yield piece

    def read(self, limit: int = 1024 * 1024) -> bytes:
        """The rest of the body, up to `limit` bytes (an error's, say)."""
        body = bytearray()
        for piece in self:
            body += piece
            if len(body) >= limit:
                break
        return bytes(body[:limit])


class _AsyncKept:
    """An async connection: its stream, when it was last used, its fd."""

    __slots__ = ("fd", "since", "stream")

    def __init__(self, stream: anyio.abc.ByteStream, fd: int) -> None:
        self.stream = stream
        self.since = 0.0
        self.fd = fd


class AsyncHttpPool(_Base):
    """The same with coroutines, on anyio streams (asyncio or trio)."""

    def __init__(
        self,
        url: str | Endpoint,
        *,
        token: str | None = None,
        timeout: float = 60.0,
        ca_file: str | None = None,
    ) -> None:
        super().__init__(url, token=token, timeout=timeout, ca_file=ca_file)
        self._idle: list[_AsyncKept] = []
        self._closed = False

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        query: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> Answer:
        target, headers, body, limit = self._prepare(path, json, query, timeout)
        while True:
            kept, reused = await self._take(limit)
            stream = kept.stream
            exchange = Exchange()
            try:
                with anyio.fail_after(limit):
                    await stream.send(exchange.request(method, target, headers, body))
                    answer = None
                    while answer is None:
                        answer = exchange.feed(await _receive(stream))
            except (OSError, anyio.BrokenResourceError) as exc:
                await anyio.aclose_forcefully(stream)
                failure = self._failure(exc, reused, exchange, limit)
                if failure is None:
                    continue
                raise failure from None
            except BaseException:  # cancelled mid-exchange: the connection is in no known state
                await anyio.aclose_forcefully(stream)
                raise
            await self._give_back(kept, exchange)
            return answer

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for kept in idle:
            await anyio.aclose_forcefully(kept.stream)

    async def _take(self, timeout: float) -> tuple[_AsyncKept, bool]:
        if self._closed:
            raise ValueError("the client is closed")
        now = time.monotonic()
        while self._idle:
            kept = self._idle.pop()
            if now - kept.since < KEEP_IDLE and not _peer_closed(kept.fd):
                return kept, True
            await anyio.aclose_forcefully(kept.stream)
        try:
            with anyio.fail_after(timeout):
                return await self._connect(), False
        except TimeoutError:
            raise TimeoutError(f"{self.where}: no connection within {timeout:g} s") from None
        except (OSError, anyio.BrokenResourceError) as exc:
            # anyio says "All connection attempts failed" from the reason (a group of them
            # with several addresses): with one, its reason (ConnectionRefusedError...) is ours.
            cause = exc.__cause__
            if isinstance(cause, BaseExceptionGroup) and len(cause.exceptions) == 1:
                cause = cause.exceptions[0]
            raise connection_error(
                cause if isinstance(cause, OSError) else exc, self.where
            ) from None

    async def _connect(self) -> _AsyncKept:
        """A new connection, through the proxy's tunnel and TLS when they are asked for."""
        tcp = await anyio.connect_tcp(*self._dialed())
        stream: anyio.abc.ByteStream = tcp
        try:
            if self.endpoint.proxy is not None:
                tunnel, data = self._tunnel()
                await tcp.send(data)
                while not tunnel.feed(await _receive(tcp)):
                    pass
            if self.endpoint.tls is not None:
                stream = await TLSStream.wrap(
                    tcp,
                    hostname=self.endpoint.host,
                    ssl_context=self.endpoint.tls,
                    standard_compatible=False,
                )
        except BaseException:
            await anyio.aclose_forcefully(tcp)
            raise
        return _AsyncKept(stream, tcp.extra(anyio.abc.SocketAttribute.raw_socket).fileno())

    async def _give_back(self, kept: _AsyncKept, exchange: Exchange) -> None:
        if exchange.reusable() and not self._closed and len(self._idle) < MAX_IDLE:
            kept.since = time.monotonic()
            self._idle.append(kept)
            return
        await anyio.aclose_forcefully(kept.stream)


async def _receive(stream: anyio.abc.ByteStream) -> bytes:
    """What came next; b"" at the end of the stream."""
    try:
        return await stream.receive(READ_SIZE)
    except anyio.EndOfStream:
        return b""

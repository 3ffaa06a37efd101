"""HTTP/1.1 for the client library and the poller: requests over kept connections.

`HttpPool` (blocking, shared by threads) and `AsyncHttpPool` (anyio: asyncio or
trio) send a request and return the whole answer as an `Answer` (status and
body bytes). Both keep idle connections for the next request, so a job's
`POST` and its `GET ?wait=` cost no TCP handshake. The protocol is
controller/client/httpwire.py (sans-IO); the two pools only move its bytes.

Why not httpx: it spent ~550 us of CPU per request here, more than the
controller's server side. Why not h11: its validating state machine cost
~47 us per exchange, a third of a poller's CPU; ours costs ~4
(docs/design-notes.md, "The Python client").

A kept connection the server has closed meanwhile (its keep-alive timeout) is
noticed before use by a zero-timeout poll, and a request on a reused
connection that fails before any byte of an answer came back is sent once more
on a new connection: the server closed it without reading the request.
Failures raise `OSError`s: `ConnectionError` (refused, reset, closed early),
`TimeoutError` (no answer within `timeout` seconds).
"""

from __future__ import annotations

import os
import select
import socket
import struct
import threading
import time
from typing import Any
from urllib.parse import SplitResult, urlsplit

import anyio
import anyio.abc

from controller.client.httpwire import Answer, Exchange, Stale, encode_json, target

__all__ = ["Answer", "AsyncHttpPool", "HttpPool"]

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


def token_problem(token: str) -> str:
    """Why `token` cannot be sent as a bearer token ("" when it can): it goes in a header."""
    if not (token.isascii() and token.isprintable()) or " " in token:
        return "a token is printable ASCII without spaces"
    return ""


def url_port(parts: SplitResult, default: int | None = None) -> int | None:
    """A split URL's port, `default` when it names none, None when it is out of range or not
    a number."""
    try:
        port = parts.port
    except ValueError:
        return None
    return default if port is None else port


def http_address(url: str) -> tuple[str, int]:
    """(host, port) of `http://HOST:PORT` (a trailing slash allowed); ValueError otherwise."""
    parts = urlsplit(url)
    port = url_port(parts)
    if parts.scheme != "http" or not parts.hostname or not port or parts.path not in ("", "/"):
        raise ValueError(f"expected an http://HOST:PORT URL, got {url!r}")
    return parts.hostname, port


class _Base:
    def __init__(self, host: str, port: int, *, token: str | None, timeout: float) -> None:
        self.host = host
        self.port = port
        self.timeout = timeout
        self.where = f"http://{host}:{port}"
        netloc = f"[{host}]" if ":" in host else host
        head = f"Host: {netloc}:{port}\r\n"
        if token:
            why = token_problem(token)
            if why:
                raise ValueError(why)
            head += f"Authorization: Bearer {token}\r\n"
        self._head = head.encode("ascii")
        self._json_head = self._head + b"Content-Type: application/json\r\n"

    def _prepare(
        self, path: str, json: Any, query: dict[str, Any] | None, timeout: float | None
    ) -> tuple[str, bytes, bytes, float]:
        """A request's target, header lines, body and timeout."""
        body = encode_json(json)
        limit = self.timeout if timeout is None else timeout
        return target(path, query), self._json_head if body else self._head, body, limit

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
        return _reason(exc, self.where)


class _Kept:
    """A blocking connection: its socket, when it was last used, and the timeout its socket
    options hold."""

    __slots__ = ("since", "sock", "timeout")

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        self.sock = sock
        self.since = 0.0
        self.timeout = -1.0
        self.set_timeout(timeout)

    def set_timeout(self, timeout: float) -> None:
        """The timeout as SO_RCVTIMEO/SO_SNDTIMEO on a blocking socket: Python's own socket
        timeout would poll() before every send and recv, a system call each."""
        if timeout != self.timeout:
            self.timeout = timeout
            # 0 would mean "no timeout" to the kernel; past 10^6 s is as good as none.
            timeout = min(max(timeout, 0.001), 1e6)
            whole = int(timeout)
            value = struct.pack("ll", whole, int((timeout - whole) * 1e6))
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


class HttpPool(_Base):
    """Blocking requests over kept connections; one pool may be shared by threads."""

    def __init__(self, host: str, port: int, *, token: str | None = None, timeout: float = 60.0):
        super().__init__(host, port, token=token, timeout=timeout)
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
        try:
            sock = socket.create_connection((self.host, self.port), timeout=timeout)
        except TimeoutError:
            raise TimeoutError(f"{self.where}: no connection within {timeout:g} s") from None
        except OSError as exc:
            raise _reason(exc, self.where) from None
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return _Kept(sock, timeout), False

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


class _AsyncKept:
    """An async connection: its stream, when it was last used, its fd."""

    __slots__ = ("fd", "since", "stream")

    def __init__(self, stream: anyio.abc.SocketStream) -> None:
        self.stream = stream
        self.since = 0.0
        self.fd = stream.extra(anyio.abc.SocketAttribute.raw_socket).fileno()


class AsyncHttpPool(_Base):
    """The same with coroutines, on anyio streams (asyncio or trio)."""

    def __init__(self, host: str, port: int, *, token: str | None = None, timeout: float = 60.0):
        super().__init__(host, port, token=token, timeout=timeout)
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
                        try:
                            data = await stream.receive(READ_SIZE)
                        except anyio.EndOfStream:
                            data = b""
                        answer = exchange.feed(data)
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
                stream = await anyio.connect_tcp(self.host, self.port)
        except TimeoutError:
            raise TimeoutError(f"{self.where}: no connection within {timeout:g} s") from None
        except OSError as exc:
            # anyio says "All connection attempts failed" from the reason (a group of them
            # with several addresses): with one, its reason (ConnectionRefusedError...) is ours.
            cause = exc.__cause__
            if isinstance(cause, BaseExceptionGroup) and len(cause.exceptions) == 1:
                cause = cause.exceptions[0]
            raise _reason(cause if isinstance(cause, OSError) else exc, self.where) from None
        return _AsyncKept(stream), False

    async def _give_back(self, kept: _AsyncKept, exchange: Exchange) -> None:
        if exchange.reusable() and not self._closed and len(self._idle) < MAX_IDLE:
            kept.since = time.monotonic()
            self._idle.append(kept)
            return
        await anyio.aclose_forcefully(kept.stream)


def _reason(exc: BaseException, where: str) -> ConnectionError:
    """A ConnectionError naming the server (ConnectionRefusedError and the like keep their type)."""
    why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    kind = type(exc) if isinstance(exc, ConnectionError) and type(exc) is not Stale else None
    return (kind or ConnectionError)(f"{where}: {why or type(exc).__name__}")

"""HTTP/1.1 for the client library and the poller: keep-alive connections on h11.

`HttpPool` (blocking, shared by threads) and `AsyncHttpPool` (anyio: asyncio or
trio) send a request and return the whole answer as an `Answer` (status and
body bytes). Both keep idle connections for the next request, so a job's
`POST` and its `GET ?wait=` cost no TCP handshake. The protocol is h11's
sans-IO state machine (`_Exchange`); the two pools only move its bytes.

Why not httpx: it spent ~550 us of CPU per request here, more than the
controller's server side; this layer spends ~100 (bench/http_bench.py).

A kept connection the server has closed meanwhile (its keep-alive timeout) is
noticed before use by a non-blocking peek, and a request on a reused
connection that fails before any byte of an answer came back is sent once more
on a new connection: the server closed it without reading the request.
Failures raise `OSError`s: `ConnectionError` (refused, reset, closed early),
`TimeoutError` (no answer within `timeout` seconds).
"""

from __future__ import annotations

import json
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import anyio
import anyio.abc
import h11

# A job object with a payload and a result of max_extra_size (16 MiB) each, base64,
# fits with room for a raised limit; a longer answer is a broken or foreign server.
MAX_ANSWER = 256 * 1024 * 1024
# The most an answer's status line and headers may take.
MAX_HEAD = 64 * 1024
# What one recv asks for.
READ_SIZE = 64 * 1024
# A connection idle this long is closed rather than reused: the controller drops
# idle connections after 5 s, and a request should not race that.
KEEP_IDLE = 4.0
# Idle connections kept per pool (more are closed after use).
MAX_IDLE = 64


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


class _Stale(ConnectionError):
    """A reused connection failed before any byte of the answer: safe to send again."""


class _Exchange:
    """One request and its answer on an h11 connection (sans-IO)."""

    def __init__(self, conn: h11.Connection) -> None:
        self._conn = conn
        self._status = 0
        self._body: list[bytes] = []
        self._size = 0
        self.got_bytes = False

    def request(
        self, method: str, target: str, headers: list[tuple[str, str]], body: bytes
    ) -> bytes:
        send = self._conn.send
        if body or method in ("POST", "PUT"):
            headers = [*headers, ("Content-Length", str(len(body)))]
        out = send(h11.Request(method=method, target=target, headers=headers)) or b""
        if body:
            out += send(h11.Data(data=body)) or b""
        return out + (send(h11.EndOfMessage()) or b"")

    def feed(self, data: bytes) -> Answer | None:
        """Bytes read (b"" at the end of the stream); the answer once it is whole."""
        if data:
            self.got_bytes = True
        conn = self._conn
        conn.receive_data(data)
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                if not data:  # the end of the stream inside an answer
                    raise self._closed() from None
                raise ConnectionError(f"a malformed HTTP answer: {exc}") from None
            if event is h11.NEED_DATA:
                if not data:
                    raise self._closed()
                return None
            if isinstance(event, h11.Response):
                self._status = event.status_code
            elif isinstance(event, h11.Data):
                self._size += len(event.data)
                if self._size > MAX_ANSWER:
                    raise ConnectionError(f"an HTTP answer over {MAX_ANSWER} bytes")
                self._body.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                return Answer(self._status, b"".join(self._body))
            elif isinstance(event, h11.ConnectionClosed):
                raise self._closed()

    def reusable(self) -> bool:
        conn = self._conn
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
            return True
        return False

    def _closed(self) -> ConnectionError:
        if self.got_bytes:
            return ConnectionError("the server closed the connection mid-answer")
        return _Stale("the server closed the connection without answering")


def _target(path: str, query: dict[str, Any] | None) -> str:
    return f"{path}?{urlencode(query)}" if query else path


def _encode(body: Any) -> bytes:
    return b"" if body is None else json.dumps(body, separators=(",", ":")).encode()


def _peer_closed(fd: int) -> bool:
    """Whether the server closed an idle kept connection (or wrote to it unasked): it is
    readable then (one poll)."""
    try:
        return bool(select.select([fd], [], [], 0)[0])
    except (OSError, ValueError):
        return True


class _Base:
    def __init__(self, host: str, port: int, *, token: str | None, timeout: float) -> None:
        self.host = host
        self.port = port
        self.timeout = timeout
        self.where = f"http://{host}:{port}"
        netloc = f"[{host}]" if ":" in host else host
        self._headers = [("Host", f"{netloc}:{port}"), ("Accept", "application/json")]
        if token:
            self._headers.append(("Authorization", f"Bearer {token}"))
        self._json_headers = [*self._headers, ("Content-Type", "application/json")]

    def _headers_for(self, body: bytes) -> list[tuple[str, str]]:
        return self._json_headers if body else self._headers


class _Kept:
    """A blocking connection: its socket, its h11 state, when it was last used, and the
    timeout its socket options hold."""

    __slots__ = ("h11", "since", "sock", "timeout")

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        self.sock = sock
        self.h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
        self.since = 0.0
        self.timeout = -1.0
        self.set_timeout(timeout)

    def set_timeout(self, timeout: float) -> None:
        """The timeout as SO_RCVTIMEO/SO_SNDTIMEO on a blocking socket: Python's own socket
        timeout would poll() before every send and recv, a system call each."""
        if timeout != self.timeout:
            whole = int(timeout)
            value = struct.pack("ll", whole, int((timeout - whole) * 1e6))
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
            self.timeout = timeout


class HttpPool(_Base):
    """Blocking requests over kept connections; one pool may be shared by threads."""

    def __init__(self, host: str, port: int, *, token: str | None = None, timeout: float = 60.0):
        super().__init__(host, port, token=token, timeout=timeout)
        self._idle: list[_Kept] = []
        self._lock = threading.Lock()
        self._closed = False

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        query: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> Answer:
        target = _target(path, query)
        body = _encode(json)
        headers = self._headers_for(body)
        limit = self.timeout if timeout is None else timeout
        while True:
            kept, reused = self._take(limit)
            sock = kept.sock
            exchange = _Exchange(kept.h11)
            try:
                kept.set_timeout(limit)
                sock.sendall(exchange.request(method, target, headers, body))
                answer = None
                while answer is None:
                    answer = exchange.feed(sock.recv(READ_SIZE))
            except (ConnectionError, OSError) as exc:
                sock.close()
                # SO_RCVTIMEO/SO_SNDTIMEO running out is EAGAIN
                timed_out = isinstance(exc, TimeoutError | BlockingIOError)
                if reused and not exchange.got_bytes and not timed_out:
                    continue  # the server had closed it: a new connection
                if timed_out:
                    raise TimeoutError(f"{self.where}: no answer within {limit:g} s") from None
                raise _reason(exc, self.where) from None
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

    def _give_back(self, kept: _Kept, exchange: _Exchange) -> None:
        if exchange.reusable():
            with self._lock:
                if not self._closed and len(self._idle) < MAX_IDLE:
                    kept.since = time.monotonic()
                    self._idle.append(kept)
                    return
        kept.sock.close()


class _AsyncKept:
    """An async connection: its stream, its h11 state, when it was last used, its fd."""

    __slots__ = ("fd", "h11", "since", "stream")

    def __init__(self, stream: anyio.abc.SocketStream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
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
        target = _target(path, query)
        body = _encode(json)
        headers = self._headers_for(body)
        limit = self.timeout if timeout is None else timeout
        while True:
            kept, reused = await self._take(limit)
            stream = kept.stream
            exchange = _Exchange(kept.h11)
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
            except (ConnectionError, OSError, anyio.BrokenResourceError) as exc:
                await anyio.aclose_forcefully(stream)
                if reused and not exchange.got_bytes and not isinstance(exc, TimeoutError):
                    continue  # the server had closed it: a new connection
                if isinstance(exc, TimeoutError):
                    raise TimeoutError(f"{self.where}: no answer within {limit:g} s") from None
                raise _reason(exc, self.where) from None
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

    async def _give_back(self, kept: _AsyncKept, exchange: _Exchange) -> None:
        if exchange.reusable() and not self._closed and len(self._idle) < MAX_IDLE:
            kept.since = time.monotonic()
            self._idle.append(kept)
            return
        await anyio.aclose_forcefully(kept.stream)


def _reason(exc: BaseException, where: str) -> ConnectionError:
    """A ConnectionError naming the server (ConnectionRefusedError and the like keep their type)."""
    why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    kind = type(exc) if isinstance(exc, ConnectionError) and type(exc) is not _Stale else None
    return (kind or ConnectionError)(f"{where}: {why or type(exc).__name__}")

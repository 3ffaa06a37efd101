"""HTTP/1.1 for the client library and the poller: requests over kept connections.

`HttpPool` (blocking, shared by threads) and `AsyncHttpPool` (anyio: asyncio or
trio) send a request and return the whole answer as an `Answer` (status and
body bytes). Both keep idle connections for the next request, so a job's
`POST` and its `GET ?wait=` cost no TCP handshake. `_Exchange` is the protocol,
sans-IO: the bytes of a request, then the answer's framing (Content-Length,
chunked, or until close); the two pools only move its bytes.

Why not httpx: it spent ~550 us of CPU per request here, more than the
controller's server side. Why not h11: its validating state machine cost
~47 us per exchange, a third of a poller's CPU; this one costs ~8
(docs/design-notes.md, "The Python client").

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
    """One request and its answer on a kept connection (sans-IO): `request` gives the bytes
    to send, `feed` takes what came back until the answer is whole.

    The answer's framing is HTTP/1.1's: a Content-Length, chunks, or (no length, no
    chunks) everything until the server closes; 1xx interim answers are skipped; 204
    and 304 have no body. Malformed bytes raise ConnectionError and nothing else.
    """

    __slots__ = (
        "_body",
        "_buf",
        "_chunk_at",
        "_framing",
        "_length",
        "_method",
        "_status",
        "got_bytes",
        "keep",
    )

    def __init__(self) -> None:
        self._buf = bytearray()
        self._status = 0  # 0 until the head is read
        self._framing = ""  # "length", "chunked" or "close"
        self._length = 0
        self._body = bytearray()
        self._chunk_at = 0  # where the next chunk's size line starts in _buf
        self._method = ""
        self.got_bytes = False
        self.keep = True  # whether the connection may serve the next request

    def request(self, method: str, target: str, headers: bytes, body: bytes) -> bytes:
        """`headers`: complete header lines, each ending in CRLF."""
        if not target.startswith("/") or any(c in target for c in " \r\n"):
            raise ValueError(f"not a request target: {target!r}")
        self._method = method
        length = b"Content-Length: %d\r\n" % len(body) if body or method in ("POST", "PUT") else b""
        return b"%s %s HTTP/1.1\r\n%s%s\r\n%s" % (
            method.encode("ascii"),
            target.encode("ascii"),
            headers,
            length,
            body,
        )

    def feed(self, data: bytes) -> Answer | None:
        """Bytes read (b"" at the end of the stream); the answer once it is whole."""
        if data:
            self.got_bytes = True
            self._buf += data
        while self._status == 0 or 100 <= self._status < 200:
            self._status = 0
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > MAX_HEAD:
                    raise ConnectionError(f"an HTTP answer's head over {MAX_HEAD} bytes")
                if not data:
                    raise self._closed()
                return None
            head = bytes(self._buf[:end])
            del self._buf[: end + 4]
            self._read_head(head)
        return self._read_body(not data)

    def reusable(self) -> bool:
        """Whether the connection may carry the next request (the answer was whole)."""
        return self.keep

    def _read_head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        version, _, rest = lines[0].partition(b" ")
        code = rest[:3]
        if version not in (b"HTTP/1.1", b"HTTP/1.0") or len(code) != 3 or not code.isdigit():
            raise ConnectionError(f"a malformed HTTP answer: {lines[0][:80]!r}")
        self._status = status = int(code)
        if status < 100 or status == 101:
            raise ConnectionError(f"an HTTP answer with status {status}")
        connection = b""
        length = -1
        chunked = False
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            if not colon or not name or name != name.strip():
                raise ConnectionError(f"a malformed HTTP header: {line[:80]!r}")
            name = name.lower()
            value = value.strip()
            if name == b"content-length":
                if not value.isdigit() or (length >= 0 and int(value) != length):
                    raise ConnectionError(f"a malformed Content-Length: {value[:40]!r}")
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = value.lower().rsplit(b",", 1)[-1].strip() == b"chunked"
                if not chunked:
                    raise ConnectionError(f"an unknown Transfer-Encoding: {value[:40]!r}")
            elif name == b"connection":
                connection = value.lower()
        if status < 200:
            return  # interim: the real answer follows
        if version == b"HTTP/1.0":
            self.keep = b"keep-alive" in connection
        elif b"close" in connection:
            self.keep = False
        if status in (204, 304) or self._method == "HEAD":
            self._framing, self._length = "length", 0
        elif chunked:
            self._framing = "chunked"
        elif length >= 0:
            if length > MAX_ANSWER:
                raise ConnectionError(f"an HTTP answer over {MAX_ANSWER} bytes")
            self._framing, self._length = "length", length
        else:
            self._framing, self.keep = "close", False

    def _read_body(self, ended: bool) -> Answer | None:
        buf = self._buf
        if self._framing == "length":
            if len(buf) < self._length:
                if ended:
                    raise self._closed()
                return None
            if len(buf) > self._length:
                self.keep = False  # bytes nobody asked for: the connection is not trusted
            return Answer(self._status, bytes(buf[: self._length]))
        if self._framing == "close":
            if len(buf) > MAX_ANSWER:
                raise ConnectionError(f"an HTTP answer over {MAX_ANSWER} bytes")
            return Answer(self._status, bytes(buf)) if ended else None
        while True:  # chunked: size line, data, CRLF; a 0 size, trailers, an empty line
            at = self._chunk_at
            eol = buf.find(b"\r\n", at)
            if eol < 0:
                if len(buf) - at > MAX_HEAD:
                    raise ConnectionError("a malformed chunk size line")
                break
            size_text = bytes(buf[at:eol]).split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise ConnectionError(f"a malformed chunk size: {size_text[:20]!r}") from None
            if size_text.startswith((b"-", b"+")):
                raise ConnectionError(f"a malformed chunk size: {size_text[:20]!r}")
            if size == 0:
                trailers = buf.find(b"\r\n", eol + 2)
                while trailers >= 0 and trailers != eol + 2:  # skip trailer lines
                    eol = trailers
                    trailers = buf.find(b"\r\n", eol + 2)
                if trailers < 0:
                    if len(buf) - at > MAX_HEAD:
                        raise ConnectionError("HTTP trailers too long")
                    break
                if len(buf) > trailers + 2:
                    self.keep = False
                return Answer(self._status, bytes(self._body))
            if len(self._body) + size > MAX_ANSWER:
                raise ConnectionError(f"an HTTP answer over {MAX_ANSWER} bytes")
            start = eol + 2
            if len(buf) < start + size + 2:
                break
            if buf[start + size : start + size + 2] != b"\r\n":
                raise ConnectionError("a malformed chunk: no CRLF after its data")
            self._body += buf[start : start + size]
            self._chunk_at = start + size + 2
        if ended:
            raise self._closed()
        return None

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
        head = f"Host: {netloc}:{port}\r\n"
        if token:
            if not (token.isascii() and token.isprintable()) or " " in token:
                raise ValueError("a token is printable ASCII without spaces")
            head += f"Authorization: Bearer {token}\r\n"
        self._head = head.encode("ascii")
        self._json_head = self._head + b"Content-Type: application/json\r\n"

    def _prepare(
        self, path: str, json: Any, query: dict[str, Any] | None, timeout: float | None
    ) -> tuple[str, bytes, bytes, float]:
        """A request's target, header lines, body and timeout."""
        body = _encode(json)
        limit = self.timeout if timeout is None else timeout
        return _target(path, query), self._json_head if body else self._head, body, limit

    def _failure(
        self, exc: BaseException, reused: bool, exchange: _Exchange, limit: float
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
        target, headers, body, limit = self._prepare(path, json, query, timeout)
        while True:
            kept, reused = self._take(limit)
            sock = kept.sock
            exchange = _Exchange()
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
            exchange = _Exchange()
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

"""HTTP/1.1 for the client library and the poller, sans-IO: the bytes of a request, then
the answer, with no networking at all (controller/client/http.py moves the bytes).

h11 (the parser hypercorn itself uses) decides what an answer is. A fast path reads
the answers the controller sends (HTTP/1.1, a final status, a Content-Length, header
lines in h11's grammar) in ~5 us; every other answer (chunks, no length, 1xx,
HTTP/1.0, a bare LF, a folded header, anything malformed) goes to h11 whole.
tests/test_client_http.py feeds both the same bytes, cut anywhere: the same answer,
or both refuse (ConnectionError, and nothing else).

Why not h11 for every answer: it costs ~50-60 us of CPU per exchange, and that showed
end to end. The HTTP door's jobs/s through the client library, h11 alone and the
hand-written codec this fast path replaces alternating in one run (2 local workers, a
no-op handler, 8 rounds of 1,500 jobs, medians): the blocking Client shared by 16
threads 393 against 562 jobs/s (-30%; -34% in an earlier run of 4 rounds),
AsyncClient with 64 in flight 282 against 352 (-20%).

`Tunnel` is a proxy's CONNECT: once per connection, so it is all h11's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import h11

# A job object with a payload and a result of max_extra_size (16 MiB) each, base64,
# fits with room for a raised limit; a longer answer is a broken or foreign server.
MAX_ANSWER = 256 * 1024 * 1024
# The most an answer's status line and headers may take.
MAX_HEAD = 64 * 1024

Headers = list[tuple[bytes, bytes]]


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


class Stale(ConnectionError):
    """A reused connection failed before any byte of the answer: safe to send again."""


# h11's grammar (h11/_abnf.py), for the fast path's status line and header lines.
_STATUS_LINE = re.compile(rb"HTTP/1\.1 ([0-9]{3})(?: (?:[ \t]|[^\x00\s])*)?")
_FIELD = rb"[^\x00\s]"
_HEADER_LINE = re.compile(
    rb"([-!#$%&'*+.^_`|~0-9a-zA-Z]+):[ \t]*(" + _FIELD + rb"+(?:[ \t]+" + _FIELD + rb"+)*)?[ \t]*"
)
# Where h11 finds the end of a head.
_BLANK_LINE = re.compile(rb"\n\r?\n")


class Exchange:
    """One request and its answer on a kept connection (sans-IO): `request` gives the bytes
    to send, `feed` takes what came back until the answer is whole.

    The fast path reads the answers the controller sends: HTTP/1.1, a final status, a
    Content-Length, header lines as h11's grammar has them. Any other answer (chunks,
    no length, 1xx, HTTP/1.0, a bare LF, a folded or odd header, ...) is handed, every
    byte of it, to h11, which decides; so the answer is h11's in every case, and
    anything malformed raises ConnectionError and nothing else.
    """

    __slots__ = ("_buf", "_h11", "_length", "_method", "_start", "_status", "got_bytes", "keep")

    def __init__(self) -> None:
        self._buf = bytearray()
        self._status = 0  # 0 until the head is read
        self._start = 0  # where the body starts in _buf
        self._length = 0
        self._method = ""
        self._h11: _H11Answer | None = None  # the answer is h11's to read
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
        if self._h11 is not None:
            return self._h11.feed(data)
        buf = self._buf
        buf += data
        if self._status == 0:
            blank = _BLANK_LINE.search(buf)
            if blank is None:
                if len(buf) <= MAX_HEAD and data:
                    return None
                if not buf:
                    raise Stale("the server closed the connection without answering")
                return self._to_h11(data)
            if not self._read_head(blank.start(), blank.end()):
                return self._to_h11(data)
        body_end = self._start + self._length
        if len(buf) < body_end:
            if not data:
                raise ConnectionError("the server closed the connection mid-answer")
            return None
        if len(buf) > body_end:
            self.keep = False  # bytes nobody asked for: the connection is not trusted
        return Answer(self._status, bytes(buf[self._start : body_end]))

    def reusable(self) -> bool:
        """Whether the connection may carry the next request (the answer was whole, and
        neither side asked to close)."""
        return self.keep if self._h11 is None else self._h11.keep

    def _read_head(self, end: int, body: int) -> bool:
        """Read a head the fast path takes (False: it is h11's)."""
        buf = self._buf
        head = bytes(buf[: end - 1])
        crlf = head.count(b"\r\n")
        if buf[end - 1 : end] != b"\r" or body - end != 3 or head.count(b"\n") != crlf:
            return False  # not CRLF CRLF at its end, or a bare LF in it
        if head.count(b"\r") != crlf:
            return False  # a bare CR
        lines = head.split(b"\r\n")
        status_line = _STATUS_LINE.fullmatch(lines[0])
        if status_line is None:
            return False
        status = int(status_line[1])
        length = -1
        for line in lines[1:]:
            field = _HEADER_LINE.fullmatch(line)
            if field is None:
                return False
            name = field[1].lower()
            value = field[2] or b""
            if name == b"content-length":
                if length >= 0 or not value.isdigit() or len(value) > 20:
                    return False
                length = int(value)
            elif name == b"transfer-encoding":
                return False
            elif name == b"connection" and b"close" in value.lower().replace(b" ", b"").split(b","):
                self.keep = False
        if status < 200:
            return False
        if status in (204, 304) or self._method == "HEAD":
            length = 0
        elif length < 0 or length > MAX_ANSWER:
            return False
        self._status, self._length, self._start = status, length, body
        return True

    def _to_h11(self, data: bytes) -> Answer | None:
        self._h11 = _H11Answer(self._method)
        self._h11.got_bytes = self.got_bytes
        raw, self._buf = bytes(self._buf), bytearray()
        if data and raw:
            return self._h11.feed(raw)
        answer = self._h11.feed(raw) if raw else None
        return answer if answer is not None else self._h11.feed(b"")


class _H11Answer:
    """An answer h11 reads (the fast path's exceptions)."""

    __slots__ = ("_body", "_conn", "_status", "got_bytes", "keep")

    def __init__(self, method: str) -> None:
        self._conn = conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
        # The request as h11 needs to know it: the answer's framing depends on its method.
        conn.send(h11.Request(method=method, target="/", headers=[(b"Host", b"-")]))
        conn.send(h11.EndOfMessage())
        self._status = 0
        self._body = bytearray()
        self.got_bytes = False
        self.keep = False

    def feed(self, data: bytes) -> Answer | None:
        if data:
            self.got_bytes = True
        conn = self._conn
        try:
            for event in _events(conn, data):
                if isinstance(event, h11.Response):
                    self._status = event.status_code
                elif isinstance(event, h11.Data):
                    if len(self._body) + len(event.data) > MAX_ANSWER:
                        raise ConnectionError(f"an HTTP answer over {MAX_ANSWER} bytes")
                    self._body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    # Bytes after the answer that nobody asked for: not trusted either.
                    self.keep = conn.their_state is h11.DONE and conn.next_event() is h11.NEED_DATA
                    return Answer(self._status, bytes(self._body))
                elif isinstance(event, h11.ConnectionClosed):
                    if self.got_bytes:
                        raise ConnectionError("the server closed the connection mid-answer")
                    raise Stale("the server closed the connection without answering")
                # InformationalResponse (1xx): the real answer follows.
            return None
        except h11.RemoteProtocolError as exc:
            if not data and self.got_bytes:  # the end of the stream, with an answer begun
                raise ConnectionError(
                    f"the server closed the connection mid-answer ({exc})"
                ) from None
            if "Receive buffer too long" in str(exc):
                raise ConnectionError(f"an HTTP answer's head over {MAX_HEAD} bytes") from None
            raise ConnectionError(f"a malformed HTTP answer: {exc}") from None


class StreamedAnswer:
    """An answer read as it comes (sans-IO), for a body that may last as long as a job runs
    (`GET /job/{id}/output?follow=1`, chunked): `feed` takes what came back and gives the
    body's new bytes; `status` is set once the head is read, `ended` once the body is whole.
    The request is `Exchange.request`'s bytes; the answer is h11's alone (no fast path: one
    exchange a command, not one a job). Anything malformed, or the end of the stream before
    the end of the body, raises ConnectionError."""

    __slots__ = ("_conn", "ended", "status")

    def __init__(self, method: str) -> None:
        self._conn = conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
        # The request as h11 needs to know it: the answer's framing depends on its method.
        conn.send(h11.Request(method=method, target="/", headers=[(b"Host", b"-")]))
        conn.send(h11.EndOfMessage())
        self.status = 0
        self.ended = False

    def feed(self, data: bytes) -> bytes:
        """Bytes read (b"" at the end of the stream); the body's bytes among them."""
        body = bytearray()
        try:
            for event in _events(self._conn, data):
                if isinstance(event, h11.Response):
                    self.status = event.status_code
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    self.ended = True
                    break
                elif isinstance(event, h11.ConnectionClosed):
                    raise ConnectionError("the server closed the connection mid-answer")
        except h11.RemoteProtocolError as exc:
            if not data:
                raise ConnectionError(
                    f"the server closed the connection mid-answer ({exc})"
                ) from None
            raise ConnectionError(f"a malformed HTTP answer: {exc}") from None
        return bytes(body)


class Tunnel:
    """A proxy's CONNECT (sans-IO): `request` gives its bytes, `feed` takes the proxy's
    answer until it is whole: True once the tunnel is open; ConnectionError when the proxy
    refuses or answers something else."""

    __slots__ = ("_conn", "authority", "proxy")

    def __init__(self, authority: str, proxy: str) -> None:
        self._conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
        self.authority = authority
        self.proxy = proxy

    def request(self, headers: Headers) -> bytes:
        conn = self._conn
        head = [(b"Host", self.authority.encode("ascii")), *headers]
        out = conn.send(h11.Request(method="CONNECT", target=self.authority, headers=head))
        return out + conn.send(h11.EndOfMessage())

    def feed(self, data: bytes) -> bool:
        try:
            for event in _events(self._conn, data):
                if isinstance(event, h11.ConnectionClosed):
                    raise ConnectionError(f"proxy {self.proxy} closed the connection")
                if isinstance(event, h11.Response):
                    if not 200 <= event.status_code < 300:
                        why = f"{event.status_code} {event.reason.decode('latin-1')}".strip()
                        raise ConnectionError(
                            f"proxy {self.proxy} refused CONNECT {self.authority}: {why}"
                        )
                    if self._conn.trailing_data[0]:  # it spoke before the client did
                        raise ConnectionError(f"proxy {self.proxy}: bytes after its answer")
                    return True
            return False
        except h11.RemoteProtocolError as exc:
            raise ConnectionError(f"proxy {self.proxy}: a malformed answer: {exc}") from None


def _events(conn: h11.Connection, data: bytes) -> Iterator[object]:
    """What h11 makes of `data` (b"": the end of the stream), event by event, until it needs
    more."""
    conn.receive_data(data)
    while (event := conn.next_event()) not in (h11.NEED_DATA, h11.PAUSED):
        yield event


def target(path: str, query: dict[str, Any] | None) -> str:
    return f"{path}?{urlencode(query)}" if query else path


def encode_json(body: Any) -> bytes:
    return b"" if body is None else json.dumps(body, separators=(",", ":")).encode()


def head_lines(headers: Headers) -> bytes:
    """Header lines, each ending in CRLF, as `Exchange.request` takes them."""
    return b"".join(b"%s: %s\r\n" % (name, value) for name, value in headers)

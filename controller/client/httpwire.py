"""HTTP/1.1 for the client library and the poller, sans-IO: the bytes of a request, then
the answer's framing, with no networking at all (controller/client/http.py moves the bytes).

The answer's framing is HTTP/1.1's: a Content-Length, chunks, or (no length, no chunks)
everything until the server closes; 1xx interim answers are skipped; 204, 304 and HEAD
have no body. Head and body have named caps; malformed bytes raise ConnectionError and
nothing else (tests/test_client_http.py feeds it any framing cut anywhere, and random bytes).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

# A job object with a payload and a result of max_extra_size (16 MiB) each, base64,
# fits with room for a raised limit; a longer answer is a broken or foreign server.
MAX_ANSWER = 256 * 1024 * 1024
# What a chunk size may be written with.
_HEX = b"0123456789abcdefABCDEF"
# The most an answer's status line and headers may take.
MAX_HEAD = 64 * 1024


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


class Exchange:
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
            # Hex digits only: int() would also take "0x1f", "1_f" and a sign.
            if not size_text or size_text.strip(_HEX):
                raise ConnectionError(f"a malformed chunk size: {size_text[:20]!r}")
            size = int(size_text, 16)
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
        return Stale("the server closed the connection without answering")


def target(path: str, query: dict[str, Any] | None) -> str:
    return f"{path}?{urlencode(query)}" if query else path


def encode_json(body: Any) -> bytes:
    return b"" if body is None else json.dumps(body, separators=(",", ":")).encode()

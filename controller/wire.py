"""The one place that knows the Unix-socket wire format (docs/protocol.md).

Every frame is ``<varint length><protobuf message>`` followed, for the
message types that carry an ``extra_size`` field (ControlMsg, WorkerResponse,
and WorkerPulse for PULSE_OUTPUT), by exactly ``extra_size`` raw bytes. Each
connection carries one frame each way.

`FrameDecoder` is the sans-IO half (the shape of wsproto's frame buffer): feed
it whatever bytes arrived, ask it for the frame, and it either returns one,
says it needs more, or raises a `RemoteProtocolError` subclass. Every size a
peer announces is checked against a named cap before anything is allocated.
`whole_frame` is the quick path for a frame that arrived in one read.
`FrameReader` reads a frame from a non-blocking socket without waiting (the
reactor's exchanges use it); `recv_frame` / `send_frame` are the thin trio
half that waits, shared by the controller, the worker and the tests;
`controller.sockets` and `controller.reactor` open, accept and dial the
sockets themselves.
"""

from __future__ import annotations

import _socket
import socket
from collections.abc import Awaitable, Callable
from typing import Final, Generic, NoReturn, TypeVar

import trio
from google.protobuf.message import DecodeError, Message

from gen import worker_protocol_pb2 as pb

# A delimited protobuf header is small (a few scalar fields; a REGISTER's queues and
# labels, which controller/declared.py keeps to 2 KiB of names); 4 KiB is generous
# and bounds what a peer can make us buffer before we know what it wants.
MAX_HEADER_SIZE: Final = 4096
# A uint64 varint never needs more than 10 bytes; an 11th continuation byte is garbage.
MAX_VARINT_BYTES: Final = 10
# Cap on the raw bytes after a WorkerPulse (a PULSE_OUTPUT's output): a worker sends at most
# 16 KiB a pulse (worker/output.py CHUNK), and a hostile one cannot make us hold more.
MAX_PULSE_EXTRA: Final = 64 * 1024
# Default cap on the raw bytes after a message (the `max_extra_size` config key).
DEFAULT_MAX_EXTRA_SIZE: Final = 16 * 1024 * 1024
# One receive call's size: a whole small frame arrives in one read, and a large
# extra payload is copied in big pieces rather than byte by byte.
RECEIVE_CHUNK: Final = 256 * 1024
# The first read of a frame: nearly every frame is a few dozen bytes. Python allocates the
# whole size before the call and shrinks it after; at 256 KiB that is an mmap, an mremap
# and a munmap around every small frame (glibc's mmap threshold is 128 KiB).
FIRST_READ: Final = 64 * 1024

M = TypeVar("M", bound=Message)


class RemoteProtocolError(Exception):
    """The peer sent something this side cannot accept.

    `can_reply` says whether the connection is still in a state where an
    error answer makes sense (the peer is waiting for one); the shells use it
    to decide between answering CTRL_ERR_FAILED and just closing.
    """

    can_reply: bool = True


class VarintTooLong(RemoteProtocolError):
    """The length prefix ran past 10 bytes."""


class HeaderTooLarge(RemoteProtocolError):
    """The length prefix announced a message over MAX_HEADER_SIZE."""


class ExtraTooLarge(RemoteProtocolError):
    """The message announced more extra bytes than max_extra_size."""


class MalformedMessage(RemoteProtocolError):
    """The header bytes are not a valid protobuf message of the expected type."""


class Truncated(RemoteProtocolError):
    """The peer closed its side before sending all it announced."""

    can_reply = False


class PeerTimeout(RemoteProtocolError):
    """The peer went silent for longer than the allowed timeout."""


class ConnectionLost(RemoteProtocolError):
    """The connection broke (reset, refused, gone) in the middle of an exchange."""

    can_reply = False


_HAS_EXTRA: dict[type[Message], bool] = {}


def has_extra(msg_type: type[Message]) -> bool:
    """True for the message types followed by `extra_size` raw bytes (cached: per frame)."""
    known = _HAS_EXTRA.get(msg_type)
    if known is None:
        known = _HAS_EXTRA[msg_type] = "extra_size" in msg_type.DESCRIPTOR.fields_by_name
    return known


def encode_varint(value: int) -> bytes:
    """Base-128 varint, least significant group first (protobuf's encoding)."""
    if value < 0:
        raise ValueError(f"varint must be non-negative, got {value}")
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_frame(msg: Message, extra: bytes = b"") -> bytes:
    """Serialize `msg` delimited, followed by `extra`.

    For messages with an `extra_size` field that field is set to len(extra);
    other messages cannot carry extra bytes.
    """
    if has_extra(type(msg)):
        msg.extra_size = len(extra)  # type: ignore[attr-defined]
    elif extra:
        raise ValueError(f"{type(msg).__name__} carries no extra bytes")
    body = msg.SerializeToString()
    return encode_varint(len(body)) + body + extra


# The ChannelFrame fields (proto/worker_protocol.proto) of each message a channel carries.
CHANNEL_PULSE: Final = 1
CHANNEL_PULSE_RESPONSE: Final = 2
CHANNEL_CONTROL: Final = 3
CHANNEL_RESPONSE: Final = 4
_ANSWERS_TAG: Final = b"\x28"  # field 5, varint
_EXTRA_SIZE_TAG: Final = b"\x30"  # field 6, varint


def encode_channel(field: int, msg: Message, extra: bytes = b"", answers: int = 0) -> bytes:
    """One channel frame: a delimited ChannelFrame holding `msg` in `field` (CHANNEL_...),
    `answers` (a response's ControlType) and `extra_size`, then `extra`. Written field by
    field, as protobuf lays them out: the same bytes as building the ChannelFrame, without
    copying `msg` into it."""
    inner = msg.SerializeToString()
    body = bytes(((field << 3) | 2,)) + encode_varint(len(inner)) + inner
    if answers:
        body += _ANSWERS_TAG + encode_varint(answers)
    if extra:
        body += _EXTRA_SIZE_TAG + encode_varint(len(extra))
    return encode_varint(len(body)) + body + extra


class FrameDecoder(Generic[M]):
    """Incremental parser for one frame of `msg_type` (sans-IO)."""

    def __init__(self, msg_type: type[M], max_extra_size: int = DEFAULT_MAX_EXTRA_SIZE) -> None:
        self._type = msg_type
        self._with_extra = has_extra(msg_type)
        self._max_extra = max_extra_size
        self._buf = bytearray()
        self._msg: M | None = None
        self._extra_size = 0

    def feed(self, data: bytes | bytearray) -> None:
        """Append bytes received from the peer."""
        self._buf += data

    def wanted(self) -> int:
        """A good size for the next receive (at least 1)."""
        if self._msg is not None:
            return max(1, min(self._extra_size - len(self._buf), RECEIVE_CHUNK))
        return RECEIVE_CHUNK

    def next_frame(self) -> tuple[M, bytes] | None:
        """The complete frame, or None while more bytes are needed."""
        if self._msg is None and not self._parse_header():
            return None
        assert self._msg is not None
        if len(self._buf) < self._extra_size:
            return None
        extra = bytes(self._buf[: self._extra_size])
        del self._buf[: self._extra_size]
        return self._msg, extra

    def eof(self) -> NoReturn:
        """The peer closed its side: raise Truncated unless nothing was pending."""
        if self._buf or self._msg is not None:
            raise Truncated(
                f"peer closed after {len(self._buf)} bytes of an incomplete "
                f"{self._type.__name__} frame"
            )
        raise Truncated(f"peer closed before sending a {self._type.__name__}")

    def _parse_header(self) -> bool:
        buf = self._buf
        prefix = _length_prefix(buf, 0, len(buf), self._type)
        if prefix is None:
            return False
        length, pos = prefix
        if len(buf) < pos + length:
            return False
        msg, extra_size = self._decode(bytes(buf[pos : pos + length]))
        del buf[: pos + length]
        self._msg = msg
        self._extra_size = extra_size
        return True

    def _decode(self, body: bytes) -> tuple[M, int]:
        return _decode(self._type, body, self._max_extra)


def _length_prefix(
    buf: bytes | bytearray, pos: int, end: int, msg_type: type[Message]
) -> tuple[int, int] | None:
    """The header length a frame at `pos` announces and where its header starts; None while
    the prefix is still incomplete before `end`. Raises VarintTooLong or HeaderTooLarge."""
    length = 0
    shift = 0
    at = pos
    while True:
        if at >= end:
            if at - pos >= MAX_VARINT_BYTES:
                raise VarintTooLong("length prefix longer than 10 bytes")
            return None
        byte = buf[at]
        length |= (byte & 0x7F) << shift
        at += 1
        if not byte & 0x80:
            break
        if at - pos >= MAX_VARINT_BYTES:
            raise VarintTooLong("length prefix longer than 10 bytes")
        shift += 7
    if length > MAX_HEADER_SIZE:
        raise HeaderTooLarge(
            f"{msg_type.__name__} header of {length} bytes exceeds {MAX_HEADER_SIZE}"
        )
    return length, at


def _decode(msg_type: type[M], body: bytes, max_extra: int) -> tuple[M, int]:
    """The message and the number of extra bytes it announces (checked against the cap)."""
    try:
        msg = msg_type.FromString(body)
    except DecodeError as exc:
        raise MalformedMessage(f"not a valid {msg_type.__name__}: {exc}") from None
    extra_size: int = msg.extra_size if has_extra(msg_type) else 0  # type: ignore[attr-defined]
    if extra_size > max_extra:
        raise ExtraTooLarge(
            f"{msg_type.__name__} announces {extra_size} extra bytes, over the limit of {max_extra}"
        )
    return msg, extra_size


def whole_frame(msg_type: type[M], data: bytes, max_extra: int) -> tuple[M, bytes] | None:
    """The frame at the start of `data` when all of it is there and its header is short.

    The common case on a Unix socket, where one read brings the whole frame;
    None means "use a FrameDecoder" (more bytes to come, or a longer header).
    Raises what the FrameDecoder would raise for the same bytes.
    """
    if data and data[0] < 0x80:
        end = 1 + data[0]  # a one-byte length: a header under 128 bytes
        if len(data) >= end:
            msg, extra_size = _decode(msg_type, data[1:end], max_extra)
            if len(data) >= end + extra_size:
                return msg, data[end : end + extra_size]
    return None


class StreamDecoder(Generic[M]):
    """Incremental parser for a stream of frames of `msg_type` (a worker's channel, sans-IO).

    `feed(data)` returns every frame the bytes complete, in order; the rest waits for the
    next feed. Any split of the same bytes gives the same frames. Each header is checked
    against MAX_HEADER_SIZE and each announced extra size against `max_extra_size` before
    anything is buffered for it; a bad frame raises a `RemoteProtocolError` subclass and
    the decoder is of no further use.
    """

    __slots__ = ("_buf", "_check", "_extra_size", "_max_extra", "_msg", "_type")

    def __init__(
        self,
        msg_type: type[M],
        max_extra_size: int = DEFAULT_MAX_EXTRA_SIZE,
        check: Callable[[M, int], None] | None = None,
    ) -> None:
        """`check(msg, extra_size)`: a further look at each header before its extra bytes
        are buffered (it raises a `RemoteProtocolError` to refuse the frame)."""
        self._check = check
        self._type = msg_type
        self._max_extra = max_extra_size
        self._buf = bytearray()
        self._msg: M | None = None  # a header read whose extra bytes are still coming
        self._extra_size = 0

    @property
    def pending(self) -> bool:
        """Part of a frame is buffered (the peer is in the middle of one)."""
        return bool(self._buf) or self._msg is not None

    def feed(self, data: bytes) -> list[tuple[M, bytes]]:
        frames: list[tuple[M, bytes]] = []
        if not self._buf and self._msg is None:
            # The common case: whole frames and nothing left over; no copy into the buffer.
            pos = self._parse(data, 0, frames)
            if pos < len(data):
                self._buf += data[pos:]
            return frames
        self._buf += data
        pos = self._parse(self._buf, 0, frames)
        del self._buf[:pos]
        return frames

    def _parse(self, buf: bytes | bytearray, pos: int, frames: list[tuple[M, bytes]]) -> int:
        """Frames from `buf` at `pos` on; the position of the first byte not used."""
        end = len(buf)
        while True:
            if self._msg is None:
                prefix = _length_prefix(buf, pos, end, self._type)
                if prefix is None:
                    return pos
                length, at = prefix
                if end < at + length:
                    return pos
                self._msg, self._extra_size = _decode(
                    self._type, bytes(buf[at : at + length]), self._max_extra
                )
                if self._check is not None:
                    self._check(self._msg, self._extra_size)
                pos = at + length
            if end - pos < self._extra_size:
                return pos
            extra = bytes(buf[pos : pos + self._extra_size])
            pos += self._extra_size
            frames.append((self._msg, extra))
            self._msg = None
            self._extra_size = 0


async def _ready_by(
    wait: Callable[[socket.socket], Awaitable[None]], sock: socket.socket, deadline: float
) -> bool:
    """Wait for the socket to be ready; False if `deadline` came first."""
    with trio.move_on_at(deadline):
        await wait(sock)
        return True
    return False


# Every receive and send on a connection's socket says this instead of relying on
# O_NONBLOCK: sockets accepted by the controller and the worker stay in blocking mode,
# which saves an ioctl per accept (controller/transport.py).
DONTWAIT: Final = socket.MSG_DONTWAIT


class FrameReader(Generic[M]):
    """Reads one frame of `msg_type` from a socket without blocking, as its bytes arrive.

    Each `read(sock)` makes one receive call and returns the frame once it is
    complete, else None (nothing there yet, or only part of it). A bad frame,
    a broken connection or a close before the end raise the matching
    `RemoteProtocolError`. A frame that comes whole in one read, the common
    case on a Unix socket, needs no `FrameDecoder` at all.
    """

    __slots__ = ("_decoder", "_max_extra", "_type")

    def __init__(self, msg_type: type[M], max_extra_size: int = DEFAULT_MAX_EXTRA_SIZE) -> None:
        self._type = msg_type
        self._max_extra = max_extra_size
        self._decoder: FrameDecoder[M] | None = None  # only once a frame comes in pieces

    def read(self, sock: _socket.socket) -> tuple[M, bytes] | None:
        decoder = self._decoder
        try:
            data = sock.recv(FIRST_READ if decoder is None else decoder.wanted(), DONTWAIT)
        except BlockingIOError:
            return None
        except OSError as exc:
            raise ConnectionLost(f"receiving a {self._type.__name__}: {exc}") from None
        if decoder is None:
            frame = whole_frame(self._type, data, self._max_extra)
            if frame is not None:
                return frame
            decoder = self._decoder = FrameDecoder(self._type, self._max_extra)
        if not data:
            decoder.eof()
        decoder.feed(data)
        return decoder.next_frame()


async def recv_frame(
    sock: socket.socket,
    msg_type: type[M],
    *,
    timeout: float,
    max_extra_size: int = DEFAULT_MAX_EXTRA_SIZE,
) -> tuple[M, bytes]:
    """Receive one frame from a non-blocking socket.

    Reads first and waits only when the kernel has nothing yet: on a Unix
    socket the answer is often already there, and skipping the wait halves
    the cost of an exchange. `timeout` bounds each silence, not the transfer.
    """
    reader = FrameReader(msg_type, max_extra_size)
    while True:
        frame = reader.read(sock)
        if frame is not None:
            return frame
        if not await _ready_by(trio.lowlevel.wait_readable, sock, trio.current_time() + timeout):
            raise PeerTimeout(f"peer silent for {timeout:g} s while sending a {msg_type.__name__}")


async def send_frame(
    sock: socket.socket, msg: Message, extra: bytes = b"", *, timeout: float
) -> None:
    """Send one frame on a non-blocking socket; a peer that stops reading is PeerTimeout."""
    data = memoryview(encode_frame(msg, extra))
    deadline = trio.current_time() + timeout
    while data:
        try:
            sent = sock.send(data)
        except BlockingIOError:
            if await _ready_by(trio.lowlevel.wait_writable, sock, deadline):
                continue
            raise PeerTimeout(
                f"peer did not read a {type(msg).__name__} within {timeout:g} s"
            ) from None
        except OSError as exc:
            raise ConnectionLost(f"sending a {type(msg).__name__}: {exc}") from None
        data = data[sent:]
        deadline = trio.current_time() + timeout


__all__ = [
    "DEFAULT_MAX_EXTRA_SIZE",
    "MAX_HEADER_SIZE",
    "ConnectionLost",
    "ExtraTooLarge",
    "FrameDecoder",
    "FrameReader",
    "HeaderTooLarge",
    "MalformedMessage",
    "PeerTimeout",
    "RemoteProtocolError",
    "StreamDecoder",
    "Truncated",
    "VarintTooLong",
    "encode_channel",
    "encode_frame",
    "encode_varint",
    "pb",
    "recv_frame",
    "send_frame",
    "whole_frame",
]

"""The UDP datagram format, shared by the front door and its clients. Pure.

One JSON object per datagram (the single-quoted literal form is read
too, safely). `packet_type` 0: no acknowledgement wanted, 1: wanted, 2: this
is one. Everything both sides must agree on lives here: packet types, size
limits, how payloads and results travel (text, or base64 when not UTF-8),
and the error acknowledgement, which always carries `code` and `message`
and never outgrows the request it answers. And the one resend rule of every
sender that waits for an acknowledgement (`resend_after`).
"""

from __future__ import annotations

import ast
import base64
import binascii
import json
from typing import Any

NO_ACK, WANT_ACK, IS_ACK = 0, 1, 2
# Largest datagram read in one go (the UDP maximum).
MAX_DATAGRAM = 65_535
# A notify_task whose result would make the datagram bigger than this announces
# `result_size` instead; the client reads the result with get_result.
MAX_INLINE_RESULT = 60_000
# Largest chunk one get_result may ask for (base64 of it stays well under 64 KiB).
MAX_CHUNK = 32_768
# Largest datagram read in the single-quoted literal form (ast.literal_eval's cost grows
# faster than the text: a big one would be a cheap way to keep the controller busy).
MAX_LITERAL = 4096
# Largest answer to `status`: at most a few times a small request, so it amplifies little.
MAX_STATUS = 1200
# The resend rule (resend_after): the first repeat after RESEND_FIRST seconds, the wait
# doubling up to RESEND_MAX, at most RESEND_COUNT repeats (about a minute of them).
RESEND_FIRST = 0.2
RESEND_MAX = 2.0
RESEND_COUNT = 32


def resend_after(sent: int) -> float | None:
    """How long to wait for the acknowledgement after a request's `sent`-th send before
    sending it again; None when it has been repeated RESEND_COUNT times (send no more).

    The one rule of every sender that waits for an acknowledgement: udp-client's and
    the library's requests (which also end at their own deadline) and a calculator's
    completed_task."""
    if sent > RESEND_COUNT:
        return None
    return float(min(RESEND_FIRST * 2.0 ** min(sent - 1, 16), RESEND_MAX))


# A task_id is a signed 64-bit integer above 0: the journal and the worker wire hold no more.
MAX_TASK_ID = 2**63 - 1
TASK_ID_RULE = "params.task_id must be an integer from 1 to 2^63-1"


class BadPacket(Exception):
    """A packet refused; `code` and `message` go in the error acknowledgement."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# One encoder for every datagram: json.dumps with arguments builds a new one per call.
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
_ASCII_ENCODER = json.JSONEncoder(separators=(",", ":"))
# An acknowledgement without params, the most common datagram: the bytes json gives.
_PLAIN_ACK = b'{"method":"ack","packet_type":%d,"transmission_id":%d}'


_DECODER = json.JSONDecoder()


def _loads(text: str) -> Any:
    """`json.loads(text)`, cheaper for the usual datagram: a value with nothing around it."""
    try:
        obj, end = _DECODER.raw_decode(text)
    except ValueError:
        return json.loads(text)  # leading white space, or not JSON: raises as json.loads does
    return obj if end == len(text) else json.loads(text)


def encode(obj: dict[str, Any]) -> bytes:
    """One datagram's bytes: UTF-8 JSON. Text holding a lone surrogate (legal in JSON, not
    in UTF-8) is written with \\u escapes instead, so any text a peer sent can go back."""
    text = _ENCODER.encode(obj)
    try:
        return text.encode()
    except UnicodeEncodeError:
        return _ASCII_ENCODER.encode(obj).encode()


def parse_packet(data: bytes) -> dict[str, Any]:
    """JSON, or the single-quoted Python-literal form (never eval); BadPacket else."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise BadPacket("bad_encoding", "not UTF-8") from None
    try:
        obj = _loads(text)
    except (ValueError, RecursionError):
        if len(data) > MAX_LITERAL:
            raise BadPacket(
                "bad_json", "not JSON (the literal form is read up to 4096 bytes)"
            ) from None
        try:
            obj = ast.literal_eval(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            raise BadPacket("bad_json", "not a JSON object") from None
    if not isinstance(obj, dict):
        raise BadPacket("not_object", "the packet must be a JSON object")
    return obj


def decode(data: bytes) -> dict[str, Any] | None:
    """A datagram from a controller or a worker we talk to: its object, or None when it is
    not a JSON object (dropped, like a lost one: the repeats deal with it)."""
    try:
        packet = _loads(data.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    return packet if isinstance(packet, dict) else None


def int_field(value: Any) -> int | None:
    """`value` if it is a JSON integer (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def task_id_field(value: Any) -> int:
    """`value` as a task_id (a JSON integer from 1 to MAX_TASK_ID); else BadPacket."""
    task_id = int_field(value)
    if task_id is None or not 1 <= task_id <= MAX_TASK_ID:
        raise BadPacket("bad_task_id", TASK_ID_RULE)
    return task_id


def request(method: str, params: dict[str, Any], txid: int | None = None) -> bytes:
    """A request: type 1 with `txid`, type 0 without."""
    packet: dict[str, Any] = {"method": method, "params": params}
    if txid is None:
        packet["packet_type"] = NO_ACK
    else:
        packet["packet_type"] = WANT_ACK
        packet["transmission_id"] = txid
    return encode(packet)


def ack(txid: int, params: dict[str, Any] | None = None) -> bytes:
    if not params and type(txid) is int:  # bool is an int json spells otherwise
        return _PLAIN_ACK % (IS_ACK, txid)
    packet: dict[str, Any] = {"method": "ack", "packet_type": IS_ACK, "transmission_id": txid}
    if params:
        packet["params"] = params
    return encode(packet)


def error_ack(txid: int, code: str, message: str, limit: int) -> bytes | None:
    """The error acknowledgement with `message` shortened so that it is at most `limit`
    bytes, but never to "" (an empty message says the code again); None when even one
    character of it is too big (the answer is then silence)."""
    message = message or code or "refused"

    def packet(text: str) -> bytes:
        return encode(
            {
                "method": "ack",
                "packet_type": IS_ACK,
                "transmission_id": txid,
                "error": {"code": code, "message": text},
            }
        )

    data = packet(message)
    if len(data) <= limit:
        return data
    # The longest prefix that fits (the size grows with the prefix): a binary search.
    low, high = 0, len(message) - 1  # packet(message[:low]) fits, unless low is 0
    while low < high:
        middle = (low + high + 1) // 2
        if len(packet(message[:middle])) <= limit:
            low = middle
        else:
            high = middle - 1
    return packet(message[:low]) if low else None


def bytes_param(
    params: dict[str, Any], name: str, limit: int, where: str = "params."
) -> bytes | None:
    """`params[name]` (text) or `params[name + "_b64"]` (base64) as bytes; None when neither.
    The one reader of such fields, for the UDP door, calculators and the HTTP door.

    BadPacket(`bad_<name>` or `<name>_too_large`) for wrong types, bad base64,
    both given, or more than `limit` bytes (`where` prefixes field names in messages).
    """
    text = params.get(name)
    b64 = params.get(f"{name}_b64")
    if text is not None and b64 is not None:
        raise BadPacket(f"bad_{name}", f"give {name} or {name}_b64, not both")
    if text is not None:
        if not isinstance(text, str):
            raise BadPacket(f"bad_{name}", f"{where}{name} must be text")
        # surrogatepass: a lone surrogate is legal in JSON text; it becomes bytes, not a crash.
        data = text.encode("utf-8", "surrogatepass")
    elif b64 is not None:
        if not isinstance(b64, str):
            raise BadPacket(f"bad_{name}", f"{where}{name}_b64 must be base64 text")
        try:
            data = base64.b64decode(b64, validate=True)
        except (binascii.Error, ValueError):
            raise BadPacket(f"bad_{name}", f"{where}{name}_b64 is not valid base64") from None
    else:
        return None
    if len(data) > limit:
        raise BadPacket(
            f"{name}_too_large", f"{name} of {len(data)} bytes is over max_extra_size {limit}"
        )
    return data


def put_bytes(params: dict[str, Any], name: str, data: bytes) -> None:
    """Set `params[name]` to `data` as text when it is UTF-8 (a lone surrogate's three bytes
    included: text that came with one is shown again as that same text), else
    `params[name + "_b64"]`."""
    try:
        params[name] = data.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        params[f"{name}_b64"] = base64.b64encode(data).decode()


def read_bytes(params: dict[str, Any], name: str) -> bytes | None:
    """The inverse of `put_bytes` for a trusted peer; None when neither field is there."""
    if name in params:
        return str(params[name]).encode("utf-8", "surrogatepass")
    if f"{name}_b64" in params:
        return base64.b64decode(str(params[f"{name}_b64"]))
    return None

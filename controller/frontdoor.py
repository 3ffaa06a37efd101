"""The UDP front door, pure: datagram bytes in, datagrams out (DESIGN.md section 4).

How it works: `datagram(data, addr, now)` parses and validates one packet and
returns the datagrams to send (acknowledgements, re-sent outcomes); new tasks
go to the scheduler through the `Scheduler` protocol. `task_finished` turns a
core outcome into a `notify_task`; success notifications are repeated with
doubling intervals until the client acknowledges them. `expire(now)` runs
those repeats and forgets finished records after `result_retention`.

Records are keyed by (client address, task_id): that is the duplicate
detection key, and it is also why outcomes only ever go to the submitter.
Every copy of a repeated packet (same sender, same transmission_id) gets the
same acknowledgement and is acted on once.

Anything a peer sends can only end as an error acknowledgement (never larger
than the packet it answers) or as silence plus a counter; the log gets at
most one line per `LOG_INTERVAL` about dropped packets.
"""

from __future__ import annotations

import ast
import base64
import binascii
import enum
import ipaddress
import itertools
import json
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from controller.core.model import TaskFinished, TaskState
from controller.deadlines import Deadlines

log = logging.getLogger("controller.frontdoor")

Address = tuple[str, int]

NO_ACK, WANT_ACK, IS_ACK = 0, 1, 2
# A notify_task whose result would make the datagram bigger than this announces
# `result_size` instead; the client reads the result with get_result.
MAX_INLINE_RESULT = 60_000
# Largest chunk one get_result may ask for (base64 of it stays well under 64 KiB).
MAX_CHUNK = 32_768
# How long a (sender, transmission_id) is remembered to answer repeats without acting twice.
TRANSMISSION_MEMORY = 120.0
# Cap on remembered transmissions, so a flood of distinct ids cannot grow memory without bound.
MAX_TRANSMISSIONS = 200_000
# First interval between repeats of an unacknowledged success notification (then doubling).
NOTIFY_FIRST_INTERVAL = 0.5
# Records forgotten per expire() call: retention deletes reach the journal in bounded
# batches, and a backlog (after a restart) does not stall the event loop.
MAX_FORGET_PER_CALL = 1000
# At most one log line per this many seconds about dropped or refused packets.
LOG_INTERVAL = 10.0


class Scheduler(Protocol):
    """What the front door needs of the controller core."""

    def submit_task(self, task_id: int, payload: bytes, owner: Address) -> int: ...

    def task_state(self, ref: int) -> TaskState | None: ...

    def status_report(self) -> dict[str, Any]: ...


class JournalSink(Protocol):
    """Where the front door reports what must survive a crash (the journal, or nothing)."""

    def accepting(self) -> str: ...

    def task_added(self, ref: int, host: str, port: int, task_id: int, payload: bytes) -> None: ...

    def task_finished(self, ref: int, state: str, result: bytes, error: str) -> None: ...

    def task_notified(self, ref: int, retention: float) -> None: ...

    def task_forgotten(self, ref: int) -> None: ...


class NoJournal:
    """`journal: null`: state lives in memory only."""

    def accepting(self) -> str:
        return ""

    def task_added(self, ref: int, host: str, port: int, task_id: int, payload: bytes) -> None:
        pass

    def task_finished(self, ref: int, state: str, result: bytes, error: str) -> None:
        pass

    def task_notified(self, ref: int, retention: float) -> None:
        pass

    def task_forgotten(self, ref: int) -> None:
        pass


class RecordState(enum.Enum):
    LIVE = "live"  # queued or running in the core
    SUCCESS = "success"
    ERROR = "error"
    FAILED_POST = "failed_post"


_FINAL = {
    TaskState.SUCCESS: RecordState.SUCCESS,
    TaskState.ERROR: RecordState.ERROR,
    TaskState.FAILED_POST: RecordState.FAILED_POST,
}


@dataclass(eq=False)
class Record:
    addr: Address
    task_id: int
    ref: int
    state: RecordState = RecordState.LIVE
    result: bytes = b""
    error: str = ""
    notify_txid: int = 0  # transmission id of the pending success notification
    notify_left: int = 0  # repeats still allowed
    notify_at: float = 0.0  # when the next repeat is due
    notify_interval: float = NOTIFY_FIRST_INTERVAL
    acked: bool = False
    expires_at: float = 0.0


@dataclass(frozen=True, slots=True)
class Send:
    data: bytes
    addr: Address
    # An error reply reveals no recorded state, so it need not wait for a journal commit.
    independent: bool = False


class BadPacket(Exception):
    """A packet the front door refuses; `code` goes in the error acknowledgement."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class FrontDoorStats:
    received: int = 0
    not_allowed: int = 0
    unparseable: int = 0
    refused: int = 0
    duplicates: int = 0
    tasks_added: int = 0
    notifications: int = 0
    notify_repeats: int = 0
    by_code: dict[str, int] = field(default_factory=dict)


def encode(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def parse_packet(data: bytes) -> dict[str, Any]:
    """JSON, or the seed's single-quoted Python-literal form (never eval)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise BadPacket("bad_encoding", "not UTF-8") from None
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        try:
            obj = ast.literal_eval(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            raise BadPacket("bad_json", "not a JSON object") from None
    if not isinstance(obj, dict):
        raise BadPacket("not_object", "the packet must be a JSON object")
    return obj


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class FrontDoor:
    def __init__(
        self,
        scheduler: Scheduler,
        *,
        allowed_clients: Sequence[ipaddress.IPv4Network | ipaddress.IPv6Network],
        notify_retries: int = 8,
        result_retention: float = 3600.0,
        max_payload: int = 16 * 1024 * 1024,
        first_txid: int = 1,
        journal: JournalSink | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.journal: JournalSink = journal or NoJournal()
        self.allowed_clients = tuple(allowed_clients)
        self.notify_retries = notify_retries
        self.result_retention = result_retention
        self.max_payload = max_payload
        self.stats = FrontDoorStats()
        self.records: dict[tuple[Address, int], Record] = {}
        self._by_ref: dict[int, Record] = {}
        self._by_txid: dict[int, Record] = {}  # pending success notifications
        self._txid = itertools.count(first_txid)
        self._seen: OrderedDict[tuple[Address, int], tuple[float, bytes | None]] = OrderedDict()
        self._allowed_cache: dict[str, bool] = {}
        self._deadlines: Deadlines[Record] = Deadlines()
        self._last_log = -LOG_INTERVAL
        self._dropped_since_log = 0

    # ------------------------------------------------------------ inbound

    def datagram(self, data: bytes, addr: Address, now: float) -> list[Send]:
        """Handle one datagram from `addr`; returns what to send."""
        self.stats.received += 1
        if not self._is_allowed(addr[0]):
            self.stats.not_allowed += 1
            self._note_drop(now, f"packet from {addr[0]} outside allowed_clients")
            return []
        try:
            packet = parse_packet(data)
        except BadPacket as exc:
            self.stats.unparseable += 1
            self._note_drop(now, f"unparseable packet from {addr[0]}: {exc.message}")
            return []
        ptype = packet.get("packet_type")
        txid = _int(packet.get("transmission_id"))
        if ptype == IS_ACK:
            self._on_ack(txid, addr, now)
            return []
        if txid is not None and ptype == WANT_ACK:
            key = (addr, txid)
            seen = self._seen.get(key)
            if seen is not None:
                self.stats.duplicates += 1
                return [Send(seen[1], addr)] if seen[1] is not None else []
        try:
            if ptype not in (NO_ACK, WANT_ACK) or isinstance(ptype, bool):
                raise BadPacket("bad_packet_type", "packet_type must be 0, 1 or 2")
            if ptype == WANT_ACK and txid is None:
                raise BadPacket("bad_transmission_id", "transmission_id must be an integer")
            out, ack_params = self._on_request(packet, addr, now)
        except BadPacket as exc:
            self.stats.refused += 1
            codes = self.stats.by_code
            codes[exc.code] = codes.get(exc.code, 0) + 1
            self._note_drop(now, f"refused packet from {addr[0]}: {exc.message}")
            reply = self._error_ack(txid, exc, len(data)) if txid is not None else None
            if txid is not None and ptype == WANT_ACK:
                self._remember(addr, txid, reply, now)
            return [Send(reply, addr, independent=True)] if reply is not None else []
        if ptype != WANT_ACK or txid is None:
            return out
        ack: dict[str, Any] = {"method": "ack", "packet_type": IS_ACK, "transmission_id": txid}
        if ack_params:
            ack["params"] = ack_params
        reply = encode(ack)
        self._remember(addr, txid, reply, now)
        return [Send(reply, addr), *out]

    def _on_request(
        self, packet: dict[str, Any], addr: Address, now: float
    ) -> tuple[list[Send], dict[str, Any] | None]:
        method = packet.get("method")
        params = packet.get("params", {})
        if not isinstance(params, dict):
            raise BadPacket("bad_params", "params must be an object")
        if method == "add_task":
            return self._add_task(params, addr, now), None
        if method == "get_task":
            return [], self._get_task(params, addr)
        if method == "get_result":
            return [], self._get_result(params, addr)
        if method == "status":
            report = self.scheduler.status_report()
            report["front_door"] = {
                "received": self.stats.received,
                "refused": self.stats.refused,
                "unparseable": self.stats.unparseable,
                "not_allowed": self.stats.not_allowed,
                "duplicates": self.stats.duplicates,
                "refused_by_code": dict(self.stats.by_code),
                "records": len(self.records),
            }
            return [], report
        raise BadPacket("unknown_method", f"unknown method {str(method)[:40]!r}")

    def _task_id(self, params: dict[str, Any]) -> int:
        task_id = _int(params.get("task_id"))
        if task_id is None or task_id < 1 or task_id >= 2**64:
            raise BadPacket("bad_task_id", "params.task_id must be an integer >= 1")
        return task_id

    def _add_task(self, params: dict[str, Any], addr: Address, now: float) -> list[Send]:
        task_id = self._task_id(params)
        payload = self._payload(params)
        record = self.records.get((addr, task_id))
        if record is not None:
            self.stats.duplicates += 1
            if record.state is RecordState.LIVE:
                return []
            return self._notify(record, now)  # finished: send the stored outcome again
        refusal = self.journal.accepting()
        if refusal:
            raise BadPacket("journal_unavailable", "cannot record new tasks now")
        ref = self.scheduler.submit_task(task_id, payload, addr)
        self.journal.task_added(ref, addr[0], addr[1], task_id, payload)
        record = Record(addr, task_id, ref)
        self.records[(addr, task_id)] = record
        self._by_ref[ref] = record
        self.stats.tasks_added += 1
        return []

    def _payload(self, params: dict[str, Any]) -> bytes:
        text = params.get("payload")
        b64 = params.get("payload_b64")
        if text is not None and b64 is not None:
            raise BadPacket("bad_payload", "give payload or payload_b64, not both")
        if text is not None:
            if not isinstance(text, str):
                raise BadPacket("bad_payload", "params.payload must be text")
            payload = text.encode("utf-8")
        elif b64 is not None:
            if not isinstance(b64, str):
                raise BadPacket("bad_payload", "params.payload_b64 must be base64 text")
            try:
                payload = base64.b64decode(b64, validate=True)
            except (binascii.Error, ValueError):
                raise BadPacket("bad_payload", "params.payload_b64 is not valid base64") from None
        else:
            payload = b""
        if len(payload) > self.max_payload:
            raise BadPacket(
                "payload_too_large", f"payload of {len(payload)} bytes over {self.max_payload}"
            )
        return payload

    def _get_task(self, params: dict[str, Any], addr: Address) -> dict[str, Any]:
        task_id = self._task_id(params)
        record = self._lookup(addr, task_id)
        answer: dict[str, Any] = {"task_id": task_id, "status": self._status(record)}
        if record.state is RecordState.SUCCESS:
            answer["result_size"] = len(record.result)
        elif record.state in (RecordState.ERROR, RecordState.FAILED_POST):
            answer["error"] = record.error
        return answer

    def _get_result(self, params: dict[str, Any], addr: Address) -> dict[str, Any]:
        task_id = self._task_id(params)
        record = self._lookup(addr, task_id)
        if record.state is not RecordState.SUCCESS:
            raise BadPacket("no_result", f"task {task_id} has no result ({self._status(record)})")
        offset = _int(params.get("offset", 0))
        length = _int(params.get("length", MAX_CHUNK))
        if offset is None or offset < 0 or length is None or length < 0:
            raise BadPacket("bad_range", "offset and length must be integers >= 0")
        chunk = record.result[offset : offset + min(length, MAX_CHUNK)]
        return {
            "task_id": task_id,
            "offset": offset,
            "result_size": len(record.result),
            "result_b64": base64.b64encode(chunk).decode(),
        }

    def _lookup(self, addr: Address, task_id: int) -> Record:
        record = self.records.get((addr, task_id))
        if record is None:
            raise BadPacket("unknown_task", f"no task {task_id} from this address")
        return record

    def _status(self, record: Record) -> str:
        if record.state is not RecordState.LIVE:
            return str(record.state.value)
        state = self.scheduler.task_state(record.ref)
        return state.public if state is not None else "running"

    def _on_ack(self, txid: int | None, addr: Address, now: float) -> None:
        record = self._by_txid.get(txid) if txid is not None else None
        if record is None or record.addr != addr:
            return
        del self._by_txid[record.notify_txid]
        record.acked = True
        record.notify_left = 0
        self._retain(record, now)

    def restore(
        self,
        ref: int,
        addr: Address,
        task_id: int,
        now: float,
        *,
        state: str = "live",
        result: bytes = b"",
        error: str = "",
        notified: bool = False,
        retain_for: float | None = None,
    ) -> list[Send]:
        """Put back a record from the journal; an outcome not yet delivered is sent again."""
        record = Record(addr, task_id, ref, state=RecordState(state), result=result, error=error)
        self.records[(addr, task_id)] = record
        if record.state is RecordState.LIVE:
            self._by_ref[ref] = record
            return []
        if notified:
            record.acked = True
            record.expires_at = now + max(
                0.0, self.result_retention if retain_for is None else retain_for
            )
            self._push(record.expires_at, record)
            return []
        return self._notify(record, now)

    # ------------------------------------------------------------ outbound

    def task_finished(self, finished: TaskFinished, now: float) -> list[Send]:
        """A task ended in the core: record the outcome and notify its client."""
        record = self._by_ref.pop(finished.ref, None)
        if record is None:
            return []
        record.state = _FINAL[finished.state]
        record.result = finished.result
        record.error = finished.error
        self.journal.task_finished(record.ref, record.state.value, record.result, record.error)
        return self._notify(record, now)

    def _notify(self, record: Record, now: float) -> list[Send]:
        self.stats.notifications += 1
        params: dict[str, Any] = {"task_id": record.task_id, "status": record.state.value}
        if record.state is not RecordState.SUCCESS:
            params["error"] = record.error
            self._retain(record, now)
            packet = {"method": "notify_task", "packet_type": NO_ACK, "params": params}
            return [Send(encode(packet), record.addr)]
        if record.notify_txid:
            self._by_txid.pop(record.notify_txid, None)
        txid = next(self._txid)
        record.notify_txid = txid
        record.acked = False
        record.notify_left = self.notify_retries
        record.notify_interval = NOTIFY_FIRST_INTERVAL
        record.notify_at = now + NOTIFY_FIRST_INTERVAL
        record.expires_at = 0.0  # kept at least until acknowledged or given up on
        self._by_txid[txid] = record
        self._push(record.notify_at, record)
        return [Send(self._success_packet(record), record.addr)]

    def expire(self, now: float) -> list[Send]:
        """Repeat due notifications and forget records past their retention."""
        out: list[Send] = []
        forgotten = 0
        while forgotten < MAX_FORGET_PER_CALL:
            due = self._deadlines.pop_due(now)
            if due is None:
                break
            when, record = due
            if self.records.get((record.addr, record.task_id)) is not record:
                continue
            if record.expires_at and when >= record.expires_at:
                forgotten += 1
                del self.records[(record.addr, record.task_id)]
                self._by_txid.pop(record.notify_txid, None)
                self.journal.task_forgotten(record.ref)
                continue
            if not record.acked and record.notify_txid and record.notify_at == when:
                if record.notify_left > 0:
                    record.notify_left -= 1
                    record.notify_interval *= 2
                    record.notify_at = now + record.notify_interval
                    self._push(record.notify_at, record)
                    self.stats.notify_repeats += 1
                    out.append(Send(self._success_packet(record), record.addr))
                else:
                    self._by_txid.pop(record.notify_txid, None)
                    record.notify_txid = 0
                    self._retain(record, now)
        self._forget_transmissions(now)
        return out

    def next_deadline(self) -> float:
        """When `expire` next has work: a repeat, a retention, or a transmission to forget."""
        first = self._deadlines.next()
        if self._seen:
            first = min(first, next(iter(self._seen.values()))[0])
        return first

    def _success_packet(self, record: Record) -> bytes:
        """notify_task for a success: the result inline, or its size when too big."""
        params: dict[str, Any] = {"task_id": record.task_id, "status": "success"}
        result = record.result
        if len(result) <= MAX_INLINE_RESULT:
            try:
                params["result"] = result.decode("utf-8")
            except UnicodeDecodeError:
                params["result_b64"] = base64.b64encode(result).decode()
        else:
            params["result_size"] = len(result)
        packet = {
            "method": "notify_task",
            "packet_type": WANT_ACK,
            "transmission_id": record.notify_txid,
            "params": params,
        }
        data = encode(packet)
        if len(data) > MAX_INLINE_RESULT:  # DESIGN.md: over 60,000 bytes encoded is announced
            params.pop("result", None)
            params.pop("result_b64", None)
            params["result_size"] = len(result)
            data = encode(packet)
        return data

    # ------------------------------------------------------------ helpers

    def _retain(self, record: Record, now: float) -> None:
        """The outcome was delivered (or given up on): keep the record for result_retention."""
        record.expires_at = now + self.result_retention
        self._push(record.expires_at, record)
        self.journal.task_notified(record.ref, self.result_retention)

    def _push(self, when: float, record: Record) -> None:
        self._deadlines.push(when, record)

    def _error_ack(self, txid: int, exc: BadPacket, limit: int) -> bytes | None:
        """The error acknowledgement, shortened or withheld so it never outgrows the request."""
        for message in (exc.message, exc.message[:40], ""):
            error = {"code": exc.code, "message": message} if message else {"code": exc.code}
            ack = {"method": "ack", "packet_type": IS_ACK, "transmission_id": txid, "error": error}
            data = encode(ack)
            if len(data) <= limit:
                return data
        return None

    def _remember(self, addr: Address, txid: int, reply: bytes | None, now: float) -> None:
        self._seen[(addr, txid)] = (now + TRANSMISSION_MEMORY, reply)
        if len(self._seen) > MAX_TRANSMISSIONS:
            self._seen.popitem(last=False)

    def _forget_transmissions(self, now: float) -> None:
        seen = self._seen
        while seen:
            key, (until, _) = next(iter(seen.items()))
            if until > now:
                break
            del seen[key]

    def _is_allowed(self, host: str) -> bool:
        allowed = self._allowed_cache.get(host)
        if allowed is None:
            try:
                ip = ipaddress.ip_address(host.split("%", 1)[0])
            except ValueError:
                allowed = False
            else:
                if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
                    ip = ip.ipv4_mapped
                allowed = any(ip in net for net in self.allowed_clients)
            if len(self._allowed_cache) > 10_000:
                self._allowed_cache.clear()
            self._allowed_cache[host] = allowed
        return allowed

    def _note_drop(self, now: float, what: str) -> None:
        self._dropped_since_log += 1
        if now - self._last_log >= LOG_INTERVAL:
            extra = self._dropped_since_log - 1
            more = f" (and {extra} more dropped or refused since the last report)" if extra else ""
            log.warning("%s%s", what, more)
            self._last_log = now
            self._dropped_since_log = 0

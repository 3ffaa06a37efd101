"""The UDP door, pure: a codec between datagrams and the job book.

How it works: `datagram(data, addr, now)` parses and checks one packet and
returns what should happen, as actions: `Submit` a new job, `Send` a
datagram, `Delivered` (the client has an outcome: its retention starts), and
what a calculator said (`Heartbeat`, `Completed`, `CalculatorAck`: see
calclink.py). It reads the job book (duplicates, statuses, results) but never
changes it, and it calls neither the scheduler nor the journal: the door's
shell (shell.py) carries out the clients' actions (actions.py) with the job
desk, state changes before sends, and hands the calculators' to the
calculators' shell.

Routing: a datagram from an address in `allowed_clients` is a client's, one
from `allowed_calculators` a calculator's (an address in both is both); a
calculator's methods (`heartbeat`, `completed_task`) are taken only from a
calculator, every other method only from a client, and an acknowledgement
that is not of a client's notification goes to the calculators' side.
`job_finished` turns an ended job into a `notify_task`; success notifications
are repeated until acknowledged (controller/transmissions.py).

A UDP job's id is `udp-<host>-<port>-<task_id>`, so the (client address,
task_id) duplicate-detection key is just a book lookup, and outcomes only
ever go to the submitter. Anything a peer sends can only end as an error
acknowledgement (never larger than the packet it answers) or as silence
plus a counter; the log gets at most one line per `LOG_INTERVAL` about
dropped packets.
"""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from controller import datagram as dg
from controller import options
from controller.allowlist import Networks, cached_allowed
from controller.containment import INTERNAL_MESSAGE
from controller.datagram import BadPacket
from controller.dependencies import after_refusal
from controller.doors.udp import calclink, words
from controller.doors.udp.actions import ClientAction, Delivered, Send, Submit
from controller.doors.udp.calclink import CalculatorAck, CalculatorAction
from controller.job_ids import DoorName
from controller.job_states import JobState
from controller.jobs import Job, JobBook, udp_job_id
from controller.options import JobOptions
from controller.transmissions import PLAIN_ACK, TRANSMISSION_MEMORY, Address, Repeats, Seen

log = logging.getLogger("controller.frontdoor")

# At most one log line per this many seconds about dropped or refused packets.
LOG_INTERVAL = 10.0


# What the codec returns: the clients' actions (carried out with the job desk) for the
# clients' datagrams, the calculators' shell's for the calculators'.
UdpAction = ClientAction | CalculatorAction
CALCULATOR_METHODS = frozenset({"heartbeat", "completed_task"})
# Client hosts whose default options (their address as owner) are kept made.
MAX_OWNERS_KEPT = 4096


@dataclass
class FrontDoorStats:
    received: int = 0
    not_allowed: int = 0
    unparseable: int = 0
    refused: int = 0
    duplicates: int = 0
    tasks_added: int = 0
    unique_duplicates: int = 0  # add_task answered with the live job holding its unique_key
    notifications: int = 0
    notify_repeats: int = 0
    by_code: dict[str, int] = field(default_factory=dict)


class FrontDoor:
    def __init__(
        self,
        book: JobBook,
        *,
        allowed_clients: Networks,
        allowed_calculators: Networks = (),
        refusal: Callable[[], str] = lambda: "",
        busy: Callable[[int], str] = lambda size: "",
        holder: Callable[[str], Job | None] = lambda key: None,
        status_report: Callable[[], dict[str, Any]] = dict,
        notify_retries: int = 8,
        max_payload: int = 16 * 1024 * 1024,
        first_txid: int = 1,
        max_result: int = 16 * 1024 * 1024,
        memory: int = 64 * 1024 * 1024,
        options: JobOptions | None = None,
    ) -> None:
        """`refusal()`: why new jobs must be refused now ("" when welcome); `busy(size)`: why
        a new job with a payload of `size` bytes does not fit now ("" when it does);
        `holder(unique_key)`: the live job that holds that key (None: it is free);
        `max_result`: the largest result a calculator may report."""
        self.book = book
        self.refusal = refusal
        self.busy = busy
        self.holder = holder
        self.status_report = status_report
        self.allowed_clients = tuple(allowed_clients)
        self.allowed_calculators = tuple(allowed_calculators)
        self.max_payload = max_payload
        self.max_result = max_result
        self.stats = FrontDoorStats()
        # udp_memory: bytes of answers held for repeats; past it the oldest go. It bounds
        # copies only: a job's record, its result and its duplicate detection stay in the
        # book for result_retention, and an answer that went is made again from them.
        self.seen = Seen(memory)
        # An accepted add_task is not remembered in `seen`: its job is in the book, which
        # answers the copies (acknowledged again, acting on nothing; the outcome sent again
        # once the job ended) for as long as the job is kept, longer than `seen` would keep
        # it unless result_retention is shorter than TRANSMISSION_MEMORY. ~92 bytes a job.
        self._book_dedups = book.result_retention >= TRANSMISSION_MEMORY
        self.repeats = Repeats(notify_retries, first_txid)
        self._client_cache: dict[str, bool] = {}
        self._calculator_cache: dict[str, bool] = {}
        self._last_log = -LOG_INTERVAL
        self._dropped_since_log = 0
        # The options of a job that gives none, its owner the client's address (one object
        # per client host, shared by its jobs); None: the controller's defaults.
        self.options = options
        self._owners: dict[str, JobOptions] = {}

    # ------------------------------------------------------------ inbound

    def datagram(self, data: bytes, addr: Address, now: float) -> list[UdpAction]:
        """Handle one datagram from `addr`."""
        self.stats.received += 1
        host = addr[0]
        client = cached_allowed(host, self.allowed_clients, self._client_cache)
        calculator = cached_allowed(host, self.allowed_calculators, self._calculator_cache)
        if not client and not calculator:
            self.stats.not_allowed += 1
            self._note_drop(now, f"packet from {host} outside allowed_clients")
            return []
        try:
            packet = dg.parse_packet(data)
        except BadPacket as exc:
            self.stats.unparseable += 1
            self._note_drop(now, f"unparseable packet from {addr[0]}: {exc.message}")
            return []
        ptype = packet.get("packet_type")
        txid = dg.int_field(packet.get("transmission_id"))
        if ptype == dg.IS_ACK:
            if txid is None:
                return []
            job_id = self.repeats.acked(txid, addr) if client else None
            if job_id is not None:
                return [Delivered(job_id)]
            if calculator:
                return [CalculatorAck(txid, addr, refused="error" in packet)]
            return []
        method = packet.get("method")
        from_calculator = isinstance(method, str) and method in CALCULATOR_METHODS
        if not (calculator if from_calculator else client):
            # A calculator's method from outside allowed_calculators, or a client's from
            # outside allowed_clients: dropped, counted, never answered.
            self.stats.not_allowed += 1
            self._note_drop(now, f"{str(method)[:40]} from {host} not allowed")
            return []
        if txid is not None and ptype == dg.WANT_ACK:
            seen = self.seen.get(addr, txid)
            if seen is not None:
                self.stats.duplicates += 1
                return [Send(seen[0], addr)] if seen[0] is not None else []
        try:
            if ptype not in (dg.NO_ACK, dg.WANT_ACK) or isinstance(ptype, bool):
                raise BadPacket("bad_packet_type", "packet_type must be 0, 1 or 2")
            if ptype == dg.WANT_ACK and txid is None:
                raise BadPacket("bad_transmission_id", "transmission_id must be an integer")
            out, ack_params = self._on_request(packet, addr, now)
        except BadPacket as exc:
            self.stats.refused += 1
            codes = self.stats.by_code
            codes[exc.code] = codes.get(exc.code, 0) + 1
            self._note_drop(now, f"refused packet from {addr[0]}: {exc.message}")
            if txid is None:
                return []
            reply = dg.error_ack(txid, exc.code, exc.message, len(data))
            if ptype == dg.WANT_ACK:
                self.seen.remember(addr, txid, reply, now)
            return [Send(reply, addr, independent=True)] if reply is not None else []
        if ptype != dg.WANT_ACK or txid is None:
            return list(out)
        reply = dg.ack(txid, ack_params)
        # An add_task answered with params (a duplicate: no job made) is remembered here.
        if ack_params or not (self._book_dedups and packet.get("method") == "add_task"):
            self.seen.remember(addr, txid, reply if ack_params else PLAIN_ACK, now)
        if out and isinstance(out[0], Submit):
            job_id = out[0].job_id
            return [Send(reply, addr, batched=True, job_id=job_id, request_size=len(data)), *out]
        return [Send(reply, addr), *out]

    def _on_request(
        self, packet: dict[str, Any], addr: Address, now: float
    ) -> tuple[Sequence[UdpAction], dict[str, Any] | None]:
        method = packet.get("method")
        params = packet.get("params", {})
        if not isinstance(params, dict):
            raise BadPacket("bad_params", "params must be an object")
        if isinstance(method, str) and method in CALCULATOR_METHODS:
            return calclink.decode(method, params, addr, self.max_result), None
        if method == "add_task":
            return self._add_task(params, addr, now)
        if method == "get_task":
            return [], self._get_task(params, addr)
        if method == "get_result":
            return [], self._get_result(params, addr)
        if method == "status":
            report = self.status_report()
            report["front_door"] = {
                "received": self.stats.received,
                "refused": self.stats.refused,
                "unparseable": self.stats.unparseable,
                "not_allowed": self.stats.not_allowed,
                "duplicates": self.stats.duplicates,
                "refused_by_code": dict(self.stats.by_code),
                "records": len(self.book),
            }
            return [], fit_status(report, dg.MAX_STATUS - STATUS_ENVELOPE)
        raise BadPacket("unknown_method", f"unknown method {str(method)[:40]!r}")

    @staticmethod
    def _task_id(params: dict[str, Any]) -> int:
        return dg.task_id_field(params.get("task_id"))

    def _add_task(
        self, params: dict[str, Any], addr: Address, now: float
    ) -> tuple[list[ClientAction], dict[str, Any] | None]:
        """The job to make, or the acknowledgement's params when none is: a live job holds the
        task's unique_key (DESIGN.md section 17), and the ack names it in `params.id`."""
        task_id = self._task_id(params)
        payload = dg.bytes_param(params, "payload", self.max_payload) or b""
        job_id = udp_job_id(addr[0], addr[1], task_id)
        job = self.book.get(job_id)
        if job is not None and job.door != DoorName.UDP:  # an older journal's: not this client's
            raise BadPacket("bad_task_id", f"task {task_id} is in use by a job of another door")
        if job is not None:
            self.stats.duplicates += 1
            if not job.state.final:
                return [], None
            return self.job_finished(job, now), None  # send the stored outcome again
        options = self._options(params, addr)
        if options is not None and options.after:
            why = after_refusal(options.after, job_id, self.book)
            if why:
                raise BadPacket("bad_option", why)
        if options is not None and options.unique_key:
            holder = self.holder(options.unique_key)
            if holder is not None:  # nothing made: the ack names the job that holds the key
                self.stats.unique_duplicates += 1
                return [], {"id": holder.id}
        if self.refusal():
            raise BadPacket("journal_unavailable", "cannot record new tasks now")
        busy = self.busy(len(payload))
        if busy:
            raise BadPacket("busy", busy)
        self.stats.tasks_added += 1
        return [Submit(job_id, task_id, payload, addr, options)], None

    def _options(self, params: dict[str, Any], addr: Address) -> JobOptions | None:
        """The job's options (`params.<name>`), its owner the client's address by default;
        BadPacket `bad_option` for a bad one. None: the controller's defaults."""
        door_defaults = self.options
        if door_defaults is None:  # a door made without defaults (tests)
            if not options.OPTION_NAMES.intersection(params):
                return None
            base = options.DEFAULT
        else:
            host = addr[0]
            known = self._owners.get(host)
            if known is None:
                if len(self._owners) >= MAX_OWNERS_KEPT:
                    self._owners.clear()
                known = self._owners[host] = replace(door_defaults, owner=host)
            base = known
        try:
            return options.parse(params, base, time.time())
        except options.BadOption as exc:
            raise BadPacket("bad_option", str(exc)) from None

    def _get_task(self, params: dict[str, Any], addr: Address) -> dict[str, Any]:
        task_id = self._task_id(params)
        job = self._lookup(addr, task_id)
        answer: dict[str, Any] = {"task_id": task_id, "status": words.status(job)}
        if job.state is JobState.FINISHED:
            answer["result_size"] = len(job.result)
        elif job.state.final:
            answer["error"] = job.error
        return answer

    def _get_result(self, params: dict[str, Any], addr: Address) -> dict[str, Any]:
        task_id = self._task_id(params)
        job = self._lookup(addr, task_id)
        if job.state is not JobState.FINISHED:
            raise BadPacket("no_result", f"task {task_id} has no result ({words.status(job)})")
        offset = dg.int_field(params.get("offset", 0))
        length = dg.int_field(params.get("length", dg.MAX_CHUNK))
        if offset is None or offset < 0 or length is None or length < 0:
            raise BadPacket("bad_range", "offset and length must be integers >= 0")
        chunk = job.result[offset : offset + min(length, dg.MAX_CHUNK)]
        return {
            "task_id": task_id,
            "offset": offset,
            "result_size": len(job.result),
            "result_b64": base64.b64encode(chunk).decode(),
        }

    def _lookup(self, addr: Address, task_id: int) -> Job:
        job = self.book.get(udp_job_id(addr[0], addr[1], task_id))
        if job is None or job.door != DoorName.UDP:
            raise BadPacket("unknown_task", f"no task {task_id} from this address")
        return job

    def internal_error(self, data: bytes, addr: Address) -> list[Send]:
        """The handling of `data` failed (a bug, contained): an error acknowledgement with code
        `internal` when one is wanted and fits, else silence."""
        self.stats.refused += 1
        codes = self.stats.by_code
        codes["internal"] = codes.get("internal", 0) + 1
        try:
            packet = dg.parse_packet(data)
        except BadPacket:
            return []
        txid = dg.int_field(packet.get("transmission_id"))
        if packet.get("packet_type") != dg.WANT_ACK or txid is None:
            return []
        reply = dg.error_ack(txid, "internal", INTERNAL_MESSAGE, len(data))
        return [Send(reply, addr, independent=True)] if reply is not None else []

    # ------------------------------------------------------------ outbound

    def job_finished(self, job: Job, now: float) -> list[ClientAction]:
        """Tell the submitter of an ended UDP job its outcome."""
        addr = job.key
        assert isinstance(addr, tuple)
        self.stats.notifications += 1
        if job.final is not JobState.FINISHED:
            params = {"task_id": job.task_id, "status": words.status(job), "error": job.error}
            send = Send(dg.request("notify_task", params), addr, batched=True, job_id=job.id)
            return [send, Delivered(job.id)]
        txid = self.repeats.start(job.id, addr, now)
        return [Send(self._success_packet(job, txid), addr, batched=True, job_id=job.id)]

    def expire(self, now: float) -> list[ClientAction]:
        """Repeat due notifications; give up on those out of repeats; forget old requests."""
        again, gave_up = self.repeats.due(now)
        out: list[ClientAction] = []
        for pending in again:
            job = self.book.get(pending.job_id)
            if job is None:  # forgotten meanwhile (its retention ran out)
                self.repeats.cancel(pending.job_id)
                continue
            self.stats.notify_repeats += 1
            out.append(Send(self._success_packet(job, pending.txid), pending.addr, batched=True))
        for job_id in gave_up:
            out.append(Delivered(job_id))
        self.seen.expire(now)
        return out

    def next_deadline(self) -> float:
        """When `expire` next has work: a repeat, or a request to forget."""
        return min(self.repeats.next_deadline(), self.seen.next_deadline())

    def forget(self, job: Job) -> None:
        """The book forgot `job`: nothing more to send for it."""
        self.repeats.cancel(job.id)

    @staticmethod
    def _success_packet(job: Job, txid: int) -> bytes:
        """notify_task for a success: the result inline, or its size when too big."""
        params: dict[str, Any] = {"task_id": job.task_id, "status": "success"}
        result = job.result
        if len(result) <= dg.MAX_INLINE_RESULT:
            dg.put_bytes(params, "result", result)
            data = dg.request("notify_task", params, txid)
            if len(data) <= dg.MAX_INLINE_RESULT:
                return data
            params.pop("result", None)
            params.pop("result_b64", None)
        params["result_size"] = len(result)  # over 60,000 bytes encoded: announced
        return dg.request("notify_task", params, txid)

    # ------------------------------------------------------------ helpers

    def _note_drop(self, now: float, what: str) -> None:
        self._dropped_since_log += 1
        if now - self._last_log >= LOG_INTERVAL:
            extra = self._dropped_since_log - 1
            more = f" (and {extra} more dropped or refused since the last report)" if extra else ""
            log.warning("%s%s", what, more)
            self._last_log = now
            self._dropped_since_log = 0


# Bytes of the acknowledgement around a status report (method, type, a 20-digit id).
STATUS_ENVELOPE = 100


def fit_status(report: dict[str, Any], limit: int) -> dict[str, Any]:
    """The status report cut to at most `limit` bytes encoded: the worker list shortened
    first (`workers_total` and the per-kind counts stay whole), then the details that
    can be long (refusals by code, worker losses, Redis's last error), then whole sections."""

    def size() -> int:
        return len(dg.encode(report))

    workers = report.get("workers")
    if isinstance(workers, list):
        while workers and size() > limit:  # halve a long list, then one at a time
            keep = len(workers) // 2 if len(workers) > 8 else len(workers) - 1
            del workers[keep:]
    for section, key in (
        ("front_door", "refused_by_code"),
        (None, "worker_losses"),
        ("redis", "last_error"),
    ):
        if size() <= limit:
            return report
        holder = report.get(section) if section else report
        if isinstance(holder, dict):
            holder.pop(key, None)
    for key in ("redis", "front_door", "workers", "kinds"):
        if size() <= limit:
            return report
        report.pop(key, None)
    if size() > limit:
        return {"workers_total": report.get("workers_total"), "tasks": report.get("tasks")}
    return report

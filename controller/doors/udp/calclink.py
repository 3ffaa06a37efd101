"""The controller's half of the calculator protocol, on the UDP door's port. Pure.

In: `heartbeat` (type 0, `params.status` ready or busy, `params.queues` and
`params.labels` lists of names: what it serves and has) and `completed_task`
(type 1, acknowledged by the door on every copy, acted on once by the core),
from `allowed_calculators` only: `decode` turns them into `Heartbeat` and
`Completed`. Out: `perform_task` (type 1), which `CalculatorLink` sends again at
doubling intervals until the calculator acknowledges it or `dial_timeout` has
passed since the first send (then `PerformUnacked`: the core tries another
worker). The door's codec hands every acknowledgement from a calculator's
address that it does not recognise as a client's on as a `CalculatorAck`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from controller import datagram as dg
from controller import declared
from controller.datagram import BadPacket
from controller.deadlines import Deadlines
from controller.usage import Usage, usage_from_json

Address = tuple[str, int]

# First repeat of an unacknowledged perform_task (then doubling, within dial_timeout).
PERFORM_FIRST_REPEAT = 0.05


@dataclass(frozen=True, slots=True)
class Heartbeat:
    address: Address
    ready: bool
    serves: declared.Declared = declared.DEFAULT  # the queues it serves, its labels
    # A busy one's params.progress and params.progress_status, unchecked (the desk cleans
    # them: controller/progress.py); None when it sent no progress.
    progress: tuple[object, object] | None = None


@dataclass(frozen=True, slots=True)
class Completed:
    address: Address
    task_id: int
    ok: bool
    output: bytes
    error: str
    job_output: bytes = b""  # what the job wrote to stderr (params.output: its tail)
    usage: Usage | None = None  # what the attempt used (params.usage), when it says


@dataclass(frozen=True, slots=True)
class CalculatorAck:
    """An acknowledgement from a calculator's address: perhaps of one of our perform_tasks."""

    txid: int
    address: Address
    refused: bool  # an error acknowledgement (e.g. busy)


CalculatorAction = Heartbeat | Completed | CalculatorAck


@dataclass(frozen=True, slots=True)
class PerformAcked:
    address: Address
    ref: int
    refused: bool  # acknowledged with an error (e.g. busy): it does not have the job


@dataclass(frozen=True, slots=True)
class PerformUnacked:
    address: Address
    ref: int


@dataclass(eq=False, slots=True)
class _Pending:
    address: Address
    ref: int
    txid: int
    data: bytes
    give_up_at: float
    next_at: float
    interval: float


def decode(
    method: str, params: dict[str, Any], address: Address, max_result: int
) -> list[CalculatorAction]:
    """A calculator's `heartbeat` or `completed_task`: what the core should hear. BadPacket
    for a bad one (a result over `max_result` bytes is one)."""
    if method == "heartbeat":
        status = params.get("status")
        if status not in ("ready", "busy"):
            raise BadPacket("bad_status", "params.status must be ready or busy")
        try:
            serves = declared.read(params.get("queues", ()), params.get("labels", ()))
        except declared.BadDeclaration as exc:
            code = "bad_queues" if exc.what == "queues" else "bad_labels"
            raise BadPacket(code, str(exc)) from None
        progress = None
        if status == "busy" and "progress" in params:
            progress = (params["progress"], params.get("progress_status", ""))
        return [Heartbeat(address, status == "ready", serves, progress)]
    task_id = dg.task_id_field(params.get("task_id"))
    status = params.get("status")
    printed = params.get("output", "")
    if not isinstance(printed, str):
        raise BadPacket("bad_output", "params.output must be text")
    job_output = printed.encode("utf-8", "surrogatepass")
    usage = None
    if "usage" in params:
        try:
            usage = usage_from_json(params["usage"])
        except ValueError as exc:
            raise BadPacket("bad_usage", f"params.{exc}") from None
    if status == "success":
        output = dg.bytes_param(params, "result", max_result) or b""
        return [Completed(address, task_id, True, output, "", job_output, usage)]
    if status == "error":
        error = params.get("error", "")
        if not isinstance(error, str):
            raise BadPacket("bad_error", "params.error must be text")
        return [Completed(address, task_id, False, b"", error, job_output, usage)]
    raise BadPacket("bad_status", "params.status must be success or error")


class CalculatorLink:
    """The perform_tasks sent and not yet acknowledged, and their repeats."""

    def __init__(self, *, dial_timeout: float, first_txid: int = 1) -> None:
        self.dial_timeout = dial_timeout
        self._txid = itertools.count(first_txid)
        self._pending: dict[int, _Pending] = {}
        self._deadlines: Deadlines[_Pending] = Deadlines()
        self.next_deadline = self._deadlines.next

    def acked(self, ack: CalculatorAck) -> PerformAcked | None:
        """An acknowledgement from a calculator: is it one of our perform_tasks?"""
        pending = self._pending.get(ack.txid)
        if pending is None or pending.address != ack.address:
            return None
        del self._pending[ack.txid]
        return PerformAcked(ack.address, pending.ref, ack.refused)

    def perform(
        self, address: Address, ref: int, task_id: int, payload: bytes, now: float
    ) -> bytes:
        """The first `perform_task` datagram for this job (repeats come from `expire`)."""
        params: dict[str, Any] = {"task_id": task_id}
        dg.put_bytes(params, "payload", payload)
        txid = next(self._txid)
        data = dg.request("perform_task", params, txid)
        pending = _Pending(
            address,
            ref,
            txid,
            data,
            give_up_at=now + self.dial_timeout,
            next_at=now + PERFORM_FIRST_REPEAT,
            interval=PERFORM_FIRST_REPEAT,
        )
        self._pending[txid] = pending
        self._deadlines.push(pending.next_at, pending)
        return data

    def expire(self, now: float) -> tuple[list[tuple[bytes, Address]], list[PerformUnacked]]:
        """(perform_tasks to send again, those whose dial_timeout ran out)."""
        again: list[tuple[bytes, Address]] = []
        gave_up: list[PerformUnacked] = []
        while (due := self._deadlines.pop_due(now)) is not None:
            when, pending = due
            if self._pending.get(pending.txid) is not pending or pending.next_at != when:
                continue
            if now >= pending.give_up_at:
                del self._pending[pending.txid]
                gave_up.append(PerformUnacked(pending.address, pending.ref))
                continue
            again.append((pending.data, pending.address))
            pending.interval *= 2
            pending.next_at = min(now + pending.interval, pending.give_up_at)
            self._deadlines.push(pending.next_at, pending)
        return again, gave_up

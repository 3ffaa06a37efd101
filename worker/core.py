"""The worker's session state, pure: what to answer each ControlMsg and what to pulse.

A worker runs at most one task. On a channel whose controller granted `takes_next` it
may hold one more, the next, which starts once the running one's outcome is out
(docs/protocol.md, "A next task"). Its task id stays in every pulse from the
moment SET_TASK is accepted until the result (or the failure) has been
fetched, so that a controller that restarted in between can take the task
over. The local worker's loop (`worker.local.worker`) owns the sockets, the clock and
the running task; it asks this object what to do and reports back.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from controller.declared import DEFAULT as DECLARED_DEFAULT
from controller.declared import Declared
from gen import worker_protocol_pb2 as pb


class Phase(enum.Enum):
    IDLE = "idle"
    RUNNING = "running"
    DONE = "done"  # result waiting to be fetched
    FAILED = "failed"  # error text waiting to be fetched


class Effect(enum.Enum):
    NONE = enum.auto()
    START = enum.auto()  # start running the accepted task
    RESTART = enum.auto()  # stop everything and exit 75
    FETCHED = enum.auto()  # the outcome went out: back to idle once the answer is written
    HELD = enum.auto()  # a next task, held: nothing to send (its outcome is the answer)
    QUIET = enum.auto()  # nothing to send (a CTRL_DROP of a task it does not hold)


@dataclass(frozen=True, slots=True)
class Answer:
    response: pb.WorkerResponse
    extra: bytes = b""
    effect: Effect = Effect.NONE


class WorkerSession:
    """What the worker knows and promises; no I/O."""

    def __init__(self, declared: Declared = DECLARED_DEFAULT) -> None:
        self.declared = declared  # the queues it serves and the labels it has
        self.worker_id = 0
        self.phase = Phase.IDLE
        self.task_id = 0
        self.payload = b""
        self.outcome = b""  # the result, or the error text when FAILED
        self.usage: pb.Usage | None = None  # what the task used, when measured
        self.reason = ""  # "limit" when it failed on one of its limits
        self.limits = pb.JobLimits()  # the running task's own limits (SET_TASK)
        self.batch_id = ""  # the batch whose then job the running task is (SET_TASK)
        self.draining = False
        self.takes_next = False  # granted: a SET_TASK while one runs is held as the next
        self.waiting: tuple[pb.ControlMsg, bytes] | None = None  # the next task, held

    @property
    def has_outcome(self) -> bool:
        return self.phase in (Phase.DONE, Phase.FAILED)

    def register(self, next_pulse: int) -> pb.WorkerPulse:
        """REGISTER, declaring the worker's queues and labels."""
        return pb.WorkerPulse(
            type=pb.PULSE_REGISTER,
            next_pulse=next_pulse,
            queues=sorted(self.declared.queues),
            labels=sorted(self.declared.labels),
        )

    def pulse(self, next_pulse: int) -> pb.WorkerPulse:
        """The periodic pulse: FETCH_ME while an outcome waits, else OK."""
        ptype = pb.PULSE_FETCH_ME if self.has_outcome else pb.PULSE_OK
        return pb.WorkerPulse(
            type=ptype, worker_id=self.worker_id, task_id=self.task_id, next_pulse=next_pulse
        )

    def on_control(self, msg: pb.ControlMsg, extra: bytes) -> Answer:
        """The answer to one control message from the controller."""
        kind = msg.type
        tid = self.task_id
        if kind == pb.CTRL_GET_STATUS:
            return Answer(pb.WorkerResponse(error=pb.WORKER_ERR_OK, task_id=tid))
        if kind == pb.CTRL_SET_TASK:
            if self.phase is not Phase.IDLE and self._holds_next(msg):
                self.waiting = (msg, extra)
                return Answer(
                    pb.WorkerResponse(error=pb.WORKER_ERR_OK, task_id=msg.task_id),
                    effect=Effect.HELD,
                )
            if self.phase is not Phase.IDLE or self.draining:
                # With next tasks granted, the refusal names the task refused (it may be a
                # next one, which the controller puts back while the running one goes on).
                refused = msg.task_id if self.takes_next else tid
                return Answer(pb.WorkerResponse(error=pb.WORKER_ERR_BUSY, task_id=refused))
            if not msg.HasField("task_id") or msg.task_id == 0:
                return _failed(tid, "SET_TASK without a task_id (task ids start at 1)")
            self.phase = Phase.RUNNING
            self.task_id = msg.task_id
            self.payload = extra
            self.limits = msg.limits
            self.batch_id = msg.batch_id
            return Answer(
                pb.WorkerResponse(error=pb.WORKER_ERR_OK, task_id=msg.task_id), effect=Effect.START
            )
        if kind == pb.CTRL_FETCH:
            if self.phase is Phase.DONE:
                code = pb.WORKER_ERR_OK
            elif self.phase is Phase.FAILED:
                code = pb.WORKER_ERR_TASK_FAILED
            else:
                return Answer(pb.WorkerResponse(error=pb.WORKER_ERR_NO_FETCH, task_id=tid))
            response = pb.WorkerResponse(error=code, task_id=tid)
            if self.usage is not None:
                response.usage.CopyFrom(self.usage)
            if self.reason and self.phase is Phase.FAILED:
                response.reason = self.reason
            return Answer(response, self.outcome, effect=Effect.FETCHED)
        if kind == pb.CTRL_RESTART:
            return Answer(
                pb.WorkerResponse(error=pb.WORKER_ERR_OK, task_id=tid), effect=Effect.RESTART
            )
        if kind == pb.CTRL_DROP and self.takes_next:
            # Forgotten only while the running task's outcome is not on its way: once it is,
            # the next task is as good as started (the controller reads that outcome first).
            waiting = self.waiting
            if (
                waiting is not None
                and waiting[0].task_id == msg.task_id
                and self.phase is Phase.RUNNING
            ):
                self.waiting = None
                return Answer(pb.WorkerResponse(error=pb.WORKER_ERR_OK, task_id=msg.task_id))
            return Answer(
                pb.WorkerResponse(error=pb.WORKER_ERR_OK, task_id=tid), effect=Effect.QUIET
            )
        return _failed(tid, f"unknown control type {kind}")

    def _holds_next(self, msg: pb.ControlMsg) -> bool:
        """A SET_TASK while a task runs is held as the next one: granted, none held yet, not
        draining, and a task id."""
        return (
            self.takes_next
            and self.waiting is None
            and not self.draining
            and msg.HasField("task_id")
            and msg.task_id != 0
        )

    def take_waiting(self) -> tuple[pb.ControlMsg, bytes] | None:
        """The next task to start now that the worker is idle (None: none, or draining: the
        controller places a held task again when the worker leaves)."""
        waiting, self.waiting = self.waiting, None
        if waiting is None or self.draining or self.phase is not Phase.IDLE:
            return None
        return waiting

    def finished(
        self,
        task_id: int,
        ok: bool,
        outcome: bytes,
        usage: pb.Usage | None = None,
        reason: str = "",
    ) -> None:
        """The running task ended (`outcome` is the result, or the error text; `usage` what
        it used; `reason` "limit" when it hit one of its limits)."""
        if self.phase is not Phase.RUNNING or task_id != self.task_id:
            return  # a task abandoned by RESTART; nothing to keep
        self.phase = Phase.DONE if ok else Phase.FAILED
        self.outcome = outcome
        self.usage = usage
        self.reason = reason
        self.payload = b""
        self.limits = pb.JobLimits()
        self.batch_id = ""

    def fetched(self, task_id: int) -> None:
        """The FETCH answer carrying this task's outcome was written."""
        if self.has_outcome and task_id == self.task_id:
            self.phase = Phase.IDLE
            self.task_id = 0
            self.outcome = b""
            self.usage = None
            self.reason = ""


def _failed(task_id: int, why: str) -> Answer:
    return Answer(pb.WorkerResponse(error=pb.WORKER_ERR_FAILED, task_id=task_id), why.encode())

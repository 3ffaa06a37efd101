"""The UDP client engine: jobs through the front door over one socket, under trio.

One UDP socket and one receiver task that does the work as datagrams come in:
an acknowledgement moves its request on, a notification is acknowledged
(every copy) and ends its job, reported once through a callback, and the
next job of a batch is sent from there. No task, event or cancel scope per
job: a round trip costs its datagrams and the Python between them
(docs/client.md, "udp-client"). What waits on the clock is
a deadline served by one timer task: requests repeated with a doubling
interval until acknowledged, get_task for a job whose notification seems
lost, the session's timeout. A result too large for one datagram is read
with get_result. The datagram format and the resend rule are
controller/datagram.py, shared with the front door and the calculators.

It is also the library's udp:// engine (controller/client/udp_backend.py): `request`
alone, and `notified` for the notifications of the tasks it submits that way.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import socket as stdsocket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import trio

from controller import datagram as dg
from controller.client.exit_status import EXIT_FAILED, EXIT_OK, EXIT_TIMEOUT
from controller.deadlines import Deadlines
from controller.doors.udp import words

# With no notification this long after the acknowledgement, ask with get_task (then again).
POLL_AFTER = 3.0
# Datagrams handled in a row before the receiver lets other tasks run.
RECEIVE_BURST = 64
# The timer task wakes at most this often: what it serves is due in 0.2 s or more.
TIMER_TICK = 0.01

Answered = Callable[[dict[str, Any] | None], None]  # the acknowledgement, or None: no answer
Report = Callable[["Outcome"], None]


@dataclass
class Outcome:
    task_id: int
    status: str  # success, error, failed_post, refused, timeout
    result: bytes = b""
    error: str = ""
    latency: float = 0.0

    @property
    def exit_code(self) -> int:
        if self.status == "success":
            return EXIT_OK
        return EXIT_TIMEOUT if self.status == "timeout" else EXIT_FAILED


@dataclass(eq=False, slots=True)
class _Request:
    """One request, sent again until acknowledged or its deadline passes."""

    txid: int
    data: bytes
    deadline: float
    answered: Answered
    sent: int = 0  # how many times it was sent (dg.resend_after says when the next)
    at: float = 0.0  # when it is sent again, or its deadline once it is sent no more


@dataclass(eq=False, slots=True)
class _Job:
    """One task from add_task to its outcome."""

    task_id: int
    started: float
    deadline: float
    report: Report
    request: _Request | None = None  # its one request in flight
    settled: bool = False  # its outcome is known (later notifications are repeats)
    poll_at: float = math.inf  # when to ask get_task
    result: bytearray = field(default_factory=bytearray)  # a large result, read in chunks
    size: int = 0


class UdpSession:
    """Runs tasks through one bound UDP socket; `receive()` must run beside `run_task`,
    `run_many` and `request`.

    The socket is a plain stdlib socket used without blocking: sending never
    waits (a datagram the kernel cannot take is lost, and repeated like any
    other), and `receive` drains every datagram that is there before it waits.
    Outcomes are reported from the receiver (or timer) task: `run_many`'s
    `on_outcome` must not block.
    """

    def __init__(self, sock: stdsocket.socket, server: tuple[str, int], timeout: float) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.server = server
        self.timeout = timeout
        self.duplicates = 0
        self._txid = itertools.count(int(time.time() * 1000))
        self._requests: dict[int, _Request] = {}  # by transmission_id
        self._jobs: dict[int, _Job] = {}  # by task_id, until their outcome is reported
        self._deadlines: Deadlines[_Request | _Job] = Deadlines()
        self._timer_at = math.inf  # when the timer task wakes next
        self._timer_wake = trio.Event()
        # Given, it takes the notifications of tasks this session does not run itself
        # (submitted with `request`); else they count as duplicates. Called in the receiver.
        self.notified: Callable[[dict[str, Any]], None] | None = None

    # ------------------------------------------------------------ the tasks beside

    async def receive(self) -> None:
        """Read and act on every datagram, and serve the timers, until cancelled."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._timers)
            await self._read()

    async def _read(self) -> None:
        sock = self.sock
        burst = 0
        while True:
            try:
                data = sock.recv(dg.MAX_DATAGRAM)
            except BlockingIOError:
                burst = 0
                await trio.lowlevel.wait_readable(sock)
                continue
            except OSError:
                continue  # an ICMP error from an earlier send: the repeats deal with it
            burst += 1
            if burst % RECEIVE_BURST == 0:
                await trio.lowlevel.checkpoint()  # let the other tasks run
            packet = dg.decode(data)
            if packet is None:
                continue
            if packet.get("packet_type") == dg.IS_ACK:
                txid = packet.get("transmission_id")
                request = self._requests.pop(txid, None) if isinstance(txid, int) else None
                if request is not None:
                    request.answered(packet)
            elif packet.get("method") == "notify_task":
                self._on_notify(packet)

    async def _timers(self) -> None:
        deadlines = self._deadlines
        while True:
            now = trio.current_time()
            while (due := deadlines.pop_due(now)) is not None:
                when, item = due
                if isinstance(item, _Request):
                    self._request_due(item, when, now)
                else:
                    self._poll_due(item, when, now)
            self._timer_at = max(deadlines.next(), now + TIMER_TICK)
            with trio.move_on_at(self._timer_at):
                await self._timer_wake.wait()
            self._timer_wake = trio.Event()

    def _arm(self, when: float, item: _Request | _Job) -> None:
        self._deadlines.push(when, item)
        if when < self._timer_at:
            self._timer_wake.set()

    # ------------------------------------------------------------ requests

    def _send(self, data: bytes) -> None:
        # A datagram the kernel refuses (full buffer, unreachable) is lost like any
        # other: requests are repeated, and a lost ack brings the notification again.
        with contextlib.suppress(OSError):
            self.sock.sendto(data, self.server)

    def _request(
        self, method: str, params: dict[str, Any], deadline: float, answered: Answered
    ) -> _Request:
        """Send until acknowledged; `answered(ack)` then, or `answered(None)` at the deadline."""
        txid = next(self._txid)
        request = _Request(txid, dg.request(method, params, txid), deadline, answered)
        self._requests[txid] = request
        self._resend(request, trio.current_time())
        return request

    def _resend(self, request: _Request, now: float) -> None:
        """Send it (again), and arm its next repeat, or its deadline once it may be sent no
        more (dg.resend_after)."""
        self._send(request.data)
        request.sent += 1
        wait = dg.resend_after(request.sent)
        request.at = request.deadline if wait is None else min(request.deadline, now + wait)
        self._arm(request.at, request)

    def _request_due(self, request: _Request, when: float, now: float) -> None:
        if self._requests.get(request.txid) is not request or request.at != when:
            return  # answered or dropped since
        if now >= request.deadline:
            del self._requests[request.txid]
            request.answered(None)
            return
        self._resend(request, now)

    def _drop(self, request: _Request | None) -> None:
        """Forget a request: its `answered` is never called. A job drops its one request when
        it settles or is abandoned, so a job's callbacks only ever see it unsettled."""
        if request is not None:
            self._requests.pop(request.txid, None)

    async def request(
        self, method: str, params: dict[str, Any], deadline: float
    ) -> dict[str, Any] | None:
        """Send until acknowledged; the acknowledgement, or None at the deadline."""
        answer: list[dict[str, Any] | None] = []
        event = trio.Event()

        def answered(ack: dict[str, Any] | None) -> None:
            answer.append(ack)
            event.set()

        request = self._request(method, params, deadline, answered)
        try:
            await event.wait()
        finally:
            self._drop(request)
        return answer[0]

    # ------------------------------------------------------------ jobs

    def _start(self, task_id: int, payload: dict[str, Any], report: Report) -> _Job | None:
        """Submit `task_id`; `report(outcome)` once it has one (from the engine's tasks).
        None, and nothing sent, when this session runs a task of that id already."""
        if task_id in self._jobs:
            return None
        now = trio.current_time()
        job = self._jobs[task_id] = _Job(task_id, now, now + self.timeout, report)
        job.request = self._request(
            "add_task",
            {"task_id": task_id, **payload},
            job.deadline,
            functools.partial(self._added, job),
        )
        return job

    def _added(self, job: _Job, ack: dict[str, Any] | None) -> None:
        job.request = None
        if ack is None:
            self._finish(
                job, Outcome(job.task_id, "timeout", error="add_task was not acknowledged")
            )
            return
        err = ack.get("error")
        if err is not None:
            if not isinstance(err, dict):
                err = {"code": err}
            message = f"{err.get('code')}: {err.get('message', '')}"
            self._finish(job, Outcome(job.task_id, "refused", error=message))
            return
        self._wait_for_notification(job, trio.current_time())

    def _wait_for_notification(self, job: _Job, now: float) -> None:
        job.poll_at = min(job.deadline, now + POLL_AFTER)
        self._arm(job.poll_at, job)

    def _poll_due(self, job: _Job, when: float, now: float) -> None:
        if self._jobs.get(job.task_id) is not job or job.settled or job.poll_at != when:
            return
        if now >= job.deadline:
            self._finish(job, Outcome(job.task_id, "timeout", error="no notification in time"))
            return
        job.request = self._request(
            "get_task",
            {"task_id": job.task_id},
            job.deadline,
            functools.partial(self._polled, job),
        )

    def _polled(self, job: _Job, ack: dict[str, Any] | None) -> None:
        job.request = None
        if ack is None:
            self._finish(job, Outcome(job.task_id, "timeout", error="no notification in time"))
            return
        params = ack.get("params")
        if isinstance(params, dict) and params.get("status") in words.ENDED_WORDS:
            self._settle(job, dict(params))  # a late notification now counts as a repeat
        else:
            self._wait_for_notification(job, trio.current_time())

    def _on_notify(self, packet: dict[str, Any]) -> None:
        txid = packet.get("transmission_id")
        if packet.get("packet_type") == dg.WANT_ACK and isinstance(txid, int):
            self._send(dg.ack(txid))
        params = packet.get("params")
        if not isinstance(params, dict):
            return
        task_id = params.get("task_id")
        job = self._jobs.get(task_id) if isinstance(task_id, int) else None
        if job is None and self.notified is not None:
            self.notified(params)
            return
        if job is None or job.settled:
            self.duplicates += 1  # a repeat of an outcome already reported
            return
        self._settle(job, params)

    def _settle(self, job: _Job, params: dict[str, Any]) -> None:
        """Its outcome is known (notification or get_task): report it, reading a large
        result first."""
        job.settled = True
        self._drop(job.request)  # an add_task not yet acknowledged, or a get_task
        job.request = None
        status = params.get("status")
        if status != "success":
            self._finish(job, Outcome(job.task_id, str(status), error=str(params.get("error", ""))))
            return
        inline = dg.read_bytes(params, "result")
        if inline is not None:
            self._finish(job, Outcome(job.task_id, "success", inline))
            return
        size = params.get("result_size", 0)
        job.size = size if isinstance(size, int) else 0
        self._next_chunk(job)

    def _next_chunk(self, job: _Job) -> None:
        if len(job.result) >= job.size:
            self._finish(job, Outcome(job.task_id, "success", bytes(job.result)))
            return
        params = {"task_id": job.task_id, "offset": len(job.result), "length": dg.MAX_CHUNK}
        job.request = self._request(
            "get_result", params, job.deadline, functools.partial(self._chunk, job)
        )

    def _chunk(self, job: _Job, ack: dict[str, Any] | None) -> None:
        job.request = None
        if ack is None or "error" in ack:
            self._finish(job, Outcome(job.task_id, "timeout", error="could not read the result"))
            return
        params = ack.get("params")
        chunk = (dg.read_bytes(params, "result") if isinstance(params, dict) else None) or b""
        if not chunk:  # the controller has no more than this
            job.size = len(job.result)
        job.result += chunk
        self._next_chunk(job)

    def _finish(self, job: _Job, outcome: Outcome) -> None:
        self._abandon(job)
        if outcome.status not in ("timeout", "refused"):
            outcome.latency = trio.current_time() - job.started
        job.report(outcome)

    def _abandon(self, job: _Job) -> None:
        """Stop following a job (its outcome is reported by the caller, or not at all)."""
        job.settled = True
        self._drop(job.request)
        job.request = None
        if self._jobs.get(job.task_id) is job:
            del self._jobs[job.task_id]

    # ------------------------------------------------------------ the API

    async def run_task(self, task_id: int, payload: dict[str, Any]) -> Outcome:
        """Run one task to its outcome."""
        outcome: list[Outcome] = []
        event = trio.Event()

        def report(done: Outcome) -> None:
            outcome.append(done)
            event.set()

        job = self._start(task_id, payload, report)
        if job is None:
            return _already_running(task_id)
        try:
            await event.wait()
        finally:
            if not outcome:
                self._abandon(job)
        return outcome[0]

    async def run_many(
        self,
        task_ids: Iterable[int],
        payload: dict[str, Any],
        window: int,
        on_outcome: Callable[[Outcome], None],
    ) -> None:
        """Run every task, `window` at a time, reporting each outcome as it comes.

        Each outcome sends the next task from the receiver, at once. An exception
        from `on_outcome` stops the batch and is raised here.
        """
        window = max(1, window)
        ids = iter(task_ids)
        live: dict[int, _Job] = {}
        failed: list[BaseException] = []
        all_done = trio.Event()
        filling = False
        exhausted = False

        def tell(outcome: Outcome) -> None:
            try:
                on_outcome(outcome)
            except BaseException as exc:
                failed.append(exc)

        def fill() -> None:
            """Start tasks until `window` are live, the ids run out or on_outcome failed."""
            nonlocal filling, exhausted
            if filling:  # an outcome reported while starting: the loop below goes on
                return
            filling = True
            try:
                while len(live) < window and not failed:
                    task_id = next(ids, None)
                    if task_id is None:
                        exhausted = True
                        break
                    job = self._start(task_id, payload, report)
                    if job is None:
                        tell(_already_running(task_id))
                    else:
                        live[task_id] = job
            finally:
                filling = False
            if failed or (exhausted and not live):
                all_done.set()

        def report(outcome: Outcome) -> None:
            live.pop(outcome.task_id, None)
            tell(outcome)
            fill()

        fill()
        try:
            await all_done.wait()
        finally:
            for job in list(live.values()):
                self._abandon(job)
        if failed:
            raise failed[0]


def _already_running(task_id: int) -> Outcome:
    return Outcome(task_id, "refused", error=f"task {task_id} is already running in this session")

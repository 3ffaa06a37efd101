"""The UDP client engine: jobs through the front door over one socket, under trio.

One UDP socket; a receiver task routes acknowledgements to the request that
waits for them (by transmission_id) and notifications to the task that waits
for them (by task_id), acknowledging every copy and reporting each outcome
once. Requests are repeated with a doubling interval until acknowledged. A
task whose notification seems lost is asked about with get_task; a result too
large for one datagram is read with get_result.
The datagram format is controller/datagram.py, shared with the front door.
"""

from __future__ import annotations

import contextlib
import itertools
import socket as stdsocket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import trio

from controller import datagram as dg

# udp-client's exit statuses: success, job error or failed_post, usage error, no answer.
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_TIMEOUT = 0, 1, 2, 3
# First repeat of an unacknowledged request, then doubling up to the cap.
RESEND_FIRST = 0.2
RESEND_MAX = 2.0
# With no notification this long after the acknowledgement, ask with get_task (then again).
POLL_AFTER = 3.0
# Datagrams handled in a row before the receiver lets the tasks it woke run.
RECEIVE_BURST = 64


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


@dataclass
class _Waiter:
    event: trio.Event = field(default_factory=trio.Event)
    packet: dict[str, Any] | None = None


class UdpSession:
    """Runs tasks through one bound UDP socket; `receive()` must run beside `run_task`.

    The socket is a plain stdlib socket used without blocking: sending never
    waits (a datagram the kernel cannot take is lost, and repeated like any
    other), and `receive` drains every datagram that is there before it waits.
    """

    def __init__(self, sock: stdsocket.socket, server: tuple[str, int], timeout: float) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.server = server
        self.timeout = timeout
        self.duplicates = 0
        self._txid = itertools.count(int(time.time() * 1000))
        self._acks: dict[int, _Waiter] = {}
        self._notes: dict[int, _Waiter] = {}

    async def receive(self) -> None:
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
                await trio.lowlevel.checkpoint()  # let the waiting tasks run
            packet = dg.decode(data)
            if packet is None:
                continue
            if packet.get("packet_type") == dg.IS_ACK:
                waiter = self._acks.get(packet.get("transmission_id"))  # type: ignore[arg-type]
                if waiter is not None and not waiter.event.is_set():
                    waiter.packet = packet
                    waiter.event.set()
            elif packet.get("method") == "notify_task":
                self._on_notify(packet)

    def _send(self, data: bytes) -> None:
        # A datagram the kernel refuses (full buffer, unreachable) is lost like any
        # other: requests are repeated, and a lost ack brings the notification again.
        with contextlib.suppress(OSError):
            self.sock.sendto(data, self.server)

    def _on_notify(self, packet: dict[str, Any]) -> None:
        txid = packet.get("transmission_id")
        if packet.get("packet_type") == dg.WANT_ACK and isinstance(txid, int):
            self._send(dg.ack(txid))
        params = packet.get("params")
        if not isinstance(params, dict):
            return
        task_id = params.get("task_id")
        waiter = self._notes.get(task_id) if isinstance(task_id, int) else None
        if waiter is None or waiter.event.is_set():
            self.duplicates += 1  # a repeat of an outcome already reported
            return
        waiter.packet = params
        waiter.event.set()

    async def request(
        self, method: str, params: dict[str, Any], deadline: float
    ) -> dict[str, Any] | None:
        """Send until acknowledged; the acknowledgement, or None at the deadline."""
        txid = next(self._txid)
        data = dg.request(method, params, txid)
        waiter = _Waiter()
        self._acks[txid] = waiter
        interval = RESEND_FIRST
        try:
            while trio.current_time() < deadline:
                self._send(data)
                with trio.move_on_at(min(deadline, trio.current_time() + interval)):
                    await waiter.event.wait()
                    return waiter.packet
                interval = min(interval * 2, RESEND_MAX)
            return None
        finally:
            del self._acks[txid]

    async def run_task(self, task_id: int, payload: dict[str, Any]) -> Outcome:
        start = trio.current_time()
        deadline = start + self.timeout
        waiter = _Waiter()
        self._notes[task_id] = waiter
        try:
            ack = await self.request("add_task", {"task_id": task_id, **payload}, deadline)
            if ack is None:
                return Outcome(task_id, "timeout", error="add_task was not acknowledged")
            if "error" in ack:
                err = ack["error"]
                return Outcome(
                    task_id, "refused", error=f"{err.get('code')}: {err.get('message', '')}"
                )
            params = await self._await_outcome(task_id, waiter, deadline)
            if params is None:
                return Outcome(task_id, "timeout", error="no notification in time")
            outcome = await self._outcome(task_id, params, deadline)
            outcome.latency = trio.current_time() - start
            return outcome
        finally:
            self._notes.pop(task_id, None)

    async def run_many(
        self,
        task_ids: Iterable[int],
        payload: dict[str, Any],
        window: int,
        on_outcome: Callable[[Outcome], None],
    ) -> None:
        """Run every task, `window` at a time, reporting each outcome as it comes.

        A fixed set of `window` runners takes the ids in turn: no task and no
        limiter per id.
        """
        ids = iter(task_ids)

        async def runner() -> None:
            for task_id in ids:
                on_outcome(await self.run_task(task_id, payload))

        async with trio.open_nursery() as nursery:
            for _ in range(max(1, window)):
                nursery.start_soon(runner)

    async def _await_outcome(
        self, task_id: int, waiter: _Waiter, deadline: float
    ) -> dict[str, Any] | None:
        while True:
            with trio.move_on_at(min(deadline, trio.current_time() + POLL_AFTER)):
                await waiter.event.wait()
                return waiter.packet
            if trio.current_time() >= deadline:
                return None
            ack = await self.request("get_task", {"task_id": task_id}, deadline)
            if ack is None:
                return None
            params = ack.get("params") or {}
            if params.get("status") in ("success", "error", "failed_post"):
                if waiter.event.is_set():
                    return waiter.packet
                waiter.event.set()  # from now on a late notification counts as a duplicate
                return dict(params)

    async def _outcome(self, task_id: int, params: dict[str, Any], deadline: float) -> Outcome:
        status = params.get("status")
        if status != "success":
            return Outcome(task_id, str(status), error=str(params.get("error", "")))
        inline = dg.read_bytes(params, "result")
        if inline is not None:
            return Outcome(task_id, "success", inline)
        size = params.get("result_size", 0)
        result = bytearray()
        while len(result) < size:
            ack = await self.request(
                "get_result",
                {"task_id": task_id, "offset": len(result), "length": dg.MAX_CHUNK},
                deadline,
            )
            if ack is None or "error" in ack:
                return Outcome(task_id, "timeout", error="could not read the result")
            chunk = dg.read_bytes(ack["params"], "result") or b""
            if not chunk:
                break
            result += chunk
        return Outcome(task_id, "success", bytes(result))

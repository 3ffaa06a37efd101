"""`worker --udp HOST:PORT`: a calculator, a worker that speaks the UDP door's datagrams.

It sends `heartbeat` every `--pulse` seconds (`busy` while it runs a job,
`ready` otherwise, and one `ready` at once when a job ends; each names the
queues it serves and the labels it has), takes
`perform_task` (acknowledging every copy, running one job at a time), and
reports with `completed_task`, repeated under the one resend rule of the
datagram format (controller/datagram.py, `resend_after`) until the controller
acknowledges it; past that rule's count, it goes with every heartbeat instead,
so that a controller that was away long gets it when it is back. A controller
that restarts simply hears the next heartbeat. A result
too large for one datagram is reported as an error. SIGTERM/SIGINT, or the
end of the --exit-with-parent process: finish the running job and its report
(bounded by --drain-timeout), then exit 0 (worker/leaving.py).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import time
from collections import OrderedDict
from typing import Any

import trio

from controller import datagram as dg
from controller.declared import DEFAULT as DECLARED_DEFAULT
from controller.declared import Declared
from worker.leaving import leave_on_signals
from worker.output import SINK, OutputSink
from worker.progress import REPORTER, Reporter
from worker.runner import Runner, TaskFailed, take_usage

log = logging.getLogger("worker.calculator")

# How many recent transmission ids and successful reports the calculator remembers.
MEMORY = 10_000


class Calculator:
    def __init__(
        self,
        server: tuple[str, int],
        runner: Runner,
        *,
        pulse_period: float = 1.0,
        drain_timeout: float = 30.0,
        declared: Declared = DECLARED_DEFAULT,
        parent_pid: int | None = None,
    ) -> None:
        infos = socket.getaddrinfo(server[0], server[1], type=socket.SOCK_DGRAM)
        family, _, _, _, address = infos[0]
        self.sock = socket.socket(family, socket.SOCK_DGRAM)
        self.sock.setblocking(False)
        self.sock.connect(address)  # only the controller's datagrams come in
        self.runner = runner
        self.pulse_period = pulse_period
        self.drain_timeout = drain_timeout
        self.parent_pid = parent_pid  # its end drains the worker (None: not watched)
        # Every heartbeat says what the calculator serves and has.
        self._declared = {
            "queues": sorted(declared.queues),
            "labels": sorted(declared.labels),
        }
        self._txid = itertools.count(int(time.time() * 1000))
        self._running: int | None = None  # task_id of the job being run
        self._report: tuple[int, bytes] | None = None  # (txid, datagram) not yet acknowledged
        self._report_with_beats = False  # its repeats are spent: it goes with the heartbeats
        self._reported = 0  # task_id of the last report
        # Recent perform_task transmission ids (copies are acknowledged, not acted on), and
        # the reports of recent successes (a job asked for again is reported, not rerun).
        self._seen: OrderedDict[int, bytes] = OrderedDict()
        self._succeeded: OrderedDict[int, dict[str, Any]] = OrderedDict()
        self._report_acked = trio.Event()
        self._beat_now = trio.Event()
        self._idle = trio.Event()  # set when a job's report is acknowledged
        self._draining = False
        # The running job's progress (worker/progress.py): the latest goes with each busy
        # heartbeat as params.progress and params.progress_status.
        self._reporter = Reporter()
        self._progress: tuple[float, str] | None = None

    async def run(self) -> int:
        with self.sock:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._heartbeats)
                nursery.start_soon(self._signals, nursery.cancel_scope)
                await self._receive(nursery)
        return 0

    # ------------------------------------------------------------ out

    def _send(self, data: bytes) -> None:
        with contextlib.suppress(OSError):  # refused while the controller restarts: lost
            self.sock.send(data)

    async def _heartbeats(self) -> None:
        while True:
            status = "busy" if self._running is not None or self._report else "ready"
            beat: dict[str, Any] = {"status": status, **self._declared}
            self._progress = self._reporter.take() or self._progress
            if self._running is not None and self._progress is not None:
                beat["progress"], beat["progress_status"] = self._progress
            self._send(dg.request("heartbeat", beat))
            if self._report is not None and self._report_with_beats:
                self._send(self._report[1])
            with trio.move_on_after(self.pulse_period):
                await self._beat_now.wait()
            self._beat_now = trio.Event()

    async def _signals(self, scope: trio.CancelScope) -> None:
        await leave_on_signals(scope, self._drain, self.drain_timeout, self.parent_pid)

    async def _drain(self) -> None:
        self._draining = True
        if self._running is not None or self._report is not None:
            await self._idle.wait()

    # ------------------------------------------------------------ in

    async def _receive(self, nursery: trio.Nursery) -> None:
        while True:
            await trio.lowlevel.wait_readable(self.sock)
            while True:
                try:
                    data = self.sock.recv(dg.MAX_DATAGRAM)
                except BlockingIOError:
                    break
                except OSError:
                    continue  # an ICMP error for an earlier send
                self._datagram(data, nursery)

    def _datagram(self, data: bytes, nursery: trio.Nursery) -> None:
        packet = dg.decode(data)
        if packet is None:
            return
        txid = packet.get("transmission_id")
        if packet.get("packet_type") == dg.IS_ACK:
            if self._report is not None and txid == self._report[0]:
                self._report = None
                self._report_acked.set()
                self._idle.set()
                self._beat_now.set()  # ready at once
            return
        if packet.get("method") != "perform_task" or not isinstance(txid, int):
            return
        params = packet.get("params")
        task_id = params.get("task_id") if isinstance(params, dict) else None
        if not isinstance(task_id, int) or not isinstance(params, dict):
            return
        answer = self._seen.get(txid)
        if answer is not None:
            self._send(answer)  # a copy (repeated, duplicated or late): the same answer
            return
        if self._running == task_id or (self._report is not None and self._reported == task_id):
            self._answer(txid, dg.ack(txid))  # the controller asks again for the job it has
            return
        if self._report is not None and self._running is None:
            # The controller places a new job here only once it has our report: this
            # perform_task is as good as the acknowledgement (which may still be on its way).
            self._report = None
            self._report_acked.set()
            self._idle.set()
        if self._draining or self._running is not None:
            # Busy with another job (or leaving): the controller places it elsewhere.
            busy = dg.error_ack(txid, "busy", "running another job", dg.MAX_DATAGRAM)
            self._answer(txid, busy or b"")
            return
        self._answer(txid, dg.ack(txid))
        done = self._succeeded.get(task_id)
        if done is not None:
            # It ran this job and the controller lost the report: tell it again, do not rerun.
            nursery.start_soon(self._report_again, task_id, done)
            return
        payload = dg.read_bytes(params, "payload") or b""
        self._running = task_id
        self._idle = trio.Event()
        nursery.start_soon(self._run, task_id, payload)

    def _answer(self, txid: int, answer: bytes) -> None:
        """Answer a perform_task, and every later copy of it the same way."""
        self._seen[txid] = answer
        if len(self._seen) > MEMORY:
            self._seen.popitem(last=False)
        self._send(answer)

    async def _run(self, task_id: int, payload: bytes) -> None:
        params: dict[str, Any] = {"task_id": task_id}
        sink = OutputSink(limit=dg.MAX_INLINE_RESULT)
        SINK.set(sink)  # this task's context: the job's stderr and logging go there
        self._reporter.clear()
        self._progress = None
        REPORTER.set(self._reporter)  # and its progress
        try:
            result = await self.runner(task_id, payload)
            params["status"] = "success"
            dg.put_bytes(params, "result", result)
        except TaskFailed as exc:
            params["status"] = "error"
            params["error"] = str(exc)[-4000:]
        except Exception as exc:  # a bug in a runner must not kill the calculator
            SINK.set(None)  # the calculator's own line, not the job's
            log.exception("job %d: runner crashed", task_id)
            params = {"task_id": task_id, "status": "error", "error": f"worker error: {exc}"}
        SINK.set(None)
        usage = take_usage()
        if usage is not None:  # what the job used, when it fits the datagram (below)
            params["usage"] = usage
        params, txid, data = self._completion(task_id, params, sink.take(len(sink)))
        if params["status"] == "success":
            self._succeeded[task_id] = params
            if len(self._succeeded) > MEMORY:
                self._succeeded.popitem(last=False)
        await self._send_report(task_id, txid, data)

    async def _report_again(self, task_id: int, params: dict[str, Any]) -> None:
        self._running = task_id
        self._idle = trio.Event()
        _, txid, data = self._completion(task_id, params)
        await self._send_report(task_id, txid, data)

    def _completion(
        self, task_id: int, params: dict[str, Any], output: bytes = b""
    ) -> tuple[dict[str, Any], int, bytes]:
        """The completed_task datagram (an error report when the result cannot fit one), with
        as much of the end of the job's `output` as fits beside it."""
        txid = next(self._txid)
        data = dg.request("completed_task", params, txid)
        if len(data) > dg.MAX_INLINE_RESULT and "usage" in params:
            params = {name: value for name, value in params.items() if name != "usage"}
            data = dg.request("completed_task", params, txid)
        if len(data) > dg.MAX_INLINE_RESULT:
            error = f"result of {len(data)} bytes encoded is too large for one datagram"
            params = {"task_id": task_id, "status": "error", "error": error}
            data = dg.request("completed_task", params, txid)
        if output:
            room = dg.MAX_INLINE_RESULT - len(data)
            text = output.decode("utf-8", "replace")[-room:]
            while text:
                with_output = dg.request("completed_task", {**params, "output": text}, txid)
                if len(with_output) <= dg.MAX_INLINE_RESULT:
                    return {**params, "output": text}, txid, with_output
                # Escapes took more room than characters: cut from the front by the excess.
                text = text[len(with_output) - dg.MAX_INLINE_RESULT :]
        return params, txid, data

    async def _send_report(self, task_id: int, txid: int, data: bytes) -> None:
        """completed_task, repeated until acknowledged."""
        self._report = (txid, data)
        self._report_with_beats = False
        self._reported = task_id
        self._report_acked = trio.Event()
        self._running = None
        sent = 0
        while self._report is not None and self._report[0] == txid:
            self._send(data)
            sent += 1
            wait = dg.resend_after(sent)
            if wait is None:
                self._report_with_beats = True
                return
            with trio.move_on_after(wait):
                await self._report_acked.wait()

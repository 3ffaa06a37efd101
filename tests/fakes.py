"""Fakes of the other side, on real Unix sockets: a fake worker and a fake controller."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import trio

from controller import wire
from controller.transport import listen_unix
from gen import worker_protocol_pb2 as pb
from tests.helpers import accept, exchange

Responder = Callable[[pb.ControlMsg, bytes], Awaitable[tuple[pb.WorkerResponse, bytes] | None]]


@dataclass
class FakeWorker:
    """Registers on main.sock and answers control messages like a well-behaved worker.

    `script` may override the answer per control type (return None to hang up
    without answering). `received` records every control message.
    """

    socket_dir: Path
    next_pulse: int = 2
    worker_id: int = 0
    task_id: int = 0
    result: bytes | None = None
    received: list[tuple[int, int, bytes]] = field(default_factory=list)
    script: dict[int, Responder] = field(default_factory=dict)
    got: trio.Event = field(default_factory=trio.Event)

    async def pulse(self, ptype: int = pb.PULSE_OK, task_id: int | None = None) -> pb.PulseResponse:
        tid = self.task_id if task_id is None else task_id
        msg = pb.WorkerPulse(
            type=ptype, worker_id=self.worker_id, task_id=tid, next_pulse=self.next_pulse
        )
        resp, _ = await exchange(self.socket_dir / "main.sock", msg, pb.PulseResponse)
        return resp

    async def start(self, nursery: trio.Nursery, ready: bool = True) -> FakeWorker:
        resp = await self.pulse(pb.PULSE_REGISTER)
        assert resp.error == pb.CTRL_ERR_OK
        self.worker_id = resp.worker_id
        path = self.socket_dir / f"{self.worker_id}.sock"
        sock = listen_unix(path, 64)
        nursery.start_soon(self._serve, sock, nursery)
        if ready:
            assert (await self.pulse()).error == pb.CTRL_ERR_OK
        return self

    async def _serve(self, sock, nursery) -> None:
        with sock:
            while True:
                nursery.start_soon(self._answer, await accept(sock))

    async def _answer(self, conn) -> None:
        with conn:
            msg, extra = await wire.recv_frame(conn, pb.ControlMsg, timeout=5)
            self.received.append((msg.type, msg.task_id, extra))
            self.got.set()
            self.got = trio.Event()
            custom = self.script.get(msg.type)
            out = await custom(msg, extra) if custom else self.default(msg, extra)
            if out is not None:
                await wire.send_frame(conn, out[0], out[1], timeout=5)

    def default(self, msg: pb.ControlMsg, extra: bytes) -> tuple[pb.WorkerResponse, bytes]:
        if msg.type == pb.CTRL_SET_TASK:
            if self.task_id:
                return pb.WorkerResponse(error=pb.WORKER_ERR_BUSY, task_id=self.task_id), b""
            self.task_id = msg.task_id
            self.result = b"done:" + extra
            return pb.WorkerResponse(error=pb.WORKER_ERR_OK, task_id=msg.task_id), b""
        if msg.type == pb.CTRL_FETCH:
            if self.result is None:
                return pb.WorkerResponse(error=pb.WORKER_ERR_NO_FETCH, task_id=self.task_id), b""
            tid, result = self.task_id, self.result
            self.task_id, self.result = 0, None
            return pb.WorkerResponse(error=pb.WORKER_ERR_OK, task_id=tid), result
        return pb.WorkerResponse(error=pb.WORKER_ERR_OK, task_id=self.task_id), b""

    def kinds(self) -> list[int]:
        return [kind for kind, _, _ in self.received]

    async def wait_for(self, kind: int, count: int = 1) -> None:
        while self.kinds().count(kind) < count:
            await self.got.wait()


@dataclass
class FakeController:
    """A scripted main.sock: answers pulses, records them, can forget worker ids."""

    socket_dir: Path
    next_id: int = 1
    known: set[int] = field(default_factory=set)
    pulses: list[tuple[float, pb.WorkerPulse]] = field(default_factory=list)
    changed: trio.Event = field(default_factory=trio.Event)
    # False: a controller older than job output (its REGISTER answer does not offer to take it).
    takes_output: bool = False
    outputs: list[tuple[int, bytes]] = field(default_factory=list)  # (task_id, bytes) received
    # False: a controller older than job progress (it is sent no PULSE_PROGRESS).
    takes_progress: bool = False

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        path = self.socket_dir / "main.sock"
        sock = listen_unix(path, 64)
        task_status.started()
        async with trio.open_nursery() as nursery:
            with sock:
                while True:
                    nursery.start_soon(self._answer, await accept(sock))

    async def _answer(self, conn) -> None:
        with conn:
            pulse, extra = await wire.recv_frame(
                conn, pb.WorkerPulse, timeout=5, max_extra_size=wire.MAX_PULSE_EXTRA
            )
            self.pulses.append((trio.current_time(), pulse))
            if pulse.type == pb.PULSE_OUTPUT:
                self.outputs.append((pulse.task_id, extra))
            if pulse.type == pb.PULSE_REGISTER:
                resp = pb.PulseResponse(
                    error=pb.CTRL_ERR_OK,
                    worker_id=self.next_id,
                    takes_output=self.takes_output,
                    takes_progress=self.takes_progress,
                )
                self.known.add(self.next_id)
                self.next_id += 1
            elif pulse.worker_id in self.known:
                resp = pb.PulseResponse(error=pb.CTRL_ERR_OK)
            else:
                resp = pb.PulseResponse(error=pb.CTRL_ERR_UNKNOWN_ID)
            await wire.send_frame(conn, resp, timeout=5)
            self.changed.set()
            self.changed = trio.Event()

    def of_type(self, ptype: int) -> list[pb.WorkerPulse]:
        return [p for _, p in self.pulses if p.type == ptype]

    async def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0) -> None:
        with trio.fail_after(timeout):
            while not predicate():
                await self.changed.wait()

    async def control(self, worker_id: int, msg: pb.ControlMsg, extra: bytes = b""):
        return await exchange(self.socket_dir / f"{worker_id}.sock", msg, pb.WorkerResponse, extra)

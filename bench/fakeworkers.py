"""Many fake workers in one process, for controller benchmarks.

`--mode pulse`: register COUNT workers and pulse each every PERIOD seconds, spread evenly.
`--mode answer`: COUNT workers that accept SET_TASK and report FETCH_ME at once; each
registers with the queues (`--queue`, repeated; none: `default`) and labels (`--label`) given.
"""

from __future__ import annotations

import argparse
import socket
from pathlib import Path

import trio

from controller import wire
from controller.transport import listen_unix
from gen import worker_protocol_pb2 as pb
from tests.helpers import accept
from tests.helpers import exchange as dial


async def exchange(path: str, msg: pb.WorkerPulse) -> pb.PulseResponse:
    resp, _ = await dial(path, msg, pb.PulseResponse, timeout=10)
    return resp


async def pulse_forever(main: str, wid: int, period: float, offset: float) -> None:
    await trio.sleep(offset)
    msg = pb.WorkerPulse(type=pb.PULSE_OK, worker_id=wid, next_pulse=max(1, round(3 * period)))
    while True:
        started = trio.current_time()
        await exchange(main, msg)
        await trio.sleep_until(started + period)


class AnsweringWorker:
    def __init__(self, socket_dir: Path, queues: list[str], labels: list[str]) -> None:
        self.dir = socket_dir
        self.queues = queues
        self.labels = labels
        self.main = str(socket_dir / "main.sock")
        self.wid = 0
        self.task_id = 0

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        reg = pb.WorkerPulse(
            type=pb.PULSE_REGISTER, next_pulse=60, queues=self.queues, labels=self.labels
        )
        self.wid = (await exchange(self.main, reg)).worker_id
        sock = listen_unix(self.dir / f"{self.wid}.sock", 64)
        await exchange(
            self.main, pb.WorkerPulse(type=pb.PULSE_OK, worker_id=self.wid, next_pulse=60)
        )
        task_status.started()
        async with trio.open_nursery() as nursery:
            while True:
                nursery.start_soon(self.answer, await accept(sock), nursery)

    async def answer(self, conn: socket.socket, nursery: trio.Nursery) -> None:
        with conn:
            msg, extra = await wire.recv_frame(conn, pb.ControlMsg, timeout=10)
            if msg.type == pb.CTRL_SET_TASK:
                self.task_id = msg.task_id
                resp = pb.WorkerResponse(error=pb.WORKER_ERR_OK, task_id=msg.task_id)
                await wire.send_frame(conn, resp, timeout=10)
                fetch_me = pb.WorkerPulse(
                    type=pb.PULSE_FETCH_ME, worker_id=self.wid, task_id=msg.task_id, next_pulse=60
                )
                nursery.start_soon(exchange, self.main, fetch_me)
            elif msg.type == pb.CTRL_FETCH:
                resp = pb.WorkerResponse(error=pb.WORKER_ERR_OK, task_id=self.task_id)
                self.task_id = 0
                await wire.send_frame(conn, resp, extra, timeout=10)
            else:
                resp = pb.WorkerResponse(error=pb.WORKER_ERR_OK, task_id=self.task_id)
                await wire.send_frame(conn, resp, timeout=10)


async def main_async(args: argparse.Namespace) -> None:
    socket_dir = Path(args.socket_dir)
    async with trio.open_nursery() as nursery:
        if args.mode == "pulse":
            main = str(socket_dir / "main.sock")
            reg = pb.WorkerPulse(type=pb.PULSE_REGISTER, next_pulse=max(1, round(3 * args.period)))
            for i in range(args.count):
                wid = (await exchange(main, reg)).worker_id
                nursery.start_soon(
                    pulse_forever, main, wid, args.period, args.period * i / args.count
                )
        else:
            for _ in range(args.count):
                await nursery.start(AnsweringWorker(socket_dir, args.queue, args.label).run)
        print("ready", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket-dir", required=True)
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--mode", choices=["pulse", "answer"], default="answer")
    parser.add_argument("--period", type=float, default=1.0)
    parser.add_argument("--queue", action="append", default=[])
    parser.add_argument("--label", action="append", default=[])
    trio.run(main_async, parser.parse_args())


if __name__ == "__main__":
    main()

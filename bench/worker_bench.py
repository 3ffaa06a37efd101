"""The worker alone: tasks/s through one real worker process driven by a fake controller.

Printed beside a bare `subprocess.run(["true"])` loop measured in the same run, so the
`--exec true` figure shows what the worker adds on top of starting a process.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import trio

from bench.common import median, socket_dir
from controller import wire
from controller.transport import listen_unix
from gen import worker_protocol_pb2 as pb
from tests.helpers import accept, exchange, worker_argv


class MiniController:
    """Answers pulses and wakes the driver when FETCH_ME arrives."""

    def __init__(self, sockdir: Path) -> None:
        self.sockdir = sockdir
        self.worker_id = 0
        self.ready = trio.Event()
        self.fetch_me = trio.Event()

    async def serve(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listener = listen_unix(self.sockdir / "main.sock", 64)
        task_status.started()
        async with trio.open_nursery() as nursery:
            while True:
                nursery.start_soon(self.answer, await accept(listener))

    async def answer(self, conn: Any) -> None:
        with conn:
            pulse, _ = await wire.recv_frame(conn, pb.WorkerPulse, timeout=5)
            resp = pb.PulseResponse(error=pb.CTRL_ERR_OK)
            if pulse.type == pb.PULSE_REGISTER:
                self.worker_id = 1
                resp.worker_id = 1
            await wire.send_frame(conn, resp, timeout=5)
            if pulse.type == pb.PULSE_OK:
                self.ready.set()
            elif pulse.type == pb.PULSE_FETCH_ME:
                self.fetch_me.set()


async def drive(args: list[str], tasks: int) -> float:
    with socket_dir() as sockdir:
        ctl = MiniController(sockdir)
        async with trio.open_nursery() as nursery:
            await nursery.start(ctl.serve)
            cmd = worker_argv(sockdir, *args)
            proc = subprocess.Popen(cmd)
            try:
                await ctl.ready.wait()
                path = sockdir / "1.sock"
                start = time.perf_counter()
                for task_id in range(1, tasks + 1):
                    ctl.fetch_me = trio.Event()
                    msg = pb.ControlMsg(type=pb.CTRL_SET_TASK, task_id=task_id)
                    await exchange(path, msg, pb.WorkerResponse, b"", timeout=5)
                    await ctl.fetch_me.wait()
                    resp, _ = await exchange(
                        path, pb.ControlMsg(type=pb.CTRL_FETCH), pb.WorkerResponse, timeout=5
                    )
                    assert resp.error == pb.WORKER_ERR_OK, resp
                elapsed = time.perf_counter() - start
            finally:
                proc.terminate()
                proc.wait()
            nursery.cancel_scope.cancel()
    return tasks / elapsed


def bare_true(count: int) -> float:
    start = time.perf_counter()
    for _ in range(count):
        subprocess.run(["true"], check=True)
    return count / (time.perf_counter() - start)


def main(rounds: int = 3) -> dict[str, Any]:
    runs: dict[str, list[float]] = {
        "async_noop": [],
        "sync_noop": [],
        "exec_true": [],
        "bare_true": [],
    }
    for _ in range(rounds):
        runs["async_noop"].append(trio.run(drive, ["--handler", "worker.runner:anoop"], 3000))
        runs["sync_noop"].append(trio.run(drive, ["--handler", "worker.runner:noop"], 3000))
        runs["exec_true"].append(trio.run(drive, ["--exec", "true"], 300))
        runs["bare_true"].append(bare_true(300))
    r = {name: round(median(values)) for name, values in runs.items()}
    print(
        f"one worker, fake controller: async no-op handler {r['async_noop']:,} tasks/s "
        f"({1e6 / r['async_noop']:.0f} us/task), sync no-op handler (in a thread) {r['sync_noop']:,} tasks/s "
        f"({1e6 / r['sync_noop']:.0f} us/task)"
    )
    print(
        f"one worker, --exec true: {r['exec_true']:,} tasks/s ({1e6 / r['exec_true']:.0f} us/task) "
        f"beside bare subprocess.run(['true']): {r['bare_true']:,}/s ({1e6 / r['bare_true']:.0f} us); "
        f"the worker adds {1e6 / r['exec_true'] - 1e6 / r['bare_true']:.0f} us per task"
    )
    return r


if __name__ == "__main__":
    main()

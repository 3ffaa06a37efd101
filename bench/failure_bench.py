"""How fast a dead or frozen worker's task moves on.

A real worker (`--exec sleep 60`) holds a task; a fake worker waits idle. We
kill -9 (or SIGSTOP) the real one and time until the fake one receives the
task's SET_TASK. kill -9 is seen through the pidfd at once; SIGSTOP only when
the worker's promised next_pulse runs out.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import trio

from bench.common import median, socket_dir
from controller import wire
from controller.config import Config
from controller.shell.core_shell import CoreShell
from controller.transport import listen_unix
from gen import worker_protocol_pb2 as pb
from tests.helpers import accept, exchange, worker_argv


class Catcher:
    """A fake worker that timestamps the SET_TASK it receives."""

    def __init__(self, sockdir: Path) -> None:
        self.sockdir = sockdir
        self.got = trio.Event()
        self.at = 0.0

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        main = self.sockdir / "main.sock"
        reg, _ = await exchange(
            main, pb.WorkerPulse(type=pb.PULSE_REGISTER, next_pulse=60), pb.PulseResponse, timeout=5
        )
        listener = listen_unix(self.sockdir / f"{reg.worker_id}.sock", 16)
        await exchange(
            main,
            pb.WorkerPulse(type=pb.PULSE_OK, worker_id=reg.worker_id, next_pulse=60),
            pb.PulseResponse,
            timeout=5,
        )
        task_status.started()
        while True:
            conn = await accept(listener)
            with conn:
                msg, _ = await wire.recv_frame(conn, pb.ControlMsg, timeout=5)
                if msg.type == pb.CTRL_SET_TASK and not self.got.is_set():
                    self.at = time.perf_counter()
                    self.got.set()
                await wire.send_frame(
                    conn, pb.WorkerResponse(error=pb.WORKER_ERR_OK, task_id=msg.task_id), timeout=5
                )


async def one(how: int, pulse: float) -> float:
    with socket_dir() as sockdir:
        shell = CoreShell(Config(socket_dir=sockdir, journal=None))
        async with trio.open_nursery() as nursery:
            await nursery.start(shell.serve)
            cmd = worker_argv(sockdir, "--pulse", str(pulse), "--exec", "sleep", "60")
            proc = subprocess.Popen(cmd)
            try:
                while shell.core.idle_workers < 1:
                    await trio.sleep(0.005)
                shell.submit(1, b"")
                [victim] = shell.core.workers.values()
                while victim.task is None or victim.task.state.value != "running":
                    await trio.sleep(0.005)
                catcher = Catcher(sockdir)
                await nursery.start(catcher.run)
                await trio.sleep(0.3)  # a moment into the pulse period, as in life
                start = time.perf_counter()
                proc.send_signal(how)
                await catcher.got.wait()
                elapsed = catcher.at - start
            finally:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait()
            nursery.cancel_scope.cancel()
    return elapsed


def main(rounds: int = 5) -> dict[str, Any]:
    kill = [trio.run(one, signal.SIGKILL, 1.0) for _ in range(rounds)]
    stop = [trio.run(one, signal.SIGSTOP, 1.0) for _ in range(3)]
    r = {
        "kill9_to_replacement_ms": round(median(kill) * 1000, 1),
        "kill9_max_ms": round(max(kill) * 1000, 1),
        "sigstop_to_replacement_s": round(median(stop), 2),
        "sigstop_bound_s": 2 + 0.5,  # next_pulse of a --pulse 1 worker is 2 s
    }
    print(
        f"failure detection: kill -9 of a busy worker -> SET_TASK elsewhere in {r['kill9_to_replacement_ms']} ms "
        f"(max {r['kill9_max_ms']} ms) [target < 50 ms]; SIGSTOP -> re-placed in {r['sigstop_to_replacement_s']} s "
        f"[target within next_pulse + 0.5 = {r['sigstop_bound_s']} s]"
    )
    return r


if __name__ == "__main__":
    main()

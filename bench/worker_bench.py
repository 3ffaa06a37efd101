"""The worker alone: tasks/s through one real worker process driven by a fake controller.

Printed beside a bare `subprocess.run(["true"])` loop measured in the same run, so the
`--exec true` figure shows what the worker adds on top of starting a process. Job output is
measured the same way: the same jobs with a controller that takes output and with one that
does not (an older one), and a job that writes a line to stderr beside one that writes nothing.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import median, socket_dir
from bench.floor import read_frame
from controller import wire
from gen import worker_protocol_pb2 as pb
from tests.helpers import worker_argv

# The target for `--exec true`: this share of a bare subprocess.run(["true"]) loop.
EXEC_TARGET = 0.8
# `--exec true` as a job user (root only) and under every limit: at most this much more a job.
JAILED_TARGET = 1.10
JAILED_FLAGS = [
    "--memory-max",
    "1G",
    "--tasks-max",
    "256",
    "--cpu-time",
    "60",
    "--file-size",
    "1G",
    "--open-files",
    "1024",
]
JOB_USER = "61001"  # a uid with no passwd entry runs with gid = uid


def jailed_args() -> list[str]:
    """--exec true as the jobs of a packaged slot run: a job user (when root) and limits."""
    user = ["--job-user", JOB_USER] if os.geteuid() == 0 else []
    return [*user, *JAILED_FLAGS, "--exec", "true"]


class MiniController:
    """The controller's side of the worker protocol, blocking, in this process: main.sock
    answered, SET_TASK and FETCH dialled. Plain sockets and no event loop, so that what is
    measured is the worker (the real controller's cost is in e2e_bench)."""

    def __init__(self, sockdir: Path, takes_output: bool = True) -> None:
        self.sockdir = sockdir
        self.takes_output = takes_output  # False: answer REGISTER as a controller before output
        self.output_pulses = 0
        self.listener = socket.socket(socket.AF_UNIX)
        self.listener.bind(str(sockdir / "main.sock"))
        self.listener.listen(64)
        self.listener.settimeout(10)

    def pulse(self) -> pb.WorkerPulse:
        """Answer one pulse on main.sock; the pulse."""
        conn, _ = self.listener.accept()
        with conn:
            pulse: pb.WorkerPulse = read_frame(conn, pb.WorkerPulse)
            resp = pb.PulseResponse(error=pb.CTRL_ERR_OK)
            if pulse.type == pb.PULSE_REGISTER:
                resp.worker_id = 1
                resp.takes_output = self.takes_output
            elif pulse.type == pb.PULSE_OUTPUT:
                self.output_pulses += 1
            conn.sendall(wire.encode_frame(resp))
            return pulse

    def wait_for(self, kind: int, task_id: int | None = None) -> None:
        """Answer pulses until one of `kind` (for `task_id`, if given) comes. A periodic OK
        may come in between, and so may a periodic FETCH_ME for the previous task, sent
        before its FETCH and read after it."""
        while True:
            pulse = self.pulse()
            if pulse.type == kind and (task_id is None or pulse.task_id == task_id):
                return

    def dial(self, msg: pb.ControlMsg) -> pb.WorkerResponse:
        with socket.socket(socket.AF_UNIX) as conn:
            conn.settimeout(10)
            conn.connect(str(self.sockdir / "1.sock"))
            conn.sendall(wire.encode_frame(msg))
            answer: pb.WorkerResponse = read_frame(conn, pb.WorkerResponse)
            return answer


def cpu_ns(pid: int) -> int:
    """Nanoseconds the process has run on a CPU (its threads included): less swayed by a busy
    machine than the wall clock."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            total += int((task / "schedstat").read_text().split()[0])
    return total


def drive(
    args: list[str],
    tasks: int,
    floor_worker: bool = False,
    takes_output: bool = True,
    cpu: list[float] | None = None,
) -> float:
    """Tasks/s through one worker given `args`: ours, or bench/floor.py's blocking worker;
    `takes_output`: the controller says in its REGISTER answer that it keeps job output;
    `cpu`: where to add the worker's CPU microseconds per task (its commands' not counted)."""
    with socket_dir() as sockdir:
        ctl = MiniController(sockdir, takes_output)
        if floor_worker:
            argv = [sys.executable, "-m", "bench.floor", "worker", str(sockdir), *args]
        else:
            argv = worker_argv(sockdir, *args)
        proc = subprocess.Popen(argv)
        try:
            ctl.wait_for(pb.PULSE_OK)
            fetch = pb.ControlMsg(type=pb.CTRL_FETCH)
            start = time.perf_counter()
            cpu_start = cpu_ns(proc.pid)
            for task_id in range(1, tasks + 1):
                ctl.dial(pb.ControlMsg(type=pb.CTRL_SET_TASK, task_id=task_id))
                ctl.wait_for(pb.PULSE_FETCH_ME, task_id)
                resp = ctl.dial(fetch)
                assert resp.error == pb.WORKER_ERR_OK, resp
            elapsed = time.perf_counter() - start
            if cpu is not None:
                cpu.append((cpu_ns(proc.pid) - cpu_start) / 1000 / tasks)
        finally:
            proc.terminate()
            proc.wait()
            ctl.listener.close()
    return tasks / elapsed


def bare_true(count: int) -> float:
    start = time.perf_counter()
    for _ in range(count):
        subprocess.run(["true"], check=True)
    return count / (time.perf_counter() - start)


def piped_true(count: int) -> float:
    """Bare spawns doing what `--exec` must per task: the payload on stdin, stdout
    and stderr read, TASK_ID in the environment."""
    env = {**os.environ, "TASK_ID": "1"}
    start = time.perf_counter()
    for _ in range(count):
        subprocess.run(["true"], input=b"", capture_output=True, env=env, check=True)
    return count / (time.perf_counter() - start)


def main(rounds: int = 4) -> dict[str, Any]:
    runs: dict[str, list[float]] = {
        "async_noop": [],
        "sync_noop": [],
        "exec_true": [],
        "bare_true": [],
        "piped_true": [],
        "floor_exec_true": [],
        "async_noop_old_controller": [],
        "async_stderr_line": [],
        "exec_true_old_controller": [],
        "exec_true_base": [],
        "exec_true_jailed": [],
    }
    anoop = ["--handler", "worker.runner:anoop"]
    line = ["--handler", "worker.runner:anoop_line"]
    cpu: dict[str, list[float]] = {
        name: []
        for name in ("takes", "old", "line", "exec", "exec_old", "exec_base", "exec_jailed")
    }
    exec_true = ["--exec", "true"]
    for round_ in range(rounds):
        # Each figure beside its baseline: measured one right after the other, first one then
        # the other first (on a busy machine the order alone moves a figure by ~5%).
        noop_pair = [
            ("async_noop", anoop, 3000, True, "takes"),
            ("async_noop_old_controller", anoop, 3000, False, "old"),
        ]
        exec_pair = [
            ("exec_true", exec_true, 300, True, "exec"),
            ("exec_true_old_controller", exec_true, 300, False, "exec_old"),
        ]
        jailed_pair = [
            ("exec_true_base", exec_true, 300, True, "exec_base"),
            ("exec_true_jailed", jailed_args(), 300, True, "exec_jailed"),
        ]
        pairs = [noop_pair, exec_pair, jailed_pair]
        for pair in pairs:
            for name, args, tasks, takes, where in pair if round_ % 2 == 0 else pair[::-1]:
                runs[name].append(drive(args, tasks, takes_output=takes, cpu=cpu[where]))
        runs["async_stderr_line"].append(drive(line, 3000, cpu=cpu["line"]))
        runs["sync_noop"].append(drive(["--handler", "worker.runner:noop"], 3000))
        runs["bare_true"].append(bare_true(300))
        runs["piped_true"].append(piped_true(300))
        runs["floor_exec_true"].append(drive(["true"], 300, floor_worker=True))
    r: dict[str, float] = {name: round(median(values)) for name, values in runs.items()}
    print(
        f"one worker, fake controller: async no-op handler {r['async_noop']:,} tasks/s "
        f"({1e6 / r['async_noop']:.0f} us/task), sync no-op handler (in a thread) {r['sync_noop']:,} tasks/s "
        f"({1e6 / r['sync_noop']:.0f} us/task)"
    )
    print(
        f"one worker, --exec true: {r['exec_true']:,} tasks/s ({1e6 / r['exec_true']:.0f} us/task) "
        f"beside bare subprocess.run(['true']): {r['bare_true']:,}/s ({1e6 / r['bare_true']:.0f} us); "
        f"the worker adds {1e6 / r['exec_true'] - 1e6 / r['bare_true']:.0f} us per task; "
        f"ratio {r['exec_true'] / r['bare_true']:.2f}x [target >= {EXEC_TARGET}x]"
    )
    bare_us, piped_us = 1e6 / r["bare_true"], 1e6 / r["piped_true"]
    print(
        f"  what --exec must do per task (payload on stdin, stdout and stderr read, TASK_ID set) "
        f"costs {piped_us:.0f} us in subprocess.run alone ({r['piped_true'] / r['bare_true']:.2f}x "
        f"of bare), leaving {bare_us / EXEC_TARGET - piped_us:.0f} us a task of the {EXEC_TARGET}x "
        f"target for the "
        f"protocol's three exchanges; bench/floor.py's blocking worker doing the same, no checks: "
        f"{r['floor_exec_true']:,} tasks/s ({1e6 / r['floor_exec_true']:.0f} us/task), ratio "
        f"{r['floor_exec_true'] / r['bare_true']:.2f}x"
    )
    us = {name: 1e6 / value for name, value in r.items()}
    c = {name: median(values) for name, values in cpu.items()}
    print(
        "job output, a job that writes nothing, the worker's CPU per task: async no-op handler "
        f"{c['takes']:.1f} us with a controller that takes output beside {c['old']:.1f} us with "
        f"one that does not ({c['takes'] - c['old']:+.1f} us); --exec true {c['exec']:.1f} us "
        f"beside {c['exec_old']:.1f} us ({c['exec'] - c['exec_old']:+.1f} us). Wall clock: "
        f"{us['async_noop']:.0f} / {us['async_noop_old_controller']:.0f} and "
        f"{us['exec_true']:.0f} / {us['exec_true_old_controller']:.0f} us a task"
    )
    print(
        "job output, a job that writes one line to stderr: async handler "
        f"{c['line']:.1f} us of the worker's CPU per task ({c['line'] - c['takes']:+.1f} us "
        f"beside one that writes nothing: the write, and one PULSE_OUTPUT exchange before its "
        f"FETCH_ME), {us['async_stderr_line'] - us['async_noop']:+.0f} us of wall clock"
    )
    base_us, jailed_us = us["exec_true_base"], us["exec_true_jailed"]
    who = f"as job user {JOB_USER} and " if os.geteuid() == 0 else "(not root: no job user) "
    print(
        f"--exec true {who}under every limit ({' '.join(JAILED_FLAGS)}): {jailed_us:.0f} us a "
        f"task beside {base_us:.0f} us without: {jailed_us / base_us:.2f}x "
        f"[target <= {JAILED_TARGET:.2f}x]; the worker's CPU per task {c['exec_jailed']:.1f} us "
        f"beside {c['exec_base']:.1f} us"
    )
    r.update({f"cpu_us_{name}": round(value, 1) for name, value in c.items()})
    return r


if __name__ == "__main__":
    main()

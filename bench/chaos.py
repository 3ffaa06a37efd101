"""`make chaos`: every fault at once while tasks stream in; a verdict at the end.

Seeded and bounded. While a client submits tasks through a lossy link (20%
of datagrams dropped, 5% duplicated, some reordered), this kills workers with
SIGKILL, SIGSTOPs others for a while, kills the controller with SIGKILL and
starts it again on its journal, and throws garbage datagrams at the front
door and garbage connections at main.sock. Workers are supervised the way
systemd's Restart=always would. At the end it waits for every acknowledged
task to finish and prints what happened. Exit status 1 when an acknowledged
task was lost.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import signal
import socket as stdsocket
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import trio

from controller.client import Outcome, UdpSession
from tests.helpers import (
    connect_unix,
    controller_argv,
    free_udp_port,
    lossy_router,
    recording_exec,
    worker_argv,
    write_config,
)

NOT_ACKED = "add_task was not acknowledged"


@dataclass
class Tally:
    kills: collections.Counter[str] = field(default_factory=collections.Counter)
    outcomes: dict[int, Outcome] = field(default_factory=dict)
    submitted: int = 0


async def run(seconds: float, seed: int, workers: int, workdir: Path) -> int:
    rng = random.Random(seed)
    port = free_udp_port()
    sockdir = workdir / "s"
    sockdir.mkdir(mode=0o750)
    execlog = workdir / "executions.log"
    execlog.touch()
    config = write_config(
        workdir,
        socket_dir=str(sockdir),
        client_address={"host": "127.0.0.1", "port": port},
        journal=str(workdir / "journal.sqlite3"),
        timeout_task_placement=120,
        max_retries=10,
        dial_timeout=1.0,
    )
    controller_cmd = controller_argv(config, log_level="WARNING")
    worker_cmd = worker_argv(sockdir, "--pulse", "0.3", *recording_exec(execlog))
    controller_log = (workdir / "controller.log").open("ab")
    tally = Tally()
    procs: dict[str, trio.Process] = {}
    deadline = trio.current_time() + seconds
    submit_until = deadline - min(20.0, seconds / 3)

    async def start_controller() -> None:
        procs["controller"] = await trio.lowlevel.open_process(
            controller_cmd, stderr=controller_log, stdout=subprocess.DEVNULL
        )

    async def supervised(slot: int) -> None:
        while True:
            proc = await trio.lowlevel.open_process(worker_cmd, stderr=subprocess.DEVNULL)
            procs[f"worker{slot}"] = proc
            await proc.wait()
            await trio.sleep(0.1)

    async def chaos() -> None:
        while trio.current_time() < submit_until:
            await trio.sleep(rng.uniform(0.3, 1.2))
            action = rng.choice(
                ["kill_worker", "stop_worker", "kill_controller", "garbage_udp", "garbage_unix"]
            )
            if action == "kill_worker":
                victim = procs.get(f"worker{rng.randrange(workers)}")
                if victim is not None and victim.returncode is None:
                    victim.send_signal(signal.SIGKILL)
                    tally.kills["worker SIGKILL"] += 1
            elif action == "stop_worker":
                victim = procs.get(f"worker{rng.randrange(workers)}")
                if victim is not None and victim.returncode is None:
                    victim.send_signal(signal.SIGSTOP)
                    tally.kills["worker SIGSTOP"] += 1
                    await trio.sleep(rng.uniform(1.0, 4.0))
                    if victim.returncode is None:
                        victim.send_signal(signal.SIGCONT)
            elif action == "kill_controller":
                controller = procs["controller"]
                controller.send_signal(signal.SIGKILL)
                await controller.wait()
                tally.kills["controller SIGKILL"] += 1
                await start_controller()
            elif action == "garbage_udp":
                with stdsocket.socket(stdsocket.AF_INET, stdsocket.SOCK_DGRAM) as s:
                    for _ in range(50):
                        s.sendto(os.urandom(rng.randrange(1, 2000)), ("127.0.0.1", port))
                tally.kills["garbage datagrams x50"] += 1
            else:
                for _ in range(5):
                    try:
                        conn = await connect_unix(sockdir / "main.sock", 1.0)
                    except OSError:
                        break
                    with conn:
                        conn.send(os.urandom(rng.randrange(1, 64)))
                tally.kills["garbage connections x5"] += 1

    sock = stdsocket.socket(stdsocket.AF_INET, stdsocket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    await start_controller()
    try:
        async with trio.open_nursery() as nursery:
            for slot in range(workers):
                nursery.start_soon(supervised, slot)
            router = await nursery.start(
                lambda task_status: lossy_router(
                    rng,
                    ("127.0.0.1", port),
                    drop=0.2,
                    dup=0.05,
                    reorder=0.1,
                    task_status=task_status,
                )
            )
            client = UdpSession(
                sock, router, timeout=max(60.0, deadline - trio.current_time() + 30)
            )
            nursery.start_soon(client.receive)
            nursery.start_soon(chaos)
            window = trio.Semaphore(16)

            async def one(task_id: int) -> None:
                tally.outcomes[task_id] = await client.run_task(task_id, {"payload": f"p{task_id}"})

            async with trio.open_nursery() as tasks:
                task_id = 0
                while trio.current_time() < submit_until:
                    await window.acquire()
                    task_id += 1
                    tally.submitted += 1

                    async def submit(tid: int = task_id) -> None:
                        try:
                            await one(tid)
                        finally:
                            window.release()

                    tasks.start_soon(submit)
                # Every submitted task must end within the time left.
                tasks.cancel_scope.deadline = deadline + 30
            nursery.cancel_scope.cancel()
    finally:
        for proc in procs.values():
            if proc.returncode is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                await proc.wait()
        controller_log.close()
        sock.close()
    return report(tally, execlog, client.duplicates, workdir)


def report(tally: Tally, execlog: Path, duplicates: int, workdir: Path) -> int:
    outcomes = tally.outcomes
    acked = {
        t: o for t, o in outcomes.items() if not (o.status == "timeout" and o.error == NOT_ACKED)
    }
    unfinished_in_time = tally.submitted - len(outcomes)
    lost = {t: o for t, o in acked.items() if o.status == "timeout"}
    by_status = collections.Counter(o.status for o in acked.values())
    causes = collections.Counter(
        o.error.split(";")[-1].strip()[:80]
        for o in acked.values()
        if o.status not in ("success", "timeout")
    )
    runs = collections.Counter(int(line) for line in execlog.read_text().split() if line.isdigit())
    extra_runs = sum(n - 1 for n in runs.values() if n > 1)
    longest = max((o.latency for o in acked.values() if o.status == "success"), default=0.0)
    print("chaos verdict")
    print(f"  faults injected: {dict(tally.kills)}")
    print(
        f"  tasks submitted: {tally.submitted}, acknowledged: {len(acked)}, "
        f"never acknowledged (client gave up): {len(outcomes) - len(acked)}, still open at the end: {unfinished_in_time}"
    )
    print(
        f"  succeeded: {by_status['success']}, failed: {by_status['error']}, failed_post: {by_status['failed_post']}"
    )
    for cause, n in causes.most_common():
        print(f"    failure cause x{n}: {cause}")
    print(f"  duplicate notifications suppressed at the client: {duplicates}")
    print(
        f"  executions beyond one per task: {extra_runs} (a worker killed or stopped while running a task, "
        f"or a result handed over just before a controller SIGKILL: at-least-once)"
    )
    print(f"  longest time a task waited for its outcome: {longest:.1f} s")
    print(f"  acknowledged tasks lost: {len(lost) + unfinished_in_time}")
    print(f"  logs and journal in {workdir}")
    verdict = not lost and unfinished_in_time == 0 and by_status["success"] > 0
    print(
        "PASS: nothing acknowledged was lost" if verdict else "FAIL: acknowledged tasks were lost"
    )
    return 0 if verdict else 1


def main() -> None:
    parser = argparse.ArgumentParser(prog="chaos", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--seconds", type=float, default=240, help="total run time, at most 300 (default 240)"
    )
    parser.add_argument("--seed", type=int, default=20261126)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument(
        "--workdir", metavar="DIR", help="where logs and the journal go (default: a new temp dir)"
    )
    args = parser.parse_args()
    seconds = min(args.seconds, 300.0)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(
        f"chaos: {seconds:g} s, seed {args.seed}, {args.workers} workers, in {workdir}", flush=True
    )
    sys.exit(trio.run(run, seconds, args.seed, args.workers, workdir))


if __name__ == "__main__":
    main()

"""Where a no-op job's cost goes, and what the controller costs when it does nothing.

- CPU per job of each process (controller, each worker, the client), from /proc,
  over 10,000 jobs through the UDP door in the default layout.
- The same controller with bench/floor.py's blocking workers instead of ours,
  alternating with ours: how much a leaner worker would give.
- System calls per job of the controller (`strace -c -f` over 3,000 jobs, when
  strace is installed), beside the protocol's minimum.
- The controller's CPU over 60 s idle with 2 workers pulsing.
- The controller's memory with 100,000 jobs queued (journal on, no workers).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import trio

from bench.common import children_of, cpu_while, median, percentile, process_cpu, rss_mb, socket_dir
from bench.e2e_bench import drive, start_controller
from controller import datagram as dg
from tests.helpers import free_udp_port, wait_for_condition

# The controller's system calls per job that the protocol itself asks for: add_task in and
# its ack out, notify_task out and its ack in (4); SET_TASK and FETCH dialled, each a
# socket, connect, send, receive and close (10); FETCH_ME accepted, received, answered and
# closed (4). The socket-owner check (a stat per dial) and the event waits come on top.
PROTOCOL_MINIMUM = 18
OWNER_CHECKS = 2


def cpu_per_job(tasks: int = 10_000) -> dict[str, Any]:
    """Microseconds of CPU per job of the controller, the workers together, and the client."""
    port = free_udp_port()
    with socket_dir() as sockdir:
        proc = start_controller(sockdir, port, 2, {})
        try:
            trio.run(drive, port, 200, 8, 10_000_000)  # warm up; waits for the workers
            pids = [proc.pid, *children_of(proc.pid)]
            (rate, _), cpu = cpu_while(pids, tasks, lambda: trio.run(drive, port, tasks, 64, 1))
        finally:
            proc.terminate()
            proc.wait()
    return {"tasks_per_s": round(rate), **{key: round(us) for key, us in cpu.items()}}


# Our local workers' CPU per job may be at most this multiple of bench/floor.py's.
WORKER_CPU_TARGET = 1.3


def _with_workers(kind: str, tasks: int) -> dict[str, float]:
    """One default-layout run with 2 workers of `kind` ("ours" or "floor", bench/floor.py's
    blocking workers, which the controller serves like any other): jobs/s, CPU per job of
    each process, and the one-at-a-time p50."""
    port = free_udp_port()
    with socket_dir() as sockdir:
        proc = start_controller(sockdir, port, 2 if kind == "ours" else 0, {})
        floor_workers: list[subprocess.Popen[bytes]] = []
        try:
            if kind == "floor":
                sockets = sockdir / "s"
                wait_for_condition(lambda: (sockets / "main.sock").exists(), 10)
                floor_workers = [
                    subprocess.Popen([sys.executable, "-m", "bench.floor", "worker", str(sockets)])
                    for _ in range(2)
                ]
            trio.run(drive, port, 200, 8, 10_000_000)  # warm up; waits for the workers
            workers = [w.pid for w in floor_workers] or children_of(proc.pid)
            pids = [proc.pid, *workers]
            (rate, _), cpu = cpu_while(pids, tasks, lambda: trio.run(drive, port, tasks, 64, 1))
            _, latencies = trio.run(drive, port, 1000, 1, 20_000_000)
        finally:
            for worker in floor_workers:
                worker.kill()
                worker.wait()
            proc.terminate()
            proc.wait()
    return {"tasks_per_s": rate, **cpu, "p50_ms": 1e3 * percentile(latencies, 0.5)}


def floor_workers(rounds: int = 3, tasks: int = 8000) -> dict[str, dict[str, float]]:
    """Our workers and bench/floor.py's under the same controller, alternating; the median
    of each figure. The floor's workers do the protocol's exchanges and nothing else (no
    trio, no checks, no pulses after the first), so the difference bounds what any leaner
    worker could give."""
    runs: dict[str, list[dict[str, float]]] = {"ours": [], "floor": []}
    for r in range(rounds):
        for kind in ("ours", "floor") if r % 2 == 0 else ("floor", "ours"):
            runs[kind].append(_with_workers(kind, tasks))
    return {
        kind: {key: round(median([run[key] for run in rows]), 3) for key in rows[0]}
        for kind, rows in runs.items()
    }


def _strace_calls(path: Path) -> int:
    """The total of calls in an `strace -c` summary."""
    for line in path.read_text().splitlines():
        fields = line.split()
        if fields and fields[-1] == "total":
            return int(fields[3])
    raise ValueError(f"no total in {path}")


def _traced(pid: int) -> bool:
    """Whether a tracer (strace) has attached to every thread of `pid`."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("TracerPid:") and line.split()[1] == "0":
                return False
    return True


def syscalls_per_job(tasks: int = 3000) -> dict[str, Any] | None:
    """The controller's system calls per job under `strace -c -f`; None without strace."""
    strace = shutil.which("strace")
    if strace is None:
        return None
    port = free_udp_port()
    with socket_dir() as sockdir:
        proc = start_controller(sockdir, port, 2, {})
        try:
            trio.run(drive, port, 200, 8, 10_000_000)
            out = sockdir / "strace.txt"
            tracer = subprocess.Popen(
                [strace, "-c", "-f", "-p", str(proc.pid), "-o", str(out)],
                stderr=subprocess.DEVNULL,
            )
            wait_for_condition(lambda: _traced(proc.pid), timeout=10)
            trio.run(drive, port, tasks, 64, 1)
            tracer.terminate()
            tracer.wait()
            calls = _strace_calls(out)
        except (OSError, ValueError):
            return None  # not allowed to trace here
        finally:
            proc.terminate()
            proc.wait()
    return {"per_job": round(calls / tasks, 1), "protocol_minimum": PROTOCOL_MINIMUM}


def idle_cpu(seconds: float = 60.0) -> dict[str, Any]:
    """The controller's share of a core over `seconds` with 2 idle workers, after some work."""
    port = free_udp_port()
    with socket_dir() as sockdir:
        proc = start_controller(sockdir, port, 2, {})
        try:
            trio.run(drive, port, 2000, 64, 1)  # jobs first: the poll window must close again
            before, start = process_cpu(proc.pid), time.perf_counter()
            time.sleep(seconds)
            share = (process_cpu(proc.pid) - before) / (time.perf_counter() - start)
        finally:
            proc.terminate()
            proc.wait()
    return {"seconds": seconds, "core_share": round(share, 4)}


def queued_memory(jobs: int = 100_000, window: int = 64) -> dict[str, Any]:
    """The controller's RSS with `jobs` queued through the UDP door (journal on, no worker)."""
    port = free_udp_port()
    with socket_dir() as sockdir, tempfile.TemporaryDirectory() as tmp:
        journal = str(Path(tmp) / "journal.sqlite3")
        proc = start_controller(sockdir, port, 0, {"journal": journal})
        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.bind(("127.0.0.1", 0))
            sock.settimeout(0.5)
            server = ("127.0.0.1", port)
            wait_for_condition(lambda: (sockdir / "s" / "main.sock").exists(), timeout=20)
            base = rss_mb(proc.pid)
            acked: set[int] = set()
            sent = 0
            while len(acked) < jobs:
                while sent < jobs and sent - len(acked) < window:
                    sent += 1
                    params = {"task_id": sent, "data": f"payload-{sent}"}
                    sock.sendto(dg.request("add_task", params, sent), server)
                try:
                    answer = dg.decode(sock.recv(65536))
                except TimeoutError:  # a datagram lost: send the unacknowledged again
                    for txid in range(1, sent + 1):
                        if txid not in acked:
                            params = {"task_id": txid, "data": f"payload-{txid}"}
                            sock.sendto(dg.request("add_task", params, txid), server)
                    continue
                if answer is not None and answer.get("packet_type") == dg.IS_ACK:
                    acked.add(int(answer["transmission_id"]))
            sock.close()
            rss = rss_mb(proc.pid)
        finally:
            proc.terminate()
            proc.wait()
    return {"jobs": jobs, "rss_mb": round(rss, 1), "base_rss_mb": round(base, 1)}


# Gaps between wake-ups for `wakeup_cost`, seconds.
WAKE_GAPS = (0.0005, 0.002, 0.01, 0.05)


def _some_work() -> None:
    """A piece of Python of the kind a controller runs per message: a JSON round trip and a
    few hundred dict stores."""
    message = {"method": "add_task", "params": {"task_id": 1, "data": "x" * 50}}
    json.loads(json.dumps(message))
    table: dict[str, int] = {}
    for n in range(200):
        table[str(n)] = n


def wakeup_cost(gaps: tuple[float, ...] = WAKE_GAPS, wakes: int = 200) -> dict[str, float]:
    """The CPU the same piece of Python takes right after a wake-up, by the gap between
    wake-ups (p50 microseconds): a process that sleeps longer wakes to colder caches, which
    is why a dispatcher costs more CPU per job when its jobs take milliseconds."""
    found: dict[str, float] = {}
    for gap in gaps:
        ours, theirs = socket.socketpair()
        with ours, theirs:

            def ping(peer: socket.socket = theirs, gap: float = gap) -> None:
                for _ in range(wakes):
                    time.sleep(gap)
                    peer.send(b"x")

            pinger = threading.Thread(target=ping)
            pinger.start()
            costs = []
            for _ in range(wakes):
                ours.recv(1)
                start = time.thread_time_ns()
                _some_work()
                costs.append((time.thread_time_ns() - start) / 1000)
            pinger.join()
        found[f"{gap * 1000:g} ms"] = round(percentile(costs, 0.5), 1)
    return found


def main() -> dict[str, Any]:
    results: dict[str, Any] = {}
    cpu = results["cpu"] = cpu_per_job()
    print(
        f"CPU per no-op job, default layout, 2 workers ({cpu['tasks_per_s']:,} jobs/s): "
        f"controller {cpu['controller_us']} us, workers {cpu['workers_us']} us, "
        f"client {cpu['client_us']} us",
        flush=True,
    )
    lean = results["floor_workers"] = floor_workers()
    ours, floor = lean["ours"], lean["floor"]
    print(
        f"the same controller with bench/floor.py's blocking workers (alternating with ours, "
        f"median of 3): {floor['tasks_per_s']:,.0f} jobs/s against {ours['tasks_per_s']:,.0f}; "
        f"CPU per job workers {floor['workers_us']:.0f} us against {ours['workers_us']:.0f}, "
        f"controller {floor['controller_us']:.0f} against {ours['controller_us']:.0f}; one at a "
        f"time p50 {floor['p50_ms']:.3f} ms against {ours['p50_ms']:.3f}; our workers' CPU per "
        f"job {ours['workers_us'] / floor['workers_us']:.2f}x the floor's "
        f"[target <= {WORKER_CPU_TARGET}x]",
        flush=True,
    )
    calls = results["syscalls"] = syscalls_per_job()
    if calls is None:
        print("system calls per job: strace not installed or not allowed here (skipped)")
    else:
        print(
            f"controller system calls per job (strace -c): {calls['per_job']} beside the "
            f"protocol's minimum of {PROTOCOL_MINIMUM} (+{OWNER_CHECKS} socket-owner checks, "
            "+ event waits)",
            flush=True,
        )
    idle = results["idle"] = idle_cpu()
    print(
        f"controller idle for {idle['seconds']:g} s with 2 workers: "
        f"{idle['core_share']:.2%} of a core [target: under 1%]",
        flush=True,
    )
    wake = results["wakeup_cost"] = wakeup_cost()
    print(
        "the same Python (a JSON round trip, 200 dict stores) right after a wake-up, CPU p50 "
        "by the gap between wake-ups: "
        + ", ".join(f"{us} us {gap} apart" for gap, us in wake.items()),
        flush=True,
    )
    memory = results["queued_memory"] = queued_memory()
    print(
        f"controller with {memory['jobs']:,} jobs queued (UDP door, journal on): "
        f"{memory['rss_mb']} MB RSS ({memory['base_rss_mb']} MB before) [target: under 100 MB]",
        flush=True,
    )
    return results


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()

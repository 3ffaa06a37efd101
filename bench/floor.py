"""The floor of the design in plain Python: the same hops per task and nothing else.

A stripped controller, workers and client that make exactly the product's
system calls per task (add_task and its ack, SET_TASK, FETCH_ME, FETCH,
notify_task and its ack: two datagram exchanges and three Unix connections)
with blocking sockets or one `selectors` loop, and no validation, no
timeouts, no retries, no journal, no trio. It is not a product: it is the
yardstick for how much of the end-to-end cost is the design (the hops) and
how much is the implementation. Printed by `make bench` beside the real thing.

Its blocking worker also stands in for ours elsewhere in `make bench`: under the
real controller (bench/speed_bench.py, what a leaner worker would give) and,
running `true` for each task, under the worker bench's fake controller
(bench/worker_bench.py, what `--exec` could reach with the protocol's hops).
"""

from __future__ import annotations

import collections
import json
import os
import selectors
import socket
import subprocess
import sys
import time
from typing import Any

from bench.common import cpu_while, percentile, socket_dir
from controller.wire import encode_frame, whole_frame
from gen import worker_protocol_pb2 as pb
from tests.helpers import free_udp_port


def read_frame(sock: socket.socket, msg_type: type[Any]) -> Any:
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            raise EOFError
        data += chunk
        frame = whole_frame(msg_type, data, 1 << 24)
        if frame is not None:
            return frame[0]


def pulse(sockdir: str, msg: pb.WorkerPulse) -> pb.PulseResponse:
    with socket.socket(socket.AF_UNIX) as conn:
        conn.connect(f"{sockdir}/main.sock")
        conn.sendall(encode_frame(msg))
        reply: pb.PulseResponse = read_frame(conn, pb.PulseResponse)
        return reply


def worker(sockdir: str, command: list[str] | None = None) -> None:
    """Register, say OK once, then: SET_TASK -> FETCH_ME -> FETCH, forever (blocking). With
    a `command`, each task runs it as `--exec` must (stdin, stdout and stderr piped, TASK_ID
    set; the benches' payloads are empty) and its stdout is the result."""
    wid = pulse(sockdir, pb.WorkerPulse(type=pb.PULSE_REGISTER, next_pulse=2)).worker_id
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(f"{sockdir}/{wid}.sock")
    listener.listen(64)
    pulse(sockdir, pb.WorkerPulse(type=pb.PULSE_OK, worker_id=wid, next_pulse=3600))
    task_id = 0
    result = b""
    while True:
        conn, _ = listener.accept()
        with conn:
            msg = read_frame(conn, pb.ControlMsg)
            if msg.type == pb.CTRL_SET_TASK:
                task_id = msg.task_id
                conn.sendall(encode_frame(pb.WorkerResponse(task_id=task_id)))
                conn.close()
                if command:
                    env = {**os.environ, "TASK_ID": str(task_id)}
                    result = subprocess.run(command, input=b"", capture_output=True, env=env).stdout
                fetch_me = pb.WorkerPulse(
                    type=pb.PULSE_FETCH_ME, worker_id=wid, task_id=task_id, next_pulse=3600
                )
                pulse(sockdir, fetch_me)
            else:
                conn.sendall(encode_frame(pb.WorkerResponse(task_id=task_id), result))


def controller(sockdir: str, port: int) -> None:
    """One selectors loop: datagrams in, dials out, pulses answered; no checks at all."""
    sel = selectors.DefaultSelector()
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", port))
    udp.setblocking(False)
    main = socket.socket(socket.AF_UNIX)
    main.bind(f"{sockdir}/main.sock")
    main.listen(1024)
    main.setblocking(False)
    sel.register(udp, selectors.EVENT_READ, ("udp", 0))
    sel.register(main, selectors.EVENT_READ, ("main", 0))
    idle: collections.deque[int] = collections.deque()
    queue: collections.deque[tuple[int, Any]] = collections.deque()
    running: dict[int, tuple[int, Any]] = {}
    ids = iter(range(1, 1 << 62))
    txids = iter(range(1, 1 << 62))

    def dial(wid: int, msg: pb.ControlMsg, kind: str) -> None:
        conn = socket.socket(socket.AF_UNIX)
        conn.connect(f"{sockdir}/{wid}.sock")
        conn.sendall(encode_frame(msg))
        conn.setblocking(False)
        sel.register(conn, selectors.EVENT_READ, (kind, wid))

    def place() -> None:
        while idle and queue:
            wid = idle.popleft()
            running[wid] = queue.popleft()
            dial(wid, pb.ControlMsg(type=pb.CTRL_SET_TASK, task_id=running[wid][0]), "set")

    while True:
        for key, _ in sel.select():
            kind, wid = key.data
            if kind == "udp":
                while True:
                    try:
                        data, addr = udp.recvfrom(65535)
                    except BlockingIOError:
                        break
                    packet = json.loads(data)
                    if packet["packet_type"] == 1:
                        ack = {"method": "ack", "packet_type": 2}
                        ack["transmission_id"] = packet["transmission_id"]
                        udp.sendto(json.dumps(ack).encode(), addr)
                        queue.append((packet["params"]["task_id"], addr))
                place()
                continue
            if kind == "main":
                accepted, _ = main.accept()
                accepted.setblocking(False)
                sel.register(accepted, selectors.EVENT_READ, ("pulse", 0))
                continue
            conn = key.fileobj
            assert isinstance(conn, socket.socket)
            data = conn.recv(65536)
            sel.unregister(conn)
            if kind == "pulse":
                msg = pb.WorkerPulse.FromString(data[1 : 1 + data[0]])
                reply = pb.PulseResponse()
                if msg.type == pb.PULSE_REGISTER:
                    reply.worker_id = next(ids)
                conn.sendall(encode_frame(reply))
                conn.close()
                if msg.type == pb.PULSE_FETCH_ME:
                    dial(msg.worker_id, pb.ControlMsg(type=pb.CTRL_FETCH), "fetch")
                elif msg.type == pb.PULSE_OK:
                    idle.append(msg.worker_id)
                    place()
            elif kind == "set":
                conn.close()
            else:
                conn.close()
                task_id, addr = running.pop(wid)
                note = {"method": "notify_task", "packet_type": 1, "transmission_id": next(txids)}
                note["params"] = {"task_id": task_id, "status": "success", "result": ""}
                udp.sendto(json.dumps(note).encode(), addr)
                idle.append(wid)
                place()


def client(port: int, first: int, count: int, window: int) -> tuple[float, list[float]]:
    """Keep `window` tasks in flight; tasks/s and each task's round trip."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    server = ("127.0.0.1", port)
    sent_at: dict[int, float] = {}
    latencies: list[float] = []
    next_id = first

    def submit() -> None:
        nonlocal next_id
        packet = {"method": "add_task", "packet_type": 1, "transmission_id": next_id}
        packet["params"] = {"task_id": next_id}
        sent_at[next_id] = time.perf_counter()
        sock.sendto(json.dumps(packet).encode(), server)
        next_id += 1

    start = time.perf_counter()
    for _ in range(min(window, count)):
        submit()
    while len(latencies) < count:
        packet = json.loads(sock.recv(65535))
        if packet.get("method") != "notify_task":
            continue
        ack = {"method": "ack", "packet_type": 2, "transmission_id": packet["transmission_id"]}
        sock.sendto(json.dumps(ack).encode(), server)
        latencies.append(time.perf_counter() - sent_at.pop(packet["params"]["task_id"]))
        if next_id < first + count:
            submit()
    elapsed = time.perf_counter() - start
    sock.close()
    return count / elapsed, latencies


def measure(workers: int = 2, tasks: int = 10_000) -> dict[str, Any]:
    port = free_udp_port()
    with socket_dir() as sockdir:
        here = [sys.executable, "-m", "bench.floor"]
        procs = [subprocess.Popen([*here, "controller", str(sockdir), str(port)])]
        try:
            while not (sockdir / "main.sock").exists():
                time.sleep(0.01)
            procs += [subprocess.Popen([*here, "worker", str(sockdir)]) for _ in range(workers)]
            client(port, 1, 500, 8)  # warm up; waits for the workers to say OK
            pids = [proc.pid for proc in procs]
            (rate, _), cpu = cpu_while(pids, tasks, lambda: client(port, 1_000, tasks, 64))
            _, latencies = client(port, 1_000_000, 2_000, 1)
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
    return {
        "workers": workers,
        "tasks_per_s": round(rate),
        "p50_ms": round(percentile(latencies, 0.5) * 1000, 3),
        **{key: round(us) for key, us in cpu.items()},
    }


def main() -> dict[str, Any]:
    r = measure()
    print(
        f"the design's floor (bench/floor.py: the same hops in plain Python, no checks): "
        f"{r['tasks_per_s']:,} tasks/s with {r['workers']} workers (CPU per job: controller "
        f"{r['controller_us']}, workers {r['workers_us']}, client {r['client_us']} us), one at "
        f"a time p50 {r['p50_ms']} ms",
        flush=True,
    )
    return r


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker(sys.argv[2], sys.argv[3:])
    elif len(sys.argv) > 1 and sys.argv[1] == "controller":
        controller(sys.argv[2], int(sys.argv[3]))
    else:
        main()

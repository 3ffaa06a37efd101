"""`make chaos`: every fault at once while jobs stream in through every door; a verdict at the end.

Seeded and bounded. Jobs come in through all three doors of controller A: UDP
(through a lossy link: 20% of datagrams dropped, 5% duplicated, some
reordered), HTTP (`AsyncClient("http://...")`) and a Redis stream
(`AsyncClient("redis://...")`) that controller B consumes too. They run on
every kind of worker: local ones (A's and B's), a calculator and a poller, in three
queues, some needing a label only some workers have, with priorities and four owners; both
controllers keep a periodic job every 2 s, and no due time may be made twice.
Meanwhile this kills workers, calculators and pollers with SIGKILL, SIGSTOPs
local workers for a while, kills either controller with SIGKILL and starts it
again on its journal, restarts redis-server, holds slow and silent HTTP
connections open, floods the HTTP door from one address with connections that
trickle header bytes, opens one-request connections in a row, sends large payloads
to a queue nobody serves, makes a served queue's Redis stream key a string for a
while, throws garbage datagrams at the UDP door and garbage
connections at main.sock, and hostile values at every door (task_ids over 63
bits, nested objects where numbers or text belong, lone surrogates in text,
times too far ahead, ids of another door's jobs: see `hostile_datagrams`,
`HOSTILE_BODIES` and `hostile_entries`). Every process is supervised the way systemd's
Restart=always would. Through HTTP it also submits batches (three jobs and a `then` job)
and jobs that wait for another (`after`, `after_any`). At the end it waits for every
acknowledged job to end and checks that each has exactly one final outcome at its door, and
that no `then` or waiting job was lost or started before a job it waits for. Exit status 1
when an acknowledged job was lost.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import random
import shutil
import signal
import socket as stdsocket
import sqlite3
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import trio

from controller.client import AsyncClient, ControllerError, JobFailed, Outcome, UdpSession
from controller.config import JOURNAL_SYNC_MODES
from tests.helpers import (
    REDIS_SERVER,
    RedisServer,
    connect_unix,
    controller_argv,
    free_tcp_port,
    free_udp_port,
    lossy_router,
    worker_argv,
    write_config,
)

NOT_ACKED = "add_task was not acknowledged"
# What each kind of worker serves: jobs come in three queues, some needing the label `gpu`,
# with priorities and several owners, and every job has some worker that may take it.
WORKER_SERVES = (
    ("--queues", "default,bulk", "--labels", "gpu"),
    ("--queues", "default,spare"),
    ("--queues", "default,urgent"),
)
CALCULATOR_SERVES = ("--queues", "bulk,urgent")
POLLER_SERVES = ("--queues", "default,bulk", "--labels", "gpu")
QUEUES = ("default", "bulk", "urgent")
# Served by a worker but given no jobs: its Redis stream key is made a string for a while,
# which must stop that queue's stream alone.
SPARE_QUEUE = "spare"
# A periodic job every 2 s in both controllers: with Redis, each due time is made once in all.
SCHEDULE = {"name": "tick", "every": 2, "payload": "tick", "queue": "bulk"}


def job_options(rng: random.Random) -> dict[str, Any]:
    """Random options for one job: a queue, a priority, an owner, sometimes a label."""
    options: dict[str, Any] = {
        "queue": rng.choice(QUEUES),
        "priority": rng.randint(-5, 5),
        "owner": f"owner{rng.randrange(4)}",
    }
    if options["queue"] != "urgent" and rng.random() < 0.2:
        options["requires"] = ["gpu"]
    return options


# Past year 9999 once in UTC: must be refused as too far ahead, never break an answer later.
EXTREME_RUN_AT = "9999-12-31T23:59:59-23:59"
# A queue no worker serves: large payloads sent there fill max_pending_bytes, not memory.
NOBODYS_QUEUE = "chaos-nobody"
# Seconds a hostile HTTP request may take (the door may be down: a SIGKILL, a restart).
HOSTILE_HTTP_TIMEOUT = 5.0


def hostile_datagrams(n: int) -> list[bytes]:
    """Datagrams of the right shape with values the UDP door must refuse (none makes a job)."""
    big = 2**63 + n
    packets: list[dict[str, Any]] = [
        {"method": "add_task", "packet_type": 1, "transmission_id": n, "params": {"task_id": big}},
        {
            "method": "add_task",
            "packet_type": 1,
            "transmission_id": n,
            "params": {"task_id": 2**90},
        },
        {"method": "add_task", "packet_type": 1, "transmission_id": 2**100, "params": {}},
        {"method": "add_task", "packet_type": 1, "transmission_id": n, "params": {"task_id": -n}},
        {"method": "add_task", "packet_type": 1, "transmission_id": n, "params": {"task_id": 1.5}},
        {"method": "add_task", "packet_type": 1, "transmission_id": n, "params": {"task_id": [1]}},
        {"method": "add_task", "packet_type": 1, "transmission_id": n, "params": [{"a": 1}]},
        {"method": {"add_task": 1}, "packet_type": 1, "transmission_id": n, "params": {}},
        {"method": ["get_task"], "packet_type": {"x": 1}, "transmission_id": n},
        {"method": "get_task", "packet_type": 1, "transmission_id": n, "params": {"task_id": big}},
        {
            "method": "get_result",
            "packet_type": 1,
            "transmission_id": n,
            "params": {"task_id": 1, "offset": 2**80, "length": -1},
        },
        {"method": "heartbeat", "packet_type": 0, "params": {"status": {"\ud800": [1e308]}}},
        {
            "method": "completed_task",
            "packet_type": 1,
            "transmission_id": n,
            "params": {"task_id": 2**64, "status": "error", "error": "\ud800"},
        },
        {
            "method": "completed_task",
            "packet_type": 1,
            "transmission_id": n,
            "params": {"task_id": 1, "status": "success", "result_b64": {"x": "\udfff"}},
        },
        # Times too far ahead (more than 3,650 days, or past year 9999 once in UTC).
        {
            "method": "add_task",
            "packet_type": 1,
            "transmission_id": n,
            "params": {"task_id": big, "run_at": EXTREME_RUN_AT},
        },
        {
            "method": "add_task",
            "packet_type": 1,
            "transmission_id": n,
            "params": {"task_id": 1, "delay": 1e308},
        },
    ]
    return [json.dumps(packet).encode() for packet in packets]


# (method, path, body) of hostile HTTP requests; {n} is the round, {job} a job of this round.
HOSTILE_BODIES: list[tuple[str, str, str]] = [
    ("POST", "/job/", '{"id": "udp-127.0.0.1-1-{n}"}'),
    ("POST", "/job/", '{"name": 92233720368547758070}'),
    ("POST", "/job/", '{"payload": {"a": [1, 2.5e308]}}'),
    (
        "POST",
        "/job/",
        '{"name": "\\ud800", "id": "{job}", "payload": "{job}", '
        '"info_url": "\\udfff", "download_url": "x\\udc00"}',
    ),
    ("PUT", "/job/{job}/", '{"state": {"x": 1}}'),
    ("PUT", "/job/{job}/", '{"log": "\\ud800"}'),
    ("PUT", "/job/{job}/", '{"state": "failed", "worker": "\\ud800", "error": "\\udfff"}'),
    ("POST", "/job/", "\xff\xfe not JSON"),
    ("POST", "/job/", '{"id": "{job}-far", "run_at": "' + EXTREME_RUN_AT + '"}'),
    ("POST", "/job/", '{"delay": "NaN"}'),
    ("POST", "/job/", '{"delay": 1e308, "queue": "chaos-never"}'),
    # No value accepted before may break a listing or a page afterwards (500 counts).
    ("GET", "/job/?limit=1000", ""),
    ("GET", "/job/?state=scheduled", ""),
    ("GET", "/ui/jobs", ""),
]


def hostile_entries(n: int) -> list[dict[str, bytes]]:
    """Redis entries each controller must refuse alone (a `failed` outcome) or keep as given."""
    return [
        {"id": f"udp-127.0.0.1-1-{n}".encode(), "payload": b"udp id"},
        {"id": f"hostile-{n}".encode(), "payload": f"hostile-redis-twin-{n}".encode()},
        {"id": b"x" * 300, "payload": b"too long an id"},
        {"name": b"\xff\xfe\xed\xa0\x80", "payload": f"hostile-redis-{n}".encode()},
        {"run_at": EXTREME_RUN_AT.encode(), "payload": b"too far ahead"},
        {"delay": b"inf", "payload": b"never"},
    ]


DOORS = ("udp", "http", "redis")


@dataclass
class Tally:
    kills: collections.Counter[str] = field(default_factory=collections.Counter)
    outcomes: dict[int, Outcome] = field(default_factory=dict)  # UDP, by task_id
    submitted: int = 0
    # HTTP and Redis jobs by id: submitted, acknowledged, and the final state seen.
    others_submitted: collections.Counter[str] = field(default_factory=collections.Counter)
    acked: dict[str, set[str]] = field(default_factory=lambda: {"http": set(), "redis": set()})
    final: dict[str, str] = field(default_factory=dict)
    # Batches and dependent jobs (HTTP): each `then` or dependent job acknowledged, by id, and
    # the ids of the jobs it waits for.
    flows: dict[str, list[str]] = field(default_factory=dict)
    # Hostile inputs sent, and those answered with an internal error (a contained bug).
    hostile: int = 0
    hostile_internal: int = 0


def recording_job(execlog: Path) -> list[str]:
    """`--exec` for a job that logs its payload (unique per job, to count executions) and
    echoes it: task_ids are not unique across two controllers."""
    return ["--exec", "sh", "-c", f'input=$(cat); echo "$input" >> {execlog}; printf %s "$input"']


# Numeric uids for the local workers' job users (`--job-user`, one per slot; no passwd entry
# needed): controller A's slots from the base, controller B's worker at the base less one.
JOB_UID_BASE = 64100


def shared_execlog() -> Path:
    """A log every job user can append to: a directory of its own that others may enter but
    not list, the file writable by all (the run's workdir may sit below directories job
    users cannot enter)."""
    directory = Path(tempfile.mkdtemp(prefix="chaos-exec-"))
    directory.chmod(0o711)
    execlog = directory / "executions.log"
    execlog.touch()
    execlog.chmod(0o666)
    return execlog


async def run(
    seconds: float,
    seed: int,
    workers: int,
    workdir: Path,
    doors: set[str],
    journal_sync: str,
    job_users: bool = False,
) -> int:
    rng = random.Random(seed)
    port = free_udp_port()
    http_port = free_tcp_port()
    sockdir = workdir / "s"
    sockdir.mkdir(mode=0o750)
    execlog = shared_execlog() if job_users else workdir / "executions.log"
    execlog.touch()
    job = recording_job(execlog)
    server: RedisServer | None = None
    if "redis" in doors:
        server = RedisServer(workdir / "redis")
        server.start()
    stream = {"url": server.url, "claim_after": 3} if server is not None else None
    config = write_config(
        workdir,
        socket_dir=str(sockdir),
        client_address={"host": "127.0.0.1", "port": port},
        http_address={"host": "127.0.0.1", "port": http_port} if "http" in doors else None,
        journal=str(workdir / "journal.sqlite3"),
        journal_sync=journal_sync,
        timeout_task_placement=120,
        max_retries=10,
        dial_timeout=1.0,
        calculator_timeout=2.0,
        claim_timeout=3.0,
        lease_timeout=3.0,
        redis=stream,
        schedules=[SCHEDULE],
    )
    commands = {"controller": controller_argv(config, log_level="WARNING")}
    for slot in range(workers):
        serves = WORKER_SERVES[slot % len(WORKER_SERVES)]
        user = ("--job-user", str(JOB_UID_BASE + slot)) if job_users else ()
        # The last slot speaks the seed's exchange, the others their channels (section 16).
        protocol = ("--seed-protocol",) if slot == workers - 1 and workers > 1 else ()
        commands[f"worker{slot}"] = worker_argv(
            sockdir, "--pulse", "0.3", *protocol, *serves, *user, *job
        )
    calc = [sys.executable, "-m", "worker", "--log-level", "ERROR", "--pulse", "0.3"]
    commands["calculator"] = [*calc, "--udp", f"127.0.0.1:{port}", *CALCULATOR_SERVES, *job]
    if "http" in doors:
        hub = f"http://127.0.0.1:{http_port}"
        commands["poller"] = [
            *calc, "--hub", hub, "--name", "chaos-poller", *POLLER_SERVES, *job
        ]  # fmt: skip
    if server is not None:  # controller B: the same stream, one local worker
        b_dir = workdir / "b"
        b_sockets = b_dir / "s"
        b_sockets.mkdir(parents=True, mode=0o750)
        b_config = write_config(
            b_dir,
            socket_dir=str(b_sockets),
            client_address={"host": "127.0.0.1", "port": free_udp_port()},
            journal=str(b_dir / "journal.sqlite3"),
            journal_sync=journal_sync,
            max_retries=10,
            dial_timeout=1.0,
            redis=stream,
            schedules=[SCHEDULE],
        )
        commands["controller_b"] = controller_argv(b_config, log_level="WARNING")
        user = ("--job-user", str(JOB_UID_BASE - 1)) if job_users else ()
        commands["worker_b"] = worker_argv(b_sockets, "--pulse", "0.3", *user, *job)
    controller_log = (workdir / "controller.log").open("ab")
    b_log = (workdir / "controller_b.log").open("ab")
    tally = Tally()
    procs: dict[str, trio.Process] = {}
    deadline = trio.current_time() + seconds
    submit_until = deadline - min(20.0, seconds / 3)

    async def start(name: str) -> None:
        log = controller_log if name == "controller" else b_log
        procs[name] = await trio.lowlevel.open_process(
            commands[name],
            stderr=log if name.startswith("controller") else subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )

    async def supervised(name: str) -> None:
        """Restart=always for a worker, calculator or poller."""
        while True:
            await start(name)
            await procs[name].wait()
            await trio.sleep(0.1)

    async def kill_and_restart(name: str) -> None:
        proc = procs[name]
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
        tally.kills[f"{name.replace('_', ' ')} SIGKILL"] += 1
        await start(name)

    async def slow_http(silent: bool) -> None:
        """A client that sends half a request (or nothing) and holds the connection."""
        try:
            conn = await trio.open_tcp_stream("127.0.0.1", http_port)
        except OSError:
            return
        async with conn:
            if not silent:
                head = b"POST /job/ HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"
                with trio.move_on_after(0.5):
                    await conn.send_all(head)
            await trio.sleep(rng.uniform(1.0, 6.0))

    async def slow_header_flood() -> None:
        """Connections from one address, each sending a header byte now and then: they may
        hold that address's places (max_connections_per_client), never everyone's."""

        async def trickle() -> None:
            try:
                conn = await trio.open_tcp_stream("127.0.0.1", http_port)
            except OSError:
                return
            async with conn:
                with contextlib.suppress(OSError, trio.BrokenResourceError):
                    for byte in b"GET /health/ HTTP/1.1\r\nHost: x\r\n":
                        await conn.send_all(bytes([byte]))
                        await trio.sleep(rng.uniform(0.5, 2.0))

        with trio.move_on_after(8):
            async with trio.open_nursery() as flood:
                for _ in range(100):
                    flood.start_soon(trickle)

    async def one_request_connections() -> None:
        """Many connections in a row, each one request with `Connection: close`."""
        for _ in range(60):
            tally.hostile += 1
            if await raw_http("GET", "/health/", b"") == 500:
                tally.hostile_internal += 1

    async def oversized_queue(n: int) -> None:
        """Large payloads to a queue nobody serves, deleted again a moment later."""
        body = json.dumps({"queue": NOBODYS_QUEUE, "payload": "x" * (2 << 20)}).encode()
        ids = []
        for i in range(8):
            tally.hostile += 1
            job_id = f"oversized-{n}-{i}"
            status = await raw_http(
                "POST", "/job/", body.replace(b"{", b'{"id": "%s", ' % job_id.encode(), 1)
            )
            if status == 500:
                tally.hostile_internal += 1
            ids.append(job_id)
        await trio.sleep(2)
        for job_id in ids:
            await raw_http("DELETE", f"/job/{job_id}/", b"")

    async def wrong_typed_stream() -> None:
        """The spare queue's stream key holds a string for a few seconds."""
        assert server is not None

        def set_key(present: bool) -> None:
            r = redis.Redis.from_url(server.url, socket_timeout=HOSTILE_HTTP_TIMEOUT)
            try:
                key = f"jobs.{SPARE_QUEUE}"
                if present:
                    r.delete(key)
                    r.set(key, "notastream")
                else:
                    r.delete(key)
            except redis.RedisError:
                pass  # restarting
            finally:
                r.close()

        await trio.to_thread.run_sync(set_key, True)
        await trio.sleep(rng.uniform(2.0, 5.0))
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(set_key, False)

    async def raw_http(method: str, path: str, body: bytes) -> int:
        """One request on a connection of its own: the answer's status (0: no answer)."""
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: chaos\r\nConnection: close\r\n"
            f"Authorization: Bearer \u00e9\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        answer = b""
        with trio.move_on_after(HOSTILE_HTTP_TIMEOUT):
            try:
                conn = await trio.open_tcp_stream("127.0.0.1", http_port)
                async with conn:
                    await conn.send_all(head.encode("latin-1") + body)
                    while len(answer) < 12 and (chunk := await conn.receive_some(4096)):
                        answer += chunk
            except (OSError, trio.BrokenResourceError):  # refused, or reset before the answer
                return 0
        parts = answer.split(b" ", 2)
        return int(parts[1]) if len(parts) > 2 and parts[1].isdigit() else 0

    def add_entries(entries: list[dict[str, bytes]]) -> None:
        assert server is not None
        r = redis.Redis.from_url(server.url, socket_timeout=HOSTILE_HTTP_TIMEOUT)
        try:
            for entry in entries:
                r.xadd("jobs", entry)  # type: ignore[arg-type]
        except redis.RedisError:
            pass  # restarting: these are lost, as any producer's would be
        finally:
            r.close()

    async def hostile(n: int) -> None:
        """One round of hostile values at every door: refused or kept, never fatal."""
        with stdsocket.socket(stdsocket.AF_INET, stdsocket.SOCK_DGRAM) as s:
            s.bind(("127.0.0.1", 0))
            s.setblocking(False)
            for packet in hostile_datagrams(n):
                s.sendto(packet, ("127.0.0.1", port))
                tally.hostile += 1
            with trio.move_on_after(1.0):
                while True:
                    await trio.lowlevel.wait_readable(s)
                    with contextlib.suppress(OSError, ValueError):
                        if b'"internal"' in s.recv(65536):
                            tally.hostile_internal += 1
        if "http" in doors:
            for method, path, text in HOSTILE_BODIES:
                fill = {"{n}": str(n), "{job}": f"hostile-{n}"}
                for mark, value in fill.items():
                    path, text = path.replace(mark, value), text.replace(mark, value)
                tally.hostile += 1
                if await raw_http(method, path, text.encode("latin-1")) == 500:
                    tally.hostile_internal += 1
        if server is not None:
            entries = hostile_entries(n)
            tally.hostile += len(entries)
            await trio.to_thread.run_sync(add_entries, entries)

    async def chaos(nursery: trio.Nursery) -> None:
        actions = ["kill_worker", "stop_worker", "kill_controller", "garbage_udp", "garbage_unix"]
        actions.append("hostile_input")
        rounds = 0
        actions.append("kill_calculator")
        if "http" in doors:
            actions += ["kill_poller", "slow_http", "slow_header_flood"]
            actions += ["one_request_connections", "oversized_queue"]
        if server is not None:
            actions += ["restart_redis", "kill_controller_b", "wrong_typed_stream"]
        while trio.current_time() < submit_until:
            await trio.sleep(rng.uniform(0.3, 1.2))
            action = rng.choice(actions)
            if action in ("kill_worker", "kill_calculator", "kill_poller"):
                name = {"kill_calculator": "calculator", "kill_poller": "poller"}.get(
                    action, f"worker{rng.randrange(workers)}"
                )
                victim = procs.get(name)
                if victim is not None and victim.returncode is None:
                    victim.send_signal(signal.SIGKILL)
                    kind = name.rstrip("0123456789")
                    tally.kills[f"{kind} SIGKILL"] += 1
            elif action == "stop_worker":
                victim = procs.get(f"worker{rng.randrange(workers)}")
                if victim is not None and victim.returncode is None:
                    victim.send_signal(signal.SIGSTOP)
                    tally.kills["worker SIGSTOP"] += 1
                    await trio.sleep(rng.uniform(1.0, 4.0))
                    if victim.returncode is None:
                        victim.send_signal(signal.SIGCONT)
            elif action == "kill_controller":
                await kill_and_restart("controller")
            elif action == "hostile_input":
                rounds += 1
                nursery.start_soon(hostile, rounds)
                tally.kills["hostile input rounds"] += 1
            elif action == "kill_controller_b":
                await kill_and_restart("controller_b")
            elif action == "restart_redis":
                assert server is not None
                with trio.CancelScope(shield=True):  # the end of the run never finds it down
                    await trio.to_thread.run_sync(server.stop)
                    await trio.sleep(rng.uniform(0.2, 2.0))
                    await trio.to_thread.run_sync(server.start)
                tally.kills["redis-server restart"] += 1
            elif action == "slow_header_flood":
                nursery.start_soon(slow_header_flood)
                tally.kills["slow-header floods x100 from one address"] += 1
            elif action == "one_request_connections":
                nursery.start_soon(one_request_connections)
                tally.kills["one-request connections x60 in a row"] += 1
            elif action == "oversized_queue":
                rounds += 1
                nursery.start_soon(oversized_queue, rounds)
                tally.kills["2 MiB payloads x8 to a queue nobody serves"] += 1
            elif action == "wrong_typed_stream":
                nursery.start_soon(wrong_typed_stream)
                tally.kills["a queue's stream key made a string"] += 1
            elif action == "slow_http":
                for _ in range(3):
                    nursery.start_soon(slow_http, rng.random() < 0.5)
                tally.kills["slow or silent HTTP connections x3"] += 1
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

    async def door_jobs(door: str, url: str, window: int) -> None:
        """Jobs with ids of our own through the HTTP or Redis door: each submitted until
        acknowledged (the same id again is the same job), then waited for until it ends."""
        limit = trio.Semaphore(window)

        async def one(job_id: str) -> None:
            # A Redis job of queue q goes to the stream jobs.q, which only a controller whose
            # workers serve q reads: B's worker serves only `default`.
            options = job_options(rng)
            try:
                async with AsyncClient(url, timeout=5) as client:
                    while trio.current_time() < deadline + 30:
                        try:
                            await client.submit(job_id, id=job_id, **options)
                            break
                        except Exception:  # the door is down (SIGKILL, restart): again
                            await trio.sleep(0.2)
                    else:
                        return
                    tally.acked[door].add(job_id)
                    while trio.current_time() < deadline + 30:
                        try:
                            found = await client.get(job_id)
                            await found.result(timeout=5)
                            tally.final[job_id] = "finished"
                            return
                        except JobFailed as exc:
                            tally.final[job_id] = exc.state
                            return
                        except Exception:  # down, or not ended within 5 s: ask again
                            await trio.sleep(0.2)
            finally:
                limit.release()

        async with trio.open_nursery() as jobs:
            n = 0
            while trio.current_time() < submit_until:
                await limit.acquire()
                n += 1
                tally.others_submitted[door] += 1
                jobs.start_soon(one, f"{door[0]}{n}")

    async def flow_jobs(url: str, window: int) -> None:
        """Batches of three jobs with a `then` job, and a job that waits for another (after,
        after_any), through the HTTP door; each submitted until acknowledged (a batch whose
        then job's id exists was made by an earlier try), then waited for until it ends."""
        limit = trio.Semaphore(window)

        async def ended(client: AsyncClient, job_id: str) -> None:
            while trio.current_time() < deadline + 30:
                try:
                    await (await client.get(job_id)).result(timeout=5)
                    tally.final[job_id] = "finished"
                    return
                except JobFailed as exc:
                    tally.final[job_id] = exc.state
                    return
                except Exception:  # down, or not ended within 5 s: ask again
                    await trio.sleep(0.2)

        async def one(n: int) -> None:
            members = [f"b{n}-{k}" for k in range(3)]
            then, waiter = f"t{n}", f"w{n}"
            jobs = [{"payload": m, "id": m} for m in members]
            try:
                async with AsyncClient(url, timeout=5) as client:
                    while trio.current_time() < deadline + 30:
                        try:
                            await client.submit_batch(jobs, then={"payload": then, "id": then})
                            break
                        except ControllerError as exc:
                            if exc.status == 409:  # an earlier try made it
                                break
                            await trio.sleep(0.2)
                        except Exception:  # the door is down (SIGKILL, restart): again
                            await trio.sleep(0.2)
                    else:
                        return
                    tally.flows[then] = members
                    while trio.current_time() < deadline + 30:
                        try:
                            await client.submit(
                                waiter, id=waiter, after=[members[0]], after_any=True
                            )
                            tally.flows[waiter] = [members[0]]
                            break
                        except Exception:
                            await trio.sleep(0.2)
                    for job_id in [then, waiter] if waiter in tally.flows else [then]:
                        await ended(client, job_id)
            finally:
                limit.release()

        async with trio.open_nursery() as jobs:
            n = 0
            while trio.current_time() < submit_until:
                await limit.acquire()
                n += 1
                jobs.start_soon(one, n)

    sock = stdsocket.socket(stdsocket.AF_INET, stdsocket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    await start("controller")
    if "controller_b" in commands:
        await start("controller_b")
    client: UdpSession | None = None
    try:
        async with trio.open_nursery() as nursery:
            for name in commands:
                if not name.startswith("controller"):
                    nursery.start_soon(supervised, name)
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
            nursery.start_soon(chaos, nursery)
            async with trio.open_nursery() as clients:
                if "http" in doors:
                    clients.start_soon(door_jobs, "http", f"http://127.0.0.1:{http_port}", 4)
                    clients.start_soon(flow_jobs, f"http://127.0.0.1:{http_port}", 2)
                if server is not None:
                    clients.start_soon(door_jobs, "redis", server.url, 4)
                window = trio.Semaphore(16)

                async def one(task_id: int) -> None:
                    assert client is not None
                    params = {"payload": f"p{task_id}", **job_options(rng)}
                    outcome = await client.run_task(task_id, params)
                    tally.outcomes[task_id] = outcome

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

                    clients.start_soon(submit)
                # Every submitted job must end within the time left.
                clients.cancel_scope.deadline = deadline + 30
            nursery.cancel_scope.cancel()
        redis_check = check_redis(server, tally) if server is not None else None
    finally:
        for proc in procs.values():
            if proc.returncode is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                await proc.wait()
        if server is not None:
            server.stop()
        controller_log.close()
        b_log.close()
        sock.close()
    duplicates = client.duplicates if client is not None else 0
    try:
        return report(tally, execlog, duplicates, workdir, redis_check)
    finally:
        if job_users:  # keep the log with the run's other files
            shutil.copy(execlog, workdir / "executions.log")
            shutil.rmtree(execlog.parent, ignore_errors=True)


def check_redis(server: RedisServer, tally: Tally) -> dict[str, int]:
    """Each acknowledged Redis job: its hash final, exactly one entry on the results stream."""
    r = redis.Redis.from_url(server.url)
    try:
        entries: Any = r.xrange("jobs:results")
        written = collections.Counter(fields[b"id"].decode() for _, fields in entries)
        states = {}
        for job_id in tally.acked["redis"]:
            state = r.hget(f"job:{job_id}", "state")
            states[job_id] = state.decode() if isinstance(state, bytes) else ""
    finally:
        r.close()
    acked = tally.acked["redis"]
    return {
        "final_in_redis": sum(1 for s in states.values() if s in ("finished", "failed")),
        "one_results_entry": sum(1 for job_id in acked if written[job_id] == 1),
        "two_or_more_entries": sum(1 for job_id in acked if written[job_id] > 1),
    }


def periodic_jobs(workdir: Path) -> tuple[int, int]:
    """How many due times of the periodic job the controllers' journals hold, and how many
    of them are there more than once (in both journals: two controllers made one due time)."""
    seen: collections.Counter[str] = collections.Counter()
    for path in (workdir / "journal.sqlite3", workdir / "b" / "journal.sqlite3"):
        if not path.exists():
            continue
        with contextlib.closing(sqlite3.connect(path)) as db:
            rows = db.execute("SELECT id FROM jobs WHERE id LIKE 'cron-%'").fetchall()
        seen.update(str(row[0]) for row in rows)
    return len(seen), sum(1 for n in seen.values() if n > 1)


def flow_check(tally: Tally, execlog: Path) -> tuple[int, int, int]:
    """(then and waiting jobs acknowledged with no outcome or that never ran, those whose first
    run came before the first run of a job they wait for, then jobs that ran more than once),
    from the executions log: each job's payload is its id, one line a run."""
    first: dict[str, int] = {}
    runs: collections.Counter[str] = collections.Counter()
    for index, line in enumerate(execlog.read_text().split()):
        first.setdefault(line, index)
        runs[line] += 1
    lost = early = twice = 0
    for job_id, waits_for in tally.flows.items():
        state = tally.final.get(job_id)
        if state is None or (state == "finished" and job_id not in first):
            lost += 1
            continue
        if job_id in first and any(first[job_id] < first.get(m, -1) for m in waits_for):
            early += 1
        if job_id.startswith("t") and runs[job_id] > 1:
            twice += 1
    return lost, early, twice


def report(
    tally: Tally,
    execlog: Path,
    duplicates: int,
    workdir: Path,
    redis_check: dict[str, int] | None,
) -> int:
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
    runs = collections.Counter(execlog.read_text().split())
    runs.pop(str(SCHEDULE["payload"]), None)  # the periodic jobs all carry the same payload
    extra_runs = sum(n - 1 for n in runs.values() if n > 1)
    longest = max((o.latency for o in acked.values() if o.status == "success"), default=0.0)
    print("chaos verdict")
    print(f"  faults injected: {dict(tally.kills)}")
    print(
        f"  UDP door: jobs submitted: {tally.submitted}, acknowledged: {len(acked)}, "
        f"never acknowledged (client gave up): {len(outcomes) - len(acked)}, "
        f"still open at the end: {unfinished_in_time}"
    )
    print(
        f"    succeeded: {by_status['success']}, failed: {by_status['error']}, "
        f"failed_post: {by_status['failed_post']}"
    )
    for cause, n in causes.most_common():
        print(f"    failure cause x{n}: {cause}")
    print(f"    duplicate notifications suppressed at the client: {duplicates}")
    print(f"    longest time a job waited for its outcome: {longest:.1f} s")
    other_lost = 0
    for door in ("http", "redis"):
        if not tally.others_submitted[door]:
            continue
        door_acked = tally.acked[door]
        states = collections.Counter(tally.final.get(job_id, "none") for job_id in door_acked)
        missing = states.pop("none", 0)
        other_lost += missing
        print(
            f"  {door.upper()} door: jobs submitted: {tally.others_submitted[door]}, "
            f"acknowledged: {len(door_acked)}, ended: {dict(states)}, no outcome: {missing}"
        )
    if redis_check is not None:
        n = len(tally.acked["redis"])
        bad = n - redis_check["final_in_redis"] + redis_check["two_or_more_entries"]
        bad += n - redis_check["one_results_entry"] - redis_check["two_or_more_entries"]
        other_lost += bad
        print(
            f"    in Redis: {redis_check['final_in_redis']} of {n} with a final job:<id>, "
            f"{redis_check['one_results_entry']} with exactly one results entry, "
            f"{redis_check['two_or_more_entries']} with more than one"
        )
    print(
        f"  executions beyond one per job: {extra_runs} (a worker killed or stopped while "
        "running a job, or a result handed over just before a controller SIGKILL: "
        "at-least-once)"
    )
    flows_lost, early, then_twice = flow_check(tally, execlog)
    other_lost += flows_lost
    print(
        f"  batches and dependent jobs (HTTP): {len(tally.flows)} then or waiting jobs "
        f"acknowledged, no outcome: {flows_lost}, started before a job they wait for: {early}, "
        f"then jobs run more than once: {then_twice} (at-least-once, as any job)"
    )
    tracebacks = sum(
        log.read_text(errors="replace").count("Traceback")
        for log in (workdir / "controller.log", workdir / "controller_b.log")
        if log.exists()
    )
    print(
        f"  hostile inputs sent: {tally.hostile}, refused with an internal error: "
        f"{tally.hostile_internal}"
    )
    print(f"  tracebacks in the controllers' logs: {tracebacks}")
    made, twice = periodic_jobs(workdir)
    print(
        f"  periodic jobs (every {SCHEDULE['every']} s, in both controllers): {made} due times "
        f"made, {twice} made more than once"
    )
    print(f"  acknowledged jobs lost: {len(lost) + unfinished_in_time + other_lost}")
    print(f"  logs and journals in {workdir}")
    verdict = (
        not lost
        and unfinished_in_time == 0
        and other_lost == 0
        and early == 0
        and by_status["success"] > 0
        and twice == 0
    )
    print("PASS: nothing acknowledged was lost" if verdict else "FAIL: acknowledged jobs were lost")
    return 0 if verdict else 1


def main() -> None:
    parser = argparse.ArgumentParser(prog="chaos", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--seconds", type=float, default=240, help="total run time, at most 300 (default 240)"
    )
    parser.add_argument("--seed", type=int, default=20261126)
    parser.add_argument("--workers", type=int, default=3, help="controller A's local workers")
    parser.add_argument(
        "--doors",
        default=",".join(DOORS),
        help="doors to drive, from udp,http,redis (default all; redis needs redis-server)",
    )
    parser.add_argument(
        "--journal-sync",
        choices=JOURNAL_SYNC_MODES,
        default="full",
        help="the controllers' journal_sync (default full; normal has no fsync per commit, "
        "and its faults here are process kills, which it survives)",
    )
    parser.add_argument(
        "--workdir", metavar="DIR", help="where logs and the journal go (default: a new temp dir)"
    )
    parser.add_argument(
        "--job-users",
        choices=("auto", "on", "off"),
        default="auto",
        help="run each local worker's --exec jobs as a uid of its own (--job-user "
        f"{JOB_UID_BASE}, {JOB_UID_BASE + 1}, ...); auto: when run as root (default)",
    )
    args = parser.parse_args()
    job_users = args.job_users == "on" or (args.job_users == "auto" and os.geteuid() == 0)
    seconds = min(args.seconds, 300.0)
    doors = {door.strip() for door in args.doors.split(",") if door.strip()}
    unknown = doors - set(DOORS)
    if unknown or "udp" not in doors:
        parser.error(f"--doors: udp and any of http, redis; got {args.doors!r}")
    if "redis" in doors and REDIS_SERVER is None:
        print("chaos: redis-server is not installed: the Redis door is left out", flush=True)
        doors.discard("redis")
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(
        f"chaos: {seconds:g} s, seed {args.seed}, doors {', '.join(sorted(doors))}, "
        f"journal_sync {args.journal_sync}, "
        f"{args.workers} local workers + a calculator"
        + (" + a poller" if "http" in doors else "")
        + (" + controller B with one worker on the stream" if "redis" in doors else "")
        + (", jobs of each local worker as a uid of their own" if job_users else "")
        + f", in {workdir}",
        flush=True,
    )
    sys.exit(
        trio.run(
            run, seconds, args.seed, args.workers, workdir, doors, args.journal_sync, job_users
        )
    )


if __name__ == "__main__":
    main()

"""The front door over real UDP: a lossy router in-process, then the real commands."""

from __future__ import annotations

import collections
import functools
import json
import os
import random
import select
import socket as stdsocket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from controller.app import assemble
from controller.client import UdpSession
from controller.config import ClientAddress, Config
from controller.doors.udp.shell import UdpDoor
from controller.shell import durability
from controller.shell.core_shell import CoreShell
from tests.helpers import (
    controller_argv,
    free_udp_port,
    lossy_router,
    run_udp_client,
    wait_until,
    write_config,
)
from tests.worker_handlers import EXECUTIONS, GATES, start_workers
from tests.worker_handlers import executions as executions_in


async def test_200_tasks_through_lossy_network(sockdir, nursery):
    config = Config(
        socket_dir=sockdir,
        journal=None,
        client_address=ClientAddress("127.0.0.1", 0),
        max_retries=3,
    )
    ctl = assemble(config)
    shell, desk, udp = ctl.shell, ctl.desk, ctl.udp
    server = udp.bind()
    await nursery.start(desk.run)
    await nursery.start(shell.serve)
    await nursery.start(udp.serve)
    noted = sockdir / "executions"
    noted.mkdir()
    handler = "tests.worker_handlers:counted_done"
    await start_workers(nursery, sockdir, "--handler", handler, count=2, **{EXECUTIONS: str(noted)})
    await wait_until(lambda: shell.core.idle_workers == 2)
    rng = random.Random(20261126)
    router = await nursery.start(
        functools.partial(lossy_router, rng, server, drop=0.3, dup=0.1, reorder=0.2)
    )

    sock = stdsocket.socket(stdsocket.AF_INET, stdsocket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    client = UdpSession(sock, router, timeout=60)
    results = {}
    reported = collections.Counter[int]()
    limiter = trio.CapacityLimiter(50)

    async def one(task_id: int) -> None:
        async with limiter:
            outcome = await client.run_task(task_id, {"payload": f"p{task_id}"})
        results[task_id] = outcome
        reported[task_id] += 1

    with sock, trio.fail_after(120):
        async with trio.open_nursery() as inner:
            inner.start_soon(client.receive)
            async with trio.open_nursery() as tasks:
                for task_id in range(1, 201):
                    tasks.start_soon(one, task_id)
            inner.cancel_scope.cancel()
    assert {t: o.status for t, o in results.items()} == {t: "success" for t in range(1, 201)}
    assert all(results[t].result == f"done:p{t}".encode() for t in range(1, 201))
    assert set(reported.values()) == {1}
    executions = executions_in(noted)
    assert max(executions.values()) <= 1 + config.max_retries
    assert sum(executions.values()) == 200  # no worker failed: each ran exactly once
    print(f"duplicates suppressed at the client: {client.duplicates}")


async def test_large_result_read_with_get_result(sockdir, nursery):
    config = Config(socket_dir=sockdir, journal=None, client_address=ClientAddress("127.0.0.1", 0))
    ctl = assemble(config)
    shell, desk, udp = ctl.shell, ctl.desk, ctl.udp
    server = udp.bind()
    await nursery.start(desk.run)
    await nursery.start(shell.serve)
    await nursery.start(udp.serve)
    big = bytes(range(256)) * 1000  # 256,000 bytes: five get_result chunks and more
    await start_workers(nursery, sockdir, "--handler", "tests.worker_handlers:large")
    sock = stdsocket.socket(stdsocket.AF_INET, stdsocket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    client = UdpSession(sock, server, timeout=30)
    with sock:
        async with trio.open_nursery() as inner:
            inner.start_soon(client.receive)
            outcome = await client.run_task(9, {})
            inner.cancel_scope.cancel()
    assert outcome.status == "success" and outcome.result == big


# ---------------------------------------------------------------- acknowledgements held


class GatedClient:
    """A raw UDP client of one in-process controller whose one worker (a real process,
    tests.worker_handlers:gated) runs each job when the test opens its gate."""

    def __init__(self, server: tuple[str, int], gates: Path) -> None:
        self.server = server
        self.gates = gates
        self.sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM)

    async def running(self, payload: str) -> None:
        """Until the worker runs the job of `payload`."""
        await wait_until((self.gates / f"{payload}.running").exists)

    def open(self, payload: str) -> None:
        (self.gates / f"{payload}.go").touch()

    def opened(self, payload: str) -> bool:
        return (self.gates / f"{payload}.go").exists()

    async def add(self, task_id: int, payload: str) -> None:
        packet = {"method": "add_task", "packet_type": 1, "transmission_id": task_id}
        packet["params"] = {"task_id": task_id, "payload": payload}
        await self.sock.sendto(json.dumps(packet).encode(), self.server)

    async def receive(self) -> dict[str, Any]:
        with trio.fail_after(10):
            return dict(json.loads(await self.sock.recv(65536)))

    def waiting(self) -> bool:
        """A datagram is there to read."""
        return bool(select.select([self.sock], [], [], 0)[0])


async def gated_controller(
    sockdir: Path, nursery: trio.Nursery
) -> tuple[GatedClient, trio.Nursery, CoreShell]:
    """A controller (journal off) with one gated worker; the nursery its UDP door runs in."""
    config = Config(socket_dir=sockdir, journal=None, client_address=ClientAddress("127.0.0.1", 0))
    ctl = assemble(config)
    shell, desk, udp = ctl.shell, ctl.desk, ctl.udp
    gates = sockdir / "gates"
    gates.mkdir()
    client = GatedClient(udp.bind(), gates)
    await client.sock.bind(("127.0.0.1", 0))
    await nursery.start(desk.run)
    await nursery.start(shell.serve)
    door = await nursery.start(_serve_door, udp)
    handler = "tests.worker_handlers:gated"
    await start_workers(nursery, sockdir, "--handler", handler, **{GATES: str(gates)})
    await wait_until(lambda: shell.core.idle_workers == 1)
    return client, door, shell


async def _serve_door(udp: UdpDoor, task_status: trio.TaskStatus[trio.Nursery]) -> None:
    async with trio.open_nursery() as door:
        await door.start(udp.serve)
        task_status.started(door)


async def busy_with(client: GatedClient, task_id: int, payload: str) -> None:
    """Job `task_id` running behind its closed gate, its acknowledgement read: a lone job's
    acknowledgement is never held."""
    await client.add(task_id, payload)
    await client.running(payload)
    ack = await client.receive()
    assert ack == {"method": "ack", "packet_type": 2, "transmission_id": task_id}


def batch_delay_of(monkeypatch, seconds: float) -> None:
    """Batches from two jobs in flight on, each waiting `seconds` (the door's rule reads
    these when it arms its timer)."""
    monkeypatch.setattr(durability, "BATCH_AFTER", 1)
    monkeypatch.setattr(durability, "BATCH_DELAY_PER_JOB", seconds)
    monkeypatch.setattr(durability, "BATCH_DELAY_MAX", seconds)


async def test_a_lone_jobs_answers_go_out_at_once(sockdir, nursery, monkeypatch):
    # Nothing would share the client's wake-up: no wait, whatever the batches' delay.
    batch_delay_of(monkeypatch, 3600.0)
    client, _, _ = await gated_controller(sockdir, nursery)
    with client.sock:
        await busy_with(client, 1, "lone")
        assert not client.opened("lone")
        client.open("lone")
        note = await client.receive()
        assert note["method"] == "notify_task" and note["params"]["result"] == "done:lone"


async def test_with_other_jobs_in_flight_answers_leave_together_in_order(
    sockdir, nursery, monkeypatch
):
    batch_delay_of(monkeypatch, 3600.0)  # longer than the test: it ends with the door
    client, door, shell = await gated_controller(sockdir, nursery)
    with client.sock:
        await busy_with(client, 1, "first")
        await client.add(2, "second")  # queued behind the first: two jobs in flight
        await wait_until(lambda: len(shell.core.tasks) == 2)
        client.open("first")
        client.open("second")
        await wait_until(lambda: not shell.core.tasks)  # both ran and ended
        assert not client.waiting()  # every answer waits for the batch
        door.cancel_scope.cancel()  # e.g. SIGTERM: the batch goes out before the socket closes
        answers = [await client.receive() for _ in range(3)]
        assert answers[0] == {"method": "ack", "packet_type": 2, "transmission_id": 2}
        assert [(a["method"], a["params"]["task_id"]) for a in answers[1:]] == [
            ("notify_task", 1),
            ("notify_task", 2),
        ]


async def test_a_batch_leaves_after_its_delay_without_waiting_for_outcomes(
    sockdir, nursery, monkeypatch
):
    batch_delay_of(monkeypatch, 0.2)
    client, _, _ = await gated_controller(sockdir, nursery)
    with client.sock:
        await busy_with(client, 1, "first")
        start = trio.current_time()
        await client.add(2, "second")
        ack = await client.receive()  # while both jobs wait: the batch's time, not theirs
        assert ack == {"method": "ack", "packet_type": 2, "transmission_id": 2}
        assert trio.current_time() - start >= 0.2 * 0.99
        assert not client.opened("first")
        client.open("first")
        client.open("second")
        notes = {(await client.receive())["params"]["result"] for _ in range(2)}
        assert notes == {"done:first", "done:second"}


def paced(gap: float, count: int = 40) -> durability.Pace:
    """A Pace that saw `count` answers, `gap` seconds apart."""
    pace = durability.Pace()
    for n in range(count):
        pace.note(n * gap)
    return pace


def test_answers_that_come_far_apart_do_not_wait_for_company():
    # 16 in flight: a batch would wait 720 us. Jobs that end every millisecond (a command's
    # start alone takes that long) would bring no company in it: the answer goes at once.
    assert durability.batch_delay(16) == pytest.approx(720e-6)
    assert paced(1e-3).delay(16) == 0.0
    # Answers 100 us apart (no-op jobs): about seven more come in the wait, so it waits.
    assert paced(100e-6).delay(16) == pytest.approx(720e-6)
    # With 64 in flight the wait is 3.6 ms, and the same millisecond jobs fill it.
    assert paced(1e-3).delay(64) == pytest.approx(durability.batch_delay(64))
    # A few in flight: no wait, however close together.
    assert paced(10e-6).delay(4) == 0.0


def test_a_commit_waits_for_the_jobs_that_can_join_it_not_for_a_queue():
    # 2 pollers, 5,000 jobs queued, both pollers' claims waiting: no company is coming.
    assert durability.commit_load(5000, 4998, 0, 2) == 4
    assert durability.batch_delay(durability.commit_load(5000, 4998, 0, 2)) == 0.0
    # 64 clients' jobs on 2 local workers: the answers held for the commit count.
    assert durability.commit_load(64, 40, 0, 22) == 46
    assert durability.batch_delay(46) > 0.0
    # Jobs waiting for their time add nothing either.
    assert durability.commit_load(10, 0, 9, 0) == 1


def test_a_pace_starts_as_dense_and_follows_the_gaps():
    pace = durability.Pace()
    assert pace.delay(16) == pytest.approx(720e-6)  # before any gap: the rule without a pace
    for n in range(40):  # sparse, then dense again
        pace.note(n * 1e-3)
    assert pace.delay(16) == 0.0
    for n in range(40):
        pace.note(1.0 + n * 50e-6)
    assert pace.delay(16) > 0.0


# ---------------------------------------------------------------- real processes


def start_controller(
    tmp: Path, sockdir: Path, port: int, *args: str, **settings
) -> subprocess.Popen[bytes]:
    settings = {"journal": None, **settings}
    path = write_config(
        tmp, socket_dir=str(sockdir), client_address={"host": "127.0.0.1", "port": port}, **settings
    )
    cmd = controller_argv(path, *args, log_level="WARNING")
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


TUNED = ["--cpus", "0", "--busy-poll", "200", "--", "--cpus", str((os.cpu_count() or 1) - 1)]


@pytest.mark.parametrize("tuning", [[], TUNED], ids=["default", "pinned-busy-poll"])
def test_udp_client_add_5_prints_result(tmp_path, sockdir, tuning):
    port = free_udp_port()
    proc = start_controller(tmp_path, sockdir, port, "--workers", "2", *tuning)
    try:
        done = run_udp_client(port, "--timeout", "30", "add", "5", "--payload", "hi")
        assert (done.returncode, done.stdout) == (0, b"hi"), done.stderr
        ids = tmp_path / "ids"
        ids.write_text("\n".join(str(i) for i in range(10, 60)) + "\n")
        many = run_udp_client(port, "add", "--ids-from", str(ids), "--payload", "x")
        assert many.returncode == 0, many.stderr
        assert b"succeeded: 50" in many.stderr and b"p99" in many.stderr
        status = run_udp_client(port, "status")
        assert status.returncode == 0, status.stderr
        assert b"workers: 2" in status.stdout and b"success 51" in status.stdout
    finally:
        stop(proc)


def test_failed_post_exits_1(tmp_path, sockdir):
    port = free_udp_port()
    proc = start_controller(tmp_path, sockdir, port, timeout_task_placement=0.5)
    try:
        done = run_udp_client(port, "add", "1")
        assert done.returncode == 1
        assert b"failed_post" in done.stderr
    finally:
        stop(proc)


def test_no_answer_exits_3():
    done = run_udp_client(free_udp_port(), "--timeout", "1", "add", "1", timeout=1)
    assert done.returncode == 3 and b"no answer" in done.stderr


def test_global_options_after_the_command():
    # --server may follow the command; --timeout after `add` is the job's own option.
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "controller.client",
            "--timeout",
            "0.5",
            "add",
            "1",
            "--server",
            f"127.0.0.1:{free_udp_port()}",
            "--timeout",
            "60",
        ],
        capture_output=True,
        timeout=30,
    )
    assert done.returncode == 3 and b"within 0.5 s" in done.stderr


def test_usage_error_exits_2(tmp_path):
    assert run_udp_client(1, "add", "abc").returncode == 2
    assert run_udp_client(1, "add", "5-1").returncode == 2
    ids = tmp_path / "ids"
    ids.write_text("1\n2\nthree\n")
    bad_line = run_udp_client(1, "add", "--ids-from", str(ids))
    assert bad_line.returncode == 2 and b"line 3" in bad_line.stderr
    missing = run_udp_client(1, "add", "--ids-from", str(tmp_path / "nope"))
    assert missing.returncode == 2 and b"nope" in missing.stderr
    assert run_udp_client(1, "add", "5", "--ids-from", str(ids)).returncode == 2  # not both

"""kill -9 the controller under a stream of tasks, 20 times (seeded), restarting it on its journal.

Every acknowledged task must end `success` at its client, reported once; a task a
re-registered worker took over must not run again while that controller lives (a later kill
may lose the journal's record of it again: then it is placed again); worker ids never repeat.
"""

from __future__ import annotations

import collections
import datetime
import json
import random
import re
import signal
import socket as stdsocket
import subprocess
import time

import trio

from controller.client import UdpSession
from tests.helpers import (
    controller_argv,
    free_udp_port,
    worker_argv,
    write_config,
)

ROUNDS = 20
TASKS = 400


async def test_kill_9_controller_twenty_times_loses_nothing(tmp_path, sockdir):
    rng = random.Random(20261126)
    port = free_udp_port()
    execlog = tmp_path / "executions.log"
    config = write_config(
        tmp_path,
        socket_dir=str(sockdir),
        client_address={"host": "127.0.0.1", "port": port},
        journal=str(tmp_path / "journal.sqlite3"),
        timeout_task_placement=120,
        dial_timeout=1.0,
    )
    controller_cmd = controller_argv(config)
    # INFO: the "registered as worker N" lines are how worker ids are checked below
    # Each run notes its task and the wall-clock time it started.
    record = f'echo "$TASK_ID $(date +%s.%N)" >> {execlog}; cat'
    worker_cmd = worker_argv(
        sockdir, "--pulse", "0.2", "--exec", "sh", "-c", record, log_level="INFO"
    )
    kills: list[float] = []  # wall-clock times of the kills
    logs = [tmp_path / f"controller-{i}.log" for i in range(ROUNDS + 1)]
    worker_logs = [tmp_path / f"worker-{i}.log" for i in range(2)]
    outcomes = {}
    reported = collections.Counter[int]()

    async def spawn(cmd, log_path):
        with log_path.open("wb") as log:  # the child keeps its own copy of the descriptor
            return await trio.lowlevel.open_process(cmd, stdout=subprocess.DEVNULL, stderr=log)

    workers = []

    async def supervised(slot: int) -> None:
        """Like systemd's Restart=always: a worker that exits (75 after RESTART) comes back."""
        with worker_logs[slot].open("ab") as log:
            while True:
                proc = await trio.lowlevel.open_process(worker_cmd, stderr=log)
                workers.append(proc)
                try:
                    await proc.wait()
                finally:
                    proc.kill()

    controller = await spawn(controller_cmd, logs[0])
    sock = stdsocket.socket(stdsocket.AF_INET, stdsocket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    client = UdpSession(sock, ("127.0.0.1", port), timeout=180)
    limiter = trio.CapacityLimiter(32)

    async def one(task_id: int) -> None:
        async with limiter:
            outcome = await client.run_task(task_id, {"payload": f"p{task_id}"})
        outcomes[task_id] = outcome
        reported[task_id] += 1

    async def chaos() -> None:
        nonlocal controller
        for i in range(1, ROUNDS + 1):
            await trio.sleep(rng.uniform(0.3, 1.0))
            controller.send_signal(signal.SIGKILL)
            kills.append(time.time())
            await controller.wait()
            controller = await spawn(controller_cmd, logs[i])

    try:
        with sock, trio.fail_after(240):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(supervised, 0)
                nursery.start_soon(supervised, 1)
                nursery.start_soon(client.receive)
                nursery.start_soon(chaos)
                async with trio.open_nursery() as tasks:
                    for task_id in range(1, TASKS + 1):
                        tasks.start_soon(one, task_id)
                nursery.cancel_scope.cancel()
    finally:
        for proc in [controller, *workers]:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    failures = {t: (o.status, o.error) for t, o in outcomes.items() if o.status != "success"}
    assert failures == {}
    assert all(outcomes[t].result == f"p{t}".encode() for t in range(1, TASKS + 1))
    assert set(reported.values()) == {1}

    text = "\n".join(path.read_text() for path in logs if path.exists())
    adopted = [  # (task, when it was taken over: the log's wall clock)
        (int(task), _wall(stamp))
        for stamp, task in re.findall(r"^(\S+ \S+) .*took over task (\d+)", text, re.M)
    ]
    replaced = {int(m) for m in re.findall(r"task (\d+) was running before the restart", text)}
    starts: dict[int, list[float]] = collections.defaultdict(list)
    for line in execlog.read_text().splitlines():
        task, at = line.split()
        starts[int(task)].append(float(at))
    runs = collections.Counter({task: len(times) for task, times in starts.items()})
    assert set(runs) == set(range(1, TASKS + 1))
    twice = {t: n for t, n in runs.items() if n > 1}
    # Taken over means not run again while that controller lives: a run after the take-over
    # comes after a later kill (which may have lost the journal's record of it again).
    for task, taken in adopted:
        later = [at for at in starts[task] if at > taken]
        assert all(any(taken < kill < at for kill in kills) for at in later), (task, taken)
    # A crash costs the runs the journal had not yet written: each worker's outcome on its way
    # and the next task it started behind it (journaled as pending while held), more when a
    # commit is slow to land (a loaded machine). Two workers, ROUNDS crashes.
    assert sum(n - 1 for n in twice.values()) <= 4 * ROUNDS

    ids = [
        int(m)
        for path in worker_logs
        for m in re.findall(r"registered as worker (\d+)", path.read_text())
    ]
    assert len(ids) == len(set(ids)) >= 2
    print(
        f"\n{ROUNDS} kills: {TASKS} tasks all succeeded; taken over {len(adopted)}, "
        f"re-placed {len(replaced)}, ran twice {len(twice)}, worker ids {len(ids)} all distinct, "
        f"client saw {client.duplicates} duplicate notifications"
    )


def _wall(stamp: str) -> float:
    """A log line's time ("2026-11-28 05:13:01,738", local time) as seconds since the epoch."""
    return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def test_full_disk_refuses_new_tasks_loudly(tmp_path, sockdir):
    """A journal that cannot grow: new tasks get an error acknowledgement, never a silent ack."""
    import resource

    port = free_udp_port()
    config = write_config(
        tmp_path,
        socket_dir=str(sockdir),
        client_address={"host": "127.0.0.1", "port": port},
        journal=str(tmp_path / "journal.sqlite3"),
    )
    limit = 256 * 1024

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    log = tmp_path / "controller.log"
    with log.open("wb") as err:
        proc = subprocess.Popen(
            controller_argv(config),
            stderr=err,
            preexec_fn=small_files,
        )
    try:
        sock = stdsocket.socket(stdsocket.AF_INET, stdsocket.SOCK_DGRAM)
        sock.settimeout(0.3)
        acked, refused, silent = [], [], 0
        with sock:
            for task_id in range(1, 400):
                packet = {
                    "method": "add_task",
                    "packet_type": 1,
                    "transmission_id": task_id,
                    "params": {"task_id": task_id, "payload": "x" * 4000},
                }
                for _ in range(10 if task_id == 1 else 2):  # at first it may still be starting
                    sock.sendto(json.dumps(packet).encode(), ("127.0.0.1", port))
                    try:
                        reply = json.loads(sock.recv(65536))
                        break
                    except TimeoutError:
                        reply = None
                if reply is None:
                    silent += 1
                elif "error" in reply:
                    refused.append(reply["error"]["code"])
                    if len(refused) >= 3:
                        break
                else:
                    acked.append(task_id)
        assert acked, "nothing was accepted before the limit"
        assert refused and set(refused) == {"journal_unavailable"}
        assert "JOURNAL WRITE FAILED" in log.read_text()
        # Everything acknowledged is on disk: read the journal back.
        from controller.journal import Journal

        proc.kill()
        proc.wait()
        rows = Journal.open(tmp_path / "journal.sqlite3").load().jobs
        assert set(acked) <= {row.task_id for row in rows}
    finally:
        proc.kill()
        proc.wait()

"""The worker against a fake controller on real Unix sockets."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import trio
import trio.lowlevel

from controller import wire
from gen import worker_protocol_pb2 as pb
from tests.fakes import FakeController
from tests.helpers import reap, send_raw, wait_until
from worker.errors import SetupError
from worker.local.base import EXIT_RESTART, promised_next_pulse
from worker.runner import TaskFailed, build_runner, run_command

MiB = 1024 * 1024


def set_task(task_id: int) -> pb.ControlMsg:
    return pb.ControlMsg(type=pb.CTRL_SET_TASK, task_id=task_id)


FETCH = pb.ControlMsg(type=pb.CTRL_FETCH)
STATUS = pb.ControlMsg(type=pb.CTRL_GET_STATUS)


def test_promised_next_pulse():
    assert promised_next_pulse(1.0) == 2
    assert promised_next_pulse(0.1) == 1
    assert promised_next_pulse(1.6) == 4


async def test_registers_listens_and_pulses_on_time(sockdir, nursery):
    async with real_worker(nursery, sockdir, "--pulse", "0.2") as (fake, _proc):
        [reg] = fake.of_type(pb.PULSE_REGISTER)
        assert reg.next_pulse == 1
        path = sockdir / "1.sock"
        assert stat.S_IMODE(path.stat().st_mode) == 0o660
        await fake.wait_for(lambda: len(fake.of_type(pb.PULSE_OK)) >= 4)
        times = [t for t, p in fake.pulses if p.type == pb.PULSE_OK]
        # Every period, not faster (a loaded machine may make one late, never early).
        assert all(0.15 <= b - a < 2.0 for a, b in itertools.pairwise(times[1:]))
        assert all(p.worker_id == 1 and p.task_id == 0 for p in fake.of_type(pb.PULSE_OK))


async def test_task_cycle_fetch_me_at_once(sockdir, nursery):
    async with real_worker(nursery, sockdir, "--pulse", "30", "--exec", "cat") as (fake, _proc):
        resp, _ = await fake.control(1, set_task(7), b"payload")
        assert (resp.error, resp.task_id) == (pb.WORKER_ERR_OK, 7)
        sent = trio.current_time()
        await fake.wait_for(lambda: bool(fake.of_type(pb.PULSE_FETCH_ME)))
        assert fake.pulses[-1][0] - sent < 10  # not at the next 30 s period
        assert fake.of_type(pb.PULSE_FETCH_ME)[0].task_id == 7
        busy, _ = await fake.control(1, set_task(8), b"x")
        assert (busy.error, busy.task_id) == (pb.WORKER_ERR_BUSY, 7)
        status, _ = await fake.control(1, STATUS)
        assert status.task_id == 7  # kept until fetched
        resp, result = await fake.control(1, FETCH)
        assert (resp.error, resp.task_id, result) == (pb.WORKER_ERR_OK, 7, b"payload")
        resp, _ = await fake.control(1, FETCH)
        assert resp.error == pb.WORKER_ERR_NO_FETCH
        status, _ = await fake.control(1, STATUS)
        assert status.task_id == 0


async def test_handler_exception_is_task_failed(sockdir, nursery):
    async with real_worker(nursery, sockdir, "--handler", "tests.worker_handlers:boom") as (
        fake,
        _proc,
    ):
        await fake.control(1, set_task(3), b"x")
        resp, text = await finished_outcome(fake, 1, 3)
        assert resp.error == pb.WORKER_ERR_TASK_FAILED and resp.task_id == 3
        assert text == b"ValueError: bad payload"


async def test_async_handler_runs_in_loop(sockdir, nursery):
    async with real_worker(nursery, sockdir, "--handler", "tests.worker_handlers:upper") as (
        fake,
        _proc,
    ):
        await fake.control(1, set_task(3), b"abc")
        assert (await finished_outcome(fake, 1, 3))[1] == b"ABC"


def assert_refused(reply: bytes) -> None:
    """`reply` is one WorkerResponse frame: WORKER_ERR_FAILED, saying why."""
    decoder = wire.FrameDecoder(pb.WorkerResponse)
    decoder.feed(reply)
    frame = decoder.next_frame()
    assert frame is not None
    resp, why = frame
    assert resp.error == pb.WORKER_ERR_FAILED and why


async def test_unknown_control_type_is_failed(sockdir, nursery):
    async with real_worker(nursery, sockdir) as (fake, _proc):
        resp, why = await fake.control(1, pb.ControlMsg(type=42))
        assert resp.error == pb.WORKER_ERR_FAILED and b"unknown control type" in why


# ---------------------------------------------------------------- --exec


async def test_exec_sees_task_id_and_payload():
    out = await run_command(["sh", "-c", 'echo "$TASK_ID:$(cat)"'], 5, b"hello", MiB)
    assert out == b"5:hello\n"


async def test_exec_runner_gives_the_command_the_workers_environment(monkeypatch):
    monkeypatch.setenv("JOB_CONTROLLER_TEST", "from-the-worker")
    run = build_runner(["sh", "-c", 'echo "$JOB_CONTROLLER_TEST:$TASK_ID"'], None, MiB)
    assert await run(7, b"") == b"from-the-worker:7\n"
    assert await run(8, b"") == b"from-the-worker:8\n"  # TASK_ID is each job's own


async def test_exec_failure_reports_stderr_tail():
    with pytest.raises(TaskFailed, match="exited with status 3: oops"):
        await run_command(["sh", "-c", "echo oops >&2; exit 3"], 1, b"", MiB)


async def test_exec_killed_by_signal():
    with pytest.raises(TaskFailed, match="killed by SIGKILL"):
        await run_command(["sh", "-c", "kill -9 $$"], 1, b"", MiB)


async def test_exec_output_over_limit_is_task_failed():
    with pytest.raises(TaskFailed, match="output exceeded max_extra_size"):
        await run_command(["head", "-c", str(50 * MiB), "/dev/zero"], 1, b"", 16 * MiB)


def test_exec_command_not_found_is_setup_error():
    with pytest.raises(SetupError, match="command not found"):
        build_runner(["/no/such/command"], None, MiB)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nomodule", "expected MODULE:FUNC"),
        ("no_such_mod:f", "cannot import"),
        ("os:nothing", "has no"),
    ],
)
def test_bad_handler_is_setup_error(spec, message):
    with pytest.raises(SetupError, match=message):
        build_runner(None, spec, MiB)


# ---------------------------------------------------------------- real processes


def spawn_worker(sockdir, *args: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "worker", "--socket-dir", str(sockdir), "--pulse", "0.2", *args]
    return subprocess.Popen(cmd, stderr=subprocess.PIPE)


async def wait_exit(proc: subprocess.Popen[bytes], timeout: float = 10) -> int:
    with trio.fail_after(timeout):
        while proc.poll() is None:
            await trio.sleep(0.02)
    return proc.returncode


async def test_sigterm_drains_then_shutdown_exit_0(sockdir, nursery):
    fake = FakeController(sockdir)
    await nursery.start(fake.serve)
    proc = spawn_worker(sockdir, "--exec", "sh", "-c", "sleep 0.5; cat")
    try:
        await fake.wait_for(lambda: bool(fake.of_type(pb.PULSE_OK)))
        await fake.control(1, set_task(4), b"drained")
        proc.send_signal(signal.SIGTERM)
        busy, _ = await fake.control(1, set_task(5), b"")
        assert busy.error == pb.WORKER_ERR_BUSY
        await fake.wait_for(lambda: bool(fake.of_type(pb.PULSE_FETCH_ME)))
        resp, result = await fake.control(1, FETCH)
        assert (resp.task_id, result) == (4, b"drained")
        await fake.wait_for(lambda: bool(fake.of_type(pb.PULSE_SHUTDOWN)))
        assert await wait_exit(proc) == 0
    finally:
        reap(proc)


async def test_restart_exit_status_75_real_process(sockdir, nursery):
    fake = FakeController(sockdir)
    await nursery.start(fake.serve)
    proc = spawn_worker(sockdir, "--exec", "sleep", "30")
    try:
        await fake.wait_for(lambda: bool(fake.of_type(pb.PULSE_OK)))
        await fake.control(1, set_task(1), b"")
        await fake.control(1, pb.ControlMsg(type=pb.CTRL_RESTART))
        assert await wait_exit(proc) == EXIT_RESTART
        assert not (sockdir / "1.sock").exists()
    finally:
        reap(proc)


async def test_worker_waits_for_absent_controller(sockdir, nursery):
    proc = spawn_worker(sockdir)
    try:
        fake = FakeController(sockdir)
        with trio.fail_after(10):
            while b"unreachable" not in (
                line := await trio.to_thread.run_sync(proc.stderr.readline)
            ):
                assert line, "worker exited"
        await nursery.start(fake.serve)
        await fake.wait_for(lambda: bool(fake.of_type(pb.PULSE_OK)))
        proc.send_signal(signal.SIGTERM)
        assert await wait_exit(proc) == 0
    finally:
        reap(proc)


def test_cli_bad_handler_exit_2():
    proc = subprocess.run(
        [sys.executable, "-m", "worker", "--handler", "nope"], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "MODULE:FUNC" in proc.stderr


def spawn_parent_of_worker(sockdir) -> subprocess.Popen[bytes]:
    cmd = f"{sys.executable} -m worker --socket-dir {sockdir} --exit-with-parent $$ & wait"
    return subprocess.Popen(["sh", "-c", cmd])


# A subreaper (as a container's init, systemd --user or a supervisor may be) whose child, a
# shell, starts a worker tied to the shell and leaves at once: the worker is the subreaper's
# then, and its parent is alive but not the one it was started by.
ORPHANED_WORKER = """
import ctypes, os, subprocess, sys, time
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
sh = subprocess.Popen(
    ["sh", "-c", sys.executable + " -m worker --socket-dir " + sys.argv[1]
     + " --exit-with-parent $$ & echo $!"],
    stdout=subprocess.PIPE,
)
worker = int(sh.stdout.readline())
sh.wait()  # the shell has ended: it did not wait for the worker to start
deadline = time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    pid, status = os.waitpid(worker, os.WNOHANG)
    if pid:
        print("exited", os.waitstatus_to_exitcode(status))
        break
    time.sleep(0.02)
else:
    os.kill(worker, 9)
    os.waitpid(worker, 0)
    print("still running")
"""


def test_a_worker_whose_parent_ended_before_it_started_exits(sockdir):
    """Its parent is gone before it could ask to be told: it sees another parent and exits
    at once, instead of waiting for a controller that will never come back."""
    proc = subprocess.run(
        [sys.executable, "-c", ORPHANED_WORKER, str(sockdir), "20"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.stdout.strip() == "exited 0", proc.stdout + proc.stderr
    assert "ended before the worker started" in proc.stderr


# A parent that starts its worker from a thread that then ends (trio starts processes from
# its worker threads); the kernel signals that end as well, and the parent lives on.
THREADED_PARENT = """
import subprocess, sys, threading
procs = []
argv = [sys.executable, "-m", "worker", "--socket-dir", sys.argv[1], "--exit-with-parent",
        str(__import__("os").getpid())]
spawner = threading.Thread(target=lambda: procs.append(subprocess.Popen(argv)))
spawner.start()
spawner.join()  # the thread that forked the worker has ended
print(procs[0].pid, flush=True)
sys.stdin.read()  # until the test closes our stdin
procs[0].terminate()
sys.exit(procs[0].wait())
"""


def start_threaded_parent(sockdir) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", THREADED_PARENT, str(sockdir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )


async def test_a_worker_stays_when_the_parent_thread_that_started_it_ends(sockdir, nursery):
    fake = FakeController(sockdir)
    await nursery.start(fake.serve)
    parent = start_threaded_parent(sockdir)
    try:
        assert parent.stdout is not None and parent.stdin is not None
        await trio.to_thread.run_sync(parent.stdout.readline)
        await fake.wait_for(lambda: len(fake.of_type(pb.PULSE_OK)) >= 3)
        assert not fake.of_type(pb.PULSE_SHUTDOWN)
        parent.stdin.close()
        assert await trio.to_thread.run_sync(parent.wait) == 0
        assert fake.of_type(pb.PULSE_SHUTDOWN)  # drained on SIGTERM, not before
    finally:
        reap(parent)
        assert parent.stdout is not None
        parent.stdout.close()


async def test_exit_with_parent_drains_when_the_parent_is_killed(sockdir, nursery):
    fake = FakeController(sockdir)
    await nursery.start(fake.serve)
    parent = spawn_parent_of_worker(sockdir)
    try:
        await fake.wait_for(lambda: bool(fake.of_type(pb.PULSE_OK)))
        parent.kill()  # SIGKILL: no chance to stop its child itself
        parent.wait()
        await fake.wait_for(lambda: bool(fake.of_type(pb.PULSE_SHUTDOWN)))
    finally:
        parent.kill()
        parent.wait()


async def test_cancelled_exec_job_kills_its_whole_process_group(tmp_path):
    """RESTART, task_timeout and a drain past its deadline cancel the job: the command and
    anything it started are killed and reaped, not left behind."""
    pids = tmp_path / "pids"
    script = f"sleep 30 & echo $$ $! > {pids}; wait"
    with trio.move_on_after(10) as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_command, ["sh", "-c", script], 1, b"", MiB)
            while not pids.exists() or not pids.read_text().strip():
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    assert not scope.cancelled_caught  # the job ended when cancelled, not at the guard
    shell_pid, sleep_pid = (int(p) for p in pids.read_text().split())
    with pytest.raises(ProcessLookupError):
        os.kill(shell_pid, 0)  # killed and reaped by the worker
    # The orphaned sleep is killed with the group; init reaps it (a zombie until then).
    # SIGKILL takes effect when the process next runs, so it may still be running (R) for a
    # moment: wait, with a deadline, for it to be dead.
    stat = Path(f"/proc/{sleep_pid}/stat")

    def dead() -> bool:
        try:
            return stat.read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except FileNotFoundError:
            return True

    await wait_until(dead, timeout=5)


async def test_exec_job_feeds_a_large_payload_and_reads_a_large_result():
    data = bytes(range(256)) * 20_000  # 5 MB both ways: more than any pipe buffer
    assert await run_command(["cat"], 1, data, 16 * MiB) == data


# ---------------------------------------------------------------- the local worker's loop


@contextlib.asynccontextmanager
async def real_worker(nursery, sockdir, *args: str):
    """A fake controller and a real worker process on it, once the worker said OK."""
    fake = FakeController(sockdir)
    await nursery.start(fake.serve)
    proc = spawn_worker(sockdir, *args)
    try:
        await fake.wait_for(lambda: bool(fake.of_type(pb.PULSE_OK)))
        yield fake, proc
    finally:
        reap(proc)


OVERSIZED_EXTRA = (lambda body: wire.encode_varint(len(body)) + body)(
    pb.ControlMsg(type=pb.CTRL_SET_TASK, task_id=1, extra_size=2**40).SerializeToString()
)


async def finished_outcome(fake, worker_id: int, task_id: int):
    await fake.wait_for(
        lambda: any(
            p.worker_id == worker_id and p.task_id == task_id
            for p in fake.of_type(pb.PULSE_FETCH_ME)
        )
    )
    return await fake.control(worker_id, FETCH)


@pytest.mark.parametrize(
    ("handler", "prefix"),
    [
        ("tests.worker_handlers:wait_for_file", b"plain:"),
        ("tests.worker_handlers:await_file", b"async:"),
    ],
    ids=["plain", "async"],
)
async def test_real_worker_answers_control_messages_while_a_handler_runs(
    sockdir, nursery, tmp_path, handler, prefix
):
    async with real_worker(nursery, sockdir, "--handler", handler) as (fake, _proc):
        release = tmp_path / "release"
        await fake.control(1, set_task(6), str(release).encode())
        status, _ = await fake.control(1, STATUS)
        assert (status.error, status.task_id) == (pb.WORKER_ERR_OK, 6)
        busy, _ = await fake.control(1, set_task(7), b"")
        assert busy.error == pb.WORKER_ERR_BUSY
        assert not fake.of_type(pb.PULSE_FETCH_ME)
        release.write_bytes(b"go")
        resp, result = await finished_outcome(fake, 1, 6)
        assert (resp.error, resp.task_id, result) == (pb.WORKER_ERR_OK, 6, prefix + b"go")
        status, _ = await fake.control(1, STATUS)
        assert status.task_id == 0


async def test_real_worker_registers_again_keeping_its_task(sockdir, nursery, tmp_path):
    release = tmp_path / "release"
    async with real_worker(
        nursery,
        sockdir,
        "--exec",
        "sh",
        "-c",
        f'while [ ! -e {release} ]; do sleep 0.01; done; echo "kept:$(cat)"',
    ) as (fake, _proc):
        await fake.control(1, set_task(9), b"p")
        fake.known.clear()  # the controller restarted and forgot everyone
        await fake.wait_for(lambda: len(fake.of_type(pb.PULSE_REGISTER)) == 2)
        await fake.wait_for(
            lambda: any(p.worker_id == 2 and p.task_id == 9 for _, p in fake.pulses)
        )
        assert not (sockdir / "1.sock").exists() and (sockdir / "2.sock").exists()
        release.touch()
        resp, result = await finished_outcome(fake, 2, 9)
        assert (resp.error, resp.task_id, result) == (pb.WORKER_ERR_OK, 9, b"kept:p\n")


async def test_real_worker_declares_its_queues_and_labels_in_every_register(sockdir, nursery):
    async with real_worker(nursery, sockdir, "--queues", "q2,q1", "--labels", "ssd") as (fake, _):
        fake.known.clear()  # the controller restarted and forgot everyone
        # (its OK once answered: the next pulse is a period away, so the kill meets no exchange)
        await fake.wait_for(lambda: any(p.worker_id == 2 for p in fake.of_type(pb.PULSE_OK)))
        regs = fake.of_type(pb.PULSE_REGISTER)
        assert [(list(r.queues), list(r.labels)) for r in regs] == [(["q1", "q2"], ["ssd"])] * 2
        assert all(not p.queues and not p.labels for p in fake.of_type(pb.PULSE_OK))


async def test_real_worker_exec_job_ignoring_stdin_and_flooding_both_outputs(sockdir, nursery):
    """A command that never reads its (big) payload and writes more than a pipe holds to
    both stdout and stderr finishes: the worker writes, reads and waits in one loop."""
    flood = "head -c 3000000 /dev/zero; head -c 3000000 /dev/zero >&2; echo oops >&2; exit 4"
    async with real_worker(nursery, sockdir, "--exec", "sh", "-c", flood) as (fake, _proc):
        await fake.control(1, set_task(3), b"x" * (4 * MiB))
        resp, why = await finished_outcome(fake, 1, 3)
        assert resp.error == pb.WORKER_ERR_TASK_FAILED
        assert why.startswith(b"sh exited with status 4:") and why.endswith(b"oops")
        await fake.control(1, set_task(4), b"")
        resp, why = await finished_outcome(fake, 1, 4)
        assert resp.error == pb.WORKER_ERR_TASK_FAILED  # the next job runs as well


async def test_real_worker_exec_command_gone_is_task_failed(sockdir, nursery, tmp_path):
    command = tmp_path / "job"
    command.write_text("#!/bin/sh\ncat\n")
    command.chmod(0o755)
    async with real_worker(nursery, sockdir, "--exec", str(command)) as (fake, _proc):
        await fake.control(1, set_task(1), b"first")
        resp, result = await finished_outcome(fake, 1, 1)
        assert (resp.error, result) == (pb.WORKER_ERR_OK, b"first")
        command.unlink()
        await fake.control(1, set_task(2), b"second")
        resp, why = await finished_outcome(fake, 1, 2)
        assert resp.error == pb.WORKER_ERR_TASK_FAILED
        assert why == f"cannot run {command}: No such file or directory".encode()


async def test_real_worker_second_signal_exits_at_once(sockdir, nursery):
    async with real_worker(nursery, sockdir, "--exec", "sleep", "30") as (fake, proc):
        await fake.control(1, set_task(1), b"")
        proc.send_signal(signal.SIGTERM)
        busy, _ = await fake.control(1, set_task(2), b"")  # draining: it took the first
        assert busy.error == pb.WORKER_ERR_BUSY
        proc.send_signal(signal.SIGINT)
        assert await wait_exit(proc) == 128 + signal.SIGINT


async def test_real_worker_drain_timeout_abandons_the_job_then_shuts_down(sockdir, nursery):
    async with real_worker(nursery, sockdir, "--drain-timeout", "0.3", "--exec", "sleep", "30") as (
        fake,
        proc,
    ):
        await fake.control(1, set_task(1), b"")
        proc.send_signal(signal.SIGTERM)
        await fake.wait_for(lambda: bool(fake.of_type(pb.PULSE_SHUTDOWN)))
        assert await wait_exit(proc) == 0
        assert not (sockdir / "1.sock").exists()


@pytest.mark.parametrize(
    "data",
    [
        b"\xff" * 11,
        wire.encode_varint(10_000),
        b"\x02\xff\xff",
        OVERSIZED_EXTRA,
    ],
    ids=["endless-varint", "oversized-header", "garbage", "oversized-extra"],
)
async def test_real_worker_refuses_bad_frames_on_that_connection_only(sockdir, nursery, data):
    async with real_worker(nursery, sockdir) as (fake, _proc):
        reply = await send_raw(sockdir / "1.sock", data)
        assert_refused(reply)
        if data == OVERSIZED_EXTRA:
            assert b"1099511627776" in reply  # the refusal names the size asked for
        status, _ = await fake.control(1, STATUS)
        assert (status.error, status.task_id) == (pb.WORKER_ERR_OK, 0)


async def test_real_worker_waits_out_a_full_listen_backlog_on_main_sock(sockdir, nursery):
    """A controller too busy to accept (main.sock's backlog full) is retried until the dial
    timeout, reported once, and registered with once it accepts again."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sockdir / "main.sock"))
    listener.listen(0)
    fillers = []
    try:
        while True:
            filler = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            filler.setblocking(False)
            fillers.append(filler)
            filler.connect(str(sockdir / "main.sock"))
    except BlockingIOError:
        pass
    proc = spawn_worker(sockdir)
    try:
        with trio.fail_after(10):
            while b"listen backlog full" not in (
                line := await trio.to_thread.run_sync(proc.stderr.readline, abandon_on_cancel=True)
            ):
                assert line, "worker exited"
        for sock in (*fillers, listener):
            sock.close()
        (sockdir / "main.sock").unlink()
        fake = FakeController(sockdir)
        await nursery.start(fake.serve)
        await fake.wait_for(lambda: bool(fake.of_type(pb.PULSE_OK)))
        assert proc.poll() is None
    finally:
        for sock in (*fillers, listener):
            sock.close()
        reap(proc)

"""The worker channel (DESIGN.md section 16, docs/protocol.md "The channel"): real workers on
an in-process controller, fake workers that send hostile bytes, and the framing itself."""

from __future__ import annotations

import itertools
import os
import signal
import socket as stdsocket
import subprocess
import sys
import time

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from controller import wire
from controller.channel import MAX_FRAMES_PER_SECOND
from controller.core import Action, TaskFinished, TaskState
from controller.joblimits import JobLimits
from controller.usage import Usage
from gen import worker_protocol_pb2 as pb
from tests.helpers import (
    connect_unix,
    fake_channel,
    reap,
    recv_all,
    running_controller,
    wait_until,
    worker_argv,
    write_config,
)
from worker.local.channel import read_one

pytestmark = pytest.mark.filterwarnings("ignore::trio.TrioDeprecationWarning")


def spawn(sockdir, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(worker_argv(sockdir, *args, log_level="WARNING"))


# ---------------------------------------------------------------- real workers


async def test_jobs_outcomes_and_failures_travel_on_the_channel(sockdir):
    """Two channel workers: every job's result or error comes back, no worker socket is
    made, and each worker holds one channel."""
    script = 'read p; if [ "$p" = fail ]; then echo broken >&2; exit 3; fi; echo "r$p"'
    procs = [spawn(sockdir, "--exec", "sh", "-c", script) for _ in range(2)]
    try:
        async with running_controller(sockdir) as (shell, outcomes):
            await wait_until(lambda: shell.core.idle_workers == 2)
            assert len(shell.links.channels) == 2
            assert sorted(p.name for p in sockdir.iterdir()) == ["main.sock"]
            for i in range(1, 41):
                shell.submit(i, b"fail\n" if i == 40 else b"%d\n" % i)
            done = await outcomes.wait(40, timeout=30)
            by_id = {d.task_id: d for d in done}
            assert all(by_id[i].result == b"r%d\n" % i for i in range(1, 40))
            assert by_id[40].state is TaskState.ERROR
            assert "broken" in by_id[40].error
    finally:
        for proc in procs:
            reap(proc)


async def test_seed_and_channel_workers_side_by_side(sockdir):
    procs = [spawn(sockdir, "--seed-protocol"), spawn(sockdir)]
    try:
        async with running_controller(sockdir) as (shell, outcomes):
            await wait_until(lambda: shell.core.idle_workers == 2)
            assert len(shell.links.channels) == 1
            seed = [
                w for w in shell.core.workers.values() if w.worker_id not in shell.links.channels
            ]
            assert (sockdir / f"{seed[0].worker_id}.sock").exists()
            for i in range(1, 101):
                shell.submit(i, b"p%d" % i)
            done = await outcomes.wait(100, timeout=30)
            assert {d.task_id: d.result for d in done} == {i: b"p%d" % i for i in range(1, 101)}
            assert all(w.done > 0 for w in shell.core.workers.values())
    finally:
        for proc in procs:
            reap(proc)


async def test_output_and_usage_arrive_before_the_outcome(sockdir):
    script = "echo to-stderr >&2; echo result"
    procs = [spawn(sockdir, "--exec", "sh", "-c", script)]
    try:
        async with running_controller(sockdir) as (shell, outcomes):
            seen: list[tuple[str, object]] = []

            def finished(done: TaskFinished) -> None:
                seen.append(("outcome", done.result))
                outcomes(done)

            shell.connect(
                finished=finished,
                output=lambda ref, job, data: seen.append(("output", data)),
                usage=lambda ref, job, usage: seen.append(("usage", usage)),
            )
            await wait_until(lambda: shell.core.idle_workers == 1)
            shell.submit(1, b"")
            await outcomes.wait(1)
            kinds = [kind for kind, _ in seen]
            assert kinds[-1] == "outcome" and seen[-1][1] == b"result\n"
            assert b"".join(d for k, d in seen if k == "output") == b"to-stderr\n"  # type: ignore[misc]
            [usage] = [u for k, u in seen if k == "usage"]
            assert isinstance(usage, Usage) and usage.wall > 0
            assert kinds.index("output") < kinds.index("outcome")
    finally:
        for proc in procs:
            reap(proc)


async def test_a_canceled_job_restarts_its_worker_over_the_channel(sockdir):
    proc = spawn(sockdir, "--exec", "sleep", "30")
    try:
        async with running_controller(sockdir) as (shell, _outcomes):
            await wait_until(lambda: shell.core.idle_workers == 1)
            task = shell.submit(1, b"")
            await wait_until(lambda: task.state is TaskState.RUNNING)
            actions: list[Action] = []
            assert shell.core.scheduler.cancel(task.ref, trio.current_time(), actions)
            shell.execute(actions)
            await wait_until(lambda: proc.poll() is not None, timeout=5)
            assert proc.returncode == 75
            assert not shell.links.channels
    finally:
        reap(proc)


async def test_a_draining_worker_hands_over_its_job_then_shuts_down(sockdir):
    marker = sockdir / "go"
    script = f"while [ ! -e {marker} ]; do sleep 0.02; done; echo finished"
    proc = spawn(sockdir, "--exec", "sh", "-c", script)
    try:
        async with running_controller(sockdir) as (shell, outcomes):
            await wait_until(lambda: shell.core.idle_workers == 1)
            task = shell.submit(1, b"")
            await wait_until(lambda: task.state is TaskState.RUNNING)
            proc.send_signal(signal.SIGTERM)
            marker.touch()
            [done] = await outcomes.wait(1)
            assert (done.state, done.result) == (TaskState.SUCCESS, b"finished\n")
            await wait_until(lambda: proc.poll() is not None, timeout=10)
            assert proc.returncode == 0
            await wait_until(lambda: not shell.core.workers and not shell.links.channels)
            assert shell.core.counters.worker_losses == {}
    finally:
        reap(proc)


async def test_the_worker_registers_again_after_a_controller_restart(sockdir):
    proc = spawn(sockdir, "--pulse", "0.2")
    try:
        async with running_controller(sockdir) as (shell, outcomes):
            await wait_until(lambda: shell.core.idle_workers == 1)
            shell.submit(1, b"first")
            [done] = await outcomes.wait(1)
            assert done.result == b"first"
        async with running_controller(sockdir) as (shell, outcomes):
            await wait_until(lambda: shell.core.idle_workers == 1, timeout=15)
            assert len(shell.links.channels) == 1
            shell.submit(2, b"second")
            [done] = await outcomes.wait(1)
            assert done.result == b"second"
        assert proc.poll() is None
    finally:
        reap(proc)


async def test_a_job_running_across_a_controller_restart_is_taken_over(sockdir):
    """The worker keeps its job when its channel ends, registers again with it, and its
    outcome reaches the new controller (which recovers it as the journal would)."""
    marker = sockdir / "go"
    script = f"while [ ! -e {marker} ]; do sleep 0.02; done; echo late"
    proc = spawn(sockdir, "--pulse", "0.2", "--exec", "sh", "-c", script)
    try:
        async with running_controller(sockdir) as (shell, outcomes):
            await wait_until(lambda: shell.core.idle_workers == 1)
            task = shell.submit(7, b"")
            await wait_until(lambda: task.state is TaskState.RUNNING)
        async with running_controller(sockdir) as (shell, outcomes):
            shell.core.recover(1, 7, b"", None, trio.current_time(), running=True, grace=10)
            await wait_until(lambda: len(shell.links.channels) == 1, timeout=15)
            marker.touch()
            [done] = await outcomes.wait(1, timeout=10)
            assert (done.task_id, done.result) == (7, b"late\n")
    finally:
        reap(proc)


# ---------------------------------------------------------------- fake workers, hostile bytes


async def _read_frame(sock, msg_type, timeout: float = 5.0):
    return await wire.recv_frame(sock, msg_type, timeout=timeout)


def _send_outcome(chan: stdsocket.socket, task_id: int, result: bytes) -> None:
    """A job's outcome on the channel, as a worker writes it: a success with its result."""
    response = pb.WorkerResponse(error=pb.WORKER_ERR_OK, task_id=task_id)
    chan.sendall(wire.encode_channel(wire.CHANNEL_RESPONSE, response, result, pb.CTRL_FETCH))


async def _frames(sock, decoder, count: int) -> list[tuple[pb.ChannelFrame, bytes]]:
    got: list[tuple[pb.ChannelFrame, bytes]] = []
    with trio.fail_after(5):
        while len(got) < count:
            try:
                data = sock.recv(65536)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(sock)
                continue
            assert data, "the channel ended"
            got += decoder.feed(data)
    return got


async def test_a_fake_worker_speaks_the_channel_and_its_end_re_places_the_job(sockdir):
    """One write each way per job; the channel's end (no process exit to see) puts the job
    back at once."""
    limits = JobLimits(file_size=1 << 20)
    async with running_controller(sockdir, job_limits=limits) as (shell, outcomes):
        wid, chan = await fake_channel(sockdir)
        decoder = wire.StreamDecoder(pb.ChannelFrame)
        with chan:
            await wait_until(lambda: shell.core.idle_workers == 1)
            shell.submit(5, b"payload")
            [(frame, extra)] = await _frames(chan, decoder, 1)
            assert frame.control.type == pb.CTRL_SET_TASK and frame.control.task_id == 5
            assert extra == b"payload"
            assert frame.control.limits.file_size == 1 << 20  # the job's limits travel with it
            response = pb.WorkerResponse(error=pb.WORKER_ERR_OK, task_id=5)
            response.usage.wall = 0.5
            chan.sendall(
                wire.encode_channel(wire.CHANNEL_RESPONSE, response, b"done", pb.CTRL_FETCH)
            )
            [done] = await outcomes.wait(1)
            assert (done.task_id, done.result) == (5, b"done")
            task = shell.submit(6, b"again")
            await _frames(chan, decoder, 1)
            assert shell.core.workers[wid].task is task
        # closed: gone at once, its job queued again with an attempt used
        await wait_until(lambda: wid not in shell.core.workers, timeout=1)
        assert task.state is TaskState.QUEUED and task.attempts == 1
        assert shell.core.counters.worker_losses == {"channel ended": 1}


async def test_a_pulse_of_an_unknown_type_is_answered_and_the_channel_stays(sockdir):
    """A newer worker's pulse type costs an older controller nothing: CTRL_ERR_UNKNOWN_TYPE,
    and the channel (and the job on it) goes on."""
    async with running_controller(sockdir) as (shell, outcomes):
        wid, chan = await fake_channel(sockdir)
        decoder = wire.StreamDecoder(pb.ChannelFrame)
        with chan:
            await wait_until(lambda: shell.core.idle_workers == 1)
            shell.submit(7, b"payload")
            [(frame, _)] = await _frames(chan, decoder, 1)
            assert frame.control.task_id == 7
            odd = pb.WorkerPulse(type=9, worker_id=wid, task_id=7, next_pulse=30)
            chan.sendall(wire.encode_channel(wire.CHANNEL_PULSE, odd))
            [(frame, _)] = await _frames(chan, decoder, 1)
            assert frame.pulse_response.error == pb.CTRL_ERR_UNKNOWN_TYPE
            _send_outcome(chan, 7, b"done")
            [done] = await outcomes.wait(1)
            assert (done.task_id, done.result) == (7, b"done")
            assert wid in shell.links.channels


async def test_a_pulse_written_before_the_worker_read_its_task_is_no_mismatch(sockdir):
    """On a channel a task counts as taken once written: a pulse the worker wrote before it
    read that task still says task 0 (or its last one). That is no mismatch: no GET_STATUS,
    no RESTART, and the job's outcome counts."""
    async with running_controller(sockdir) as (shell, outcomes):
        wid, chan = await fake_channel(sockdir)
        decoder = wire.StreamDecoder(pb.ChannelFrame)
        with chan:
            await wait_until(lambda: shell.core.idle_workers == 1)
            shell.submit(5, b"payload")
            [(frame, _)] = await _frames(chan, decoder, 1)
            assert frame.control.type == pb.CTRL_SET_TASK
            early = pb.WorkerPulse(type=pb.PULSE_OK, worker_id=wid, task_id=0, next_pulse=5)
            chan.sendall(wire.encode_channel(wire.CHANNEL_PULSE, early))  # no answer to an OK
            _send_outcome(chan, 5, b"done")
            [done] = await outcomes.wait(1)
            assert (done.task_id, done.result) == (5, b"done")
            # The pulse was read before the outcome: a GET_STATUS would be waiting by now.
            assert not _readable_now(chan)
            assert wid in shell.core.workers and shell.core.counters.worker_losses == {}


async def test_a_status_answer_that_crossed_the_next_task_is_no_mismatch(sockdir):
    """A GET_STATUS answered after the job ended says task 0; if the controller wrote the next
    task meanwhile, that answer crossed it on the channel: no RESTART."""
    async with running_controller(sockdir) as (shell, outcomes):
        wid, chan = await fake_channel(sockdir)
        decoder = wire.StreamDecoder(pb.ChannelFrame)
        with chan:
            await wait_until(lambda: shell.core.idle_workers == 1)
            shell.submit(5, b"first")
            await _frames(chan, decoder, 1)
            shell.submit(6, b"next")  # queued: the worker is busy
            for task_id in (5, 9):  # the second names a task it was never given
                pulse = pb.WorkerPulse(type=pb.PULSE_OK, worker_id=wid, task_id=task_id)
                chan.sendall(wire.encode_channel(wire.CHANNEL_PULSE, pulse))
            [(question, _)] = await _frames(chan, decoder, 1)
            assert question.control.type == pb.CTRL_GET_STATUS
            done = pb.WorkerResponse(error=pb.WORKER_ERR_OK, task_id=5)
            chan.sendall(wire.encode_channel(wire.CHANNEL_RESPONSE, done, b"", pb.CTRL_FETCH))
            [(next_task, _)] = await _frames(chan, decoder, 1)
            assert next_task.control.task_id == 6
            idle = pb.WorkerResponse(error=pb.WORKER_ERR_OK, task_id=0)
            chan.sendall(wire.encode_channel(wire.CHANNEL_RESPONSE, idle, b"", pb.CTRL_GET_STATUS))
            answer = pb.WorkerResponse(error=pb.WORKER_ERR_OK, task_id=6)
            chan.sendall(wire.encode_channel(wire.CHANNEL_RESPONSE, answer, b"ok", pb.CTRL_FETCH))
            finished = await outcomes.wait(2)
            assert [f.task_id for f in finished] == [5, 6]
            assert not _readable_now(chan)  # no RESTART
            assert shell.core.counters.worker_losses == {}


def _readable_now(sock) -> bool:
    """Whether anything waits to be read on `sock` (a GET_STATUS or RESTART would)."""
    try:
        return bool(sock.recv(1, stdsocket.MSG_PEEK))
    except BlockingIOError:
        return False


async def test_a_silent_channel_worker_is_dropped_and_its_channel_told_so(sockdir):
    """The pulse deadline holds on a channel: past it the worker is dropped, and its channel
    gets CTRL_ERR_UNKNOWN_ID and is closed (a live worker registers again)."""
    async with running_controller(sockdir) as (shell, _outcomes):
        wid, chan = await fake_channel(sockdir, next_pulse=1)
        with chan:
            data = await recv_all(chan, timeout=5)
        assert wid not in shell.core.workers
        [(frame, _)] = wire.StreamDecoder(pb.ChannelFrame).feed(data)
        assert frame.pulse_response.error == pb.CTRL_ERR_UNKNOWN_ID


HOSTILE = {
    "header over 4 KiB": wire.encode_varint(wire.MAX_HEADER_SIZE + 1) + b"x" * 10,
    "varint too long": b"\xff" * 11,
    "not protobuf": b"\x05\xff\xff\xff\xff\xff",
    "output over 64 KiB": wire.encode_varint(4) + b"\x30" + wire.encode_varint(1 << 20)[:3],
    "a control message from a worker": wire.encode_channel(
        wire.CHANNEL_CONTROL, pb.ControlMsg(type=pb.CTRL_RESTART)
    ),
    "an empty frame": b"\x00",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
async def test_hostile_bytes_end_that_channel_alone(sockdir, name):
    data = HOSTILE[name]
    if name == "output over 64 KiB":
        data = wire.encode_channel(
            wire.CHANNEL_PULSE,
            pb.WorkerPulse(type=pb.PULSE_OUTPUT),
            b"x" * (wire.MAX_PULSE_EXTRA + 1),
        )
    proc = spawn(sockdir)
    try:
        async with running_controller(sockdir) as (shell, outcomes):
            wid, chan = await fake_channel(sockdir)
            with chan:
                if name == "output over 64 KiB":  # the header alone is refused, unread extra
                    data = data[: len(data) - wire.MAX_PULSE_EXTRA]
                    frame = pb.ChannelFrame()
                    frame.pulse.type = pb.PULSE_OUTPUT
                    frame.pulse.worker_id = wid
                    frame.extra_size = wire.MAX_PULSE_EXTRA + 1
                    body = frame.SerializeToString()
                    data = wire.encode_varint(len(body)) + body
                chan.sendall(data)
                await recv_all(chan)  # the controller closes it
            await wait_until(lambda: wid not in shell.core.workers, timeout=2)
            await wait_until(lambda: shell.core.idle_workers == 1)
            shell.submit(1, b"still served")
            [done] = await outcomes.wait(1)
            assert done.result == b"still served"
    finally:
        reap(proc)


async def test_a_worker_that_stalls_in_a_frame_or_floods_loses_its_channel(sockdir):
    async with running_controller(sockdir, dial_timeout=0.3) as (shell, _outcomes):
        wid, chan = await fake_channel(sockdir)
        with chan:
            whole = wire.encode_channel(
                wire.CHANNEL_PULSE, pb.WorkerPulse(type=pb.PULSE_OK, worker_id=wid)
            )
            chan.sendall(whole + whole[:2])  # a frame and part of the next, then nothing
            start = trio.current_time()
            await recv_all(chan)
            assert 0.25 < trio.current_time() - start < 3
        assert wid not in shell.core.workers
        wid, chan = await fake_channel(sockdir)
        with chan:
            pulse = wire.encode_channel(
                wire.CHANNEL_PULSE, pb.WorkerPulse(type=pb.PULSE_OK, worker_id=wid, next_pulse=30)
            )
            flood = pulse * (MAX_FRAMES_PER_SECOND + 10)
            with trio.fail_after(10):
                view = memoryview(flood)
                while view:
                    try:
                        view = view[chan.send(view) :]
                    except BlockingIOError:
                        await trio.lowlevel.wait_writable(chan)
                    except BrokenPipeError:
                        break
            await recv_all(chan)
        await wait_until(lambda: wid not in shell.core.workers, timeout=2)


async def test_a_channel_for_another_process_or_a_second_channel_is_refused(sockdir):
    async with running_controller(sockdir) as (shell, _outcomes):
        wid, chan = await fake_channel(sockdir)
        with chan:
            second = await connect_unix(sockdir / "main.sock", 5)
            with second:
                opening = pb.WorkerPulse(type=pb.PULSE_OK, worker_id=wid, channel=True)
                await wire.send_frame(second, opening, timeout=5)
                answer, _ = await _read_frame(second, pb.PulseResponse)
                assert answer.error == pb.CTRL_ERR_FAILED and not answer.channel
        await wait_until(lambda: wid not in shell.core.workers, timeout=2)
        # a worker id registered by this process, opened from another process: refused
        main = sockdir / "main.sock"
        sock = await connect_unix(main, 5)
        with sock:
            register = pb.WorkerPulse(type=pb.PULSE_REGISTER, next_pulse=30, channel=True)
            await wire.send_frame(sock, register, timeout=5)
            answer, _ = await _read_frame(sock, pb.PulseResponse)
        code = (
            "import socket, sys\n"
            "from controller import wire\n"
            "from gen import worker_protocol_pb2 as pb\n"
            "s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])\n"
            f"s.sendall(wire.encode_frame(pb.WorkerPulse(type=1, worker_id={answer.worker_id},"
            " channel=True)))\n"
            "print(s.recv(100).hex())\n"
        )
        result = await trio.run_process(
            [sys.executable, "-c", code, str(main)], capture_stdout=True, check=False
        )
        reply = bytes.fromhex(result.stdout.decode().strip())
        assert pb.PulseResponse.FromString(reply[1:]).error == pb.CTRL_ERR_FAILED
        assert os.getpid() == shell.core.workers[answer.worker_id].pid


@pytest.mark.parametrize("case", ["not asked at its REGISTER", "a SHUTDOWN", "a FETCH_ME"])
async def test_a_channel_not_granted_or_opened_by_another_pulse_is_refused(sockdir, case):
    """Only a worker whose REGISTER asked for a channel opens one, with PULSE_OK or
    PULSE_FETCH_ME; anything else is refused (FAILED, the close) and the worker stays as it is."""
    async with running_controller(sockdir) as (shell, _outcomes):
        main = sockdir / "main.sock"
        sock = await connect_unix(main, 5)
        with sock:
            asked = case != "not asked at its REGISTER"
            register = pb.WorkerPulse(type=pb.PULSE_REGISTER, next_pulse=30, channel=asked)
            await wire.send_frame(sock, register, timeout=5)
            answer, _ = await _read_frame(sock, pb.PulseResponse)
        assert answer.error == pb.CTRL_ERR_OK and answer.channel is asked
        wid = answer.worker_id
        kind = pb.PULSE_SHUTDOWN if case == "a SHUTDOWN" else pb.PULSE_OK
        if case == "a FETCH_ME":  # allowed: a worker holding an outcome from before opens so
            kind = pb.PULSE_FETCH_ME
        sock = await connect_unix(main, 5)
        with sock:
            opening = pb.WorkerPulse(type=kind, worker_id=wid, channel=True)
            await wire.send_frame(sock, opening, timeout=5)
            answer, _ = await _read_frame(sock, pb.PulseResponse)
            if case == "a FETCH_ME":
                assert answer.error == pb.CTRL_ERR_OK and answer.channel
                await wait_until(lambda: wid in shell.links.channels)
                return
            assert answer.error == pb.CTRL_ERR_FAILED and not answer.channel
            assert await recv_all(sock) == b""  # closed
        assert wid in shell.core.workers and wid not in shell.links.channels


@pytest.mark.parametrize("stall", ["mid-frame", "not reading"])
def test_the_worker_gives_up_a_channel_its_controller_stalls_in_a_frame(sockdir, tmp_path, stall):
    """Section 3's limits hold on the worker's side too: a controller that stops in the middle
    of a frame, or stops reading the worker's (large) outcome, loses the channel after
    dial_timeout; the worker registers again."""
    config = write_config(tmp_path, socket_dir=str(sockdir), dial_timeout=0.5)
    listener = stdsocket.socket(stdsocket.AF_UNIX, stdsocket.SOCK_STREAM)
    listener.bind(str(sockdir / "main.sock"))
    listener.listen(8)
    listener.settimeout(10)

    def opened(worker_id: int) -> stdsocket.socket:
        """The worker's REGISTER answered with a channel, and its opening."""
        conn, _ = listener.accept()
        with conn:
            pulse = read_one(conn, pb.WorkerPulse)
            assert pulse.type == pb.PULSE_REGISTER and pulse.channel
            conn.sendall(wire.encode_frame(pb.PulseResponse(worker_id=worker_id, channel=True)))
        chan, _ = listener.accept()
        assert read_one(chan, pb.WorkerPulse).channel
        chan.sendall(wire.encode_frame(pb.PulseResponse(channel=True)))
        return chan

    proc = subprocess.Popen(
        worker_argv(sockdir, "--config", str(config), "--pulse", "30")  # it echoes payloads
    )
    try:
        with listener, opened(1) as chan:
            if stall == "mid-frame":
                chan.sendall(b"\x1e\x1a")  # a header of 30 bytes announced, one sent
            else:  # an 8 MiB payload echoed back: the outcome waits for a reader
                chan.setsockopt(stdsocket.SOL_SOCKET, stdsocket.SO_RCVBUF, 4096)
                task = pb.ControlMsg(type=pb.CTRL_SET_TASK, task_id=1)
                chan.sendall(wire.encode_channel(wire.CHANNEL_CONTROL, task, b"A" * (8 << 20)))
            started = time.monotonic()
            again = opened(2)  # registered again: it gave the first channel up
            assert time.monotonic() - started < 8  # dial_timeout 0.5 s, not never
            again.close()
    finally:
        reap(proc)


def test_a_frame_that_came_while_the_worker_s_loop_was_held_is_no_stall(sockdir, tmp_path):
    """A handler that holds the worker's loop past dial_timeout while the rest of a frame
    arrives: the worker reads what came before it judges the channel stalled, and keeps it
    (the next job, that frame, runs and its outcome comes back on it)."""
    config = write_config(tmp_path, socket_dir=str(sockdir), dial_timeout=0.5)
    listener = stdsocket.socket(stdsocket.AF_UNIX, stdsocket.SOCK_STREAM)
    listener.bind(str(sockdir / "main.sock"))
    listener.listen(8)
    listener.settimeout(10)
    handler = "tests.worker_handlers:block_until_file"
    proc = subprocess.Popen(
        worker_argv(sockdir, "--config", str(config), "--pulse", "30", "--handler", handler)
    )
    gate = tmp_path / "go"
    try:
        with listener:
            conn, _ = listener.accept()
            with conn:
                assert read_one(conn, pb.WorkerPulse).type == pb.PULSE_REGISTER
                conn.sendall(wire.encode_frame(pb.PulseResponse(worker_id=1, channel=True)))
            chan, _ = listener.accept()
        with chan:
            read_one(chan, pb.WorkerPulse)
            chan.sendall(wire.encode_frame(pb.PulseResponse(channel=True)))
            first = pb.ControlMsg(type=pb.CTRL_SET_TASK, task_id=1)
            second = pb.ControlMsg(type=pb.CTRL_SET_TASK, task_id=2)
            # (small enough for the socket's buffers to hold while nobody reads)
            big = wire.encode_channel(wire.CHANNEL_CONTROL, second, b"A" * 100_000)
            # The job, and the start of a large frame read with it: then its loop is held.
            job = wire.encode_channel(wire.CHANNEL_CONTROL, first, str(gate).encode())
            chan.sendall(job + big[:500])  # one write: the worker reads both at once
            time.sleep(1.0)  # the loop held past dial_timeout (the behaviour under test)
            chan.sendall(big[500:])
            gate.touch()  # the handler lets go
            decoder = wire.StreamDecoder(pb.ChannelFrame, 4 << 20)
            chan.settimeout(10)
            outcomes: dict[int, tuple[int, int, bytes]] = {}
            while len(outcomes) < 2:  # the first job's, then the large frame's (it fails)
                data = chan.recv(65536)
                assert data, f"the worker gave its channel up; outcomes {outcomes}"
                for frame, extra in decoder.feed(data):
                    if frame.WhichOneof("msg") == "response":
                        response = frame.response
                        outcomes[response.task_id] = (frame.answers, response.error, extra)
            assert outcomes[1] == (pb.CTRL_FETCH, pb.WORKER_ERR_OK, b"held")
            assert outcomes[2][:2] == (pb.CTRL_FETCH, pb.WORKER_ERR_TASK_FAILED)
    finally:
        reap(proc)


async def test_killing_a_channel_worker_mid_job_places_its_job_on_another_at_once(sockdir):
    slow = spawn(sockdir, "--pulse", "5", "--exec", "sh", "-c", "sleep 30")
    fast: subprocess.Popen[bytes] | None = None
    try:
        async with running_controller(sockdir) as (shell, outcomes):
            await wait_until(lambda: shell.core.idle_workers == 1)
            task = shell.submit(1, b"")
            await wait_until(lambda: task.state is TaskState.RUNNING)
            fast = spawn(sockdir, "--pulse", "5")
            await wait_until(lambda: shell.core.idle_workers == 1)
            os.kill(slow.pid, signal.SIGKILL)
            [done] = await outcomes.wait(1, timeout=3)
            assert done.state is TaskState.SUCCESS and task.attempts == 2
    finally:
        reap(slow)
        if fast is not None:
            reap(fast)


# ---------------------------------------------------------------- the framing

_pulses = st.builds(
    pb.WorkerPulse,
    type=st.sampled_from([pb.PULSE_OK, pb.PULSE_OUTPUT, pb.PULSE_SHUTDOWN]),
    worker_id=st.integers(0, 2**64 - 1),
    task_id=st.integers(0, 2**64 - 1),
    next_pulse=st.integers(0, 10_000),
)
_responses = st.builds(
    pb.WorkerResponse,
    error=st.sampled_from(list(pb.WorkerError.values())),
    task_id=st.integers(0, 2**64 - 1),
    reason=st.sampled_from(["", "limit"]),
)
_controls = st.builds(
    pb.ControlMsg,
    type=st.sampled_from(list(pb.ControlType.values())),
    task_id=st.integers(1, 2**63 - 1),
)
_frames_st = st.lists(
    st.one_of(
        st.tuples(st.just(wire.CHANNEL_PULSE), _pulses, st.binary(max_size=300)),
        st.tuples(st.just(wire.CHANNEL_RESPONSE), _responses, st.binary(max_size=300)),
        st.tuples(st.just(wire.CHANNEL_CONTROL), _controls, st.binary(max_size=300)),
    ),
    max_size=12,
)


@settings(max_examples=200, deadline=None)
@given(frames=_frames_st, cuts=st.lists(st.integers(0, 5000), max_size=20))
def test_any_split_of_a_channel_stream_parses_the_same(frames, cuts):
    stream = b"".join(
        wire.encode_channel(field, msg, extra, pb.CTRL_FETCH if field == 4 else 0)
        for field, msg, extra in frames
    )
    points = sorted({c % (len(stream) + 1) for c in cuts} | {0, len(stream)})
    decoder = wire.StreamDecoder(pb.ChannelFrame)
    got = []
    for start, end in itertools.pairwise(points):
        got += decoder.feed(stream[start:end])
    assert not decoder.pending
    assert len(got) == len(frames)
    for (field, msg, extra), (frame, got_extra) in zip(frames, got, strict=True):
        assert got_extra == extra
        inner = getattr(frame, frame.WhichOneof("msg"))
        assert inner == msg
        assert frame.extra_size == len(extra)
        # the hand-written encoding is the protobuf one
        built = pb.ChannelFrame(extra_size=len(extra))
        getattr(built, frame.WhichOneof("msg")).CopyFrom(msg)
        if field == 4:
            built.answers = pb.CTRL_FETCH
        assert frame == built

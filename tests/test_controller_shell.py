"""The controller's trio shell against fake workers on real Unix sockets."""

from __future__ import annotations

import os
import socket as stdsocket

import pytest
import trio

from controller import wire
from controller.core import TaskState, WorkerState
from controller.errors import StartupError
from controller.shell.main_socket import bind_main_socket, prepare_socket_dir
from gen import worker_protocol_pb2 as pb
from tests.fakes import FakeWorker
from tests.helpers import (
    connect_unix,
    exchange,
    recv_all,
    running_controller,
    send_raw,
    wait_until,
)


async def fresh_register_is_answered(sockdir) -> None:
    with trio.fail_after(1):
        msg = pb.WorkerPulse(type=pb.PULSE_REGISTER, next_pulse=2)
        resp, _ = await exchange(sockdir / "main.sock", msg, pb.PulseResponse)
    assert resp.error == pb.CTRL_ERR_OK and resp.worker_id > 0


async def test_register_pulse_and_unknown_ids(sockdir, nursery):
    async with running_controller(sockdir) as (shell, _):
        w = await FakeWorker(sockdir).start(nursery)
        assert shell.core.workers[w.worker_id].state is WorkerState.IDLE
        w2 = await FakeWorker(sockdir).start(nursery)
        assert w2.worker_id == w.worker_id + 1
        stranger = FakeWorker(sockdir, worker_id=999)
        assert (await stranger.pulse()).error == pb.CTRL_ERR_UNKNOWN_ID
        assert (await w.pulse(ptype=9)).error == pb.CTRL_ERR_UNKNOWN_TYPE
        assert shell.core.workers[w.worker_id].pid == os.getpid()


async def test_full_task_cycle(sockdir, nursery):
    async with running_controller(sockdir) as (shell, outcomes):
        w = await FakeWorker(sockdir).start(nursery)
        shell.submit(5, b"hi")
        await w.wait_for(pb.CTRL_SET_TASK)
        assert w.received[0] == (pb.CTRL_SET_TASK, 5, b"hi")
        assert (await w.pulse(pb.PULSE_FETCH_ME)).error == pb.CTRL_ERR_OK
        [done] = await outcomes.wait(1)
        assert (done.task_id, done.state, done.result) == (5, TaskState.SUCCESS, b"done:hi")


async def test_expire_and_replace(sockdir, nursery, autojump_clock):
    async with running_controller(sockdir) as (shell, outcomes):
        silent = await FakeWorker(sockdir, next_pulse=2).start(nursery)
        shell.submit(1, b"x")
        await silent.wait_for(pb.CTRL_SET_TASK)
        healthy = await FakeWorker(sockdir, next_pulse=60).start(nursery)
        start = trio.current_time()
        await healthy.wait_for(pb.CTRL_SET_TASK)
        assert trio.current_time() - start == pytest.approx(2.0, abs=0.01)
        assert silent.worker_id not in shell.core.workers
        await healthy.pulse(pb.PULSE_FETCH_ME)
        assert (await outcomes.wait(1))[0].state is TaskState.SUCCESS


async def test_busy_goes_to_another_worker(sockdir, nursery):
    async with running_controller(sockdir) as (shell, outcomes):
        other = await FakeWorker(sockdir).start(nursery)
        busy = FakeWorker(sockdir, task_id=77)  # holds a task the controller does not know
        busy.script[pb.CTRL_GET_STATUS] = None  # type: ignore[assignment]
        await busy.start(nursery, ready=False)
        await busy.pulse(task_id=0)  # claims idle (last, so picked first), then answers BUSY
        shell.submit(3, b"p")
        await other.wait_for(pb.CTRL_SET_TASK)
        assert busy.kinds() == [pb.CTRL_SET_TASK]
        assert shell.core.workers[busy.worker_id].state is WorkerState.UNSURE
        await other.pulse(pb.PULSE_FETCH_ME)
        assert (await outcomes.wait(1))[0].state is TaskState.SUCCESS


async def test_task_failed_retried_elsewhere_then_error_when_retries_run_out(sockdir, nursery):
    async def fail(msg, extra):
        return pb.WorkerResponse(error=pb.WORKER_ERR_TASK_FAILED, task_id=msg.task_id or 4), b"boom"

    async with running_controller(sockdir, max_retries=1) as (shell, outcomes):
        workers = [await FakeWorker(sockdir).start(nursery) for _ in range(2)]
        for w in workers:
            w.script[pb.CTRL_FETCH] = fail
        shell.submit(4, b"p")
        for attempt in range(2):
            w = workers[-1 - attempt]  # the most recently idle first, then the other
            await w.wait_for(pb.CTRL_SET_TASK)
            await w.pulse(pb.PULSE_FETCH_ME)
        [done] = await outcomes.wait(1)
        assert done.state is TaskState.ERROR and "boom" in done.error
        assert [w.kinds().count(pb.CTRL_SET_TASK) for w in workers] == [1, 1]


async def test_failed_answer_drops_worker(sockdir, nursery):
    async def failed(msg, extra):
        return pb.WorkerResponse(error=pb.WORKER_ERR_FAILED), b"disk on fire"

    async with running_controller(sockdir) as (shell, outcomes):
        bad = FakeWorker(sockdir)
        bad.script[pb.CTRL_SET_TASK] = failed
        await bad.start(nursery)
        shell.submit(1, b"x")
        await wait_until(lambda: bad.worker_id not in shell.core.workers)
        good = await FakeWorker(sockdir).start(nursery)
        await good.wait_for(pb.CTRL_SET_TASK)
        await good.pulse(pb.PULSE_FETCH_ME)
        assert (await outcomes.wait(1))[0].state is TaskState.SUCCESS


async def test_mismatch_get_status_then_restart(sockdir, nursery):
    async with running_controller(sockdir) as (shell, _):
        w = await FakeWorker(sockdir).start(nursery)
        shell.submit(1, b"x")
        await w.wait_for(pb.CTRL_SET_TASK)
        await w.pulse(task_id=0)  # crossed the SET_TASK: only a check
        await w.wait_for(pb.CTRL_GET_STATUS)
        await wait_until(lambda: not shell.core.workers[w.worker_id].checking)
        assert pb.CTRL_RESTART not in w.kinds()
        w.task_id = 42  # now it really holds something else
        await w.pulse()
        await w.wait_for(pb.CTRL_RESTART)
        assert w.kinds() == [
            pb.CTRL_SET_TASK,
            pb.CTRL_GET_STATUS,
            pb.CTRL_GET_STATUS,
            pb.CTRL_RESTART,
        ]
        assert w.worker_id not in shell.core.workers


async def test_task_timeout_restarts(sockdir, nursery, autojump_clock):
    async with running_controller(sockdir, task_timeout=5) as (shell, _):
        w = await FakeWorker(sockdir, next_pulse=60).start(nursery)
        shell.submit(1, b"x")
        await w.wait_for(pb.CTRL_SET_TASK)
        start = trio.current_time()
        await w.wait_for(pb.CTRL_RESTART)
        assert trio.current_time() - start == pytest.approx(5.0, abs=0.01)
        assert shell.core.queued == 1


async def test_placement_timeout(sockdir, autojump_clock):
    async with running_controller(sockdir, timeout_task_placement=3) as (shell, outcomes):
        shell.submit(1, b"x")
        [done] = await outcomes.wait(1)
        assert done.state is TaskState.FAILED_POST
        assert trio.current_time() == pytest.approx(3.0, abs=0.01)


async def test_worker_socket_that_never_answers(sockdir, nursery, autojump_clock):
    async def hang(msg, extra):
        await trio.sleep_forever()

    async with running_controller(sockdir, dial_timeout=2) as (shell, _):
        good = await FakeWorker(sockdir, next_pulse=60).start(nursery)
        w = FakeWorker(sockdir, next_pulse=60)
        w.script[pb.CTRL_SET_TASK] = hang
        await w.start(nursery)  # idle last: the task goes here first
        shell.submit(1, b"x")
        await good.wait_for(pb.CTRL_SET_TASK)
        assert w.worker_id not in shell.core.workers
        assert shell.core.counters.worker_losses == {"no answer": 1}


async def _too_big(msg, extra):
    return pb.WorkerResponse(error=pb.WORKER_ERR_OK, task_id=1), b"x" * 2000


async def _not_its_task(msg, extra):
    return pb.WorkerResponse(error=pb.WORKER_ERR_OK, task_id=999), b"someone else's"


@pytest.mark.parametrize(
    "answer", [_too_big, _not_its_task], ids=["more-than-max-extra-size", "wrong-task-id"]
)
async def test_bad_fetch_answer_drops_worker_and_keeps_the_task(sockdir, nursery, answer):
    async with running_controller(sockdir, max_extra_size=1000) as (shell, outcomes):
        w = FakeWorker(sockdir)
        w.script[pb.CTRL_FETCH] = answer
        await w.start(nursery)
        shell.submit(1, b"x")
        await w.wait_for(pb.CTRL_SET_TASK)
        await w.pulse(pb.PULSE_FETCH_ME)
        await wait_until(lambda: w.worker_id not in shell.core.workers)
        assert outcomes.items == [] and shell.core.queued == 1
        await fresh_register_is_answered(sockdir)


@pytest.mark.parametrize(
    "data",
    [
        b"\xff\xff\xff garbage \x00\x01",  # malformed
        b"\xff" * 11,  # endless varint
        wire.encode_varint(1 << 20),  # header over 4 KiB
    ],
    ids=["garbage", "endless-varint", "oversized-header"],
)
async def test_bad_pulse_bytes_get_failed_and_server_keeps_serving(sockdir, data):
    async with running_controller(sockdir):
        reply = await send_raw(sockdir / "main.sock", data)
        decoder = wire.FrameDecoder(pb.PulseResponse)
        decoder.feed(reply)
        frame = decoder.next_frame()
        assert frame is not None and frame[0].error == pb.CTRL_ERR_FAILED
        await fresh_register_is_answered(sockdir)


async def test_half_message_and_200_idle_connections(sockdir):
    async with running_controller(sockdir, dial_timeout=30):
        socks = []
        try:
            for _ in range(200):
                socks.append(await connect_unix(sockdir / "main.sock", 5))
            socks[0].send(b"\x08")  # half a message, then silence
            await fresh_register_is_answered(sockdir)
        finally:
            for s in socks:
                s.close()


async def test_silent_pulse_connection_is_closed_after_dial_timeout(sockdir, autojump_clock):
    async with running_controller(sockdir, dial_timeout=2):
        with await connect_unix(sockdir / "main.sock", 5) as s:
            s.send(b"\x06\x08")
            start = trio.current_time()
            reply = await recv_all(s)
            assert trio.current_time() - start == pytest.approx(2.0, abs=0.01)
            assert reply  # CTRL_ERR_FAILED, then close


async def test_stale_main_sock_replaced_live_one_refused(sockdir):
    stale = stdsocket.socket(stdsocket.AF_UNIX, stdsocket.SOCK_STREAM)
    stale.bind(str(sockdir / "main.sock"))
    stale.close()  # the file stays, nobody listens
    async with running_controller(sockdir):
        await fresh_register_is_answered(sockdir)
        with pytest.raises(StartupError, match="another controller"):
            # In a thread: the probe's pulse is answered by this loop's controller.
            await trio.to_thread.run_sync(bind_main_socket, sockdir / "main.sock")


def test_world_writable_socket_dir_refused(sockdir):
    sockdir.chmod(0o777)
    with pytest.raises(StartupError, match="world-writable"):
        prepare_socket_dir(sockdir)

"""Job output on the worker's side: the sink, and PULSE_OUTPUT against a fake controller
(a real `worker` process)."""

from __future__ import annotations

import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from gen import worker_protocol_pb2 as pb
from tests.fakes import FakeController
from tests.helpers import reap, worker_argv
from worker.local.base import EXIT_RESTART
from worker.output import BUFFER_LIMIT, CHUNK, OutputSink

MiB = 1024 * 1024
FETCH = pb.ControlMsg(type=pb.CTRL_FETCH)
RESTART = pb.ControlMsg(type=pb.CTRL_RESTART)


def test_the_sink_keeps_the_newest_bytes_and_says_what_it_dropped() -> None:
    woken: list[int] = []
    sink = OutputSink(lambda: woken.append(len(sink)), limit=10)
    sink.write(b"abc")
    sink.write(b"def")
    assert woken == [3]  # once, when bytes arrived where there were none
    sink.write(b"0123456789xy")
    assert len(sink) == 10
    assert sink.take(100) == b"[worker: 8 bytes of output dropped]\n23456789xy"
    assert len(sink) == 0 and sink.take() == b""
    sink.write(b"again")
    assert woken == [3, 5]


def test_the_sink_hands_out_chunks_and_wakes_when_a_chunk_is_full() -> None:
    woken: list[int] = []
    sink = OutputSink(lambda: woken.append(len(sink)))
    sink.write(b"x" * (CHUNK - 1))
    sink.write(b"yy")  # a whole chunk now waits: its owner sends it without waiting
    assert woken == [CHUNK - 1, CHUNK + 1]
    assert sink.take() == b"x" * (CHUNK - 1) + b"y"
    assert sink.take() == b"y"


def _spawn(sockdir: Path, command: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(worker_argv(sockdir, "--pulse", "30", "--exec", "sh", "-c", command))


@asynccontextmanager
async def worker_and_fake(
    sockdir: Path, command: str, takes_output: bool
) -> AsyncIterator[FakeController]:
    """A fake controller and a real `worker --exec sh -c COMMAND` process on it."""
    fake = FakeController(sockdir, takes_output=takes_output)
    proc = _spawn(sockdir, command)
    try:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                await nursery.start(fake.serve)
                await fake.wait_for(lambda: bool(fake.of_type(pb.PULSE_OK)))
                yield fake
                resp, _ = await fake.control(1, RESTART)  # the worker leaves (exit 75)
                assert resp.error == pb.WORKER_ERR_OK
                while proc.poll() is None:
                    await trio.sleep(0.01)
                assert proc.returncode == EXIT_RESTART
                nursery.cancel_scope.cancel()
    finally:
        reap(proc)


async def _job(fake: FakeController, task_id: int, payload: bytes) -> tuple[int, bytes]:
    resp, _ = await fake.control(1, pb.ControlMsg(type=pb.CTRL_SET_TASK, task_id=task_id), payload)
    assert resp.error == pb.WORKER_ERR_OK
    await fake.wait_for(lambda: bool(fake.of_type(pb.PULSE_FETCH_ME)))
    resp, extra = await fake.control(1, FETCH)
    return resp.error, extra


def _types(fake: FakeController) -> list[int]:
    return [p.type for _, p in fake.pulses]


async def test_a_jobs_stderr_reaches_the_controller_before_its_outcome(sockdir: Path) -> None:
    script = "echo one >&2; echo two >&2; cat"
    async with worker_and_fake(sockdir, script, takes_output=True) as fake:
        assert await _job(fake, 7, b"payload") == (pb.WORKER_ERR_OK, b"payload")
        assert b"".join(data for tid, data in fake.outputs if tid == 7) == b"one\ntwo\n"
        assert all(tid == 7 for tid, _ in fake.outputs)
        types = _types(fake)
        last_output = max(i for i, t in enumerate(types) if t == pb.PULSE_OUTPUT)
        assert last_output < types.index(pb.PULSE_FETCH_ME)
        [pulse] = [p for _, p in fake.pulses if p.type == pb.PULSE_OUTPUT][:1]
        assert pulse.worker_id == 1


async def test_an_older_controller_is_sent_no_output(sockdir: Path) -> None:
    script = "echo one >&2; cat"
    async with worker_and_fake(sockdir, script, takes_output=False) as fake:
        assert await _job(fake, 7, b"payload") == (pb.WORKER_ERR_OK, b"payload")
        assert pb.PULSE_OUTPUT not in _types(fake) and fake.outputs == []


async def test_a_flood_of_output_goes_in_chunks_and_the_worker_holds_a_bounded_amount(
    sockdir: Path,
) -> None:
    size = 2 * MiB
    script = f"head -c {size} /dev/zero | tr '\\0' x >&2; echo end >&2; echo done"
    async with worker_and_fake(sockdir, script, takes_output=True) as fake:
        assert await _job(fake, 7, b"") == (pb.WORKER_ERR_OK, b"done\n")
        chunks = [data for _, data in fake.outputs]
        assert all(len(chunk) <= CHUNK for chunk in chunks)
        got = b"".join(chunks)
        assert got.endswith(b"x" * 1000 + b"end\n")
        xs = got.count(b"x")
        assert xs <= size
        # What could not be sent as fast as it came is dropped, and the worker says so.
        assert xs == size or b"bytes of output dropped]" in got
        assert len(got) < size + BUFFER_LIMIT


async def test_output_leaves_while_the_job_runs(sockdir: Path) -> None:
    flag = sockdir / "go"
    script = f"echo one >&2; while [ ! -e {flag} ]; do sleep 0.01; done; echo two >&2; cat"
    async with worker_and_fake(sockdir, script, takes_output=True) as fake:
        resp, _ = await fake.control(1, pb.ControlMsg(type=pb.CTRL_SET_TASK, task_id=7), b"p")
        assert resp.error == pb.WORKER_ERR_OK
        await fake.wait_for(lambda: bool(fake.outputs))
        assert fake.outputs == [(7, b"one\n")]  # the job is still running: it waits for `go`
        flag.touch()
        await fake.wait_for(lambda: bool(fake.of_type(pb.PULSE_FETCH_ME)))
        assert fake.outputs == [(7, b"one\n"), (7, b"two\n")]
        resp, extra = await fake.control(1, FETCH)
        assert (resp.error, extra) == (pb.WORKER_ERR_OK, b"p")

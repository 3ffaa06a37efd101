"""A job submitted `journal_first` (the Redis door's) is handed out when the scheduler decides
it, and what a worker reads on its channel is in that order (commit "A Redis job is handed out
when the scheduler decides it, not when its journal commit lands").

Before that fix the scheduler handed such a job out at once (a worker's next task, or its
running one) but its SET_TASK was written only once the journal commit carrying the job had
landed, while later events wrote at once: a CTRL_DROP (a cancel, a reclaim) or a later SET_TASK
reached the worker before the SET_TASK it came after, and the worker ran a job the controller
had taken back ("FETCH answered task X for task Y").

An in-process controller (controller/app.py `assemble`) with a real journal whose commits the
test holds (`HeldJournal`: the committer's write waits in its thread until let go), and fake
workers on real channels that ask for `takes_next` (`Peer`). Every frame a controller writes
on a channel is in the socket once the event that wrote it is handled (ChannelConn.send writes
at once), so `Peer.available` reads all of them without waiting."""

from __future__ import annotations

import logging
import socket
import subprocess
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from controller import wire
from controller.app import Controller, assemble
from controller.config import Config
from controller.job_ids import DoorName
from controller.job_states import JobState
from controller.jobs import Job
from controller.journal import Journal, Op, Rejected
from gen import worker_protocol_pb2 as pb
from tests.helpers import fake_channel, reap, wait_until, worker_argv

pytestmark = pytest.mark.filterwarnings("ignore::trio.TrioDeprecationWarning")

SET, DROP, RESTART = pb.CTRL_SET_TASK, pb.CTRL_DROP, pb.CTRL_RESTART


class HeldJournal(Journal):
    """A real journal whose commits wait, in the committer's thread, while `hold` is on."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.free = threading.Event()
        self.free.set()
        self.waiting = threading.Event()  # a commit is held

    def write(self, batch: list[Op]) -> list[Rejected]:
        if not self.free.is_set():
            self.waiting.set()
            self.free.wait(timeout=20)  # bounded: a failed test lets go in its teardown
        return super().write(batch)

    def hold(self) -> None:
        self.waiting.clear()
        self.free.clear()

    def let_go(self) -> None:
        self.free.set()

    def settled(self) -> bool:
        """Nothing staged, nothing being written."""
        return not self.dirty and self.committed == self.latest_generation()


@asynccontextmanager
async def journaled_controller(
    sockdir: Path, tmp_path: Path
) -> AsyncIterator[tuple[Controller, HeldJournal]]:
    """The controller's parts with a journal and its committer (no doors: the test submits
    through the desk as the Redis door does)."""
    journal = HeldJournal.open(tmp_path / "journal.sqlite3")
    assert isinstance(journal, HeldJournal)
    journal.load()
    try:
        ctl = assemble(Config(socket_dir=sockdir, journal=journal.path), journal)
        assert ctl.committer is not None
        async with trio.open_nursery() as nursery:
            await nursery.start(ctl.committer.run)
            await nursery.start(ctl.desk.run)
            await nursery.start(ctl.shell.serve)
            try:
                yield ctl, journal
            finally:
                journal.let_go()
                nursery.cancel_scope.cancel()
    finally:
        journal.let_go()
        journal.close()


def redis_job(ctl: Controller, job_id: str) -> Job:
    """A job submitted as the Redis door submits one: `journal_first`."""
    desk = ctl.desk
    now = trio.current_time()
    return desk.submit(
        job_id,
        DoorName.REDIS,
        f"{job_id}-0",
        desk.book.pick_task_id(),
        b"",
        now,
        journal_first=True,
    )


def http_job(ctl: Controller, job_id: str) -> Job:
    """A job submitted without `journal_first` (handed out at once)."""
    desk = ctl.desk
    now = trio.current_time()
    return desk.submit(job_id, DoorName.HTTP, None, desk.book.pick_task_id(), b"", now)


async def held_commit(journal: HeldJournal) -> None:
    """Wait until the committer is holding a commit (what was staged before is not on disk)."""
    await wait_until(journal.waiting.is_set)
    assert journal.committed < journal.latest_generation()


async def released(ctl: Controller, journal: HeldJournal) -> None:
    """Let the held commit go; return once everything staged is on disk and every action that
    waited for it has run."""
    journal.let_go()
    await wait_until(lambda: journal.settled() and len(ctl.desk.write_ahead) == 0)


class Peer:
    """A fake worker on a channel that asked for `takes_next`, over a real Unix socket: it reads
    what the controller writes and answers only what the test tells it to."""

    def __init__(self, wid: int, sock: socket.socket) -> None:
        self.wid = wid
        self.sock = sock
        self._decoder = wire.StreamDecoder(pb.ChannelFrame)
        self.read: list[tuple[int, int]] = []  # every control read so far: (type, task id)

    @classmethod
    async def open(cls, sockdir: Path) -> Peer:
        wid, chan = await fake_channel(sockdir, takes_next=True)
        return cls(wid, chan)

    def available(self) -> list[tuple[int, int]]:
        """The controls written to it that it has not read yet (all of them: none is on its
        way), each (type, task id)."""
        frames: list[pb.ChannelFrame] = []
        while True:
            try:
                data = self.sock.recv(65536)
            except BlockingIOError:
                break
            assert data, "the channel ended"
            frames += [frame for frame, _ in self._decoder.feed(data)]
        assert all(f.WhichOneof("msg") == "control" for f in frames), frames
        got = [(int(f.control.type), f.control.task_id) for f in frames]
        self.read += got
        return got

    async def next_controls(self, count: int) -> list[tuple[int, int]]:
        """The next `count` controls (waiting for them, bounded)."""
        got: list[tuple[int, int]] = []
        with trio.fail_after(5):
            while len(got) < count:
                more = self.available()
                if not more:
                    await trio.lowlevel.wait_readable(self.sock)
                got += more
        return got

    def outcome(self, task_id: int, result: bytes) -> None:
        response = pb.WorkerResponse(error=pb.WORKER_ERR_OK, task_id=task_id)
        self.sock.sendall(
            wire.encode_channel(wire.CHANNEL_RESPONSE, response, result, pb.CTRL_FETCH)
        )


def out_of_order(read: list[tuple[int, int]]) -> list[str]:
    """What a worker reading `read` in this order could not make sense of: a CTRL_DROP of a
    task it was not handed before, a SET_TASK of a task it was told to drop, or a task handed
    twice."""
    problems = []
    handed: set[int] = set()
    dropped: set[int] = set()
    for kind, task_id in read:
        if kind == SET:
            if task_id in dropped:
                problems.append(f"SET_TASK {task_id} after its CTRL_DROP")
            elif task_id in handed:
                problems.append(f"SET_TASK {task_id} twice")
            handed.add(task_id)
        elif kind == DROP:
            if task_id not in handed:
                problems.append(f"CTRL_DROP {task_id} before its SET_TASK")
            dropped.add(task_id)
    return problems


async def held_behind_a_running_job(
    ctl: Controller, journal: HeldJournal, peer: Peer, name: str
) -> tuple[Job, Job]:
    """The worker `peer` runs the Redis job "first" (handed out once on disk); then the Redis job
    `name` comes while the journal holds its commit (its job_added is in the held commit):
    (first, that job)."""
    core = ctl.shell.core
    await wait_until(lambda: core.idle_workers == 1)
    first = redis_job(ctl, "first")
    assert await peer.next_controls(1) == [(SET, first.task_id)]  # once on disk
    await wait_until(journal.settled)
    journal.hold()
    later = redis_job(ctl, name)
    await held_commit(journal)
    return first, later


def fetch_mismatches(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "answered task" in r.getMessage()]


async def test_a_job_canceled_before_its_commit_lands_never_reaches_the_worker(
    sockdir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker runs a job; a Redis job comes while the journal commit is held, and is canceled
    before the commit lands. The worker reads nothing about it: no CTRL_DROP of a task it was
    never handed, no SET_TASK of a canceled job after the commit (before the fix: DROP, then
    SET_TASK, then a RESTART when the job before ended)."""
    caplog.set_level(logging.WARNING)
    async with journaled_controller(sockdir, tmp_path) as (ctl, journal):
        core = ctl.shell.core
        peer = await Peer.open(sockdir)
        with peer.sock:
            first, canceled = await held_behind_a_running_job(ctl, journal, peer, "canceled")
            worker = core.workers[peer.wid]
            canceled_task = canceled.task
            assert canceled_task is not None
            assert ctl.desk.cancel(canceled, trio.current_time())
            assert canceled.state is JobState.CANCELED
            assert out_of_order(peer.available()) == []
            await released(ctl, journal)
            # The commit that carried the canceled job has landed: nothing of it is written.
            assert peer.available() == []
            peer.outcome(first.task_id, b"r1")
            await wait_until(lambda: first.state.final)
            last = redis_job(ctl, "last")
            assert await peer.next_controls(1) == [(SET, last.task_id)]
            peer.outcome(last.task_id, b"r3")
            await wait_until(lambda: last.state.final)
            assert peer.available() == []
            assert peer.read == [(SET, first.task_id), (SET, last.task_id)]
            assert core.workers.get(peer.wid) is worker
        assert [first.result, last.result] == [b"r1", b"r3"]
        assert canceled.result == b"" and canceled_task.attempts == 0
        assert core.counters.restarts_sent == 0
        assert core.counters.worker_losses == {}
    assert fetch_mismatches(caplog) == []


async def test_a_job_reclaimed_before_its_commit_lands_goes_to_the_idle_worker_only(
    sockdir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker runs a job; a Redis job comes while the journal commit is held; then a second
    worker comes, idle. The first worker never reads a CTRL_DROP for a task it was not handed,
    nor that task after the commit; the job runs once (before the fix: a reclaim's DROP reached
    the first worker before its SET_TASK, which came after the commit)."""
    caplog.set_level(logging.WARNING)
    async with journaled_controller(sockdir, tmp_path) as (ctl, journal):
        core = ctl.shell.core
        busy = await Peer.open(sockdir)
        with busy.sock:
            first, second = await held_behind_a_running_job(ctl, journal, busy, "second")
            second_task = second.task
            assert second_task is not None
            idle = await Peer.open(sockdir)
            with idle.sock:
                await wait_until(lambda: idle.wid in core.workers)
                worker = core.workers[idle.wid]
                held = core.workers[busy.wid]
                await wait_until(lambda: worker.task is not None or held.reclaiming)
                assert out_of_order(busy.available()) == []
                await released(ctl, journal)
                assert out_of_order(busy.read) == []
                assert busy.available() == []
                assert busy.read == [(SET, first.task_id)]
                # The scheduler decided it for the idle worker: its SET_TASK, at once.
                assert idle.available() == [(SET, second.task_id)]
                idle.outcome(second.task_id, b"r2")
                busy.outcome(first.task_id, b"r1")
                await wait_until(lambda: first.state.final and second.state.final)
                assert busy.available() == [] and idle.available() == []
        assert [first.result, second.result] == [b"r1", b"r2"]
        assert second_task.attempts == 1
        assert core.counters.restarts_sent == 0
        assert core.counters.worker_losses == {}
    assert fetch_mismatches(caplog) == []


async def test_a_later_set_task_does_not_overtake_one_waiting_for_its_commit(
    sockdir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker runs a job; a Redis job comes while the journal commit is held, the running job
    ends (the worker is free: the Redis job is its task) and an HTTP job comes (its next task,
    handed out at once). The worker reads the Redis job's SET_TASK first (before the fix: the
    HTTP job's, then the Redis job's after the commit, as if it were the next one)."""
    caplog.set_level(logging.WARNING)
    async with journaled_controller(sockdir, tmp_path) as (ctl, journal):
        core = ctl.shell.core
        peer = await Peer.open(sockdir)
        with peer.sock:
            first, second = await held_behind_a_running_job(ctl, journal, peer, "second")
            worker = core.workers[peer.wid]
            peer.outcome(first.task_id, b"r1")
            await wait_until(lambda: first.state.final)
            third = http_job(ctl, "third")
            assert out_of_order(peer.available()) == []
            await released(ctl, journal)
            peer.available()
            assert peer.read == [(SET, t.task_id) for t in (first, second, third)]
            assert worker.task is second.task and worker.next is third.task
            peer.outcome(second.task_id, b"r2")
            peer.outcome(third.task_id, b"r3")
            await wait_until(lambda: second.state.final and third.state.final)
            assert peer.available() == []
        assert [first.result, second.result, third.result] == [b"r1", b"r2", b"r3"]
        assert core.counters.restarts_sent == 0
        assert core.counters.worker_losses == {}
    assert fetch_mismatches(caplog) == []


def _gated_script(tmp: Path) -> str:
    """Notes its run (TASK_ID), then waits (at most 15 s) for go-TASK_ID or go-all in `tmp`."""
    return (
        f'echo "$TASK_ID" >> {tmp}/ran; i=0; '
        f'while [ ! -e {tmp}/go-$TASK_ID ] && [ ! -e {tmp}/go-all ] && [ "$i" -lt 300 ]; '
        'do sleep 0.05; i=$((i+1)); done; echo "r$TASK_ID"'
    )


def spawn(argv: list[str]) -> subprocess.Popen[bytes]:
    """A real worker process (the test reaps it by its pid)."""
    return subprocess.Popen(argv)


def ran(tmp: Path) -> list[int]:
    path = tmp / "ran"
    return [int(line) for line in path.read_text().split()] if path.exists() else []


async def test_a_real_worker_never_runs_a_job_canceled_before_its_commit_lands(
    sockdir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The cancel case with a real worker process (it takes next tasks): the canceled Redis job
    never runs, the worker is never restarted, and every other job runs once (before the fix
    it started the canceled job after the one before, and was restarted for it)."""
    caplog.set_level(logging.WARNING)
    proc = spawn(worker_argv(sockdir, "--exec", "sh", "-c", _gated_script(tmp_path)))
    try:
        async with journaled_controller(sockdir, tmp_path) as (ctl, journal):
            core = ctl.shell.core
            await wait_until(lambda: core.idle_workers == 1)
            [worker] = core.workers.values()
            assert worker.takes_next and worker.pid == proc.pid
            first = redis_job(ctl, "first")
            await wait_until(lambda: ran(tmp_path) == [first.task_id])
            await wait_until(journal.settled)
            journal.hold()
            canceled = redis_job(ctl, "canceled")
            await held_commit(journal)
            assert ctl.desk.cancel(canceled, trio.current_time())
            await released(ctl, journal)
            (tmp_path / f"go-{first.task_id}").touch()
            await wait_until(lambda: first.state.final)
            # The worker's outcome did not cross a DROP it never answered: no RESTART.
            assert core.counters.restarts_sent == 0
            assert core.workers.get(worker.worker_id) is worker
            last = redis_job(ctl, "last")
            (tmp_path / f"go-{last.task_id}").touch()
            await wait_until(lambda: last.state.final)
            assert [first.result, last.result] == [
                b"r%d\n" % first.task_id,
                b"r%d\n" % last.task_id,
            ]
            assert canceled.state is JobState.CANCELED
            assert ran(tmp_path) == [first.task_id, last.task_id]
            assert core.counters.restarts_sent == 0
            assert core.counters.worker_losses == {}
            assert core.workers.get(worker.worker_id) is worker
            assert proc.poll() is None
    finally:
        (tmp_path / "go-all").touch()  # a job still running there ends (its worker is killed)
        reap(proc)
    assert fetch_mismatches(caplog) == []

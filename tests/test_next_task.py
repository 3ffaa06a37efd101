"""A next task on the worker channel (DESIGN.md section 16; commit "Local workers take a next
task on their channel"): real workers on an in-process controller, and hostile channel peers
that ask for `takes_next` and then misbehave.

A held next task is ASSIGNING (its job "requested") and counts no attempt until the task before
it ends there (controller/core/next_tasks.py); it is taken back with CTRL_DROP when canceled,
when an idle worker could take it (a reclaim), or when its placement timeout passes.

The real workers run `--exec sh -c SCRIPT`: each run appends "TASK_ID WORKER_PID" to a log in
the test's temp dir (so a test counts runs and sees where each ran), and a gated job waits
for `go-TASK_ID` or `go-all` there (bounded), so the test decides when it ends."""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from controller import wire
from controller.core import Action, TaskFinished, TaskState
from controller.core.model import Task, Worker
from controller.job_states import JobState
from controller.jobs import live_state
from controller.options import JobOptions
from controller.shell.core_shell import CoreShell
from gen import worker_protocol_pb2 as pb
from tests.helpers import fake_channel, reap, recv_all, running_controller, wait_until, worker_argv

pytestmark = pytest.mark.filterwarnings("ignore::trio.TrioDeprecationWarning")

# ---------------------------------------------------------------- real workers


def _gated_script(tmp: Path) -> str:
    """Notes its run, then waits (at most 15 s) for go-TASK_ID or go-all in `tmp`."""
    return (
        f'echo "$TASK_ID $PPID" >> {tmp}/ran; i=0; '
        f'while [ ! -e {tmp}/go-$TASK_ID ] && [ ! -e {tmp}/go-all ] && [ "$i" -lt 300 ]; '
        'do sleep 0.05; i=$((i+1)); done; echo "r$TASK_ID"'
    )


def _sleepy_script(tmp: Path) -> str:
    """Notes its run, sleeps a little, answers."""
    return f'echo "$TASK_ID $PPID" >> {tmp}/ran; sleep 0.05; echo "r$TASK_ID"'


def ran(tmp: Path) -> list[tuple[int, int]]:
    """(task id, worker pid) of each run so far, in order."""
    path = tmp / "ran"
    if not path.exists():
        return []
    lines = path.read_text().split("\n")
    return [(int(t), int(p)) for t, p in (line.split() for line in lines if line.strip())]


def runs(tmp: Path) -> collections.Counter[int]:
    return collections.Counter(task_id for task_id, _ in ran(tmp))


class Workers:
    """Real worker processes this test started; each killed and reaped by its pid."""

    def __init__(self, sockdir: Path) -> None:
        self.sockdir = sockdir
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, *args: str, log: Path | None = None) -> subprocess.Popen[bytes]:
        level = "INFO" if log is not None else "WARNING"
        argv = worker_argv(self.sockdir, *args, log_level=level)
        if log is None:
            proc = subprocess.Popen(argv)
        else:
            with log.open("ab") as sink:
                proc = subprocess.Popen(argv, stderr=sink)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            reap(proc)


@contextlib.contextmanager
def workers(sockdir: Path) -> Iterator[Workers]:
    group = Workers(sockdir)
    try:
        yield group
    finally:
        group.close()


def worker_of(shell: CoreShell, proc: subprocess.Popen[bytes]) -> Worker:
    [worker] = [w for w in shell.core.workers.values() if w.pid == proc.pid]
    return worker


def cancel(shell: CoreShell, task: Task) -> None:
    actions: list[Action] = []
    assert shell.core.scheduler.cancel(task.ref, trio.current_time(), actions)
    shell.execute(actions)


async def watch_next(shell: CoreShell, seen: set[tuple[int, int]]) -> None:
    """Note every (worker id, next task id) the core's worker records hold, until cancelled."""
    while True:
        for worker in shell.core.workers.values():
            if worker.next is not None:
                seen.add((worker.worker_id, worker.next.task_id))
        await trio.sleep(0.002)


def finished_once(items: list[TaskFinished], task_ids: range | list[int]) -> dict[int, bytes]:
    """Each task in `task_ids` finished exactly once, in success: its result, by task id."""
    counts = collections.Counter(f.task_id for f in items)
    assert counts == collections.Counter(task_ids), counts
    assert all(f.state is TaskState.SUCCESS for f in items), items
    return {f.task_id: f.result for f in items}


# ---------------------------------------------------------------- steady state


async def test_channel_workers_hold_a_next_task_and_every_job_runs_once(sockdir, tmp_path):
    """More jobs than workers: each worker holds a next task while one runs, and every job
    succeeds once, with one attempt."""
    jobs = range(1, 13)
    with workers(sockdir) as group:
        for _ in range(2):
            group.spawn("--exec", "sh", "-c", _sleepy_script(tmp_path))
        async with running_controller(sockdir) as (shell, outcomes):
            await wait_until(lambda: shell.core.idle_workers == 2)
            assert all(w.takes_next for w in shell.core.workers.values())
            seen: set[tuple[int, int]] = set()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch_next, shell, seen)
                tasks = [shell.submit(i, b"") for i in jobs]
                # Both were busy with a job and more were pending: each got a next one, held
                # (requested, no attempt yet) until the one before it ends.
                nexts = [w.next for w in shell.core.workers.values()]
                assert all(t is not None and t.state is TaskState.ASSIGNING for t in nexts)
                assert all(live_state(t.state) is JobState.REQUESTED for t in nexts if t)
                assert all(t is not None and t.attempts == 0 for t in nexts)
                done = await outcomes.wait(len(jobs), timeout=30)
                nursery.cancel_scope.cancel()
            results = finished_once(done, jobs)
            assert results == {i: b"r%d\n" % i for i in jobs}
            assert runs(tmp_path) == collections.Counter(jobs)
            assert all(t.attempts == 1 for t in tasks)
            assert {wid for wid, _ in seen} == set(shell.core.workers)
            assert shell.core.counters.worker_losses == {}


async def test_one_task_and_seed_protocol_workers_never_hold_a_next_task(sockdir, tmp_path):
    jobs = range(1, 13)
    with workers(sockdir) as group:
        script = _sleepy_script(tmp_path)
        group.spawn("--one-task", "--exec", "sh", "-c", script)
        group.spawn("--seed-protocol", "--exec", "sh", "-c", script)
        async with running_controller(sockdir) as (shell, outcomes):
            await wait_until(lambda: shell.core.idle_workers == 2)
            assert len(shell.links.channels) == 1  # the --one-task one
            assert not any(w.takes_next or w.next_granted for w in shell.core.workers.values())
            seen: set[tuple[int, int]] = set()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch_next, shell, seen)
                for i in jobs:
                    shell.submit(i, b"")
                assert all(w.next is None for w in shell.core.workers.values())
                done = await outcomes.wait(len(jobs), timeout=30)
                nursery.cancel_scope.cancel()
            assert seen == set()
            finished_once(done, jobs)
            assert runs(tmp_path) == collections.Counter(jobs)
            assert all(w.done > 0 for w in shell.core.workers.values())


async def test_no_next_task_while_a_worker_is_idle(sockdir, tmp_path):
    """Two workers, two long jobs: each runs on its own worker, none is handed ahead; a third
    submitted while both run goes to one's next."""
    with workers(sockdir) as group:
        for _ in range(2):
            group.spawn("--exec", "sh", "-c", _gated_script(tmp_path))
        async with running_controller(sockdir) as (shell, outcomes):
            await wait_until(lambda: shell.core.idle_workers == 2)
            first = shell.submit(1, b"")
            assert all(w.next is None for w in shell.core.workers.values())
            second = shell.submit(2, b"")
            assert all(w.next is None for w in shell.core.workers.values())
            assert {first.worker_id, second.worker_id} == set(shell.core.workers)
            await wait_until(lambda: len(ran(tmp_path)) == 2)
            assert all(w.next is None for w in shell.core.workers.values())
            third = shell.submit(3, b"")
            holders = [w for w in shell.core.workers.values() if w.next is third]
            assert len(holders) == 1 and holders[0].task in (first, second)
            assert third.state is TaskState.ASSIGNING and third.attempts == 0
            holder = holders[0]
            assert holder.task is not None
            # Only the holder's job ends (the other worker stays busy: nothing reclaims it).
            (tmp_path / f"go-{holder.task.task_id}").touch()
            await wait_until(lambda: len(ran(tmp_path)) == 3)
            assert dict(ran(tmp_path))[3] == holder.pid  # it ran where it was held
            (tmp_path / "go-all").touch()
            done = await outcomes.wait(3, timeout=20)
            finished_once(done, [1, 2, 3])
            assert runs(tmp_path) == collections.Counter([1, 2, 3])
            assert third.attempts == 1


# ---------------------------------------------------------------- cancel, death, drain


async def test_a_canceled_next_task_is_dropped_and_never_runs(sockdir, tmp_path):
    with workers(sockdir) as group:
        proc = group.spawn("--exec", "sh", "-c", _gated_script(tmp_path))
        async with running_controller(sockdir) as (shell, outcomes):
            await wait_until(lambda: shell.core.idle_workers == 1)
            worker = worker_of(shell, proc)
            first = shell.submit(1, b"")
            second = shell.submit(2, b"")
            assert worker.task is first and worker.next is second
            assert live_state(second.state) is JobState.REQUESTED and second.attempts == 0
            await wait_until(lambda: ran(tmp_path) == [(1, proc.pid)])
            cancel(shell, second)
            assert second.state is TaskState.CANCELED and worker.dropping == 2
            # The worker answers CTRL_DROP: it forgot the task.
            await wait_until(lambda: worker.dropping == 0)
            (tmp_path / "go-1").touch()
            (tmp_path / "go-2").touch()  # had it started, it would end at once
            await outcomes.wait(2)
            # Had the worker kept task 2, it would run it before task 3.
            shell.submit(3, b"")
            (tmp_path / "go-3").touch()
            done = await outcomes.wait(3)
            assert [(f.task_id, f.state) for f in done] == [
                (2, TaskState.CANCELED),
                (1, TaskState.SUCCESS),
                (3, TaskState.SUCCESS),
            ]
            assert ran(tmp_path) == [(1, proc.pid), (3, proc.pid)]
            assert shell.core.workers.get(worker.worker_id) is worker
            assert shell.core.counters.restarts_sent == 0
            assert shell.core.counters.worker_losses == {}
            assert proc.poll() is None


async def test_a_killed_worker_s_running_and_next_tasks_run_once_elsewhere(sockdir, tmp_path):
    """SIGKILL while it runs one job and holds another: the held one goes back with no
    attempt (none was counted while held); both run on a worker that comes later, once each."""
    script = _gated_script(tmp_path)
    with workers(sockdir) as group:
        doomed = group.spawn("--exec", "sh", "-c", script)
        async with running_controller(sockdir) as (shell, outcomes):
            await wait_until(lambda: shell.core.idle_workers == 1)
            worker = worker_of(shell, doomed)
            first = shell.submit(1, b"")
            second = shell.submit(2, b"")
            assert worker.task is first and worker.next is second
            await wait_until(lambda: ran(tmp_path) == [(1, doomed.pid)])
            os.kill(doomed.pid, signal.SIGKILL)
            await wait_until(lambda: worker.worker_id not in shell.core.workers)
            assert second.state is TaskState.QUEUED and second.attempts == 0
            assert first.attempts == 1
            (tmp_path / "go-all").touch()
            other = group.spawn("--exec", "sh", "-c", script)
            done = await outcomes.wait(2, timeout=20)
            assert finished_once(done, [1, 2]) == {1: b"r1\n", 2: b"r2\n"}
            assert sorted(ran(tmp_path)) == [(1, doomed.pid), (1, other.pid), (2, other.pid)]
            assert (first.attempts, second.attempts) == (2, 1)


async def test_a_draining_worker_refuses_its_next_task_at_once(sockdir, tmp_path):
    """SIGTERM while it runs a gated job and holds another: the held one goes back at once
    (while the running job still runs), with no attempt used, so a job allowed no retry runs
    (once) on another worker; the drained worker finishes its job and leaves."""
    script = _gated_script(tmp_path)
    log = tmp_path / "drained.log"
    with workers(sockdir) as group:
        drained = group.spawn("--exec", "sh", "-c", script, log=log)
        async with running_controller(sockdir) as (shell, outcomes):
            await wait_until(lambda: shell.core.idle_workers == 1)
            worker = worker_of(shell, drained)
            first = shell.submit(1, b"")
            second = shell.submit(2, b"", options=JobOptions(max_retries=0))
            assert worker.task is first and worker.next is second
            await wait_until(lambda: ran(tmp_path) == [(1, drained.pid)])
            drained.send_signal(signal.SIGTERM)
            # Refused at once: no other worker exists to reclaim it, job 1 still runs.
            await wait_until(lambda: second.state is TaskState.QUEUED)
            assert second.attempts == 0 and worker.next is None and not worker.takes_next
            assert worker.task is first and first.state is TaskState.RUNNING
            other = group.spawn("--exec", "sh", "-c", script)
            await wait_until(lambda: second.state is TaskState.RUNNING)
            (tmp_path / "go-2").touch()
            done = await outcomes.wait(1, timeout=20)
            assert [(f.task_id, f.state) for f in done] == [(2, TaskState.SUCCESS)]
            assert ran(tmp_path) == [(1, drained.pid), (2, other.pid)]
            assert drained.poll() is None and first.state is TaskState.RUNNING
            (tmp_path / "go-1").touch()  # only now does the drained worker's job end
            done = await outcomes.wait(2, timeout=20)
            assert finished_once(done, [2, 1]) == {1: b"r1\n", 2: b"r2\n"}
            await wait_until(lambda: drained.poll() is not None, timeout=10)
            assert drained.returncode == 0
            assert worker.worker_id not in shell.core.workers
            assert shell.core.counters.worker_losses == {}
            assert (first.attempts, second.attempts) == (1, 1)
            assert runs(tmp_path) == collections.Counter([1, 2])


async def test_a_task_written_to_a_worker_that_is_leaving_goes_back_with_no_attempt(
    sockdir, tmp_path
):
    """A draining worker's last outcome and its SHUTDOWN leave together; the controller, reading
    the outcome first, writes the worker a pending task that it never reads. That task goes
    back with no attempt used, so a job allowed no retry still runs (once) elsewhere."""
    script = _gated_script(tmp_path)
    with workers(sockdir) as group:
        leaving = group.spawn("--exec", "sh", "-c", script)
        async with running_controller(sockdir) as (shell, outcomes):
            await wait_until(lambda: shell.core.idle_workers == 1)
            worker = worker_of(shell, leaving)
            staying = group.spawn("--exec", "sh", "-c", script)
            await wait_until(lambda: shell.core.idle_workers == 2)
            tasks = [shell.submit(i, b"", options=JobOptions(max_retries=0)) for i in range(1, 6)]
            await wait_until(lambda: len(ran(tmp_path)) == 2)
            mine = worker.task
            assert mine is not None and worker.next is not None
            leaving.send_signal(signal.SIGTERM)
            await wait_until(lambda: worker.next is None and not worker.takes_next)
            (tmp_path / f"go-{mine.task_id}").touch()  # its outcome, then its SHUTDOWN
            await wait_until(lambda: leaving.poll() is not None, timeout=10)
            await wait_until(lambda: worker.worker_id not in shell.core.workers)
            (tmp_path / "go-all").touch()
            done = await outcomes.wait(5, timeout=30)
            assert finished_once(done, range(1, 6))
            assert [t.attempts for t in tasks] == [1] * 5
            assert runs(tmp_path) == collections.Counter(range(1, 6))
            assert {pid for _, pid in ran(tmp_path)} == {leaving.pid, staying.pid}


# ---------------------------------------------------------------- reclaim, placement timeout


async def test_a_held_task_is_reclaimed_for_a_worker_that_became_idle(sockdir, tmp_path):
    """Worker A runs a long job and holds X; worker B's job ends and nothing is pending: X is
    taken back from A (CTRL_DROP, answered) and runs on B, once; A is not restarted."""
    script = _gated_script(tmp_path)
    with workers(sockdir) as group:
        procs = [group.spawn("--exec", "sh", "-c", script) for _ in range(2)]
        async with running_controller(sockdir) as (shell, outcomes):
            await wait_until(lambda: shell.core.idle_workers == 2)
            shell.submit(1, b"")
            shell.submit(2, b"")
            await wait_until(lambda: len(ran(tmp_path)) == 2)
            x = shell.submit(3, b"")
            [a] = [w for w in shell.core.workers.values() if w.next is x]
            [b] = [w for w in shell.core.workers.values() if w is not a]
            assert a.task is not None and b.task is not None
            a_job, b_job = a.task, b.task
            assert x.state is TaskState.ASSIGNING and x.attempts == 0
            (tmp_path / f"go-{b_job.task_id}").touch()
            # B idle, nothing pending: X is reclaimed from A and runs on B.
            await wait_until(lambda: (3, b.pid) in ran(tmp_path))
            assert a.next is None and not a.reclaiming and a.dropping == 0
            assert a.task is a_job and a_job.state is TaskState.RUNNING
            assert x.worker_id == b.worker_id and x.attempts == 1
            assert a.takes_next  # still handed next tasks
            (tmp_path / "go-all").touch()
            done = await outcomes.wait(3, timeout=20)
            finished_once(done, [1, 2, 3])
            # Had A kept X, it would start it once its job ended, before anything else.
            await wait_until(lambda: shell.core.idle_workers == 2)
            shell.submit(4, b"")
            shell.submit(5, b"")
            done = await outcomes.wait(5, timeout=20)
            finished_once(done, [1, 2, 3, 4, 5])
            assert runs(tmp_path) == collections.Counter([1, 2, 3, 4, 5])
            assert {pid for tid, pid in ran(tmp_path) if tid in (4, 5)} == {a.pid, b.pid}
            assert shell.core.counters.restarts_sent == 0
            assert shell.core.counters.worker_losses == {}
            assert shell.core.workers.get(a.worker_id) is a
            assert all(proc.poll() is None for proc in procs)


async def test_a_held_task_past_its_placement_timeout_fails_and_never_runs(sockdir, tmp_path):
    """A task held behind a long job fails with reason placement when its placement timeout
    passes; the running job is unaffected and the worker is not restarted."""
    with workers(sockdir) as group:
        proc = group.spawn("--exec", "sh", "-c", _gated_script(tmp_path))
        async with running_controller(sockdir) as (shell, outcomes):
            await wait_until(lambda: shell.core.idle_workers == 1)
            worker = worker_of(shell, proc)
            first = shell.submit(1, b"")
            x = shell.submit(2, b"", options=JobOptions(placement_timeout=0.5))
            assert worker.task is first and worker.next is x
            assert x.state is TaskState.ASSIGNING
            await wait_until(lambda: ran(tmp_path) == [(1, proc.pid)])
            done = await outcomes.wait(1, timeout=4)  # 0.5 s, and time to spare
            [failed] = done
            assert (failed.task_id, failed.state, failed.reason) == (
                2,
                TaskState.FAILED_POST,
                "placement",
            )
            assert "no free worker within 0.5 s" in failed.error
            assert x.attempts == 0 and worker.next is None and worker.dropping == 0
            assert worker.task is first and first.state is TaskState.RUNNING
            assert ran(tmp_path) == [(1, proc.pid)]
            (tmp_path / "go-1").touch()
            (tmp_path / "go-2").touch()  # had it started, it would end at once
            # Had the worker kept task 2, it would run it before task 3.
            shell.submit(3, b"")
            (tmp_path / "go-3").touch()
            done = await outcomes.wait(3, timeout=20)
            assert [(f.task_id, f.state) for f in done] == [
                (2, TaskState.FAILED_POST),
                (1, TaskState.SUCCESS),
                (3, TaskState.SUCCESS),
            ]
            assert ran(tmp_path) == [(1, proc.pid), (3, proc.pid)]
            assert shell.core.workers.get(worker.worker_id) is worker
            assert shell.core.counters.restarts_sent == 0
            assert shell.core.counters.worker_losses == {}
            assert proc.poll() is None


# ---------------------------------------------------------------- hostile channel peers


class Peer:
    """A fake worker on a channel that asked for `takes_next`, over a real Unix socket."""

    def __init__(self, wid: int, sock: socket.socket) -> None:
        self.wid = wid
        self.sock = sock
        self._decoder = wire.StreamDecoder(pb.ChannelFrame)
        self._got: list[pb.ChannelFrame] = []

    @classmethod
    async def open(cls, sockdir: Path) -> Peer:
        wid, chan = await fake_channel(sockdir, takes_next=True)
        return cls(wid, chan)

    async def frames(self, count: int) -> list[pb.ChannelFrame]:
        """The next `count` frames the controller writes."""
        with trio.fail_after(5):
            while len(self._got) < count:
                try:
                    data = self.sock.recv(65536)
                except BlockingIOError:
                    await trio.lowlevel.wait_readable(self.sock)
                    continue
                assert data, "the channel ended"
                self._got += [frame for frame, _ in self._decoder.feed(data)]
        got, self._got = self._got[:count], self._got[count:]
        return got

    async def controls(self, count: int) -> list[tuple[int, int]]:
        """The next `count` control messages: (type, task id) each."""
        frames = await self.frames(count)
        assert all(f.WhichOneof("msg") == "control" for f in frames), frames
        return [(f.control.type, f.control.task_id) for f in frames]

    def answer(self, error: int, task_id: int, answers: int, extra: bytes = b"") -> None:
        response = pb.WorkerResponse(error=error, task_id=task_id)
        self.sock.sendall(wire.encode_channel(wire.CHANNEL_RESPONSE, response, extra, answers))

    def outcome(self, task_id: int, result: bytes) -> None:
        self.answer(pb.WORKER_ERR_OK, task_id, pb.CTRL_FETCH, result)

    def quiet(self) -> bool:
        """Nothing written to it that it has not read."""
        if self._got:
            return False
        try:
            return not self.sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return True


SET, DROP = pb.CTRL_SET_TASK, pb.CTRL_DROP


async def test_a_peer_that_refuses_its_next_task_keeps_its_job_and_gets_no_more(sockdir, tmp_path):
    with workers(sockdir) as group:
        async with running_controller(sockdir) as (shell, outcomes):
            peer = await Peer.open(sockdir)
            with peer.sock:
                await wait_until(lambda: shell.core.idle_workers == 1)
                worker = shell.core.workers[peer.wid]
                assert worker.takes_next
                first = shell.submit(1, b"one")
                second = shell.submit(2, b"two")
                assert worker.next is second
                assert await peer.controls(2) == [(SET, 1), (SET, 2)]
                peer.answer(pb.WORKER_ERR_BUSY, 2, SET)
                await wait_until(lambda: second.state is TaskState.QUEUED)
                assert worker.next is None and worker.task is first and not worker.takes_next
                # The task runs elsewhere (a worker that takes no next task: the third job
                # has nowhere to go while both run).
                other = group.spawn("--one-task", "--exec", "sh", "-c", _gated_script(tmp_path))
                await wait_until(lambda: second.state is TaskState.RUNNING)
                assert second.worker_id == worker_of(shell, other).worker_id
                third = shell.submit(3, b"three")
                assert third.state is TaskState.QUEUED and worker.next is None
                assert peer.quiet()
                peer.outcome(1, b"r1")
                assert await peer.controls(1) == [(SET, 3)]  # a plain task: it is idle
                assert worker.task is third and worker.next is None
                peer.outcome(3, b"r3")
                (tmp_path / "go-all").touch()
                done = await outcomes.wait(3, timeout=20)
                results = finished_once(done, [1, 2, 3])
                assert results == {1: b"r1", 2: b"r2\n", 3: b"r3"}
                assert ran(tmp_path) == [(2, other.pid)]
                assert shell.core.workers.get(peer.wid) is worker
                assert shell.core.counters.worker_losses == {}
                assert (first.attempts, third.attempts) == (1, 1)


async def test_a_refused_next_task_uses_no_attempt(sockdir):
    async with running_controller(sockdir) as (shell, _outcomes):
        peer = await Peer.open(sockdir)
        with peer.sock:
            await wait_until(lambda: shell.core.idle_workers == 1)
            shell.submit(1, b"one")
            second = shell.submit(2, b"two")
            assert await peer.controls(2) == [(SET, 1), (SET, 2)]
            peer.answer(pb.WORKER_ERR_BUSY, 2, SET)
            await wait_until(lambda: second.state is TaskState.QUEUED)
            assert second.attempts == 0


async def test_drop_answers_nobody_asked_for_are_ignored(sockdir):
    async with running_controller(sockdir) as (shell, outcomes):
        peer = await Peer.open(sockdir)
        with peer.sock:
            await wait_until(lambda: shell.core.idle_workers == 1)
            worker = shell.core.workers[peer.wid]
            first = shell.submit(1, b"one")
            second = shell.submit(2, b"two")
            assert await peer.controls(2) == [(SET, 1), (SET, 2)]
            # DROP answers for a task never heard of, its held next task, its running task,
            # and a refusal of nothing: none was asked.
            peer.answer(pb.WORKER_ERR_OK, 999, DROP)
            peer.answer(pb.WORKER_ERR_OK, 2, DROP)
            peer.answer(pb.WORKER_ERR_OK, 1, DROP)
            peer.answer(pb.WORKER_ERR_BUSY, 0, DROP)
            peer.answer(pb.WORKER_ERR_FAILED, 2, DROP)
            peer.outcome(1, b"r1")  # read after them: once it counts, they were read
            await wait_until(lambda: first.state is TaskState.SUCCESS)
            assert worker.task is second and worker.dropping == 0 and worker.takes_next
            third = shell.submit(3, b"three")
            assert worker.next is third  # still handed a next task
            assert await peer.controls(1) == [(SET, 3)]
            peer.answer(pb.WORKER_ERR_OK, 3, DROP)
            peer.outcome(2, b"r2")
            await wait_until(lambda: second.state is TaskState.SUCCESS)
            assert worker.task is third
            peer.outcome(3, b"r3")
            done = await outcomes.wait(3)
            assert finished_once(done, [1, 2, 3]) == {1: b"r1", 2: b"r2", 3: b"r3"}
            assert peer.quiet()  # no DROP, no RESTART, no GET_STATUS
            assert shell.core.workers.get(peer.wid) is worker
            assert shell.core.counters.worker_losses == {}
            assert shell.core.counters.restarts_sent == 0
            assert [t.attempts for t in (first, second, third)] == [1, 1, 1]


async def test_a_peer_that_ignores_drop_and_runs_the_canceled_task_is_restarted(sockdir):
    async with running_controller(sockdir) as (shell, outcomes):
        peer = await Peer.open(sockdir)
        with peer.sock:
            await wait_until(lambda: shell.core.idle_workers == 1)
            first = shell.submit(1, b"one")
            second = shell.submit(2, b"two")
            assert await peer.controls(2) == [(SET, 1), (SET, 2)]
            cancel(shell, second)
            assert await peer.controls(1) == [(DROP, 2)]
            peer.outcome(1, b"r1")  # no DROP answer: it started task 2
            assert await peer.controls(1) == [(pb.CTRL_RESTART, 0)]
            await wait_until(lambda: peer.wid not in shell.core.workers)
            with contextlib.suppress(OSError):
                peer.outcome(2, b"r2")
            await recv_all(peer.sock)  # the controller closes the channel
        assert first.state is TaskState.SUCCESS and second.state is TaskState.CANCELED
        assert [(f.task_id, f.state) for f in outcomes.items] == [
            (2, TaskState.CANCELED),
            (1, TaskState.SUCCESS),
        ]
        assert shell.core.counters.restarts_sent == 1
        assert shell.core.counters.worker_losses == {"its job was canceled": 1}


async def test_a_peer_that_answers_a_reclaim_after_the_outcome_runs_the_held_task(sockdir):
    """A reclaim's CTRL_DROP crosses the outcome of the running task: the peer writes that
    outcome, then its OK to the DROP. The held task started there and runs there (no RESTART);
    the late OK is ignored, and the idle worker gets nothing."""
    async with running_controller(sockdir) as (shell, outcomes):
        peer = await Peer.open(sockdir)
        with peer.sock:
            await wait_until(lambda: shell.core.idle_workers == 1)
            worker = shell.core.workers[peer.wid]
            first = shell.submit(1, b"one")
            second = shell.submit(2, b"two")
            assert await peer.controls(2) == [(SET, 1), (SET, 2)]
            idle = await Peer.open(sockdir)  # idle, nothing pending: task 2 is reclaimed
            with idle.sock:
                assert await peer.controls(1) == [(DROP, 2)]
                assert worker.reclaiming
                peer.outcome(1, b"r1")
                peer.answer(pb.WORKER_ERR_OK, 2, DROP)
                await wait_until(lambda: first.state is TaskState.SUCCESS)
                assert worker.task is second and second.state is TaskState.RUNNING
                assert second.attempts == 1 and not worker.reclaiming
                third = shell.submit(3, b"three")  # read after the late OK: it was read
                assert await idle.controls(1) == [(SET, 3)]
                assert worker.task is second and second.worker_id == peer.wid
                idle.outcome(3, b"r3")
                peer.outcome(2, b"r2")
                done = await outcomes.wait(3)
                assert finished_once(done, [1, 3, 2]) == {1: b"r1", 2: b"r2", 3: b"r3"}
                assert peer.quiet() and idle.quiet()  # no RESTART, no second SET_TASK 2
                assert shell.core.counters.restarts_sent == 0
                assert shell.core.counters.worker_losses == {}
                assert shell.core.workers.get(peer.wid) is worker
                assert third.attempts == 1


async def test_a_peer_that_answers_a_cancel_drop_after_the_outcome_is_restarted(sockdir):
    """A cancel's CTRL_DROP crosses the outcome of the running task: the peer writes that
    outcome, then its OK to the DROP. The canceled task counts as started: RESTART."""
    async with running_controller(sockdir) as (shell, outcomes):
        peer = await Peer.open(sockdir)
        with peer.sock:
            await wait_until(lambda: shell.core.idle_workers == 1)
            first = shell.submit(1, b"one")
            second = shell.submit(2, b"two")
            assert await peer.controls(2) == [(SET, 1), (SET, 2)]
            cancel(shell, second)
            assert await peer.controls(1) == [(DROP, 2)]
            peer.outcome(1, b"r1")
            peer.answer(pb.WORKER_ERR_OK, 2, DROP)
            assert await peer.controls(1) == [(pb.CTRL_RESTART, 0)]
            await wait_until(lambda: peer.wid not in shell.core.workers)
            await recv_all(peer.sock)  # the controller closes the channel
        assert first.state is TaskState.SUCCESS and second.state is TaskState.CANCELED
        assert [(f.task_id, f.state) for f in outcomes.items] == [
            (2, TaskState.CANCELED),
            (1, TaskState.SUCCESS),
        ]
        assert shell.core.counters.restarts_sent == 1
        assert shell.core.counters.worker_losses == {"its job was canceled": 1}

"""Jobs as strangers, the controller's side (DESIGN.md section 15): job users per slot, the
config's `job_users` and `job_limits`, sockets that answer only whom they should, and each
attempt's usage and reason.

Root tests use numeric uids with no passwd entry (62001...): a process is given one with
setpriv, in a group of its own and no other, as a job would run."""

from __future__ import annotations

import errno
import functools
import json
import os
import socket as stdsocket
import stat
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from controller import options
from controller.app import assemble
from controller.config import ConfigError, parse_config
from controller.core import TaskState
from controller.doors.http import codec
from controller.errors import StartupError
from controller.joblimits import JobLimits
from controller.main import slot_job_users
from controller.shell.core_shell import CoreShell
from controller.shell.desk import JobDesk
from controller.shell.main_socket import answers_a_pulse, prepare_socket_dir
from controller.shell.recovery import recover
from controller.shell.supervisor import Supervisor, worker_command
from controller.transport import chmod_socket_file, listen_unix
from controller.usage import Usage
from gen import worker_protocol_pb2 as pb
from tests.fakes import FakeWorker
from tests.helpers import (
    controller_argv,
    free_udp_port,
    live_controller,
    reap,
    running_controller,
    wait_for_condition,
    wait_until,
    worker_argv,
    write_config,
)
from tests.test_controller_shell import fresh_register_is_answered

DEFAULT_OPTS = options.DEFAULT
JOB_UID = 62001
WORKERS_GID = 62100  # stands in for the packaged `controller` group

ROOT = os.getuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="needs root: runs processes as other uids")

# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("value", "slots"),
    [
        ("controller-job-{slot}", ["controller-job-0", "controller-job-1", "controller-job-2"]),
        ([62001, "62002", "alice", 62004], ["62001", "62002", "alice"]),
        (None, [None, None, None]),
    ],
)
def test_job_users_give_each_slot_its_user(value, slots):
    config = parse_config({"job_users": value})
    assert slot_job_users(config, 3, []) == slots


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("controller-job", "holding {slot}"),
        ([], "non-empty list"),
        ([0], "uid 0"),
        (["root"], "never run as root"),
        ([True], "a user name or a uid"),
        ([1.5], "a user name or a uid"),
        (["a b"], "is not a user name"),
        (["-x"], "is not a user name"),
        ([62001, "62001"], "the same user twice"),
        ({"x": 1}, "must be null"),
    ],
)
def test_bad_job_users_are_refused_naming_the_key(value, message):
    with pytest.raises(ConfigError, match="job_users") as caught:
        parse_config({"job_users": value})
    assert message in str(caught.value)


def test_job_limits_are_read_with_their_units():
    config = parse_config({"job_limits": {"memory_max": "256M", "tasks_max": 64, "cpu_time": 60}})
    assert config.job_limits == JobLimits(memory_max=256 << 20, tasks_max=64, cpu_time=60.0)
    assert parse_config({}).job_limits.is_empty()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"memory": "1G"}, "unknown limit 'memory'"),
        ({"memory_max": "lots"}, "memory_max"),
        ({"tasks_max": 0}, "tasks_max"),
        ({"cpu_time": -1}, "cpu_time"),
        ("256M", "must be an object"),
    ],
)
def test_bad_job_limits_are_refused_naming_the_key(value, message):
    with pytest.raises(ConfigError, match="job_limits") as caught:
        parse_config({"job_limits": value})
    assert message in str(caught.value)


def test_fewer_job_users_than_slots_is_a_start_error():
    config = parse_config({"job_users": [62001, 62002]})
    with pytest.raises(StartupError, match="names 2 users, but --workers 3"):
        slot_job_users(config, 3, [])
    with pytest.raises(StartupError, match="in one place"):
        slot_job_users(config, 2, ["--job-user", "x"])


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"job_users": [62001]}, "names 1 users, but --workers 2"),
        ({"job_limits": {"open_files": "many"}}, "key 'job_limits' open_files"),
        ({"job_users": "nobody"}, "key 'job_users'"),
    ],
)
def test_the_controller_refuses_to_start_with_bad_job_settings(tmp_path, settings, words):
    config = write_config(tmp_path, socket_dir=str(tmp_path / "s"), **settings)
    run = subprocess.run(
        controller_argv(config, "--workers", "2"), capture_output=True, timeout=60, text=True
    )
    assert run.returncode == 2, run.stderr
    assert words in run.stderr
    assert "Traceback" not in run.stderr


async def test_each_supervised_slot_gets_its_job_user(tmp_path):
    """`controller --workers N` passes slot i's job user as `--job-user` to its worker, before
    the arguments after -- (where --exec takes every argument after it)."""
    script = 'printf "%s\\n" "$@" > "$0.$$"; exec sleep 30'
    argv = ["sh", "-c", script, str(tmp_path / "argv")]
    command = worker_command("/run/x", ["--exec", "true"], "62001")
    assert command[-4:] == ["--job-user", "62001", "--exec", "true"]
    slots = [[*argv, "--job-user", f"6200{n}"] for n in (1, 2, 3)]
    supervisor = Supervisor(3, argv, slot_argvs=slots)
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        await wait_until(lambda: len(list(tmp_path.glob("argv.*"))) == 3)
        await wait_until(lambda: all(p.read_text() for p in tmp_path.glob("argv.*")))
        nursery.cancel_scope.cancel()
    seen = sorted(p.read_text().split() for p in tmp_path.glob("argv.*"))
    assert seen == [["--job-user", "62001"], ["--job-user", "62002"], ["--job-user", "62003"]]
    assert Supervisor(2, ["w"]).slot_argv(1) == ["w"]  # job_users null: none passed


# ---------------------------------------------------------------- sockets


def _popen(argv: list[str], **kwargs: Any) -> subprocess.Popen[str]:
    """A process the test stops by pid (reap)."""
    return subprocess.Popen(argv, text=True, **kwargs)


def _can_run_as(uid: int) -> bool:
    if not ROOT:
        return False
    probe = subprocess.run(
        [*_as_user(uid), sys.executable, "-c", "import controller.wire"], capture_output=True
    )
    return probe.returncode == 0


def _as_user(uid: int, gid: int | None = None, groups: tuple[int, ...] = ()) -> list[str]:
    """setpriv's command line for a process of `uid`, in group `gid` (default: the uid, a
    group of its own) and in `groups` besides (default: none), as a job runs."""
    extra = [f"--groups={','.join(map(str, groups))}"] if groups else ["--clear-groups"]
    return ["setpriv", f"--reuid={uid}", f"--regid={uid if gid is None else gid}", *extra]


as_job_user = pytest.mark.skipif(
    not _can_run_as(JOB_UID), reason="needs root and a repository other uids can read"
)

# Run as the job's uid: what it can do to the socket directory and main.sock.
_PROBE = """
import json, os, socket, sys
from controller import wire
from gen import worker_protocol_pb2 as pb
sockdir = sys.argv[1]
seen = {}
def attempt(name, fn):
    try:
        seen[name] = fn()
    except OSError as exc:
        seen[name] = "errno %d" % exc.errno
def register():
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5)
    s.connect(os.path.join(sockdir, "main.sock"))
    s.sendall(wire.encode_frame(pb.WorkerPulse(type=pb.PULSE_REGISTER, next_pulse=2)))
    data = s.recv(4096)
    if not data:
        return "closed"
    resp, _ = wire.whole_frame(pb.PulseResponse, data, 0)
    return pb.ControllerError.Name(resp.error)
actions = {
    "list": lambda: sorted(os.listdir(sockdir)),
    "create": lambda: open(os.path.join(sockdir, "1.sock"), "w").close() or "created",
    "unlink": lambda: os.unlink(os.path.join(sockdir, "main.sock")) or "removed",
    "register": register,
}
for name in sys.argv[2:]:
    attempt(name, actions[name])
print(json.dumps(seen))
"""


def _probe_as(
    uid: int,
    sockdir: Path,
    actions: tuple[str, ...] = ("list", "create", "unlink", "register"),
    gid: int | None = None,
) -> dict[str, object]:
    run = subprocess.run(
        [*_as_user(uid, gid), sys.executable, "-c", _PROBE, str(sockdir), *actions],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert run.returncode == 0, run.stderr
    seen: dict[str, object] = json.loads(run.stdout)
    return seen


@as_job_user
async def test_a_job_user_cannot_reach_the_packaged_socket_directory(sockdir):
    """The directory as packaged, 0770 root:<the workers' group>: a job user (its own group,
    no other) can neither list it, nor put a file in it, nor reach main.sock; a worker of
    that group registers."""
    os.chown(sockdir, 0, WORKERS_GID)
    sockdir.chmod(0o770)
    async with running_controller(sockdir) as (shell, _):
        os.chown(sockdir / "main.sock", 0, WORKERS_GID)  # the packaged controller's group
        job = await trio.to_thread.run_sync(_probe_as, JOB_UID, sockdir)
        eacces = f"errno {errno.EACCES}"
        assert job == {"list": eacces, "create": eacces, "unlink": eacces, "register": eacces}
        assert (sockdir / "main.sock").exists() and not (sockdir / "1.sock").exists()
        worker = await trio.to_thread.run_sync(
            functools.partial(_probe_as, 62000, sockdir, ("register",), gid=WORKERS_GID)
        )
        assert worker["register"] == "CTRL_ERR_OK"
        assert shell.refused_peers == 0  # (the probe is dropped again when it exits)


@as_job_user
async def test_main_sock_refuses_a_job_user_that_reaches_it(sockdir):
    """Even where main.sock is reachable (a directory others may enter, the socket 0666),
    a job user's REGISTER is refused: its uid is not allowed and its group is its own."""
    os.chown(sockdir, 0, WORKERS_GID)
    sockdir.chmod(0o771)
    async with running_controller(sockdir) as (shell, _):
        os.chmod(sockdir / "main.sock", 0o666)
        job = await trio.to_thread.run_sync(_probe_as, JOB_UID, sockdir)
        assert job["register"] == "CTRL_ERR_FAILED"
        assert shell.core.workers == {} and shell.refused_peers == 1


def test_a_socket_directory_others_may_write_is_refused_sticky_or_not(sockdir):
    for mode in (0o777, 0o1777, 0o1773):
        sockdir.chmod(mode)
        with pytest.raises(StartupError, match="world-writable"):
            prepare_socket_dir(sockdir)
    sockdir.chmod(0o770)
    prepare_socket_dir(sockdir)


def test_listen_unix_never_changes_a_file_through_a_symlink(tmp_path):
    target = tmp_path / "precious"
    target.write_text("x")
    target.chmod(0o600)
    link = tmp_path / "a.sock"
    link.symlink_to(target)
    with pytest.raises(OSError) as caught:
        chmod_socket_file(link, 0o666)
    assert caught.value.errno == errno.ELOOP
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    with listen_unix(tmp_path / "b.sock", 4, 0o660):
        assert stat.S_IMODE((tmp_path / "b.sock").stat().st_mode) == 0o660


async def test_a_removed_main_sock_is_bound_again_and_a_real_worker_comes_back(sockdir, caplog):
    async with running_controller(sockdir) as (shell, outcomes):
        proc = _popen(worker_argv(sockdir, "--pulse", "0.2"))
        try:
            await wait_until(lambda: shell.core.idle_workers == 1, timeout=20)
            main = sockdir / "main.sock"
            main.unlink()
            gone = trio.current_time()
            await wait_until(main.exists, timeout=2)
            assert trio.current_time() - gone < 1.0
            assert shell.rebinds == 1
            assert "main.sock was removed while the controller ran; bound again" in caplog.text
            # The worker's pulses reach the controller again: it still runs jobs.
            shell.submit(7, b"after the rebind")
            [done] = await outcomes.wait(1)
            assert (done.state, done.result) == (TaskState.SUCCESS, b"after the rebind")
        finally:
            reap(proc)


async def test_a_replaced_main_sock_is_taken_back_and_workers_come_back(sockdir, caplog):
    """A listener put in main.sock's place (silent: it swallows pulses) is noticed and
    replaced within a second; the worker, dropped or not meanwhile, runs the next job."""
    async with running_controller(sockdir) as (shell, outcomes):
        proc = _popen(worker_argv(sockdir, "--pulse", "0.2"))
        impostor = stdsocket.socket(stdsocket.AF_UNIX, stdsocket.SOCK_STREAM)
        try:
            await wait_until(lambda: shell.core.idle_workers == 1, timeout=20)
            main = sockdir / "main.sock"
            main.unlink()
            impostor.bind(str(main))
            impostor.listen(16)
            swapped = trio.current_time()
            await wait_until(lambda: shell.rebinds == 1, timeout=2)
            assert trio.current_time() - swapped < 1.0
            assert "replaced by another file" in caplog.text
            shell.submit(8, b"taken back")
            [done] = await outcomes.wait(1, timeout=20)
            assert (done.state, done.result) == (TaskState.SUCCESS, b"taken back")
        finally:
            impostor.close()
            reap(proc)


async def test_a_silent_listener_on_main_sock_does_not_block_the_start(sockdir):
    """A main.sock that accepts connections and never answers a pulse is stale: replaced."""
    squatter = stdsocket.socket(stdsocket.AF_UNIX, stdsocket.SOCK_STREAM)
    squatter.bind(str(sockdir / "main.sock"))
    squatter.listen(16)
    try:
        async with running_controller(sockdir, dial_timeout=0.5):
            await fresh_register_is_answered(sockdir)
    finally:
        squatter.close()


def test_a_controller_process_starts_past_a_silent_main_sock(tmp_path):
    """The command itself: before, it exited 2 ("another controller is already serving")."""
    sockdir = tmp_path / "s"
    sockdir.mkdir(mode=0o750)
    squatter = stdsocket.socket(stdsocket.AF_UNIX, stdsocket.SOCK_STREAM)
    squatter.bind(str(sockdir / "main.sock"))
    squatter.listen(16)
    config = write_config(
        tmp_path,
        socket_dir=str(sockdir),
        dial_timeout=0.5,
        client_address={"host": "127.0.0.1", "port": free_udp_port()},
    )
    proc = subprocess.Popen(controller_argv(config), stderr=subprocess.PIPE)
    try:
        wait_for_condition(lambda: answers_a_pulse(sockdir / "main.sock", 1.0), timeout=20)
        assert proc.poll() is None
    finally:
        squatter.close()
        reap(proc)


async def test_a_worker_socket_served_by_another_process_is_sent_nothing(sockdir, nursery):
    """The socket file was swapped after the owner check could pass: whoever listens there
    now is not the process that registered, so SET_TASK never reaches it."""
    async with running_controller(sockdir) as (shell, outcomes):
        victim = await FakeWorker(sockdir).start(nursery)
        path = sockdir / f"{victim.worker_id}.sock"
        path.unlink()
        script = (
            "import socket, sys\n"
            "s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(4)\n"
            "print('listening', flush=True)\n"
            "c, _ = s.accept(); c.settimeout(5)\n"
            "print('got', len(c.recv(65536)), flush=True)\n"
        )
        impostor = _popen([sys.executable, "-c", script, str(path)], stdout=subprocess.PIPE)
        try:
            assert impostor.stdout is not None
            assert await trio.to_thread.run_sync(impostor.stdout.readline) == "listening\n"
            shell.submit(1, b"secret payload")
            await wait_until(lambda: victim.worker_id not in shell.core.workers)
            assert shell.core.counters.worker_losses == {"socket owned by another uid": 1}
            good = await FakeWorker(sockdir).start(nursery)
            await good.wait_for(pb.CTRL_SET_TASK)
            await good.pulse(pb.PULSE_FETCH_ME)
            assert (await outcomes.wait(1))[0].state is TaskState.SUCCESS
            impostor.terminate()
            out, _ = impostor.communicate(timeout=10)
            assert "got" not in out or "got 0" in out  # connected, and was sent nothing
        finally:
            reap(impostor)


# ---------------------------------------------------------------- limits, usage and reason


def test_a_jobs_limits_may_ask_for_less_than_the_configuration_never_more():
    config = parse_config({"job_limits": {"memory_max": "256M", "cpu_time": 60}})
    defaults = config.job_options("http")
    asked = options.parse({"limits": {"memory_max": "128M"}}, defaults, 0.0)
    assert asked.limits == JobLimits(memory_max=128 << 20, cpu_time=60.0)
    assert options.as_fields(asked)["limits"] == {"memory_max": 128 << 20, "cpu_time": 60.0}
    as_text = options.parse({"limits": '{"tasks_max": 8}'}, defaults, 0.0, text=True)
    assert as_text.limits == JobLimits(memory_max=256 << 20, tasks_max=8, cpu_time=60.0)
    with pytest.raises(options.BadOption, match=r"memory_max .* more than the configuration"):
        options.parse({"limits": {"memory_max": "1G"}}, defaults, 0.0)
    for bad in ({"memory": 1}, {"cpu_time": -1}, "256M", [1]):
        with pytest.raises(options.BadOption, match="limits"):
            options.parse({"limits": bad}, defaults, 0.0)
    with pytest.raises(options.BadOption, match="JSON object"):
        options.parse({"limits": "{oops"}, defaults, 0.0, text=True)
    kept = options.from_json(options.to_json(asked), config.job_options("http"))
    assert kept.limits == asked.limits


def _failing_fetch(
    usage: pb.Usage, reason: str, error: bytes
) -> Callable[[pb.ControlMsg, bytes], Awaitable[tuple[pb.WorkerResponse, bytes]]]:
    async def answer(msg: pb.ControlMsg, extra: bytes) -> tuple[pb.WorkerResponse, bytes]:
        resp = pb.WorkerResponse(error=pb.WORKER_ERR_TASK_FAILED, extra_size=len(error))
        resp.usage.CopyFrom(usage)
        resp.reason = reason
        return resp, error

    return answer


def desk_options(desk: JobDesk, door: str) -> options.JobOptions:
    """The options a job of `door` gets by default (the configuration's)."""
    shell = desk.scheduling
    assert isinstance(shell, CoreShell)
    return shell.config.job_options(door)


@asynccontextmanager
async def _desk(sockdir: Path, **settings: Any) -> AsyncIterator[tuple[CoreShell, JobDesk]]:
    """The controller's scheduler shell and job desk, wired as `controller` wires them."""
    config = parse_config({"socket_dir": str(sockdir), "journal": None, **settings})
    ctl = assemble(config)
    shell, desk, _door = ctl.shell, ctl.desk, ctl.udp
    async with trio.open_nursery() as nursery:
        await nursery.start(desk.run)
        await nursery.start(shell.serve)
        yield shell, desk
        nursery.cancel_scope.cancel()


async def test_set_task_carries_the_jobs_limits_under_the_configurations(sockdir, nursery):
    seen: list[pb.JobLimits] = []
    async with _desk(sockdir, job_limits={"memory_max": "256M", "tasks_max": 64}) as (_, desk):
        worker = FakeWorker(sockdir)

        async def remember(msg: pb.ControlMsg, extra: bytes) -> tuple[pb.WorkerResponse, bytes]:
            seen.append(msg.limits)
            return worker.default(msg, extra)

        worker.script[pb.CTRL_SET_TASK] = remember
        await worker.start(nursery)
        defaults = desk_options(desk, "http")
        asked = options.parse({"limits": {"memory_max": "64M"}}, defaults, 0.0)
        desk.submit("j1", "http", None, 1, b"p", trio.current_time(), options=asked)
        await wait_until(lambda: len(seen) == 1)
        await worker.pulse(pb.PULSE_FETCH_ME)
        await wait_until(lambda: desk.book.get("j1").state.final)
        desk.submit("j2", "http", None, 2, b"p", trio.current_time(), options=defaults)
        await wait_until(lambda: len(seen) == 2)
    assert (seen[0].memory_max, seen[0].tasks_max) == (64 << 20, 64)
    assert (seen[1].memory_max, seen[1].tasks_max) == (256 << 20, 64)


async def test_a_limit_failure_ends_the_job_at_once_with_its_usage_and_reason(sockdir, nursery):
    """FETCH answers TASK_FAILED with reason "limit": no retry (it would hit the limit
    again); the job object says `reason: limit` and what the attempt used."""
    async with _desk(sockdir, max_retries=3) as (shell, desk):
        worker = FakeWorker(sockdir)
        usage = pb.Usage(wall=1.5, cpu=1.25, max_rss=12 << 20)
        error = b"CPU time limit 1 s"
        worker.script[pb.CTRL_FETCH] = _failing_fetch(usage, "limit", error)
        await worker.start(nursery)
        desk.submit("spin", "http", None, 9, b"p", trio.current_time())
        await worker.wait_for(pb.CTRL_SET_TASK)
        await worker.pulse(pb.PULSE_FETCH_ME)
        job = desk.book.get("spin")
        assert job is not None
        await wait_until(lambda: job.state.final)
        assert worker.kinds().count(pb.CTRL_SET_TASK) == 1  # never placed again
        shown = codec.job_json(job, desk.book.wall_offset)
        assert (shown["state"], shown["reason"], shown["error"]) == (
            "failed",
            "limit",
            "CPU time limit 1 s",
        )
        assert shown["usage"] == {"wall": 1.5, "cpu": 1.25, "max_rss": 12 << 20}
        assert shown["attempts"] == 1
        [attempt] = job.attempts_made()
        assert attempt.usage == Usage(1.5, 1.25, 12 << 20)
        assert shell.core.counters.retries == 0


async def test_other_failures_are_retried_and_each_attempt_keeps_its_usage(sockdir, nursery):
    async with _desk(sockdir, max_retries=1) as (_, desk):
        worker = FakeWorker(sockdir)
        worker.script[pb.CTRL_FETCH] = _failing_fetch(pb.Usage(wall=0.5, cpu=0.25), "", b"exit 1")
        await worker.start(nursery)
        desk.submit("flaky", "http", None, 3, b"p", trio.current_time())
        for attempt in (1, 2):
            await worker.wait_for(pb.CTRL_SET_TASK, attempt)
            worker.task_id = 0
            await worker.pulse(pb.PULSE_FETCH_ME, task_id=3)
        job = desk.book.get("flaky")
        assert job is not None
        await wait_until(lambda: job.state.final)
        shown = codec.job_json(job, desk.book.wall_offset)
        assert (shown["state"], shown["reason"], shown["attempts"]) == ("failed", "error", 2)
        assert [a.usage for a in job.attempts_made()] == [Usage(0.5, 0.25, 0)] * 2


async def test_a_finished_job_has_usage_and_no_reason_and_a_placement_failure_says_so(
    sockdir, nursery
):
    async with _desk(sockdir) as (_, desk):
        worker = FakeWorker(sockdir)

        async def fetched(msg: pb.ControlMsg, extra: bytes) -> tuple[pb.WorkerResponse, bytes]:
            resp, out = worker.default(msg, extra)
            resp.usage.CopyFrom(pb.Usage(wall=0.25, cpu=0.125, max_rss=1024, memory_peak=2048))
            return resp, out

        worker.script[pb.CTRL_FETCH] = fetched
        await worker.start(nursery)
        desk.submit("ok", "http", None, 4, b"p", trio.current_time())
        await worker.wait_for(pb.CTRL_SET_TASK)
        await worker.pulse(pb.PULSE_FETCH_ME)
        job = desk.book.get("ok")
        assert job is not None
        await wait_until(lambda: job.state.final)
        shown = codec.job_json(job, desk.book.wall_offset)
        assert (shown["state"], shown["reason"]) == ("finished", None)
        assert shown["usage"] == {"wall": 0.25, "cpu": 0.125, "max_rss": 1024, "memory_peak": 2048}
        waiting = options.parse({"placement_timeout": 0.1, "queue": "nobody"}, DEFAULT_OPTS, 0.0)
        desk.submit("late", "http", None, 5, b"p", trio.current_time(), options=waiting)
        late = desk.book.get("late")
        assert late is not None
        await wait_until(lambda: late.state.final)
        assert codec.job_json(late, 0.0)["reason"] == "placement"
        assert codec.job_json(late, 0.0)["usage"] is None


async def test_a_usage_report_that_cannot_be_true_is_ignored(sockdir, nursery):
    async with _desk(sockdir) as (_, desk):
        worker = FakeWorker(sockdir)

        async def lying(msg: pb.ControlMsg, extra: bytes) -> tuple[pb.WorkerResponse, bytes]:
            resp, out = worker.default(msg, extra)
            resp.usage.CopyFrom(pb.Usage(wall=float("nan"), cpu=-1.0, max_rss=2**64 - 1))
            return resp, out

        worker.script[pb.CTRL_FETCH] = lying
        await worker.start(nursery)
        desk.submit("lie", "http", None, 6, b"p", trio.current_time())
        await worker.wait_for(pb.CTRL_SET_TASK)
        await worker.pulse(pb.PULSE_FETCH_ME)
        job = desk.book.get("lie")
        assert job is not None
        await wait_until(lambda: job.state.final)
        assert (job.state.value, job.usage) == ("finished", None)


# ---------------------------------------------------------------- with real workers

# A job that spins when its payload says so, else prints the uid it runs as.
_SPIN_OR_ID = ["--exec", "sh", "-c", 'read x; [ "$x" = spin ] && while :; do :; done; id -u']


async def test_a_real_worker_reports_usage_and_a_cpu_limit_hit(sockdir):
    """Through a real worker: the configuration's job_limits reach it in SET_TASK; a job
    spinning past cpu_time fails with reason limit, not retried; the next job runs, and
    both have their usage in the job object."""
    async with _desk(sockdir, job_limits={"cpu_time": 1}, max_retries=3) as (shell, desk):
        # Its own ceiling is higher: the configuration's, sent with the job, applies.
        proc = _popen(worker_argv(sockdir, "--cpu-time", "100", *_SPIN_OR_ID))
        try:
            await wait_until(lambda: shell.core.idle_workers == 1, timeout=20)
            desk.submit("spin", "http", None, 1, b"spin", trio.current_time())
            spin = desk.book.get("spin")
            assert spin is not None
            await wait_until(lambda: spin.state.final, timeout=30)
            shown = codec.job_json(spin, desk.book.wall_offset)
            assert (shown["state"], shown["reason"], shown["attempts"]) == ("failed", "limit", 1)
            assert shown["usage"] is not None and shown["usage"]["cpu"] >= 0.5
            desk.submit("next", "http", None, 2, b"", trio.current_time())
            after = desk.book.get("next")
            assert after is not None
            await wait_until(lambda: after.state.final, timeout=20)
            shown = codec.job_json(after, desk.book.wall_offset)
            assert (shown["state"], shown["reason"]) == ("finished", None)
            assert set(shown["usage"]) >= {"wall", "cpu", "max_rss"}
            assert shown["usage"]["max_rss"] > 0
        finally:
            reap(proc)


@as_job_user
def test_controller_workers_run_each_slots_jobs_as_its_job_user(tmp_path):
    """`controller --workers 2` with job_users: a job prints `id -u`, and it is its slot's
    job user's, never root."""
    with live_controller(
        tmp_path,
        "--workers",
        "2",
        "--",
        *_SPIN_OR_ID,
        job_users=[JOB_UID, JOB_UID + 1],
    ) as ctl:
        seen = set()
        for n in range(6):
            job = _http_json(ctl.url, "POST", "/job/", {"payload": "", "id": f"who-{n}"})
            deadline = time.monotonic() + 30
            while job["state"] not in ("finished", "failed"):
                assert time.monotonic() < deadline, job
                job = _http_json(ctl.url, "GET", f"/job/who-{n}/?wait=5")
            assert job["state"] == "finished", job
            seen.add(int(job["result"]))
    assert seen <= {JOB_UID, JOB_UID + 1} and seen


def _http_json(url: str, method: str, path: str, body: object = None) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=30) as resp:
        answer: dict[str, Any] = json.loads(resp.read())
    return answer


def test_metrics_sum_what_attempts_used_and_count_failures_by_reason():
    from controller.core import TaskFinished
    from controller.shell.metrics import Metrics

    metrics = Metrics()
    metrics.attempt_used(Usage(wall=2.0, cpu=1.5, max_rss=1))
    metrics.attempt_used(Usage(wall=1.0, cpu=0.25, max_rss=1))
    metrics.task_finished(TaskFinished(1, 1, None, TaskState.ERROR, error="x", reason="limit"))
    metrics.task_finished(TaskFinished(2, 2, None, TaskState.SUCCESS))
    sample = metrics.registry.get_sample_value
    assert sample("controller_job_cpu_seconds_total") == 1.75
    assert sample("controller_job_wall_seconds_total") == 3.0
    assert sample("controller_job_failures_total", {"reason": "limit"}) == 1.0


def test_the_console_and_jobctl_show_what_each_attempt_used():
    from controller.client.jobctl_tables import job_details
    from controller.doors.http.console import pages_jobs, views
    from controller.job_states import JobState
    from controller.jobs import Attempt, Job

    job = Job("j", 1, 1, "http", None)
    job.history = [Attempt(2, 10.0, 11.5, "failed", "boom", Usage(1.5, 0.75, 3 << 20))]
    job.attempt_started(3, 12.0)
    job.usage = Usage(0.5, 0.25, 5 << 20, 7 << 20)
    job.final, job.updated_at = JobState.FINISHED, 12.5
    attempts = views.attempts_data(job, 0.0, str)
    assert [(a["wall"], a["cpu"], a["max_rss"], a["memory_peak"]) for a in attempts] == [
        ("1.500 s", "0.750 s", "3.0 MiB", ""),
        ("0.500 s", "0.250 s", "5.0 MiB", "7.0 MiB"),
    ]
    shown = codec.job_json(job, 0.0)
    page = pages_jobs.job_page(shown, b"", b"", attempts, [], "csrf", False)
    assert "max rss" in page and "7.0 MiB" in page and "1.500 s" in page
    details = job_details(shown)
    assert "usage              wall 0.500 s, cpu 0.250 s, max_rss 5.0 MiB, memory_peak 7.0 MiB" in (
        details
    )


async def test_a_job_the_journal_cannot_record_fails_with_reason_error(
    sockdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sqlite3

    from controller import journal as journal_module
    from controller.config import Config
    from controller.journal import Journal

    real = journal_module.stored_text
    monkeypatch.setattr(
        journal_module, "stored_text", lambda text: object() if text == "canceled" else real(text)
    )
    path = tmp_path / "journal.sqlite3"
    journal = Journal.open(path)
    ctl = assemble(Config(socket_dir=sockdir, journal=path), journal)
    shell, desk, _ = ctl.shell, ctl.desk, ctl.udp
    recover(desk, journal.load(), trio.current_time())
    committer = ctl.committer
    assert committer is not None
    async with trio.open_nursery() as nursery:
        await nursery.start(committer.run)
        await nursery.start(shell.serve)
        job = desk.submit("kept", "http", None, desk.book.pick_task_id(), b"p", trio.current_time())
        await desk.write_ahead.committed()
        desk.cancel(job, trio.current_time())
        await desk.write_ahead.committed()  # the cancel's batch: its change refused
        await desk.write_ahead.committed()  # the failure staged instead
        assert (job.state.value, job.reason) == ("failed", "error")
        nursery.cancel_scope.cancel()
    journal.close()
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT reason FROM jobs WHERE id = 'kept'").fetchone() == ("error",)

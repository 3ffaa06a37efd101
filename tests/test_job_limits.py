"""Jobs as strangers, the worker's side (DESIGN.md section 15): a real `worker --exec` process
driven by a blocking fake controller; job users (root only), limits, usage, what a job
leaves behind, and the cgroup files against a stand-in directory."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.floor import read_frame
from bench.worker_bench import MiniController
from controller import wire
from controller.joblimits import JobLimits
from gen import worker_protocol_pb2 as pb
from tests.helpers import wait_for_condition, worker_argv
from worker.errors import SetupError
from worker.limits.cgroups import Cgroup, cgroup_limit
from worker.limits.rlimits import rlimit_hit, rlimit_plan

# A job's interpreter: one a job user may run (the test's own may live under /root).
PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
MiB = 1024 * 1024
root_only = pytest.mark.skipif(
    os.geteuid() != 0, reason="job users need root (setresuid to numeric uids)"
)
# Each test file that runs jobs as real uids has uids of its own: `make test` runs files side
# by side (pytest -n --dist loadfile), and a worker's clean-up before a slot's next job kills
# every process of its uid and removes its files.
JOB_UID, OTHER_UID, STRANGER_UID = 61001, 61002, 61003


class Driver:
    """One worker process and the fake controller it registered with."""

    def __init__(self, ctl: MiniController, proc: subprocess.Popen[bytes]) -> None:
        self.ctl = ctl
        self.proc = proc
        self.task_id = 0

    def start(self, payload: bytes = b"", limits: JobLimits | None = None) -> int:
        self.task_id += 1
        msg = pb.ControlMsg(type=pb.CTRL_SET_TASK, task_id=self.task_id)
        if limits is not None:
            msg.limits.CopyFrom(limits.to_proto())
        with socket.socket(socket.AF_UNIX) as conn:
            conn.settimeout(10)
            conn.connect(str(self.ctl.sockdir / "1.sock"))
            conn.sendall(wire.encode_frame(msg, payload))
            answer = read_frame(conn, pb.WorkerResponse)
        assert answer.error == pb.WORKER_ERR_OK, answer
        return self.task_id

    def finish(self, task_id: int) -> tuple[pb.WorkerResponse, bytes]:
        """Wait for FETCH_ME, FETCH: (the answer, the result or error text)."""
        self.ctl.wait_for(pb.PULSE_FETCH_ME, task_id)
        with socket.socket(socket.AF_UNIX) as conn:
            conn.settimeout(10)
            conn.connect(str(self.ctl.sockdir / "1.sock"))
            conn.sendall(wire.encode_frame(pb.ControlMsg(type=pb.CTRL_FETCH)))
            data = b""
            while chunk := conn.recv(65536):
                data += chunk
        return _split(data)

    def run(
        self, payload: bytes = b"", limits: JobLimits | None = None
    ) -> tuple[pb.WorkerResponse, bytes]:
        return self.finish(self.start(payload, limits))


def _split(data: bytes) -> tuple[pb.WorkerResponse, bytes]:
    """One whole frame (section 3): the answer and its extra bytes."""
    frame = wire.whole_frame(pb.WorkerResponse, data, 1 << 24)
    assert frame is not None, data
    return frame


@contextlib.contextmanager
def worker(tmp: Path, *args: str, user: int | None = None) -> Iterator[Driver]:
    """`user`: started as root with `--user` that uid (then `tmp` must be one it can reach)."""
    tmp.chmod(0o750)
    ctl = MiniController(tmp)
    ctl.listener.settimeout(30)
    if user is not None:
        os.chown(tmp, user, 0)  # it binds its own socket there
        (tmp / "main.sock").chmod(0o777)  # and dials the controller
        args = ("--user", str(user), *args)
    proc = subprocess.Popen(worker_argv(tmp, *args, log_level="INFO"), stderr=subprocess.PIPE)
    try:
        ctl.wait_for(pb.PULSE_OK)
        yield Driver(ctl, proc)
    finally:
        proc.terminate()
        with contextlib.suppress(OSError, EOFError):  # its SHUTDOWN answered: no wait for it
            ctl.listener.settimeout(5)
            ctl.wait_for(pb.PULSE_SHUTDOWN)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
        ctl.listener.close()


def _split_check() -> None:  # the frame layout _split reads
    frame = wire.encode_frame(pb.WorkerResponse(task_id=3), b"xy")
    assert _split(frame) == (pb.WorkerResponse(task_id=3, extra_size=2), b"xy")


def test_frame_layout_read_by_these_tests() -> None:
    _split_check()


# ------------------------------------------------------------------ limits (any user)


def test_a_job_past_its_cpu_time_fails_with_reason_limit_and_the_next_runs(tmp_path):
    spin = [
        PYTHON,
        "-c",
        "import sys\nif sys.stdin.read() == 'spin':\n  while True: pass\nprint('ok')",
    ]
    with worker(tmp_path, "--cpu-time", "1", "--exec", *spin) as w:
        answer, text = w.run(b"spin")
        assert answer.error == pb.WORKER_ERR_TASK_FAILED
        assert answer.reason == "limit"
        assert text.startswith(b"CPU time limit 1 s: "), text
        assert answer.usage.cpu >= 0.5 and answer.usage.wall >= 0.9  # rusage samples ticks
        answer, text = w.run(b"fine")
        assert (answer.error, text, answer.reason) == (pb.WORKER_ERR_OK, b"ok\n", "")


def test_a_job_allocating_past_memory_max_fails_with_reason_limit(tmp_path):
    grow = [
        PYTHON,
        "-c",
        "import sys\nkeep = []\nif sys.stdin.read() == 'grow':\n"
        "  while True: keep.append(bytearray(8 << 20))\nprint(len(keep))",
    ]
    with worker(tmp_path, "--memory-max", "200M", "--exec", *grow) as w:
        answer, text = w.run(b"grow")
        assert answer.error == pb.WORKER_ERR_TASK_FAILED
        assert answer.reason == "limit"
        assert text.startswith(b"memory limit 200 MiB reached"), text
        assert b"MemoryError" in text
        assert answer.usage.max_rss > 100 * MiB
        answer, text = w.run(b"small")
        assert (answer.error, text) == (pb.WORKER_ERR_OK, b"0\n")
        assert answer.usage.max_rss < 100 * MiB


def test_set_task_limits_lower_the_workers_own(tmp_path):
    spin = [PYTHON, "-c", "while True: pass"]
    with worker(tmp_path, "--cpu-time", "60", "--exec", *spin) as w:
        started = time.monotonic()
        answer, text = w.run(limits=JobLimits(cpu_time=1.0))
        assert answer.reason == "limit" and text.startswith(b"CPU time limit 1 s"), text
        assert time.monotonic() - started < 30


def test_a_job_past_its_file_size_is_stopped_by_sigxfsz(tmp_path):
    out = tmp_path / "big"
    write = ["sh", "-c", f"head -c 2000000 /dev/zero > {out}"]
    with worker(tmp_path, "--file-size", "1M", "--exec", *write) as w:
        answer, text = w.run()
        assert answer.reason == "limit", text
        assert text.startswith(b"file size limit 1 MiB: sh exited with status 153"), text
        assert out.stat().st_size == MiB


def test_usage_of_an_exec_job_and_a_failed_one(tmp_path):
    with worker(tmp_path, "--exec", "sh", "-c", "read x; exit $x") as w:
        answer, _ = w.run(b"0\n")
        assert answer.error == pb.WORKER_ERR_OK
        assert answer.HasField("usage") and answer.usage.wall > 0 and answer.usage.max_rss > 0
        answer, text = w.run(b"3\n")
        assert answer.error == pb.WORKER_ERR_TASK_FAILED and answer.reason == ""
        assert text == b"sh exited with status 3" and answer.usage.wall > 0


def test_usage_of_a_handler_job(tmp_path):
    with worker(tmp_path, "--handler", "worker.runner:noop") as w:
        answer, _ = w.run(b"x")
        assert answer.error == pb.WORKER_ERR_OK
        assert answer.usage.wall > 0 and answer.usage.max_rss > 10 * MiB


def test_what_a_job_leaves_running_is_stopped_when_it_ends(tmp_path):
    """A background process holding the job's stdout used to keep the job running until it
    ended on its own; now the job's end stops its whole process group."""
    marker = "30.4711"  # sleep's argument: how the test finds it
    job = ["sh", "-c", f"sleep {marker} & echo started"]
    with worker(tmp_path, "--exec", *job) as w:
        started = time.monotonic()
        answer, text = w.run()
        assert (answer.error, text) == (pb.WORKER_ERR_OK, b"started\n")
        assert time.monotonic() - started < 10
        wait_for_condition(lambda: not _processes_named(marker), 5)


def _processes_named(arg: str) -> list[int]:
    """The live processes with `arg` among their arguments (zombies have none)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if arg.encode() in (entry / "cmdline").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
    return found


def test_bad_limit_flags_stop_the_start(tmp_path):
    for flag, value in (("--memory-max", "lots"), ("--tasks-max", "0"), ("--cpu-quota", "9999")):
        done = subprocess.run(
            worker_argv(tmp_path, flag, value, "--exec", "true"), capture_output=True, timeout=30
        )
        assert done.returncode == 2, (flag, done.stderr)
        assert flag.encode() in done.stderr


def test_the_worker_says_how_it_limits_jobs(tmp_path):
    with worker(tmp_path, "--memory-max", "1G", "--exec", "true") as w:
        w.run()
        w.proc.send_signal(signal.SIGTERM)
        assert w.proc.stderr is not None
        log = w.proc.stderr.read1(65536)  # type: ignore[attr-defined]
        assert b"limits: setrlimit" in log or b"limits: cgroup v2 " in log


# ------------------------------------------------------------------ job users (root)


@root_only
def test_a_job_runs_as_its_slots_user_without_groups(tmp_path):
    with worker(
        tmp_path, "--job-user", str(JOB_UID), "--exec", "sh", "-c", "id -u; id -g; id -G"
    ) as w:
        answer, text = w.run()
        assert (answer.error, text) == (
            pb.WORKER_ERR_OK,
            f"{JOB_UID}\n{JOB_UID}\n{JOB_UID}\n".encode(),
        )


@root_only
def test_a_job_cannot_signal_another_slots_job(tmp_path):
    victim_name = "30.8123"  # the victim's sleep argument
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with (
        worker(
            tmp_path / "a",
            "--job-user",
            str(JOB_UID),
            "--drain-timeout",
            "0.5",
            "--exec",
            "sleep",
            victim_name,
        ) as a,
        worker(
            tmp_path / "b",
            "--job-user",
            str(OTHER_UID),
            "--exec",
            "sh",
            "-c",
            'kill -KILL "$(cat)" 2>&1; echo "rc=$?"',
        ) as b,
    ):
        victim = a.start()

        def victims() -> list[int]:  # not the worker, whose arguments name it too
            return [p for p in _processes_named(victim_name) if _uid(p) == JOB_UID]

        wait_for_condition(lambda: bool(victims()), 10)
        [pid] = victims()
        _answer, text = b.run(str(pid).encode())
        assert b"rc=1" in text and b"not permitted" in text, text
        assert victims() == [pid]  # alive
        del victim


def _uid(pid: int) -> int:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return -1


@root_only
def test_temporary_files_a_job_leaves_are_gone_before_the_next_job(tmp_path):
    job = [
        "sh",
        "-c",
        'if [ "$(cat)" = make ]; then mkdir -p "$TMPDIR/d/e" && touch "$TMPDIR/f" "$TMPDIR/d/e/g" '
        '&& chmod 000 "$TMPDIR/d"; fi; stat -c "%u %a" "$TMPDIR"; ls -A "$TMPDIR"',
    ]
    with worker(tmp_path, "--job-user", str(JOB_UID), "--exec", *job) as w:
        _, text = w.run(b"make")
        assert text == f"{JOB_UID} 700\nd\nf\n".encode(), text
        _, text = w.run(b"look")
        assert text == f"{JOB_UID} 700\n".encode(), text


@root_only
def test_a_fork_past_tasks_max_fails_with_reason_limit(tmp_path):
    forks = [
        PYTHON,
        "-c",
        "import os, sys, time\nif sys.stdin.read() == 'bomb':\n"
        "  for _ in range(64):\n    if os.fork() == 0:\n      time.sleep(30); os._exit(0)\n"
        "print('ok')",
    ]
    with worker(tmp_path, "--job-user", str(JOB_UID), "--tasks-max", "8", "--exec", *forks) as w:
        answer, text = w.run(b"bomb")
        assert answer.error == pb.WORKER_ERR_TASK_FAILED and answer.reason == "limit", text
        assert text.startswith(b"process limit 8: "), text
        answer, text = w.run(b"calm")
        assert (answer.error, text) == (pb.WORKER_ERR_OK, b"ok\n")


@root_only
def test_the_control_socket_answers_only_the_controllers_uid(sockdir):
    """A process of another uid that can reach the socket file (here through its group) is
    closed at once: no GET_STATUS answer, and above all no RESTART obeyed."""
    probe = (
        "import socket, sys\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "s.settimeout(10)\n"
        "s.connect(sys.argv[1])\n"
        "try:\n"
        "    s.sendall(bytes.fromhex(sys.argv[2]))\n"
        "    print(len(s.recv(100)))\n"
        "except (BrokenPipeError, ConnectionResetError):\n"
        "    print(0)\n"
    )
    restart = wire.encode_frame(pb.ControlMsg(type=pb.CTRL_RESTART)).hex()
    with worker(sockdir, "--exec", "true") as w:  # /tmp/jc-*: reachable through group 0
        done = subprocess.run(
            [PYTHON, "-c", probe, str(sockdir / "1.sock"), restart],
            user=STRANGER_UID,
            group=0,
            extra_groups=[],
            capture_output=True,
            timeout=30,
        )
        assert done.stdout == b"0\n", done.stderr  # closed without a word
        assert w.proc.poll() is None  # and not restarted
        answer, _ = w.run()
        assert answer.error == pb.WORKER_ERR_OK


@root_only
def test_a_job_user_that_is_root_or_unknown_is_refused(tmp_path):
    for user in ("0", "no-such-user-xyz"):
        done = subprocess.run(
            worker_argv(tmp_path, "--job-user", user, "--exec", "true"),
            capture_output=True,
            timeout=30,
        )
        assert done.returncode == 2 and b"--job-user" in done.stderr, done.stderr


# ------------------------------------------------------------------ pure parts


def test_rlimit_plan_caps_at_the_workers_hard_limits():
    import resource

    hard = {res: resource.RLIM_INFINITY for res in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9)}
    hard[resource.RLIMIT_NOFILE] = 512
    limits = JobLimits(memory_max=256 * MiB, cpu_time=1.5, open_files=4096, tasks_max=64)
    plan = dict(rlimit_plan(limits, hard, per_user=False))
    assert plan == {
        resource.RLIMIT_AS: (256 * MiB, 256 * MiB),
        resource.RLIMIT_CPU: (2, 3),
        resource.RLIMIT_NOFILE: (512, 512),
    }
    assert dict(rlimit_plan(limits, hard, per_user=True))[resource.RLIMIT_NPROC] == (64, 64)


def test_rlimit_hit_names_the_limit():
    limits = JobLimits(memory_max=256 * MiB, cpu_time=60, file_size=MiB, tasks_max=64)
    assert rlimit_hit(-signal.SIGXCPU, 60.0, 0, b"", limits, False) == "CPU time limit 60 s"
    assert rlimit_hit(-signal.SIGKILL, 61.0, 0, b"", limits, False) == "CPU time limit 60 s"
    assert rlimit_hit(-signal.SIGKILL, 1.0, 0, b"", limits, False) == ""
    assert rlimit_hit(-signal.SIGXFSZ, 0, 0, b"", limits, False) == "file size limit 1 MiB"
    assert rlimit_hit(128 + signal.SIGXFSZ, 0, 0, b"", limits, False) == "file size limit 1 MiB"
    assert rlimit_hit(1, 0, 250 * MiB, b"", limits, False).startswith("memory limit 256 MiB")
    assert rlimit_hit(1, 0, 20 * MiB, b"", limits, False) == ""
    refused = b"BlockingIOError: [Errno 11] Resource temporarily unavailable"
    assert rlimit_hit(1, 0, 0, refused, limits, True) == "process limit 64: a fork was refused"
    assert rlimit_hit(1, 0, 0, refused, limits, False) == ""


# ------------------------------------------------------------------ cgroup files (stand-in)


def test_cgroup_files_against_a_stand_in_directory(tmp_path):
    root = tmp_path / "cg"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    cgroup = Cgroup(root)
    (root / "worker").mkdir()
    cgroup.home = root / "worker"
    (root / "cgroup.subtree_control").write_text("")
    cgroup.setup()
    assert (root / "worker" / "cgroup.procs").read_text() == str(os.getpid())
    assert (root / "cgroup.subtree_control").read_text() == "+memory +pids +cpu"
    path = cgroup.create(JobLimits(memory_max=256 * MiB, tasks_max=64, cpu_quota=0.5))
    assert path == root / "job-1"
    assert (path / "memory.max").read_text() == str(256 * MiB)
    assert (path / "memory.swap.max").read_text() == "0"
    assert (path / "memory.oom.group").read_text() == "1"
    assert (path / "pids.max").read_text() == "64"
    assert (path / "cpu.max").read_text() == "50000 100000"
    cgroup.enter(path)
    assert (path / "cgroup.procs").read_text() == str(os.getpid())
    limits = JobLimits(memory_max=256 * MiB, tasks_max=64)
    (path / "memory.events").write_text("low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\n")
    assert cgroup_limit(path, limits) == (
        "memory limit 256 MiB reached: killed by the kernel (OOM)"
    )
    (path / "memory.events").write_text("low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n")
    (path / "pids.events").write_text("max 91\n")
    assert cgroup_limit(path, limits) == "process limit 64: 91 forks refused"
    (path / "memory.peak").write_text("123456\n")
    assert Cgroup.peak(path) == 123456
    cgroup.remove(path)
    assert not path.exists()


def test_cgroup_find_says_why_there_is_none(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/x\n0::/\n")
    with pytest.raises(SetupError, match="not a cgroup v2 mount"):
        Cgroup.find(proc, tmp_path / "nothing")
    proc.write_text("4:memory:/x\n")
    with pytest.raises(SetupError, match="cgroup v1 only"):
        Cgroup.find(proc, tmp_path)
    mount = tmp_path / "mnt"
    (mount / "svc").mkdir(parents=True)
    (mount / "cgroup.controllers").write_text("memory pids\n")
    (mount / "svc" / "cgroup.controllers").write_text("cpu\n")
    proc.write_text("0::/svc\n")
    with pytest.raises(SetupError, match="no memory or pids controller"):
        Cgroup.find(proc, mount)
    (mount / "svc" / "cgroup.controllers").write_text("cpu memory pids\n")
    (mount / "svc" / "cgroup.procs").write_text(f"{os.getpid()}\n1\n")
    with pytest.raises(SetupError, match="holds other processes"):
        Cgroup.find(proc, mount)
    (mount / "svc" / "cgroup.procs").write_text(f"{os.getpid()}\n")
    assert Cgroup.find(proc, mount) == mount / "svc"


@root_only
def test_user_keeps_only_the_capabilities_jobs_need(sockdir):
    """`worker --user U` started as root runs as U with CAP_SETUID, CAP_SETGID and CAP_KILL
    alone (it starts jobs as their users and stops them), and its jobs still run as the job
    user."""
    worker_uid = 61005
    os.chown(sockdir, worker_uid, 0)  # it binds its own socket there
    ctl = MiniController(sockdir)
    (sockdir / "main.sock").chmod(0o777)  # the worker, uid 61005, dials it
    ctl.listener.settimeout(30)
    argv = worker_argv(sockdir, "--user", str(worker_uid), "--job-user", str(JOB_UID))
    proc = subprocess.Popen([*argv, "--exec", "id", "-u"], stderr=subprocess.PIPE)
    try:
        ctl.wait_for(pb.PULSE_OK)
        status = Path(f"/proc/{proc.pid}/status").read_text()
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        assert fields["Uid"].split() == [str(worker_uid)] * 4
        assert fields["Groups"].split() == []
        assert int(fields["CapEff"], 16) == int(fields["CapPrm"], 16) == 0b11100000
        assert int(fields["CapInh"], 16) == 0
        answer, text = Driver(ctl, proc).run()
        assert (answer.error, text) == (pb.WORKER_ERR_OK, f"{JOB_UID}\n".encode())
    finally:
        proc.kill()
        proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
        ctl.listener.close()


@root_only
def test_a_daemon_a_job_leaves_outside_its_process_group_is_stopped(tmp_path):
    """setsid takes a process out of the job's process group; as its subreaper the worker
    gets it back once its parent ends, and stops it."""
    marker = "30.5151"
    job = ["sh", "-c", f"setsid sleep {marker} > /dev/null 2>&1 < /dev/null & echo started"]
    with worker(tmp_path, "--job-user", str(JOB_UID), "--exec", *job) as w:
        answer, text = w.run()
        assert (answer.error, text) == (pb.WORKER_ERR_OK, b"started\n")
        w.run()  # the next job: nothing of the last one is left by now

        def left() -> list[int]:
            return [p for p in _processes_named(marker) if _uid(p) == JOB_UID]

        wait_for_condition(lambda: not left(), 5)


def test_the_cgroup_half_runs_where_a_delegated_cgroup_v2_exists():
    """The kernel half of the cgroup limits needs a cgroup v2 subtree delegated to the
    worker alone (systemd's Delegate=yes); the file handling is tested above either way."""
    try:
        Cgroup.find()
    except SetupError as exc:
        pytest.skip(f"no delegated cgroup v2 memory controller here: {exc}")
    pytest.skip("this test process's own cgroup is delegated: the worker's half needs a unit")


def test_a_calculators_completed_task_carries_usage(tmp_path):
    from controller import datagram as dg

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as ctl:
        ctl.bind(("127.0.0.1", 0))
        ctl.settimeout(20)
        port = ctl.getsockname()[1]
        argv = [sys.executable, "-m", "worker", "--udp", f"127.0.0.1:{port}", "--log-level"]
        proc = subprocess.Popen([*argv, "ERROR", "--exec", "cat"])
        try:
            while True:  # its first heartbeat says where it is
                data, calculator = ctl.recvfrom(65536)
                beat = dg.decode(data)
                if beat is not None and beat.get("method") == "heartbeat":
                    break
            params: dict[str, object] = {"task_id": 9}
            dg.put_bytes(params, "payload", b"hello")
            ctl.sendto(dg.request("perform_task", params, 1), calculator)
            while True:
                data, _ = ctl.recvfrom(65536)
                packet = dg.decode(data)
                if packet and packet.get("method") == "completed_task":
                    break
            ctl.sendto(dg.ack(packet["transmission_id"]), calculator)  # nothing left to send
            report = packet["params"]
            assert report["status"] == "success" and dg.read_bytes(report, "result") == b"hello"
            usage = report["usage"]
            assert usage["wall"] > 0 and usage["max_rss"] > 0 and usage["cpu"] >= 0
        finally:
            proc.terminate()
            proc.wait(10)


@root_only
def test_a_worker_leaving_stops_every_process_of_its_job_user(tmp_path):
    """Its subreaper role ends with it: whatever still runs as its job user is stopped."""
    with worker(tmp_path, "--job-user", str(JOB_UID), "--exec", "true") as w:
        w.run()
        stray = subprocess.Popen(["sleep", "30"], user=JOB_UID, group=JOB_UID, extra_groups=[])
    assert stray.wait(10) == -signal.SIGKILL


def test_a_job_user_in_the_workers_own_group_is_refused():
    from worker.limits.jail import Jail
    from worker.limits.users import JobUser

    with pytest.raises(SetupError, match="a group of its own"):
        Jail(JobUser(61001, os.getegid(), "shares-my-group")).setup()


# A job that leaves a chain of processes, each in a session of its own and the parent of the
# next, all holding its stdout: only its main process ends. The worker, their subreaper, gets
# one link back for each link it stops.
CHAIN = """
import os, sys, time
ready_r, ready_w = os.pipe()
for level in range(int(sys.argv[2])):
    if os.fork():
        if level == 0:
            os.read(ready_r, 1)  # the whole chain is there
            print("started", flush=True)
            os._exit(0)
        while True:
            time.sleep(60)
    os.setsid()
os.write(ready_w, b"x")
os.execvp("sleep", ["sleep", sys.argv[1]])
"""


@root_only
def test_a_chain_of_sessions_a_job_leaves_is_stopped_when_it_ends(tmp_path):
    marker = "30.6262"
    job = [PYTHON, "-c", CHAIN, marker, "100"]
    with worker(tmp_path, "--job-user", str(JOB_UID), "--exec", *job) as w:
        started = time.monotonic()
        answer, text = w.run()
        assert (answer.error, text) == (pb.WORKER_ERR_OK, b"started\n")
        assert time.monotonic() - started < 20  # not held open by the chain
        assert [p for p in _processes_named(marker) if _uid(p) == JOB_UID] == []


# A job that forks as its very first instruction (a static binary: no dynamic loader before
# it), before the worker's prlimit of its main process can land: by TASK_ID, a child of its
# main thread (1), of a thread it makes first (2), or a grandchild whose parent exits at once,
# so that it comes back to the worker as an orphan (0). Each process reports the RLIMIT_AS
# and RLIMIT_CPU it runs under after a 50 ms spin (the worker has caught up by then).
EARLY_FORK = r"""
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static void spin(void) {
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    do clock_gettime(CLOCK_MONOTONIC, &now);
    while ((now.tv_sec - start.tv_sec) * 1000000000L + (now.tv_nsec - start.tv_nsec)
           < 50000000L);
}

static void report(const char *who) {
    struct rlimit as, cpu;
    getrlimit(RLIMIT_AS, &as);
    getrlimit(RLIMIT_CPU, &cpu);
    char line[128];
    int n = snprintf(line, sizeof line, "%s %lld %lld\n", who, (long long)as.rlim_cur,
                     (long long)cpu.rlim_cur);
    if (write(1, line, n) != n) _exit(1);
}

static void *forker(void *arg) {
    (void)arg;
    pid_t pid = fork();
    if (pid == 0) { spin(); report("child"); _exit(0); }
    waitpid(pid, NULL, 0);
    return NULL;
}

int main(void) {
    const char *task = getenv("TASK_ID");
    int how = task ? atoi(task) % 3 : 1;
    if (how == 2) {
        pthread_t thread;
        pthread_create(&thread, NULL, forker, NULL);
        pthread_join(thread, NULL);
    } else if (how == 0) {
        int done[2];
        if (pipe(done) != 0) return 1;
        pid_t pid = fork();
        if (pid == 0) {
            if (fork() == 0) { close(done[0]); spin(); report("grandchild"); _exit(0); }
            _exit(0);
        }
        close(done[1]);
        char c;
        while (read(done[0], &c, 1) > 0) {}  /* until the grandchild has ended */
        waitpid(pid, NULL, 0);
    } else {
        forker(NULL);
    }
    report("main");
    return 0;
}
"""


def _compiled(build: str, source_text: str) -> Path:
    """`source_text` built as a static program (dynamic where there is no static libc: a
    little later to start) in `build`, a directory a job user can reach."""
    os.chmod(build, 0o755)
    source, program = Path(build, "job.c"), Path(build, "job")
    source.write_text(source_text)
    made = subprocess.run(
        ["cc", "-O1", "-static", "-pthread", "-o", str(program), str(source)],
        capture_output=True,
    )
    if made.returncode != 0:
        made = subprocess.run(
            ["cc", "-O1", "-pthread", "-o", str(program), str(source)], capture_output=True
        )
    assert made.returncode == 0, made.stderr
    return program


@root_only
@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc) to build the job")
@pytest.mark.parametrize("worker_user", [None, 61005], ids=["root", "user"])
def test_processes_a_job_makes_before_its_limits_land_get_them_too(sockdir, worker_user):
    """posix_spawn returns before the job's limits are set on it (prlimit); what it forks in
    that moment is found and limited as well: its threads' children and the orphans that
    come back to the worker; by a worker running as root, and by one that runs as its
    `--user` with only CAP_SETUID, CAP_SETGID and CAP_KILL."""
    with tempfile.TemporaryDirectory() as build:  # under /tmp: the job user can run it
        program = _compiled(build, EARLY_FORK)
        limited = f"{1 << 30} 60\n".encode()
        args = ["--job-user", str(JOB_UID), "--memory-max", "1G", "--cpu-time", "60"]
        with worker(sockdir, *args, "--exec", str(program), user=worker_user) as w:
            for _ in range(4):
                for first in (b"child ", b"child ", b"grandchild "):
                    answer, text = w.run()
                    assert answer.error == pb.WORKER_ERR_OK, text
                    lines = text.splitlines(keepends=True)
                    assert [line.split()[0] + b" " for line in lines] == [first, b"main "]
                    assert [line.split(b" ", 1)[1] for line in lines] == [limited] * 2, text


# A job that maps 4 GiB of address space as its very first instruction, before its
# memory_max (RLIMIT_AS) can land, then says whether it got it, after a 50 ms spin.
EARLY_MAP = r"""
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

int main(void) {
    void *p = mmap(NULL, 4UL << 30, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    do clock_gettime(CLOCK_MONOTONIC, &now);
    while ((now.tv_sec - start.tv_sec) * 1000000000L + (now.tv_nsec - start.tv_nsec)
           < 50000000L);
    if (p == MAP_FAILED) return write(1, "refused\n", 8) != 8;
    return write(1, "mapped\n", 7) != 7;
}
"""


@root_only
@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc) to build the job")
def test_a_job_that_maps_past_memory_max_before_it_lands_is_stopped(tmp_path):
    """RLIMIT_AS refuses new mappings only: a job that mapped more before its limit landed
    is killed, and its error names the limit."""
    with tempfile.TemporaryDirectory() as build:
        program = _compiled(build, EARLY_MAP)
        args = ["--job-user", str(JOB_UID), "--memory-max", "1G"]
        with worker(tmp_path, *args, "--exec", str(program)) as w:
            for _ in range(8):
                answer, text = w.run()
                if answer.error == pb.WORKER_ERR_OK:
                    assert text == b"refused\n"
                else:
                    assert answer.reason == "limit", text
                    assert text.startswith(b"memory limit 1 GiB reached: mapped past it"), text

"""Operations: sd_notify and the watchdog, local supervision, peer and socket-owner checks."""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import trio

from controller.affinity import AffinityError, format_cpus, parse_cpus, pin
from controller.core import TaskState
from controller.shell.sdnotify import Notifier
from controller.shell.supervisor import Supervisor, worker_command
from gen import worker_protocol_pb2 as pb
from tests.fakes import FakeWorker
from tests.helpers import (
    controller_argv,
    free_tcp_port,
    free_udp_port,
    reap,
    run_udp_client,
    running_controller,
    wait_for_condition,
    wait_until,
    write_config,
)

NOBODY = 65534


class NotifyListener:
    """A datagram socket standing in for systemd's NOTIFY_SOCKET, timestamping what arrives."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, str]] = []
        self._stop = False
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop:
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            self.messages.append((time.monotonic(), data.decode()))

    def texts(self) -> list[str]:
        return [text for _, text in self.messages]

    def wait_for(self, text: str, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not any(m.startswith(text) for m in self.texts()):
            assert time.monotonic() < deadline, f"no {text!r} in {self.texts()[-5:]}"
            time.sleep(0.01)

    def close(self) -> None:
        self._stop = True
        self._thread.join()
        self.sock.close()


def test_sd_notify_ready_status_watchdog_stopping(tmp_path, sockdir):
    listener = NotifyListener(tmp_path / "notify.sock")
    config = write_config(
        tmp_path,
        socket_dir=str(sockdir),
        journal=None,
        client_address={"host": "127.0.0.1", "port": free_udp_port()},
    )
    env = dict(os.environ, NOTIFY_SOCKET=str(listener.path), WATCHDOG_USEC="400000")
    proc = subprocess.Popen(
        controller_argv(config),
        env=env,
        stderr=subprocess.DEVNULL,
    )
    try:
        listener.wait_for("READY=1")
        assert (sockdir / "main.sock").exists()  # READY only once serving
        listener.wait_for("STATUS=0 workers")
        deadline = time.monotonic() + 5
        while listener.texts().count("WATCHDOG=1") < 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        listener.wait_for("STOPPING=1")
        texts = listener.texts()
        assert texts.index("READY=1") < texts.index("STOPPING=1")
    finally:
        proc.kill()
        proc.wait()
        listener.close()


@pytest.fixture
def watchdog(tmp_path):
    """A listener and a notifier pinging it every 50 ms (WATCHDOG_USEC 100 ms)."""
    listener = NotifyListener(tmp_path / "notify.sock")
    notifier = Notifier({"NOTIFY_SOCKET": str(listener.path), "WATCHDOG_USEC": "100000"})
    yield listener, notifier
    notifier.close()
    listener.close()


def pings(listener: NotifyListener, after: float = 0.0) -> list[float]:
    return [t for t, text in listener.messages if text == "WATCHDOG=1" and t > after]


async def test_watchdog_pings_stop_while_the_loop_is_blocked(watchdog):
    listener, notifier = watchdog
    async with trio.open_nursery() as nursery:
        nursery.start_soon(notifier.run, lambda: "ok", lambda: 0.0)
        await wait_until(lambda: len(pings(listener)) >= 3, timeout=5)
        blocked_at = time.monotonic()
        time.sleep(0.6)  # noqa: ASYNC251 -- on purpose: the event loop is stuck
        unblocked_at = time.monotonic()
        await wait_until(lambda: bool(pings(listener, after=unblocked_at)), timeout=5)
        nursery.cancel_scope.cancel()
    assert not any(blocked_at + 0.05 < t < unblocked_at - 0.05 for t in pings(listener))


async def test_no_watchdog_while_scheduler_lags(watchdog):
    listener, notifier = watchdog
    checks = []

    def lag() -> float:
        checks.append(1)
        return 60.0

    async with trio.open_nursery() as nursery:
        nursery.start_soon(notifier.run, lambda: "behind", lag)
        await wait_until(
            lambda: len(checks) >= 5 and "STATUS=behind" in listener.texts(), timeout=5
        )
        nursery.cancel_scope.cancel()
    assert pings(listener) == []


def test_notifier_is_silent_outside_systemd():
    notifier = Notifier({})
    assert not notifier.enabled
    notifier.notify("READY=1")  # does nothing, raises nothing


# ---------------------------------------------------------------- local supervision


def test_supervised_workers_are_tied_to_this_controller_by_pid():
    """A worker that starts after its controller has gone sees another parent and exits."""
    argv = worker_command("/run/x", ["--pulse", "2"])
    at = argv.index("--exit-with-parent")
    assert argv[at + 1] == str(os.getpid())
    assert argv[-2:] == ["--pulse", "2"]


async def test_supervisor_restarts_a_killed_worker(caplog):
    supervisor = Supervisor(1, ["sleep", "30"])
    with caplog.at_level(logging.INFO, logger="controller.supervisor"):
        async with trio.open_nursery() as nursery:
            await nursery.start(supervisor.run)
            await wait_until(lambda: 0 in supervisor.pids)
            first = supervisor.pids[0]
            os.kill(first, signal.SIGKILL)
            await wait_until(lambda: supervisor.pids.get(0, first) != first, timeout=5)
            nursery.cancel_scope.cancel()
    assert "killed by SIGKILL" in caplog.text


async def test_supervisor_backs_off_for_a_worker_that_exits_at_once(caplog):
    supervisor = Supervisor(1, ["sh", "-c", "exit 3"])
    with caplog.at_level(logging.WARNING, logger="controller.supervisor"):
        async with trio.open_nursery() as nursery:
            start = trio.current_time()
            await nursery.start(supervisor.run)
            await wait_until(lambda: supervisor.restarts >= 4, timeout=10)
            elapsed = trio.current_time() - start
            nursery.cancel_scope.cancel()
    # Between four exits it waited 0.1 + 0.2 + 0.4 s: a doubling delay, not a fork loop.
    assert elapsed >= 0.7
    assert "exited with status 3" in caplog.text


async def test_supervisor_rides_out_a_failed_start(caplog, monkeypatch):
    real = trio.lowlevel.open_process
    failures = [OSError(errno.EMFILE, "Too many open files")]

    async def flaky(*args, **kwargs):
        if failures:
            raise failures.pop()
        return await real(*args, **kwargs)

    monkeypatch.setattr(trio.lowlevel, "open_process", flaky)
    supervisor = Supervisor(1, ["sleep", "30"])
    with caplog.at_level(logging.WARNING, logger="controller.supervisor"):
        async with trio.open_nursery() as nursery:
            await nursery.start(supervisor.run)
            await wait_until(lambda: 0 in supervisor.pids, timeout=5)
            nursery.cancel_scope.cancel()
    assert "Too many open files" in caplog.text


# ---------------------------------------------------------------- peer credentials


def can_run_as_nobody() -> bool:
    if os.getuid() != 0:
        return False
    probe = subprocess.run(
        [
            "setpriv",
            f"--reuid={NOBODY}",
            f"--regid={NOBODY}",
            "--clear-groups",
            sys.executable,
            "-c",
            "import controller.wire",
        ],
        capture_output=True,
    )
    return probe.returncode == 0


as_root = pytest.mark.skipif(
    not can_run_as_nobody(), reason="needs root and a repo nobody can read"
)


def run_as_nobody(*args: str) -> subprocess.Popen[bytes]:
    cmd = [
        "setpriv",
        f"--reuid={NOBODY}",
        f"--regid={NOBODY}",
        "--clear-groups",
        sys.executable,
        *args,
    ]
    return subprocess.Popen(cmd, stderr=subprocess.PIPE)


@as_root
async def test_worker_of_unknown_uid_is_refused(sockdir):
    sockdir.chmod(0o711)
    async with running_controller(sockdir) as (shell, _):
        os.chmod(sockdir / "main.sock", 0o666)
        proc = run_as_nobody("-m", "worker", "--socket-dir", str(sockdir))
        assert proc.stderr is not None
        try:
            with trio.fail_after(20):  # the worker's own account of it, not just our counter
                while b"registration refused" not in await trio.to_thread.run_sync(
                    proc.stderr.readline
                ):
                    pass
            assert shell.refused_peers >= 1 and shell.core.workers == {}
        finally:
            reap(proc)


@as_root
async def test_worker_of_allowed_uid_runs_tasks(sockdir):
    # Nobody's own directory (no one else may write there): allowed_uids admits it, not its group.
    os.chown(sockdir, NOBODY, -1)
    sockdir.chmod(0o755)
    async with running_controller(sockdir, allowed_uids=(0, NOBODY)) as (shell, outcomes):
        os.chmod(sockdir / "main.sock", 0o666)
        proc = run_as_nobody("-m", "worker", "--socket-dir", str(sockdir))
        try:
            await wait_until(lambda: shell.core.idle_workers == 1)
            [worker] = shell.core.workers.values()
            assert worker.uid == NOBODY
            shell.submit(3, b"as nobody")
            [done] = await outcomes.wait(1)
            assert (done.state, done.result) == (TaskState.SUCCESS, b"as nobody")
        finally:
            reap(proc)


@as_root
async def test_pulse_for_another_uids_worker_is_refused(sockdir, nursery):
    sockdir.chmod(0o711)
    async with running_controller(sockdir, allowed_uids=(0, NOBODY)):
        os.chmod(sockdir / "main.sock", 0o666)
        w = await FakeWorker(sockdir).start(nursery)  # registered by root
        script = (
            "import socket, sys; from controller import wire; "
            "from gen import worker_protocol_pb2 as pb\n"
            f"msg = pb.WorkerPulse(type=pb.PULSE_OK, worker_id={w.worker_id}, next_pulse=2)\n"
            "s = socket.socket(socket.AF_UNIX); s.settimeout(5)\n"
            f"s.connect({str(sockdir / 'main.sock')!r}); s.sendall(wire.encode_frame(msg))\n"
            "resp, _ = wire.whole_frame(pb.PulseResponse, s.recv(4096), 0)\n"
            "sys.exit(resp.error)"
        )
        proc = run_as_nobody("-c", script)
        with trio.fail_after(20):
            while proc.poll() is None:
                await trio.sleep(0.02)
        reap(proc)
        assert proc.returncode == pb.CTRL_ERR_FAILED


@as_root
async def test_socket_owned_by_another_uid_is_not_dialled(sockdir, nursery):
    async with running_controller(sockdir) as (shell, outcomes):
        squatted = await FakeWorker(sockdir).start(nursery)
        os.chown(sockdir / f"{squatted.worker_id}.sock", NOBODY, NOBODY)
        shell.submit(1, b"x")
        await wait_until(lambda: squatted.worker_id not in shell.core.workers)
        assert squatted.received == []  # nothing was sent to that socket
        assert shell.core.counters.worker_losses == {"socket owned by another uid": 1}
        good = await FakeWorker(sockdir).start(nursery)
        await good.wait_for(pb.CTRL_SET_TASK)
        await good.pulse(pb.PULSE_FETCH_ME)
        assert (await outcomes.wait(1))[0].state is TaskState.SUCCESS


# ---------------------------------------------------------------- metrics


def test_metrics_scrape_parses(tmp_path, sockdir):
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    udp, http = free_udp_port(), free_tcp_port()
    config = write_config(
        tmp_path,
        socket_dir=str(sockdir),
        journal=None,
        client_address={"host": "127.0.0.1", "port": udp},
        metrics_address={"host": "127.0.0.1", "port": http},
    )
    proc = subprocess.Popen(
        controller_argv(
            config, "--workers", "1", "--", "--queues", "default,q2", "--labels", "gpu"
        ),
        stderr=subprocess.DEVNULL,
    )
    try:
        done = run_udp_client(udp, "--timeout", "20", "add", "1-5", "--payload", "m")
        assert done.returncode == 0, done.stderr
        deadline = time.monotonic() + 10
        while True:
            text = (
                urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=5)
                .read()
                .decode()
            )
            samples = {
                (s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text)
                for s in family.samples
            }
            if samples.get(("controller_workers", ())) == 1.0:
                break
            assert time.monotonic() < deadline, "workers gauge never refreshed"
            time.sleep(0.1)
        assert samples[("controller_tasks_total", (("outcome", "success"),))] == 5.0
        assert samples[("controller_task_seconds_count", ())] == 5.0
        assert samples[("controller_placement_seconds_count", ())] == 5.0
        assert samples[("controller_queue_depth", ())] == 0.0
        assert samples[("controller_workers_by_kind", (("kind", "local"),))] == 1.0
        assert samples[("controller_workers_by_kind", (("kind", "calculator"),))] == 0.0
        assert samples[("controller_queue_workers", (("queue", "q2"),))] == 1.0
        assert samples[("controller_queue_paused", (("queue", "q2"),))] == 0.0
        assert samples[("controller_label_workers", (("label", "gpu"),))] == 1.0
        assert samples[("controller_tasks_scheduled", ())] == 0.0
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def test_metrics_address_in_use_is_a_startup_error(tmp_path, sockdir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        config = write_config(
            tmp_path,
            socket_dir=str(sockdir),
            journal=None,
            client_address={"host": "127.0.0.1", "port": 0},
            metrics_address={"host": "127.0.0.1", "port": port},
        )
        proc = subprocess.run(
            controller_argv(config),
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert proc.returncode == 2 and f"metrics_address 127.0.0.1:{port}" in proc.stderr


# ---------------------------------------------------------------- CPU affinity


@pytest.mark.parametrize(("text", "cpus"), [("0", {0}), ("0,0", {0}), ("0-0", {0}), (" 0 ", {0})])
def test_cpu_list_parses(text, cpus):
    assert parse_cpus(text) == cpus


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "expected a CPU list"),
        ("x", "expected a CPU list"),
        ("0,", "expected a CPU list"),
        ("1-", "expected a CPU list"),
        ("-1", "expected a CPU list"),
        ("3-1", "empty CPU range"),
        ("4096", "CPU 4096 not available here"),
    ],
)
def test_bad_cpu_list_is_a_usage_error(text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        parse_cpus(text)


@pytest.mark.parametrize("command", ["controller", "worker"])
def test_cpus_outside_the_machine_exit_2(command):
    proc = subprocess.run(
        [sys.executable, "-m", command, "--cpus", "4096"], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "--cpus: CPU 4096 not available here" in proc.stderr


def test_refused_cpu_list_is_a_clear_error(monkeypatch):
    def refuse(pid, cpus):
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))

    monkeypatch.setattr(os, "sched_setaffinity", refuse)
    with pytest.raises(
        AffinityError, match=r"--cpus 0: the system refused it \(Invalid argument\)"
    ):
        pin(frozenset({0}))


def test_cpu_list_short_form():
    assert format_cpus({0, 1, 2, 3, 6}) == "0-3,6"
    assert format_cpus({5}) == "5"


def affinity_of(pid: int) -> set[int]:
    return set(os.sched_getaffinity(pid))


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def worker_pids(controller: int) -> list[int]:
    """The local workers a controller started: children of any of its threads (trio starts
    processes from a thread) that are workers (Python itself may run a helper such as
    `ldconfig -p` while starting)."""
    children = []
    for task in Path(f"/proc/{controller}/task").glob("*/children"):
        with contextlib.suppress(OSError):  # a thread that just ended
            children += [int(pid) for pid in task.read_text().split()]
    return [pid for pid in children if " -m worker " in cmdline(pid)]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
@pytest.mark.parametrize("own", [False, True])
def test_controller_cpus_pins_itself_not_its_workers(tmp_path, own):
    first, second = sorted(os.sched_getaffinity(0))[:2]
    config = write_config(
        tmp_path,
        socket_dir=str(tmp_path / "s"),
        client_address={"host": "127.0.0.1", "port": free_udp_port()},
        journal=None,
    )
    worker_args = ["--", "--cpus", str(second)] if own else []
    cmd = controller_argv(config, "--cpus", str(first))
    log = (tmp_path / "controller.log").open("wb")
    proc = subprocess.Popen([*cmd, "--workers", "1", *worker_args], stderr=log)
    try:
        wait_for_condition(lambda: len(worker_pids(proc.pid)) == 1)
        [worker] = worker_pids(proc.pid)
        expected = {second} if own else set(os.sched_getaffinity(0))
        # The worker applies its own list once Python has started.
        wait_for_condition(lambda: affinity_of(worker) == expected)
        assert affinity_of(proc.pid) == {first}, (tmp_path / "controller.log").read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()


# ---------------------------------------------------------------- --nice


def read_log(tmp_path: Path) -> str:
    return (tmp_path / "controller.log").read_text()


def nice_of(pid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, pid)


def may_raise_priority() -> bool:
    """Root, or CAP_SYS_NICE: a process here may lower its own nice value."""
    probe = "import os; os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) - 1)"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


def start_with_one_worker(
    tmp_path: Path, *args: str, prefix: tuple[str, ...] = ()
) -> tuple[subprocess.Popen[bytes], int]:
    config = write_config(
        tmp_path,
        socket_dir=str(tmp_path / "s"),
        client_address={"host": "127.0.0.1", "port": free_udp_port()},
        journal=None,
    )
    cmd = [*prefix, *controller_argv(config, *args, "--workers", "1", log_level="INFO")]
    with (tmp_path / "controller.log").open("wb") as log:
        proc = subprocess.Popen(cmd, stderr=log)
    wait_for_condition(lambda: len(worker_pids(proc.pid)) == 1)
    return proc, worker_pids(proc.pid)[0]


def test_by_default_the_controller_and_its_workers_run_as_started(tmp_path):
    started = nice_of(0)
    proc, worker = start_with_one_worker(tmp_path)
    try:
        threads = [int(t.name) for t in Path(f"/proc/{proc.pid}/task").iterdir()]
        assert {nice_of(tid) for tid in threads} == {started} and nice_of(worker) == started
        assert "nice" not in read_log(tmp_path)
    finally:
        proc.terminate()
        proc.wait(timeout=20)


@pytest.mark.skipif(not may_raise_priority(), reason="needs root or CAP_SYS_NICE")
def test_nice_runs_the_controller_ahead_of_its_workers(tmp_path):
    started = nice_of(0)
    proc, worker = start_with_one_worker(tmp_path, "--nice", "-10")
    try:
        # The worker inherited the controller's level and is given the starting one back.
        wait_for_condition(lambda: nice_of(worker) == started)
        threads = [int(t.name) for t in Path(f"/proc/{proc.pid}/task").iterdir()]
        assert len(threads) > 1  # trio started threads: they run at the controller's level
        assert {nice_of(tid) for tid in threads} == {max(-20, started - 10)}
        assert f"running at nice {max(-20, started - 10)} (started at {started}" in read_log(
            tmp_path
        )
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_without_the_right_to_it_the_controller_says_so_and_runs_as_started(tmp_path):
    started = nice_of(0)
    # As root, drop the capability for the controller alone; otherwise it has none anyway.
    no_right = ("setpriv", "--bounding-set=-sys_nice", "--inh-caps=-sys_nice")
    privileged = may_raise_priority()
    if privileged and shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is needed to drop CAP_SYS_NICE")
    proc, worker = start_with_one_worker(
        tmp_path, "--nice", "-10", prefix=no_right if privileged else ()
    )
    try:
        wait_for_condition(lambda: "needs root or CAP_SYS_NICE" in read_log(tmp_path))
        assert nice_of(proc.pid) == started and nice_of(worker) == started
        assert f"staying at nice {started}" in read_log(tmp_path)
    finally:
        proc.terminate()
        proc.wait(timeout=20)


@pytest.mark.parametrize(
    ("value", "message"), [("40", "must be -39 to 39"), ("ahead", "expected a whole number")]
)
def test_a_bad_nice_adjustment_is_a_usage_error(value, message):
    proc = subprocess.run(
        [sys.executable, "-m", "controller", "--nice", value], capture_output=True, text=True
    )
    assert proc.returncode == 2 and message in proc.stderr

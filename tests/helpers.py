"""Helpers shared by the tests and the benchmarks (which import them from here).

Free ports, stopping processes by pid, waiting on a condition with a
deadline, command lines of real controllers and workers, per-connection
trio helpers for fake peers on Unix sockets, the seeded lossy UDP router,
and an in-process controller shell.
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio
from google.protobuf.message import Message

from controller import wire
from controller.config import Config
from controller.core import TaskFinished
from controller.shell.core_shell import CoreShell
from controller.transport import CONNECT_RETRY
from gen import worker_protocol_pb2 as pb

# ---------------------------------------------------------------- ports and processes


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def reap(proc: subprocess.Popen[bytes]) -> bytes:
    """Kill what the test started, by its pid; return its stderr if it was piped."""
    proc.kill()
    proc.wait()
    if proc.stderr is None:
        return b""
    out = proc.stderr.read()
    proc.stderr.close()
    return out


async def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll a condition with a deadline (for state that has no event to wait on)."""
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.005)


def wait_for_condition(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """`wait_until` for code outside trio."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


# ---------------------------------------------------------------- command lines


def write_config(directory: Path, **settings: object) -> Path:
    """A controller.json in `directory` with these settings; no journal unless one is named
    (the default journal is the machine's own, under /var/lib)."""
    settings.setdefault("journal", None)
    path = directory / "controller.json"
    path.write_text(json.dumps(settings))
    return path


def recording_exec(execlog: Path) -> list[str]:
    """`--exec` arguments for a job that logs its TASK_ID (to count executions) and echoes."""
    return ["--exec", "sh", "-c", f'echo "$TASK_ID" >> {execlog}; cat']


def controller_argv(config: Path, *args: str, log_level: str | None = None) -> list[str]:
    """The command line of a real controller with this config file, plus `args`."""
    level = ["--log-level", log_level] if log_level is not None else []
    return [sys.executable, "-m", "controller", "--config", str(config), *level, *args]


@contextmanager
def logged_process(argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A process started with `argv`, its stderr appended to `log`; terminated (killed after
    10 s) and reaped at the end."""
    with log.open("ab") as sink:
        proc = subprocess.Popen(argv, stderr=sink)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        reap(proc)


def remote_worker_argv(*args: str) -> list[str]:
    """The command line of a remote worker (a calculator or a poller: `args` say which)."""
    return [sys.executable, "-m", "worker", "--log-level", "WARNING", *args]


def worker_argv(socket_dir: Path, *args: str, log_level: str = "ERROR") -> list[str]:
    """The command line of one real worker on `socket_dir` (quiet by default), plus `args`."""
    return [
        sys.executable,
        "-m",
        "worker",
        "--socket-dir",
        str(socket_dir),
        "--log-level",
        log_level,
        *args,
    ]


# ---------------------------------------------------------------- fake peers on Unix sockets
# One trio task per connection: simple, and slow enough not to matter in a fake.


async def accept(listener: socket.socket) -> socket.socket:
    """The next connection, non-blocking."""
    while True:
        try:
            conn, _ = listener.accept()
        except BlockingIOError:
            await trio.lowlevel.wait_readable(listener)
            continue
        conn.setblocking(False)
        return conn


async def connect_unix(path: str | Path, timeout: float) -> socket.socket:
    """A connected non-blocking socket; OSError when nobody listens, PeerTimeout when full."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    deadline = trio.current_time() + timeout
    try:
        while True:
            try:
                sock.connect(str(path))
                return sock
            except BlockingIOError:
                if trio.current_time() >= deadline:
                    raise wire.PeerTimeout(
                        f"{path}: listen backlog full for {timeout:g} s"
                    ) from None
                await trio.sleep(CONNECT_RETRY)
    except BaseException:
        sock.close()
        raise


async def recv_exactly(sock: socket.socket, n: int) -> bytes:
    """`n` bytes from a non-blocking socket, waiting for them (at most 5 s)."""
    out = b""
    with trio.fail_after(5):
        while len(out) < n:
            try:
                chunk = sock.recv(n - len(out))
            except BlockingIOError:
                await trio.lowlevel.wait_readable(sock)
                continue
            if not chunk:
                raise EOFError
            out += chunk
    return out


async def fake_channel(
    sockdir: Path, pulse_task: int = 0, next_pulse: int = 30, takes_next: bool = False
) -> tuple[int, socket.socket]:
    """Register asking for a channel (and with `takes_next`, a next task) and open it, as a
    worker would: (worker id, the channel's socket)."""
    main = sockdir / "main.sock"
    sock = await connect_unix(main, 5)
    with sock:
        register = pb.WorkerPulse(
            type=pb.PULSE_REGISTER, next_pulse=next_pulse, channel=True, takes_next=takes_next
        )
        await wire.send_frame(sock, register, timeout=5)
        answer, _ = await wire.recv_frame(sock, pb.PulseResponse, timeout=5)
    assert answer.error == pb.CTRL_ERR_OK and answer.channel
    assert answer.takes_next == takes_next
    wid = answer.worker_id
    chan = await connect_unix(main, 5)
    opening = pb.WorkerPulse(
        type=pb.PULSE_OK, worker_id=wid, task_id=pulse_task, next_pulse=next_pulse, channel=True
    )
    await wire.send_frame(chan, opening, timeout=5)
    # The answer is read byte by byte: what follows it is the channel's.
    header = b""
    while not header or header[-1] & 0x80:
        header += await recv_exactly(chan, 1)
    opened = pb.PulseResponse.FromString(await recv_exactly(chan, header[0]))
    assert opened.error == pb.CTRL_ERR_OK and opened.channel
    return wid, chan


async def exchange(
    path: str | Path,
    msg: Message,
    answer_type: type[wire.M],
    extra: bytes = b"",
    timeout: float = 5.0,
    max_extra_size: int = wire.DEFAULT_MAX_EXTRA_SIZE,
) -> tuple[wire.M, bytes]:
    """Dial `path`, send one frame, read the one frame that answers it, close."""
    sock = await connect_unix(path, timeout)
    with sock:
        await wire.send_frame(sock, msg, extra, timeout=timeout)
        return await wire.recv_frame(
            sock, answer_type, timeout=timeout, max_extra_size=max_extra_size
        )


async def recv_all(sock, timeout: float = 5.0) -> bytes:
    """Everything the peer sends until it closes."""
    out = b""
    with trio.fail_after(timeout):
        while True:
            try:
                chunk = sock.recv(65536)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(sock)
                continue
            if not chunk:
                return out
            out += chunk


async def send_raw(path: Path, data: bytes, timeout: float = 5.0) -> bytes:
    """Send arbitrary bytes, return whatever comes back before the peer closes."""
    with await connect_unix(path, timeout) as sock:
        sock.sendall(data) if len(data) < 65536 else await _send_big(sock, data)
        return await recv_all(sock, timeout)


async def _send_big(sock, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[sock.send(view) :]
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock)


# ---------------------------------------------------------------- a lossy network


async def lossy_router(
    rng: random.Random,
    server: tuple[str, int],
    *,
    drop: float,
    dup: float,
    reorder: float,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Forward datagrams client <-> server, dropping, duplicating and delaying some."""
    down = trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    up = trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    await down.bind(("127.0.0.1", 0))
    await up.bind(("127.0.0.1", 0))
    client: list[Any] = []

    async def deliver(sock: Any, data: bytes, addr: Any) -> None:
        if rng.random() < reorder:
            await trio.sleep(rng.uniform(0.001, 0.05))
        with contextlib.suppress(
            OSError
        ):  # the controller is down: a lost datagram, like any other
            await sock.sendto(data, addr)

    async def pump(src: Any, dst: Any, nursery: trio.Nursery, to_client: bool) -> None:
        while True:
            try:
                data, addr = await src.recvfrom(65535)
            except OSError:
                continue  # ICMP port unreachable while the controller restarts
            if not to_client and not client:
                client.append(addr)
            target = client[0] if to_client else server
            if rng.random() < drop:
                continue
            for _ in range(2 if rng.random() < dup else 1):
                nursery.start_soon(deliver, dst, data, target)

    with down, up:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pump, down, up, nursery, False)
            nursery.start_soon(pump, up, down, nursery, True)
            task_status.started(down.getsockname())


# ---------------------------------------------------------------- an in-process controller


class Outcomes:
    """Collects finished tasks; `wait(n)` blocks until n have arrived."""

    def __init__(self) -> None:
        self.items: list[TaskFinished] = []
        self._changed = trio.Event()

    def __call__(self, finished: TaskFinished) -> None:
        self.items.append(finished)
        self._changed.set()
        self._changed = trio.Event()

    async def wait(self, count: int = 1, timeout: float = 10.0) -> list[TaskFinished]:
        with trio.fail_after(timeout):
            while len(self.items) < count:
                await self._changed.wait()
        return self.items


@asynccontextmanager
async def running_controller(
    sockdir: Path, **settings: object
) -> AsyncIterator[tuple[CoreShell, Outcomes]]:
    outcomes = Outcomes()
    config = Config(socket_dir=sockdir, journal=None).replace(**settings)
    shell = CoreShell(config)
    shell.connect(finished=outcomes)
    async with trio.open_nursery() as nursery:
        await nursery.start(shell.serve)
        yield shell, outcomes
        nursery.cancel_scope.cancel()


def run_udp_client(
    port: int, *args: str, timeout: float = 30
) -> subprocess.CompletedProcess[bytes]:
    """Run `udp-client --server 127.0.0.1:PORT ARGS...` to its end (bounded)."""
    cmd = [sys.executable, "-m", "controller.client", "--server", f"127.0.0.1:{port}", *args]
    return subprocess.run(cmd, capture_output=True, timeout=timeout + 30)


# ---------------------------------------------------------------- a live controller process


@dataclass
class LiveController:
    url: str  # the HTTP API
    udp_port: int
    proc: subprocess.Popen[bytes]


def _answers(url: str, context: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1, context=context) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


@contextlib.contextmanager
def live_controller(
    tmp: Path,
    *args: str,
    launcher: tuple[str, ...] = (),
    ca_file: Path | None = None,
    **settings: Any,
) -> Iterator[LiveController]:
    """A real controller (both doors, a journal in `tmp`) with `args` (e.g. --workers 2),
    started through `launcher` (e.g. prlimit and its options) if given; stopped by pid at
    the end, and checked for tracebacks. With `http_tls` among the settings its URL is
    https://, trusted through `ca_file`."""
    http_port, udp_port = free_tcp_port(), free_udp_port()
    config = write_config(
        tmp,
        **{
            "socket_dir": str(tmp / "s"),
            "journal": str(tmp / "journal.sqlite3"),
            "client_address": {"host": "127.0.0.1", "port": udp_port},
            "http_address": {"host": "127.0.0.1", "port": http_port},
            **settings,
        },
    )
    # Its log goes to a file, not a pipe: a pipe nobody reads blocks a talkative controller.
    log = tmp / "controller.log"
    with log.open("ab") as sink:
        argv = [*launcher, *controller_argv(config, *args, log_level="WARNING")]
        proc = subprocess.Popen(argv, stderr=sink)
    tls = settings.get("http_tls") is not None
    url = f"{'https' if tls else 'http'}://127.0.0.1:{http_port}"
    context = ssl.create_default_context(cafile=ca_file) if tls else None
    try:
        wait_for_condition(
            lambda: _answers(f"{url}/health/", context) or proc.poll() is not None, 20
        )
        assert proc.poll() is None, "the controller did not start"
        yield LiveController(url, udp_port, proc)
    finally:
        # SIGTERM first, as systemd would: its local workers drain and leave with it.
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=20)
        reap(proc)
        text = log.read_text(errors="replace")
        assert "Traceback" not in text, text[-5000:]


# ---------------------------------------------------------------- a real redis-server

REDIS_SERVER = shutil.which("redis-server") or (
    "/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else None
)


@dataclass
class RedisServer:
    """A redis-server of its own (temp dir, free port), started and stopped by pid."""

    directory: Path
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    extra: tuple[str, ...] = ()  # more redis-server arguments (--requirepass, --unixsocket)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert REDIS_SERVER is not None
        if not self.port:
            self.port = free_tcp_port()
        self.directory.mkdir(parents=True, exist_ok=True)
        argv = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1"]
        argv += ["--dir", str(self.directory), "--save", "", "--appendonly", "yes"]
        argv += ["--logfile", str(self.directory / "redis.log"), *self.extra]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_condition(lambda: self.ping() or self.proc is None or self.proc.poll() is not None)
        assert self.ping(), (self.directory / "redis.log").read_text(errors="replace")[-2000:]

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith((b"+PONG", b"-NOAUTH"))  # -NOAUTH: a password
        except OSError:
            return False

    def stop(self, *, kill: bool = False) -> None:
        """Stop it (SIGTERM, or SIGKILL with `kill`); its append-only file stays for a start."""
        if self.proc is not None:
            if not kill:
                self.proc.terminate()  # a clean shutdown writes the append-only file out
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=10)
            reap(self.proc)
            self.proc = None


@contextlib.contextmanager
def redis_server(tmp: Path, *extra: str) -> Iterator[RedisServer]:
    """A redis-server in tmp/redis, with `extra` arguments; stopped at the end."""
    server = RedisServer(tmp / "redis", extra=extra)
    server.start()
    try:
        yield server
    finally:
        server.stop()

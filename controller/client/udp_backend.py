"""The library client's UDP backend: blocking and thread-safe, on udp-client's engine.

The engine (controller/client/udp_engine.py, `UdpSession`) runs in a trio loop on a
thread of its own and does everything the datagrams need: requests repeated
under the one resend rule until acknowledged, every notification acknowledged
at once. This module only waits on it from the callers' threads, and keeps the
notifications by task_id until `outcome` takes them. The client picks each
job's task_id itself, from a counter that starts at the wall clock in
milliseconds so that a restarted client does not reuse the numbers of its last
run.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import socket
import threading
import time
from typing import Any

import trio

from controller import datagram as dg
from controller.client.errors import ControllerError
from controller.client.udp_engine import POLL_AFTER, UdpSession
from controller.doors.udp import words


class UdpBackend:
    def __init__(self, host: str, port: int) -> None:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
        family, _, _, _, sockaddr = infos[0]
        self.server: tuple[str, int] = (str(sockaddr[0]), int(sockaddr[1]))
        self.sock = socket.socket(family, socket.SOCK_DGRAM)
        # Connected: only the controller's datagrams come in, and the socket knows the
        # address the controller sees (a UDP job's id is built from it).
        self.sock.connect(self.server)
        self.local = self.sock.getsockname()[:2]
        # Its own jobs (run_task) are not used here: no session-wide timeout.
        self._session = UdpSession(self.sock, self.server, math.inf)
        self._session.notified = self._notified
        self._changed = threading.Condition()
        self._outcomes: dict[int, dict[str, Any]] = {}
        self.task_ids = itertools.count(int(time.time() * 1000) % (1 << 40) + 1)
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.CancelScope | None = None
        started = threading.Event()
        self._loop = threading.Thread(
            target=trio.run, args=(self._serve, started), name="udp-client", daemon=True
        )
        self._loop.start()
        started.wait()

    async def _serve(self, started: threading.Event) -> None:
        with trio.CancelScope() as self._stop:
            self._token = trio.lowlevel.current_trio_token()
            started.set()
            await self._session.receive()

    def close(self) -> None:
        if self._token is not None and self._stop is not None and self._loop.is_alive():
            with contextlib.suppress(trio.RunFinishedError):  # it ended meanwhile
                trio.from_thread.run_sync(self._stop.cancel, trio_token=self._token)
        self._loop.join(timeout=5)
        self.sock.close()

    # ------------------------------------------------------------ requests

    def request(self, method: str, params: dict[str, Any], deadline: float) -> dict[str, Any]:
        """Send until acknowledged; the acknowledgement's params. ControllerError if refused,
        TimeoutError at the deadline."""
        # The engine's clock is trio's; the deadline as a span of it.
        span = max(0.0, deadline - time.monotonic())

        async def ask() -> dict[str, Any] | None:
            return await self._session.request(method, params, trio.current_time() + span)

        ack = trio.from_thread.run(ask, trio_token=self._token)
        if ack is None:
            raise TimeoutError(f"{method} was not acknowledged by {self.server}")
        error = ack.get("error")
        if isinstance(error, dict):
            raise ControllerError(str(error.get("code")), str(error.get("message", "")))
        params_out = ack.get("params")
        return params_out if isinstance(params_out, dict) else {}

    def outcome(self, task_id: int, deadline: float) -> dict[str, Any]:
        """The notify_task params for `task_id` (asking with get_task when one seems lost)."""
        while True:
            with self._changed:
                until = min(deadline, time.monotonic() + POLL_AFTER)
                while task_id not in self._outcomes and time.monotonic() < until:
                    self._changed.wait(until - time.monotonic())
                found = self._outcomes.get(task_id)
            if found is not None:
                return found
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no outcome for task {task_id} in time")
            status = self.request("get_task", {"task_id": task_id}, deadline)
            if status.get("status") in words.ENDED_WORDS:
                return status

    def job_id(self, task_id: int) -> str:
        """The id the controller gives the job: udp-<host>-<port>-<task_id>."""
        return f"udp-{self.local[0]}-{self.local[1]}-{task_id}"

    def task_id_of(self, job_id: str) -> int:
        """The task_id of one of this client's own jobs by its id (0: another's, which the UDP
        door tells this client nothing about)."""
        prefix = self.job_id(0)[:-1]
        number = job_id[len(prefix) :] if job_id.startswith(prefix) else ""
        return int(number) if number.isdigit() and len(number) <= 20 else 0

    def peek(self, task_id: int) -> dict[str, Any] | None:
        with self._changed:
            return self._outcomes.get(task_id)

    def result_bytes(self, task_id: int, params: dict[str, Any], deadline: float) -> bytes:
        inline = dg.read_bytes(params, "result")
        if inline is not None:
            return inline
        size = int(params.get("result_size", 0))
        out = bytearray()
        while len(out) < size:
            chunk_params = {"task_id": task_id, "offset": len(out), "length": dg.MAX_CHUNK}
            chunk = dg.read_bytes(self.request("get_result", chunk_params, deadline), "result")
            if not chunk:
                break
            out += chunk
        return bytes(out)

    def _notified(self, params: dict[str, Any]) -> None:
        """A notification (already acknowledged by the engine), in the engine's thread."""
        task_id = params.get("task_id")
        if isinstance(task_id, int):
            with self._changed:
                self._outcomes.setdefault(task_id, params)
                self._changed.notify_all()

"""The library client's UDP backend: blocking, thread-safe, one socket and one receiver thread.

Requests are repeated until acknowledged (the datagram rules are
controller/datagram.py); notifications are acknowledged at once and kept by
task_id until `wait` takes them. The client picks each job's task_id itself,
from a counter that starts at the wall clock in milliseconds so that a
restarted client does not reuse the numbers of its last run.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
import time
from typing import Any

from controller import datagram as dg
from controller.client.errors import ControllerError

# First repeat of an unacknowledged request, then doubling up to the cap.
RESEND_FIRST = 0.2
RESEND_MAX = 2.0
# Without a notification this long, ask with get_task (it may have been lost).
POLL_AFTER = 3.0


class UdpBackend:
    def __init__(self, host: str, port: int) -> None:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
        # Prefer the family that answers on this host: try each address as given.
        family, _, _, _, sockaddr = infos[0]
        self.server = sockaddr[:2]
        self.sock = socket.socket(family, socket.SOCK_DGRAM)
        # Connected: only the controller's datagrams come in, and the socket knows the
        # address the controller sees (a UDP job's id is built from it).
        self.sock.connect(self.server)
        self.local = self.sock.getsockname()[:2]
        self.sock.settimeout(0.5)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._acks: dict[int, dict[str, Any]] = {}
        self._outcomes: dict[int, dict[str, Any]] = {}
        self._txid = itertools.count(int(time.time() * 1000))
        self.task_ids = itertools.count(int(time.time() * 1000) % (1 << 40) + 1)
        self._closed = False
        self._receiver = threading.Thread(target=self._receive, name="udp-client", daemon=True)
        self._receiver.start()

    def close(self) -> None:
        self._closed = True
        self._receiver.join(timeout=2)
        self.sock.close()

    # ------------------------------------------------------------ requests

    def request(self, method: str, params: dict[str, Any], deadline: float) -> dict[str, Any]:
        """Send until acknowledged; the acknowledgement's params. ControllerError if refused,
        TimeoutError at the deadline."""
        txid = next(self._txid)
        data = dg.request(method, params, txid)
        interval = RESEND_FIRST
        with self._changed:
            while True:
                self._send(data)
                until = min(deadline, time.monotonic() + interval)
                while txid not in self._acks and time.monotonic() < until:
                    self._changed.wait(until - time.monotonic())
                ack = self._acks.pop(txid, None)
                if ack is not None:
                    break
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{method} was not acknowledged by {self.server}")
                interval = min(interval * 2, RESEND_MAX)
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
            if status.get("status") in ("success", "error", "failed_post"):
                return status

    def job_id(self, task_id: int) -> str:
        """The id the controller gives the job: udp-<host>-<port>-<task_id>."""
        return f"udp-{self.local[0]}-{self.local[1]}-{task_id}"

    def peek(self, task_id: int) -> dict[str, Any] | None:
        with self._lock:
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

    # ------------------------------------------------------------ the receiver thread

    def _send(self, data: bytes) -> None:
        with contextlib.suppress(OSError):  # lost like any datagram: the repeats deal with it
            self.sock.send(data)

    def _receive(self) -> None:
        while not self._closed:
            try:
                data = self.sock.recv(dg.MAX_DATAGRAM)
            except TimeoutError:
                continue
            except OSError:
                if self._closed:
                    return
                continue
            packet = dg.decode(data)
            if packet is None:
                continue
            txid = packet.get("transmission_id")
            if packet.get("packet_type") == dg.IS_ACK and isinstance(txid, int):
                with self._changed:
                    self._acks[txid] = packet
                    self._changed.notify_all()
            elif packet.get("method") == "notify_task":
                if packet.get("packet_type") == dg.WANT_ACK and isinstance(txid, int):
                    self._send(dg.ack(txid))
                params = packet.get("params")
                if isinstance(params, dict) and isinstance(params.get("task_id"), int):
                    with self._changed:
                        self._outcomes.setdefault(params["task_id"], params)
                        self._changed.notify_all()

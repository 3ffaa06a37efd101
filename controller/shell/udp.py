"""The UDP front door's trio shell: one socket, the pure `FrontDoor`, and its timer."""

from __future__ import annotations

import collections
import contextlib
import logging
import select
import socket as stdsocket
import time
from typing import Any

import trio

from controller.config import Config
from controller.core import TaskFinished, TaskState
from controller.frontdoor import Address, FrontDoor, Send
from controller.journal import Journal
from controller.shell.server import ControllerShell, StartupError
from controller.shell.timer import DeadlineTimer

log = logging.getLogger("controller.udp")

# Kernel buffers sized for bursts of thousands of datagrams between two event-loop turns.
SOCKET_BUFFER = 4 * 1024 * 1024
MAX_DATAGRAM = 65_535
# Datagrams handled in a row before the workers' sockets get a turn (the socket is
# level-triggered: the rest wait for the reactor's next round).
RECEIVE_BURST = 8


class _CoreAdapter:
    """The front door's view of the scheduler (and of the shell's own counters)."""

    def __init__(self, udp: UdpDoor) -> None:
        self.udp = udp

    def submit_task(self, task_id: int, payload: bytes, owner: Address) -> int:
        return self.udp.shell.submit(task_id, payload, owner)

    def task_state(self, ref: int) -> TaskState | None:
        return self.udp.shell.core.task_state(ref)

    def status_report(self) -> dict[str, Any]:
        report = self.udp.shell.core.status(trio.current_time())
        report["refused_peers"] = self.udp.shell.refused_peers
        report["send_errors"] = self.udp.send_errors
        return report


def open_udp_socket(host: str, port: int) -> stdsocket.socket:
    """Bind the front door's datagram socket; StartupError naming the address on failure."""
    try:
        infos = stdsocket.getaddrinfo(
            host, port, type=stdsocket.SOCK_DGRAM, flags=stdsocket.AI_PASSIVE
        )
        family, _, _, _, sockaddr = infos[0]
        sock = stdsocket.socket(family, stdsocket.SOCK_DGRAM)
    except OSError as exc:
        raise StartupError(f"client_address {host}:{port}: {exc}") from None
    try:
        for opt in (stdsocket.SO_RCVBUF, stdsocket.SO_SNDBUF):
            with contextlib.suppress(OSError):
                sock.setsockopt(stdsocket.SOL_SOCKET, opt, SOCKET_BUFFER)
        sock.bind(sockaddr)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot listen for clients on {host}:{port}: {exc.strerror}") from None
    return sock


class UdpDoor:
    def __init__(
        self, config: Config, shell: ControllerShell, journal: Journal | None = None
    ) -> None:
        self.config = config
        self.shell = shell
        self.journal = journal
        self.send_errors = 0
        self._held: collections.deque[tuple[int, Send]] = collections.deque()
        self.door = FrontDoor(
            _CoreAdapter(self),
            allowed_clients=config.allowed_clients,
            notify_retries=config.notify_retries,
            result_retention=config.result_retention,
            max_payload=config.max_extra_size,
            # Transmission ids stay unique across restarts: start from the wall clock in ms.
            first_txid=int(time.time() * 1000),
            journal=journal,
        )
        self._sock: stdsocket.socket | None = None
        self._timer = DeadlineTimer(self.door.next_deadline, self._expire)
        shell.on_finished = self._finished

    def bind(self) -> tuple[str, int]:
        """Open the socket (before the nursery, so errors stay plain); returns the bound address."""
        if self._sock is None:
            self._sock = open_udp_socket(
                self.config.client_address.host, self.config.client_address.port
            )
        host, port = self._sock.getsockname()[:2]
        return host, port

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve datagrams from the shell's reactor (which must be running) until cancelled."""
        self.bind()
        sock = self._sock
        assert sock is not None
        reactor = self.shell.reactor
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._timer.run)
                reactor.watch(sock, select.EPOLLIN, self._readable, last=True)
                log.info("listening for clients on %s:%d", *self.bind())
                task_status.started()
        finally:
            reactor.unwatch(sock)
            sock.close()

    def _readable(self, events: int) -> None:
        sock = self._sock
        assert sock is not None
        door = self.door
        now = trio.current_time()
        for _ in range(RECEIVE_BURST):
            try:
                data, addr = sock.recvfrom(MAX_DATAGRAM)
            except BlockingIOError:
                break
            except OSError as exc:  # e.g. an ICMP error for an earlier send
                log.debug("recvfrom: %s", exc)
                continue
            self.send(door.datagram(data, addr[:2], now))
        self._timer.poke()

    def _finished(self, finished: TaskFinished) -> None:
        self.send(self.door.task_finished(finished, trio.current_time()))
        self._timer.poke()

    def _expire(self, now: float) -> None:
        self.send(self.door.expire(now))

    def send(self, sends: list[Send]) -> None:
        """Send now, or, with a journal, once the batch these datagrams depend on is on disk."""
        journal = self.journal
        if journal is not None and sends:
            generation = journal.latest_generation()
            if generation > journal.committed or self._held:
                self._transmit([send for send in sends if send.independent])
                self._held.extend((generation, send) for send in sends if not send.independent)
                return
        self._transmit(sends)

    def release(self) -> None:
        """A journal commit finished: send what was waiting for it, in order."""
        assert self.journal is not None
        committed = self.journal.committed
        held = self._held
        ready = []
        while held and held[0][0] <= committed:
            ready.append(held.popleft()[1])
        self._transmit(ready)

    def _transmit(self, sends: list[Send]) -> None:
        sock = self._sock
        assert sock is not None
        for send in sends:
            try:
                sock.sendto(send.data, send.addr)
            except OSError as exc:
                # UDP: a full buffer or an unreachable client loses this datagram;
                # success notifications are repeated, everything else is asked again.
                self.send_errors += 1
                log.debug("sendto %s failed: %s", send.addr, exc)

"""The UDP door's trio shell: one socket, the pure `FrontDoor` codec, and the door's timer.

A datagram goes to the codec; the shell carries out the clients' actions it returns with
the job desk (state changes first: `submit`, `delivered`; then the answers, each held until
the journal has what it announces: `answer_after_commit`), and hands the calculators' to
the calculators' shell (calculators.py); an ended job's notification takes the same path.
Without a journal, answers to submitters leave in batches while many jobs are in flight
(`Pace`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import select
import socket as stdsocket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import trio

from controller.config import Config
from controller.containment import contained
from controller.datagram import MAX_DATAGRAM
from controller.doors.udp.actions import Delivered, Send, Submit
from controller.doors.udp.calculators import CalculatorShell
from controller.doors.udp.codec import FrontDoor, UdpAction
from controller.errors import StartupError
from controller.job_ids import DoorName
from controller.job_states import JobState
from controller.jobs import Job
from controller.reactor import Timer
from controller.shell.core_shell import CoreShell
from controller.shell.desk import JobDesk
from controller.shell.durability import Pace
from controller.shell.timer import DeadlineTimer
from controller.transmissions import NOTIFY_FIRST_INTERVAL

# Senders whose address tuple is shared (then the cache starts again).
ADDRESS_CACHE = 4096

log = logging.getLogger("controller.udp")

# Kernel buffers sized for bursts of thousands of datagrams between two event-loop turns.
SOCKET_BUFFER = 4 * 1024 * 1024
# Datagrams handled in a row before the workers' sockets get a turn (the socket is
# level-triggered: the rest wait for the reactor's next round).
RECEIVE_BURST = 8


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
        raise StartupError(
            f"client_address: cannot listen for clients on {host}:{port}: {exc.strerror or exc}"
        ) from None
    return sock


class UdpDoor:
    """The UDP door's shell: its socket, the pure `FrontDoor` codec, and the door's timer."""

    def __init__(
        self,
        config: Config,
        shell: CoreShell,
        desk: JobDesk,
        reports: Mapping[str, Callable[[], dict[str, Any]]] | None = None,
    ) -> None:
        """`reports`: other parts' sections of the status report by name, e.g. "redis"
        (the Redis door's status)."""
        self.config = config
        self.shell = shell
        self.desk = desk
        self.send_errors = 0
        self.reports = dict(reports or {})
        self.door = FrontDoor(
            desk.book,
            allowed_clients=config.allowed_clients,
            refusal=desk.refusal,
            busy=desk.refusal_for,
            holder=desk.holder,
            status_report=self.status_report,
            notify_retries=config.notify_retries,
            max_payload=config.max_extra_size,
            allowed_calculators=config.allowed_calculators,
            max_result=config.max_extra_size,
            options=config.job_options(DoorName.UDP),
            # Transmission ids stay unique across restarts: start from the wall clock in ms.
            first_txid=int(time.time() * 1000),
            memory=config.udp_memory,
        )
        self._sock: stdsocket.socket | None = None
        self._timer = DeadlineTimer(self._next_deadline, self._expire)
        self.calculators = CalculatorShell(config, shell, desk, self.transmit, self._timer.poke)
        # One tuple per sender: recvfrom makes a new address (and host string) for every
        # datagram, and a job and its transmission keep theirs for minutes.
        self._addresses: dict[tuple[str, int], tuple[str, int]] = {}
        # Answers to submitters waiting for the next batch, in order, and its timer. With a
        # journal the commits are the batches (holding answers on would split them).
        self._batch: list[Send] = []
        self._batch_timer: Timer | None = None
        self._batching = desk.journal is None
        self._pace = Pace()
        self._live_tasks = shell.core.tasks  # every door's unfinished tasks

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
            if self._batch_timer is not None:
                self._batch_timer.cancel()
            self._send_batch(math.inf)  # what waits goes out before the socket closes
            reactor.unwatch(sock)
            sock.close()

    def status_report(self) -> dict[str, Any]:
        """What the `status` method answers: the scheduler's view and the shells' counters."""
        report = self.shell.core.status(trio.current_time())
        report["refused_peers"] = self.shell.refused_peers
        report["send_errors"] = self.send_errors
        for name, read in self.reports.items():
            report[name] = read()
        return report

    def _readable(self, events: int) -> None:
        sock = self._sock
        assert sock is not None
        door = self.door
        now = trio.current_time()
        addresses = self._addresses
        for _ in range(RECEIVE_BURST):
            try:
                data, addr = sock.recvfrom(MAX_DATAGRAM)
            except BlockingIOError:
                break
            except OSError as exc:  # e.g. an ICMP error for an earlier send
                log.debug("recvfrom: %s", exc)
                continue
            sender = addr[:2]
            known = addresses.get(sender)
            if known is None:
                if len(addresses) >= ADDRESS_CACHE:
                    addresses.clear()
                known = addresses[sender] = sender
            try:
                self._apply(door.datagram(data, known, now), now)
            except Exception as exc:  # a bug this datagram reached: it alone is refused
                contained("a datagram", exc, now, f"from {known[0]}:{known[1]}")
                self.transmit(door.internal_error(data, known))
        self._timer.poke()

    def _apply(self, actions: Iterable[UdpAction], now: float) -> None:
        """Carry out the codec's actions, in order: the calculators' go to their shell, new
        jobs and delivered outcomes to the job desk, `independent` answers out at once; the
        other answers wait for the journal to hold what the actions before them changed."""
        desk = self.desk
        held: list[Send] = []
        for action in actions:
            if isinstance(action, Send):
                if action.independent:  # reveals nothing recorded: it need not wait
                    self.transmit((action,))
                else:
                    held.append(action)
            elif isinstance(action, Submit):
                desk.submit(
                    action.job_id,
                    DoorName.UDP,
                    action.addr,
                    action.task_id,
                    action.payload,
                    now,
                    options=action.options,
                )
            elif isinstance(action, Delivered):
                desk.delivered(action.job_id, now)
            else:
                self.calculators.handle(action, now)
        desk.answer_after_commit(self.transmit, held)

    # ------------------------------------------------------------ the desk's side

    def job_finished(self, job: Job, now: float) -> None:
        actions = self.door.job_finished(job, now)
        if job.final is JobState.FINISHED:  # a success: its first repeat is now due then
            self._timer.poke_at(now + NOTIFY_FIRST_INTERVAL)
        self._apply(actions, now)

    def forget(self, job: Job) -> None:
        self.door.forget(job)

    def _next_deadline(self) -> float:
        return min(self.door.next_deadline(), self.calculators.next_deadline())

    def _expire(self, now: float) -> None:
        self._apply([*self.calculators.expire(now), *self.door.expire(now)], now)

    def transmit(self, sends: Sequence[Send]) -> None:
        sock = self._sock
        if sock is None:
            return  # closed: the client asks again, and success notifications are repeated
        for send in sends:
            # Without a journal, answers to submitters leave in batches while enough jobs are
            # in flight (durability.batch_delay): a client reads a batch in one wake-up. With
            # a few jobs they go at once, and nothing overtakes what already waits.
            if send.batched and self._batching:
                self._pace.note(trio.current_time())
                if self._batch:
                    self._batch.append(send)
                    continue
                delay = self._pace.delay(len(self._live_tasks))
                if delay:
                    self._batch.append(send)
                    when = trio.current_time() + delay
                    self._batch_timer = self.shell.reactor.call_at(when, self._send_batch)
                    continue
            self._send(sock, send)

    def _send(self, sock: stdsocket.socket, send: Send) -> None:
        try:
            sock.sendto(send.data, send.addr)
        except OSError as exc:
            # UDP: a full buffer or an unreachable client loses this datagram;
            # success notifications are repeated, everything else is asked again.
            self.send_errors += 1
            log.debug("sendto %s failed: %s", send.addr, exc)

    def _send_batch(self, now: float) -> None:
        """The batch's time has come (or the door stops): send it, in order."""
        self._batch_timer = None
        batch, self._batch = self._batch, []
        sock = self._sock
        if sock is not None:
            for send in batch:
                self._send(sock, send)

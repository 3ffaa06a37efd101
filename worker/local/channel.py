"""The channel (docs/protocol.md, "The channel"): one connection to main.sock for the
worker's life, asked for at REGISTER, on which tasks come in and outcomes, output and pulses
go out as ChannelFrames; its end makes the worker register again."""

from __future__ import annotations

import _socket
import logging
import math
import select
import socket
import time
from collections.abc import Callable

from controller import wire
from gen import worker_protocol_pb2 as pb
from worker.core import Effect
from worker.local.base import EXIT_RESTART, Settings
from worker.local.job import JobSlot

log = logging.getLogger("worker")

_IN = select.EPOLLIN
_OUT = select.EPOLLOUT

_FETCH = pb.ControlMsg(type=pb.CTRL_FETCH)


def read_one(sock: socket.socket, msg_type: type[wire.M]) -> wire.M:
    """One delimited message of `msg_type` from a blocking socket, read to its last byte and
    no further (what follows it belongs to the channel)."""
    length = shift = 0
    for _ in range(wire.MAX_VARINT_BYTES):
        byte = sock.recv(1)
        if not byte:
            raise wire.Truncated("the controller closed before answering")
        length |= (byte[0] & 0x7F) << shift
        if not byte[0] & 0x80:
            break
        shift += 7
    else:
        raise wire.VarintTooLong("length prefix longer than 10 bytes")
    if length > wire.MAX_HEADER_SIZE:
        raise wire.HeaderTooLarge(f"an answer of {length} bytes")
    body = b""
    while len(body) < length:
        chunk = sock.recv(length - len(body))
        if not chunk:
            raise wire.Truncated("the controller closed in the middle of its answer")
        body += chunk
    try:
        return msg_type.FromString(body)
    except Exception as exc:
        raise wire.MalformedMessage(f"not a valid {msg_type.__name__}: {exc}") from None


class ChannelLink(JobSlot):
    """The channel, once granted and open: every message goes on it."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self._chan: _socket.socket | None = None
        self._chan_decoder = wire.StreamDecoder(pb.ChannelFrame, settings.max_extra_size)
        self._chan_out = b""  # written, not yet taken by the kernel
        self._chan_flushed: list[Callable[[], None]] = []  # told once _chan_out is empty
        # When bytes last moved on the channel while a frame was unfinished either way: a
        # controller stuck in the middle of one for dial_timeout loses the channel.
        self._chan_moved = 0.0

    def _open_channel(self, worker_id: int) -> bool:
        """Open the channel granted at REGISTER: a new connection to main.sock, a PULSE_OK
        (FETCH_ME while an outcome waits) with `channel` set, its answer; then ChannelFrames
        both ways. Done blocking (bounded by the dial timeout): it happens once a
        registration. False: not open (the worker registers again)."""
        session = self.session
        session.worker_id = worker_id
        pulse = session.pulse(self.next_pulse)
        pulse.channel = True
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.dial_timeout)
            sock.connect(self._main_socket)
            sock.sendall(wire.encode_frame(pulse))
            answer = read_one(sock, pb.PulseResponse)
        except (OSError, wire.RemoteProtocolError) as exc:
            sock.close()
            session.worker_id = 0
            log.warning("cannot open the channel on %s: %s", self._main_socket, exc)
            return False
        if answer.error != pb.CTRL_ERR_OK or not answer.channel:
            sock.close()
            session.worker_id = 0
            log.warning("channel refused (error %d)", answer.error)
            return False
        sock.setblocking(False)
        self._chan = sock
        self._chan_decoder = wire.StreamDecoder(pb.ChannelFrame, self.max_extra_size)
        self._chan_out = b""
        self._chan_flushed = []
        self._watch(sock.fileno(), _IN, self._chan_ready)
        self._pulse_at = time.monotonic() + self.pulse_period
        log.info("channel open for worker %d", worker_id)
        return True

    def _chan_send(self, data: bytes, flushed: Callable[[], None] | None = None) -> None:
        """Write `data` on the channel after what waits; `flushed()` once all of it is out."""
        sock = self._chan
        if sock is None:
            return
        if flushed is not None:
            self._chan_flushed.append(flushed)
        if self._chan_out:
            self._chan_out += data
            return
        try:
            sent = sock.send(data, wire.DONTWAIT)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            self._chan_lost(f"sending: {exc}")
            return
        if sent < len(data):
            self._chan_out = data[sent:]
            self._chan_moved = time.monotonic()
            self._watch(sock.fileno(), _IN | _OUT, self._chan_ready)
            return
        self._chan_done_writing()

    def _chan_stall_deadline(self) -> float:
        """When the channel, in the middle of a frame either way and with nothing moving since,
        is given up (monotonic clock; inf: it is not in the middle of one)."""
        if self._chan is None or not (self._chan_out or self._chan_decoder.pending):
            return math.inf
        return self._chan_moved + self.dial_timeout

    def _chan_check_stall(self, now: float) -> float:
        """Give the channel up when it stalled mid-frame (section 3's limits hold both ways);
        the deadline to look again at (inf: none)."""
        deadline = self._chan_stall_deadline()
        if now >= deadline:
            # What came or left while this loop was busy (a handler holding it) counts first.
            self._chan_ready(_IN | _OUT)
            deadline = self._chan_stall_deadline()
            if time.monotonic() >= deadline:
                self._chan_lost(f"the controller stalled in a frame for {self.dial_timeout:g} s")
                return math.inf
        return deadline

    def _chan_done_writing(self) -> None:
        flushed, self._chan_flushed = self._chan_flushed, []
        for call in flushed:
            call()

    def _chan_ready(self, events: int) -> None:
        sock = self._chan
        if sock is None:
            return
        if events & _OUT and self._chan_out:  # first: what it frees may be answered below
            try:
                sent = sock.send(self._chan_out, wire.DONTWAIT)
            except BlockingIOError:
                sent = 0
            except OSError as exc:
                self._chan_lost(f"sending: {exc}")
                return
            self._chan_out = self._chan_out[sent:]
            if sent:
                self._chan_moved = time.monotonic()
            if not self._chan_out:
                self._watch(sock.fileno(), _IN, self._chan_ready)
                self._chan_done_writing()
        if not events & (_IN | select.EPOLLHUP | select.EPOLLERR) or self._chan is not sock:
            return
        try:
            data = sock.recv(wire.FIRST_READ, wire.DONTWAIT)
        except BlockingIOError:
            return
        except OSError as exc:
            self._chan_lost(f"receiving: {exc}")
            return
        if not data:
            self._chan_lost("the controller closed it")
            return
        self._chan_moved = time.monotonic()
        try:
            frames = self._chan_decoder.feed(data)
        except wire.RemoteProtocolError as exc:
            self._chan_lost(f"bad frame: {exc}")
            return
        for frame, extra in frames:
            if self._chan is not sock or self._done:
                return
            self._chan_frame(frame, extra)

    def _chan_frame(self, frame: pb.ChannelFrame, extra: bytes) -> None:
        which = frame.WhichOneof("msg")
        if which == "control":
            msg = frame.control
            answer = self.session.on_control(msg, extra)
            effect = answer.effect
            if effect is Effect.START:  # taken: the outcome is the answer
                self._start_job(msg.task_id, extra)
            elif effect is Effect.RESTART:
                log.warning("controller sent RESTART: stopping and exiting %d", EXIT_RESTART)
                self._abandon_job()
                self._stop(EXIT_RESTART)
            elif effect is Effect.HELD or effect is Effect.QUIET:
                pass  # a next task held (its outcome answers it), or nothing to say
            else:
                task_id = answer.response.task_id
                data = wire.encode_channel(
                    wire.CHANNEL_RESPONSE, answer.response, answer.extra, msg.type
                )
                if effect is Effect.FETCHED:
                    self._chan_send(data, lambda: self._outcome_out(task_id))
                else:
                    self._chan_send(data)
        elif which == "pulse_response":
            error = frame.pulse_response.error
            if error != pb.CTRL_ERR_OK:
                self._chan_lost(f"the controller answered a pulse with error {error}")

    def _send_outcome(self) -> None:
        """The job's outcome, on the channel, the moment it is known (its output went first)."""
        session = self.session
        if not session.has_outcome:
            return
        answer = session.on_control(_FETCH, b"")
        task_id = answer.response.task_id
        self._chan_send(
            wire.encode_channel(
                wire.CHANNEL_RESPONSE, answer.response, answer.extra, pb.CTRL_FETCH
            ),
            lambda: self._outcome_out(task_id),
        )

    def _outcome_out(self, task_id: int) -> None:
        """The outcome of `task_id` is written: the worker is idle, and starts its next task
        if it holds one."""
        session = self.session
        session.fetched(task_id)
        waiting = session.take_waiting()
        if waiting is not None:
            msg, extra = waiting
            if session.on_control(msg, extra).effect is Effect.START:
                self._start_job(msg.task_id, extra)

    def drain(self) -> None:
        """Drain; a next task held is refused at once (the controller places it again now,
        not when the running one ends)."""
        super().drain()
        session = self.session
        waiting, session.waiting = session.waiting, None
        if waiting is not None and self._chan is not None:
            refused = pb.WorkerResponse(error=pb.WORKER_ERR_BUSY, task_id=waiting[0].task_id)
            self._chan_send(
                wire.encode_channel(wire.CHANNEL_RESPONSE, refused, b"", pb.CTRL_SET_TASK)
            )

    def _chan_lost(self, why: str) -> None:
        """The channel ended: register again, keeping the job and an outcome not sent whole."""
        sock = self._chan
        if sock is None:
            return
        self._unwatch(sock.fileno())
        sock.close()
        self._chan = None
        self._chan_out = b""
        self._chan_flushed = []
        session = self.session
        session.waiting = None  # the controller places a held next task again
        log.warning(
            "channel of worker %d ended (%s); registering again (keeping task %d)",
            session.worker_id,
            why,
            session.task_id,
        )
        self._register_again()

    def _chan_shutdown(self) -> None:
        """SHUTDOWN on the channel after what waits there, then close it."""
        sock = self._chan
        assert sock is not None
        session = self.session  # its task_id: the job it ran last (the controller's check)
        pulse = pb.WorkerPulse(
            type=pb.PULSE_SHUTDOWN, worker_id=session.worker_id, task_id=session.task_id
        )
        data = self._chan_out + wire.encode_channel(wire.CHANNEL_PULSE, pulse)
        self._unwatch(sock.fileno())
        self._chan = None
        try:
            sock.settimeout(self.dial_timeout)
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            # The controller closes its end once it has read the SHUTDOWN.
            while sock.recv(4096):
                pass
        except OSError as exc:
            log.warning("SHUTDOWN not delivered: %s", exc)
        finally:
            sock.close()

"""How the controller reaches its local workers: dials to their sockets and their channels.

A SET_TASK, FETCH or RESTART goes out as a dial to `<socket_dir>/<id>.sock` (one
connection, one answer), or on the worker's channel when it has one (docs/protocol.md,
"The channel": a connection the worker opened on main.sock and keeps, which carries its
pulses and output one way and the controller's messages the other). What comes back is
handed to the core (`DialDone`, outcomes, pulses) and its actions carried out by the
shell (`LinkHost.execute`).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
from collections.abc import Callable
from typing import Protocol

import trio

from controller import wire
from controller.channel import ChannelConn
from controller.config import Config
from controller.containment import contained
from controller.core import Action, Core, Dial, DialDone, PulseReceived, Reply, Worker
from controller.joblimits import JobLimits
from controller.reactor import Reactor
from controller.shell.descriptors import Throttled
from controller.transport import Incoming, Outgoing, Result, WrongPeer
from controller.usage import Usage, checked_usage
from gen import worker_protocol_pb2 as pb

log = logging.getLogger("controller")

FAILED = wire.encode_frame(pb.PulseResponse(error=pb.CTRL_ERR_FAILED))
_UNKNOWN_ID = wire.encode_frame(pb.PulseResponse(error=pb.CTRL_ERR_UNKNOWN_ID))
_CHANNEL_OPEN = wire.encode_frame(pb.PulseResponse(error=pb.CTRL_ERR_OK, channel=True))
# A SET_TASK written on a channel counts as taken (the worker answers only to refuse it).
_TAKEN = pb.WorkerResponse(error=pb.WORKER_ERR_OK)
# The SET_TASK limits of each distinct job `limits` seen, made once (most jobs share a few).
_LIMITS_CACHE_SIZE = 256


def usage_of(report: pb.Usage) -> Usage | None:
    """A worker's usage report, checked (None: a value that cannot be true)."""
    return checked_usage(report.wall, report.cpu, report.max_rss, report.memory_peak or None)


_UNKNOWN_ID_RESPONSE = pb.PulseResponse(error=pb.CTRL_ERR_UNKNOWN_ID)
_FAILED_RESPONSE = pb.PulseResponse(error=pb.CTRL_ERR_FAILED)


def _check_channel_frame(frame: pb.ChannelFrame, extra_size: int) -> None:
    """A worker's frame on its channel, before its extra bytes are read: output comes in
    pieces of at most wire.MAX_PULSE_EXTRA."""
    if extra_size > wire.MAX_PULSE_EXTRA and frame.WhichOneof("msg") != "response":
        raise wire.ExtraTooLarge(
            f"a {frame.WhichOneof('msg')} announces {extra_size} extra bytes, over the "
            f"limit of {wire.MAX_PULSE_EXTRA}"
        )


class LinkHost(Protocol):
    """What the links need of the core's shell (controller/shell/core_shell.py)."""

    config: Config
    core: Core
    reactor: Reactor
    # Where a local worker's job output goes: (task ref, task job, the bytes).
    on_output: Callable[[int, object, bytes], None] | None
    # Where its progress goes: (task ref, task job, progress, status), unchecked.
    on_reported: Callable[[int, object, float, str], None] | None

    def execute(self, actions: list[Action]) -> None: ...

    def attempt_used(self, ref: int, job: object, usage: Usage) -> None: ...


class WorkerLinks:
    """The dials in flight and the open channels of the local workers."""

    def __init__(self, shell: LinkHost) -> None:
        self.shell = shell
        self.config = shell.config
        self.core = shell.core
        self.reactor = shell.reactor
        self.execute = shell.execute
        self._socket_prefix = f"{shell.config.socket_dir}/"
        # Each channel worker's channel (docs/protocol.md, "The channel"), by worker id.
        self.channels: dict[int, ChannelConn[pb.ChannelFrame]] = {}
        # SET_TASKs written on channels in this batch of actions: taken once it is carried out
        # (`taken_done`).
        self.taken: list[int] = []
        # The limits each job's SET_TASK carries, by the job's own `limits` option (the
        # configuration's job_limits, lowered by what the job asked for).
        self._limits_made: dict[JobLimits, pb.JobLimits | None] = {}
        self._dial_failed = Throttled(log, "cannot dial a worker")

    def taken_done(self) -> None:
        """The SET_TASKs written on channels count as taken: the core hears so."""
        while self.taken:
            taken, self.taken = self.taken, []
            now = trio.current_time()
            for wid in taken:
                done = DialDone(wid, pb.CTRL_SET_TASK, _TAKEN)
                self.execute(self.core.dial_done(done, now))

    def close_forgotten_channels(self) -> None:
        """A channel whose worker was dropped (its pulse deadline passed) is told
        CTRL_ERR_UNKNOWN_ID and closed: a worker still alive registers again."""
        workers = self.core.workers
        for wid in [wid for wid in self.channels if wid not in workers]:
            channel = self.channels.pop(wid)
            channel.send(wire.encode_channel(wire.CHANNEL_PULSE_RESPONSE, _UNKNOWN_ID_RESPONSE))
            channel.close_after_send()

    def open_channel(
        self, pid: int, uid: int, conn: Incoming[pb.WorkerPulse], pulse: pb.WorkerPulse
    ) -> None:
        """A pulse asking to make its connection the worker's channel: from the process that
        registered (uid and pid), for a worker with no channel yet."""
        wid = pulse.worker_id
        worker = self.core.workers.get(wid)
        if worker is None:
            conn.reply(_UNKNOWN_ID)
            return
        if (
            wid in self.channels
            or not worker.channel  # not granted at its REGISTER
            or pulse.type not in (pb.PULSE_OK, pb.PULSE_FETCH_ME)
            or (worker.uid is not None and worker.uid != uid)
            or (worker.pid is not None and worker.pid != pid)
        ):
            log.warning(
                "main.sock: refused a channel for worker %d from pid %d uid %d", wid, pid, uid
            )
            conn.reply(FAILED)
            return
        actions = self.core.pulse(PulseReceived(pulse, pid or None, uid), trio.current_time())
        reply = actions[0]
        assert isinstance(reply, Reply)
        if reply.response.error != pb.CTRL_ERR_OK:
            self.execute(actions[1:])
            conn.reply(wire.encode_frame(reply.response))
            return
        channel: ChannelConn[pb.ChannelFrame] = ChannelConn(
            self.reactor,
            conn.sock,
            pb.ChannelFrame,
            lambda frame, extra: self._channel_frame(wid, pid, uid, frame, extra),
            lambda why: self._channel_ended(wid, channel, why),
            timeout=self.config.dial_timeout,
            now=trio.current_time(),
            max_extra_size=self.config.max_extra_size,
            check=_check_channel_frame,
        )
        self.channels[wid] = channel
        channel.send(_CHANNEL_OPEN)
        log.debug("worker %d: channel open", wid)
        self.execute(actions[1:])

    def _channel_frame(
        self, wid: int, pid: int, uid: int, frame: pb.ChannelFrame, extra: bytes
    ) -> None:
        channel = self.channels.get(wid)
        if channel is None:
            return
        now = trio.current_time()
        if wid not in self.core.workers:  # dropped meanwhile: it registers again
            channel.send(wire.encode_channel(wire.CHANNEL_PULSE_RESPONSE, _UNKNOWN_ID_RESPONSE))
            channel.close_after_send()
            return
        which = frame.WhichOneof("msg")
        if which == "response":
            resp = frame.response
            kind = frame.answers
            if kind == pb.CTRL_FETCH:
                if resp.HasField("usage"):
                    self._usage(wid, resp)
                self.execute(self.core.local.outcome(wid, resp, extra, now))
            elif kind == pb.CTRL_DROP or (
                kind == pb.CTRL_SET_TASK and self.core.local.holds_next(wid, resp.task_id)
            ):  # its next task forgotten, or refused: the worker stays
                self.execute(self.core.local.next_answered(wid, kind, resp.task_id, now))
            elif kind == pb.CTRL_SET_TASK:  # refused: the task goes back, nothing counted
                self.execute(self.core.local.channel_ended(wid, "refused", now, resp.task_id))
                channel.close_after_send()
            else:
                self.execute(self.core.dial_done(DialDone(wid, kind, resp, extra), now))
            return
        if which != "pulse":
            channel.end(f"a worker sent a {which or 'empty frame'} on its channel")
            return
        pulse = frame.pulse
        ptype = pulse.type
        if pulse.worker_id != wid:
            channel.end(f"a pulse for worker {pulse.worker_id} on worker {wid}'s channel")
            return
        if ptype == pb.PULSE_OUTPUT:
            task = self.core.local.output(PulseReceived(pulse, None, uid))[1]
            if task is not None and extra and self.shell.on_output is not None:
                self.shell.on_output(task.ref, task.job, extra)
            return
        if ptype == pb.PULSE_PROGRESS:
            task = self.core.local.output(PulseReceived(pulse, None, uid))[1]
            if task is not None and self.shell.on_reported is not None:
                self.shell.on_reported(task.ref, task.job, pulse.progress, pulse.status)
            return
        if ptype == pb.PULSE_REGISTER:
            channel.send(wire.encode_channel(wire.CHANNEL_PULSE_RESPONSE, _FAILED_RESPONSE))
            channel.close_after_send()
            return
        actions = self.core.pulse(PulseReceived(pulse, pid or None, uid), now)
        reply = actions[0]
        assert isinstance(reply, Reply)
        self.execute(actions[1:])
        error = reply.response.error
        if error == pb.CTRL_ERR_UNKNOWN_TYPE:
            channel.send(wire.encode_channel(wire.CHANNEL_PULSE_RESPONSE, reply.response))
        elif error != pb.CTRL_ERR_OK:
            channel.send(wire.encode_channel(wire.CHANNEL_PULSE_RESPONSE, reply.response))
            channel.close_after_send()
        elif ptype == pb.PULSE_SHUTDOWN:
            channel.close_after_send()

    def _channel_ended(self, wid: int, channel: ChannelConn[pb.ChannelFrame], why: str) -> None:
        if self.channels.get(wid) is channel:
            del self.channels[wid]
        self.execute(self.core.local.channel_ended(wid, why, trio.current_time()))

    def _send_on_channel(self, channel: ChannelConn[pb.ChannelFrame], action: Dial) -> None:
        wid = action.worker_id
        msg = self._control(action, self.core.workers.get(wid))
        channel.send(wire.encode_channel(wire.CHANNEL_CONTROL, msg, action.extra))
        if action.kind == pb.CTRL_SET_TASK:
            self.taken.append(wid)
        elif action.kind == pb.CTRL_RESTART:  # the worker was dropped: it leaves
            del self.channels[wid]
            channel.close_after_send()

    # ------------------------------------------------------------ dialing

    def dial(self, action: Dial) -> None:
        cfg = self.config
        wid = action.worker_id
        channel = self.channels.get(wid)
        if channel is not None:
            self._send_on_channel(channel, action)
            return
        if action.kind == pb.CTRL_DROP:  # its channel is gone, and with it the next task
            return
        path = f"{self._socket_prefix}{wid}.sock"  # str: a Path per dial is measurable
        if action.uid is not None:
            try:
                owner = os.stat(path).st_uid
            except OSError as exc:
                self._report(DialDone(wid, action.kind, None, error=f"{path}: {exc.strerror}"))
                return
            if owner != action.uid:
                self._report(DialDone(wid, action.kind, None, not_owned=True, error="not owned"))
                return
        worker = self.core.workers.get(wid)
        msg = self._control(action, worker)
        expect = None
        if action.uid is not None:
            # Whoever listens there now must be the worker that registered (its socket file
            # may have been swapped since the stat above).
            expect = (action.uid, worker.pid if worker is not None else None)
        try:
            Outgoing(
                self.reactor,
                path,
                wire.encode_frame(msg, action.extra),
                pb.WorkerResponse,
                functools.partial(self._dialled, action, path),
                timeout=cfg.dial_timeout,
                max_extra_size=cfg.max_extra_size,
                expect=expect,
            )
        except OSError as exc:  # no descriptor for the socket: the worker did not answer
            self._dial_failed(exc.strerror or exc, trio.current_time())
            self._report(DialDone(wid, action.kind, None, error=f"{path}: {exc.strerror}"))

    def _control(self, action: Dial, worker: Worker | None) -> pb.ControlMsg:
        """The ControlMsg of `action`: a SET_TASK carries its task's limits and batch (the
        task it places: the worker's next one when it holds one, else its task)."""
        msg = pb.ControlMsg(type=action.kind)  # type: ignore[arg-type]
        if action.kind == pb.CTRL_DROP:
            msg.task_id = action.task_id
        elif action.kind == pb.CTRL_SET_TASK:
            msg.task_id = action.task_id
            task = None if worker is None else worker.next or worker.task
            if task is not None:
                limits = self._limits(task.opts.limits)
                if limits is not None:
                    msg.limits.CopyFrom(limits)
                msg.batch_id = task.opts.batch  # a batch's then job: BATCH_ID
        return msg

    def _limits(self, asked: JobLimits) -> pb.JobLimits | None:
        """What a job's SET_TASK carries: the configuration's job_limits lowered by the job's
        own (None: no limit at all)."""
        cache = self._limits_made
        try:
            return cache[asked]
        except KeyError:
            pass
        merged = self.config.job_limits.tighter(asked)
        made = None if merged.is_empty() else merged.to_proto()
        if len(cache) >= _LIMITS_CACHE_SIZE:
            cache.clear()
        cache[asked] = made
        return made

    def _usage(self, wid: int, response: pb.WorkerResponse) -> None:
        """A FETCH answer's usage report, kept with the attempt it ends (before its outcome
        is acted on) and counted in the metrics."""
        worker = self.core.workers.get(wid)
        task = worker.task if worker is not None else None
        if task is None or response.task_id not in (0, task.task_id):
            return
        usage = usage_of(response.usage)
        if usage is None:
            log.warning("worker %d: a usage report that cannot be true; ignored", wid)
            return
        self.shell.attempt_used(task.ref, task.job, usage)

    def _dialled(self, action: Dial, path: str, result: Result[pb.WorkerResponse]) -> None:
        try:
            self._answered(action, path, result)
        except Exception as exc:
            # The answer could not be acted on: the worker counts as not answering.
            contained("a worker's answer", exc, trio.current_time(), f"worker {action.worker_id}")
            try:
                done = DialDone(action.worker_id, action.kind, None, error="internal error")
                self.execute(self.core.dial_done(done, trio.current_time()))
            except Exception as again:
                contained(
                    "a worker's answer", again, trio.current_time(), f"worker {action.worker_id}"
                )

    def _answered(self, action: Dial, path: str, result: Result[pb.WorkerResponse]) -> None:
        wid = action.worker_id
        if isinstance(result, tuple):
            if action.kind == pb.CTRL_FETCH and result[0].HasField("usage"):
                self._usage(wid, result[0])
            done = DialDone(wid, action.kind, result[0], result[1])
        elif isinstance(result, WrongPeer):
            log.warning("worker %d: %s; nothing sent", wid, result.strerror)
            done = DialDone(wid, action.kind, None, not_owned=True, error=str(result.strerror))
        elif isinstance(result, wire.RemoteProtocolError):
            done = DialDone(wid, action.kind, None, error=str(result))
        else:
            reason = result.strerror or str(result)
            if result.errno == errno.ENOENT:
                reason = f"{path} is missing"
            done = DialDone(wid, action.kind, None, error=reason)
        self.execute(self.core.dial_done(done, trio.current_time()))

    def _report(self, done: DialDone) -> None:
        """A dial that failed before sending: reported on the reactor's next turn."""
        self.reactor.call_soon(lambda now: self.execute(self.core.dial_done(done, now)))

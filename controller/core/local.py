"""Local workers: the Unix-socket protocol's side of the core. No I/O, no clock.

How it works: pulses from main.sock (`PulseReceived`), the outcome of each
dial (`DialDone`) and a worker's death (`WorkerExited`) come in here; what the
protocol means for the job goes to the scheduler as accepted / refused /
finished / failed / lost, and what to say to the worker goes out as actions
(`Reply` to the pulse, `Dial` its socket, `WatchPid`).

Per-job path in the common case: Dial(SET_TASK) -> DialDone(OK) ->
PulseReceived(FETCH_ME) -> Dial(FETCH) -> DialDone(OK); a job that writes to
stderr adds PULSE_OUTPUTs while it runs (`output`: whose they are, for the
shell to keep). REGISTER declares
the queues the worker serves and the labels it has (controller/declared.py);
a bad declaration is refused with CTRL_ERR_FAILED. A FETCH_ME that
overtakes the SET_TASK answer is remembered and served when it lands. A
pulse whose task_id disagrees with the record is checked with one
GET_STATUS; only a confirmed mismatch gets RESTART. A pulse only moves the
worker's deadline field; its heap entry is re-armed when it fires early.
"""

from __future__ import annotations

import logging

from controller import declared
from controller.core.model import (
    Action,
    Dial,
    DialDone,
    PulseReceived,
    Reply,
    Task,
    TaskState,
    WatchPid,
    Worker,
    WorkerEvent,
    WorkerExited,
    WorkerState,
)
from controller.core.recovery import Recovery
from controller.core.scheduler import Scheduler
from gen import worker_protocol_pb2 as pb

log = logging.getLogger("controller.core")

_REPLY_OK = Reply(pb.PulseResponse(error=pb.CTRL_ERR_OK))
# The longest silence a worker may promise (`next_pulse`, seconds), so that a process that
# registers and goes quiet is forgotten within the hour: a REGISTER promising more is
# refused, a later pulse's promise is held to it.
MAX_NEXT_PULSE = 3600
# Local workers registered at once, at most: each costs a record and a socket to dial.
MAX_LOCAL_WORKERS = 4096
_REPLY_UNKNOWN_ID = Reply(pb.PulseResponse(error=pb.CTRL_ERR_UNKNOWN_ID))
_REPLY_UNKNOWN_TYPE = Reply(pb.PulseResponse(error=pb.CTRL_ERR_UNKNOWN_TYPE))
_REPLY_FAILED = Reply(pb.PulseResponse(error=pb.CTRL_ERR_FAILED))

_WORKER_ERR_NAMES: dict[int, str] = {int(v): str(k) for k, v in pb.WorkerError.items()}


def describe_error(code: int) -> str:
    return _WORKER_ERR_NAMES.get(code, f"unknown WorkerError {code}")


class LocalWorkers:
    """The local worker kind: registration, pulses, dial results, deaths."""

    label = "local"

    def __init__(self, scheduler: Scheduler, recovery: Recovery, first_worker_id: int = 1) -> None:
        self.scheduler = scheduler
        self.recovery = recovery
        self.next_worker_id = first_worker_id

    # ------------------------------------------------------------ the scheduler's side

    def place(self, worker: Worker, task: Task, actions: list[Action]) -> None:
        actions.append(
            Dial(worker.worker_id, worker.uid, pb.CTRL_SET_TASK, task.task_id, task.payload)
        )

    def take_back(self, worker: Worker, actions: list[Action]) -> None:
        actions.append(Dial(worker.worker_id, worker.uid, pb.CTRL_RESTART))

    def drop_next(self, worker: Worker, task: Task, actions: list[Action]) -> None:
        actions.append(Dial(worker.worker_id, worker.uid, pb.CTRL_DROP, task.task_id))

    # ------------------------------------------------------------ pulses

    def pulse(self, ev: PulseReceived, now: float) -> list[Action]:
        pulse = ev.pulse
        ptype = pulse.type
        if ptype == pb.PULSE_REGISTER:
            return self._register(ev, now)
        if ptype not in (pb.PULSE_OK, pb.PULSE_FETCH_ME, pb.PULSE_SHUTDOWN):
            log.info("pulse of unknown type %d refused", ptype)
            return [_REPLY_UNKNOWN_TYPE]
        sched = self.scheduler
        worker = sched.workers.get(pulse.worker_id)
        if worker is None:
            return [_REPLY_UNKNOWN_ID]
        if ev.uid is not None and worker.uid is not None and ev.uid != worker.uid:
            log.warning(
                "pulse for worker %d from uid %d refused: it registered as uid %d",
                worker.worker_id,
                ev.uid,
                worker.uid,
            )
            return [_REPLY_FAILED]
        actions: list[Action] = [_REPLY_OK]
        if ptype == pb.PULSE_SHUTDOWN:
            log.info("worker %d shut down", worker.worker_id)
            # A task written on its channel after the worker decided to leave (it said nothing
            # since, and its SHUTDOWN names another task) never started: it goes back with no
            # attempt counted.
            task = worker.task
            unread = (
                task is not None and pulse.task_id != task.task_id and self._refund_unread(worker)
            )
            sched.lost(worker, now, actions, cause="shutdown", blame=not unread)
            sched.dispatch(actions, now)
            return actions
        worker.deadline = now + promised(pulse)
        worker.last_pulse = now
        if pulse.channel and worker.channel:  # the pulse that opens its channel
            worker.takes_next = worker.next_granted
        task_id = pulse.task_id
        state = worker.state
        if task_id and worker.task is None and self.recovery.claim(worker, task_id, now, actions):
            if ptype == pb.PULSE_FETCH_ME:
                self._fetch(worker, actions)
            return actions
        if task_id == 0 and state in (WorkerState.STARTING, WorkerState.UNSURE):
            sched.ready(worker)
            sched.dispatch(actions, now)
            return actions
        if worker.unread:  # the first pulse since its task was written on its channel
            worker.unread = False
            if task_id == 0 and state is WorkerState.BUSY:
                return actions  # written before the worker read its task: no mismatch
        if task_id not in worker.expected_task_ids():
            self._check(worker, actions)
        elif ptype == pb.PULSE_FETCH_ME:
            if state is WorkerState.BUSY:
                self._fetch(worker, actions)
            elif state is WorkerState.ASSIGNING:
                worker.fetch_wanted = True
        return actions

    def output(self, ev: PulseReceived) -> tuple[Reply, Task | None]:
        """A PULSE_OUTPUT: the answer, and the task whose output its extra bytes are (None:
        none the worker holds now; the bytes are dropped). It moves no deadline: it says
        nothing of the worker's health that the pulses do not."""
        pulse = ev.pulse
        worker = self.scheduler.workers.get(pulse.worker_id)
        if worker is None:
            return _REPLY_UNKNOWN_ID, None
        if ev.uid is not None and worker.uid is not None and ev.uid != worker.uid:
            return _REPLY_FAILED, None
        task = worker.task
        if task is None or pulse.task_id != task.task_id:
            return _REPLY_OK, None
        return _REPLY_OK, task

    def _register(self, ev: PulseReceived, now: float) -> list[Action]:
        pulse = ev.pulse
        try:
            serves = declared.read(list(pulse.queues), list(pulse.labels))
        except declared.BadDeclaration as exc:
            log.warning("REGISTER from pid %s refused: %s", ev.pid, exc)
            return [_REPLY_FAILED]
        if pulse.next_pulse > MAX_NEXT_PULSE:
            log.warning(
                "REGISTER from pid %s refused: next_pulse %d is over the limit of %d s",
                ev.pid,
                pulse.next_pulse,
                MAX_NEXT_PULSE,
            )
            return [_REPLY_FAILED]
        if self.scheduler.live_by_kind.get(self.label, 0) >= MAX_LOCAL_WORKERS:
            log.warning(
                "REGISTER from pid %s refused: %d local workers are registered, the limit",
                ev.pid,
                MAX_LOCAL_WORKERS,
            )
            return [_REPLY_FAILED]
        wid = self.next_worker_id
        self.next_worker_id += 1
        worker = Worker(
            worker_id=wid,
            kind=self,
            pid=ev.pid,
            uid=ev.uid,
            deadline=now + promised(pulse),
            queues=serves.queues,
            labels=serves.labels,
            channel=pulse.channel,
        )
        worker.last_pulse = now
        # A next task goes on the channel only (usable once it is open: see `pulse`).
        worker.next_granted = grants_next = pulse.channel and pulse.takes_next
        self.scheduler.add_worker(worker)
        self._arm(worker)
        log.info(
            "worker %d registered (pid %s, uid %s; queues %s, labels %s)",
            wid,
            ev.pid,
            ev.uid,
            declared.shown(serves.queues),
            declared.shown(serves.labels) or "none",
        )
        actions: list[Action] = [
            Reply(
                pb.PulseResponse(
                    error=pb.CTRL_ERR_OK,
                    worker_id=wid,
                    takes_output=True,
                    takes_progress=True,
                    channel=pulse.channel,
                    takes_next=grants_next,
                )
            )
        ]
        if ev.pid:
            actions.append(WatchPid(wid, ev.pid))
        return actions

    def _arm(self, worker: Worker) -> None:
        if not worker.armed:
            worker.armed = True
            self.scheduler.at(worker.deadline, self._pulse_due, worker)

    def _pulse_due(self, when: float, obj: object, now: float, actions: list[Action]) -> None:
        assert isinstance(obj, Worker)
        obj.armed = False
        if self.scheduler.workers.get(obj.worker_id) is not obj:
            return
        if obj.deadline > now:
            self._arm(obj)
            return
        log.warning("worker %d missed its pulse deadline; dropping it", obj.worker_id)
        self.scheduler.lost(obj, now, actions, cause="pulse deadline passed")

    # ------------------------------------------------------------ dial results

    def dial_done(self, ev: DialDone, now: float) -> list[Action]:
        worker = self.scheduler.workers.get(ev.worker_id)
        if worker is None:
            return []  # dropped while the dial was in flight; its task was re-placed then
        actions: list[Action] = []
        kind = ev.kind
        if kind == pb.CTRL_SET_TASK:
            self._set_task_done(worker, ev, now, actions)
        elif kind == pb.CTRL_FETCH:
            self._fetch_done(worker, ev, now, actions)
        elif kind == pb.CTRL_GET_STATUS:
            self._status_done(worker, ev, now, actions)
        # RESTART answers are ignored: the worker was dropped when it was sent.
        self.scheduler.dispatch(actions, now)
        return actions

    def _set_task_done(
        self, worker: Worker, ev: DialDone, now: float, actions: list[Action]
    ) -> None:
        task = worker.task
        if worker.next is not None:  # its next task, taken on its channel: held there
            return
        if worker.state is not WorkerState.ASSIGNING or task is None:
            return
        sched = self.scheduler
        resp = ev.response
        if ev.not_owned:
            log.warning(
                "worker %d: its socket is not owned by uid %s; dropping it unused",
                worker.worker_id,
                worker.uid,
            )
            sched.lost(worker, now, actions, cause="socket owned by another uid", blame=False)
            return
        if resp is None:
            # It may have taken the task before going silent: that counts as an attempt.
            task.attempts += 1
            task.failed_on_worker(worker.worker_id)
            task.last_error = f"worker {worker.worker_id} did not answer SET_TASK"
            log.warning("worker %d: SET_TASK got no answer (%s)", worker.worker_id, ev.error)
            worker.task = None
            sched.lost(worker, now, actions, cause="no answer")
            sched.retry(task, now, actions)
            return
        err = resp.error
        if err == pb.WORKER_ERR_OK and resp.task_id in (0, task.task_id):
            sched.accepted(worker, now, actions)
            worker.unread = worker.channel
            if worker.fetch_wanted:
                self._fetch(worker, actions)
            return
        if err == pb.WORKER_ERR_BUSY:
            sched.refused(worker, now, actions)
            return
        why = (
            f"answered task {resp.task_id} for task {task.task_id}"
            if err == pb.WORKER_ERR_OK
            else f"answered {describe_error(err)}"
        )
        log.warning("worker %d: SET_TASK %s; dropping it", worker.worker_id, why)
        sched.lost(worker, now, actions, cause="bad answer", blame=False)

    def _fetch_done(self, worker: Worker, ev: DialDone, now: float, actions: list[Action]) -> None:
        task = worker.task
        if worker.state is not WorkerState.FETCHING or task is None:
            return
        sched = self.scheduler
        resp = ev.response
        if resp is None:
            log.warning("worker %d: FETCH got no answer (%s)", worker.worker_id, ev.error)
            sched.lost(worker, now, actions, cause="no answer")
            return
        err = resp.error
        if err == pb.WORKER_ERR_OK and resp.task_id == task.task_id:
            sched.finished(worker, ev.extra, now, actions)
        elif err in (pb.WORKER_ERR_NO_FETCH, pb.WORKER_ERR_BUSY):
            worker.advance(WorkerEvent.NOTHING_TO_FETCH)
        elif err == pb.WORKER_ERR_TASK_FAILED and resp.task_id in (0, task.task_id):
            error = ev.extra.decode("utf-8", "replace")
            sched.failed(worker, error, now, actions, limit=resp.reason == "limit")
        else:
            why = (
                f"answered task {resp.task_id} for task {task.task_id}"
                if err in (pb.WORKER_ERR_OK, pb.WORKER_ERR_TASK_FAILED)
                else f"answered {describe_error(err)}"
            )
            log.warning("worker %d: FETCH %s; dropping it", worker.worker_id, why)
            sched.lost(worker, now, actions, cause="bad answer")

    def _status_done(self, worker: Worker, ev: DialDone, now: float, actions: list[Action]) -> None:
        worker.checking = False
        sched = self.scheduler
        resp = ev.response
        if resp is None or resp.error != pb.WORKER_ERR_OK:
            why = ev.error if resp is None else describe_error(resp.error)
            log.warning("worker %d: GET_STATUS failed (%s); dropping it", worker.worker_id, why)
            sched.lost(worker, now, actions, cause="no answer" if resp is None else "bad answer")
            return
        if resp.task_id == 0 and worker.state in (WorkerState.STARTING, WorkerState.UNSURE):
            sched.ready(worker)
            return
        if resp.task_id in worker.expected_task_ids():
            return
        if resp.task_id and resp.task_id == worker.last_done and worker.unread:
            return  # asked before the outcome came: its next task was not read yet
        if resp.task_id == 0 and worker.unread and worker.state is WorkerState.BUSY:
            return  # answered on its channel before it read the task written after the question
        expected = worker.task.task_id if worker.task is not None else 0
        log.warning(
            "worker %d holds task %d but the controller gave it %d; restarting it",
            worker.worker_id,
            resp.task_id,
            expected,
        )
        sched.take_back(worker, now, actions, cause="task mismatch")

    # ------------------------------------------------------------ channels

    def outcome(
        self, worker_id: int, resp: pb.WorkerResponse, extra: bytes, now: float
    ) -> list[Action]:
        """A job's outcome on the worker's channel (a FETCH answer nobody asked for: the
        worker sends it as soon as the job ends), or the answer to a FETCH sent there."""
        worker = self.scheduler.workers.get(worker_id)
        if worker is None:
            return []
        if worker.state is WorkerState.BUSY:
            worker.fetch_wanted = False
            worker.advance(WorkerEvent.FETCH)
        actions: list[Action] = []
        self._fetch_done(worker, DialDone(worker_id, pb.CTRL_FETCH, resp, extra), now, actions)
        self.scheduler.dispatch(actions, now)
        return actions

    def next_answered(self, worker_id: int, kind: int, task_id: int, now: float) -> list[Action]:
        """The worker answered about its next task on its channel: it forgot the canceled one
        (CTRL_DROP), or would not hold one (a refused SET_TASK: it drains)."""
        worker = self.scheduler.workers.get(worker_id)
        actions: list[Action] = []
        if worker is None:
            return actions
        refused = kind == pb.CTRL_SET_TASK
        self.scheduler.next_tasks.answered(worker, refused, task_id, now, actions)
        self.scheduler.dispatch(actions, now)
        return actions

    def holds_next(self, worker_id: int, task_id: int) -> bool:
        """`task_id` is the next task of the worker, or its canceled one (a refused SET_TASK
        about it is not the refusal of a task it should have been free for)."""
        worker = self.scheduler.workers.get(worker_id)
        if worker is None or task_id == 0:
            return False
        nxt = worker.next
        return (nxt is not None and nxt.task_id == task_id) or worker.dropping == task_id

    def channel_ended(self, worker_id: int, why: str, now: float, task_id: int = 0) -> list[Action]:
        """The worker's channel ended: the worker is gone, its job placed again at once
        (`why` "refused": it answered the task `task_id` sent there BUSY, which no attempt
        counts when it had not pulsed since)."""
        worker = self.scheduler.workers.get(worker_id)
        if worker is None:
            return []
        actions: list[Action] = []
        if why == "refused":
            self._refund_unread(worker, task_id)
            self.scheduler.lost(worker, now, actions, cause="refused a task", blame=False)
        else:
            log.warning("worker %d: its channel ended (%s); dropping it", worker_id, why)
            self.scheduler.lost(worker, now, actions, cause="channel ended")
        self.scheduler.dispatch(actions, now)
        return actions

    # ------------------------------------------------------------ deaths

    def exited(self, ev: WorkerExited, now: float) -> list[Action]:
        worker = self.scheduler.workers.get(ev.worker_id)
        if worker is None:
            return []
        log.debug("worker %d (pid %s) exited", worker.worker_id, worker.pid)
        actions: list[Action] = []
        self.scheduler.lost(worker, now, actions, cause="process exited")
        self.scheduler.dispatch(actions, now)
        return actions

    # ------------------------------------------------------------ helpers

    @staticmethod
    def _refund_unread(worker: Worker, task_id: int = 0) -> bool:
        """Whether the worker's task (`task_id`, or 0: whichever) was written on its channel
        and the worker has said nothing since: it never started it, and the attempt counted
        when it was written is taken back."""
        task = worker.task
        if (
            task is None
            or task.state is not TaskState.RUNNING
            or not worker.unread
            or task_id not in (0, task.task_id)
        ):
            return False
        task.attempts -= 1
        return True

    def _check(self, worker: Worker, actions: list[Action]) -> None:
        if not worker.checking:
            worker.checking = True
            actions.append(Dial(worker.worker_id, worker.uid, pb.CTRL_GET_STATUS))

    def _fetch(self, worker: Worker, actions: list[Action]) -> None:
        worker.fetch_wanted = False
        worker.advance(WorkerEvent.FETCH)
        actions.append(Dial(worker.worker_id, worker.uid, pb.CTRL_FETCH))


def promised(pulse: pb.WorkerPulse) -> int:
    """Seconds until the worker's next pulse is due: its `next_pulse` (0 counts as 1),
    at most MAX_NEXT_PULSE."""
    return min(max(1, pulse.next_pulse), MAX_NEXT_PULSE)

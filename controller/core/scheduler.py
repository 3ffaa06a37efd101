"""The controller's brain: worker registry, task queue, deadlines. No I/O, no clock.

How it works: the shells feed events (a pulse arrived, a dial finished, a
worker process exited, a task was submitted) with the current time, and get
back a list of actions (answer the pulse, dial a worker, watch a pid, report a
finished task). `expire(now)` handles the deadlines that passed and
`next_deadline()` says when to call it next.

Per-task path in the common case: submit() -> Dial(SET_TASK) -> DialDone(OK)
-> PulseReceived(FETCH_ME) -> Dial(FETCH) -> DialDone(OK) -> TaskFinished, and
the freed worker is given the next queued task in the same step.

Deadlines live in one heap with lazy deletion: an entry is checked against
the record it names when it comes due, and a pulse only moves the worker's
deadline field (the heap entry is re-armed when it fires early). Lookups are
dicts; the idle workers are an insertion-ordered dict. Nothing scans all
workers or all tasks.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import dataclass, field

from controller.core.model import (
    Action,
    Dial,
    DialDone,
    Event,
    PulseReceived,
    Reply,
    Task,
    TaskEvent,
    TaskFinished,
    TaskProgress,
    TaskState,
    WatchPid,
    Worker,
    WorkerEvent,
    WorkerExited,
    WorkerState,
)
from controller.deadlines import Deadlines
from gen import worker_protocol_pb2 as pb

log = logging.getLogger("controller.core")

_PULSE, _PLACEMENT, _RUNNING, _GRACE = 0, 1, 2, 3

_REPLY_OK = Reply(pb.PulseResponse(error=pb.CTRL_ERR_OK))
_REPLY_UNKNOWN_ID = Reply(pb.PulseResponse(error=pb.CTRL_ERR_UNKNOWN_ID))
_REPLY_UNKNOWN_TYPE = Reply(pb.PulseResponse(error=pb.CTRL_ERR_UNKNOWN_TYPE))
_REPLY_FAILED = Reply(pb.PulseResponse(error=pb.CTRL_ERR_FAILED))

_WORKER_ERR_NAMES: dict[int, str] = {int(v): str(k) for k, v in pb.WorkerError.items()}


def describe_error(code: int) -> str:
    return _WORKER_ERR_NAMES.get(code, f"unknown WorkerError {code}")


@dataclass
class Counters:
    """Running totals for status and metrics."""

    submitted: int = 0
    succeeded: int = 0
    errors: int = 0
    failed_post: int = 0
    retries: int = 0
    restarts_sent: int = 0
    registered: int = 0
    worker_losses: dict[str, int] = field(default_factory=dict)


class Core:
    """Pure scheduling state machine; see the module docstring."""

    def __init__(
        self,
        *,
        max_retries: int = 3,
        timeout_task_placement: float = 30.0,
        task_timeout: float = 0.0,
        first_worker_id: int = 1,
    ) -> None:
        self.max_retries = max_retries
        self.timeout_task_placement = timeout_task_placement
        self.task_timeout = task_timeout
        self.workers: dict[int, Worker] = {}
        self.tasks: dict[int, Task] = {}  # live (unfinished) tasks by ref
        self.counters = Counters()
        self._next_worker_id = first_worker_id
        self._next_ref = 1
        self._queue: deque[Task] = deque()
        self._queued = 0  # tasks in state QUEUED (the deque may hold stale entries)
        self._idle: dict[int, Worker] = {}
        self._deadlines: Deadlines[tuple[int, Worker | Task]] = Deadlines()
        # Recovered tasks a re-registering worker may still hold, by task_id, until they
        # are claimed, placed elsewhere or finished.
        self._orphans: dict[int, list[Task]] = {}

    # ------------------------------------------------------------ public API

    @property
    def next_worker_id(self) -> int:
        return self._next_worker_id

    @property
    def queued(self) -> int:
        return self._queued

    @property
    def idle_workers(self) -> int:
        return len(self._idle)

    def handle(self, event: Event, now: float) -> list[Action]:
        """Apply one event; return what the shells must do."""
        if isinstance(event, PulseReceived):
            return self._on_pulse(event, now)
        if isinstance(event, DialDone):
            return self._on_dial_done(event, now)
        if isinstance(event, WorkerExited):
            return self._on_exited(event, now)
        raise TypeError(f"not a core event: {event!r}")

    def submit(
        self, task_id: int, payload: bytes, owner: object, now: float
    ) -> tuple[int, list[Action]]:
        """Queue a new task; returns its ref and the actions (a SET_TASK when a worker is free)."""
        if task_id < 1:
            raise ValueError(f"task_id must be >= 1, got {task_id}")
        ref = self._next_ref
        self._next_ref += 1
        task = Task(ref=ref, task_id=task_id, payload=payload, owner=owner, created_at=now)
        self.tasks[ref] = task
        self.counters.submitted += 1
        actions: list[Action] = []
        self._enqueue(task, now)
        self._dispatch(now, actions)
        return ref, actions

    def continue_numbering(self, first_worker_id: int, next_ref: int) -> None:
        """Continue worker ids and task refs after those a previous run used."""
        self._next_worker_id = max(self._next_worker_id, first_worker_id)
        self._next_ref = max(self._next_ref, next_ref)

    def recover(
        self,
        ref: int,
        task_id: int,
        payload: bytes,
        owner: object,
        now: float,
        *,
        running: bool,
        attempts: int = 0,
        failed_on: tuple[int, ...] = (),
        placement_left: float | None = None,
        grace: float = 3.0,
    ) -> None:
        """Put back a task a previous run had accepted but not finished.

        A queued one re-enters the queue with what was left of its placement
        time. A running one waits `grace` seconds for a re-registering worker to
        report it (and is adopted without running again); then it is re-placed.
        """
        task = Task(
            ref=ref,
            task_id=task_id,
            payload=payload,
            owner=owner,
            attempts=attempts,
            created_at=now,
        )
        task.failed_on.update(failed_on)
        self.tasks[ref] = task
        self._next_ref = max(self._next_ref, ref + 1)
        # Either way a re-registering worker may report it: the journal can lag one
        # commit behind a SET_TASK the worker accepted.
        self._orphans.setdefault(task_id, []).append(task)
        if running:
            task.state = TaskState.ORPHAN
            self._push(now + grace, _GRACE, task)
        else:
            self._enqueue(task, now, placement_left=placement_left)

    def expire(self, now: float) -> list[Action]:
        """Handle every deadline at or before `now`."""
        actions: list[Action] = []
        deadlines = self._deadlines
        while (due := deadlines.pop_due(now)) is not None:
            when, (kind, obj) = due
            if kind == _PULSE:
                assert isinstance(obj, Worker)
                obj.armed = False
                if self.workers.get(obj.worker_id) is not obj:
                    continue
                if obj.deadline > now:
                    self._arm(obj)
                    continue
                log.warning("worker %d missed its pulse deadline; dropping it", obj.worker_id)
                self._drop(obj, now, actions, cause="pulse deadline passed")
            elif kind == _PLACEMENT:
                assert isinstance(obj, Task)
                if obj.state is TaskState.QUEUED and obj.placement_deadline == when:
                    self._queued -= 1
                    obj.advance(TaskEvent.PLACEMENT_TIMEOUT)
                    self.counters.failed_post += 1
                    self._finish(
                        obj,
                        actions,
                        now,
                        error=f"no free worker within {self.timeout_task_placement:g} s",
                    )
            elif kind == _GRACE:
                assert isinstance(obj, Task)
                if obj.state is TaskState.ORPHAN:
                    self._unorphan(obj)
                    log.info(
                        "task %d was running before the restart and no worker claimed it; "
                        "placing it again",
                        obj.task_id,
                    )
                    obj.last_error = "its worker did not come back after a controller restart"
                    self._retry(obj, now, actions)
            else:
                assert isinstance(obj, Task)
                if obj.state is TaskState.RUNNING and obj.running_deadline == when:
                    worker = self.workers[obj.worker_id]
                    log.warning(
                        "task %d ran longer than task_timeout %g s on worker %d; restarting it",
                        obj.task_id,
                        self.task_timeout,
                        worker.worker_id,
                    )
                    obj.last_error = f"exceeded task_timeout of {self.task_timeout:g} s"
                    self._restart(worker, now, actions, cause="task timeout")
        self._dispatch(now, actions)
        return actions

    def next_deadline(self) -> float:
        """When `expire` next has something to do (inf when nothing is pending)."""
        return self._deadlines.next()

    def status(self, now: float, max_workers: int = 200) -> dict[str, object]:
        """What `udp-client status` shows: workers, and tasks by state (an operator's query,
        so it may look at every record)."""
        by_state: dict[str, int] = {}
        for task in self.tasks.values():
            name = task.state.public
            by_state[name] = by_state.get(name, 0) + 1
        c = self.counters
        workers = [
            {
                "id": w.worker_id,
                "pid": w.pid,
                "state": w.state.value,
                "task": w.task.task_id if w.task is not None else 0,
                "last_pulse_s": round(now - w.last_pulse, 2),
                "done": w.done,
            }
            for w in itertools.islice(self.workers.values(), max_workers)
        ]
        return {
            "workers": workers,
            "workers_total": len(self.workers),
            "tasks": {
                "queued": by_state.get("queued", 0),
                "running": by_state.get("running", 0),
                "success": c.succeeded,
                "error": c.errors,
                "failed_post": c.failed_post,
            },
            "submitted": c.submitted,
            "registered": c.registered,
            "retries": c.retries,
            "restarts_sent": c.restarts_sent,
            "worker_losses": dict(c.worker_losses),
        }

    def task_state(self, ref: int) -> TaskState | None:
        """State of a live task, None once it has finished."""
        task = self.tasks.get(ref)
        return task.state if task is not None else None

    # ------------------------------------------------------------ pulses

    def _on_pulse(self, ev: PulseReceived, now: float) -> list[Action]:
        pulse = ev.pulse
        ptype = pulse.type
        if ptype == pb.PULSE_REGISTER:
            return self._register(ev, now)
        if ptype not in (pb.PULSE_OK, pb.PULSE_FETCH_ME, pb.PULSE_SHUTDOWN):
            log.info("pulse of unknown type %d refused", ptype)
            return [_REPLY_UNKNOWN_TYPE]
        worker = self.workers.get(pulse.worker_id)
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
            self._drop(worker, now, actions, cause="shutdown")
            self._dispatch(now, actions)
            return actions
        worker.deadline = now + max(1, pulse.next_pulse)
        worker.last_pulse = now
        task_id = pulse.task_id
        state = worker.state
        adoptable = task_id and task_id in self._orphans and worker.task is None
        if adoptable and self._adopt(worker, task_id, now, actions):
            if ptype == pb.PULSE_FETCH_ME:
                self._fetch(worker, actions)
            return actions
        if task_id == 0 and state in (WorkerState.STARTING, WorkerState.UNSURE):
            worker.advance(WorkerEvent.READY)
            self._idle[worker.worker_id] = worker
            self._dispatch(now, actions)
            return actions
        if task_id not in worker.expected_task_ids():
            self._check(worker, actions)
        elif ptype == pb.PULSE_FETCH_ME:
            if state is WorkerState.BUSY:
                self._fetch(worker, actions)
            elif state is WorkerState.ASSIGNING:
                worker.fetch_wanted = True
        return actions

    def _register(self, ev: PulseReceived, now: float) -> list[Action]:
        wid = self._next_worker_id
        self._next_worker_id += 1
        worker = Worker(
            worker_id=wid,
            pid=ev.pid,
            uid=ev.uid,
            deadline=now + max(1, ev.pulse.next_pulse),
        )
        worker.last_pulse = now
        self.workers[wid] = worker
        self.counters.registered += 1
        self._arm(worker)
        log.info("worker %d registered (pid %s, uid %s)", wid, ev.pid, ev.uid)
        actions: list[Action] = [Reply(pb.PulseResponse(error=pb.CTRL_ERR_OK, worker_id=wid))]
        if ev.pid:
            actions.append(WatchPid(wid, ev.pid))
        return actions

    # ------------------------------------------------------------ dial results

    def _on_dial_done(self, ev: DialDone, now: float) -> list[Action]:
        worker = self.workers.get(ev.worker_id)
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
        self._dispatch(now, actions)
        return actions

    def _set_task_done(
        self, worker: Worker, ev: DialDone, now: float, actions: list[Action]
    ) -> None:
        task = worker.task
        if worker.state is not WorkerState.ASSIGNING or task is None:
            return
        resp = ev.response
        if ev.not_owned:
            log.warning(
                "worker %d: its socket is not owned by uid %s; dropping it unused",
                worker.worker_id,
                worker.uid,
            )
            self._drop(worker, now, actions, cause="socket owned by another uid", blame=False)
            return
        if resp is None:
            # It may have taken the task before going silent: that counts as an attempt.
            task.attempts += 1
            task.failed_on.add(worker.worker_id)
            task.last_error = f"worker {worker.worker_id} did not answer SET_TASK"
            log.warning("worker %d: SET_TASK got no answer (%s)", worker.worker_id, ev.error)
            worker.task = None
            self._drop(worker, now, actions, cause="no answer")
            self._retry(task, now, actions)
            return
        err = resp.error
        if err == pb.WORKER_ERR_OK and resp.task_id in (0, task.task_id):
            task.attempts += 1
            worker.advance(WorkerEvent.ACCEPTED)
            task.advance(TaskEvent.ACCEPTED)
            actions.append(self._progress(task, waited=now - task.queued_at))
            if self.task_timeout > 0:
                task.running_deadline = now + self.task_timeout
                self._push(task.running_deadline, _RUNNING, task)
            if worker.fetch_wanted:
                self._fetch(worker, actions)
            return
        if err == pb.WORKER_ERR_BUSY:
            worker.advance(WorkerEvent.REFUSED)
            worker.task = None
            self._requeue(task, now, actions)
            return
        why = (
            f"answered task {resp.task_id} for task {task.task_id}"
            if err == pb.WORKER_ERR_OK
            else f"answered {describe_error(err)}"
        )
        log.warning("worker %d: SET_TASK %s; dropping it", worker.worker_id, why)
        self._drop(worker, now, actions, cause="bad answer", blame=False)

    def _fetch_done(self, worker: Worker, ev: DialDone, now: float, actions: list[Action]) -> None:
        task = worker.task
        if worker.state is not WorkerState.FETCHING or task is None:
            return
        resp = ev.response
        if resp is None:
            log.warning("worker %d: FETCH got no answer (%s)", worker.worker_id, ev.error)
            self._drop(worker, now, actions, cause="no answer")
            return
        err = resp.error
        if err == pb.WORKER_ERR_OK and resp.task_id == task.task_id:
            worker.advance(WorkerEvent.FETCHED)
            worker.task = None
            worker.done += 1
            self._idle[worker.worker_id] = worker
            task.advance(TaskEvent.SUCCEED)
            self.counters.succeeded += 1
            self._finish(task, actions, now, result=ev.extra)
        elif err in (pb.WORKER_ERR_NO_FETCH, pb.WORKER_ERR_BUSY):
            worker.advance(WorkerEvent.NOTHING_TO_FETCH)
        elif err == pb.WORKER_ERR_TASK_FAILED and resp.task_id in (0, task.task_id):
            worker.advance(WorkerEvent.FETCHED)
            worker.task = None
            self._idle[worker.worker_id] = worker
            task.failed_on.add(worker.worker_id)
            task.last_error = ev.extra.decode("utf-8", "replace")
            log.info(
                "task %d failed on worker %d: %s",
                task.task_id,
                worker.worker_id,
                task.last_error[-200:],
            )
            self._retry(task, now, actions)
        else:
            why = (
                f"answered task {resp.task_id} for task {task.task_id}"
                if err in (pb.WORKER_ERR_OK, pb.WORKER_ERR_TASK_FAILED)
                else f"answered {describe_error(err)}"
            )
            log.warning("worker %d: FETCH %s; dropping it", worker.worker_id, why)
            self._drop(worker, now, actions, cause="bad answer")

    def _status_done(self, worker: Worker, ev: DialDone, now: float, actions: list[Action]) -> None:
        worker.checking = False
        resp = ev.response
        if resp is None or resp.error != pb.WORKER_ERR_OK:
            why = ev.error if resp is None else describe_error(resp.error)
            log.warning("worker %d: GET_STATUS failed (%s); dropping it", worker.worker_id, why)
            self._drop(worker, now, actions, cause="no answer" if resp is None else "bad answer")
            return
        if resp.task_id == 0 and worker.state in (WorkerState.STARTING, WorkerState.UNSURE):
            worker.advance(WorkerEvent.READY)
            self._idle[worker.worker_id] = worker
            return
        if resp.task_id in worker.expected_task_ids():
            return
        expected = worker.task.task_id if worker.task is not None else 0
        log.warning(
            "worker %d holds task %d but the controller gave it %d; restarting it",
            worker.worker_id,
            resp.task_id,
            expected,
        )
        self._restart(worker, now, actions, cause="task mismatch")

    # ------------------------------------------------------------ deaths

    def _on_exited(self, ev: WorkerExited, now: float) -> list[Action]:
        worker = self.workers.get(ev.worker_id)
        if worker is None:
            return []
        log.debug("worker %d (pid %s) exited", worker.worker_id, worker.pid)
        actions: list[Action] = []
        self._drop(worker, now, actions, cause="process exited")
        self._dispatch(now, actions)
        return actions

    # ------------------------------------------------------------ recovery

    def _adopt(self, worker: Worker, task_id: int, now: float, actions: list[Action]) -> bool:
        """Give a recovered task to the worker that reports holding it, if that is unambiguous."""
        candidates = self._orphans[task_id]
        if len(candidates) != 1:
            log.warning(
                "worker %d holds task %d, but %d recovered tasks have that number; "
                "not guessing: they will be placed again",
                worker.worker_id,
                task_id,
                len(candidates),
            )
            return False
        task = candidates[0]
        self._unorphan(task)
        if task.state is TaskState.QUEUED:
            self._queued -= 1  # its deque entry is skipped lazily
        self._idle.pop(worker.worker_id, None)
        worker.advance(WorkerEvent.ADOPT)
        task.advance(TaskEvent.ADOPT)
        worker.task = task
        task.worker_id = worker.worker_id
        if self.task_timeout > 0:
            task.running_deadline = now + self.task_timeout
            self._push(task.running_deadline, _RUNNING, task)
        log.info("worker %d took over task %d after the restart", worker.worker_id, task_id)
        actions.append(self._progress(task))
        return True

    def _unorphan(self, task: Task) -> None:
        same = self._orphans.get(task.task_id, [])
        if task in same:
            same.remove(task)
        if not same:
            self._orphans.pop(task.task_id, None)

    @staticmethod
    def _progress(task: Task, waited: float = 0.0) -> TaskProgress:
        failed_on = tuple(sorted(task.failed_on))
        return TaskProgress(task.ref, task.state, task.attempts, failed_on, waited)

    # ------------------------------------------------------------ helpers

    def _check(self, worker: Worker, actions: list[Action]) -> None:
        if not worker.checking:
            worker.checking = True
            actions.append(Dial(worker.worker_id, worker.uid, pb.CTRL_GET_STATUS))

    def _fetch(self, worker: Worker, actions: list[Action]) -> None:
        worker.fetch_wanted = False
        worker.advance(WorkerEvent.FETCH)
        actions.append(Dial(worker.worker_id, worker.uid, pb.CTRL_FETCH))

    def _restart(self, worker: Worker, now: float, actions: list[Action], cause: str) -> None:
        self.counters.restarts_sent += 1
        actions.append(Dial(worker.worker_id, worker.uid, pb.CTRL_RESTART))
        self._drop(worker, now, actions, cause=cause)

    def _drop(
        self,
        worker: Worker,
        now: float,
        actions: list[Action],
        *,
        cause: str,
        blame: bool = True,
    ) -> None:
        """Forget the worker; re-place its task (`blame`: the task counts it as a failure)."""
        del self.workers[worker.worker_id]
        self._idle.pop(worker.worker_id, None)
        if cause != "shutdown":
            losses = self.counters.worker_losses
            losses[cause] = losses.get(cause, 0) + 1
        task = worker.task
        worker.task = None
        if task is None:
            return
        if blame and task.state is TaskState.RUNNING:
            task.failed_on.add(worker.worker_id)
            if not task.last_error:
                task.last_error = f"worker {worker.worker_id} lost ({cause})"
            self._retry(task, now, actions)
        else:
            self._requeue(task, now, actions)

    def _retry(self, task: Task, now: float, actions: list[Action]) -> None:
        """The task's attempt failed: queue it again, or end it once retries are used up."""
        if task.attempts > self.max_retries:
            task.worker_id = 0
            task.advance(TaskEvent.FAIL)
            self.counters.errors += 1
            self._finish(
                task,
                actions,
                now,
                error=f"failed {task.attempts} times; last error: {task.last_error}",
            )
            return
        self.counters.retries += 1
        self._requeue(task, now, actions)

    def _requeue(self, task: Task, now: float, actions: list[Action]) -> None:
        was_running = task.state is not TaskState.ASSIGNING
        task.advance(TaskEvent.REQUEUE)
        task.worker_id = 0
        task.running_deadline = 0.0
        self._enqueue(task, now, front=True)
        if was_running:
            actions.append(self._progress(task))

    def _enqueue(
        self, task: Task, now: float, front: bool = False, placement_left: float | None = None
    ) -> None:
        left = self.timeout_task_placement if placement_left is None else max(0.0, placement_left)
        task.queued_at = now
        task.placement_deadline = now + left
        self._push(task.placement_deadline, _PLACEMENT, task)
        self._queued += 1
        if front:
            self._queue.appendleft(task)
        else:
            self._queue.append(task)

    def _dispatch(self, now: float, actions: list[Action]) -> None:
        """Give queued tasks to idle workers, oldest task first."""
        queue = self._queue
        idle = self._idle
        while queue and idle:
            task = queue.popleft()
            if task.state is not TaskState.QUEUED:
                continue  # timed out while queued
            worker = self._pick(task)
            if self._orphans:
                self._unorphan(task)
            del idle[worker.worker_id]
            self._queued -= 1
            worker.advance(WorkerEvent.ASSIGN)
            task.advance(TaskEvent.PLACE)
            worker.task = task
            task.worker_id = worker.worker_id
            actions.append(
                Dial(worker.worker_id, worker.uid, pb.CTRL_SET_TASK, task.task_id, task.payload)
            )

    def _pick(self, task: Task) -> Worker:
        """The longest-idle worker, skipping those this task already failed on if possible."""
        idle = self._idle
        if not task.failed_on:
            return next(iter(idle.values()))
        # At most len(failed_on) idle workers can be excluded, so this looks at few.
        for worker in itertools.islice(idle.values(), len(task.failed_on) + 1):
            if worker.worker_id not in task.failed_on:
                return worker
        return next(iter(idle.values()))

    def _finish(
        self,
        task: Task,
        actions: list[Action],
        now: float,
        *,
        result: bytes = b"",
        error: str = "",
    ) -> None:
        del self.tasks[task.ref]
        if self._orphans:
            self._unorphan(task)
        task.payload = b""
        actions.append(
            TaskFinished(
                task.ref,
                task.task_id,
                task.owner,
                task.state,
                result=result,
                error=error,
                age=now - task.created_at,
            )
        )

    def _arm(self, worker: Worker) -> None:
        if not worker.armed:
            worker.armed = True
            self._push(worker.deadline, _PULSE, worker)

    def _push(self, when: float, kind: int, obj: Worker | Task) -> None:
        self._deadlines.push(when, (kind, obj))

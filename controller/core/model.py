"""States, the transition tables, and the events and actions of the controller core.

Every state change of a task or a worker goes through `Task.advance` /
`Worker.advance` (`next_task_state` / `next_worker_state`), which look the
(state, event) pair up in one table and raise `IllegalTransition` naming both
when the pair is not there (the shape of h11's `_state.py`). Events in and
actions out are small frozen dataclasses; wire enums are the generated protobuf
ones, never copies.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

from controller.options import DEFAULT as DEFAULT_OPTIONS
from controller.options import DEFAULT_QUEUE, JobOptions
from gen import worker_protocol_pb2 as pb

# What a worker that names no queue serves.
SERVES_DEFAULT = frozenset({DEFAULT_QUEUE})


class IdentityEnum(enum.Enum):
    """An enum hashed by identity: the transition tables are looked up several times per
    job, and Enum's own __hash__ (hash of the name) is a Python call each time."""

    __hash__ = object.__hash__


class TaskState(IdentityEnum):
    QUEUED = "queued"
    ASSIGNING = "assigning"  # SET_TASK dialled, answer not yet in
    RUNNING = "running"
    SUCCESS = "success"
    ERROR = "error"
    FAILED_POST = "failed_post"
    ORPHAN = "orphan"  # was running when the controller restarted; waiting to be claimed
    CANCELED = "canceled"  # by a user: never placed again
    SCHEDULED = "scheduled"  # waiting for its time (delay, run_at, retry_delay)

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(
    {TaskState.SUCCESS, TaskState.ERROR, TaskState.FAILED_POST, TaskState.CANCELED}
)
# States of a task that waits for a worker (pending or for its time): it names none.
WAITING = frozenset({TaskState.SCHEDULED, TaskState.QUEUED})


class TaskEvent(IdentityEnum):
    PLACE = enum.auto()  # offered to a worker with SET_TASK
    ACCEPTED = enum.auto()  # the worker answered SET_TASK with OK
    REQUEUE = enum.auto()  # back in the queue (worker busy, failed or gone)
    SUCCEED = enum.auto()  # FETCH brought the result
    FAIL = enum.auto()  # retries used up
    PLACEMENT_TIMEOUT = enum.auto()  # no free worker within timeout_task_placement
    ADOPT = enum.auto()  # a re-registered worker reports it still holds this task
    CANCEL = enum.auto()  # a user canceled it
    WAIT = enum.auto()  # to wait for a time before it is pending (delay, retry_delay)
    DUE = enum.auto()  # its time came: pending


_TS, _TE = TaskState, TaskEvent  # short names for the table only
TASK_TRANSITIONS: dict[tuple[TaskState, TaskEvent], TaskState] = {
    (_TS.QUEUED, _TE.PLACE): _TS.ASSIGNING,
    (_TS.QUEUED, _TE.PLACEMENT_TIMEOUT): _TS.FAILED_POST,
    (_TS.QUEUED, _TE.FAIL): _TS.ERROR,
    (_TS.ASSIGNING, _TE.ACCEPTED): _TS.RUNNING,
    (_TS.ASSIGNING, _TE.REQUEUE): _TS.QUEUED,
    (_TS.ASSIGNING, _TE.FAIL): _TS.ERROR,
    (_TS.RUNNING, _TE.SUCCEED): _TS.SUCCESS,
    (_TS.RUNNING, _TE.REQUEUE): _TS.QUEUED,
    (_TS.RUNNING, _TE.FAIL): _TS.ERROR,
    (_TS.ORPHAN, _TE.ADOPT): _TS.RUNNING,
    (_TS.QUEUED, _TE.ADOPT): _TS.RUNNING,
    (_TS.ORPHAN, _TE.REQUEUE): _TS.QUEUED,
    (_TS.ORPHAN, _TE.FAIL): _TS.ERROR,
    (_TS.QUEUED, _TE.CANCEL): _TS.CANCELED,
    (_TS.ASSIGNING, _TE.CANCEL): _TS.CANCELED,
    (_TS.RUNNING, _TE.CANCEL): _TS.CANCELED,
    (_TS.ORPHAN, _TE.CANCEL): _TS.CANCELED,
    (_TS.QUEUED, _TE.WAIT): _TS.SCHEDULED,
    (_TS.ASSIGNING, _TE.WAIT): _TS.SCHEDULED,
    (_TS.RUNNING, _TE.WAIT): _TS.SCHEDULED,
    (_TS.ORPHAN, _TE.WAIT): _TS.SCHEDULED,
    (_TS.SCHEDULED, _TE.DUE): _TS.QUEUED,
    (_TS.SCHEDULED, _TE.CANCEL): _TS.CANCELED,
}


class WorkerState(IdentityEnum):
    STARTING = "starting"  # registered; its socket is not known to listen yet
    IDLE = "idle"
    ASSIGNING = "assigning"  # SET_TASK in flight
    BUSY = "busy"  # holds a task
    FETCHING = "fetching"  # FETCH in flight
    UNSURE = "unsure"  # answered BUSY to a SET_TASK: not offered work until a pulse says idle


class WorkerEvent(IdentityEnum):
    READY = enum.auto()
    ASSIGN = enum.auto()
    ACCEPTED = enum.auto()
    REFUSED = enum.auto()
    FETCH = enum.auto()
    FETCHED = enum.auto()
    NOTHING_TO_FETCH = enum.auto()
    ADOPT = enum.auto()
    NEXT = enum.auto()  # its outcome came and its next task (already there) runs now


_WS, _WE = WorkerState, WorkerEvent  # short names for the table only
WORKER_TRANSITIONS: dict[tuple[WorkerState, WorkerEvent], WorkerState] = {
    (_WS.STARTING, _WE.READY): _WS.IDLE,
    (_WS.UNSURE, _WE.READY): _WS.IDLE,
    (_WS.IDLE, _WE.ASSIGN): _WS.ASSIGNING,
    (_WS.ASSIGNING, _WE.ACCEPTED): _WS.BUSY,
    (_WS.ASSIGNING, _WE.REFUSED): _WS.UNSURE,
    (_WS.BUSY, _WE.FETCH): _WS.FETCHING,
    (_WS.FETCHING, _WE.FETCHED): _WS.IDLE,
    (_WS.FETCHING, _WE.NOTHING_TO_FETCH): _WS.BUSY,
    (_WS.FETCHING, _WE.NEXT): _WS.BUSY,
    (_WS.STARTING, _WE.ADOPT): _WS.BUSY,
    (_WS.IDLE, _WE.ADOPT): _WS.BUSY,
    (_WS.UNSURE, _WE.ADOPT): _WS.BUSY,
}


class IllegalTransition(RuntimeError):
    """A (state, event) pair the tables do not allow: always a bug in the core."""


def next_task_state(state: TaskState, event: TaskEvent) -> TaskState:
    try:
        return TASK_TRANSITIONS[state, event]
    except KeyError:
        raise IllegalTransition(
            f"task: event {event.name} is illegal in state {state.name}"
        ) from None


def next_worker_state(state: WorkerState, event: WorkerEvent) -> WorkerState:
    try:
        return WORKER_TRANSITIONS[state, event]
    except KeyError:
        raise IllegalTransition(
            f"worker: event {event.name} is illegal in state {state.name}"
        ) from None


# ---------------------------------------------------------------- records


@dataclass(eq=False, slots=True)
class Task:
    ref: int  # the controller's own handle; task_id alone is not unique across clients
    task_id: int  # the client's number, sent on the wire
    payload: bytes
    job: object  # the job it carries out (the desk's tasks: the job's id), opaque here
    state: TaskState = TaskState.QUEUED
    attempts: int = 0  # SET_TASKs that were (or may have been) accepted
    retried_at: int = 0  # `attempts` when a user last retried it: max_retries counts from there
    failed_on: frozenset[int] = frozenset()  # workers it failed on (shared while empty)
    worker_id: int = 0  # holder while ASSIGNING / RUNNING
    queued_at: float = 0.0
    # While queued: its placement deadline (0: none); while running: its timeout's; while
    # scheduled: when it is due.
    # One field for both (a task is never both), and a deadline fires only if it is still
    # the task's one and the task is in the state it was set for.
    deadline: float = 0.0
    last_error: str = ""
    created_at: float = 0.0
    # A poller's claim token for this task ("": none): its every report must carry it.
    lease: str = ""
    # Queue, priority, labels, time and retry rules (shared by jobs that set none).
    opts: JobOptions = DEFAULT_OPTIONS
    # It counts against its queue's concurrency (placed while its queue had a limit).
    limited: bool = False

    def advance(self, event: TaskEvent) -> None:
        self.state = next_task_state(self.state, event)

    def failed_on_worker(self, worker_id: int) -> None:
        """Remember a worker it failed on (a new set: rare, and an empty one costs nothing)."""
        self.failed_on = self.failed_on | {worker_id}


class WorkerKind(Protocol):
    """How the scheduler reaches one kind of worker (local today; calculators, pollers)."""

    label: str  # what status views call this kind

    def place(self, worker: Worker, task: Task, actions: list[Action]) -> None:
        """Hand `task` to `worker`; the answer comes back as accepted, refused or lost."""

    def take_back(self, worker: Worker, actions: list[Action]) -> None:
        """Stop the task `worker` holds by force (a local worker gets RESTART)."""

    def drop_next(self, worker: Worker, task: Task, actions: list[Action]) -> None:
        """Ask `worker` to forget its next task `task`, canceled before it started (only a
        kind whose workers take a next task is asked)."""


@dataclass(eq=False, slots=True)
class Worker:
    worker_id: int
    kind: WorkerKind
    pid: int | None
    uid: int | None
    deadline: float
    state: WorkerState = WorkerState.STARTING
    task: Task | None = None
    fetch_wanted: bool = False  # FETCH_ME arrived while SET_TASK was in flight
    checking: bool = False  # a GET_STATUS is in flight
    armed: bool = False  # a pulse-deadline entry for it is in the heap
    done: int = 0  # tasks fetched from it, for the status view
    last_pulse: float = 0.0
    queues: frozenset[str] = SERVES_DEFAULT  # the queues it takes jobs from
    labels: frozenset[str] = frozenset()  # what it has, for jobs' `requires`
    starved: int = -1  # the pending version at which it last found nothing it could take
    channel: bool = False  # keeps a channel: a task counts as taken once written there
    # Its task was written on its channel and no pulse has come since: the next pulse may
    # have left before the worker read the task, and may still say task 0.
    unread: bool = False
    # A next task (docs/protocol.md, "A next task"): the worker takes one on its channel
    # while its task runs (granted at REGISTER, usable once the channel is open).
    takes_next: bool = False
    next_granted: bool = False  # granted at REGISTER (takes_next once its channel opens)
    next: Task | None = None  # written on its channel, started when `task` ends
    dropping: int = 0  # the task id of a canceled next task, CTRL_DROP in flight
    reclaiming: bool = False  # CTRL_DROP in flight to take `next` back (see next_tasks.py)
    last_done: int = 0  # the task id of the last outcome it sent (a stale GET_STATUS answer)

    def advance(self, event: WorkerEvent) -> None:
        self.state = next_worker_state(self.state, event)

    def expected_task_ids(self) -> tuple[int, ...]:
        """Task ids a pulse may carry in this state without being a mismatch.

        A pulse may have left the worker before a SET_TASK landed or after a
        FETCH drained it, so the neighbouring state's id is fine too.
        """
        tid = self.task.task_id if self.task is not None else 0
        if self.state in (WorkerState.ASSIGNING, WorkerState.FETCHING):
            return (0, tid)
        if self.state is WorkerState.BUSY:
            return (tid,)
        return (0,)


# ---------------------------------------------------------------- events in


@dataclass(frozen=True, slots=True)
class PulseReceived:
    pulse: pb.WorkerPulse
    pid: int | None = None  # SO_PEERCRED of the connection
    uid: int | None = None


@dataclass(frozen=True, slots=True)
class DialDone:
    """The outcome of one Dial: `response` is None when there was no usable answer."""

    worker_id: int
    kind: int  # pb.ControlType
    response: pb.WorkerResponse | None
    extra: bytes = b""
    error: str = ""  # why there is no response
    not_owned: bool = False  # the socket file belongs to another uid: nothing was sent


@dataclass(frozen=True, slots=True)
class WorkerExited:
    """The worker's process is gone (seen through its pidfd)."""

    worker_id: int


Event = PulseReceived | DialDone | WorkerExited


# ---------------------------------------------------------------- actions out


@dataclass(frozen=True, slots=True)
class Reply:
    """Answer the pulse on the connection it came in on."""

    response: pb.PulseResponse


@dataclass(frozen=True, slots=True)
class Dial:
    """Connect to the worker's socket, send this control message, report DialDone."""

    worker_id: int
    uid: int | None
    kind: int  # pb.ControlType
    task_id: int = 0
    extra: bytes = b""


@dataclass(frozen=True, slots=True)
class WatchPid:
    """Report WorkerExited for this worker when its process ends."""

    worker_id: int
    pid: int


@dataclass(frozen=True, slots=True)
class TaskProgress:
    """A task started running, or went back to the queue after running (for the journal)."""

    ref: int
    state: TaskState
    attempts: int
    failed_on: tuple[int, ...]
    waited: float = 0.0  # seconds in the queue before this start (for the metrics)


@dataclass(frozen=True, slots=True)
class TaskFinished:
    """A task reached its final state: success (with result), error or failed_post."""

    ref: int
    task_id: int
    job: object  # the task's `job`
    state: TaskState
    result: bytes = b""
    error: str = ""
    age: float = 0.0  # seconds since it was submitted (or recovered)
    # Why it failed (DESIGN.md section 15): limit, error, timeout, lost, placement; "" else.
    reason: str = ""


@dataclass(frozen=True, slots=True)
class HandOut:
    """Answer poller `name`'s waiting /ping/ with the job of task `ref` (see pollers.py)."""

    name: str
    ref: int
    job: object  # the task's `job`: for the desk's tasks, the job's id


@dataclass(frozen=True, slots=True)
class PerformTask:
    """Send `perform_task` to the calculator at `address` (see calculators.py)."""

    address: tuple[str, int]
    ref: int
    task_id: int
    payload: bytes


Action = Reply | Dial | WatchPid | TaskProgress | TaskFinished | HandOut | PerformTask


@dataclass
class Counters:
    """Running totals for status and metrics."""

    submitted: int = 0
    succeeded: int = 0
    errors: int = 0
    placement_timeouts: int = 0  # tasks that found no worker in time (state failed_post)
    canceled: int = 0
    retries: int = 0
    restarts_sent: int = 0
    registered: int = 0
    worker_losses: dict[str, int] = field(default_factory=dict)


def progress(task: Task, waited: float = 0.0) -> TaskProgress:
    """The journal's and the metrics' view of a task that started or went back to the queue."""
    failed_on = tuple(sorted(task.failed_on))
    return TaskProgress(task.ref, task.state, task.attempts, failed_on, waited)

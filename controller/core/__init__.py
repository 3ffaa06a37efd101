"""The pure controller core: plain synchronous Python, no trio, no sockets, no clock."""

from controller.core.core import Core
from controller.core.model import (
    Action,
    Dial,
    DialDone,
    Event,
    HandOut,
    IllegalTransition,
    PerformTask,
    PulseReceived,
    Reply,
    Task,
    TaskFinished,
    TaskProgress,
    TaskState,
    WatchPid,
    Worker,
    WorkerExited,
    WorkerState,
)
from controller.core.scheduler import Counters

__all__ = [
    "Action",
    "Core",
    "Counters",
    "Dial",
    "DialDone",
    "Event",
    "HandOut",
    "IllegalTransition",
    "PerformTask",
    "PulseReceived",
    "Reply",
    "Task",
    "TaskFinished",
    "TaskProgress",
    "TaskState",
    "WatchPid",
    "Worker",
    "WorkerExited",
    "WorkerState",
]

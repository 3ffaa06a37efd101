from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PulseType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PULSE_REGISTER: _ClassVar[PulseType]
    PULSE_OK: _ClassVar[PulseType]
    PULSE_FETCH_ME: _ClassVar[PulseType]
    PULSE_SHUTDOWN: _ClassVar[PulseType]
    PULSE_OUTPUT: _ClassVar[PulseType]
    PULSE_PROGRESS: _ClassVar[PulseType]

class ControllerError(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CTRL_ERR_OK: _ClassVar[ControllerError]
    CTRL_ERR_UNKNOWN_TYPE: _ClassVar[ControllerError]
    CTRL_ERR_UNKNOWN_ID: _ClassVar[ControllerError]
    CTRL_ERR_FAILED: _ClassVar[ControllerError]

class ControlType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CTRL_RESTART: _ClassVar[ControlType]
    CTRL_FETCH: _ClassVar[ControlType]
    CTRL_SET_TASK: _ClassVar[ControlType]
    CTRL_GET_STATUS: _ClassVar[ControlType]
    CTRL_DROP: _ClassVar[ControlType]

class WorkerError(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ERR_OK: _ClassVar[WorkerError]
    WORKER_ERR_NO_FETCH: _ClassVar[WorkerError]
    WORKER_ERR_BUSY: _ClassVar[WorkerError]
    WORKER_ERR_TASK_FAILED: _ClassVar[WorkerError]
    WORKER_ERR_FAILED: _ClassVar[WorkerError]
PULSE_REGISTER: PulseType
PULSE_OK: PulseType
PULSE_FETCH_ME: PulseType
PULSE_SHUTDOWN: PulseType
PULSE_OUTPUT: PulseType
PULSE_PROGRESS: PulseType
CTRL_ERR_OK: ControllerError
CTRL_ERR_UNKNOWN_TYPE: ControllerError
CTRL_ERR_UNKNOWN_ID: ControllerError
CTRL_ERR_FAILED: ControllerError
CTRL_RESTART: ControlType
CTRL_FETCH: ControlType
CTRL_SET_TASK: ControlType
CTRL_GET_STATUS: ControlType
CTRL_DROP: ControlType
WORKER_ERR_OK: WorkerError
WORKER_ERR_NO_FETCH: WorkerError
WORKER_ERR_BUSY: WorkerError
WORKER_ERR_TASK_FAILED: WorkerError
WORKER_ERR_FAILED: WorkerError

class WorkerPulse(_message.Message):
    __slots__ = ("type", "worker_id", "task_id", "next_pulse", "queues", "labels", "extra_size", "channel", "progress", "status", "takes_next")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    NEXT_PULSE_FIELD_NUMBER: _ClassVar[int]
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_SIZE_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TAKES_NEXT_FIELD_NUMBER: _ClassVar[int]
    type: PulseType
    worker_id: int
    task_id: int
    next_pulse: int
    queues: _containers.RepeatedScalarFieldContainer[str]
    labels: _containers.RepeatedScalarFieldContainer[str]
    extra_size: int
    channel: bool
    progress: float
    status: str
    takes_next: bool
    def __init__(self, type: _Optional[_Union[PulseType, str]] = ..., worker_id: _Optional[int] = ..., task_id: _Optional[int] = ..., next_pulse: _Optional[int] = ..., queues: _Optional[_Iterable[str]] = ..., labels: _Optional[_Iterable[str]] = ..., extra_size: _Optional[int] = ..., channel: _Optional[bool] = ..., progress: _Optional[float] = ..., status: _Optional[str] = ..., takes_next: _Optional[bool] = ...) -> None: ...

class PulseResponse(_message.Message):
    __slots__ = ("error", "worker_id", "takes_output", "channel", "takes_progress", "takes_next")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TAKES_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    TAKES_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    TAKES_NEXT_FIELD_NUMBER: _ClassVar[int]
    error: ControllerError
    worker_id: int
    takes_output: bool
    channel: bool
    takes_progress: bool
    takes_next: bool
    def __init__(self, error: _Optional[_Union[ControllerError, str]] = ..., worker_id: _Optional[int] = ..., takes_output: _Optional[bool] = ..., channel: _Optional[bool] = ..., takes_progress: _Optional[bool] = ..., takes_next: _Optional[bool] = ...) -> None: ...

class JobLimits(_message.Message):
    __slots__ = ("memory_max", "tasks_max", "cpu_time", "file_size", "open_files", "cpu_quota")
    MEMORY_MAX_FIELD_NUMBER: _ClassVar[int]
    TASKS_MAX_FIELD_NUMBER: _ClassVar[int]
    CPU_TIME_FIELD_NUMBER: _ClassVar[int]
    FILE_SIZE_FIELD_NUMBER: _ClassVar[int]
    OPEN_FILES_FIELD_NUMBER: _ClassVar[int]
    CPU_QUOTA_FIELD_NUMBER: _ClassVar[int]
    memory_max: int
    tasks_max: int
    cpu_time: float
    file_size: int
    open_files: int
    cpu_quota: float
    def __init__(self, memory_max: _Optional[int] = ..., tasks_max: _Optional[int] = ..., cpu_time: _Optional[float] = ..., file_size: _Optional[int] = ..., open_files: _Optional[int] = ..., cpu_quota: _Optional[float] = ...) -> None: ...

class ControlMsg(_message.Message):
    __slots__ = ("type", "extra_size", "task_id", "limits", "batch_id")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    EXTRA_SIZE_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    type: ControlType
    extra_size: int
    task_id: int
    limits: JobLimits
    batch_id: str
    def __init__(self, type: _Optional[_Union[ControlType, str]] = ..., extra_size: _Optional[int] = ..., task_id: _Optional[int] = ..., limits: _Optional[_Union[JobLimits, _Mapping]] = ..., batch_id: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("wall", "cpu", "max_rss", "memory_peak")
    WALL_FIELD_NUMBER: _ClassVar[int]
    CPU_FIELD_NUMBER: _ClassVar[int]
    MAX_RSS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_PEAK_FIELD_NUMBER: _ClassVar[int]
    wall: float
    cpu: float
    max_rss: int
    memory_peak: int
    def __init__(self, wall: _Optional[float] = ..., cpu: _Optional[float] = ..., max_rss: _Optional[int] = ..., memory_peak: _Optional[int] = ...) -> None: ...

class WorkerResponse(_message.Message):
    __slots__ = ("error", "task_id", "extra_size", "usage", "reason")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    EXTRA_SIZE_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    error: WorkerError
    task_id: int
    extra_size: int
    usage: Usage
    reason: str
    def __init__(self, error: _Optional[_Union[WorkerError, str]] = ..., task_id: _Optional[int] = ..., extra_size: _Optional[int] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., reason: _Optional[str] = ...) -> None: ...

class ChannelFrame(_message.Message):
    __slots__ = ("pulse", "pulse_response", "control", "response", "answers", "extra_size")
    PULSE_FIELD_NUMBER: _ClassVar[int]
    PULSE_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    CONTROL_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_SIZE_FIELD_NUMBER: _ClassVar[int]
    pulse: WorkerPulse
    pulse_response: PulseResponse
    control: ControlMsg
    response: WorkerResponse
    answers: ControlType
    extra_size: int
    def __init__(self, pulse: _Optional[_Union[WorkerPulse, _Mapping]] = ..., pulse_response: _Optional[_Union[PulseResponse, _Mapping]] = ..., control: _Optional[_Union[ControlMsg, _Mapping]] = ..., response: _Optional[_Union[WorkerResponse, _Mapping]] = ..., answers: _Optional[_Union[ControlType, str]] = ..., extra_size: _Optional[int] = ...) -> None: ...

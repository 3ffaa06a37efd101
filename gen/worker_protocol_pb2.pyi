from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PulseType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PULSE_REGISTER: _ClassVar[PulseType]
    PULSE_OK: _ClassVar[PulseType]
    PULSE_FETCH_ME: _ClassVar[PulseType]
    PULSE_SHUTDOWN: _ClassVar[PulseType]
    PULSE_OUTPUT: _ClassVar[PulseType]

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
CTRL_ERR_OK: ControllerError
CTRL_ERR_UNKNOWN_TYPE: ControllerError
CTRL_ERR_UNKNOWN_ID: ControllerError
CTRL_ERR_FAILED: ControllerError
CTRL_RESTART: ControlType
CTRL_FETCH: ControlType
CTRL_SET_TASK: ControlType
CTRL_GET_STATUS: ControlType
WORKER_ERR_OK: WorkerError
WORKER_ERR_NO_FETCH: WorkerError
WORKER_ERR_BUSY: WorkerError
WORKER_ERR_TASK_FAILED: WorkerError
WORKER_ERR_FAILED: WorkerError

class WorkerPulse(_message.Message):
    __slots__ = ("type", "worker_id", "task_id", "next_pulse", "queues", "labels", "extra_size")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    NEXT_PULSE_FIELD_NUMBER: _ClassVar[int]
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_SIZE_FIELD_NUMBER: _ClassVar[int]
    type: PulseType
    worker_id: int
    task_id: int
    next_pulse: int
    queues: _containers.RepeatedScalarFieldContainer[str]
    labels: _containers.RepeatedScalarFieldContainer[str]
    extra_size: int
    def __init__(self, type: _Optional[_Union[PulseType, str]] = ..., worker_id: _Optional[int] = ..., task_id: _Optional[int] = ..., next_pulse: _Optional[int] = ..., queues: _Optional[_Iterable[str]] = ..., labels: _Optional[_Iterable[str]] = ..., extra_size: _Optional[int] = ...) -> None: ...

class PulseResponse(_message.Message):
    __slots__ = ("error", "worker_id", "takes_output")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TAKES_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    error: ControllerError
    worker_id: int
    takes_output: bool
    def __init__(self, error: _Optional[_Union[ControllerError, str]] = ..., worker_id: _Optional[int] = ..., takes_output: _Optional[bool] = ...) -> None: ...

class ControlMsg(_message.Message):
    __slots__ = ("type", "extra_size", "task_id")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    EXTRA_SIZE_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    type: ControlType
    extra_size: int
    task_id: int
    def __init__(self, type: _Optional[_Union[ControlType, str]] = ..., extra_size: _Optional[int] = ..., task_id: _Optional[int] = ...) -> None: ...

class WorkerResponse(_message.Message):
    __slots__ = ("error", "task_id", "extra_size")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    EXTRA_SIZE_FIELD_NUMBER: _ClassVar[int]
    error: WorkerError
    task_id: int
    extra_size: int
    def __init__(self, error: _Optional[_Union[WorkerError, str]] = ..., task_id: _Optional[int] = ..., extra_size: _Optional[int] = ...) -> None: ...

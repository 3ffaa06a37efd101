"""What the job desk (controller/shell/desk.py) needs of the parts around it: a door's shell
(`Door`), an answer a door holds until the journal has what it announces (`Answer`), and the
core's shell (`Scheduling`, controller/shell/core_shell.py)."""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

from controller.core import Core, Task
from controller.jobs import Job
from controller.options import JobOptions
from controller.usage import Usage


class Door(Protocol):
    """What the desk needs of a door's shell."""

    def job_finished(self, job: Job, now: float) -> None:
        """Tell the submitter of `job` (one of this door's, just ended) its outcome; call
        the desk's `delivered` once the submitter has it (or never will)."""

    def forget(self, job: Job) -> None:
        """The book forgot `job` (or its outcome is no longer news): nothing more to send."""


class Answer(Protocol):
    """An answer a door holds until the journal has what it announces."""

    @property
    def job_id(self) -> str:
        """The job the answer is about ("": none)."""

    def refused(self) -> Answer | None:
        """What goes instead when the journal refused the job's record (None: nothing)."""


AnswerT = TypeVar("AnswerT", bound=Answer)


class Scheduling(Protocol):
    """What the desk needs of the scheduler's shell (controller/shell/core_shell.py)."""

    core: Core

    def queue(
        self,
        task_id: int,
        payload: bytes,
        job: object,
        options: JobOptions | None = ...,
        wait: float = ...,
        now: float | None = ...,
        dispatch: bool = ...,
    ) -> tuple[Task, list[Any]]: ...

    def execute(self, actions: list[Any]) -> None: ...

    def dispatch(self) -> None: ...

    def attempt_used(self, ref: int, job: object, usage: Usage) -> None: ...

"""The UDP door's words for a job's state: the `status` of `get_task` answers and of
`notify_task` (DESIGN section 4), and how the client library reads them back. The job's state
itself is the job book's (controller/jobs.py `JobState`, whose values are the words of the HTTP
and Redis doors)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from controller.job_states import JobState

if TYPE_CHECKING:  # the client library reads these words without the controller's job book
    from controller.jobs import Job

# A failed job is `failed_post` when no worker took it in time, else `error`: see `status`.
UDP_WORDS = {
    JobState.WAITING: "queued",
    JobState.SCHEDULED: "queued",
    JobState.PENDING: "queued",
    JobState.REQUESTED: "running",
    JobState.WORKING: "running",
    JobState.FINISHED: "success",
    JobState.CANCELED: "error",
    JobState.DELETED: "error",
}


# The words of an ended job (a notify_task's, or a get_task's once the job has ended).
ENDED_WORDS = frozenset({"success", "error", "failed_post"})
# How the client library reads a word as a job object's state (the Python API's `job.state`).
STATE_OF_WORD = {
    "queued": JobState.PENDING,
    "running": JobState.WORKING,
    "success": JobState.FINISHED,
    "error": JobState.FAILED,
    "failed_post": JobState.FAILED,
}


def status(job: Job) -> str:
    """The job's state in the UDP door's words (queued, running, success, error, failed_post)."""
    state = job.state
    if state is JobState.FAILED:
        return "failed_post" if job.failed_post else "error"
    return UDP_WORDS[state]

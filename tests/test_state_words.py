"""A job's state in each door's words: the UDP door's table (DESIGN section 4 and the
brackets of section 7), and the job object's words (section 7), from every task state."""

from __future__ import annotations

from typing import Any

import pytest

from controller.core.model import Task, TaskState
from controller.doors.udp import words
from controller.job_states import JobState
from controller.jobs import Job

# Each live task state: the job object's state and the UDP word (DESIGN section 7).
LIVE = {
    TaskState.SCHEDULED: ("scheduled", "queued"),
    TaskState.QUEUED: ("pending", "queued"),
    TaskState.ASSIGNING: ("requested", "running"),
    TaskState.RUNNING: ("working", "running"),
    TaskState.ORPHAN: ("working", "running"),
}
# Each ended job's state (and whether no worker took it in time): its UDP word.
ENDED = [
    (JobState.FINISHED, False, "success"),
    (JobState.FAILED, False, "error"),
    (JobState.FAILED, True, "failed_post"),
    (JobState.CANCELED, False, "error"),
    (JobState.DELETED, False, "error"),
]


def job(**fields: Any) -> Job:
    """A UDP job with `fields`."""
    fields.setdefault("door", "udp")
    return Job("udp-127.0.0.1-9-1", 1, 1, key=("127.0.0.1", 9), **fields)


@pytest.mark.parametrize("task_state", list(LIVE), ids=lambda s: s.value)
def test_a_live_job_is_worded_from_its_task(task_state: TaskState) -> None:
    live = job(task=Task(1, 1, b"", "id", state=task_state))
    assert (live.state.value, words.status(live)) == LIVE[task_state]


@pytest.mark.parametrize(("state", "failed_post", "word"), ENDED)
def test_an_ended_job_has_the_udp_word_design_gives(
    state: JobState, failed_post: bool, word: str
) -> None:
    assert words.status(job(final=state, failed_post=failed_post)) == word


def test_every_job_state_has_a_udp_word() -> None:
    worded = set(words.UDP_WORDS) | {JobState.FAILED}  # failed: error or failed_post
    assert worded == set(JobState)

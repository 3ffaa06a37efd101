"""A job's states, whose values are the words the job object says (`state` over HTTP and
Redis, and in the client library): the vocabulary the doors, the job book and the client
share, with no part of the controller behind it."""

from __future__ import annotations

import enum


class JobState(enum.Enum):
    """A job's state; its values are the words of the job object's `state` (HTTP, Redis and
    the client library). The UDP door's words are controller/doors/udp/words.py's. Hashed
    by identity: the book looks states up on every job."""

    __hash__ = object.__hash__

    WAITING = "waiting"  # for the jobs its option `after` names (DESIGN.md section 17)
    SCHEDULED = "scheduled"
    PENDING = "pending"
    REQUESTED = "requested"
    WORKING = "working"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELED = "canceled"
    DELETED = "deleted"

    @property
    def final(self) -> bool:
        return self not in _LIVE


_LIVE = frozenset(
    {JobState.WAITING, JobState.SCHEDULED, JobState.PENDING, JobState.REQUESTED, JobState.WORKING}
)

"""The Redis door's per-queue rules, without Redis: an entry's options from its fields, the
stream of each queue, which worker can take a job, and each stream's room."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest

from controller.core import Core
from controller.core.model import Worker, WorkerState
from controller.doors.redis.queue_lanes import (
    PREFETCH,
    Lanes,
    Parked,
    can_take,
    entry_options,
    free_by_queue,
)
from controller.doors.redis.stream_calls import Entry
from controller.job_states import JobState
from controller.jobs import Job
from controller.options import BadOption, JobOptions

DEFAULTS = JobOptions(owner="redis", max_retries=3)
NOW = 1_800_000_000.0


def worker(
    worker_id: int, queues: set[str], labels: frozenset[str] = frozenset(), *, idle: bool = True
) -> Worker:
    state = WorkerState.IDLE if idle else WorkerState.BUSY
    return Worker(
        worker_id,
        cast(Any, None),
        None,
        None,
        0.0,
        state=state,
        queues=frozenset(queues),
        labels=labels,
    )


def test_each_queue_has_its_stream_and_the_lane_carries_its_queue() -> None:
    lanes = Lanes("jobs", DEFAULTS)
    assert lanes.lane("default").stream == "jobs"
    assert lanes.lane("default").defaults is DEFAULTS
    q = lanes.lane("reports.monthly")
    assert q.stream == "jobs.reports.monthly" and q.defaults.queue == "reports.monthly"
    assert lanes.by_stream["jobs.reports.monthly"] is q and lanes.lane("reports.monthly") is q
    served = lanes.served([worker(1, {"b", "a"}), worker(2, {"default"})])
    assert [lane.queue for lane in served] == ["default", "a", "b"]


def test_options_come_from_the_fields_as_text() -> None:
    lane = Lanes("jobs", DEFAULTS).lane("default")
    assert entry_options({b"payload": b"x", b"name": b"n"}, lane, "jobs", NOW) is DEFAULTS
    fields = {
        b"priority": b"-5",
        b"requires": b"gpu,ssd",
        b"delay": b"30",
        b"max_retries": b"0",
        b"retry_delay": b"2",
        b"timeout": b"9.5",
        b"placement_timeout": b"60",
        b"owner": b"alice",
        b"queue": b"default",
    }
    assert entry_options(fields, lane, "jobs", NOW) == JobOptions(
        queue="default",
        priority=-5,
        requires=frozenset({"gpu", "ssd"}),
        run_at=NOW + 30,
        max_retries=0,
        retry_delay=2.0,
        timeout=9.5,
        placement_timeout=60.0,
        owner="alice",
    )


def test_bad_options_and_another_queue_are_refused() -> None:
    lanes = Lanes("jobs", DEFAULTS)
    with pytest.raises(BadOption, match="owner is not UTF-8 text"):
        entry_options({b"owner": b"\xff\xfe"}, lanes.lane("default"), "jobs", NOW)
    with pytest.raises(BadOption, match="priority must be an integer"):
        entry_options({b"priority": b"1.5"}, lanes.lane("default"), "jobs", NOW)
    with pytest.raises(BadOption, match=r"its stream is 'jobs\.q'"):
        entry_options({b"queue": b"q"}, lanes.lane("default"), "jobs", NOW)
    with pytest.raises(BadOption, match="its stream is 'jobs'"):
        entry_options({b"queue": b"default"}, lanes.lane("q"), "jobs", NOW)
    assert entry_options({b"queue": b"q"}, lanes.lane("q"), "jobs", NOW).queue == "q"


def test_a_job_is_takeable_by_a_worker_of_its_queue_with_all_its_labels() -> None:
    workers = [worker(1, {"default"}, frozenset({"gpu"})), worker(2, {"q"}, frozenset({"ssd"}))]
    assert can_take(workers, JobOptions())
    assert can_take(workers, JobOptions(requires=frozenset({"gpu"})))
    assert not can_take(workers, JobOptions(requires=frozenset({"gpu", "ssd"})))
    assert can_take(workers, JobOptions(queue="q", requires=frozenset({"ssd"})))
    assert not can_take(workers, JobOptions(queue="q", requires=frozenset({"gpu"})))
    assert not can_take([], JobOptions())


def _job(job_id: str, queue: str, state: JobState) -> Job:
    job = Job(job_id, 1, 1, "redis", None, b"", None, added_at=0.0, updated_at=0.0)
    job.options = JobOptions(queue=queue)
    job.final = None if not state.final else state
    return job


def test_the_room_of_each_stream() -> None:
    lanes = Lanes("jobs", DEFAULTS)
    workers = {
        1: worker(1, {"default", "q"}),
        2: worker(2, {"q"}),
        3: worker(3, {"q"}, idle=False),
    }
    assert free_by_queue(workers.values()) == {"default": 1, "q": 2}
    core = cast(Core, SimpleNamespace(workers=workers, idle_workers=2, queued=4))
    served = lanes.served(workers.values())
    # One lane: the scheduler's counts, less what is parked.
    lane = lanes.lane("default")
    entry = Entry("jobs", "1-0", {}, "", "p")
    lanes.parked["p"] = Parked(entry, DEFAULTS, lane)
    waiting = 4 + 1
    assert lanes.rooms([lane], core, ()) == {lane: (2 + PREFETCH - waiting, waiting)}
    # Several: per queue, its idle workers less its own jobs not started, and parked ones.
    held = [_job("a", "q", JobState.PENDING), None, _job("b", "q", JobState.PENDING)]
    rooms = lanes.rooms(served, core, held)
    assert rooms == {lane: (1 + PREFETCH - 1, 1), lanes.lane("q"): (2 + PREFETCH - 2, 2)}

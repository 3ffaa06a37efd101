"""Queues, labels and time in the pure core: scheduled jobs, retry delays, placement timeouts
per job, pauses, retries by a user. Explicit times throughout."""

from __future__ import annotations

import dataclasses

from controller.core import Core, TaskState, WorkerExited
from controller.options import JobOptions
from gen import worker_protocol_pb2 as pb
from tests.test_core import answer, dials, finished, pulse, ready_worker, register


def steady_worker(core: Core, now: float = 0.0) -> int:
    """A registered, idle worker that promises a pulse only each hour (time jumps here)."""
    wid = register(core, now, next_pulse=3600)
    pulse(core, wid, now, next_pulse=3600)
    return wid


def fail_once(core: Core, wid: int, task_id: int, now: float) -> list[object]:
    """The worker holding `task_id` confirms it, then reports it failed."""
    answer(core, wid, pb.CTRL_SET_TASK, now, task_id=task_id)
    pulse(core, wid, now, pb.PULSE_FETCH_ME, task_id=task_id)
    return answer(core, wid, pb.CTRL_FETCH, now, error=pb.WORKER_ERR_TASK_FAILED, task_id=task_id)


def test_a_delayed_job_is_scheduled_until_its_time_then_placed():
    core = Core()
    a = steady_worker(core)
    task, actions = core.submit(1, b"x", None, 0.0, JobOptions(), wait=5.0)
    assert task.state is TaskState.SCHEDULED and not dials(actions)
    assert core.next_deadline() == 5.0
    assert core.expire(4.999) == []
    [dial] = dials(core.expire(5.0), pb.CTRL_SET_TASK)
    assert dial.worker_id == a
    assert core.task_state(task.ref) is TaskState.ASSIGNING


def test_placement_timeout_counts_from_pending_not_from_submission():
    core = Core()
    options = JobOptions(placement_timeout=3.0)
    task, _ = core.submit(1, b"x", None, 0.0, options, wait=10.0)
    assert finished(core.expire(9.999)) == []  # scheduled: no placement clock yet
    core.expire(10.0)
    assert task.state is TaskState.QUEUED
    assert finished(core.expire(12.999)) == []
    [ended] = finished(core.expire(13.0))
    assert ended.state is TaskState.FAILED_POST and "within 3 s" in ended.error


def test_no_placement_timeout_waits_for_ever():
    core = Core(timeout_task_placement=30)
    task, _ = core.submit(1, b"x", None, 0.0, JobOptions(placement_timeout=0))
    assert finished(core.expire(1e9)) == [] and task.state is TaskState.QUEUED
    a = ready_worker(core, 1e9)
    assert core.workers[a].task is task


def test_a_failed_job_waits_its_retry_delay_doubled_each_time_with_jitter():
    core = Core()
    a = steady_worker(core)
    options = JobOptions(retry_delay=2.0, max_retries=3)
    task, _ = core.submit(1, b"x", None, 0.0, options)
    now = 0.0
    for failures, base in ((1, 2.0), (2, 4.0), (3, 8.0)):
        actions = fail_once(core, a, 1, now)
        assert task.state is TaskState.SCHEDULED and not dials(actions, pb.CTRL_SET_TASK)
        wait = task.deadline - now
        assert 0.8 * base <= wait <= 1.2 * base, (failures, wait)
        now = task.deadline
        [dial] = dials(core.expire(now), pb.CTRL_SET_TASK)
        assert dial.worker_id == a
    [ended] = finished(fail_once(core, a, 1, now))
    assert ended.state is TaskState.ERROR and "failed 4 times" in ended.error


def test_retry_delay_is_capped_at_an_hour():
    options = JobOptions(retry_delay=3000.0)
    assert options.retry_wait(1, 1.0) == 3000.0
    assert options.retry_wait(2, 1.0) == 3600.0
    assert options.retry_wait(40, 1.2) == 3600.0 * 1.2


def test_a_job_whose_worker_died_is_placed_again_at_once_despite_its_retry_delay():
    core = Core()
    a = ready_worker(core)
    b = ready_worker(core)
    task, _ = core.submit(1, b"x", None, 0.0, JobOptions(retry_delay=60.0))
    holder = task.worker_id
    answer(core, holder, pb.CTRL_SET_TASK, 0.0, task_id=1)
    actions = core.handle(WorkerExited(holder), 1.0)
    [dial] = dials(actions, pb.CTRL_SET_TASK)
    assert dial.worker_id == ({a, b} - {holder}).pop()
    assert task.attempts == 1  # the attempt it had counts


def test_a_job_taken_back_for_its_timeout_counts_as_failed_and_waits_its_retry_delay():
    core = Core()
    a = ready_worker(core)
    task, _ = core.submit(1, b"x", None, 0.0, JobOptions(timeout=5.0, retry_delay=10.0))
    answer(core, a, pb.CTRL_SET_TASK, 0.0, task_id=1)
    for t in range(1, 5):
        pulse(core, a, float(t), task_id=1)
    actions = core.expire(5.0)
    assert dials(actions, pb.CTRL_RESTART)
    assert task.state is TaskState.SCHEDULED
    assert 8.0 <= task.deadline - 5.0 <= 12.0
    assert "timeout of 5 s" in task.last_error


def test_a_worker_gets_only_jobs_of_its_queues_and_labels():
    core = Core()
    gpu_job, _ = core.submit(1, b"", None, 0.0, JobOptions(requires=frozenset({"gpu"})))
    q1_job, _ = core.submit(2, b"", None, 0.0, JobOptions(queue="q1"))
    plain = ready_worker(core)  # default queue, no labels: neither
    assert core.workers[plain].task is None and core.queued == 2
    wid = register(core, 0.0)
    worker = core.workers[wid]
    core.scheduler.serves(worker, frozenset({"q1", "default"}), frozenset({"gpu"}))
    pulse(core, wid, 0.0)
    assert worker.task in (gpu_job, q1_job)


def test_a_paused_queue_keeps_its_jobs_until_resumed():
    core = Core()
    core.pause("default")
    task, _ = core.submit(1, b"", None, 0.0, JobOptions())
    a = ready_worker(core)
    assert core.workers[a].task is None and task.state is TaskState.QUEUED
    resumed = core.resume("default", 0.0)
    [dial] = dials(resumed, pb.CTRL_SET_TASK)
    assert dial.worker_id == a


def test_higher_priority_runs_first_on_the_next_free_worker():
    core = Core()
    low, _ = core.submit(1, b"", None, 0.0, JobOptions(priority=-5))
    high, _ = core.submit(2, b"", None, 0.0, JobOptions(priority=50))
    a = ready_worker(core)
    assert core.workers[a].task is high and low.state is TaskState.QUEUED


def test_a_retried_job_gets_a_fresh_max_retries_and_keeps_counting_attempts():
    core = Core()
    a = ready_worker(core)
    options = JobOptions(max_retries=0)
    task, _ = core.submit(1, b"x", "job-1", 0.0, options)
    [ended] = finished(fail_once(core, a, 1, 0.0))
    assert ended.state is TaskState.ERROR
    again, _ = core.resubmit(task.ref, 1, b"x", "job-1", options, 1, 1.0)
    assert core.workers[a].task is again and again.retried_at == 1
    [ended] = finished(fail_once(core, a, 1, 1.0))
    assert ended.state is TaskState.ERROR and "failed 2 times" in ended.error


def test_a_scheduled_job_can_be_canceled():
    core = Core()
    task, _ = core.submit(1, b"", None, 0.0, dataclasses.replace(JobOptions()), wait=100.0)
    actions: list[object] = []
    assert core.scheduler.cancel(task.ref, 1.0, actions)
    [ended] = finished(actions)
    assert ended.state is TaskState.CANCELED
    assert finished(core.expire(100.0)) == []


def test_scheduled_tasks_are_counted_apart_from_pending_and_running():
    core = Core()
    later, _ = core.submit(1, b"", None, 0.0, JobOptions(), wait=10.0)
    core.submit(2, b"", None, 0.0, JobOptions(), wait=20.0)
    assert (core.scheduled, core.queued) == (2, 0)
    actions: list[object] = []
    core.scheduler.cancel(later.ref, 1.0, actions)
    assert core.scheduled == 1
    core.expire(20.0)
    assert (core.scheduled, core.queued) == (0, 1)

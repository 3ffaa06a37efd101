"""The worker's pure session: every control message in every phase."""

from __future__ import annotations

from gen import worker_protocol_pb2 as pb
from worker.core import Effect, Phase, WorkerSession


def control(kind: int, task_id: int | None = None) -> pb.ControlMsg:
    msg = pb.ControlMsg(type=kind)
    if task_id is not None:
        msg.task_id = task_id
    return msg


def test_set_task_without_task_id_is_failed_and_changes_nothing():
    session = WorkerSession()
    for msg in (control(pb.CTRL_SET_TASK), control(pb.CTRL_SET_TASK, 0)):
        answer = session.on_control(msg, b"payload")
        assert answer.response.error == pb.WORKER_ERR_FAILED and b"task_id" in answer.extra
        assert (session.phase, session.task_id) == (Phase.IDLE, 0)


def test_draining_worker_refuses_work_even_when_idle():
    session = WorkerSession()
    session.draining = True
    answer = session.on_control(control(pb.CTRL_SET_TASK, 3), b"")
    assert answer.response.error == pb.WORKER_ERR_BUSY and answer.effect is Effect.NONE


def test_fetch_before_the_task_ends_is_no_fetch():
    session = WorkerSession()
    session.on_control(control(pb.CTRL_SET_TASK, 3), b"p")
    answer = session.on_control(control(pb.CTRL_FETCH), b"")
    assert (answer.response.error, answer.response.task_id) == (pb.WORKER_ERR_NO_FETCH, 3)
    assert session.pulse(2).type == pb.PULSE_OK and session.pulse(2).task_id == 3


def test_outcome_kept_until_fetched_then_idle():
    session = WorkerSession()
    session.on_control(control(pb.CTRL_SET_TASK, 3), b"p")
    session.finished(3, False, b"boom")
    assert session.pulse(2).type == pb.PULSE_FETCH_ME
    answer = session.on_control(control(pb.CTRL_FETCH), b"")
    assert (answer.response.error, answer.extra, answer.effect) == (
        pb.WORKER_ERR_TASK_FAILED,
        b"boom",
        Effect.FETCHED,
    )
    assert session.task_id == 3  # not dropped until the answer was written
    session.fetched(3)
    assert (session.phase, session.task_id, session.pulse(2).type) == (Phase.IDLE, 0, pb.PULSE_OK)


def test_late_result_of_an_abandoned_task_is_ignored():
    session = WorkerSession()
    session.on_control(control(pb.CTRL_SET_TASK, 3), b"p")
    session.finished(9, True, b"not this one")
    assert session.phase is Phase.RUNNING

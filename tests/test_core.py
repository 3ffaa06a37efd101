"""The pure core: every transition and both sides of every deadline, with explicit `now`."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controller.core import (
    Core,
    Dial,
    DialDone,
    IllegalTransition,
    PulseReceived,
    Reply,
    TaskFinished,
    TaskState,
    WatchPid,
    WorkerExited,
    WorkerState,
)
from controller.core.model import TaskEvent, WorkerEvent, next_task_state, next_worker_state
from controller.jobs import Job
from controller.options import JobOptions
from gen import worker_protocol_pb2 as pb

UID = 1000


def pulse(core: Core, wid: int, now: float, ptype=pb.PULSE_OK, task_id=0, next_pulse=2, uid=UID):
    msg = pb.WorkerPulse(type=ptype, worker_id=wid, task_id=task_id, next_pulse=next_pulse)
    return core.handle(PulseReceived(msg, pid=None, uid=uid), now)


def register(core: Core, now: float = 0.0, next_pulse: int = 2, pid: int | None = None) -> int:
    msg = pb.WorkerPulse(type=pb.PULSE_REGISTER, next_pulse=next_pulse)
    actions = core.handle(PulseReceived(msg, pid=pid, uid=UID), now)
    reply = actions[0]
    assert isinstance(reply, Reply) and reply.response.error == pb.CTRL_ERR_OK
    return reply.response.worker_id


def ready_worker(core: Core, now: float = 0.0) -> int:
    wid = register(core, now)
    pulse(core, wid, now)
    return wid


def answer(core, wid, kind, now, error=pb.WORKER_ERR_OK, task_id=0, extra=b""):
    resp = pb.WorkerResponse(error=error, task_id=task_id)
    return core.handle(DialDone(wid, kind, resp, extra), now)


def no_answer(core, wid, kind, now):
    return core.handle(DialDone(wid, kind, None, error="connection refused"), now)


def dials(actions, kind=None):
    return [a for a in actions if isinstance(a, Dial) and (kind is None or a.kind == kind)]


def finished(actions):
    return [a for a in actions if isinstance(a, TaskFinished)]


def run_to_success(core, wid, task_id, now, result=b"ok"):
    pulse(core, wid, now, pb.PULSE_FETCH_ME, task_id=task_id)
    return answer(core, wid, pb.CTRL_FETCH, now, task_id=task_id, extra=result)


# ---------------------------------------------------------------- registration and pulses


def test_register_gives_unique_ids_and_watches_pid():
    core = Core()
    msg = pb.WorkerPulse(type=pb.PULSE_REGISTER, next_pulse=2)
    actions = core.handle(PulseReceived(msg, pid=4321, uid=UID), 0.0)
    assert actions[0].response.worker_id == 1
    assert WatchPid(1, 4321) in actions
    assert register(core) == 2


def test_first_worker_id_continues_from_given():
    core = Core(first_worker_id=40)
    assert register(core) == 40


def test_unknown_id_and_unknown_type():
    core = Core()
    assert pulse(core, 99, 0.0)[0].response.error == pb.CTRL_ERR_UNKNOWN_ID
    wid = register(core)
    assert pulse(core, wid, 0.0, ptype=17)[0].response.error == pb.CTRL_ERR_UNKNOWN_TYPE


def test_pulse_from_other_uid_refused():
    core = Core()
    wid = register(core)
    assert pulse(core, wid, 0.0, uid=UID + 1)[0].response.error == pb.CTRL_ERR_FAILED
    assert core.workers[wid].state is WorkerState.STARTING


def test_no_task_before_first_ok_pulse():
    core = Core()
    wid = register(core)
    _, actions = core.submit(5, b"p", None, 0.0)
    assert dials(actions) == []
    actions = pulse(core, wid, 0.1)
    [d] = dials(actions, pb.CTRL_SET_TASK)
    assert (d.worker_id, d.task_id, d.extra) == (wid, 5, b"p")


def test_register_next_pulse_zero_counts_as_one_second():
    core = Core()
    wid = register(core, 0.0, next_pulse=0)
    assert core.expire(0.999) == [] and wid in core.workers
    core.expire(1.0)
    assert wid not in core.workers


def test_a_promise_of_silence_is_held_to_an_hour():
    """A process that registers promising an hour of silence (the most a REGISTER may) is
    forgotten within the hour, and a later pulse promising years is held to the hour."""
    core = Core()
    wid = register(core, 0.0, next_pulse=3600)
    assert core.expire(3599.999) == [] and wid in core.workers
    core.expire(3600.0)
    assert wid not in core.workers
    other = ready_worker(core, 4000.0)
    pulse(core, other, 4001.0, next_pulse=2**32 - 1)
    assert core.expire(7600.999) == [] and other in core.workers
    core.expire(7601.0)
    assert other not in core.workers


# ---------------------------------------------------------------- the happy path


def test_full_cycle_and_next_task_goes_out_at_once():
    core = Core()
    wid = ready_worker(core)
    core.submit(1, b"a", "client", 0.0)
    core.submit(2, b"b", "client", 0.0)
    answer(core, wid, pb.CTRL_SET_TASK, 0.1, task_id=1)
    assert core.workers[wid].state is WorkerState.BUSY
    actions = pulse(core, wid, 0.2, pb.PULSE_FETCH_ME, task_id=1)
    assert len(dials(actions, pb.CTRL_FETCH)) == 1
    actions = answer(core, wid, pb.CTRL_FETCH, 0.3, task_id=1, extra=b"result")
    [done] = finished(actions)
    assert (done.task_id, done.state, done.result, done.job) == (
        1,
        TaskState.SUCCESS,
        b"result",
        "client",
    )
    [d] = dials(actions, pb.CTRL_SET_TASK)
    assert d.task_id == 2


def test_fetch_me_crossing_set_task_answer_is_remembered():
    core = Core()
    wid = ready_worker(core)
    core.submit(1, b"a", None, 0.0)
    assert dials(pulse(core, wid, 0.1, pb.PULSE_FETCH_ME, task_id=1)) == []
    actions = answer(core, wid, pb.CTRL_SET_TASK, 0.1, task_id=1)
    assert len(dials(actions, pb.CTRL_FETCH)) == 1


def test_no_fetch_keeps_worker_busy():
    core = Core()
    wid = ready_worker(core)
    core.submit(1, b"a", None, 0.0)
    answer(core, wid, pb.CTRL_SET_TASK, 0.0, task_id=1)
    pulse(core, wid, 0.1, pb.PULSE_FETCH_ME, task_id=1)
    answer(core, wid, pb.CTRL_FETCH, 0.1, error=pb.WORKER_ERR_NO_FETCH, task_id=1)
    assert core.workers[wid].state is WorkerState.BUSY


# ---------------------------------------------------------------- expiry


def test_pulse_deadline_both_sides_and_task_replaced():
    core = Core()
    a = ready_worker(core, 0.0)  # deadline 2.0
    core.submit(1, b"x", None, 0.0)
    answer(core, a, pb.CTRL_SET_TASK, 0.0, task_id=1)
    b = register(core, 1.5)
    pulse(core, b, 1.5)  # b's deadline 3.5
    assert core.expire(1.999) == []
    actions = core.expire(2.0)
    assert a not in core.workers
    [d] = dials(actions, pb.CTRL_SET_TASK)
    assert (d.worker_id, d.task_id) == (b, 1)


def test_pulse_moves_deadline():
    core = Core()
    wid = ready_worker(core, 0.0)
    pulse(core, wid, 1.5)  # deadline 3.5
    assert core.expire(2.0) == [] and wid in core.workers
    assert core.expire(3.499) == [] and wid in core.workers
    core.expire(3.5)
    assert wid not in core.workers


def test_process_exit_drops_worker_and_replaces_task():
    core = Core()
    b = ready_worker(core)
    a = ready_worker(core)  # idle last: picked first
    core.submit(1, b"x", None, 0.0)
    answer(core, a, pb.CTRL_SET_TASK, 0.0, task_id=1)
    actions = core.handle(WorkerExited(a), 0.5)
    assert a not in core.workers
    assert dials(actions, pb.CTRL_SET_TASK)[0].worker_id == b


def test_shutdown_removes_worker_and_replaces_its_task():
    core = Core()
    a = ready_worker(core)
    core.submit(1, b"x", None, 0.0)
    answer(core, a, pb.CTRL_SET_TASK, 0.0, task_id=1)
    b = ready_worker(core)
    actions = pulse(core, a, 0.1, pb.PULSE_SHUTDOWN)
    assert actions[0].response.error == pb.CTRL_ERR_OK
    assert a not in core.workers
    assert dials(actions, pb.CTRL_SET_TASK)[0].worker_id == b


def test_the_most_recently_idle_worker_gets_the_next_task():
    """A job goes to the worker that became idle last: under light load one worker keeps
    its caches warm instead of all of them taking turns (docs/architecture.md, "One job, step by step")."""
    core = Core()
    a = ready_worker(core)
    b = ready_worker(core)
    for task_id in (1, 2, 3):
        [d] = dials(core.submit(task_id, b"x", None, 0.0)[1], pb.CTRL_SET_TASK)
        assert d.worker_id == b  # never a, idle longer
        answer(core, b, pb.CTRL_SET_TASK, 0.0, task_id=task_id)
        run_to_success(core, b, task_id, 0.1)
    core.submit(4, b"x", None, 0.2)
    answer(core, b, pb.CTRL_SET_TASK, 0.2, task_id=4)
    [d] = dials(core.submit(5, b"x", None, 0.3)[1], pb.CTRL_SET_TASK)
    assert d.worker_id == a  # b is busy


# ---------------------------------------------------------------- worker errors


def test_busy_places_on_another_worker_without_using_a_retry():
    core = Core(max_retries=0)
    b = ready_worker(core)
    a = ready_worker(core)  # idle last: picked first
    core.submit(1, b"x", None, 0.0)  # goes to a
    actions = answer(core, a, pb.CTRL_SET_TASK, 0.0, error=pb.WORKER_ERR_BUSY, task_id=7)
    [d] = dials(actions, pb.CTRL_SET_TASK)
    assert d.worker_id == b
    assert core.workers[a].state is WorkerState.UNSURE
    answer(core, b, pb.CTRL_SET_TASK, 0.1, task_id=1)
    assert finished(run_to_success(core, b, 1, 0.2))[0].state is TaskState.SUCCESS
    pulse(core, a, 0.3, task_id=0)  # says idle again
    assert core.workers[a].state is WorkerState.IDLE


def test_task_failed_retries_on_a_different_worker():
    core = Core()
    a = ready_worker(core)
    core.submit(1, b"x", None, 0.0)
    answer(core, a, pb.CTRL_SET_TASK, 0.0, task_id=1)
    b = ready_worker(core)  # a, idle again after b, would be picked first
    pulse(core, a, 0.1, pb.PULSE_FETCH_ME, task_id=1)
    actions = answer(
        core, a, pb.CTRL_FETCH, 0.1, error=pb.WORKER_ERR_TASK_FAILED, task_id=1, extra=b"boom"
    )
    [d] = dials(actions, pb.CTRL_SET_TASK)
    assert d.worker_id == b
    assert core.workers[a].state is WorkerState.IDLE


def test_task_failed_on_only_worker_goes_back_to_it():
    core = Core()
    a = ready_worker(core)
    core.submit(1, b"x", None, 0.0)
    answer(core, a, pb.CTRL_SET_TASK, 0.0, task_id=1)
    pulse(core, a, 0.1, pb.PULSE_FETCH_ME, task_id=1)
    actions = answer(core, a, pb.CTRL_FETCH, 0.1, error=pb.WORKER_ERR_TASK_FAILED, task_id=1)
    assert dials(actions, pb.CTRL_SET_TASK)[0].worker_id == a


@pytest.mark.parametrize("kind", ["failed", "silent"])
def test_fetch_failed_or_silent_drops_worker_and_replaces(kind):
    core = Core()
    a = ready_worker(core)
    core.submit(1, b"x", None, 0.0)
    answer(core, a, pb.CTRL_SET_TASK, 0.0, task_id=1)
    b = ready_worker(core)
    pulse(core, a, 0.1, pb.PULSE_FETCH_ME, task_id=1)
    if kind == "failed":
        actions = answer(core, a, pb.CTRL_FETCH, 0.1, error=pb.WORKER_ERR_FAILED)
    else:
        actions = no_answer(core, a, pb.CTRL_FETCH, 0.1)
    assert a not in core.workers
    assert dials(actions, pb.CTRL_SET_TASK)[0].worker_id == b


def test_set_task_failed_answer_drops_worker_without_using_a_retry():
    core = Core(max_retries=0)
    b = ready_worker(core)
    a = ready_worker(core)  # idle last: picked first
    core.submit(1, b"x", None, 0.0)
    actions = answer(core, a, pb.CTRL_SET_TASK, 0.0, error=pb.WORKER_ERR_FAILED)
    assert a not in core.workers
    assert dials(actions, pb.CTRL_SET_TASK)[0].worker_id == b


def test_socket_not_owned_drops_worker_without_using_a_retry():
    core = Core(max_retries=0)
    b = ready_worker(core)
    a = ready_worker(core)  # idle last: picked first
    core.submit(1, b"x", None, 0.0)
    actions = core.handle(DialDone(a, pb.CTRL_SET_TASK, None, not_owned=True), 0.0)
    assert a not in core.workers
    assert dials(actions, pb.CTRL_SET_TASK)[0].worker_id == b
    answer(core, b, pb.CTRL_SET_TASK, 0.0, task_id=1)
    assert finished(run_to_success(core, b, 1, 0.1))[0].state is TaskState.SUCCESS


def test_fetch_with_wrong_task_id_drops_worker():
    core = Core()
    a = ready_worker(core)
    core.submit(1, b"x", None, 0.0)
    answer(core, a, pb.CTRL_SET_TASK, 0.0, task_id=1)
    pulse(core, a, 0.1, pb.PULSE_FETCH_ME, task_id=1)
    actions = answer(core, a, pb.CTRL_FETCH, 0.1, task_id=99, extra=b"not yours")
    assert a not in core.workers and finished(actions) == []
    assert core.queued == 1


def test_dial_result_for_dropped_worker_is_ignored():
    core = Core()
    a = ready_worker(core)
    core.submit(1, b"x", None, 0.0)
    core.handle(WorkerExited(a), 0.1)
    assert answer(core, a, pb.CTRL_SET_TASK, 0.2, task_id=1) == []
    assert core.queued == 1


# ---------------------------------------------------------------- mismatch


def test_pulse_mismatch_checked_with_get_status_then_fine():
    core = Core()
    a = ready_worker(core)
    core.submit(1, b"x", None, 0.0)
    answer(core, a, pb.CTRL_SET_TASK, 0.0, task_id=1)
    actions = pulse(core, a, 0.1, task_id=0)  # sent before SET_TASK landed
    assert len(dials(actions, pb.CTRL_GET_STATUS)) == 1
    assert dials(pulse(core, a, 0.1, task_id=0)) == []  # one check at a time
    actions = answer(core, a, pb.CTRL_GET_STATUS, 0.2, task_id=1)
    assert dials(actions) == [] and core.workers[a].state is WorkerState.BUSY


def test_confirmed_mismatch_restarts_and_replaces():
    core = Core()
    a = ready_worker(core)
    core.submit(1, b"x", None, 0.0)
    answer(core, a, pb.CTRL_SET_TASK, 0.0, task_id=1)
    b = ready_worker(core)
    pulse(core, a, 0.1, task_id=8)
    actions = answer(core, a, pb.CTRL_GET_STATUS, 0.2, task_id=8)
    assert len(dials(actions, pb.CTRL_RESTART)) == 1
    assert a not in core.workers
    assert dials(actions, pb.CTRL_SET_TASK)[0].worker_id == b
    assert core.counters.restarts_sent == 1


def test_unknown_task_on_fresh_worker_is_restarted():
    core = Core()
    wid = register(core)
    actions = pulse(core, wid, 0.1, task_id=3)
    assert dials(actions, pb.CTRL_GET_STATUS)
    actions = answer(core, wid, pb.CTRL_GET_STATUS, 0.1, task_id=3)
    assert dials(actions, pb.CTRL_RESTART)


# ---------------------------------------------------------------- limits


def test_task_timeout_both_sides():
    core = Core(task_timeout=10)
    a = ready_worker(core)
    core.submit(1, b"x", None, 0.0)
    answer(core, a, pb.CTRL_SET_TASK, 1.0, task_id=1)  # deadline 11.0
    for t in range(2, 11):
        pulse(core, a, float(t), task_id=1)
    assert core.expire(10.999) == []
    actions = core.expire(11.0)
    assert len(dials(actions, pb.CTRL_RESTART)) == 1
    assert a not in core.workers and core.queued == 1


def test_one_deadline_field_serves_both_clocks_without_mixing_them():
    """A task keeps one deadline: the placement one while queued, task_timeout's while
    running. A stale one of either kind does nothing, even at the very same instant."""
    core = Core(task_timeout=10, timeout_task_placement=5)
    a = ready_worker(core)
    core.submit(1, b"x", None, 0.0)  # placement deadline 5.0
    answer(core, a, pb.CTRL_SET_TASK, 1.0, task_id=1)  # running: deadline 11.0
    for t in (2.0, 3.0, 4.0, 5.0):
        pulse(core, a, t, task_id=1)
    assert core.expire(5.0) == []  # the placement deadline is stale: it runs
    core.handle(WorkerExited(a), 6.0)  # back in the queue: placement deadline 11.0
    actions = core.expire(11.0)  # both fire now: only the placement one is its own
    assert dials(actions, pb.CTRL_RESTART) == []
    [done] = finished(actions)
    assert done.state is TaskState.FAILED_POST and core.next_deadline() == float("inf")


def test_max_retries_then_error():
    core = Core(max_retries=2)
    workers = [ready_worker(core) for _ in range(3)]
    core.submit(1, b"x", None, 0.0)
    accepted = 0
    for i in range(3):
        wid = next(w for w in workers if core.workers[w].state is WorkerState.ASSIGNING)
        answer(core, wid, pb.CTRL_SET_TASK, float(i), task_id=1)
        accepted += 1
        pulse(core, wid, float(i), pb.PULSE_FETCH_ME, task_id=1)
        actions = answer(
            core,
            wid,
            pb.CTRL_FETCH,
            float(i),
            error=pb.WORKER_ERR_TASK_FAILED,
            task_id=1,
            extra=b"bad input",
        )
    [done] = finished(actions)
    assert accepted == 3 == 1 + core.scheduler.defaults.max_retries
    assert done.state is TaskState.ERROR and "bad input" in done.error
    assert dials(actions, pb.CTRL_SET_TASK) == []


def test_placement_timeout_both_sides_and_never_sent():
    core = Core(timeout_task_placement=30)
    core.submit(1, b"x", "c", 5.0)
    assert core.expire(34.999) == []
    [done] = finished(core.expire(35.0))
    assert done.state is TaskState.FAILED_POST and "30" in done.error
    wid = register(core, 36.0)
    assert dials(pulse(core, wid, 36.0)) == []


def test_placement_timeout_once_for_a_task_queued_twice():
    """BUSY puts the task back with a fresh placement time: the first deadline is stale and
    does nothing, the second times it out, once."""
    core = Core(timeout_task_placement=30)
    a = ready_worker(core)
    core.submit(1, b"x", None, 0.0)
    answer(core, a, pb.CTRL_SET_TASK, 10.0, error=pb.WORKER_ERR_BUSY, task_id=7)
    assert core.scheduler.queued == 1
    assert finished(core.expire(30.0)) == []
    assert finished(core.expire(39.999)) == []
    [done] = finished(core.expire(40.0))
    assert done.state is TaskState.FAILED_POST
    assert finished(core.expire(100.0)) == []
    assert core.scheduler.queued == 0 and core.next_deadline() == float("inf")


def test_next_deadline():
    core = Core(timeout_task_placement=30)
    assert core.next_deadline() == float("inf")
    core.submit(1, b"x", None, 5.0)
    assert core.next_deadline() == 35.0


def test_illegal_transition_names_state_and_event():
    with pytest.raises(IllegalTransition, match=r"SUCCEED.*QUEUED"):
        next_task_state(TaskState.QUEUED, TaskEvent.SUCCEED)
    with pytest.raises(IllegalTransition, match=r"FETCH.*IDLE"):
        next_worker_state(WorkerState.IDLE, WorkerEvent.FETCH)


def test_same_task_id_from_two_owners_kept_apart():
    core = Core()
    b = ready_worker(core)
    a = ready_worker(core)  # idle last: picked first
    core.submit(5, b"one", "client-1", 0.0)
    core.submit(5, b"two", "client-2", 0.0)
    answer(core, a, pb.CTRL_SET_TASK, 0.0, task_id=5)
    answer(core, b, pb.CTRL_SET_TASK, 0.0, task_id=5)
    [one] = finished(run_to_success(core, b, 5, 0.1, b"r2"))
    assert one.job == "client-2" and one.result == b"r2"
    [two] = finished(run_to_success(core, a, 5, 0.1, b"r1"))
    assert two.job == "client-1" and two.result == b"r1"


# ---------------------------------------------------------------- cancel


def test_cancel_a_queued_task_ends_it_and_it_is_never_placed():
    core = Core(timeout_task_placement=30)
    task, _ = core.submit(1, b"x", "c", 0.0)
    actions: list[object] = []
    assert core.scheduler.cancel(task.ref, 1.0, actions)
    [done] = finished(actions)
    assert done.state is TaskState.CANCELED and done.error == "canceled"
    assert core.queued == 0 and task.ref not in core.tasks
    wid = ready_worker(core, 2.0)  # a free worker finds nothing to run
    assert dials(pulse(core, wid, 2.1), pb.CTRL_SET_TASK) == []
    assert finished(core.expire(100.0)) == []  # no placement timeout either
    assert not core.scheduler.cancel(task.ref, 3.0, [])  # gone: nothing to cancel


@pytest.mark.parametrize("accepted", [False, True], ids=["assigning", "running"])
def test_cancel_a_task_on_a_local_worker_restarts_that_worker(accepted):
    core = Core()
    wid = ready_worker(core)
    task, actions = core.submit(7, b"x", "c", 0.0)
    assert dials(actions, pb.CTRL_SET_TASK)
    if accepted:
        answer(core, wid, pb.CTRL_SET_TASK, 0.1, task_id=7)
    actions = []
    assert core.scheduler.cancel(task.ref, 0.2, actions)
    assert [d.worker_id for d in dials(actions, pb.CTRL_RESTART)] == [wid]
    [done] = finished(actions)
    assert done.state is TaskState.CANCELED
    assert wid not in core.workers  # it restarts and registers anew
    assert core.counters.worker_losses == {"its job was canceled": 1}
    # Its late answers change nothing.
    assert finished(answer(core, wid, pb.CTRL_SET_TASK, 0.3, task_id=7)) == []


@given(
    st.lists(
        st.tuples(st.floats(0, 5), st.sampled_from([1.0, 3.0, 30.0]), st.booleans()),
        min_size=1,
        max_size=40,
    )
)
def test_placement_deadlines_in_order_or_not_each_fire_once_and_on_time(steps):
    """Tasks queued with varying timeouts (so that some deadlines come out of order and go to
    the heap, the rest to the in-order deques): with no worker, each times out exactly once,
    at the first expire at or after its deadline, earliest first."""
    core = Core(timeout_task_placement=30)
    now = 0.0
    deadline: dict[int, float] = {}
    ended: dict[int, float] = {}
    for n, (gap, timeout, look) in enumerate(steps, start=1):
        now += gap
        task, _ = core.submit(n, b"", None, now, JobOptions(placement_timeout=timeout))
        deadline[task.ref] = now + timeout
        if look:
            got = finished(core.expire(now))
            assert [deadline[d.ref] for d in got] == sorted(deadline[d.ref] for d in got)
            for done in got:
                assert done.ref not in ended and deadline[done.ref] <= now
                ended[done.ref] = now
            due = {ref for ref, when in deadline.items() if when <= now}
            assert due == set(ended)
        assert core.next_deadline() == min(
            (when for ref, when in deadline.items() if ref not in ended), default=float("inf")
        )
    for done in finished(core.expire(now + 100)):
        assert done.ref not in ended
        ended[done.ref] = now + 100
    assert set(ended) == set(deadline) and core.next_deadline() == float("inf")


# ---------------------------------------------------------------- job output


def test_register_offers_to_take_output_and_output_pulses_name_the_held_task():
    core = Core()
    msg = pb.WorkerPulse(type=pb.PULSE_REGISTER, next_pulse=2)
    [reply, *_] = core.handle(PulseReceived(msg, uid=UID), 0.0)
    assert isinstance(reply, Reply) and reply.response.takes_output
    wid = reply.response.worker_id
    pulse(core, wid, 0.0)
    task = core.submit(5, b"a", "client", 0.0)[0]

    def output(task_id: int, worker_id: int = wid, uid: int = UID):
        out = pb.WorkerPulse(type=pb.PULSE_OUTPUT, worker_id=worker_id, task_id=task_id)
        return core.local.output(PulseReceived(out, uid=uid))

    assert output(5) == (reply.__class__(pb.PulseResponse(error=pb.CTRL_ERR_OK)), task)
    answer(core, wid, pb.CTRL_SET_TASK, 0.1, task_id=5)
    deadline = core.workers[wid].deadline
    resp, held = output(5)
    assert resp.response.error == pb.CTRL_ERR_OK and held is task
    assert core.workers[wid].deadline == deadline  # not a pulse of life
    assert output(6) == (resp, None)  # not the job it holds: dropped
    assert output(5, worker_id=wid + 1)[0].response.error == pb.CTRL_ERR_UNKNOWN_ID
    assert output(5, uid=UID + 1) == (Reply(pb.PulseResponse(error=pb.CTRL_ERR_FAILED)), None)
    run_to_success(core, wid, 5, 0.2)
    assert output(5) == (resp, None)  # fetched: no longer its


def test_a_jobs_output_keeps_its_newest_bytes_and_counts_what_came():
    job = Job("j", 1, 1, "http", None)
    assert job.output == b"" and job.output_since(0) == (0, b"")
    assert job.add_output(b"0123456789abc", 10) == b"3456789abc"
    job.add_output(b"de", 10)
    assert job.output == b"56789abcde"
    assert job.output_since(0) == (15, b"56789abcde")  # what was dropped cannot be sent
    assert job.output_since(13) == (15, b"de")
    assert job.output_since(15) == (15, b"")
    job.drop_output()
    assert job.output == b""

"""A next task in the pure core (docs/protocol.md, "A next task"): a local worker on a channel
that asked for `takes_next` holds the task after its running one. Driven with events as a shell
would (a SET_TASK written on a channel counts as taken at once: worker_links.py `taken_done`),
with explicit `now`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from controller.core import (
    Action,
    Core,
    Dial,
    DialDone,
    PulseReceived,
    Reply,
    Task,
    TaskFinished,
    TaskProgress,
    TaskState,
    Worker,
    WorkerExited,
    WorkerState,
)
from controller.options import JobOptions
from gen import worker_protocol_pb2 as pb
from worker.core import WorkerSession

UID = 1000
# A SET_TASK written on a channel is taken: the worker answers only to refuse it.
_TAKEN = pb.WorkerResponse(error=pb.WORKER_ERR_OK)


# ---------------------------------------------------------------- driving the core


def register(
    core: Core,
    now: float = 0.0,
    *,
    channel: bool = True,
    takes_next: bool = True,
    queues: Sequence[str] = (),
    next_pulse: int = 3600,
) -> tuple[int, pb.PulseResponse]:
    msg = pb.WorkerPulse(
        type=pb.PULSE_REGISTER,
        next_pulse=next_pulse,
        channel=channel,
        takes_next=takes_next,
        queues=list(queues),
    )
    reply = core.handle(PulseReceived(msg, pid=None, uid=UID), now)[0]
    assert isinstance(reply, Reply) and reply.response.error == pb.CTRL_ERR_OK
    return reply.response.worker_id, reply.response


def settle(core: Core, actions: list[Action], now: float) -> list[Action]:
    """`actions` and all that follows from them: each SET_TASK (written on the worker's
    channel) is taken, as the shell reports it."""
    out: list[Action] = []
    todo = list(actions)
    while todo:
        action = todo.pop(0)
        out.append(action)
        if isinstance(action, Dial) and action.kind == pb.CTRL_SET_TASK:
            todo.extend(core.handle(DialDone(action.worker_id, pb.CTRL_SET_TASK, _TAKEN), now))
    return out


def open_channel(core: Core, wid: int, now: float = 0.0, next_pulse: int = 3600) -> list[Action]:
    """The pulse that opens the worker's channel (it is ready then)."""
    msg = pb.WorkerPulse(type=pb.PULSE_OK, worker_id=wid, next_pulse=next_pulse, channel=True)
    return settle(core, core.handle(PulseReceived(msg, pid=None, uid=UID), now), now)


def channel_worker(
    core: Core,
    now: float = 0.0,
    *,
    takes_next: bool = True,
    queues: Sequence[str] = (),
    next_pulse: int = 3600,
) -> int:
    wid, _ = register(core, now, takes_next=takes_next, queues=queues, next_pulse=next_pulse)
    open_channel(core, wid, now, next_pulse)
    return wid


def submit(
    core: Core, task_id: int, now: float = 0.0, options: JobOptions | None = None
) -> tuple[Task, list[Action]]:
    task, actions = core.submit(task_id, b"p%d" % task_id, None, now, options)
    return task, settle(core, actions, now)


def outcome(core: Core, wid: int, task_id: int, now: float, ok: bool = True) -> list[Action]:
    """The worker's outcome on its channel for `task_id`."""
    error = pb.WORKER_ERR_OK if ok else pb.WORKER_ERR_TASK_FAILED
    resp = pb.WorkerResponse(error=error, task_id=task_id)
    extra = b"r%d" % task_id if ok else b"boom"
    return settle(core, core.local.outcome(wid, resp, extra, now), now)


def answered(core: Core, wid: int, kind: int, task_id: int, now: float) -> list[Action]:
    return settle(core, core.local.next_answered(wid, kind, task_id, now), now)


def dials(actions: Iterable[Action], kind: int | None = None) -> list[Dial]:
    return [a for a in actions if isinstance(a, Dial) and (kind is None or a.kind == kind)]


def finished(actions: Iterable[Action]) -> list[TaskFinished]:
    return [a for a in actions if isinstance(a, TaskFinished)]


def state(task: Task) -> TaskState:
    """The task's state now (a call, so that mypy does not keep an earlier check's)."""
    return task.state


def held_next(core: Core, wid: int) -> int:
    nxt = core.workers[wid].next
    return nxt.task_id if nxt is not None else 0


def busy_with_next(core: Core) -> tuple[int, Task, Task]:
    """One worker that takes a next task, running task 1 and holding task 2."""
    wid = channel_worker(core)
    one, _ = submit(core, 1)
    two, actions = submit(core, 2)
    assert [(d.worker_id, d.task_id) for d in dials(actions, pb.CTRL_SET_TASK)] == [(wid, 2)]
    worker = core.workers[wid]
    assert worker.task is one and worker.next is two
    return wid, one, two


def idle_arrives(core: Core, now: float = 1.0) -> tuple[int, list[Action]]:
    """A worker (one task at a time) whose channel opens with nothing pending."""
    other, _ = register(core, now, takes_next=False)
    return other, open_channel(core, other, now)


# ---------------------------------------------------------------- asking


@pytest.mark.parametrize(
    ("channel", "takes_next", "granted"),
    [(True, True, True), (False, True, False), (True, False, False), (False, False, False)],
)
def test_takes_next_is_granted_with_a_channel_only(
    channel: bool, takes_next: bool, granted: bool
) -> None:
    core = Core()
    wid, response = register(core, channel=channel, takes_next=takes_next)
    assert response.takes_next is granted
    assert response.channel is channel
    assert core.workers[wid].next_granted is granted


def test_no_next_task_before_the_channel_opening_pulse() -> None:
    """Granted at REGISTER, but ready through a pulse that opens no channel: one task at a
    time; the same worker after its opening pulse is handed a next one."""
    core = Core()
    wid, _ = register(core)
    msg = pb.WorkerPulse(type=pb.PULSE_OK, worker_id=wid, next_pulse=3600)
    settle(core, core.handle(PulseReceived(msg, pid=None, uid=UID), 0.0), 0.0)
    one, actions = submit(core, 1)
    assert core.workers[wid].task is one
    two, actions = submit(core, 2)
    assert dials(actions) == [] and two.state is TaskState.QUEUED
    assert core.workers[wid].next is None

    opened = Core()
    wid = channel_worker(opened)
    submit(opened, 1)
    _, actions = submit(opened, 2)
    assert [d.task_id for d in dials(actions, pb.CTRL_SET_TASK)] == [2]
    assert held_next(opened, wid) == 2


def test_a_worker_without_takes_next_holds_one_task_at_a_time() -> None:
    core = Core()
    wid = channel_worker(core, takes_next=False)
    submit(core, 1)
    two, actions = submit(core, 2)
    assert dials(actions) == [] and two.state is TaskState.QUEUED
    assert core.workers[wid].next is None


# ---------------------------------------------------------------- when


def test_a_next_task_only_when_no_idle_worker_can_take_it() -> None:
    core = Core()
    a = channel_worker(core, queues=["q"])
    submit(core, 1, options=JobOptions(queue="q"))  # a runs it
    b = channel_worker(core, queues=["q"])
    other = channel_worker(core, queues=["other"])  # idle, but not for queue q
    two, actions = submit(core, 2, options=JobOptions(queue="q"))
    assert [(d.worker_id, d.task_id) for d in dials(actions, pb.CTRL_SET_TASK)] == [(b, 2)]
    assert core.workers[a].next is None and core.workers[b].task is two
    # Now no idle worker serves q: the next busy one that takes a next task gets it.
    three, actions = submit(core, 3, options=JobOptions(queue="q"))
    [d] = dials(actions, pb.CTRL_SET_TASK)
    assert d.worker_id in (a, b) and d.task_id == 3
    assert core.workers[d.worker_id].next is three
    assert core.workers[other].state is WorkerState.IDLE and core.workers[other].task is None


def test_a_held_next_task_is_assigning_with_no_attempt_until_promoted() -> None:
    """Held: ASSIGNING, no attempt, no TaskProgress; the outcome before it promotes it (one
    attempt, RUNNING, its TaskProgress then)."""
    core = Core()
    wid = channel_worker(core)
    one, _ = submit(core, 1)
    two, actions = submit(core, 2)
    assert core.workers[wid].next is two
    assert [a for a in actions if isinstance(a, TaskProgress) and a.ref == two.ref] == []
    assert two.state is TaskState.ASSIGNING and two.attempts == 0 and two.worker_id == wid
    assert one.state is TaskState.RUNNING and one.attempts == 1
    assert core.workers[wid].state is WorkerState.BUSY
    assert core.queued == 0
    actions = outcome(core, wid, 1, 1.0)
    [started] = [a for a in actions if isinstance(a, TaskProgress) and a.ref == two.ref]
    assert started.state is TaskState.RUNNING and started.attempts == 1
    assert state(two) is TaskState.RUNNING and two.attempts == 1


def test_a_worker_holds_one_next_task_at_most() -> None:
    core = Core()
    wid, _, two = busy_with_next(core)
    three, actions = submit(core, 3)
    assert dials(actions) == [] and three.state is TaskState.QUEUED
    assert core.workers[wid].next is two


def test_the_next_tasks_timeout_starts_when_the_task_before_it_ends() -> None:
    core = Core()
    wid = channel_worker(core)
    submit(core, 1, 0.0)  # no timeout, runs long
    two, _ = submit(core, 2, 0.0, JobOptions(timeout=5))
    assert core.workers[wid].next is two
    actions = core.expire(100.0)  # long past 5 s since it was taken
    assert dials(actions) == [] and finished(actions) == []
    assert core.workers[wid].next is two and two.state is TaskState.ASSIGNING
    actions = outcome(core, wid, 1, 100.0)
    assert core.workers[wid].task is two
    assert core.expire(104.999) == [] and wid in core.workers
    actions = core.expire(105.0)
    assert [d.worker_id for d in dials(actions, pb.CTRL_RESTART)] == [wid]
    assert wid not in core.workers
    assert "timeout" in two.last_error


@pytest.mark.parametrize("ok", [True, False], ids=["succeeded", "failed"])
def test_the_outcome_promotes_the_next_task_and_the_worker_takes_another(ok: bool) -> None:
    core = Core(max_retries=0)
    wid, one, two = busy_with_next(core)
    three, _ = submit(core, 3)
    assert three.state is TaskState.QUEUED
    actions = outcome(core, wid, 1, 1.0, ok=ok)
    [done] = finished(actions)
    assert done.ref == one.ref
    assert done.state is (TaskState.SUCCESS if ok else TaskState.ERROR)
    worker = core.workers[wid]
    assert worker.state is WorkerState.BUSY and worker.task is two
    assert two.state is TaskState.RUNNING and two.attempts == 1  # counted at promotion
    assert [d.task_id for d in dials(actions, pb.CTRL_SET_TASK)] == [3]
    assert worker.next is three and state(three) is TaskState.ASSIGNING
    assert three.attempts == 0
    # And on: the next outcome promotes the third.
    actions = outcome(core, wid, 2, 2.0)
    assert [f.ref for f in finished(actions)] == [two.ref]
    assert worker.task is three and worker.next is None and three.attempts == 1
    actions = outcome(core, wid, 3, 3.0)
    assert worker.task is None and worker.state is WorkerState.IDLE


# ---------------------------------------------------------------- canceled before it starts


def test_canceling_a_held_next_task_sends_drop_and_the_next_waits_for_its_answer() -> None:
    core = Core()
    wid, one, two = busy_with_next(core)
    actions = settle(core, core.cancel(two.ref, 1.0), 1.0)
    assert [(d.worker_id, d.task_id) for d in dials(actions)] == [(wid, 2)]
    assert dials(actions)[0].kind == pb.CTRL_DROP
    [done] = finished(actions)
    assert done.ref == two.ref and done.state is TaskState.CANCELED
    worker = core.workers[wid]
    assert worker.task is one and worker.next is None and worker.dropping == 2
    three, actions = submit(core, 3, 2.0)
    assert dials(actions) == []  # not while the DROP is unanswered
    assert answered(core, wid, pb.CTRL_DROP, 99, 3.0) == []  # not its answer
    actions = answered(core, wid, pb.CTRL_DROP, 2, 4.0)
    assert [(d.worker_id, d.task_id) for d in dials(actions, pb.CTRL_SET_TASK)] == [(wid, 3)]
    assert worker.next is three and worker.dropping == 0
    assert core.counters.restarts_sent == 0


def test_an_outcome_while_the_drop_is_unanswered_restarts_the_worker() -> None:
    """The worker started the canceled task (its outcome crossed the DROP): RESTART."""
    core = Core()
    wid, one, two = busy_with_next(core)
    settle(core, core.cancel(two.ref, 1.0), 1.0)
    actions = outcome(core, wid, 1, 2.0)
    [done] = finished(actions)
    assert done.ref == one.ref and done.state is TaskState.SUCCESS
    assert [d.worker_id for d in dials(actions, pb.CTRL_RESTART)] == [wid]
    assert wid not in core.workers
    assert two.state is TaskState.CANCELED and two.ref not in core.tasks
    assert core.counters.restarts_sent == 1
    assert answered(core, wid, pb.CTRL_DROP, 2, 3.0) == []  # too late: forgotten


def test_canceling_the_running_task_places_its_held_next_task_at_once() -> None:
    core = Core(timeout_task_placement=0.0)
    wid, one, two = busy_with_next(core)
    # Idle with nothing pending: task 2 is reclaimed; the cancel comes before the answer.
    other, actions = idle_arrives(core)
    assert [(d.worker_id, d.task_id) for d in dials(actions, pb.CTRL_DROP)] == [(wid, 2)]
    three, _ = submit(core, 3)
    assert core.workers[other].task is three
    actions = outcome(core, other, 3, 1.0)  # idle again: no second DROP
    assert dials(actions) == [] and core.workers[wid].reclaiming
    actions = settle(core, core.cancel(one.ref, 2.0), 2.0)
    assert [d.worker_id for d in dials(actions, pb.CTRL_RESTART)] == [wid]
    assert wid not in core.workers
    assert core.workers[other].task is two, "task 2 waits while a worker is idle"
    assert two.attempts == 1  # taken there: its first attempt


# ---------------------------------------------------------------- reclaimed


def reclaimed(core: Core, cause: str) -> tuple[int, Task, Task]:
    """Worker `wid` runs task 1 and holds task 2 (placement timeout 10 s), which the
    controller takes back with a CTRL_DROP: an idle worker could take it, or its placement
    timeout passed."""
    wid = channel_worker(core)
    one, _ = submit(core, 1)
    two, _ = submit(core, 2, 0.0, JobOptions(placement_timeout=10))
    assert core.workers[wid].next is two
    if cause == "idle worker":
        _, actions = idle_arrives(core)
    else:
        assert cause == "placement"
        assert core.expire(9.999) == []
        actions = settle(core, core.expire(10.0), 10.0)
    assert [(d.worker_id, d.kind, d.task_id) for d in dials(actions)] == [(wid, pb.CTRL_DROP, 2)]
    assert finished(actions) == []
    worker = core.workers[wid]
    assert worker.reclaiming and worker.dropping == 0
    assert worker.task is one and worker.next is two
    assert state(two) is TaskState.ASSIGNING and two.attempts == 0
    return wid, one, two


def test_a_worker_becoming_idle_reclaims_a_held_task_it_could_take() -> None:
    """The DROP goes out when the worker is idle with nothing pending; its answer puts the
    task back, and the idle worker takes it (its first attempt)."""
    core = Core()
    wid, one, two = reclaimed(core, "idle worker")
    [other] = [w for w in core.workers if w != wid]
    assert core.workers[other].state is WorkerState.IDLE
    assert answered(core, wid, pb.CTRL_DROP, 99, 2.0) == []  # not its answer
    assert core.workers[wid].next is two
    actions = answered(core, wid, pb.CTRL_DROP, 2, 2.0)
    assert [(d.worker_id, d.task_id) for d in dials(actions)] == [(other, 2)]
    worker = core.workers[wid]
    assert worker.next is None and not worker.reclaiming and worker.task is one
    assert core.workers[other].task is two
    assert two.state is TaskState.RUNNING and two.attempts == 1 and two.worker_id == other
    # The worker's own outcome promotes nothing now; nobody is restarted.
    actions = outcome(core, wid, 1, 3.0)
    assert [f.ref for f in finished(actions)] == [one.ref] and dials(actions) == []
    assert worker.task is None and worker.state is WorkerState.IDLE
    assert core.workers[other].task is two
    assert core.counters.restarts_sent == 0


def test_an_idle_worker_whose_reclaim_came_to_nothing_reclaims_another() -> None:
    core = Core()
    submit(core, 1)
    a = channel_worker(core)
    b = channel_worker(core)
    for n in (2, 3, 4):
        submit(core, n)
    assert (held_next(core, a), held_next(core, b)) == (3, 4)
    idle, actions = idle_arrives(core)
    assert [(d.worker_id, d.task_id) for d in dials(actions)] == [(a, 3)]  # one per idle
    actions = outcome(core, a, 1, 2.0)  # task 3 started first: it runs on a
    assert core.workers[a].task is not None and core.workers[a].task.task_id == 3
    actions += settle(core, core.expire(2.5), 2.5)
    assert core.workers[idle].state is WorkerState.IDLE
    assert [(d.worker_id, d.kind, d.task_id) for d in dials(actions)] == [(b, pb.CTRL_DROP, 4)], (
        "idle while task 4, which it could take, waits behind task 2"
    )


def test_an_idle_worker_that_cannot_take_the_held_task_reclaims_nothing() -> None:
    core = Core()
    wid, _, two = busy_with_next(core)
    other, _ = register(core, 1.0, queues=["other"])
    actions = open_channel(core, other, 1.0)
    assert dials(actions) == []
    assert core.workers[wid].next is two and not core.workers[wid].reclaiming


@pytest.mark.parametrize("cause", ["idle worker", "placement"])
def test_a_reclaimed_task_whose_outcome_before_came_first_runs_there(cause: str) -> None:
    """The worker started it (its outcome crossed the DROP): it is promoted and runs there,
    no RESTART (it was not canceled), its placement timeout no longer applies."""
    core = Core()
    wid, one, two = reclaimed(core, cause)
    actions = outcome(core, wid, 1, 10.5)
    assert [f.ref for f in finished(actions)] == [one.ref]
    assert dials(actions) == []
    worker = core.workers[wid]
    assert worker.task is two and worker.next is None and not worker.reclaiming
    assert two.state is TaskState.RUNNING and two.attempts == 1 and two.worker_id == wid
    assert core.counters.restarts_sent == 0
    assert finished(core.expire(50.0)) == []
    for w in core.workers.values():
        if w is not worker:
            assert w.state is WorkerState.IDLE and w.task is None
    actions = outcome(core, wid, 2, 51.0)
    [done] = finished(actions)
    assert done.ref == two.ref and done.state is TaskState.SUCCESS


def test_a_held_task_past_its_placement_timeout_fails_once_the_drop_is_answered() -> None:
    """Back with no placement time left: it fails (failed_post, placement) by the next
    expire, never handed again, with no attempt counted."""
    core = Core()
    wid, one, two = reclaimed(core, "placement")
    actions = answered(core, wid, pb.CTRL_DROP, 2, 10.5)
    actions += settle(core, core.expire(10.5), 10.5)
    assert dials(actions) == [], "handed again with no placement time left"
    [done] = finished(actions)
    assert done.ref == two.ref and done.state is TaskState.FAILED_POST
    assert done.reason == "placement" and "no free worker within 10 s" in done.error
    assert two.attempts == 0 and two.ref not in core.tasks
    worker = core.workers[wid]
    assert worker.next is None and not worker.reclaiming and worker.task is one
    assert core.counters.placement_timeouts == 1 and core.counters.restarts_sent == 0


def test_a_held_task_past_its_placement_timeout_is_taken_back_not_failed() -> None:
    """Its deadline passes while held: a CTRL_DROP, and it does not fail while held (the
    answer decides), nor is a second DROP sent."""
    core = Core()
    wid, _, two = reclaimed(core, "placement")
    actions = settle(core, core.expire(10.5), 10.5)
    assert dials(actions) == [] and finished(actions) == []  # no second DROP
    assert core.workers[wid].next is two and two.ref in core.tasks


@pytest.mark.parametrize("cause", ["idle worker", "placement"])
def test_cancel_while_a_reclaim_drop_is_in_flight_sends_no_second_drop(cause: str) -> None:
    """The reclaim's DROP serves the cancel; its answer frees the worker and places
    nothing."""
    core = Core()
    wid, one, two = reclaimed(core, cause)
    actions = settle(core, core.cancel(two.ref, 10.2), 10.2)
    assert dials(actions) == []
    [done] = finished(actions)
    assert done.ref == two.ref and done.state is TaskState.CANCELED
    worker = core.workers[wid]
    assert worker.dropping == 2 and not worker.reclaiming and worker.next is None
    actions = answered(core, wid, pb.CTRL_DROP, 2, 10.5)
    assert dials(actions) == [] and finished(actions) == []
    assert worker.dropping == 0 and worker.task is one and two.ref not in core.tasks
    assert all(w.task is None for w in core.workers.values() if w is not worker)
    # Free to be handed a next task again, and no RESTART at its outcome.
    three, actions = submit(core, 3, 11.0)
    assert three.worker_id != 0
    actions = outcome(core, wid, 1, 12.0)
    assert dials(actions, pb.CTRL_RESTART) == [] and wid in core.workers
    assert core.counters.restarts_sent == 0


@pytest.mark.parametrize("cause", ["idle worker", "placement"])
def test_cancel_while_a_reclaim_drop_is_in_flight_then_the_outcome_restarts(cause: str) -> None:
    """The outcome before it comes first: the worker started the canceled task (RESTART)."""
    core = Core()
    wid, one, two = reclaimed(core, cause)
    settle(core, core.cancel(two.ref, 10.2), 10.2)
    actions = outcome(core, wid, 1, 10.5)
    [done] = finished(actions)
    assert done.ref == one.ref and done.state is TaskState.SUCCESS
    assert [d.worker_id for d in dials(actions, pb.CTRL_RESTART)] == [wid]
    assert wid not in core.workers and core.counters.restarts_sent == 1
    assert answered(core, wid, pb.CTRL_DROP, 2, 11.0) == []  # too late: forgotten


# ---------------------------------------------------------------- the worker lost


def _lose(core: Core, wid: int, how: str, now: float) -> list[Action]:
    if how == "channel ended":
        return settle(core, core.local.channel_ended(wid, "EOF", now), now)
    if how == "process exited":
        return settle(core, core.handle(WorkerExited(wid), now), now)
    if how.startswith("shutdown"):
        task = core.workers[wid].task
        if how != "shutdown":  # the cases of a worker that read its task
            assert task is not None
        if how == "shutdown after a pulse" and task is not None:  # the pulse names it
            ok = pb.WorkerPulse(type=pb.PULSE_OK, worker_id=wid, task_id=task.task_id)
            settle(core, core.handle(PulseReceived(ok, pid=None, uid=UID), now), now)
        named = 0
        if how == "shutdown naming its task" and task is not None:  # it ran it, then left
            named = task.task_id
        msg = pb.WorkerPulse(type=pb.PULSE_SHUTDOWN, worker_id=wid, task_id=named)
        return settle(core, core.handle(PulseReceived(msg, pid=None, uid=UID), now), now)
    assert how == "pulse deadline"  # its last pulse at 0 promised 3600 s
    assert core.expire(3599.999) == [] and wid in core.workers
    return settle(core, core.expire(3600.0), 3600.0)


@pytest.mark.parametrize(
    "how",
    [
        "channel ended",
        "pulse deadline",
        "process exited",
        "shutdown",
        "shutdown after a pulse",
        "shutdown naming its task",
    ],
)
def test_a_lost_worker_puts_its_next_task_back_at_the_head_unchanged(how: str) -> None:
    core = Core(timeout_task_placement=0.0)
    wid, one, two = busy_with_next(core)
    three, _ = submit(core, 3)
    assert (one.attempts, two.attempts, three.attempts) == (1, 0, 0)
    _lose(core, wid, how, 1.0)
    assert wid not in core.workers
    assert two.state is TaskState.QUEUED and two.worker_id == 0
    assert two.attempts == 0  # as before it was handed: it never ran
    if how == "shutdown":  # said before it read its task (nothing came since it was written)
        assert one.attempts == 0
    else:
        assert one.attempts == 1  # it ran: that attempt counts
    # Another worker (one task at a time) takes them in order: what was handed out first.
    other = channel_worker(core, 3700.0, takes_next=False)
    order = []
    for n in range(3):
        task = core.workers[other].task
        assert task is not None
        order.append(task.task_id)
        outcome(core, other, task.task_id, 3701.0 + n)
    assert order == [1, 2, 3]


def test_a_worker_lost_before_its_next_task_was_taken_leaves_its_attempts_unchanged() -> None:
    core = Core()
    wid = channel_worker(core)
    submit(core, 1)
    two, actions = core.submit(2, b"x", None, 0.0)  # the SET_TASK is written, not yet taken
    assert [d.task_id for d in dials(actions, pb.CTRL_SET_TASK)] == [2]
    assert core.workers[wid].next is two and two.state is TaskState.ASSIGNING
    core.local.channel_ended(wid, "EOF", 0.1)
    assert state(two) is TaskState.QUEUED
    assert two.attempts == 0


# ---------------------------------------------------------------- refused


def test_a_refused_next_task_goes_back_and_the_worker_keeps_its_running_task() -> None:
    core = Core()
    wid, one, two = busy_with_next(core)
    actions = answered(core, wid, pb.CTRL_SET_TASK, 2, 1.0)
    assert dials(actions) == []
    worker = core.workers[wid]
    assert worker.task is one and one.state is TaskState.RUNNING
    assert worker.state is WorkerState.BUSY and worker.next is None
    assert two.state is TaskState.QUEUED and two.worker_id == 0
    assert core.queued == 1
    # No more next tasks for it, and its running task's outcome is still taken.
    three, actions = submit(core, 3, 2.0)
    assert dials(actions) == [] and worker.next is None
    actions = outcome(core, wid, 1, 3.0)
    assert [f.ref for f in finished(actions)] == [one.ref]
    assert worker.task is two  # the head of the queue, as a task of its own
    assert worker.next is None and three.state is TaskState.QUEUED


def test_a_refused_next_task_uses_no_attempt() -> None:
    core = Core()
    wid, _, two = busy_with_next(core)
    answered(core, wid, pb.CTRL_SET_TASK, 2, 1.0)
    assert two.state is TaskState.QUEUED
    assert two.attempts == 0


def route_set_task_answer(core: Core, wid: int, resp: pb.WorkerResponse, now: float) -> None:
    """A worker's answer to a SET_TASK on its channel, routed as worker_links.py does: the
    refusal of its next task, else the refusal of a task it should have been free for."""
    if core.local.holds_next(wid, resp.task_id):
        settle(core, core.local.next_answered(wid, pb.CTRL_SET_TASK, resp.task_id, now), now)
    else:
        settle(core, core.local.channel_ended(wid, "refused", now), now)


def test_a_draining_worker_refuses_its_next_task_by_that_task_id() -> None:
    core = Core()
    wid = channel_worker(core)
    one, _ = submit(core, 1)
    session = WorkerSession()
    session.takes_next = True
    session.on_control(pb.ControlMsg(type=pb.CTRL_SET_TASK, task_id=1), b"p1")
    session.draining = True  # SIGTERM while task 1 runs
    two, actions = submit(core, 2)
    [d] = dials(actions, pb.CTRL_SET_TASK)
    answer = session.on_control(pb.ControlMsg(type=pb.CTRL_SET_TASK, task_id=d.task_id), b"")
    assert answer.response.error == pb.WORKER_ERR_BUSY
    route_set_task_answer(core, wid, answer.response, 1.0)
    assert wid in core.workers, "the worker was dropped with its job running"
    assert core.workers[wid].task is one and state(two) is TaskState.QUEUED
    assert answer.response.task_id == 2


@pytest.mark.parametrize(
    ("pulsed", "named", "refunded"),
    [(False, 1, True), (False, 0, True), (False, 7, False), (True, 1, False)],
)
def test_a_refusal_that_ends_the_channel_refunds_only_an_unread_task_it_names(
    pulsed: bool, named: int, refunded: bool
) -> None:
    """`channel_ended(..., "refused", task_id)`: the running task's attempt is given back
    only when the worker has not pulsed since it was written and the refusal names it (or
    names none)."""
    core = Core()
    wid = channel_worker(core)
    one, _ = submit(core, 1)
    assert core.workers[wid].task is one and one.attempts == 1
    if pulsed:
        msg = pb.WorkerPulse(type=pb.PULSE_OK, worker_id=wid, task_id=1, next_pulse=3600)
        settle(core, core.handle(PulseReceived(msg, pid=None, uid=UID), 0.5), 0.5)
    settle(core, core.local.channel_ended(wid, "refused", 1.0, named), 1.0)
    assert wid not in core.workers and state(one) is TaskState.QUEUED
    assert one.attempts == (0 if refunded else 1)


# ---------------------------------------------------------------- queue limits


def test_queue_concurrency_counts_held_next_tasks() -> None:
    core = Core()
    core.limit("default", 3, None, 0.0)
    a = channel_worker(core)
    b = channel_worker(core)
    tasks = [submit(core, n)[0] for n in range(1, 6)]
    held = [t for t in tasks if t.worker_id]
    assert len(held) == 3  # two running, one held next
    assert sum(core.workers[w].next is not None for w in (a, b)) == 1
    assert sum(t.state is TaskState.QUEUED for t in tasks) == 2
    # A promoted next task frees no room: still three held.
    wid = next(w for w in (a, b) if core.workers[w].next is not None)
    running = core.workers[wid].task
    assert running is not None
    outcome(core, wid, running.task_id, 1.0)
    live = [t for t in tasks if t.ref in core.tasks]
    assert len([t for t in live if t.worker_id]) == 3
    assert sum(core.workers[w].next is not None for w in (a, b)) == 1


def test_queue_concurrency_of_one_hands_out_no_next_task() -> None:
    core = Core()
    core.limit("default", 1, None, 0.0)
    wid = channel_worker(core)
    submit(core, 1)
    two, actions = submit(core, 2)
    assert dials(actions) == [] and core.workers[wid].next is None
    assert two.state is TaskState.QUEUED


# ---------------------------------------------------------------- a state machine

QUEUES = ("a", "b")
B_CONCURRENCY = 2


class NextTaskMachine(RuleBasedStateMachine):
    """Random submissions, workers, outcomes, cancels, losses, DROP answers (to a cancel or
    to a reclaim), placement timeouts of held tasks and time, with the next-task invariants
    checked after each core call and each step."""

    def __init__(self) -> None:
        super().__init__()
        self.core = Core(max_retries=2, timeout_task_placement=60.0)
        self.now = 0.0
        self.task_ids = 0
        self.submitted: set[int] = set()
        self.ended: Counter[int] = Counter()
        self.canceled: set[int] = set()
        # Attempts are counted when a task starts (a TaskProgress RUNNING), never else.
        self.started: Counter[int] = Counter()
        self.idle_before: set[int] = set()  # idle workers before the core call checked

    @initialize()
    def limit_b(self) -> None:
        self.core.limit("b", B_CONCURRENCY, None, self.now)

    # ------------------------------------------------------------ driving

    def run(self, call: Callable[[], list[Action]]) -> list[Action]:
        """One core call and what follows it (SET_TASKs taken), each call checked."""
        self.idle_before = {
            w.worker_id for w in self.core.workers.values() if w.state is WorkerState.IDLE
        }
        actions = call()
        self.check_call(actions)
        out = list(actions)
        todo = dials(actions, pb.CTRL_SET_TASK)
        while todo:
            taken = DialDone(todo.pop(0).worker_id, pb.CTRL_SET_TASK, _TAKEN)
            actions = self.core.handle(taken, self.now)
            self.check_call(actions)
            out.extend(actions)
            todo.extend(dials(actions, pb.CTRL_SET_TASK))
        return out

    def check_call(self, actions: list[Action]) -> None:
        workers = self.core.workers
        for action in actions:
            if isinstance(action, TaskFinished):
                self.ended[action.ref] += 1
                assert self.ended[action.ref] == 1, f"task {action.ref} ended twice"
            elif isinstance(action, TaskProgress) and action.state is TaskState.RUNNING:
                self.started[action.ref] += 1
                assert action.attempts == self.started[action.ref]
            elif isinstance(action, Dial) and action.kind == pb.CTRL_RESTART:
                assert action.worker_id not in workers, "restarted but kept"
            elif isinstance(action, Dial) and action.kind == pb.CTRL_DROP:
                # To forget a canceled next task, or to take back one still held.
                worker = workers.get(action.worker_id)
                assert worker is not None
                nxt = worker.next
                assert worker.dropping == action.task_id or (
                    worker.reclaiming and nxt is not None and nxt.task_id == action.task_id
                )
            elif isinstance(action, Dial) and action.kind == pb.CTRL_SET_TASK:
                worker = workers.get(action.worker_id)
                if worker is None or worker.next is None:
                    continue
                if worker.next.task_id != action.task_id or worker.next.state is not (
                    TaskState.ASSIGNING
                ):
                    continue
                # Just handed as a next task: no idle worker could take it.
                task = worker.next
                assert worker.takes_next
                for other in workers.values():
                    if other.state is WorkerState.IDLE:
                        assert not self.core.scheduler.pending.fits(other, task), (
                            f"task {task.task_id} handed ahead to worker {worker.worker_id} "
                            f"while worker {other.worker_id} was idle"
                        )
        self.check_state()

    def check_state(self) -> None:
        sched = self.core.scheduler
        tasks = sched.tasks
        places: Counter[int] = Counter()
        pending = {task.ref for task in sched.pending}
        for ref in pending:
            places[ref] += 1
            assert tasks[ref].state is TaskState.QUEUED
        for live in tasks.values():
            if live.state is TaskState.SCHEDULED:
                places[live.ref] += 1
        b_held = 0
        for worker in self.core.workers.values():
            task, nxt = worker.task, worker.next
            if task is not None:
                places[task.ref] += 1
                assert tasks.get(task.ref) is task, "a worker runs a task that ended"
                assert task.ref not in self.canceled
                assert task.worker_id == worker.worker_id
                b_held += task.opts.queue == "b"
            if nxt is not None:
                places[nxt.ref] += 1
                assert tasks.get(nxt.ref) is nxt, "a worker holds a task that ended"
                assert nxt.ref not in self.canceled
                assert worker.takes_next, "a next task on a worker that takes none"
                assert task is not None and task is not nxt
                assert worker.state is WorkerState.BUSY
                assert nxt.worker_id == worker.worker_id
                assert not worker.dropping
                # Held: handed, not started; no attempt counted for it.
                assert nxt.state is TaskState.ASSIGNING
                assert nxt.attempts == self.started[nxt.ref]
                b_held += nxt.opts.queue == "b"
            else:
                assert not worker.reclaiming, "reclaiming with nothing held"
            if worker.state is WorkerState.IDLE:
                assert task is None and nxt is None
                for ref in pending:  # dispatch left it nothing it could take
                    other = tasks[ref]
                    assert other.opts.queue in sched.pending.held or not (
                        sched.pending.fits(worker, other)
                    )
                if worker.worker_id not in self.idle_before:
                    self.check_reclaimed_for(worker)
        assert b_held <= B_CONCURRENCY
        assert set(places) == set(tasks), "a live task is nowhere"
        assert all(n == 1 for n in places.values()), f"a task in two places: {places}"
        assert not set(tasks) & set(self.ended)
        assert set(tasks) | set(self.ended) == self.submitted
        for task in tasks.values():
            assert task.attempts == self.started[task.ref]

    def check_reclaimed_for(self, idle: Worker) -> None:
        """A worker that became idle and could take a held task has a CTRL_DROP out for one
        it could take (at most one per idle worker: next_tasks.py `reclaim_for`), checked in
        the call that made it idle; test_an_idle_worker_whose_reclaim_came_to_nothing_
        reclaims_another checks the take-backs that came to nothing."""
        fits = self.core.scheduler.pending.fits
        could = [
            w
            for w in self.core.workers.values()
            if w.next is not None and fits(idle, w.next) and idle.worker_id not in w.next.failed_on
        ]
        if any(not w.reclaiming for w in could):
            assert any(w.reclaiming for w in could), (
                f"worker {idle.worker_id} idle while a task it could take is held, no DROP out"
            )

    def live_workers(self) -> list[Worker]:
        return sorted(self.core.workers.values(), key=lambda w: w.worker_id)

    # ------------------------------------------------------------ rules

    @rule(
        queue=st.sampled_from(QUEUES),
        timeout=st.sampled_from([0.0, 0.0, 4.0]),
        count=st.integers(1, 3),
    )
    def submit(self, queue: str, timeout: float, count: int) -> None:
        opts = JobOptions(queue=queue, timeout=timeout, max_retries=2, placement_timeout=60.0)
        for _ in range(count):
            self.task_ids += 1
            self.run(lambda: self.submit_one(self.task_ids, opts))

    def submit_one(self, task_id: int, opts: JobOptions) -> list[Action]:
        task, actions = self.core.submit(task_id, b"", None, self.now, opts)
        self.submitted.add(task.ref)
        return actions

    @rule(
        queues=st.sampled_from([("a",), ("b",), ("a", "b")]),
        takes_next=st.booleans(),
        next_pulse=st.sampled_from([8, 3600, 3600]),
    )
    def register(self, queues: tuple[str, ...], takes_next: bool, next_pulse: int) -> None:
        wid, response = register(
            self.core, self.now, takes_next=takes_next, queues=queues, next_pulse=next_pulse
        )
        assert response.takes_next is takes_next
        msg = pb.WorkerPulse(type=pb.PULSE_OK, worker_id=wid, next_pulse=next_pulse, channel=True)
        self.run(lambda: self.core.handle(PulseReceived(msg, pid=None, uid=UID), self.now))
        assert self.core.workers[wid].takes_next is takes_next

    def running(self) -> list[Worker]:
        return [
            w
            for w in self.live_workers()
            if w.task is not None and w.task.state is TaskState.RUNNING
        ]

    @precondition(lambda self: bool(self.running()))
    @rule(data=st.data(), ok=st.booleans())
    def end_task(self, data: st.DataObject, ok: bool) -> None:
        worker = data.draw(st.sampled_from(self.running()))
        task = worker.task
        assert task is not None
        nxt, dropping = worker.next, worker.dropping
        before = nxt.attempts if nxt is not None else 0
        wid = worker.worker_id
        actions = self.run(lambda: outcome_actions(self.core, wid, task.task_id, self.now, ok))
        if ok:
            assert any(f.ref == task.ref for f in finished(actions))
        if dropping:  # it started the canceled task: restarted
            assert nxt is None
            assert [d.worker_id for d in dials(actions, pb.CTRL_RESTART)] == [wid]
            assert wid not in self.core.workers
        elif nxt is not None:  # promoted (reclaimed or not): still busy, running it
            assert dials(actions, pb.CTRL_RESTART) == []
            assert self.core.workers.get(wid) is worker
            assert worker.state is WorkerState.BUSY and worker.task is nxt
            assert not worker.reclaiming
            assert nxt.state is TaskState.RUNNING and nxt.attempts == before + 1

    @precondition(lambda self: bool(self.core.scheduler.tasks))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        self.cancel_one(data.draw(st.sampled_from(sorted(self.core.scheduler.tasks))))

    @precondition(lambda self: any(w.next is not None for w in self.core.workers.values()))
    @rule(data=st.data())
    def cancel_next(self, data: st.DataObject) -> None:
        """Cancel a held next task (the case that sends a DROP)."""
        held = [w.next.ref for w in self.live_workers() if w.next is not None]
        self.cancel_one(data.draw(st.sampled_from(held)))

    def cancel_one(self, ref: int) -> None:
        task = self.core.scheduler.tasks[ref]
        holder = self.core.workers.get(task.worker_id) if task.worker_id else None
        was_next = holder is not None and holder.next is task
        reclaiming = was_next and holder is not None and holder.reclaiming
        self.canceled.add(ref)
        # Core.cancel places nothing (test_canceling_the_running_task_places_its_held_next_
        # task_at_once): the expire that follows does, as the shell's next one would.
        actions = self.run(lambda: self.core.cancel(ref, self.now) + self.core.expire(self.now))
        [done] = [f for f in finished(actions) if f.ref == ref]
        assert done.state is TaskState.CANCELED
        # Others end only if their placement time ran out (a lost worker's held task).
        assert all(f.reason == "placement" for f in finished(actions) if f.ref != ref)
        if was_next:
            assert holder is not None
            sent = [(d.worker_id, d.task_id) for d in dials(actions, pb.CTRL_DROP)]
            if reclaiming:  # the reclaim's DROP serves: no second one
                assert (holder.worker_id, task.task_id) not in sent
            else:
                assert (holder.worker_id, task.task_id) in sent
            assert dials(actions, pb.CTRL_RESTART) == []
            assert self.core.workers.get(holder.worker_id) is holder
            assert holder.dropping == task.task_id and not holder.reclaiming

    @precondition(lambda self: bool(self.core.workers))
    @rule(data=st.data(), how=st.sampled_from(["channel ended", "process exited", "shutdown"]))
    def lose(self, data: st.DataObject, how: str) -> None:
        worker = data.draw(st.sampled_from(self.live_workers()))
        nxt = worker.next
        before = nxt.attempts if nxt is not None else 0  # held: as before it was handed
        wid = worker.worker_id
        task = worker.task
        if how == "shutdown" and worker.unread and task is not None:
            # SHUTDOWN before the worker read its task (nothing came since it was written):
            # it never started, and its attempt is taken back.
            assert task.state is TaskState.RUNNING
            self.started[task.ref] -= 1
        self.run(lambda: _lose(self.core, wid, how, self.now))
        assert wid not in self.core.workers
        if nxt is not None:  # back, and maybe placed again at once (started: one attempt)
            assert nxt.worker_id != wid
            assert nxt.attempts == before + (nxt.state is TaskState.RUNNING)

    @precondition(lambda self: any(w.dropping for w in self.core.workers.values()))
    @rule(data=st.data())
    def answer_drop(self, data: st.DataObject) -> None:
        worker = data.draw(st.sampled_from([w for w in self.live_workers() if w.dropping]))
        wid, dropped = worker.worker_id, worker.dropping
        self.run(lambda: self.core.local.next_answered(wid, pb.CTRL_DROP, dropped, self.now))
        assert worker.dropping == 0

    @precondition(lambda self: any(w.reclaiming for w in self.core.workers.values()))
    @rule(data=st.data())
    def answer_reclaim(self, data: st.DataObject) -> None:
        """The worker forgot the held task the controller takes back: pending again, or
        placed at once (on an idle worker, where it starts), never the worker's next."""
        worker = data.draw(st.sampled_from([w for w in self.live_workers() if w.reclaiming]))
        task = worker.next
        assert task is not None
        wid, before = worker.worker_id, task.attempts
        actions = self.run(
            lambda: self.core.local.next_answered(wid, pb.CTRL_DROP, task.task_id, self.now)
        )
        assert dials(actions, pb.CTRL_RESTART) == []
        assert not worker.reclaiming
        past = task.opts.placement_timeout > 0 and task.deadline <= self.now
        # Forgotten there: the worker holds it again only if handed it anew (no idle worker
        # could take it by now), never with no placement time left.
        again = (wid, task.task_id) in {(d.worker_id, d.task_id) for d in dials(actions)}
        assert worker.next is not task or (again and not past), "not taken back"
        for done in finished(actions):  # none left: it fails (before any other)
            assert done.ref == task.ref and past
            assert done.state is TaskState.FAILED_POST and done.reason == "placement"
        if past:  # it fails by the next expire, never handed again
            actions = self.run(lambda: self.core.expire(self.now))
            assert task.ref not in self.core.scheduler.tasks
            assert task.ref in self.ended
        assert task.attempts == before + (task.state is TaskState.RUNNING)

    def held_deadlines(self) -> list[float]:
        return [
            w.next.deadline
            for w in self.core.workers.values()
            if w.next is not None and not w.reclaiming and w.next.deadline > self.now
        ]

    @precondition(lambda self: bool(self.held_deadlines()))
    @rule()
    def placement_passes(self) -> None:
        """Time runs to the first placement deadline of a held task: it is taken back."""
        self.now = min(self.held_deadlines())
        due = [
            w
            for w in self.live_workers()
            if w.next is not None and not w.reclaiming and w.next.deadline == self.now
        ]
        tasks = [(w, w.next) for w in due]
        actions = self.run(lambda: self.core.expire(self.now))
        sent = {(d.worker_id, d.task_id) for d in dials(actions, pb.CTRL_DROP)}
        for worker, task in tasks:
            assert task is not None
            if self.core.workers.get(worker.worker_id) is not worker:
                continue  # lost first (its pulse deadline, a timeout of its task)
            assert (worker.worker_id, task.task_id) in sent
            assert task.ref in self.core.scheduler.tasks, "failed while held"
            assert worker.next is task and worker.reclaiming

    @precondition(lambda self: any(w.next is not None for w in self.core.workers.values()))
    @rule(data=st.data())
    def refuse_next(self, data: st.DataObject) -> None:
        worker = data.draw(st.sampled_from([w for w in self.live_workers() if w.next]))
        nxt = worker.next
        assert nxt is not None
        wid = worker.worker_id
        self.run(
            lambda: self.core.local.next_answered(wid, pb.CTRL_SET_TASK, nxt.task_id, self.now)
        )
        assert worker.next is None and not worker.takes_next
        assert self.core.workers.get(wid) is worker and worker.task is not None

    @precondition(lambda self: bool(self.core.workers))
    @rule(data=st.data())
    def pulse(self, data: st.DataObject) -> None:
        """A pulse from a worker (naming the task it runs): its deadline moves."""
        worker = data.draw(st.sampled_from(self.live_workers()))
        task_id = worker.task.task_id if worker.task is not None else 0
        msg = pb.WorkerPulse(
            type=pb.PULSE_OK, worker_id=worker.worker_id, task_id=task_id, next_pulse=8
        )
        actions = self.run(
            lambda: self.core.handle(PulseReceived(msg, pid=None, uid=UID), self.now)
        )
        assert dials(actions, pb.CTRL_RESTART) == []

    @rule(dt=st.sampled_from([0.5, 2.0, 5.0]))
    def tick(self, dt: float) -> None:
        self.now += dt
        self.run(lambda: self.core.expire(self.now))

    # ------------------------------------------------------------ every step

    @invariant()
    def consistent(self) -> None:
        self.check_state()

    def drop_answered(self, wid: int, dropped: int) -> None:
        self.run(lambda: self.core.local.next_answered(wid, pb.CTRL_DROP, dropped, self.now))

    def task_ended(self, wid: int, task_id: int, ok: bool) -> list[Action]:
        return self.run(lambda: outcome_actions(self.core, wid, task_id, self.now, ok))

    def teardown(self) -> None:
        """Everything the workers hold ends: what is left is pending with no worker for it."""
        for _ in range(10_000):
            workers = self.live_workers()
            dropping = [w for w in workers if w.dropping]
            running = self.running()
            if not dropping and not running:
                break
            for worker in dropping:
                self.drop_answered(worker.worker_id, worker.dropping)
            for worker in self.running():
                task = worker.task
                assert task is not None
                self.task_ended(worker.worker_id, task.task_id, True)
        else:
            raise AssertionError("the workers never ran out of tasks")
        sched = self.core.scheduler
        for task in sched.tasks.values():
            assert task.state is TaskState.QUEUED, f"left {task.state} at the end"
            assert not any(sched.pending.fits(w, task) for w in self.core.workers.values())
        for worker in self.core.workers.values():
            assert worker.state is WorkerState.IDLE and worker.next is None


def outcome_actions(core: Core, wid: int, task_id: int, now: float, ok: bool) -> list[Action]:
    """The outcome on the channel, without taking what follows (the machine does)."""
    error = pb.WORKER_ERR_OK if ok else pb.WORKER_ERR_TASK_FAILED
    resp = pb.WorkerResponse(error=error, task_id=task_id)
    return core.local.outcome(wid, resp, b"" if ok else b"boom", now)


NextTaskMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_next_task_state_machine = NextTaskMachine.TestCase

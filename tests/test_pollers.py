"""Pollers (workers that ask GET /ping/): the pure kind's deadlines, and the HTTP door."""

from __future__ import annotations

import pytest

from controller.core import Core, HandOut, TaskFinished, TaskState
from controller.core.roster import MAX_REMEMBERED

CLAIM, LEASE = 10.0, 5.0


def core() -> Core:
    return Core(claim_timeout=CLAIM, lease_timeout=LEASE, max_retries=1)


def hand_outs(actions):
    return [a for a in actions if isinstance(a, HandOut)]


def finished(actions):
    return [a for a in actions if isinstance(a, TaskFinished)]


def test_a_waiting_poller_gets_the_next_job_and_finishes_it():
    c = core()
    assert c.pollers.ping("p1", 0.0) == []  # nothing pending: it waits
    task, actions = c.submit(9, b"in", "job-9", 1.0)
    assert hand_outs(actions) == [HandOut("p1", task.ref, "job-9")]
    c.pollers.handed("p1", 1.0, "L1")
    assert c.pollers.holds("p1", task.ref, "L1") and not c.pollers.holds("p2", task.ref, "L1")
    c.pollers.working("p1", task.ref, 2.0)
    [done] = finished(c.pollers.finished("p1", task.ref, b"out", 3.0))
    assert done.state is TaskState.SUCCESS and done.result == b"out"
    assert not c.pollers.holds("p1", task.ref, "L1") and c.workers == {}  # it pings again


def test_unconfirmed_job_returns_after_claim_timeout_with_an_attempt_used():
    c = core()
    c.pollers.ping("p1", 0.0)
    task, _ = c.submit(9, b"", "j", 0.0)
    c.pollers.handed("p1", 1.0, "L1")
    assert c.expire(1.0 + CLAIM - 0.001) == []
    c.expire(1.0 + CLAIM)
    assert task.state is TaskState.QUEUED and task.attempts == 1
    assert c.counters.worker_losses == {"claim timeout": 1}
    c.pollers.ping("p2", 20.0)  # another poller takes it (p1 failed it: p2 is preferred)
    c.pollers.handed("p2", 20.0, "L2")
    assert c.pollers.holds("p2", task.ref, "L2") and not c.pollers.holds("p2", task.ref, "L1")


def test_silent_poller_loses_its_job_after_lease_timeout_and_renewals_keep_it():
    c = core()
    c.pollers.ping("p1", 0.0)
    task, _ = c.submit(9, b"", "j", 0.0)
    c.pollers.handed("p1", 0.0, "L1")
    c.pollers.working("p1", task.ref, 1.0)
    c.pollers.working("p1", task.ref, 5.0)  # the lease renewed at 5: due at 10, not 6
    assert c.expire(9.999) == []
    assert c.task_state(task.ref) is TaskState.RUNNING
    c.expire(10.0)
    assert c.task_state(task.ref) is TaskState.QUEUED and task.attempts == 1
    assert c.counters.worker_losses == {"lease timeout": 1}


def test_a_job_handed_to_a_request_that_is_gone_goes_back_without_an_attempt():
    c = core()
    c.pollers.ping("p1", 0.0)
    task, _ = c.submit(9, b"", "j", 0.0)
    c.pollers.undeliverable("p1", 0.1)
    assert task.state is TaskState.QUEUED and task.attempts == 0 and c.workers == {}


def test_failed_report_retries_elsewhere_then_fails_with_the_pollers_error():
    c = core()
    c.pollers.ping("p1", 0.0)
    task, _ = c.submit(9, b"", "j", 0.0)
    c.pollers.handed("p1", 0.0, "L1")
    c.pollers.failed("p1", task.ref, "disk on fire", 1.0)
    assert task.state is TaskState.QUEUED
    c.pollers.ping("p1", 2.0)
    c.pollers.handed("p1", 2.0, "L1")
    [done] = finished(c.pollers.failed("p1", task.ref, "disk on fire", 3.0))
    assert done.state is TaskState.ERROR and "disk on fire" in done.error


def test_cancel_takes_the_job_from_its_poller():
    c = core()
    c.pollers.ping("p1", 0.0)
    task, _ = c.submit(9, b"", "j", 0.0)
    c.pollers.handed("p1", 0.0, "L1")
    actions: list[object] = []
    assert c.scheduler.cancel(task.ref, 1.0, actions)
    assert not c.pollers.holds("p1", task.ref, "L1")


def test_gave_up_removes_an_idle_poller_only():
    c = core()
    c.pollers.ping("p1", 0.0)
    assert len(c.workers) == 1
    c.pollers.gave_up("p1", 20.0)
    assert c.workers == {}
    with pytest.raises(AssertionError):
        c.pollers.working("p1", 1, 21.0)  # holds() must be checked first


def test_a_poller_keeps_a_job_it_held_before_a_restart():
    c = core()
    c.recover(1, 9, b"", "j", 0.0, running=True, attempts=1, grace=3.0, lease="L1")
    assert not c.pollers.adopt("p1", 9, "", 0.5)  # no lease: not its job
    assert not c.pollers.adopt("p1", 9, "L2", 0.5)  # another lease: not its job either
    assert c.workers == {}
    assert c.pollers.adopt("p1", 9, "L1", 0.5)
    assert c.pollers.holds("p1", 1, "L1")
    c.pollers.working("p1", 1, 0.6)
    [done] = finished(c.pollers.finished("p1", 1, b"kept", 1.0))
    assert done.result == b"kept"
    assert not c.pollers.adopt("p2", 42, "L1", 1.1) and c.workers == {}  # nothing to adopt


def test_a_report_needs_the_lease_the_claim_carried():
    c = core()
    c.pollers.ping("p1", 0.0)
    task, _ = c.submit(9, b"", "j", 0.0)
    c.pollers.handed("p1", 0.0, "secret-lease")
    assert not c.pollers.holds("p1", task.ref, "")
    assert not c.pollers.holds("p1", task.ref, "secret-leasf")
    assert not c.pollers.holds("p1", task.ref, "\udc80")  # any text: refused, never raises
    assert c.pollers.holds("p1", task.ref, "secret-lease")


def test_no_lease_issued_means_no_report_is_taken():
    c = core()
    c.pollers.ping("p1", 0.0)
    task, _ = c.submit(9, b"", "j", 0.0)
    assert not c.pollers.holds("p1", task.ref, "")  # handed out, but no lease yet


def _status_done(c: Core, name: str) -> int:
    [row] = [w for w in c.status(0.0)["workers"] if w["name"] == name]  # type: ignore[attr-defined]
    return int(row["done"])


def test_a_pollers_done_count_outlives_its_pings():
    c = core()
    for i in range(3):
        c.pollers.ping("p1", float(i))
        task, _ = c.submit(10 + i, b"", f"j{i}", float(i))
        c.pollers.handed("p1", float(i), "L")
        c.pollers.working("p1", task.ref, float(i))
        c.pollers.finished("p1", task.ref, b"", float(i))
    c.pollers.ping("p1", 4.0)  # waits for more: a worker again, with what it did before
    assert _status_done(c, "p1") == 3


def test_poller_names_are_forgotten_after_silence_but_not_while_live():
    c = Core(claim_timeout=CLAIM, lease_timeout=LEASE, forget_remote_after=100.0)
    for i in range(1000):  # a stream of new names, each asking once and giving up
        c.pollers.ping(f"n{i}", 1.0)
        c.pollers.gave_up(f"n{i}", 1.0)
    c.pollers.ping("live", 1.0)  # waiting all along
    assert len(c.pollers.roster) == 1001
    c.expire(100.999)
    assert len(c.pollers.roster) == 1001
    c.expire(101.0)
    assert len(c.pollers.roster) == 1 and c.pollers.names == {c.pollers.roster.ids["live"]: "live"}
    assert len(c.pollers._by_name) == 1
    c.expire(500.0)
    assert "live" in c.pollers.roster.ids  # still waiting: still known


def test_a_flood_of_poller_names_within_forget_after_is_capped():
    c = Core(claim_timeout=CLAIM, lease_timeout=LEASE, forget_remote_after=3600.0)
    c.pollers.ping("live", 0.0)  # waiting all along
    for i in range(3 * MAX_REMEMBERED):  # new names, each asking once and giving up
        c.pollers.ping(f"n{i}", 1.0 + i / 1000)
        c.pollers.gave_up(f"n{i}", 1.0 + i / 1000)
    assert len(c.pollers.roster) <= MAX_REMEMBERED
    assert len(c.pollers._by_name) <= MAX_REMEMBERED
    assert len(c.scheduler.deadlines) < 100  # the roster holds one deadline, not one a name
    assert "live" in c.pollers.roster.ids  # the oldest heard, but live: kept
    assert f"n{3 * MAX_REMEMBERED - 1}" in c.pollers.roster.ids  # the newest are kept
    assert "n0" not in c.pollers.roster.ids  # the oldest silent ones went first
    c.expire(10_000.0)
    assert list(c.pollers.roster.ids) == ["live"]

"""Calculators: the pure worker kind, and their datagrams at the UDP door."""

from __future__ import annotations

import ipaddress
import json
import logging
from typing import Any

from controller.core import Core, PerformTask, TaskFinished, TaskState
from controller.core.calculators import SILENT_REPORT_INTERVAL
from controller.core.roster import MAX_REMEMBERED
from controller.doors.udp.actions import Send
from controller.doors.udp.calclink import (
    CalculatorAck,
    CalculatorLink,
    Completed,
    Heartbeat,
    PerformAcked,
    PerformUnacked,
)
from controller.doors.udp.codec import FrontDoor
from controller.jobs import JobBook

CALC = ("127.0.0.9", 7000)
TIMEOUT = 5.0


def core() -> Core:
    return Core(calculator_timeout=TIMEOUT, max_retries=1)


def performs(actions):
    return [a for a in actions if isinstance(a, PerformTask)]


def finished(actions):
    return [a for a in actions if isinstance(a, TaskFinished)]


def test_ready_heartbeat_registers_and_gets_a_job_which_it_completes_once():
    c = core()
    assert c.calculators.heartbeat(CALC, True, 0.0) == []
    task, actions = c.submit(5, b"in", "j", 0.1)
    assert performs(actions) == [PerformTask(CALC, task.ref, 5, b"in")]
    c.calculators.acknowledged(CALC, task.ref, 0.2)
    assert c.task_state(task.ref) is TaskState.RUNNING and task.attempts == 1
    [done] = finished(c.calculators.completed(CALC, 5, True, b"out", "", 0.3))
    assert done.state is TaskState.SUCCESS and done.result == b"out"
    assert c.calculators.completed(CALC, 5, True, b"out", "", 0.4) == []  # a copy: ignored
    assert c.calculators.ignored_reports == 1
    assert c.worker_name(next(iter(c.workers))) == "127.0.0.9:7000"


def test_busy_heartbeat_registers_but_gets_no_job():
    c = core()
    c.calculators.heartbeat(CALC, False, 0.0)
    _, actions = c.submit(5, b"", "j", 0.1)
    assert performs(actions) == [] and len(c.workers) == 1


def test_unacknowledged_perform_task_goes_elsewhere_without_an_attempt():
    c = core()
    c.calculators.heartbeat(CALC, True, 0.0)
    other = ("127.0.0.9", 7001)
    task, _ = c.submit(5, b"", "j", 0.0)
    c.calculators.heartbeat(other, True, 0.1)
    actions = c.calculators.unacknowledged(CALC, task.ref, 2.0)
    assert performs(actions) == [PerformTask(other, task.ref, 5, b"")]
    assert task.attempts == 0
    # CALC is unavailable until its next ready heartbeat, then usable again.
    task2, actions = c.submit(6, b"", "j2", 2.1)
    assert performs(actions) == []
    assert performs(c.calculators.heartbeat(CALC, True, 2.2)) == [
        PerformTask(CALC, task2.ref, 6, b"")
    ]


def test_silent_calculator_dies_after_calculator_timeout_with_an_attempt_used():
    c = core()
    c.calculators.heartbeat(CALC, True, 0.0)
    task, _ = c.submit(5, b"", "j", 0.0)
    c.calculators.acknowledged(CALC, task.ref, 0.1)
    c.calculators.heartbeat(CALC, False, 3.0)  # still alive: due at 8
    assert c.expire(7.999) == []
    c.expire(8.0)
    assert c.task_state(task.ref) is TaskState.QUEUED and task.attempts == 1
    assert c.counters.worker_losses == {"calculator silent": 1}
    # A report that comes after it was declared dead is ignored.
    assert c.calculators.completed(CALC, 5, True, b"late", "", 8.1) == []


def test_error_report_fails_the_attempt_with_its_message():
    c = core()
    c.calculators.heartbeat(CALC, True, 0.0)
    task, _ = c.submit(5, b"", "j", 0.0)
    actions = c.calculators.completed(CALC, 5, False, b"", "bad input", 0.1)  # ack was lost
    assert task.attempts == 1 and task.last_error == "bad input"
    # Placed again: on the same calculator, the only one there is.
    assert performs(actions) == [PerformTask(CALC, task.ref, 5, b"")]


# ---------------------------------------------------------------- the door


def door() -> FrontDoor:
    return FrontDoor(
        JobBook(),
        allowed_clients=[ipaddress.ip_network("127.0.0.1/32")],
        allowed_calculators=[ipaddress.ip_network("127.0.0.9/32")],
        max_result=1000,
    )


def datagram(method: str, txid: int | None = None, **params) -> bytes:
    packet = {"method": method, "params": params, "packet_type": 0 if txid is None else 1}
    if txid is not None:
        packet["transmission_id"] = txid
    return json.dumps(packet).encode()


def test_heartbeat_from_outside_allowed_calculators_is_dropped_counted_never_answered():
    fd = door()
    assert fd.datagram(datagram("heartbeat", status="ready"), ("127.0.0.1", 9), 0.0) == []
    assert fd.datagram(datagram("completed_task", 1, task_id=1, status="success"), ("10.0.0.1", 9), 0.0) == []  # fmt: skip
    assert fd.stats.not_allowed == 2
    # and a calculator's address may not use the client methods
    assert fd.datagram(datagram("add_task", 2, task_id=1), CALC, 0.0) == []
    assert fd.stats.not_allowed == 3
    assert fd.datagram(datagram("heartbeat", status="ready"), CALC, 0.0) == [Heartbeat(CALC, True)]


def test_completed_task_acknowledged_every_copy_reported_once():
    fd = door()
    data = datagram("completed_task", 77, task_id=5, status="success", result="r")
    first = fd.datagram(data, CALC, 0.0)
    assert Completed(CALC, 5, True, b"r", "") in first
    [ack] = [a for a in first if isinstance(a, Send)]
    again = fd.datagram(data, CALC, 0.1)
    assert again == [Send(ack.data, CALC)]  # the same acknowledgement, nothing else
    bad = fd.datagram(datagram("completed_task", 78, task_id=5, status="maybe", pad="x" * 60), CALC, 0.2)  # fmt: skip
    assert json.loads(bad[0].data)["error"]["code"] == "bad_status"


def test_perform_task_repeated_until_acknowledged_or_dial_timeout():
    fd = door()
    link = CalculatorLink(dial_timeout=2.0)
    packet = json.loads(link.perform(CALC, 1, 5, b"p", 0.0))
    assert packet["method"] == "perform_task" and packet["params"] == {"task_id": 5, "payload": "p"}
    resent, _ = link.expire(0.05)
    assert [json.loads(data) for data, _ in resent] == [packet]
    ack = json.dumps(
        {"method": "ack", "packet_type": 2, "transmission_id": packet["transmission_id"]}
    )
    [heard] = fd.datagram(ack.encode(), CALC, 0.1)  # from a calculator: its side's
    assert heard == CalculatorAck(packet["transmission_id"], CALC, False)
    assert link.acked(heard) == PerformAcked(CALC, 1, False)
    assert link.acked(heard) is None  # a copy
    assert link.expire(10.0) == ([], [])
    # another one, never acknowledged
    link.perform(CALC, 2, 6, b"", 20.0)
    out: list[object] = []
    t = 20.0
    while t <= 22.5:
        again, gave_up = link.expire(t)
        out += again
        out += gave_up
        t += 0.05
    assert out[-1] == PerformUnacked(CALC, 2)
    assert sum(isinstance(a, PerformUnacked) for a in out) == 1


def test_a_calculator_reports_a_job_it_held_before_a_restart_and_keeps_it():
    c = core()
    c.recover(1, 9, b"", "j", 0.0, running=True, attempts=1, grace=3.0, lease="127.0.0.9:7000")
    c.calculators.heartbeat(CALC, False, 0.5)  # busy: still running it
    [done] = finished(c.calculators.completed(CALC, 9, True, b"kept", "", 1.0))
    assert done.state is TaskState.SUCCESS and done.result == b"kept"
    assert c.expire(10.0) == []  # nothing left to place again after the grace


def test_a_completed_task_from_another_port_is_ignored_and_counted():
    c = core()
    c.calculators.heartbeat(CALC, True, 0.0)
    forger = (CALC[0], CALC[1] + 1)
    c.calculators.heartbeat(forger, False, 0.0)  # registered too, but busy: holds nothing
    task, _ = c.submit(5, b"in", "j", 0.1)
    c.calculators.acknowledged(CALC, task.ref, 0.2)
    assert c.calculators.completed(forger, 5, True, b"FORGED", "", 0.3) == []
    assert c.calculators.ignored_reports == 1 and task.state is TaskState.RUNNING
    [done] = finished(c.calculators.completed(CALC, 5, True, b"real", "", 0.4))
    assert done.result == b"real"


def test_after_a_restart_only_the_address_perform_task_went_to_keeps_the_job():
    c = core()
    c.recover(1, 9, b"", "j", 0.0, running=True, attempts=1, grace=3.0, lease="127.0.0.9:7000")
    forger = (CALC[0], CALC[1] + 1)
    c.calculators.heartbeat(forger, False, 0.5)
    assert c.calculators.completed(forger, 9, True, b"FORGED", "", 1.0) == []
    assert c.calculators.ignored_reports == 1
    c.calculators.heartbeat(CALC, False, 1.5)
    [done] = finished(c.calculators.completed(CALC, 9, True, b"kept", "", 2.0))
    assert done.result == b"kept"


def test_the_address_a_job_is_placed_on_is_its_lease():
    c = core()
    c.calculators.heartbeat(CALC, True, 0.0)
    task, _ = c.submit(5, b"in", "j", 0.1)
    assert task.lease == "127.0.0.9:7000"


def test_garbage_from_a_calculator_is_dropped_and_counted():
    fd = door()
    for data in (b"\x00\xffgarbage", b"[1, 2]", b'{"method": "heartbeat", "packet_type": 0}'):
        assert fd.datagram(data, CALC, 0.0) == []
    assert fd.stats.unparseable == 2 and fd.stats.refused == 1  # the last: no status
    assert fd.datagram(datagram("heartbeat", status="ready"), CALC, 0.1) == [Heartbeat(CALC, True)]


def test_a_flood_of_calculator_addresses_within_forget_after_is_capped():
    c = Core(calculator_timeout=TIMEOUT, forget_remote_after=3600.0)
    for i in range(3 * MAX_REMEMBERED):  # a heartbeat each from many ports, never again
        c.calculators.heartbeat((f"127.0.{i // 60000}.9", 1024 + i % 60000), True, i / 1000)
        c.expire(i / 1000)  # the silent ones stop being workers
    assert len(c.calculators.roster) <= MAX_REMEMBERED
    assert len(c.calculators._by_addr) <= MAX_REMEMBERED
    # the live ones' pulse deadlines, and one for the roster
    assert len(c.scheduler.deadlines) < MAX_REMEMBERED
    c.expire(10_000.0)
    assert len(c.calculators.roster) == 0 and c.calculators.addresses == {}


def test_a_flood_of_silent_calculators_logs_a_count_not_a_line_each(caplog):
    c = Core(calculator_timeout=TIMEOUT, forget_remote_after=60.0)
    for port in range(2000, 3000):  # heartbeats from many ports, never again
        c.calculators.heartbeat(("127.0.0.9", port), True, 0.0)
    with caplog.at_level(logging.WARNING, logger="controller.core"):
        c.expire(TIMEOUT)
        assert c.workers == {} and c.calculators.silent_dropped == 1000
        c.calculators.heartbeat(("127.0.0.9", 9999), True, TIMEOUT + SILENT_REPORT_INTERVAL)
        c.expire(2 * TIMEOUT + SILENT_REPORT_INTERVAL)
    lines = [r.getMessage() for r in caplog.records if "silent" in r.getMessage()]
    assert lines == [
        "calculator 127.0.0.9:2000 silent for calculator_timeout; dropping it",
        "1000 idle calculators silent for calculator_timeout dropped since the last report "
        "(the latest 127.0.0.9:9999)",
    ]


def test_calculator_addresses_are_forgotten_after_silence():
    c = Core(calculator_timeout=TIMEOUT, forget_remote_after=60.0)
    for port in range(2000, 3000):
        c.calculators.heartbeat(("127.0.0.9", port), True, 0.0)
    assert len(c.calculators.roster) == 1000
    c.expire(TIMEOUT)  # silent: dropped as workers, still known by address
    assert c.workers == {} and len(c.calculators.roster) == 1000
    c.expire(59.999)
    assert len(c.calculators.roster) == 1000
    c.expire(60.0)
    assert len(c.calculators.roster) == 0 and c.calculators.addresses == {}
    assert c.calculators.names == {} and c.calculators._by_addr == {}


def test_a_calculators_done_count_survives_a_timeout():
    c = core()
    c.calculators.heartbeat(CALC, True, 0.0)
    c.submit(5, b"in", "j", 0.1)
    c.calculators.completed(CALC, 5, True, b"out", "", 0.2)
    c.expire(TIMEOUT + 1)  # silent: dropped
    c.calculators.heartbeat(CALC, True, TIMEOUT + 2)
    workers: Any = c.status(TIMEOUT + 2)["workers"]
    assert [row["done"] for row in workers] == [1]

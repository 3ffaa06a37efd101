"""What workers declare (queues and labels): read on both sides, stored, and shown."""

from __future__ import annotations

import ipaddress
import json
from typing import Any

import pytest

from controller import declared
from controller.client.udp_output import format_status
from controller.core import Core, PulseReceived, Reply
from controller.doors.http.codec import ApiError, parse_declared
from controller.doors.http.console.pages import workers_table
from controller.doors.http.console.views import worker_data
from controller.doors.udp.calclink import Heartbeat
from controller.doors.udp.codec import FrontDoor, fit_status
from controller.jobs import JobBook
from gen import worker_protocol_pb2 as pb
from worker.core import WorkerSession
from worker.main import build_parser, check_arguments

CALC = ("127.0.0.9", 7000)
LONGEST = "x" * 64


# ---------------------------------------------------------------- reading a declaration


def test_nothing_declared_serves_default_with_no_labels_and_shares_one_record():
    assert declared.read() is declared.DEFAULT
    assert declared.read([], "") is declared.DEFAULT
    assert declared.read(["default"], []) is declared.DEFAULT
    assert declared.Declared(frozenset({"default"}), frozenset()) == declared.DEFAULT


@pytest.mark.parametrize(
    ("queues", "labels", "expected_queues", "expected_labels"),
    [
        ("a,b", "gpu,ssd", {"a", "b"}, {"gpu", "ssd"}),
        (" a , b ,a", "", {"a", "b"}, set()),
        (["q.1", "q_2", "q-3"], ["gpu"], {"q.1", "q_2", "q-3"}, {"gpu"}),
        ([], ["gpu"], {"default"}, {"gpu"}),  # labels alone: it still serves default
        ([LONGEST], [LONGEST], {LONGEST}, {LONGEST}),
    ],
)
def test_a_declaration_reads_lists_or_comma_separated_text(
    queues, labels, expected_queues, expected_labels
):
    got = declared.read(queues, labels)
    assert got.queues == expected_queues and got.labels == expected_labels


@pytest.mark.parametrize(
    ("queues", "labels", "said"),
    [
        ("Upper", "", "queues: a name must match [a-z0-9_.-]{1,64}, got 'Upper'"),
        ("a,,b", "", "got ''"),
        ("a", "gpu ssd", "labels: a name must match"),
        ("x" * 65, "", "queues: a name must match"),
        ("caf\u00e9", "", "a name must match"),
        ([1], [], "got 1"),
        (["a"], [None], "labels: a name must match"),
        ({"a": 1}, [], "queues: a list of names is wanted, got dict"),
        ([], 7, "labels: a list of names is wanted, got int"),
        ([f"q{n}" for n in range(33)], [], "queues: at most 32 names, got 33"),
        ([], ",".join(f"l{n}" for n in range(33)), "labels: at most 32 names, got 33"),
        ("a," * 5000, "", "queues: more than 2112 characters"),
        (
            [f"{n:02d}".ljust(64, "q") for n in range(32)],
            ["one"],
            "queues and labels: 2051 characters of names, more than 2048",
        ),
    ],
)
def test_a_bad_declaration_is_refused_naming_the_list_and_why(queues, labels, said):
    with pytest.raises(declared.BadDeclaration) as caught:
        declared.read(queues, labels)
    assert said in str(caught.value)


def test_shown_lists_are_sorted_and_cut_at_a_name():
    assert declared.shown(frozenset({"b", "a"})) == "a,b"
    assert declared.shown(frozenset()) == ""
    assert declared.shown(frozenset({"a" * 30, "b" * 30}), 40) == "a" * 30 + ",..."
    assert declared.shown(frozenset({"a" * 50}), 40) == "a" * 37 + "..."
    assert declared.shown(frozenset({"gpu", "ssd"}), 40) == "gpu,ssd"


# ---------------------------------------------------------------- local workers


def register(core: Core, msg: pb.WorkerPulse) -> pb.PulseResponse:
    [reply, *_] = core.handle(PulseReceived(msg, pid=None, uid=1000), 0.0)
    assert isinstance(reply, Reply)
    return reply.response


def test_the_worker_session_declares_in_register_only():
    session = WorkerSession(declared.read("b,a", "gpu"))
    msg = session.register(2)
    assert msg.type == pb.PULSE_REGISTER and msg.next_pulse == 2
    assert list(msg.queues) == ["a", "b"] and list(msg.labels) == ["gpu"]
    session.worker_id = 4
    pulse = session.pulse(2)
    assert list(pulse.queues) == [] and list(pulse.labels) == []
    assert list(WorkerSession().register(2).queues) == ["default"]


def test_register_sets_the_workers_queues_and_labels():
    core = Core()
    resp = register(
        core,
        pb.WorkerPulse(type=pb.PULSE_REGISTER, next_pulse=2, queues=["a", "b"], labels=["gpu"]),
    )
    assert resp.error == pb.CTRL_ERR_OK
    worker = core.workers[resp.worker_id]
    assert worker.queues == {"a", "b"} and worker.labels == {"gpu"}


def test_an_old_workers_register_serves_default_with_no_labels():
    core = Core()
    old = pb.WorkerPulse.FromString(b"\x20\x02")  # fields 1-4 only, as before the new ones
    resp = register(core, old)
    assert resp.error == pb.CTRL_ERR_OK
    worker = core.workers[resp.worker_id]
    assert worker.queues == {"default"} and worker.labels == frozenset()


@pytest.mark.parametrize(
    ("queues", "labels"),
    [
        (["Bad"], []),
        ([""], []),
        ([], ["x" * 65]),
        ([f"q{n}" for n in range(33)], []),
        ([], ["l"] * 33),
        ([f"{n:02d}".ljust(64, "q") for n in range(32)], ["one"]),
    ],
)
def test_a_register_with_a_bad_declaration_is_refused_and_registers_nothing(queues, labels):
    core = Core()
    msg = pb.WorkerPulse(type=pb.PULSE_REGISTER, next_pulse=2, queues=queues, labels=labels)
    resp = register(core, msg)
    assert resp.error == pb.CTRL_ERR_FAILED and not resp.HasField("worker_id")
    assert core.workers == {} and core.counters.registered == 0
    good = register(core, pb.WorkerPulse(type=pb.PULSE_REGISTER, next_pulse=2))
    assert good.worker_id == 1  # the refusal used no worker id


def test_pulses_other_than_register_change_nothing_declared():
    core = Core()
    wid = register(
        core, pb.WorkerPulse(type=pb.PULSE_REGISTER, next_pulse=2, queues=["a"])
    ).worker_id
    msg = pb.WorkerPulse(type=pb.PULSE_OK, worker_id=wid, next_pulse=2, queues=["zzz"])
    core.handle(PulseReceived(msg, pid=None, uid=1000), 0.5)
    assert core.workers[wid].queues == {"a"}


# ---------------------------------------------------------------- calculators


def door() -> FrontDoor:
    return FrontDoor(
        JobBook(),
        allowed_clients=[ipaddress.ip_network("127.0.0.1/32")],
        allowed_calculators=[ipaddress.ip_network("127.0.0.9/32")],
        max_result=1000,
    )


def heartbeat(**params) -> bytes:
    return json.dumps({"method": "heartbeat", "packet_type": 0, "params": params}).encode()


def test_a_heartbeat_carries_the_calculators_declaration():
    fd = door()
    [beat] = fd.datagram(heartbeat(status="ready", queues=["a", "b"], labels=["gpu"]), CALC, 0)
    assert beat == Heartbeat(CALC, True, declared.read(["a", "b"], ["gpu"]))
    [older] = fd.datagram(heartbeat(status="busy"), CALC, 0.1)  # a calculator that says none
    assert older == Heartbeat(CALC, False, declared.DEFAULT)


@pytest.mark.parametrize(
    ("params", "code"),
    [
        ({"queues": ["Bad"]}, "bad_queues"),
        ({"queues": "default", "labels": [f"l{n}" for n in range(33)]}, "bad_labels"),
        ({"queues": {"a": 1}}, "bad_queues"),
        ({"labels": [None]}, "bad_labels"),
        # over the characters of both lists together
        ({"queues": [f"{n:02d}".ljust(64, "q") for n in range(32)], "labels": ["x"]}, "bad_labels"),
    ],
)
def test_a_heartbeat_with_a_bad_declaration_is_dropped_and_counted(params, code):
    fd = door()
    assert fd.datagram(heartbeat(status="ready", **params), CALC, 0.0) == []
    assert fd.stats.refused == 1 and fd.stats.by_code == {code: 1}


def test_the_latest_heartbeat_says_what_a_calculator_serves():
    core = Core(calculator_timeout=5.0)
    core.calculators.heartbeat(CALC, True, 0.0, declared.read("a", "gpu"))
    [worker] = core.workers.values()
    assert worker.queues == {"a"} and worker.labels == {"gpu"}
    core.calculators.heartbeat(CALC, True, 1.0, declared.read("b", ""))
    assert core.workers == {worker.worker_id: worker}
    assert worker.queues == {"b"} and worker.labels == frozenset()
    core.calculators.heartbeat(CALC, True, 2.0)
    assert worker.queues == {"default"}


# ---------------------------------------------------------------- pollers


def test_a_ping_says_what_a_poller_serves_and_a_later_one_updates_it():
    core = Core()
    core.pollers.ping("p1", 0.0, declared.read("a,b", "gpu"))
    [worker] = core.workers.values()
    assert worker.queues == {"a", "b"} and worker.labels == {"gpu"}
    core.pollers.ping("p1", 1.0, declared.read("c", ""))
    assert worker.queues == {"c"} and worker.labels == frozenset()
    core.pollers.ping("p2", 1.0)
    assert {w.worker_id: w.queues for w in core.workers.values()}[
        core.pollers.roster.ids["p2"]
    ] == {"default"}


def test_pings_query_is_read_and_a_bad_one_is_400():
    assert parse_declared({"worker": "p"}) is declared.DEFAULT
    assert parse_declared({"queues": "a,b", "labels": "gpu"}) == declared.read("a,b", "gpu")
    assert parse_declared({"queues": "", "labels": ""}) is declared.DEFAULT
    with pytest.raises(ApiError) as caught:
        parse_declared({"queues": "a,B"})
    assert caught.value.status == 400 and "queues: a name must match" in str(caught.value)
    with pytest.raises(ApiError):
        parse_declared({"labels": ",".join(f"l{n}" for n in range(33))})


# ---------------------------------------------------------------- the worker command


def test_worker_queues_default_to_default_and_labels_to_none():
    args = build_parser().parse_args([])
    assert args.queues == ("default",) and args.labels == ()
    args = build_parser().parse_args(["--queues", "a, b,a", "--labels", "gpu"])
    assert args.queues == ("a", "b") and args.labels == ("gpu",)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--queues", "Bad"], "argument --queues: a name must match [a-z0-9_.-]{1,64}, got 'Bad'"),
        (["--labels", "a b"], "argument --labels: a name must match"),
        (["--queues", ""], "argument --queues: give at least one queue"),
        (["--labels", ",".join(f"l{n}" for n in range(33))], "at most 32 names, got 33"),
        (
            ["--queues", ",".join(f"{n:02d}".ljust(64, "q") for n in range(32)), "--labels", "x"],
            "arguments --queues and --labels: 2049 characters of names, more than 2048",
        ),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_worker_arguments_are_named_before_any_worker_starts(argv, said):
    assert said in (check_arguments(argv) or "")


def test_good_worker_arguments_pass_the_check(capsys):
    assert check_arguments(["--queues", "a", "--labels", "", "--exec", "cat", "--x"]) is None
    assert check_arguments(["--help"]) is None
    assert "--queues" in capsys.readouterr().out


# ---------------------------------------------------------------- shown


def test_status_report_page_and_udp_client_show_queues_and_labels():
    core = Core()
    register(
        core,
        pb.WorkerPulse(type=pb.PULSE_REGISTER, next_pulse=2, queues=["gpu.q"], labels=["cuda"]),
    )
    core.pollers.ping("p1", 0.0, declared.read([f"q{n:02d}" for n in range(32)], ""))
    report: dict[str, Any] = core.status(1.0)
    local, poller = report["workers"]
    assert (local["queues"], local["labels"]) == ("gpu.q", "cuda")
    assert poller["labels"] == "" and poller["queues"].endswith(",...")
    assert len(poller["queues"]) <= 40
    assert fit_status(report, 1100) is report and len(json.dumps(report)) < 1200
    text = format_status(report)
    assert "queues / labels" in text and "gpu.q / cuda" in text and "q00,q01" in text
    page = workers_table(*worker_data(core, 1.0))
    assert "<th>queues</th><th>labels</th>" in page
    assert "<td>gpu.q</td><td>cuda</td>" in page and "<td>q00,q01," in page

"""Progress (DESIGN.md section 17): what a running job reports, from every worker kind, shown
as the job object's `progress` and `status` and by `jobctl show`; hostile reports refused or
clamped. Real controllers and workers (tests/test_output.py's manner)."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from controller import datagram as dg
from controller.progress import MAX_STATUS, check_http, clean
from gen import worker_protocol_pb2 as pb
from tests.fakes import FakeController
from tests.helpers import (
    exchange,
    live_controller,
    logged_process,
    reap,
    remote_worker_argv,
    wait_for_condition,
    wait_until,
    worker_argv,
)
from tests.test_http import http_controller
from worker.progress import SEND_SECONDS, ProgressLines, Reporter, checked, parse_line


def _call(url: str, method: str = "GET", body: Any = None, raw: bytes | None = None) -> Any:
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, method=method)
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=30) as resp:
        return json.loads(resp.read())


def _status(url: str, method: str, body: Any = None, raw: bytes | None = None) -> int:
    try:
        _call(url, method, body, raw)
    except urllib.error.HTTPError as exc:
        assert json.loads(exc.read())["code"] == exc.code
        return exc.code
    return 200


def _job(url: str, job_id: str) -> dict[str, Any]:
    return dict(_call(f"{url}/job/{job_id}/"))


def _reports_then_ends(
    url: str, tmp: Path, job_id: str, first: tuple[float, str], last: tuple[float, str]
) -> None:
    """Submit a job whose payload names a gate file; see `first` while it runs, open the
    gate, and see `last` kept once it finished."""
    gate = tmp / f"gate-{job_id}"
    _call(f"{url}/job/", "POST", {"id": job_id, "payload": str(gate)})
    wait_for_condition(
        lambda: (_job(url, job_id)["progress"], _job(url, job_id)["status"]) == first, 20
    )
    assert _job(url, job_id)["state"] in ("requested", "working")
    gate.touch()
    done = _call(f"{url}/job/{job_id}/?wait=20")
    assert done["state"] == "finished", done
    assert (done["progress"], done["status"]) == last


# A command reporting through JOB_PROGRESS_FD: a good line, bad ones (ignored), and past the
# gate (its payload) a number over 1, clamped.
SCRIPT = (
    'read gate; printf "progress 0.4 copying files\\nnot progress\\nprogress nan x\\n'
    'progress\\n" >&"$JOB_PROGRESS_FD"; while [ ! -e "$gate" ]; do sleep 0.02; done; '
    'echo "progress 7 past the end" >&"$JOB_PROGRESS_FD"; echo ok'
)


@pytest.mark.parametrize("handler", ["progressing", "aprogressing"])
@pytest.mark.parametrize("seed", [False, True], ids=["channel", "seed-protocol"])
def test_a_handler_reports_progress_on_either_exchange(
    tmp_path: Path, handler: str, seed: bool
) -> None:
    with live_controller(tmp_path) as ctl:
        flags = ["--seed-protocol"] if seed else []
        argv = worker_argv(tmp_path / "s", *flags, "--handler", f"tests.worker_handlers:{handler}")
        with logged_process(argv, tmp_path / "worker.log"):
            _reports_then_ends(ctl.url, tmp_path, "h", (0.25, "started"), (0.75, "almost"))
            # A job that reports nothing shows none; the next attempt does not show the last.
            other = _call(f"{ctl.url}/job/", "POST", {"id": "n", "payload": str(tmp_path / "g2")})
            assert other["progress"] is None and other["status"] is None
            # It ends, so that the worker leaves at once when it is stopped.
            (tmp_path / "g2").touch()
            assert _call(f"{ctl.url}/job/n/?wait=20")["state"] == "finished"


def test_an_exec_command_writes_progress_lines_to_job_progress_fd(tmp_path: Path) -> None:
    args = ("--workers", "1", "--", "--exec", "sh", "-c", SCRIPT)
    with live_controller(tmp_path, *args) as ctl:
        _reports_then_ends(ctl.url, tmp_path, "e", (0.4, "copying files"), (1.0, "past the end"))
        # jobctl show shows it.
        shown = subprocess.run(
            [sys.executable, "-m", "controller.client.jobctl", "--url", ctl.url, "show", "e"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        assert any(line.split() == ["progress", "100%"] for line in shown.splitlines()), shown
        assert any(line.split() == ["status", "past", "the", "end"] for line in shown.splitlines())


def test_a_calculator_sends_progress_in_its_busy_heartbeats(tmp_path: Path) -> None:
    with live_controller(tmp_path, allowed_calculators=["127.0.0.0/8"]) as ctl:
        argv = remote_worker_argv(
            "--udp", f"127.0.0.1:{ctl.udp_port}", "--pulse", "0.1", "--exec", "sh", "-c", SCRIPT
        )
        with logged_process(argv, tmp_path / "calculator.log"):
            _reports_then_ends(
                ctl.url, tmp_path, "c", (0.4, "copying files"), (0.4, "copying files")
            )


def test_a_hostile_heartbeat_progress_is_dropped_and_the_calculator_lives(tmp_path: Path) -> None:
    with (
        live_controller(tmp_path, allowed_calculators=["127.0.0.0/8"]) as ctl,
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock,
    ):
        sock.connect(("127.0.0.1", ctl.udp_port))
        sock.settimeout(5)
        for bad in ("x", None, [1], {"a": 1}, 1e308 * 10, True):
            params = {"status": "busy", "progress": bad, "progress_status": 5}
            sock.send(dg.request("heartbeat", params, 1))
        sock.send(dg.request("heartbeat", {"status": "ready"}, 2))
        _call(f"{ctl.url}/job/", "POST", {"id": "for-calc", "payload": "p"})
        # The calculator is alive and gets the job (after the heartbeats' acks).
        while b"perform_task" not in sock.recv(65536):
            pass


def test_a_poller_sends_progress_in_its_lease_put(tmp_path: Path) -> None:
    with live_controller(tmp_path) as ctl:
        argv = remote_worker_argv("--hub", ctl.url, "--pulse", "0.1", "--exec", "sh", "-c", SCRIPT)
        with logged_process(argv, tmp_path / "poller.log"):
            _reports_then_ends(
                ctl.url, tmp_path, "p", (0.4, "copying files"), (1.0, "past the end")
            )


def test_hostile_progress_in_a_put_is_400_and_the_holder_alone_reports(tmp_path: Path) -> None:
    with live_controller(tmp_path) as ctl:
        _call(f"{ctl.url}/job/", "POST", {"id": "j"})
        job = _call(f"{ctl.url}/ping/?worker=w1&wait=5")
        path = f"{ctl.url}/job/j/"
        base = {"state": "working", "worker": "w1", "lease": job["lease"]}
        for bad in ("0.5", -0.1, 1.01, True, None, [0.5], 1e400):
            assert _status(path, "PUT", {**base, "progress": bad}) == 400, bad
        assert (
            _status(path, "PUT", raw=json.dumps(base).encode()[:-1] + b', "progress": NaN}') == 400
        )
        assert _status(path, "PUT", {**base, "progress": 0.5, "status": 3}) == 400
        assert _status(path, "PUT", {**base, "progress": 0.5, "status": "x" * 201}) == 400
        assert _status(path, "PUT", {**base, "status": "no progress"}) == 400
        assert _status(path, "PUT", {"state": "working", "progress": 0.5}) == 400  # no worker
        assert _job(ctl.url, "j")["progress"] is None
        other = {**base, "worker": "w2", "progress": 0.9}
        assert _status(path, "PUT", other) == 409  # not the holder
        assert _status(path, "PUT", {**base, "progress": 1, "status": "x" * 200}) == 200
        assert (_job(ctl.url, "j")["progress"], _job(ctl.url, "j")["status"]) == (1.0, "x" * 200)
        assert _status(path, "PUT", {**base, "state": "finished", "progress": 0}) == 200
        assert _job(ctl.url, "j")["progress"] == 0.0  # with its end: kept
        assert _status(path, "PUT", {**base, "progress": 0.3}) == 409  # ended: no more


def test_the_controller_cleans_what_the_worker_wire_and_heartbeats_carry() -> None:
    assert clean(0.5, "ok") == (0.5, "ok")
    assert clean(-3, "") == (0.0, "")
    assert clean(7, "") == (1.0, "")
    for bad in (math.nan, math.inf, -math.inf, "0.5", None, True, [1]):
        assert clean(bad, "s") is None
    assert clean(0.5, "a\nb\x00" + "x" * 500) == (0.5, "a b " + "x" * (MAX_STATUS - 4))
    assert clean(0.5, 12) == (0.5, "")
    assert check_http(0.5, "s") is None
    assert check_http(2, "") is not None and check_http(0.5, "x" * 201) is not None


def test_the_worker_keeps_the_latest_value_and_reads_lines() -> None:
    woken: list[int] = []
    reporter = Reporter(lambda: woken.append(1))
    for step in range(1000):
        reporter.set(step / 1000, "")
    assert woken == [1]  # once, for the first: the owner sends at most a few a second
    assert reporter.take() == (0.999, "") and reporter.take() is None
    assert parse_line(b"progress 0.4 copying files") == (0.4, "copying files")
    assert parse_line(b"  progress   1e-1  ") == (0.1, "")
    for bad in (b"progress", b"progress x", b"progress inf", b"Progress 0.1", b"\xff", b"p 1"):
        assert parse_line(bad) is None
    with pytest.raises(ValueError):
        checked(math.nan)
    seen: list[tuple[float, str]] = []
    lines = ProgressLines(lambda p, s: seen.append((p, s)))
    lines.feed(b"progress 0.1 a\nprogress 0.2 b\nprog")
    lines.feed(b"ress 0.3 c\n" + b"y" * 5000)
    lines.feed(b"\nprogress 0.4 d\n")
    assert seen == [(0.2, "b"), (0.3, "c"), (0.4, "d")]


# Four bursts of 3,000 progress lines as fast as the shell writes them, 0.3 s apart, then a
# last one, then the result.
FLOOD = (
    "for b in 1 2 3 4; do i=0; while [ $i -lt 3000 ]; do "
    'echo "progress 0.$i flood"; i=$((i+1)); done; sleep 0.3; done '
    '>&"$JOB_PROGRESS_FD"; echo "progress 0.99 last" >&"$JOB_PROGRESS_FD"; cat'
)


def _spawn(argv: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv)


@pytest.mark.parametrize("takes", [True, False], ids=["takes-progress", "older-controller"])
async def test_a_flood_of_progress_is_a_few_pulses_a_second_and_its_last_goes_first(
    tmp_path: Path, takes: bool
) -> None:
    sockdir = tmp_path / "s"
    sockdir.mkdir()
    fake = FakeController(sockdir, takes_progress=takes)
    proc = _spawn(worker_argv(sockdir, "--pulse", "30", "--exec", "sh", "-c", FLOOD))
    try:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                await nursery.start(fake.serve)
                await fake.wait_for(lambda: bool(fake.of_type(pb.PULSE_OK)))
                started = trio.current_time()
                task = pb.ControlMsg(type=pb.CTRL_SET_TASK, task_id=7)
                resp, _ = await fake.control(1, task, b"result")
                assert resp.error == pb.WORKER_ERR_OK
                await fake.wait_for(lambda: bool(fake.of_type(pb.PULSE_FETCH_ME)))
                took = trio.current_time() - started
                resp, extra = await fake.control(1, pb.ControlMsg(type=pb.CTRL_FETCH))
                assert (resp.error, extra) == (pb.WORKER_ERR_OK, b"result")
                sent = fake.of_type(pb.PULSE_PROGRESS)
                if not takes:
                    assert sent == []
                else:
                    assert 3 <= len(sent) <= took / SEND_SECONDS + 2
                    assert (sent[-1].task_id, sent[-1].status) == (7, "last")
                    assert sent[-1].progress == pytest.approx(0.99)
                    # The last progress is answered before the outcome is announced.
                    order = [p.type for _, p in fake.pulses]
                    assert order.index(pb.PULSE_FETCH_ME) > len(order) - 1 - order[::-1].index(
                        pb.PULSE_PROGRESS
                    )
                nursery.cancel_scope.cancel()
    finally:
        reap(proc)


async def test_hostile_progress_pulses_on_main_sock_are_cleaned_and_answered(
    tmp_path: Path,
) -> None:
    sockdir = tmp_path / "s"
    sockdir.mkdir()
    handler = "tests.worker_handlers:progressing"
    gate = tmp_path / "gate"
    async with (
        http_controller(sockdir, workers=1, handler=handler) as ctl,
        httpx.AsyncClient(base_url=ctl.url, timeout=30) as http,
    ):
        await http.post("/job/", json={"id": "j", "payload": str(gate)})
        held = ctl.desk.book.get("j")
        assert held is not None
        await wait_until(lambda: (held.progress, held.progress_status) == (0.25, "started"))
        worker = int((await http.get("/job/j/")).json()["worker"])

        async def pulse(**fields: Any) -> int:
            msg = pb.WorkerPulse(type=pb.PULSE_PROGRESS, worker_id=worker, **fields)
            resp, _ = await exchange(sockdir / "main.sock", msg, pb.PulseResponse)
            return int(resp.error)

        task_id = held.task_id
        assert await pulse(task_id=task_id, progress=math.nan, status="nan") == 0
        assert await pulse(task_id=task_id, progress=math.inf) == 0
        assert (held.progress, held.progress_status) == (0.25, "started")  # dropped
        assert await pulse(task_id=task_id + 1, progress=0.5) == 0  # not its job
        assert (held.progress, held.progress_status) == (0.25, "started")
        assert await pulse(task_id=task_id, progress=5.0, status="\x00" + "y" * 999) == 0
        assert (held.progress, held.progress_status) == (1.0, " " + "y" * (MAX_STATUS - 1))
        assert await pulse(task_id=task_id, progress=-2.0) == 0
        assert (held.progress, held.progress_status) == (0.0, "")
        # Each progress kept is an event of GET /events/, carrying it; a dropped one is none.
        changes = [c for c in ctl.web.events.ring if c[1] == "j"]
        assert [c[4] for c in changes][-3:] == [0.25, 1.0, 0.0]
        msg = pb.WorkerPulse(type=pb.PULSE_PROGRESS, worker_id=worker + 99, progress=0.5)
        resp, _ = await exchange(sockdir / "main.sock", msg, pb.PulseResponse)
        assert resp.error == pb.CTRL_ERR_UNKNOWN_ID
        gate.touch()
        done = (await http.get("/job/j/", params={"wait": 10})).json()
        assert (done["state"], done["progress"], done["status"]) == ("finished", 0.75, "almost")


@pytest.mark.parametrize("kind", ["--hub", "--udp"])
def test_a_remote_workers_handler_reports_progress(tmp_path: Path, kind: str) -> None:
    with live_controller(tmp_path, allowed_calculators=["127.0.0.0/8"]) as ctl:
        where = ctl.url if kind == "--hub" else f"127.0.0.1:{ctl.udp_port}"
        handler = "tests.worker_handlers:progressing"
        argv = remote_worker_argv(kind, where, "--pulse", "0.1", "--handler", handler)
        with logged_process(argv, tmp_path / "remote.log"):
            # A calculator's last report is its last busy heartbeat's: 0.75 or an earlier one.
            last = (0.75, "almost") if kind == "--hub" else None
            gate = tmp_path / "gate-r"
            _call(f"{ctl.url}/job/", "POST", {"id": "r", "payload": str(gate)})
            wait_for_condition(lambda: _job(ctl.url, "r")["status"] == "started", 20)
            assert _job(ctl.url, "r")["progress"] == 0.25
            gate.touch()
            done = _call(f"{ctl.url}/job/r/?wait=20")
            assert done["state"] == "finished" and done["progress"] is not None
            if last is not None:
                assert (done["progress"], done["status"]) == last

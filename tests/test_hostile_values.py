"""Hostile values, second round: times a job may wait (`delay`, `run_at`) and the other job
options on every door, times an older journal kept, error acknowledgements, the UDP door's
answer memory, the worker a waiting job names, and the caps on local workers' REGISTER.

The pure parts are fuzzed with hypothesis; the doors are proven end to end on a real
controller (tests/helpers.live_controller) with a real worker, and a real redis-server
when there is one."""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import json
import logging
import math
import os
import socket
import sqlite3
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import trio
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from controller import datagram as dg
from controller import options
from controller.client import jobctl_tables
from controller.core import Core, PulseReceived, Reply
from controller.core.local import MAX_LOCAL_WORKERS, MAX_NEXT_PULSE
from controller.core.model import TaskState
from controller.jobs import Job
from controller.transmissions import SEEN_OVERHEAD, Seen
from gen import worker_protocol_pb2 as pb
from tests.helpers import (
    REDIS_SERVER,
    LiveController,
    exchange,
    live_controller,
    redis_server,
    running_controller,
    wait_for_condition,
)

NOW = 1_800_000_000.0  # a wall-clock time in 2027
TEN_YEARS = 3650 * 86400
POISON = "9999-12-31T23:59:59-23:59"  # year 10000 in UTC
# What a journal written by an older version may hold for such a job's run_at.
OLD_POISON_WALL = 253402387140.0

# Values of every JSON kind a door may carry for an option, and numbers of any size.
NUMBERS = (
    st.integers()
    | st.integers(min_value=10**15, max_value=10**400)
    | st.integers(min_value=-(10**400), max_value=-(10**15))
    | st.floats()  # NaN and the infinities included
    | st.sampled_from([TEN_YEARS, TEN_YEARS + 1, TEN_YEARS - 0.5, 1e308, -0.0, 2**63])
)
TIME_TEXT = (
    st.text(max_size=40)
    | st.datetimes(
        min_value=dt.datetime(1, 1, 2),
        max_value=dt.datetime(9999, 12, 30),
        timezones=st.timezones(),
    ).map(dt.datetime.isoformat)
    | st.builds(
        lambda year, offset: f"{year:04d}-12-31T23:59:59{offset}",
        st.integers(min_value=1, max_value=9999),
        st.sampled_from(["Z", "-23:59", "+23:59", "+00:00", "", "+24:00"]),
    )
    | st.sampled_from([POISON, "0001-01-01T00:00:00+23:59", "nan", "inf", "1e400", " 5 "])
)
ANY_VALUE = (
    NUMBERS
    | TIME_TEXT
    | st.none()
    | st.booleans()
    | st.lists(st.text(max_size=5), max_size=3)
    | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)
)


def is_time_text(text: str) -> bool:
    """`text` reads back as an RFC 3339 time."""
    return dt.datetime.fromisoformat(text).tzinfo is not None


def check_shown(chosen: options.JobOptions, now_wall: float) -> None:
    """Options a door accepted can be shown, journaled and read back."""
    if chosen.run_at is not None:
        assert now_wall <= chosen.run_at <= now_wall + options.MAX_SECONDS
    shown = options.as_fields(chosen)
    json.dumps(shown, allow_nan=False)
    if shown["run_at"] is not None:
        assert is_time_text(shown["run_at"])
    kept = options.from_json(options.to_json(chosen), options.DEFAULT)
    assert kept == chosen


# ---------------------------------------------------------------- options: the shared reader


@pytest.mark.parametrize("text", [False, True])
def test_times_past_ten_years_and_numbers_that_are_no_time_are_bad_options(text: bool) -> None:
    def refused(**fields: Any) -> bool:
        if text:
            fields = {k: v if isinstance(v, str) else repr(v) for k, v in fields.items()}
        try:
            options.parse(fields, options.DEFAULT, NOW, text=text)
        except options.BadOption as exc:
            assert str(exc)
            return True
        return False

    ahead = dt.datetime.fromtimestamp(NOW + TEN_YEARS + 1, dt.UTC).isoformat()
    assert refused(run_at=POISON)
    assert refused(run_at=ahead)
    assert not refused(run_at=dt.datetime.fromtimestamp(NOW + TEN_YEARS, dt.UTC).isoformat())
    assert not refused(run_at="0001-01-01T00:00:00+23:59")  # the past: now
    assert refused(delay=TEN_YEARS + 1)
    assert not refused(delay=TEN_YEARS)
    for bad in (math.nan, math.inf, -math.inf, 1e400, 10**400, -(10**400), 1e308):
        for name in ("delay", "timeout", "placement_timeout", "retry_delay"):
            assert refused(**{name: bad}), (name, bad)
        for name in ("priority", "max_retries"):
            assert refused(**{name: bad}), (name, bad)


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(options.OPTIONS),
    value=ANY_VALUE,
    text=st.booleans(),
)
@example(name="run_at", value=POISON, text=False)
@example(name="delay", value=10**400, text=False)
@example(name="priority", value=10**4000, text=False)
def test_any_option_value_is_refused_or_makes_options_that_show(
    name: str, value: Any, text: bool
) -> None:
    if text and not isinstance(value, str):
        value = json.dumps(value) if not isinstance(value, float) else repr(value)
    try:
        chosen = options.parse({name: value}, options.DEFAULT, NOW, text=text)
    except options.BadOption as exc:
        assert str(exc) and len(str(exc)) < 300
        return
    check_shown(chosen, NOW)


@settings(max_examples=300, deadline=None)
@given(value=TIME_TEXT | NUMBERS)
def test_any_run_at_or_delay_is_refused_or_within_ten_years(value: Any) -> None:
    for name in ("run_at", "delay"):
        try:
            chosen = options.parse({name: value}, options.DEFAULT, NOW)
        except options.BadOption:
            continue
        check_shown(chosen, NOW)


@given(wall=st.floats() | st.sampled_from([OLD_POISON_WALL, -1e300, 1e300, 253402300799.9999]))
def test_rfc3339_shows_any_wall_clock_number_as_a_time(wall: float) -> None:
    shown = options.rfc3339(wall)
    assert shown.endswith("Z") and is_time_text(shown)


def test_rfc3339_is_unchanged_within_the_years_a_date_shows() -> None:
    assert options.rfc3339(0) == "1970-01-01T00:00:00.000000Z"
    assert options.rfc3339(NOW + 0.25) == "2027-01-15T08:00:00.250000Z"
    assert options.rfc3339(OLD_POISON_WALL) == "9999-12-31T23:59:59.999999Z"


def test_options_an_older_journal_kept_beyond_the_years_still_show() -> None:
    kept = options.from_json(json.dumps({"run_at": OLD_POISON_WALL}), options.DEFAULT)
    assert options.as_fields(kept)["run_at"] == "9999-12-31T23:59:59.999999Z"


@pytest.fixture
def far_zone() -> Iterator[None]:
    """The local zone 14 hours ahead (jobctl prints times in it)."""
    before = os.environ.get("TZ")
    os.environ["TZ"] = "Etc/GMT-14"
    time.tzset()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TZ", None)
        else:
            os.environ["TZ"] = before
        time.tzset()


def test_jobctl_prints_times_at_the_ends_of_the_years(far_zone: None) -> None:
    last = options.rfc3339(OLD_POISON_WALL)
    assert jobctl_tables.when(last) == last  # beyond what the local zone can show: as given
    assert jobctl_tables.when("2027-01-15T08:00:00Z") == "2027-01-15"


# ---------------------------------------------------------------- error acknowledgements


@settings(max_examples=300, deadline=None)
@given(
    txid=st.integers(min_value=0, max_value=2**70),
    code=st.sampled_from(["bad_option", "unknown_task", "internal", "x"]),
    message=st.text(max_size=300) | st.text(alphabet="é\ud800x", max_size=300),
    limit=st.integers(min_value=0, max_value=600),
)
def test_an_error_ack_has_a_message_or_is_silence(
    txid: int, code: str, message: str, limit: int
) -> None:
    reply = dg.error_ack(txid, code, message, limit)
    one_char = dg.encode(
        {
            "method": "ack",
            "packet_type": dg.IS_ACK,
            "transmission_id": txid,
            "error": {"code": code, "message": (message or code)[:1]},
        }
    )
    if reply is None:
        assert len(one_char) > limit
        return
    assert len(reply) <= limit
    error = json.loads(reply)["error"]
    assert error["code"] == code and error["message"]
    assert (message or code).startswith(error["message"])


# ---------------------------------------------------------------- local workers' REGISTER


def register(core: Core, pid: int, next_pulse: int = 2) -> int:
    msg = pb.WorkerPulse(type=pb.PULSE_REGISTER, next_pulse=next_pulse)
    reply = core.handle(PulseReceived(msg, pid=pid, uid=1000), 0.0)[0]
    assert isinstance(reply, Reply)
    return int(reply.response.error)


def test_register_past_4096_workers_or_an_hour_of_silence_is_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    core = Core()
    assert register(core, 7, next_pulse=MAX_NEXT_PULSE + 1) == pb.CTRL_ERR_FAILED
    assert register(core, 8, next_pulse=MAX_NEXT_PULSE) == pb.CTRL_ERR_OK
    for pid in range(1, MAX_LOCAL_WORKERS):
        assert register(core, 100 + pid) == pb.CTRL_ERR_OK
    with caplog.at_level(logging.WARNING, "controller.core"):
        assert register(core, 99999) == pb.CTRL_ERR_FAILED
    assert len(core.workers) == MAX_LOCAL_WORKERS
    [line] = [r.getMessage() for r in caplog.records if "99999" in r.getMessage()]
    assert str(MAX_LOCAL_WORKERS) in line
    [line] = [r.getMessage() for r in caplog.records if "pid 7 " in r.getMessage()]
    assert str(MAX_NEXT_PULSE) in line
    # One leaves: there is room for one more, and no more.
    first = next(iter(core.workers))
    shutdown = pb.WorkerPulse(type=pb.PULSE_SHUTDOWN, worker_id=first)
    core.handle(PulseReceived(shutdown, pid=8, uid=1000), 1.0)
    assert register(core, 99999) == pb.CTRL_ERR_OK
    assert register(core, 100000) == pb.CTRL_ERR_FAILED


async def test_register_promising_more_than_an_hour_is_refused_on_main_sock(
    sockdir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with running_controller(sockdir) as (shell, _):
        for next_pulse, answer in ((MAX_NEXT_PULSE + 1, pb.CTRL_ERR_FAILED), (2, pb.CTRL_ERR_OK)):
            msg = pb.WorkerPulse(type=pb.PULSE_REGISTER, next_pulse=next_pulse)
            with trio.fail_after(5):
                resp, _ = await exchange(sockdir / "main.sock", msg, pb.PulseResponse)
            assert resp.error == answer
        assert len(shell.core.workers) == 1
    [line] = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert f"pid {os.getpid()} " in line and str(MAX_NEXT_PULSE) in line


# ---------------------------------------------------------------- the worker a waiting job names


@pytest.mark.parametrize("how", ["lease ran out", "claim ran out", "failed", "failed, retry_delay"])
def test_a_job_back_to_pending_or_scheduled_names_no_worker(how: str) -> None:
    core = Core(claim_timeout=5.0, lease_timeout=5.0)
    chosen = options.JobOptions(retry_delay=10.0 if how == "failed, retry_delay" else 0.0)
    task, _ = core.submit(1, b"p", "o", 0.0, chosen)
    job = Job("j", task.ref, 1, "http", None, task=task)
    core.pollers.ping("p1", 0.0)
    assert task.state is TaskState.ASSIGNING and job.worker
    core.pollers.handed("p1", 0.0, "lease")
    job.attempt_started(task.worker_id, 0.0)
    if how == "claim ran out":
        core.expire(5.0)
    else:
        core.pollers.working("p1", task.ref, 1.0)
        assert job.worker
        if how == "lease ran out":
            core.expire(6.0)
        else:
            core.pollers.failed("p1", task.ref, "no", 2.0)
    waiting = TaskState.SCHEDULED if how == "failed, retry_delay" else TaskState.QUEUED
    assert task.state is waiting and job.worker == 0


# ---------------------------------------------------------------- end to end, every door


@dataclass
class Doors:
    ctl: LiveController
    redis: redis.Redis | None
    udp: socket.socket
    txid: int = 0

    def http(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(f"{self.ctl.url}{path}", data=data, method=method)
        try:
            with urllib.request.urlopen(request, timeout=30) as resp:
                raw = resp.read()
                status = resp.status
        except urllib.error.HTTPError as exc:
            raw, status = exc.read(), exc.code
        if raw.startswith((b"{", b"[")):
            return status, json.loads(raw)
        return status, raw.decode(errors="replace")

    def datagram(self, packet: dict[str, Any]) -> dict[str, Any]:
        """Send a request (a new transmission id); its acknowledgement (notifications that
        come meanwhile are acknowledged and passed over)."""
        self.txid += 1
        txid = packet.setdefault("transmission_id", self.txid)
        self.udp.sendto(json.dumps(packet).encode(), ("127.0.0.1", self.ctl.udp_port))
        return self.answer(txid)

    def answer(self, txid: int) -> dict[str, Any]:
        self.udp.settimeout(10)
        while True:
            reply = json.loads(self.udp.recv(65536))
            if reply.get("method") != "ack":  # a notify_task: acknowledged when it asks
                if reply.get("packet_type") == 1:
                    ack = {"method": "ack", "packet_type": 2}
                    ack["transmission_id"] = reply["transmission_id"]
                    self.udp.sendto(json.dumps(ack).encode(), ("127.0.0.1", self.ctl.udp_port))
            elif reply.get("transmission_id") == txid:
                return dict(reply)

    def every_view_answers(self, *job_ids: str) -> None:
        """Every listing and page answers 200 (and the named jobs' own pages)."""
        paths = [f"/job/?state={s}" for s in ("scheduled", "pending", "deleted", "finished")]
        paths += ["/job/", "/job/?limit=1000", "/queue/", "/", "/ui/", "/ui/jobs"]
        paths += ["/ui/jobs?state=scheduled", "/ui/jobs?state=deleted", "/ui/queues"]
        for job_id in job_ids:
            paths += [f"/job/{job_id}/", f"/ui/jobs/{job_id}"]
        for path in paths:
            status, body = self.http("GET", path)
            assert status == 200, (path, body)

    def runs_a_normal_job(self) -> None:
        status, job = self.http("POST", "/job/", {"payload": "normal"})
        assert status == 201, job
        status, job = self.http("GET", f"/job/{job['id']}/?wait=30")
        assert (status, job["state"], job["result"]) == (200, "finished", "normal")


@pytest.fixture(scope="module")
def doors(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Doors]:
    tmp: Path = tmp_path_factory.mktemp("values")
    with contextlib.ExitStack() as stack:
        settings_: dict[str, Any] = {"udp_memory": 8 * 1024 * 1024}
        client = None
        if REDIS_SERVER is not None:
            server = stack.enter_context(redis_server(tmp))
            settings_["redis"] = {"url": server.url}
            client = redis.Redis.from_url(server.url)
            stack.callback(client.close)
        ctl = stack.enter_context(live_controller(tmp, "--workers", "1", **settings_))
        sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
        sock.bind(("127.0.0.1", 0))
        yield Doors(ctl, client, sock)


def redis_outcome(doors: Doors, job_id: str) -> dict[bytes, bytes]:
    r = doors.redis
    assert r is not None
    wait_for_condition(lambda: bool(r.hget(f"job:{job_id}", "state")), 30)
    return dict(r.hgetall(f"job:{job_id}"))


def test_the_poison_run_at_is_a_bad_option_on_every_door(doors: Doors) -> None:
    status, body = doors.http(
        "POST", "/job/", {"id": "poison-1", "payload": "hi", "run_at": POISON}
    )
    assert status == 400 and "run_at" in body["message"], body
    assert doors.http("GET", "/job/poison-1/")[0] == 404
    add = {"method": "add_task", "packet_type": 1, "params": {"task_id": 1, "run_at": POISON}}
    error = doors.datagram(add)["error"]
    assert error["code"] == "bad_option" and "run_at" in error["message"]
    if doors.redis is not None:
        doors.redis.xadd("jobs", {"id": "poison-2", "payload": "hi", "run_at": POISON})
        outcome = redis_outcome(doors, "poison-2")
        assert outcome[b"state"] == b"failed" and b"run_at" in outcome[b"error"]
    doors.every_view_answers()
    doors.runs_a_normal_job()


FUZZ = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    phases=[Phase.explicit, Phase.generate],
)


@FUZZ
@given(name=st.sampled_from(options.OPTIONS), value=ANY_VALUE)
@example(name="run_at", value=POISON)
@example(name="delay", value=TEN_YEARS)
@example(name="timeout", value=10**400)
def test_fuzz_option_values_on_every_door(doors: Doors, name: str, value: Any) -> None:
    """Any value of any option, on every door: refused as a bad option, or a job that every
    listing and page shows, that can be deleted and shown again."""
    if isinstance(value, float) and not math.isfinite(value):
        value = 10**400  # (JSON has no NaN: a door sees a huge number instead)
    doors.txid += 1
    made: list[str] = []
    job_id = f"fuzz-{doors.txid}"
    status, body = doors.http("POST", "/job/", {"id": job_id, "payload": "f", name: value})
    assert status in (201, 400), body
    if status == 400:
        assert body["message"]
    else:
        made.append(job_id)
    task_id = doors.txid
    add = {"method": "add_task", "packet_type": 1, "params": {"task_id": task_id, name: value}}
    answer = doors.datagram(add)
    if "error" in answer:
        assert answer["error"]["code"] == "bad_option" and answer["error"]["message"]
    else:
        made.append(f"udp-127.0.0.1-{doors.udp.getsockname()[1]}-{task_id}")
    if doors.redis is not None and name != "requires":
        # (a label no worker here has would make the entry wait for another controller)
        text = value if isinstance(value, str) else json.dumps(value)
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            text = ",".join(value)
        redis_id = f"fuzz-redis-{doors.txid}"
        fields = {"id": redis_id, "payload": "f", name: text.encode("utf-8", "surrogatepass")}
        doors.redis.xadd("jobs", fields)
        wait_for_condition(
            lambda: (
                doors.http("GET", f"/job/{redis_id}/")[0] == 200
                or bool(doors.redis and doors.redis.hget(f"job:{redis_id}", "state"))
            ),
            30,
        )
        if doors.http("GET", f"/job/{redis_id}/")[0] == 200:
            made.append(redis_id)
    doors.every_view_answers(*made)
    for made_id in made:
        assert doors.http("DELETE", f"/job/{made_id}/")[0] == 200
        status, job = doors.http("GET", f"/job/{made_id}/")
        assert (status, job["state"]) == (200, "deleted")


def test_a_flood_of_get_result_keeps_the_task_and_its_duplicate_detection(doors: Doors) -> None:
    """udp_memory 8 MiB, a 32 KiB result read again and again with fresh transmission ids:
    the task, its result and its duplicate detection stay; a repeat whose answer went is
    answered again from the record."""
    result = "r" * 32768
    task_id = 10**12
    add = {
        "method": "add_task",
        "packet_type": 1,
        "params": {"task_id": task_id, "payload": result},
    }
    first_add = doors.datagram(add)
    assert "error" not in first_add
    job_id = f"udp-127.0.0.1-{doors.udp.getsockname()[1]}-{task_id}"
    status, job = doors.http("GET", f"/job/{job_id}/?wait=30")
    assert job["state"] == "finished"
    first_txid = doors.txid + 1
    for _ in range(400):
        get = {"method": "get_result", "packet_type": 1, "params": {"task_id": task_id}}
        reply = doors.datagram(get)
        assert "error" not in reply, reply
        assert base64.b64decode(reply["params"]["result_b64"]) == result.encode()
    # A repeat of the first request, whose answer is long gone: answered again.
    again = {"method": "get_result", "packet_type": 1, "transmission_id": first_txid}
    again["params"] = {"task_id": task_id}
    reply = doors.datagram(again)
    assert base64.b64decode(reply["params"]["result_b64"]) == result.encode()
    # The same add_task again: acknowledged, its outcome sent again, nothing run again.
    assert "error" not in doors.datagram({**add, "transmission_id": first_add["transmission_id"]})
    status, after = doors.http("GET", f"/job/{job_id}/")
    assert (status, after["attempts"], after["state"]) == (200, 1, "finished")
    reply = doors.datagram({"method": "get_task", "packet_type": 1, "params": {"task_id": task_id}})
    assert reply["params"]["status"] == "success"


def compact(packet: dict[str, Any]) -> bytes:
    return json.dumps(packet, separators=(",", ":")).encode()


def test_an_error_ack_carries_a_message_shortened_to_fit(doors: Doors) -> None:
    """A request just large enough for an error acknowledgement with a few characters of
    message gets those characters; one too small for a single character gets silence."""
    address = ("127.0.0.1", doors.ctl.udp_port)
    for room in (3, 1, 0):
        doors.txid += 1
        txid = doors.txid
        fits = dg.encode(
            {
                "method": "ack",
                "packet_type": 2,
                "transmission_id": txid,
                "error": {"code": "unknown_task", "message": "n" * room},
            }
        )
        packet: dict[str, Any] = {"method": "get_task", "packet_type": 1, "transmission_id": txid}
        packet["params"] = {"task_id": 123456789, "pad": ""}
        packet["params"]["pad"] = "x" * (len(fits) - len(compact(packet)))
        assert len(compact(packet)) == len(fits)
        doors.udp.sendto(compact(packet), address)
        if room:
            error = doors.answer(txid)["error"]
            assert error == {"code": "unknown_task", "message": "no task 123456789"[:room]}
        else:  # silence: the first answer that comes is the probe's, sent after it
            probe = {"method": "get_task", "packet_type": 1, "transmission_id": txid + 1}
            probe["params"] = {"task_id": 1, "pad": "x" * 100}
            doors.txid += 1
            doors.udp.sendto(compact(probe), address)
            doors.udp.settimeout(10)
            assert json.loads(doors.udp.recv(65536))["transmission_id"] == txid + 1


# ---------------------------------------------------------------- a record an older version kept


def test_a_journal_holding_a_time_past_the_years_still_lists_shows_and_deletes(
    tmp_path: Path,
) -> None:
    with live_controller(tmp_path) as ctl:
        doors = Doors(ctl, None, socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
        status, _ = doors.http("POST", "/job/", {"id": "poison-1", "payload": "hi", "delay": 3600})
        assert status == 201
        doors.udp.close()
    # What an older version recorded for the poison run_at (year 10000 in UTC).
    with contextlib.closing(sqlite3.connect(tmp_path / "journal.sqlite3")) as db:
        (kept,) = db.execute("SELECT options FROM jobs WHERE id = 'poison-1'").fetchone()
        changed = {**json.loads(kept), "run_at": OLD_POISON_WALL}
        db.execute(
            "UPDATE jobs SET options = ?, queued_at = ? WHERE id = 'poison-1'",
            (json.dumps(changed), OLD_POISON_WALL),
        )
        db.commit()
    with (
        live_controller(tmp_path, "--workers", "1") as ctl,
        contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_DGRAM)) as sock,
    ):
        doors = Doors(ctl, None, sock)
        doors.every_view_answers("poison-1")
        status, job = doors.http("GET", "/job/poison-1/")
        assert (job["state"], job["run_at"]) == ("scheduled", "9999-12-31T23:59:59.999999Z")
        status, listed = doors.http("GET", "/job/?state=scheduled")
        assert "poison-1" in listed
        status, job = doors.http("DELETE", "/job/poison-1/")
        assert (status, job["state"]) == (200, "deleted")
        doors.every_view_answers("poison-1")
        doors.runs_a_normal_job()


# ---------------------------------------------------------------- the UDP door's answer memory


@settings(max_examples=100, deadline=None)
@given(
    memory=st.integers(min_value=0, max_value=200_000),
    sizes=st.lists(st.integers(min_value=0, max_value=70_000), max_size=60),
)
def test_remembered_answers_never_hold_more_than_udp_memory(memory: int, sizes: list[int]) -> None:
    seen = Seen(memory)
    for txid, size in enumerate(sizes):
        seen.remember(("127.0.0.1", 9), txid, b"a" * size, float(txid))
        assert seen.held_bytes <= memory
    if sizes and SEEN_OVERHEAD + sizes[-1] <= memory // 4:  # the newest is kept
        assert seen.get(("127.0.0.1", 9), len(sizes) - 1) == (b"a" * sizes[-1],)

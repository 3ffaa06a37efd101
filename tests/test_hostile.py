"""Hostile input against a real controller (journal on): values the journal must store as
given, ids that belong to one door, answers that wait for the journal, a corrupted journal,
and every door fuzzed with hypothesis. After each input the controller is alive and runs a
normal job; its log holds no traceback (live_controller checks at the end)."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
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
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from controller import datagram as datagram_module
from controller import journal as journal_module
from controller.app import assemble
from controller.config import ClientAddress, Config, RedisSettings
from controller.doors.http.access import Gate
from controller.doors.http.console.session import TokenFile
from controller.job_states import JobState
from controller.jobs import Job
from controller.journal import Journal
from controller.shell.recovery import recover
from tests.helpers import (
    REDIS_SERVER,
    LiveController,
    controller_argv,
    free_tcp_port,
    free_udp_port,
    live_controller,
    reap,
    redis_server,
    wait_for_condition,
    write_config,
)

# Each fuzz test's examples: enough to reach odd corners, few enough to stay fast.
EXAMPLES = 50
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    # Each example costs a round trip or two to a real controller: a failure is reported as
    # found, not shrunk for minutes.
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
LONE_SURROGATES = st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff", "a\ud800b"])
# JSON-shaped values of every kind, lone surrogates and numbers of any size included.
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=2**62, max_value=2**70)
    | st.integers(min_value=-(2**70), max_value=-(2**62))
    | st.floats(allow_nan=False)
    | st.text(max_size=30)
    | LONE_SURROGATES
    | st.text(min_size=5000, max_size=20000, alphabet="xy\ud800")
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def dumps(obj: Any) -> bytes:
    """JSON as a hostile peer may send it: lone surrogates as \\u escapes, any number."""
    return json.dumps(obj).encode()


# Transmission ids of the probes that follow each hostile datagram.
PROBES = 10**15


def wants_ack(data: bytes) -> bool:
    packet = json.loads(data)
    txid = packet.get("transmission_id")
    return bool(packet.get("packet_type") == 1 and type(txid) is int)


@dataclass
class Hostile:
    ctl: LiveController
    redis: redis.Redis | None
    udp: socket.socket
    normal_jobs: int = 0
    probes: int = 0

    def http(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any]:
        request = urllib.request.Request(
            f"{self.ctl.url}{path}", data=body, method=method, headers=headers or {}
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as resp:
                raw = resp.read()
                return resp.status, json.loads(raw) if raw else None
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            return exc.code, json.loads(raw) if raw else None

    def send(self, data: bytes) -> None:
        self.udp.sendto(data, ("127.0.0.1", self.ctl.udp_port))

    def datagram(self, data: bytes) -> dict[str, Any] | None:
        """Send one datagram; the acknowledgement it got (None: silence). A probe that is
        always answered follows it, so silence costs one round trip, not a timeout."""
        self.probes += 1
        probe_txid = PROBES + self.probes
        probe = {"method": "get_task", "packet_type": 1, "transmission_id": probe_txid}
        self.send(data)
        # padded: an error acknowledgement is never larger than the packet it answers
        self.send(dumps({**probe, "params": {"task_id": 1, "pad": "x" * 200}}))
        self.udp.settimeout(10)
        answer = None
        probed = False
        while not (probed and (answer is not None or not wants_ack(data))):
            try:
                packet = json.loads(self.udp.recv(65536))
            except TimeoutError:
                assert probed, "the controller answers no more"
                return None  # silence (an answer would have outgrown the request)
            txid = packet.get("transmission_id")
            if packet.get("method") != "ack":  # a notify_task for an earlier job
                if packet.get("packet_type") == 1:
                    self.send(dumps({"method": "ack", "packet_type": 2, "transmission_id": txid}))
            elif txid == probe_txid:
                probed = True
                self.udp.settimeout(0.5)  # an answer that waits for the journal comes later
            elif not (isinstance(txid, int) and PROBES <= txid < probe_txid):  # not a stale probe
                answer = dict(packet)
        return answer

    def runs_a_normal_job(self) -> None:
        """The controller is alive and runs a job end to end."""
        assert self.ctl.proc.poll() is None, "the controller exited"
        self.normal_jobs += 1
        payload = f"normal {self.normal_jobs}"
        status, job = self.http("POST", "/job/", dumps({"payload": payload}))
        assert status == 201, job
        status, job = self.http("GET", f"/job/{job['id']}/?wait=30")
        assert (status, job["state"], job["result"]) == (200, "finished", payload)


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hostile]:
    tmp: Path = tmp_path_factory.mktemp("hostile")
    with contextlib.ExitStack() as stack:
        # max_retries 0: a job a remote worker fails stays failed, with that worker's error
        settings_: dict[str, Any] = {"dial_timeout": 1.0, "calculator_timeout": 3, "max_retries": 0}
        client = None
        if REDIS_SERVER is not None:
            server = stack.enter_context(redis_server(tmp))
            settings_["redis"] = {"url": server.url, "claim_after": 5}
            client = redis.Redis.from_url(server.url)
            stack.callback(client.close)
        ctl = stack.enter_context(live_controller(tmp, "--workers", "1", **settings_))
        sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
        sock.bind(("127.0.0.1", 0))
        yield Hostile(ctl, client, sock)


def add_task(task_id: Any, txid: int = 1, **params: Any) -> bytes:
    packet = {"method": "add_task", "packet_type": 1, "transmission_id": txid}
    packet["params"] = {"task_id": task_id, **params}
    return dumps(packet)


# ---------------------------------------------------------------- values and ids


def test_a_task_id_over_63_bits_is_refused_and_the_largest_one_runs(hostile: Hostile) -> None:
    answer = hostile.datagram(add_task(2**63, txid=11))
    assert answer is not None and answer["error"]["code"] == "bad_task_id"
    assert hostile.datagram(add_task(2**63 - 1, txid=12, payload="big")) == {
        "method": "ack",
        "packet_type": 2,
        "transmission_id": 12,
    }
    port = hostile.udp.getsockname()[1]
    status, job = hostile.http("GET", f"/job/udp-127.0.0.1-{port}-{2**63 - 1}/?wait=30")
    assert (status, job["state"], job["result"]) == (200, "finished", "big")
    hostile.runs_a_normal_job()


def test_lone_surrogates_in_every_text_field_are_kept_as_given(hostile: Hostile) -> None:
    body = {
        "name": "\ud800",
        "info_url": "i\udfff",
        "download_url": "\udc00d",
        "payload": "p\ud800q",
    }
    status, job = hostile.http("POST", "/job/", dumps(body))
    assert status == 201, job
    status, job = hostile.http("GET", f"/job/{job['id']}/?wait=30")
    assert job["state"] == "finished"
    assert {key: job[key] for key in body} == body
    assert job["result"] == "p\ud800q"  # the echo worker got the payload's bytes, 3 a surrogate
    hostile.runs_a_normal_job()


def test_a_udp_id_cannot_be_taken_over_http(hostile: Hostile) -> None:
    port = hostile.udp.getsockname()[1]
    status, error = hostile.http("POST", "/job/", dumps({"id": f"udp-127.0.0.1-{port}-77"}))
    assert status == 400 and "udp-" in error["message"]
    assert "error" not in (hostile.datagram(add_task(77, txid=77, payload="mine")) or {})
    status, job = hostile.http("GET", f"/job/udp-127.0.0.1-{port}-77/?wait=30")
    assert (job["door"], job["state"], job["result"]) == ("udp", "finished", "mine")
    hostile.runs_a_normal_job()


def claimed_by_poller(hostile: Hostile, name: str) -> dict[str, Any]:
    """Submit jobs until one is handed to poller `name` (the local worker takes the others)."""
    found: list[dict[str, Any]] = []

    def ping() -> None:
        status, job = hostile.http("GET", f"/ping/?worker={name}&wait=2")
        if status == 200:
            found.append(job)

    for attempt in range(50):
        pinger = threading.Thread(target=ping)
        pinger.start()
        hostile.http("POST", "/job/", dumps({"payload": f"for a poller {attempt}"}))
        pinger.join(30)
        if found:
            return found[0]
    raise AssertionError("no job was handed to the poller")


def test_lone_surrogates_from_a_poller_are_kept(hostile: Hostile) -> None:
    job = claimed_by_poller(hostile, "surrogates")
    lease = {"lease": job["lease"]} if "lease" in job else {}
    put = {"state": "failed", "worker": "surrogates", "error": "e\ud800", "log": "l\udfff", **lease}
    status, answer = hostile.http("PUT", f"/job/{job['id']}/", dumps(put))
    assert status == 200, answer
    status, job = hostile.http("GET", f"/job/{job['id']}/")
    assert (job["state"], job["log"]) == ("failed", ["l\udfff"])
    assert "e\ud800" in job["error"]
    hostile.runs_a_normal_job()


def test_lone_surrogates_from_a_calculator_are_kept(hostile: Hostile) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as calc:
        calc.bind(("127.0.0.1", 0))
        calc.settimeout(0.5)
        door = ("127.0.0.1", hostile.ctl.udp_port)
        heartbeat = {"method": "heartbeat", "packet_type": 0}
        perform: dict[str, Any] | None = None
        for attempt in range(50):
            calc.sendto(dumps({**heartbeat, "params": {"status": "ready"}}), door)
            payload = f"for a calculator \ud800 {attempt}"
            hostile.http("POST", "/job/", dumps({"payload": payload}))
            with contextlib.suppress(TimeoutError):
                perform = json.loads(calc.recv(65536))
                break
        assert perform is not None and perform["method"] == "perform_task"
        assert perform["params"]["payload"] == payload  # the same text, surrogate and all
        ack = {"method": "ack", "packet_type": 2, "transmission_id": perform["transmission_id"]}
        calc.sendto(dumps(ack), door)
        params = {"task_id": perform["params"]["task_id"], "status": "error", "error": "c\ud800"}
        done = {"method": "completed_task", "packet_type": 1, "transmission_id": 5}
        calc.sendto(dumps({**done, "params": params}), door)
        calc.settimeout(10)
        assert json.loads(calc.recv(65536))["transmission_id"] == 5
        calc.sendto(dumps({**heartbeat, "params": {"status": "busy"}}), door)
    task_id = perform["params"]["task_id"]
    _status, listing = hostile.http("GET", "/job/?state=failed&limit=1000")
    (job,) = [job for job in listing.values() if job["task_id"] == task_id]
    assert "c\ud800" in job["error"]
    hostile.runs_a_normal_job()


def test_a_non_ascii_bearer_token_is_401_and_a_utf8_one_matches(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("s\u00e9cret\n", encoding="utf-8")
    gate = Gate([ipaddress.ip_network("127.0.0.0/8")], TokenFile(tokens), clock=time.monotonic)

    def status(authorization: bytes) -> int:
        scope = {
            "client": ("127.0.0.1", 1),
            "path": "/job/",
            "headers": [(b"authorization", authorization)],
        }
        refusal = gate.refusal(scope)
        return 200 if refusal is None else refusal.status

    assert status(b"Bearer \xc3\xa9\xff") == 401
    assert status("Bearer s\u00e9cret".encode()) == 200


# ---------------------------------------------------------------- Redis entries


def redis_outcome(hostile: Hostile, job_id: str) -> dict[bytes, bytes]:
    assert hostile.redis is not None
    r = hostile.redis
    wait_for_condition(lambda: bool(r.hget(f"job:{job_id}", "state")), 30)
    return dict(r.hgetall(f"job:{job_id}"))


@pytest.mark.skipif(REDIS_SERVER is None, reason="needs redis-server")
def test_a_redis_entry_cannot_take_another_doors_job(hostile: Hostile) -> None:
    assert hostile.redis is not None
    hostile.http("POST", "/job/", dumps({"id": "http-owned", "payload": "h"}))
    _, job = hostile.http("GET", "/job/http-owned/?wait=30")
    assert job["state"] == "finished"
    hostile.redis.xadd("jobs", {"id": "http-owned", "payload": "from redis"})
    outcome = redis_outcome(hostile, "http-owned")
    assert outcome[b"state"] == b"failed" and b"id in use" in outcome[b"error"]
    _status, after = hostile.http("GET", "/job/http-owned/")
    assert after == job  # nothing of that job changed
    hostile.redis.xadd("jobs", {"id": "udp-127.0.0.1-1-1", "payload": "x"})
    outcome = redis_outcome(hostile, "udp-127.0.0.1-1-1")
    assert outcome[b"state"] == b"failed" and b"udp-" in outcome[b"error"]
    hostile.runs_a_normal_job()


# ---------------------------------------------------------------- fuzzing every door


@FUZZ
@given(
    packet_type=st.sampled_from([0, 1]) | VALUES,
    txid=st.integers(min_value=1, max_value=2**80) | VALUES,
    method=st.sampled_from(["add_task", "get_task", "get_result", "status", "nope"]) | VALUES,
    params=st.dictionaries(
        st.sampled_from(["task_id", "payload", "payload_b64", "offset", "length", "x"]), VALUES
    )
    | VALUES,
)
def test_fuzz_udp_datagrams(hostile: Hostile, packet_type, txid, method, params) -> None:
    packet = {"method": method, "packet_type": packet_type, "transmission_id": txid}
    packet["params"] = params
    data = dumps(packet)
    if len(data) < 60_000:
        answer = hostile.datagram(data)
        if answer is not None and "error" in answer:
            assert answer["error"]["code"] != "internal", answer
    hostile.runs_a_normal_job()


@FUZZ
@given(
    method=st.sampled_from(["heartbeat", "completed_task"]),
    packet_type=st.sampled_from([0, 1]) | VALUES,
    params=st.fixed_dictionaries(
        {},
        optional={
            "status": st.sampled_from(["ready", "busy", "success", "error"]) | VALUES,
            "task_id": st.integers(min_value=-5, max_value=2**64) | VALUES,
            "result": VALUES,
            "result_b64": VALUES,
            "error": VALUES,
        },
    ),
)
def test_fuzz_calculator_messages(hostile: Hostile, method, packet_type, params) -> None:
    txid = hostile.probes + 1  # a new one each time: a repeat would be answered from memory
    packet = {"method": method, "packet_type": packet_type, "transmission_id": txid}
    packet["params"] = params
    data = dumps(packet)
    if len(data) < 60_000:
        hostile.datagram(data)
        busy = {"method": "heartbeat", "packet_type": 0, "params": {"status": "busy"}}
        hostile.datagram(dumps(busy))  # this socket takes none of the normal jobs
    hostile.runs_a_normal_job()


NEW_JOB_FIELDS = ["name", "info_url", "download_url", "payload", "payload_b64", "id", "other"]


@FUZZ
@given(
    body=st.dictionaries(st.sampled_from(NEW_JOB_FIELDS), VALUES) | VALUES | st.binary(max_size=64),
    header=st.text(max_size=40) | LONE_SURROGATES,
)
def test_fuzz_http_bodies_and_headers(hostile: Hostile, body, header) -> None:
    data = body if isinstance(body, bytes) else dumps(body)
    headers = {"X-Fuzz": header.encode("utf-8", "surrogatepass").decode("latin-1")}
    headers["Content-Type"] = "application/json"
    with contextlib.suppress(ValueError):  # http.client refuses a header with a newline
        status, answer = hostile.http("POST", "/job/", data, headers)
        assert status in (200, 201, 400, 413), answer
        if status in (200, 201) and isinstance(body, dict):
            for key in ("name", "info_url", "download_url"):
                if isinstance(body.get(key), str):
                    assert answer[key] == body[key]
    hostile.runs_a_normal_job()


@FUZZ
@given(
    body=st.fixed_dictionaries(
        {},
        optional={
            "state": st.sampled_from(["working", "finished", "failed", "canceled"]) | VALUES,
            "worker": st.sampled_from(["fuzzer"]) | VALUES,
            "log": VALUES,
            "error": VALUES,
            "result": VALUES,
            "result_b64": VALUES,
        },
    )
    | VALUES,
)
def test_fuzz_poller_puts(hostile: Hostile, body) -> None:
    status, job = hostile.http("POST", "/job/", dumps({"payload": "to be put"}))
    status, answer = hostile.http("PUT", f"/job/{job['id']}/", dumps(body))
    assert status in (200, 400, 409, 413), answer
    hostile.runs_a_normal_job()


REDIS_FIELDS = ["id", "payload", "name", "other"]


@pytest.mark.skipif(REDIS_SERVER is None, reason="needs redis-server")
@FUZZ
@given(
    fields=st.dictionaries(
        st.sampled_from(REDIS_FIELDS),
        st.binary(max_size=40)
        | st.text(max_size=40).map(str.encode)
        | st.sampled_from([b"udp-127.0.0.1-1-1", b"", b"x" * 300, b"\xed\xa0\x80"]),
        min_size=1,
    )
)
def test_fuzz_redis_entries(hostile: Hostile, fields) -> None:
    assert hostile.redis is not None
    hostile.redis.xadd("jobs", fields)
    hostile.runs_a_normal_job()


# ---------------------------------------------------------------- answers wait for the journal


def test_no_answer_confirms_a_cancel_or_a_delete_before_it_is_on_disk(tmp_path: Path) -> None:
    """A PUT cancel's and a DELETE's 200 leave only once the change is committed: with the
    journal's file locked by another writer the controller cannot commit, and killed then
    (SIGKILL) it has confirmed nothing; a confirmed change survives the restart."""
    journal = tmp_path / "journal.sqlite3"
    http_port = free_tcp_port()
    config = write_config(
        tmp_path,
        socket_dir=str(tmp_path / "s"),
        journal=str(journal),
        client_address={"host": "127.0.0.1", "port": free_udp_port()},
        http_address={"host": "127.0.0.1", "port": http_port},
    )
    url = f"http://127.0.0.1:{http_port}"

    def start() -> subprocess.Popen[bytes]:
        log = (tmp_path / "controller.log").open("ab")
        with log:
            proc = subprocess.Popen(controller_argv(config, log_level="WARNING"), stderr=log)
        wait_for_condition(lambda: health(url) or proc.poll() is not None, 20)
        assert proc.poll() is None
        return proc

    def call(method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        data = None if body is None else dumps(body)
        request = urllib.request.Request(f"{url}{path}", data=data, method=method)
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, json.loads(resp.read())

    proc = start()  # no workers: the jobs stay pending
    try:
        for job_id in ("to-cancel", "to-delete", "plain-cancel", "plain-delete"):
            assert call("POST", "/job/", {"id": job_id})[0] == 201
        # Plain: SIGKILL right after the 200s. Text fields come back after it as given.
        notes = {"name": "n\ud800", "info_url": "i\udfff", "download_url": "d\udc00"}
        assert call("POST", "/job/", {"id": "noted", **notes})[0] == 201
        assert call("PUT", "/job/noted/", {"log": "l\ud800"})[0] == 200
        assert call("PUT", "/job/plain-cancel/", {"state": "canceled"})[0] == 200
        assert call("DELETE", "/job/plain-delete/")[0] == 200
        proc.send_signal(signal.SIGKILL)
        reap(proc)
        proc = start()
        assert call("GET", "/job/plain-cancel/")[1]["state"] == "canceled"
        assert call("GET", "/job/plain-delete/")[1]["state"] == "deleted"
        noted = call("GET", "/job/noted/")[1]
        assert {key: noted[key] for key in notes} == notes and noted["log"] == ["l\ud800"]
        # With the file locked, no 200 may come; killed meanwhile, nothing was confirmed.
        answers: dict[str, Any] = {}

        def ask(name: str, method: str, body: dict[str, Any] | None) -> None:
            try:
                answers[name] = call(method, f"/job/{name}/", body)[0]
            except OSError as exc:
                answers[name] = exc

        locker = sqlite3.connect(journal, isolation_level=None)
        locker.execute("BEGIN EXCLUSIVE")
        askers = [
            threading.Thread(target=ask, args=("to-cancel", "PUT", {"state": "canceled"})),
            threading.Thread(target=ask, args=("to-delete", "DELETE", None)),
        ]
        for asker in askers:
            asker.start()
        log_path = tmp_path / "controller.log"
        wait_for_condition(lambda: "JOURNAL WRITE FAILED" in log_path.read_text(), 30)
        proc.send_signal(signal.SIGKILL)
        reap(proc)
        for asker in askers:
            asker.join(30)
        locker.execute("ROLLBACK")
        locker.close()
        proc = start()
        states = {name: call("GET", f"/job/{name}/")[1]["state"] for name in answers}
        for name, answer in answers.items():
            if answer == 200:  # confirmed: it must have survived
                assert states[name] in ("canceled", "deleted"), (name, states)
        assert all(answer != 200 for answer in answers.values()), answers
    finally:
        proc.terminate()
        reap(proc)


def health(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health/", timeout=1) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


# ---------------------------------------------------------------- a corrupted journal


def test_a_corrupted_journal_stops_the_start_with_one_line(tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite3"
    journal = Journal.open(path)
    journal.load()
    for ref in range(1, 3000):
        journal.job_added(Job(f"job-{ref}", ref, ref, "http", None, b"x" * 100))
    journal.write(journal.take()[0])
    journal.close()
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    data = bytearray(path.read_bytes())
    page = 4096 * 20  # a leaf of the jobs table, in the middle of the file
    data[page + 100 : page + 400] = b"\xff" * 300
    path.write_bytes(bytes(data))
    config = write_config(
        tmp_path,
        socket_dir=str(tmp_path / "s"),
        journal=str(path),
        client_address={"host": "127.0.0.1", "port": free_udp_port()},
    )
    done = subprocess.run(controller_argv(config), capture_output=True, timeout=60)
    assert done.returncode == 2
    lines = done.stderr.decode().strip().splitlines()
    assert len(lines) == 1, lines
    assert str(path) in lines[0] and "quick_check" in lines[0] and "page" in lines[0]


# ---------------------------------------------------------------- a change the journal refuses


async def test_a_job_the_journal_cannot_store_is_refused_alone(
    sockdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Were a value the journal cannot store to get past the doors' checks (here a task_id
    over 63 bits, let through on purpose), its job alone is refused (an `internal` error
    acknowledgement) and the jobs in the same batch are committed and acknowledged."""
    monkeypatch.setattr(datagram_module, "MAX_TASK_ID", 2**64 - 1)
    path = tmp_path / "journal.sqlite3"
    journal = Journal.open(path)
    config = Config(
        socket_dir=sockdir,
        journal=path,
        client_address=ClientAddress("127.0.0.1", free_udp_port()),
    )
    ctl = assemble(config, journal)
    shell, desk, door = ctl.shell, ctl.desk, ctl.udp
    recover(desk, journal.load(), trio.current_time())
    committer = ctl.committer
    assert committer is not None
    async with trio.open_nursery() as nursery:
        await nursery.start(committer.run)
        await nursery.start(shell.serve)
        await nursery.start(door.serve)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.bind(("127.0.0.1", 0))
            sock.settimeout(10)
            target = ("127.0.0.1", config.client_address.port)
            for txid, task_id in ((1, 5), (2, 2**63), (3, 6)):  # one batch: no await between
                sock.sendto(add_task(task_id, txid=txid, payload="x" * 100), target)
            answers: dict[int, str | None] = {}
            while len(answers) < 3:
                packet = json.loads(await trio.to_thread.run_sync(sock.recv, 65536))
                answers[packet["transmission_id"]] = packet.get("error", {}).get("code")
            port = sock.getsockname()[1]
        assert answers == {1: None, 2: "internal", 3: None}
        assert desk.book.get(f"udp-127.0.0.1-{port}-{2**63}") is None
        nursery.cancel_scope.cancel()
    journal.close()
    with sqlite3.connect(path) as db:
        assert sorted(row[0] for row in db.execute("SELECT task_id FROM jobs")) == [5, 6]


async def test_a_later_change_the_journal_cannot_store_fails_its_job_saying_why(
    sockdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An accepted job whose later change cannot be stored (here its cancel's error text,
    made unstorable on purpose) fails, with an error saying why, and that is journaled."""
    real = journal_module.stored_text
    monkeypatch.setattr(
        journal_module,
        "stored_text",
        lambda text: object() if text == "canceled" else real(text),
    )
    path = tmp_path / "journal.sqlite3"
    journal = Journal.open(path)
    ctl = assemble(Config(socket_dir=sockdir, journal=path), journal)
    shell, desk, _ = ctl.shell, ctl.desk, ctl.udp
    recover(desk, journal.load(), trio.current_time())
    committer = ctl.committer
    assert committer is not None
    async with trio.open_nursery() as nursery:
        await nursery.start(committer.run)
        await nursery.start(shell.serve)
        now = trio.current_time()
        job = desk.submit("kept", "http", None, desk.book.pick_task_id(), b"p", now)
        await desk.write_ahead.committed()
        desk.cancel(job, trio.current_time())
        await desk.write_ahead.committed()  # the cancel's batch: its change refused
        await desk.write_ahead.committed()  # the failure staged instead
        assert job.state is JobState.FAILED
        assert "cannot record a change of this job" in job.error
        nursery.cancel_scope.cancel()
    journal.close()
    with sqlite3.connect(path) as db:
        state, error = db.execute("SELECT state, error FROM jobs WHERE id = 'kept'").fetchone()
    assert state == "failed" and "cannot record a change of this job" in error


async def test_the_redis_cancel_channel_cancels_redis_jobs_only(sockdir: Path) -> None:

    config = Config(socket_dir=sockdir, journal=None, redis=RedisSettings(url="redis://x:1/0"))
    ctl = assemble(config)
    shell, desk, _ = ctl.shell, ctl.desk, ctl.udp
    door = ctl.redis  # not run: only its cancel rule is looked at
    assert door is not None
    async with trio.open_nursery() as nursery:
        await nursery.start(shell.serve)
        now = trio.current_time()
        http_job = desk.submit("shared-name", "http", None, desk.book.pick_task_id(), b"", now)
        redis_job = desk.submit("redis-job", "redis", "1-0", desk.book.pick_task_id(), b"", now)
        door._cancel("shared-name")
        door._cancel("redis-job")
        assert (http_job.state, redis_job.state) == (JobState.PENDING, JobState.CANCELED)
        nursery.cancel_scope.cancel()
    door.calls.close()


def test_a_poller_runs_a_payload_with_a_lone_surrogate_and_lives(tmp_path: Path) -> None:
    payload = "\udfff for the poller"
    with live_controller(tmp_path) as ctl:  # no local worker: the poller takes the job
        cmd = [sys.executable, "-m", "worker", "--log-level", "WARNING", "--pulse", "0.5"]
        poller = subprocess.Popen([*cmd, "--hub", ctl.url, "--name", "sp"])
        try:
            request = urllib.request.Request(
                f"{ctl.url}/job/", data=dumps({"payload": payload}), method="POST"
            )
            with urllib.request.urlopen(request, timeout=30) as resp:
                job = json.loads(resp.read())
            with urllib.request.urlopen(f"{ctl.url}/job/{job['id']}/?wait=30", timeout=40) as resp:
                job = json.loads(resp.read())
            assert (job["state"], job["result"], job["worker"]) == ("finished", payload, "sp")
            assert poller.poll() is None
        finally:
            reap(poller)

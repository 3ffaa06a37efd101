"""Queue limits (DESIGN section 17): `concurrency` and `rate` on `PUT /queue/{name}/`.

The pure core with explicit times (pollers as the workers: remote workers count the same),
hypothesis properties on it, then the HTTP API, real worker processes, a restart on the same
journal, and `jobctl queues`.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.app import assemble
from controller.config import ClientAddress, Config
from controller.core import Core, HandOut, PulseReceived, Reply, WorkerExited
from controller.core.limits import Rate
from controller.declared import Declared
from controller.journal import Journal
from controller.options import JobOptions
from gen import worker_protocol_pb2 as pb
from tests.helpers import wait_until
from tests.test_console import section
from tests.test_core import UID, answer, dials, pulse, ready_worker
from tests.test_http import client, http_controller
from tests.worker_handlers import GATES, start_workers

BOTH = Declared(queues=frozenset({"a", "b"}))


def handed(actions: list[object]) -> dict[str, int]:
    """The pollers handed a job by these actions: name -> ref."""
    return {a.name: a.ref for a in actions if isinstance(a, HandOut)}


def submit(core: Core, n: int, queue: str, now: float) -> list[object]:
    _, actions = core.submit(n, b"", None, now, JobOptions(queue=queue))
    return list(actions)


def held(core: Core, queue: str) -> int:
    """Tasks of `queue` held by workers now."""
    return sum(1 for t in core.tasks.values() if t.opts.queue == queue and t.worker_id)


# ---------------------------------------------------------------- the pure core


def test_a_queue_at_its_concurrency_starts_nothing_until_one_ends_and_others_go_on():
    core = Core()
    core.limit("a", 1, None, 0.0)
    for n in (1, 2, 3):
        submit(core, n, "a", 0.0)
    first = handed(core.pollers.ping("p1", 0.0, BOTH))
    assert len(first) == 1
    assert handed(core.pollers.ping("p2", 0.0, BOTH)) == {}  # "a" is at its concurrency
    # Another queue's job goes to the idle poller at once: "a" blocks nobody else.
    assert list(handed(submit(core, 9, "b", 0.0))) == ["p2"]
    ref = first["p1"]
    core.pollers.working("p1", ref, 0.5)
    after = handed(core.pollers.finished("p1", ref, b"ok", 1.0))
    assert after == {} and held(core, "a") == 0  # p1 left (it pings again); p2 holds "b"'s
    assert len(handed(core.pollers.ping("p3", 1.0, BOTH))) == 1
    assert held(core, "a") == 1


def test_a_failed_attempt_and_a_lost_worker_release_the_slot():
    core = Core(max_retries=5)
    core.limit("a", 1, None, 0.0)
    submit(core, 1, "a", 0.0)
    submit(core, 2, "a", 0.0)
    ref = handed(core.pollers.ping("p1", 0.0, BOTH))["p1"]
    assert handed(core.pollers.ping("p2", 0.0, BOTH)) == {}
    core.pollers.working("p1", ref, 0.0)
    # Its attempt fails: it is pending again (retry_delay 0), the slot is free, p2 takes one.
    [(name, ref2)] = handed(core.pollers.failed("p1", ref, "boom", 1.0)).items()
    assert name == "p2" and held(core, "a") == 1
    # p2 goes silent past lease_timeout: lost, the slot free for the next poller.
    core.pollers.working("p2", ref2, 1.0)
    core.expire(1.0 + core.pollers.lease_timeout)
    assert held(core, "a") == 0
    assert len(handed(core.pollers.ping("p3", 100.0, BOTH))) == 1
    assert held(core, "a") == 1


def test_local_workers_and_pollers_share_the_concurrency_and_a_death_frees_it():
    core = Core(max_retries=5)
    core.limit("default", 1, None, 0.0)
    wid = ready_worker(core)
    _, actions = core.submit(1, b"", None, 0.0, JobOptions())
    [dial] = dials(actions, pb.CTRL_SET_TASK)
    assert dial.worker_id == wid
    core.submit(2, b"", None, 0.0, JobOptions())
    assert handed(core.pollers.ping("p1", 0.0)) == {}  # the local worker holds the one slot
    answer(core, wid, pb.CTRL_SET_TASK, 0.5, task_id=1)
    # The local worker's process dies: its job is placed again at once, on the poller.
    after = core.handle(WorkerExited(wid), 1.0)
    assert list(handed(after)) == ["p1"] and held(core, "default") == 1


def test_a_queue_waiting_for_a_token_starts_on_time_with_no_new_event():
    core = Core()
    core.limit("a", None, Rate(1, "s"), 10.0)
    submit(core, 1, "a", 10.0)
    submit(core, 2, "a", 10.0)
    assert len(handed(core.pollers.ping("p1", 10.0, BOTH))) == 1  # the bucket's one token
    assert handed(core.pollers.ping("p2", 10.0, BOTH)) == {}
    assert core.next_deadline() == pytest.approx(11.0)  # the next token: the timer wakes
    assert handed(core.expire(10.999)) == {}
    assert list(handed(core.expire(core.next_deadline()))) == ["p2"]


def test_a_rate_per_minute_refills_evenly_and_null_removes_it():
    core = Core()
    core.limit("a", None, Rate(2, "m"), 0.0)
    for n in range(1, 6):
        submit(core, n, "a", 0.0)
    for name in ("p1", "p2", "p3"):
        core.pollers.ping(name, 0.0, BOTH)
    assert held(core, "a") == 2  # the bucket starts full: 2 tokens
    assert core.next_deadline() == pytest.approx(30.0)  # 2 a minute: one each 30 s
    core.expire(30.0)
    assert held(core, "a") == 3
    assert core.limits("a") == (None, Rate(2, "m"))
    core.limit("a", None, None, 31.0)  # removed: every idle poller takes one
    core.pollers.ping("p4", 31.0, BOTH)
    assert held(core, "a") == 4 and core.limits("a") == (None, None)


def test_a_changed_rate_starts_a_full_bucket_and_the_same_rate_keeps_its_tokens():
    core = Core()
    core.limit("a", None, Rate(1, "m"), 0.0)
    for n in range(1, 6):
        submit(core, n, "a", 0.0)
    for name in ("p1", "p2", "p3", "p4"):
        core.pollers.ping(name, 0.0, BOTH)
    assert held(core, "a") == 1  # its one token spent
    core.limit("a", None, Rate(1, "m"), 1.0)  # the same rate: no new token
    core.pollers.ping("p2", 1.0, BOTH)
    assert held(core, "a") == 1
    core.limit("a", None, Rate(2, "m"), 2.0)  # a new rate: a full bucket of 2
    core.pollers.ping("p2", 2.0, BOTH)
    core.pollers.ping("p3", 2.0, BOTH)
    assert held(core, "a") == 3
    assert core.next_deadline() == pytest.approx(32.0)  # then one each 30 s


def serving_a(core: Core, now: float) -> int:
    """A local worker of queue "a" registered at `now` (its pulses due every 30 s)."""
    msg = pb.WorkerPulse(type=pb.PULSE_REGISTER, next_pulse=30, queues=["a"])
    [reply, *_] = core.handle(PulseReceived(msg, pid=None, uid=UID), now)
    assert isinstance(reply, Reply) and reply.response.error == pb.CTRL_ERR_OK
    return reply.response.worker_id


def test_an_orphan_counts_again_when_its_queue_s_limit_is_removed_and_set_again():
    core = Core()
    core.limit("a", 1, None, 0.0)
    a = JobOptions(queue="a")
    core.recover(1, 11, b"", None, 0.0, running=True, grace=3.0, options=a)
    core.recover(2, 12, b"", None, 0.0, running=False, options=a)
    core.limit("a", None, None, 0.1)  # removed: nothing counts
    idle = serving_a(core, 0.2)
    pulse(core, idle, 0.2, next_pulse=30)
    assert core.tasks[2].worker_id == idle  # no limit: it runs
    core.limit("a", 1, None, 0.3)  # set again: the orphan and task 2 count (2 of 1)
    old = serving_a(core, 0.4)
    pulse(core, old, 0.4, task_id=11, next_pulse=30)  # its old worker takes it back
    assert core.tasks[1].worker_id == old
    core.submit(13, b"", None, 0.5, a)
    three = core.tasks[max(core.tasks)]
    finish(core, idle, 12, 0.6)  # task 2 ends: the orphan, running, still holds the one place
    assert three.worker_id == 0
    assert core.scheduler.limits.queues["a"].running == 1
    finish(core, old, 11, 0.7)  # the orphan ends: the third starts, and it alone counts
    assert three.worker_id in (idle, old)
    assert core.scheduler.limits.queues["a"].running == 1


def finish(core: Core, wid: int, task_id: int, now: float) -> None:
    """The local worker `wid` ran `task_id`: its SET_TASK answered (if still to be), its
    outcome announced and fetched."""
    if core.workers[wid].state.name == "ASSIGNING":
        answer(core, wid, pb.CTRL_SET_TASK, now, task_id=task_id)
    pulse(core, wid, now, ptype=pb.PULSE_FETCH_ME, task_id=task_id, next_pulse=30)
    answer(core, wid, pb.CTRL_FETCH, now, task_id=task_id, extra=b"done")
    assert all(t.task_id != task_id for t in core.tasks.values())


@pytest.mark.parametrize("end", ["claimed", "grace passed"])
def test_a_job_running_before_a_restart_counts_until_its_worker_claims_it_or_not(end):
    """After a restart a job that was running (journal: working) may still run on its worker:
    at concurrency 1 a new worker that registers first gets nothing of that queue."""
    core = Core()
    core.limit("a", 1, Rate(5, "s"), 0.0)
    a = JobOptions(queue="a")
    core.recover(1, 11, b"", None, 0.0, running=True, grace=3.0, options=a)
    core.recover(2, 12, b"", None, 0.0, running=False, options=a)
    idle = serving_a(core, 0.1)
    pulse(core, idle, 0.1, next_pulse=30)
    assert held(core, "a") == 0 and core.queued == 1  # the new worker waits
    if end == "claimed":  # its old worker comes back with it: it runs there, still alone
        old = serving_a(core, 0.2)
        pulse(core, old, 0.2, task_id=11, next_pulse=30)
        assert core.tasks[1].worker_id == old and held(core, "a") == 1
        assert core.tasks[2].worker_id == 0
    else:
        core.expire(3.0)  # never claimed: it is placed again, and the other still waits
        assert held(core, "a") == 1
        assert [t.ref for t in core.tasks.values() if t.worker_id == idle] == [1]
        assert core.tasks[2].worker_id == 0
    assert core.limits("a") == (1, Rate(5, "s"))


def test_a_limit_set_while_jobs_run_counts_them():
    core = Core()
    for n in (1, 2, 3):
        submit(core, n, "a", 0.0)
    core.pollers.ping("p1", 0.0, BOTH)
    core.pollers.ping("p2", 0.0, BOTH)
    core.limit("a", 2, None, 1.0)
    assert held(core, "a") == 2
    assert handed(core.pollers.ping("p3", 1.0, BOTH)) == {}
    core.limit("a", 3, None, 2.0)  # raised: the waiting poller takes the third
    assert held(core, "a") == 3


# ---------------------------------------------------------------- properties of the pure core

step = st.one_of(
    st.tuples(st.just("submit"), st.sampled_from(["a", "a", "b"])),
    st.tuples(st.just("finish"), st.integers(0, 5)),
    st.tuples(st.just("fail"), st.integers(0, 5)),
    st.tuples(st.just("wait"), st.floats(0.0, 2.0)),
)


def run_steps(core: Core, steps: list[tuple[str, object]], on_start) -> None:
    """Drive `core` with pollers p0..p5 through `steps`, time moving on with "wait"; every
    poller without a job asks for one after each step (work is never short of workers).
    `on_start(now, ref)` for every job handed out."""
    now = 0.0
    n = 0
    refs: dict[str, int] = {}

    def took(actions: list[object]) -> None:
        for name, ref in handed(actions).items():
            refs[name] = ref
            on_start(now, ref)

    for kind, arg in steps:
        if kind == "submit":
            n += 1
            took(submit(core, n, str(arg), now))
        elif kind in ("finish", "fail") and f"p{arg}" in refs:
            name = f"p{arg}"
            ref = refs.pop(name)
            if kind == "finish":
                took(core.pollers.finished(name, ref, b"", now))
            else:
                took(core.pollers.failed(name, ref, "no", now))
        elif kind == "wait":
            assert isinstance(arg, float)
            now += arg
            took(core.expire(now))
        for name in (f"p{i}" for i in range(6)):
            if name not in refs:
                took(core.pollers.ping(name, now, BOTH))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 3), st.lists(step, min_size=5, max_size=80))
def test_a_queue_never_has_more_than_its_concurrency_running(concurrency, steps):
    core = Core(max_retries=100)
    core.limit("a", concurrency, None, 0.0)

    def check(now: float, ref: int) -> None:
        assert held(core, "a") <= concurrency

    run_steps(core, steps, check)
    assert held(core, "a") <= concurrency


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.sampled_from(["s", "m"]), st.lists(step, min_size=5, max_size=80))
def test_no_more_starts_in_a_window_than_the_rate_allows(count, unit, steps):
    core = Core(max_retries=100)
    rate = Rate(count, unit)
    core.limit("a", None, rate, 0.0)
    starts: list[float] = []

    def check(now: float, ref: int) -> None:
        if core.tasks[ref].opts.queue == "a":
            starts.append(now)

    if unit == "m":  # a minute's tokens come 60 times slower: stretch the waits
        steps = [(k, a * 60 if k == "wait" else a) for k, a in steps]
    run_steps(core, steps, check)
    # In any window [t_i, t_j]: at most the bucket's N plus what refills in it.
    for i, first in enumerate(starts):
        for j in range(i, len(starts)):
            allowed = count + (starts[j] - first) * count / rate.per
            assert j - i + 1 <= allowed + 1e-6, (starts, i, j)


# ---------------------------------------------------------------- the HTTP API


async def test_limits_are_set_listed_and_cleared_over_http(sockdir):
    async with http_controller(sockdir, workers=0) as ctl, client(ctl.url) as http:
        resp = await http.put("/queue/mail/", json={"concurrency": 2, "rate": "5/s"})
        assert resp.status_code == 200, resp.text
        assert resp.json() == {
            "mail": {
                "pending": 0,
                "scheduled": 0,
                "working": 0,
                "workers": 0,
                "paused": False,
                "concurrency": 2,
                "rate": "5/s",
            }
        }
        listed = (await http.get("/queue/")).json()
        assert listed["mail"]["concurrency"] == 2  # listed though it has no jobs
        assert listed["mail"]["rate"] == "5/s"
        resp = await http.put("/queue/mail/", json={"rate": None, "paused": True})
        assert resp.json()["mail"]["concurrency"] == 2
        assert resp.json()["mail"]["rate"] is None and resp.json()["mail"]["paused"] is True
        await http.put("/queue/mail/", json={"rate": "30/m"})
        assert (await http.get("/queue/")).json()["mail"]["rate"] == "30/m"
        await http.put("/queue/mail/", json={"concurrency": None, "rate": None, "paused": False})
        assert "mail" not in (await http.get("/queue/")).json()  # no jobs, limit or pause
        # A queue with jobs and no limit shows nulls.
        await http.post("/job/", json={"id": "x", "payload": "x", "queue": "plain"})
        plain = (await http.get("/queue/")).json()["plain"]
        assert plain["concurrency"] is None and plain["rate"] is None


@pytest.mark.parametrize(
    "body",
    [
        {"concurrency": 0},
        {"concurrency": -1},
        {"concurrency": 1.5},
        {"concurrency": 2.0},
        {"concurrency": "2"},
        {"concurrency": True},
        {"concurrency": 10**30},
        {"rate": "0/s"},
        {"rate": "5/h"},
        {"rate": "5"},
        {"rate": "s/5"},
        {"rate": 5},
        {"rate": ""},
        {"rate": " 5/s"},
        {"rate": "5/s "},
        {"rate": "-5/s"},
        {"rate": "1.5/s"},
        {"rate": "\u0665/s"},
        {"rate": "5/sec"},
        {"rate": "9" * 5000 + "/s"},
        {"rate": ["5/s"]},
        {"rate": "5/s", "concurrency": 0, "paused": True},  # nothing of it is applied
        {},
        {"burst": 3},
    ],
)
async def test_bad_limits_are_400_and_change_nothing(sockdir, body):
    async with http_controller(sockdir, workers=0) as ctl, client(ctl.url) as http:
        resp = await http.put("/queue/q/", content=json.dumps(body))
        assert resp.status_code == 400, resp.text
        assert resp.json()["code"] == 400 and resp.json()["message"]
        assert (await http.get("/queue/")).json() == {}


# ---------------------------------------------------------------- real workers


@asynccontextmanager
async def controller_with_workers(
    sockdir: Path, gates: Path, workers: int, journal: Path | None = None
) -> AsyncIterator[tuple[str, Core]]:
    """A controller (HTTP door) and `workers` gated worker processes serving a and b."""
    config = Config(
        socket_dir=sockdir,
        journal=journal,
        client_address=ClientAddress("127.0.0.1", 0),
        http_address=ClientAddress("127.0.0.1", 0),
    )
    store = Journal.open(journal) if journal is not None else None
    ctl = assemble(config, store, store.load() if store is not None else None)
    await ctl.bind()
    ctl.udp.bind()
    assert ctl.http is not None
    async with trio.open_nursery() as nursery:
        await nursery.start(ctl.serve)
        args = ("--handler", "tests.worker_handlers:gated", "--queues", "a,b")
        await start_workers(nursery, sockdir, *args, count=workers, **{GATES: str(gates)})
        await wait_until(lambda: len(ctl.shell.core.workers) == workers)
        host, port = ctl.http.address()
        yield f"http://{host}:{port}", ctl.shell.core
        nursery.cancel_scope.cancel()


def running(gates: Path, prefix: str) -> set[str]:
    """Jobs of `prefix` that started and were not let go yet."""
    started = {p.name.removesuffix(".running") for p in gates.glob(f"{prefix}*.running")}
    return {name for name in started if not (gates / f"{name}.go").exists()}


async def test_real_workers_never_run_two_of_a_queue_at_concurrency_one(sockdir):
    gates = Path(tempfile.mkdtemp(prefix="gates-", dir=sockdir))
    async with (
        controller_with_workers(sockdir, gates, workers=4) as (url, core),
        client(url) as http,
    ):
        assert (await http.put("/queue/a/", json={"concurrency": 1})).status_code == 200
        for name in ("a1", "a2", "a3"):
            await http.post("/job/", json={"id": name, "payload": name, "queue": "a"})
        for name in ("b1", "b2"):
            await http.post("/job/", json={"id": name, "payload": name, "queue": "b"})
        # b's jobs run beside a's one; a's others wait though a worker is idle.
        await wait_until(lambda: running(gates, "b") == {"b1", "b2"})
        await wait_until(lambda: len(running(gates, "a")) == 1)
        report = (await http.get("/queue/")).json()["a"]
        assert (report["working"], report["pending"], report["concurrency"]) == (1, 2, 1)
        assert core.idle_workers == 1
        seen: set[str] = set()
        highest = 0

        async def watch() -> None:
            nonlocal highest
            while True:
                highest = max(highest, (await http.get("/queue/")).json()["a"]["working"])
                await trio.sleep(0.005)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            for _ in range(3):
                await wait_until(lambda: len(running(gates, "a")) == 1)
                [now] = running(gates, "a")
                assert now not in seen
                seen.add(now)
                (gates / f"{now}.go").touch()
            for name in ("a1", "a2", "a3"):
                done = (await http.get(f"/job/{name}/", params={"wait": 10})).json()
                assert done["state"] == "finished"
            nursery.cancel_scope.cancel()
        assert seen == {"a1", "a2", "a3"} and highest == 1
        for name in ("b1", "b2"):
            (gates / f"{name}.go").touch()


# ---------------------------------------------------------------- the journal and jobctl


async def jobctl(url: str, *args: str) -> str:
    done = await trio.run_process(
        [sys.executable, "-m", "controller.client.jobctl", "--url", url, *args],
        capture_stdout=True,
        capture_stderr=True,
        env={**os.environ, "TZ": "UTC0"},
    )
    return done.stdout.decode()


async def test_limits_survive_a_restart_and_jobctl_queues_shows_them(sockdir, tmp_path):
    journal = tmp_path / "journal.sqlite3"
    async with (
        http_controller(sockdir, workers=0, journal=journal) as ctl,
        client(ctl.url) as http,
    ):
        await http.put("/queue/a/", json={"concurrency": 2, "rate": "3/m"})
        await http.put("/queue/b/", json={"concurrency": 1})
        await http.put("/queue/b/", json={"concurrency": None})
        await http.put("/queue/c/", json={"rate": "7/s", "paused": True})
    async with http_controller(sockdir, workers=0, journal=journal) as again:
        async with client(again.url) as http:
            listed = (await http.get("/queue/")).json()
        assert set(listed) == {"a", "c"}
        assert (listed["a"]["concurrency"], listed["a"]["rate"]) == (2, "3/m")
        assert (listed["c"]["concurrency"], listed["c"]["rate"]) == (None, "7/s")
        assert listed["c"]["paused"] is True
        # The limit holds after the restart: a's third start waits for its concurrency.
        assert again.shell.core.limits("a") == (2, Rate(3, "m"))
        table = await jobctl(again.url, "queues")
        header, *rows = [line.split() for line in table.strip().splitlines()]
        assert header[-2:] == ["CONCURRENCY", "RATE"]
        assert {row[0]: row[-2:] for row in rows} == {"a": ["2", "3/m"], "c": ["-", "7/s"]}
        as_json = json.loads(await jobctl(again.url, "--json", "queues"))
        assert as_json["a"]["rate"] == "3/m" and as_json["c"]["concurrency"] is None


async def test_a_restart_keeps_holding_a_queue_at_its_concurrency(sockdir, tmp_path):
    journal = tmp_path / "journal.sqlite3"
    gates = Path(tempfile.mkdtemp(prefix="gates-", dir=sockdir))
    async with http_controller(sockdir, workers=0, journal=journal) as ctl:
        async with client(ctl.url) as http:
            await http.put("/queue/a/", json={"concurrency": 1})
            for name in ("r1", "r2"):
                await http.post("/job/", json={"id": name, "payload": name, "queue": "a"})
        await ctl.desk.write_ahead.committed()
    async with (
        controller_with_workers(sockdir, gates, workers=2, journal=journal) as (url, core),
        client(url) as http,
    ):
        # One runs; the other stays pending though the second worker is idle.
        await wait_until(lambda: len(running(gates, "r")) == 1 and core.idle_workers == 1)
        assert core.queued == 1
        (gates / f"{running(gates, 'r').pop()}.go").touch()
        await wait_until(lambda: len(running(gates, "r")) == 1 and core.idle_workers == 1)
        (gates / f"{running(gates, 'r').pop()}.go").touch()
        for name in ("r1", "r2"):
            done = (await http.get(f"/job/{name}/", params={"wait": 10})).json()
            assert done["state"] == "finished"


async def test_the_console_shows_each_queue_s_limits(sockdir):
    async with http_controller(sockdir, workers=0) as ctl, client(ctl.url) as http:
        await http.put("/queue/mail/", json={"concurrency": 3, "rate": "30/m"})
        await http.post("/job/", json={"id": "x", "payload": "x", "queue": "plain"})
        page = await http.get("/ui/queues")
        assert page.status_code == 200
        shown = section(page, "queues")
        assert "<th>concurrency</th><th>rate</th>" in shown.replace("\n", "")
        mail = shown[shown.index(">mail<") :]
        assert "<td class=num>3</td><td>30/m</td>" in mail[: mail.index("</tr>")]
        plain = shown[shown.index(">plain<") :]
        assert "<td class=num>-</td><td>-</td>" in plain[: plain.index("</tr>")]
        overview = section(await http.get("/"), "overview-queues")
        assert "30/m" in overview

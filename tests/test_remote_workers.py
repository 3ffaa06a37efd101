"""Calculators (worker --udp) and pollers (worker --hub) as real processes on loopback."""

from __future__ import annotations

import collections
import functools
import json
import random
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import trio

from controller.client import Client, JobFailed
from tests.helpers import (
    live_controller,
    lossy_router,
    reap,
    run_udp_client,
    wait_for_condition,
)


def remote_worker(*args: str, execlog: Path | None = None) -> subprocess.Popen[bytes]:
    job = ["--exec", "sh", "-c", f'echo "$TASK_ID" >> {execlog}; cat'] if execlog else []
    cmd = [sys.executable, "-m", "worker", "--log-level", "WARNING", *args, *job]
    return subprocess.Popen(cmd, stderr=subprocess.PIPE)


def health(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/health/", timeout=5) as resp:
        return dict(json.loads(resp.read()))


def executions(execlog: Path) -> collections.Counter[str]:
    return (
        collections.Counter(execlog.read_text().split())
        if execlog.exists()
        else collections.Counter()
    )


def test_three_kinds_side_by_side_every_job_once(tmp_path: Path) -> None:
    execlog = tmp_path / "ran"
    with live_controller(
        tmp_path,
        "--workers",
        "1",
        "--",
        *["--exec", "sh", "-c", f'echo "$TASK_ID" >> {execlog}; cat'],
    ) as ctl:
        calc = remote_worker(
            "--udp", f"127.0.0.1:{ctl.udp_port}", "--pulse", "0.2", execlog=execlog
        )
        poll = remote_worker("--hub", ctl.url, "--name", "p1", "--pulse", "0.5", execlog=execlog)
        try:
            wait_for_condition(lambda: health(ctl.url)["workers"] == 3, 20)
            with Client(ctl.url) as client:
                jobs = [client.submit(f"job{n}") for n in range(60)]
                results = [job.result(timeout=60) for job in jobs]
                listing = json.loads(
                    urllib.request.urlopen(f"{ctl.url}/job/?limit=1000", timeout=5).read()
                )
            out = run_udp_client(ctl.udp_port, "status", "--json")
            status = json.loads(out.stdout)
            shown = run_udp_client(ctl.udp_port, "status").stdout.decode()
        finally:
            reap(calc)
            reap(poll)
    assert results == [f"job{n}".encode() for n in range(60)]
    holders = {job["worker"] for job in listing.values()}
    # udp-client status counts every kind's jobs, the pollers' too (between their pings).
    by_holder = collections.Counter(job["worker"] for job in listing.values())
    kinds = status["kinds"]
    assert kinds["poller"]["done"] == by_holder["p1"] > 0
    calculated = sum(n for h, n in by_holder.items() if h and h.startswith("127.0.0.1:"))
    assert kinds["calculator"]["done"] == calculated > 0
    assert kinds["local"]["done"] == by_holder["1"]
    assert f"idle, done {by_holder['p1']})" in shown.split("poller", 1)[1]
    assert "p1" in holders and any(h and h.startswith("127.0.0.1:") for h in holders)
    assert "1" in holders  # the local worker
    assert all(count == 1 for count in executions(execlog).values())  # no failure: once each
    assert len(executions(execlog)) == 60


def test_calculator_behind_a_lossy_link_runs_every_job_once(tmp_path: Path) -> None:
    execlog = tmp_path / "ran"

    async def main(ctl: Any) -> list[bytes]:
        rng = random.Random(20261126)
        async with trio.open_nursery() as nursery:
            router = await nursery.start(
                functools.partial(
                    lossy_router, rng, ("127.0.0.1", ctl.udp_port), drop=0.3, dup=0.1, reorder=0.2
                )
            )
            calc = remote_worker(
                "--udp", f"127.0.0.1:{router[1]}", "--pulse", "0.2", execlog=execlog
            )
            try:
                with trio.fail_after(60):
                    while health(ctl.url)["workers"] < 1:
                        await trio.sleep(0.05)
                with Client(ctl.url) as client:
                    jobs = [client.submit(f"lossy{n}") for n in range(40)]
                    out = [await trio.to_thread.run_sync(job.result, 90) for job in jobs]
            finally:
                reap(calc)
            nursery.cancel_scope.cancel()
        return out

    # A calculator 30% of whose datagrams are lost is silent now and then: a generous
    # calculator_timeout and dial_timeout keep it alive; no job may run twice meanwhile.
    with live_controller(tmp_path, calculator_timeout=10, dial_timeout=3.0) as ctl:
        results = trio.run(main, ctl)
    assert results == [f"lossy{n}".encode() for n in range(40)]
    counts = executions(execlog)
    assert len(counts) == 40 and max(counts.values()) == 1


def test_killed_calculator_its_job_placed_elsewhere_after_calculator_timeout(
    tmp_path: Path,
) -> None:
    execlog = tmp_path / "ran"
    slow = ["--exec", "sh", "-c", f'echo "$TASK_ID" >> {execlog}; sleep 60']
    with live_controller(tmp_path, calculator_timeout=1.5) as ctl:
        cmd = [
            sys.executable,
            "-m",
            "worker",
            "--udp",
            f"127.0.0.1:{ctl.udp_port}",
            "--pulse",
            "0.2",
            *slow,
        ]
        victim = subprocess.Popen(cmd, stderr=subprocess.PIPE)
        wait_for_condition(lambda: health(ctl.url)["workers"] == 1, 20)
        with Client(ctl.url) as client:
            job = client.submit("x", id="calc-victim")
            wait_for_condition(lambda: client.get("calc-victim").state == "working", 20)
            victim.send_signal(signal.SIGKILL)
            reap(victim)
            rescuer = remote_worker(
                "--udp", f"127.0.0.1:{ctl.udp_port}", "--pulse", "0.2", execlog=execlog
            )
            try:
                assert job.result(timeout=30) == b"x"
            finally:
                reap(rescuer)
            assert client.get("calc-victim").info["attempts"] == 2


def test_killed_poller_its_job_placed_again_after_lease_timeout(tmp_path: Path) -> None:
    with live_controller(tmp_path, lease_timeout=1.5) as ctl:
        victim = remote_worker("--hub", ctl.url, "--name", "victim", "--exec", "sleep", "60")
        with Client(ctl.url) as client:
            job = client.submit("y", id="poll-victim")
            wait_for_condition(lambda: client.get("poll-victim").state == "working", 20)
            victim.send_signal(signal.SIGKILL)
            reap(victim)
            rescuer = remote_worker("--hub", ctl.url, "--name", "rescuer")
            try:
                assert job.result(timeout=30) == b"y"
            finally:
                reap(rescuer)
            done = client.get("poll-victim")
            assert done.info["worker"] == "rescuer" and done.info["attempts"] == 2


def test_a_canceled_job_stops_on_its_poller(tmp_path: Path) -> None:
    with live_controller(tmp_path) as ctl:
        poller = remote_worker(
            "--hub", ctl.url, "--name", "p", "--pulse", "0.2", "--exec", "sleep", "60"
        )
        try:
            with Client(ctl.url) as client:
                client.submit("z", id="stop-me")
                wait_for_condition(lambda: client.get("stop-me").state == "working", 20)
                assert client.cancel("stop-me").state == "canceled"
                # The poller sees 409 at its next lease PUT, stops the job, asks again.
                client.submit("after", id="next-one")
                wait_for_condition(lambda: client.get("next-one").state == "working", 20)
        finally:
            reap(poller)


def test_controller_killed_while_remote_workers_hold_jobs_loses_nothing(tmp_path: Path) -> None:
    execlog = tmp_path / "ran"
    slow = ["--exec", "sh", "-c", f'echo "$TASK_ID" >> {execlog}; sleep 1; cat']
    with live_controller(tmp_path) as first:
        url, udp_port = first.url, first.udp_port
        calc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "worker",
                "--udp",
                f"127.0.0.1:{udp_port}",
                "--pulse",
                "0.2",
                *slow,
            ],
            stderr=subprocess.PIPE,
        )
        poll = subprocess.Popen(
            [sys.executable, "-m", "worker", "--hub", url, "--name", "p", "--pulse", "0.2", *slow],
            stderr=subprocess.PIPE,
        )
        try:
            wait_for_condition(lambda: health(url)["workers"] == 2, 20)
            with Client(url) as client:
                ids = [client.submit(f"held{n}", id=f"held-{n}").id for n in range(6)]
                wait_for_condition(
                    lambda: sum(client.get(i).state == "working" for i in ids) == 2, 20
                )
            first.proc.kill()  # SIGKILL while both remote workers hold a job
            first.proc.wait()
            config = tmp_path / "controller.json"
            from tests.helpers import controller_argv

            second = subprocess.Popen(
                controller_argv(config, log_level="WARNING"), stderr=subprocess.DEVNULL
            )
            try:
                wait_for_condition(lambda: _answers(url), 20)
                with Client(url) as client:
                    results = [client.get(i).result(timeout=60) for i in ids]
            finally:
                reap(second)
        finally:
            reap(calc)
            reap(poll)
    assert results == [f"held{n}".encode() for n in range(6)]
    counts = executions(execlog)
    assert len(counts) == 6  # every job ran
    # The two held at the kill are claimed back by the workers that hold them (no second run),
    # unless their reports miss the 3 s recovery grace on a slow machine.
    assert sum(counts.values()) <= 6 + 2, counts


def _answers(url: str) -> bool:
    try:
        health(url)
        return True
    except OSError:
        return False


@pytest.mark.parametrize("kind", ["calculator", "poller"])
def test_sigterm_finishes_and_reports_the_running_job_then_exits_0(
    tmp_path: Path, kind: str
) -> None:
    with live_controller(tmp_path) as ctl:
        where = (
            ["--udp", f"127.0.0.1:{ctl.udp_port}"] if kind == "calculator" else ["--hub", ctl.url]
        )
        cmd = [
            sys.executable,
            "-m",
            "worker",
            *where,
            "--pulse",
            "0.2",
            "--exec",
            "sh",
            "-c",
            "sleep 1; cat",
        ]
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE)
        try:
            wait_for_condition(lambda: health(ctl.url)["workers"] == 1, 20)
            with Client(ctl.url) as client:
                job = client.submit("drained", id="drain-me")
                wait_for_condition(lambda: client.get("drain-me").state == "working", 20)
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(timeout=20) == 0
                assert job.result(timeout=5) == b"drained"
        finally:
            reap(proc)


def test_pollers_lease_puts_carry_what_the_job_writes_to_stderr(tmp_path: Path) -> None:
    with live_controller(tmp_path) as ctl:
        script = "echo first >&2; sleep 0.6; echo second >&2; sleep 0.6; cat"
        poller = remote_worker("--hub", ctl.url, "--name", "talker", "--pulse", "0.2",
                               "--exec", "sh", "-c", script)  # fmt: skip
        try:
            with Client(ctl.url) as client:
                job = client.submit("quiet result", id="talky")
                assert job.result(timeout=20) == b"quiet result"
                log = "".join(client.get("talky").info["log"])
        finally:
            reap(poller)
    assert "first" in log and "second" in log


def test_a_result_too_large_for_a_datagram_is_reported_as_an_error(tmp_path: Path) -> None:
    with live_controller(tmp_path, max_retries=0) as ctl:
        big = ["--exec", "sh", "-c", "head -c 70000 /dev/zero"]  # 70 kB: over 60,000 encoded
        calc = remote_worker("--udp", f"127.0.0.1:{ctl.udp_port}", "--pulse", "0.2", *big)
        try:
            wait_for_condition(lambda: health(ctl.url)["workers"] == 1, 20)
            with Client(ctl.url) as client:
                job = client.submit("x")
                with pytest.raises(JobFailed) as info:
                    job.result(timeout=20)
        finally:
            reap(calc)
    assert "too large for one datagram" in info.value.error


def test_every_kind_declares_its_queues_and_labels_and_the_controller_shows_them(
    tmp_path: Path,
) -> None:
    with live_controller(
        tmp_path, "--workers", "1", "--", "--queues", "local.q,default", "--labels", "ssd"
    ) as ctl:
        calc = remote_worker(
            "--udp", f"127.0.0.1:{ctl.udp_port}", "--pulse", "0.2", "--queues", "calc-q",
            "--labels", "gpu,x_1",
        )  # fmt: skip
        poll = remote_worker("--hub", ctl.url, "--name", "p1", "--queues", "poll.q,b")
        plain = remote_worker("--hub", ctl.url, "--name", "p2")
        seen: dict[str, Any] = {}

        def all_declared() -> bool:
            report = json.loads(run_udp_client(ctl.udp_port, "status", "--json").stdout)
            seen.update(
                {w["kind"] + w["name"]: (w["queues"], w["labels"]) for w in report["workers"]}
            )
            return len(seen) == 4

        try:
            wait_for_condition(all_declared, 30)
            shown = run_udp_client(ctl.udp_port, "status").stdout.decode()
            with urllib.request.urlopen(f"{ctl.url}/", timeout=5) as resp:
                page = resp.read().decode()
        finally:
            reap(calc)
            reap(poll)
            reap(plain)
    [local] = [key for key in seen if key.startswith("local")]
    assert seen[local] == ("default,local.q", "ssd")
    [calculator] = [key for key in seen if key.startswith("calculator")]
    assert seen[calculator] == ("calc-q", "gpu,x_1")
    assert seen["pollerp1"] == ("b,poll.q", "")
    assert seen["pollerp2"] == ("default", "")
    assert "default,local.q / ssd" in shown and "calc-q / gpu,x_1" in shown
    assert "<td>calc-q</td><td>gpu,x_1</td>" in page and "<td>default,local.q</td>" in page


def test_a_poller_with_a_bad_declaration_is_refused_with_the_error_object(tmp_path: Path) -> None:
    with live_controller(tmp_path) as ctl:
        url = f"{ctl.url}/ping/?worker=p&wait=0&queues=ok,Not-Ok"
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(url, timeout=5)
        error = json.loads(caught.value.read())
        assert caught.value.code == 400 and error["code"] == 400
        assert "queues: a name must match" in error["message"]
        assert health(ctl.url)["workers"] == 0


def test_each_job_runs_only_on_a_worker_of_its_queue_with_its_labels(tmp_path: Path) -> None:
    """Real workers of the three kinds, each serving its own queue or label: every job runs
    on one that may take it, and a job nobody may take waits, pending."""
    with live_controller(
        tmp_path, "--workers", "1", "--", "--queues", "local", "--exec", "sh", "-c", "echo local"
    ) as ctl:
        calc = remote_worker(
            "--udp", f"127.0.0.1:{ctl.udp_port}", "--pulse", "0.2", "--queues", "calc",
            "--exec", "sh", "-c", "echo calc",
        )  # fmt: skip
        poll = remote_worker(
            "--hub", ctl.url, "--name", "gpu", "--labels", "gpu", "--exec", "sh", "-c", "echo gpu"
        )
        try:
            with Client(ctl.url) as client:
                jobs = {
                    "local": [client.submit(b"", queue="local") for _ in range(5)],
                    "calc": [client.submit(b"", queue="calc") for _ in range(5)],
                    "gpu": [client.submit(b"", requires=["gpu"]) for _ in range(5)],
                }
                stuck = client.submit(b"", queue="nobody")
                for where, batch in jobs.items():
                    for job in batch:
                        assert job.result(timeout=30).strip() == where.encode()
                assert client.get(stuck.id).state == "pending"
                with urllib.request.urlopen(f"{ctl.url}/queue/", timeout=5) as resp:
                    queues = json.loads(resp.read())
                assert queues["nobody"]["pending"] == 1 and queues["nobody"]["workers"] == 0
        finally:
            reap(calc)
            reap(poll)


@pytest.mark.parametrize("kind", ["calculator", "poller"])
def test_a_remote_workers_usage_reaches_the_job(tmp_path: Path, kind: str) -> None:
    """What an attempt used travels with its outcome from calculators (`params.usage`) and
    pollers (`usage` in the final PUT), as from local workers."""
    with live_controller(tmp_path, max_retries=0) as ctl:
        where = (
            ["--udp", f"127.0.0.1:{ctl.udp_port}"] if kind == "calculator" else ["--hub", ctl.url]
        )
        busy = ["--exec", "sh", "-c", "i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done; cat"]
        worker = remote_worker(*where, "--pulse", "0.2", *busy)
        try:
            wait_for_condition(lambda: health(ctl.url)["workers"] == 1, 20)
            with Client(ctl.url) as client:
                job = client.submit("counted", id=f"used-{kind}")
                assert job.result(timeout=30) == b"counted"
                usage = client.get(f"used-{kind}").info["usage"]
        finally:
            reap(worker)
    assert usage is not None and usage["wall"] > 0 and usage["cpu"] > 0, usage
    assert usage["max_rss"] > 100_000, usage


def test_a_pollers_usage_that_cannot_be_true_is_a_bad_field(tmp_path: Path) -> None:
    with live_controller(tmp_path) as ctl, Client(ctl.url) as client:
        client.submit("x", id="x")
        for usage in (
            {"wall": -1, "cpu": 0, "max_rss": 1},
            {"wall": 1},
            [1, 2, 3],
            {"wall": 1, "cpu": 1, "max_rss": 2**64},
        ):
            body = json.dumps({"state": "finished", "worker": "w", "usage": usage}).encode()
            request = urllib.request.Request(f"{ctl.url}/job/x/", data=body, method="PUT")
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(request, timeout=10)
            assert info.value.code == 400, usage
            assert "usage" in json.loads(info.value.read())["message"]

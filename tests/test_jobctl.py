"""`jobctl` end to end: each command against a live controller (one local worker running a
shell script), its table and its --json, exit codes, bearer tokens and bad usage."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import selectors
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from controller.client import Client
from controller.client.jobctl_tables import cut, table, when
from tests.helpers import LiveController, free_tcp_port, live_controller, wait_for_condition

# The worker's script: "fail..." fails (its stderr says why); "wait FILE" writes "started"
# to stderr, returns once FILE exists (bounded) and writes "ending"; anything else is echoed.
SCRIPT = """#!/bin/sh
input=$(cat)
case "$input" in
  fail*) echo "it failed" >&2; exit 3;;
  wait*) echo "started" >&2; f=${input#wait }; n=0
         while [ ! -e "$f" ] && [ $n -lt 600 ]; do sleep 0.05; n=$((n+1)); done
         echo "ending" >&2;;
esac
printf %s "$input"
"""
QUEUES = "default,lq,rq,pq,oq"


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveController]:
    tmp: Path = tmp_path_factory.mktemp("jobctl")
    script = tmp / "job.sh"
    script.write_text(SCRIPT)
    script.chmod(0o755)
    args = ("--workers", "1", "--", "--queues", QUEUES, "--exec", str(script))
    with live_controller(tmp, *args, max_retries=0) as ctl:
        yield ctl


@pytest.fixture
def client(live: LiveController) -> Iterator[Client]:
    with Client(live.url) as client:
        yield client


def jobctl(url: str | None, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run `jobctl [--url URL] ARGS...` to its end, in UTC (so that times can be checked)."""
    cmd = [sys.executable, "-m", "controller.client.jobctl"]
    if url is not None:
        cmd += ["--url", url]
    env = {**os.environ, "TZ": "UTC0"}
    return subprocess.run(
        cmd + list(args), capture_output=True, text=True, timeout=timeout, env=env
    )


def api(url: str, path: str) -> Any:
    with urllib.request.urlopen(url + path, timeout=10) as resp:
        return json.loads(resp.read())


def rows(table: str) -> list[list[str]]:
    """A table's lines, split into cells (no cell of these tests holds two spaces)."""
    return [re.split(r"\s{2,}", line.strip()) for line in table.strip().splitlines()]


def ended(client: Client, job_id: str, state: str) -> None:
    wait_for_condition(lambda: client.get(job_id).state == state, 20)


def one_line_error(result: subprocess.CompletedProcess[str], *words: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jobctl"), result.stderr
    for word in words:
        assert word in lines[0], result.stderr


# ---------------------------------------------------------------- formatting


def test_times_are_local_and_shortened() -> None:
    zone = dt.timezone(dt.timedelta(hours=2))
    now = dt.datetime(2026, 11, 27, 12, 0, tzinfo=zone)
    local = {"today": "2026-11-27T08:30:05Z", "year": "2026-03-01T23:10:00Z"}
    with_zone = {key: dt.datetime.fromisoformat(value).astimezone() for key, value in local.items()}
    assert when(local["today"], with_zone["today"]) == with_zone["today"].strftime("%H:%M:%S")
    assert when(local["year"], with_zone["today"]) == with_zone["year"].strftime("%b %d %H:%M")
    assert when("2024-01-02T03:04:05Z", now) == "2024-01-02"
    assert when(None, now) == "-" and when("not a time", now) == "not a time"


def test_cells_are_one_line_and_cut() -> None:
    assert cut("a" * 40) == "a" * 35 + "…"
    assert cut("two\nlines\tand tabs") == "two lines and tabs"
    assert cut(None) == "-" and cut("") == "-" and cut(0) == "0"
    assert table(["A", "BB"], [["xyz", "1"], ["p", ""]]).splitlines() == [
        "A    BB",
        "xyz  1",
        "p",
    ]


# ---------------------------------------------------------------- help and usage


def test_help_shows_examples_and_every_command() -> None:
    result = jobctl(None, "--help")
    assert result.returncode == 0
    assert "examples:" in result.stdout and "jobctl retry --failed --queue" in result.stdout
    for name in ("list", "show", "cancel", "retry", "delete", "pause", "resume", "queues"):
        assert re.search(rf"^\s+{name}\s", result.stdout, re.M), name
    sub = jobctl(None, "list", "--help")
    assert sub.returncode == 0 and "--state" in sub.stdout and "examples:" in sub.stdout
    version = jobctl(None, "--version")
    assert version.returncode == 0 and version.stdout.startswith("jobctl ")


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["frobnicate"],
        ["show"],
        ["cancel"],
        ["pause"],
        ["retry"],
        ["retry", "a", "--failed"],
        ["retry", "a", "--queue", "q"],
        ["list", "--limit", "0"],
        ["list", "--limit", "1001"],
        ["--timeout", "0", "queues"],
        ["--url", "ftp://127.0.0.1:8080", "queues"],
        ["--token-file", "/nonexistent/token", "queues"],
        ["--ca-file", "/nonexistent/ca.pem", "queues"],  # with an http:// URL
    ],
)
def test_bad_usage_exits_2_without_asking(args: list[str]) -> None:
    # The port is closed: a command that did ask the controller would exit 3.
    result = jobctl(f"http://127.0.0.1:{free_tcp_port()}", *args)
    assert result.returncode == 2, result
    assert result.stdout == "" and "Traceback" not in result.stderr


def test_unreachable_controller_exits_3() -> None:
    result = jobctl(f"http://127.0.0.1:{free_tcp_port()}", "list")
    assert result.returncode == 3
    one_line_error(result, "list", "refused")


def test_no_answer_in_time_exits_3() -> None:
    with socket.socket() as silent:  # accepts connections (the backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        result = jobctl(url, "--timeout", "0.5", "show", "x")
        assert result.returncode == 3
        assert time.monotonic() - started < 20
        one_line_error(result, "show x", "no answer within 0.5 s")


# ---------------------------------------------------------------- list and show


def test_list_table_and_json(live: LiveController, client: Client) -> None:
    for n in range(3):
        client.submit(f"hello {n}", id=f"list-{n}", name=f"job {n}", queue="lq", priority=n)
    for n in range(3):
        ended(client, f"list-{n}", "finished")
    result = jobctl(live.url, "list", "--queue", "lq")
    assert result.returncode == 0, result.stderr
    header, *body = rows(result.stdout)
    assert header == ["ID", "STATE", "QUEUE", "PRI", "TRIES", "WORKER", "NAME", "UPDATED"]
    assert [row[0] for row in body] == ["list-2", "list-1", "list-0"]  # newest first
    listing = api(live.url, "/job/?queue=lq")
    for row in body:
        job = listing[row[0]]
        assert row[1:5] == ["finished", "lq", str(job["priority"]), str(job["attempts"])]
        assert row[6] == job["name"]
        # Today's time of day, in the local zone (UTC here).
        assert row[7] == job["updated_at"][11:19], (row, job["updated_at"])
    as_json = jobctl(live.url, "--json", "list", "--queue", "lq")
    assert as_json.returncode == 0
    assert json.loads(as_json.stdout) == listing
    # The global options are taken after the command too.
    limited = jobctl(live.url, "list", "--queue", "lq", "--limit", "1", "--json")
    assert list(json.loads(limited.stdout)) == ["list-2"]
    assert jobctl(live.url, "list", "--state", "failed", "--queue", "lq").stdout == ""


def test_list_with_a_bad_state_is_a_usage_error_naming_the_controllers_message(
    live: LiveController,
) -> None:
    result = jobctl(live.url, "list", "--state", "sleepy")
    assert result.returncode == 2
    one_line_error(result, "list: 400", "sleepy")


def test_long_fields_are_cut_in_the_table(live: LiveController, client: Client) -> None:
    long_id = "long-" + "x" * 60
    client.submit("x", id=long_id, name="n" * 80, queue="oq")
    ended(client, long_id, "finished")
    result = jobctl(live.url, "list", "--queue", "oq")
    [row] = rows(result.stdout)[1:]
    assert row[0] == long_id[:35] + "…" and len(row[6]) == 24 and row[6].endswith("…")


def test_show_a_job_and_a_failed_one(live: LiveController, client: Client) -> None:
    client.submit("hi there", id="show-ok", name="greeting")
    ended(client, "show-ok", "finished")
    result = jobctl(live.url, "show", "show-ok")
    assert result.returncode == 0
    fields = dict(re.split(r"\s+", line, maxsplit=1) for line in result.stdout.splitlines())
    assert fields["id"] == "show-ok" and fields["state"] == "finished"
    assert fields["result"] == "hi there" and fields["name"] == "greeting"
    job = api(live.url, "/job/show-ok/")
    assert fields["added_at"].endswith(f"({job['added_at']})")
    as_json = jobctl(live.url, "show", "show-ok", "--json")
    assert json.loads(as_json.stdout) == job

    client.submit("fail now", id="show-failed")
    ended(client, "show-failed", "failed")
    failed = jobctl(live.url, "show", "show-failed")
    assert failed.returncode == 0  # the command worked: the job's failure is its state
    assert re.search(r"^state\s+failed$", failed.stdout, re.M)
    assert re.search(r"^error\s+.*it failed", failed.stdout, re.M)


def test_show_an_unknown_job_exits_1_with_the_api_message(live: LiveController) -> None:
    for args in (["show", "no-such-job"], ["--json", "show", "no-such-job"]):
        result = jobctl(live.url, *args)
        assert result.returncode == 1 and result.stdout == ""
        one_line_error(result, "show no-such-job: 404", "no job 'no-such-job'")


# ---------------------------------------------------------------- cancel, delete, retry


def test_cancel_running_pending_and_final_jobs(
    live: LiveController, client: Client, tmp_path: Path
) -> None:
    client.submit("done", id="cancel-done")
    ended(client, "cancel-done", "finished")
    gate = tmp_path / "gate"
    client.submit(f"wait {gate}", id="cancel-running")
    ended(client, "cancel-running", "working")
    client.submit("x", id="cancel-pending", queue="pq-none")  # no worker serves it

    result = jobctl(live.url, "cancel", "cancel-running", "cancel-pending")
    assert result.returncode == 0, result.stderr
    assert [row[:2] for row in rows(result.stdout)[1:]] == [
        ["cancel-running", "canceled"],
        ["cancel-pending", "canceled"],
    ]
    # Canceling a canceled job again is no change; a finished one cannot be canceled (409),
    # an unknown one is 404: each said on its own line, the rest still done, exit 1.
    mixed = jobctl(live.url, "--json", "cancel", "cancel-done", "cancel-pending", "nope")
    assert mixed.returncode == 1
    assert list(json.loads(mixed.stdout)) == ["cancel-pending"]
    assert json.loads(mixed.stdout)["cancel-pending"]["state"] == "canceled"
    errors = mixed.stderr.strip().splitlines()
    assert len(errors) == 2
    assert errors[0].startswith("jobctl: cancel cancel-done: 409 ")
    assert errors[1].startswith("jobctl: cancel nope: 404 ")
    assert client.get("cancel-done").state == "finished"


def test_delete_jobs(live: LiveController, client: Client) -> None:
    client.submit("x", id="delete-me")
    ended(client, "delete-me", "finished")
    result = jobctl(live.url, "delete", "delete-me", "--json")
    assert result.returncode == 0
    job = json.loads(result.stdout)["delete-me"]
    assert job["state"] == "deleted" and "result" not in job
    again = jobctl(live.url, "delete", "delete-me")  # the same answer again
    assert again.returncode == 0 and rows(again.stdout)[1][:2] == ["delete-me", "deleted"]
    missing = jobctl(live.url, "delete", "never-was")
    assert missing.returncode == 1
    one_line_error(missing, "delete never-was: 404")


def test_retry_named_jobs(live: LiveController, client: Client) -> None:
    client.submit("fail once", id="retry-me")
    ended(client, "retry-me", "failed")
    before = client.get("retry-me").info["attempts"]
    result = jobctl(live.url, "retry", "retry-me", "--json")
    assert result.returncode == 0, result.stderr
    assert list(json.loads(result.stdout)) == ["retry-me"]
    # It runs again (and fails again: its payload says so).
    wait_for_condition(lambda: client.get("retry-me").info["attempts"] > before, 20)
    ended(client, "retry-me", "failed")
    table = jobctl(live.url, "retry", "retry-me")
    assert table.returncode == 0 and rows(table.stdout)[1][0] == "retry-me"
    ended(client, "retry-me", "failed")
    client.submit("fine", id="retry-finished")
    ended(client, "retry-finished", "finished")
    refused = jobctl(live.url, "retry", "retry-finished")
    assert refused.returncode == 1
    one_line_error(refused, "retry retry-finished: 409", "only a failed or canceled job")


def test_retry_every_failed_job_of_a_queue(live: LiveController, client: Client) -> None:
    ids = [f"bulk-{n}" for n in range(3)]
    for job_id in [*ids, "bulk-other"]:
        client.submit(
            "fail in bulk", id=job_id, queue="default" if job_id == "bulk-other" else "rq"
        )
    for job_id in [*ids, "bulk-other"]:
        ended(client, job_id, "failed")
    attempts = {job_id: client.get(job_id).info["attempts"] for job_id in [*ids, "bulk-other"]}

    result = jobctl(live.url, "retry", "--failed", "--queue", "rq", "--json")
    assert result.returncode == 0, result.stderr
    assert sorted(json.loads(result.stdout)) == ids
    assert result.stderr.splitlines()[0] == "jobctl: retrying 3 failed job(s) of queue rq"

    def tried_again() -> bool:
        return all(client.get(j).info["attempts"] > attempts[j] for j in ids)

    wait_for_condition(tried_again, 20)
    assert client.get("bulk-other").info["attempts"] == attempts["bulk-other"]
    assert client.get("bulk-other").state == "failed"

    nothing = jobctl(live.url, "retry", "--failed", "--queue", "no-such-queue")
    assert nothing.returncode == 0 and nothing.stdout == ""
    assert nothing.stderr == "jobctl: no failed jobs of queue no-such-queue\n"


# ---------------------------------------------------------------- queues


def test_pause_resume_and_queues(live: LiveController, client: Client) -> None:
    paused = jobctl(live.url, "pause", "pq")
    assert paused.returncode == 0, paused.stderr
    assert rows(paused.stdout) == [
        ["QUEUE", "PENDING", "SCHEDULED", "WORKING", "WORKERS", "PAUSED", "CONCURRENCY", "RATE"],
        ["pq", "0", "0", "0", "1", "yes", "-", "-"],
    ]
    job = client.submit("held", id="paused-job", queue="pq")
    report = json.loads(jobctl(live.url, "queues", "--json").stdout)
    assert report == api(live.url, "/queue/")
    assert report["pq"] == {
        "pending": 1,
        "scheduled": 0,
        "working": 0,
        "workers": 1,
        "paused": True,
        "concurrency": None,
        "rate": None,
    }
    table = {row[0]: row for row in rows(jobctl(live.url, "queues").stdout)}
    assert table["pq"] == ["pq", "1", "0", "0", "1", "yes", "-", "-"]
    assert table["QUEUE"][0] == "QUEUE"

    resumed = jobctl(live.url, "--json", "resume", "pq")
    assert resumed.returncode == 0
    assert json.loads(resumed.stdout)["pq"]["paused"] is False
    assert job.result(timeout=20) == b"held"

    bad = jobctl(live.url, "pause", "No Such!")
    assert bad.returncode == 2
    one_line_error(bad, "pause No Such!: 400")


# ---------------------------------------------------------------- job output


def read_until(proc: subprocess.Popen[bytes], wanted: bytes, timeout: float = 20) -> bytes:
    """What `proc` printed, read as it comes until `wanted` shows (or the deadline)."""
    assert proc.stdout is not None
    seen = b""
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        while wanted not in seen and time.monotonic() < deadline:
            if selector.select(deadline - time.monotonic()):
                piece = os.read(proc.stdout.fileno(), 65536)
                if not piece:
                    break
                seen += piece
    return seen


def test_output_and_follow(live: LiveController, client: Client, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    client.submit(f"wait {gate}", id="output-job")
    ended(client, "output-job", "working")
    cmd = [sys.executable, "-m", "controller.client.jobctl", "--url", live.url]
    argv = [*cmd, "output", "output-job", "--follow"]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as follow:
        try:
            assert b"started" in read_until(follow, b"started")
            assert follow.poll() is None  # it goes on while the job runs
            gate.write_text("go")
            out, err = follow.communicate(timeout=30)
        finally:
            gate.write_text("go")  # the job ends whatever happened here
            if follow.poll() is None:
                follow.kill()
    assert follow.returncode == 0, err
    assert b"ending" in out
    assert client.get("output-job").state == "finished"
    whole = jobctl(live.url, "output", "output-job")
    assert whole.returncode == 0
    assert whole.stdout.splitlines()[-2:] == ["started", "ending"]
    missing = jobctl(live.url, "output", "no-such-job")
    assert missing.returncode == 1
    one_line_error(missing, "output no-such-job: 404")


# ---------------------------------------------------------------- tokens


def test_bearer_token_from_a_file(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("# operators\ns3cret\nother\n")
    tokens.chmod(0o600)
    mine = tmp_path / "mine"
    mine.write_text("other\n")
    wrong = tmp_path / "wrong"
    wrong.write_text("guess\n")
    with live_controller(tmp_path, "--workers", "0", http_token_file=str(tokens)) as ctl:
        refused = jobctl(ctl.url, "queues")
        assert refused.returncode == 1
        one_line_error(refused, "queues: 401", "--token-file")
        assert jobctl(ctl.url, "--token-file", str(wrong), "list").returncode == 1
        ok = jobctl(ctl.url, "--token-file", str(mine), "list", "--json")
        assert ok.returncode == 0 and json.loads(ok.stdout) == {}
        # The controller's own file works too: its first token, past the comment.
        same = jobctl(ctl.url, "queues", "--token-file", str(tokens), "--json")
        assert same.returncode == 0 and json.loads(same.stdout) == {}


def test_follow_prints_each_chunk_as_it_comes() -> None:
    """`output --follow` against a stand-in server whose chunked answer the test writes piece
    by piece: each piece is printed before the next is sent, and the end of the answer ends
    the command."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        cmd = [sys.executable, "-m", "controller.client.jobctl", "--url", url]
        argv = [*cmd, "output", "a job/1", "--follow"]
        with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as follow:
            try:
                listener.settimeout(20)
                conn, _ = listener.accept()
                with conn:
                    conn.settimeout(20)
                    request = b""
                    while b"\r\n\r\n" not in request:
                        request += conn.recv(4096)
                    assert request.startswith(b"GET /job/a%20job%2F1/output?follow=1 HTTP/1.1\r\n")
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; charset=utf-8\r\n"
                        b"Transfer-Encoding: chunked\r\n\r\n8\r\nstarted\n\r\n"
                    )
                    assert read_until(follow, b"started\n") == b"started\n"
                    conn.sendall(b"7\r\nending\n\r\n")
                    assert read_until(follow, b"ending\n") == b"ending\n"
                    assert follow.poll() is None
                    conn.sendall(b"0\r\n\r\n")
                    out, err = follow.communicate(timeout=20)
            finally:
                if follow.poll() is None:
                    follow.kill()
    assert follow.returncode == 0 and out == b"" and err == b""

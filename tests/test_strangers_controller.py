"""Jobs as strangers, the controller's side (DESIGN.md section 15): job users per slot, the
config's `job_users` and `job_limits`, sockets that answer only whom they should, and each
attempt's usage and reason.

Root tests use numeric uids with no passwd entry (62001...): a process is given one with
setpriv, in a group of its own and no other, as a job would run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from controller.config import ConfigError, parse_config
from controller.joblimits import JobLimits
from controller.shell.core_shell import StartupError
from controller.shell.main import slot_job_users
from controller.shell.supervisor import Supervisor
from tests.helpers import controller_argv, wait_until, write_config

JOB_UID = 62001
ROOT = os.getuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="needs root: runs processes as other uids")

# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("value", "slots"),
    [
        ("controller-job-{slot}", ["controller-job-0", "controller-job-1", "controller-job-2"]),
        ([62001, "62002", "alice", 62004], ["62001", "62002", "alice"]),
        (None, [None, None, None]),
    ],
)
def test_job_users_give_each_slot_its_user(value, slots):
    config = parse_config({"job_users": value})
    assert slot_job_users(config, 3, []) == slots


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("controller-job", "holding {slot}"),
        ([], "non-empty list"),
        ([0], "uid 0"),
        (["root"], "never run as root"),
        ([True], "a user name or a uid"),
        ([1.5], "a user name or a uid"),
        (["a b"], "is not a user name"),
        (["-x"], "is not a user name"),
        ([62001, "62001"], "the same user twice"),
        ({"x": 1}, "must be null"),
    ],
)
def test_bad_job_users_are_refused_naming_the_key(value, message):
    with pytest.raises(ConfigError, match="job_users") as caught:
        parse_config({"job_users": value})
    assert message in str(caught.value)


def test_job_limits_are_read_with_their_units():
    config = parse_config({"job_limits": {"memory_max": "256M", "tasks_max": 64, "cpu_time": 60}})
    assert config.job_limits == JobLimits(memory_max=256 << 20, tasks_max=64, cpu_time=60.0)
    assert parse_config({}).job_limits.is_empty()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"memory": "1G"}, "unknown limit 'memory'"),
        ({"memory_max": "lots"}, "memory_max"),
        ({"tasks_max": 0}, "tasks_max"),
        ({"cpu_time": -1}, "cpu_time"),
        ("256M", "must be an object"),
    ],
)
def test_bad_job_limits_are_refused_naming_the_key(value, message):
    with pytest.raises(ConfigError, match="job_limits") as caught:
        parse_config({"job_limits": value})
    assert message in str(caught.value)


def test_fewer_job_users_than_slots_is_a_start_error():
    config = parse_config({"job_users": [62001, 62002]})
    with pytest.raises(StartupError, match="names 2 users, but --workers 3"):
        slot_job_users(config, 3, [])
    with pytest.raises(StartupError, match="in one place"):
        slot_job_users(config, 2, ["--job-user", "x"])


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"job_users": [62001]}, "names 1 users, but --workers 2"),
        ({"job_limits": {"open_files": "many"}}, "key 'job_limits' open_files"),
        ({"job_users": "nobody"}, "key 'job_users'"),
    ],
)
def test_the_controller_refuses_to_start_with_bad_job_settings(tmp_path, settings, words):
    config = write_config(tmp_path, socket_dir=str(tmp_path / "s"), **settings)
    run = subprocess.run(
        controller_argv(config, "--workers", "2"), capture_output=True, timeout=60, text=True
    )
    assert run.returncode == 2, run.stderr
    assert words in run.stderr
    assert "Traceback" not in run.stderr


async def test_each_supervised_slot_gets_its_job_user(tmp_path):
    """`controller --workers N` passes slot i's job user as `--job-user` to its worker."""
    script = 'printf "%s\\n" "$@" > "$0.$$"; exec sleep 30'
    argv = ["sh", "-c", script, str(tmp_path / "argv")]
    supervisor = Supervisor(3, argv, job_users=["62001", "62002", "62003"])
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        await wait_until(lambda: len(list(tmp_path.glob("argv.*"))) == 3)
        await wait_until(lambda: all(p.read_text() for p in tmp_path.glob("argv.*")))
        nursery.cancel_scope.cancel()
    seen = sorted(p.read_text().split() for p in tmp_path.glob("argv.*"))
    assert seen == [["--job-user", "62001"], ["--job-user", "62002"], ["--job-user", "62003"]]
    assert Supervisor(2, ["w"]).slot_argv(1) == ["w"]  # job_users null: none passed


def _unused() -> None:  # keep imports used while the file grows
    _ = (sys, Path)

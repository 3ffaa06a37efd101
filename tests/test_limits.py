"""Per-job and per-process limits that need no server: the log's size, the throttled
warning for running out of descriptors, the descriptor limit raised at start."""

from __future__ import annotations

import logging
import resource

import pytest

from controller.jobs import Job
from controller.shell.descriptors import LOG_EVERY, Throttled, raise_nofile_limit


def _job() -> Job:
    return Job("j", 1, 1, "http", None)


def _size(job: Job) -> int:
    return sum(len(line.encode("utf-8", "surrogatepass")) for line in job.log)


def test_the_oldest_log_entries_go_first_whole():
    job = _job()
    for line in ("aaaa", "bbbb", "cccc"):
        job.add_log(line, limit=10)
    assert job.log == ["bbbb", "cccc"]
    job.add_log("dd", limit=10)
    assert job.log == ["bbbb", "cccc", "dd"] and _size(job) == 10
    job.add_log("e", limit=10)
    assert job.log == ["cccc", "dd", "e"]


def test_an_entry_longer_than_the_limit_keeps_its_newest_bytes():
    job = _job()
    job.add_log("old", limit=5)
    job.add_log("0123456789", limit=5)
    assert job.log == ["56789"]


def test_a_cut_never_splits_a_character_and_lone_surrogates_count_as_three_bytes():
    job = _job()
    job.add_log("x" + "é" * 5, limit=5)  # 11 bytes; the cut falls inside an é
    assert job.log == ["éé"] and _size(job) == 4
    job = _job()
    job.add_log("\udc80\udc80", limit=6)
    assert job.log == ["\udc80\udc80"]


def test_many_small_entries_stay_within_the_limit():
    job = _job()
    for i in range(20_000):
        job.add_log(str(i), limit=1000)
    assert _size(job) <= 1000 and job.log[-1] == "19999"


def test_throttled_logs_the_first_then_a_count_per_interval(caplog):
    warn = Throttled(logging.getLogger("test.throttled"), "cannot accept")
    with caplog.at_level(logging.WARNING, "test.throttled"):
        for now in (0.0, 1.0, 2.0, LOG_EVERY - 0.001):
            warn("Too many open files", now)
        assert len(caplog.records) == 1
        warn("Too many open files", LOG_EVERY)
    assert len(caplog.records) == 2 and "4 times" in caplog.records[1].getMessage()
    assert warn.count == 5


def test_the_soft_descriptor_limit_is_raised_to_the_hard_one():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:
        if hard <= 64:
            pytest.skip("the hard limit is too low to lower the soft one")
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard - 1, hard))
        soft = hard - 1
    try:
        assert raise_nofile_limit() == (soft, hard)
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_packaged_config_allows_no_calculators_and_make_runs_allows_loopback():
    import ipaddress
    from pathlib import Path

    from controller.config import load_config

    packaging = Path(__file__).resolve().parent.parent / "packaging"
    assert load_config(packaging / "controller.json").allowed_calculators == ()
    dev = load_config(packaging / "dev.json").allowed_calculators
    assert any(ipaddress.ip_address("127.0.0.1") in net for net in dev)
    assert any(ipaddress.ip_address("::1") in net for net in dev)

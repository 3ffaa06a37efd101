"""The job of `python -m bench.peers --lengths`: its arithmetic, the handler, and bench/work.sh."""

from __future__ import annotations

import subprocess
import time

import pytest

from bench import peers_lengths, work


def test_efficiency_is_jobs_per_s_over_workers_per_length() -> None:
    # 2 workers, 10 ms jobs: 200 jobs/s is everything they can do.
    assert work.efficiency(200, 2, 0.01) == pytest.approx(1.0)
    assert work.efficiency(500, 2, 0.001) == pytest.approx(0.25)


def test_jobs_for_keeps_the_workers_busy_for_the_seconds_asked() -> None:
    assert peers_lengths.jobs_for(0.001, 3.0) == 6000
    assert peers_lengths.jobs_for(0.01, 3.0) == 600
    assert peers_lengths.jobs_for(0.03, 1.0) == 67  # rounded up


def test_loop_iterations_take_the_scripts_start_out_of_the_probe() -> None:
    # 20,000 iterations took 21 ms of which 1 ms was the start: 1 us each.
    assert work.loop_iterations(0.001, 0.001, 20_000, 0.021) == 1000
    assert work.loop_iterations(0.010, 0.0, 20_000, 0.020) == 10_000
    assert work.loop_iterations(1e-9, 0.0, 20_000, 0.020) == 1
    with pytest.raises(ValueError, match="no longer"):
        work.loop_iterations(0.001, 0.002, 20_000, 0.002)


@pytest.mark.parametrize("kind", work.KINDS)
def test_the_handler_lasts_at_least_the_length_it_is_given(kind: str) -> None:
    start = time.perf_counter()
    assert work.run(f"{kind} 0.005".encode()) == b""
    assert time.perf_counter() - start >= 0.005


def test_the_handler_refuses_an_unknown_kind() -> None:
    with pytest.raises(ValueError, match="unknown kind"):
        work.run(b"nap 0.001")


def _script(line: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(peers_lengths.SCRIPT_ARGV, input=line.encode(), capture_output=True)


def test_the_script_sleeps_and_loops_as_its_line_says() -> None:
    start = time.perf_counter()
    assert _script("sleep 0.02").returncode == 0
    assert time.perf_counter() - start >= 0.02
    assert _script("busy 100").returncode == 0
    assert peers_lengths.script_line("busy", 0.001, {"busy_iterations": {"1 ms": 7}}) == "busy 7"
    assert peers_lengths.script_line("sleep", 0.001, {}) == "sleep 0.001"


def test_the_script_fails_on_a_line_it_does_not_know() -> None:
    done = _script("nap 1")
    assert done.returncode == 2
    assert b"unknown job: nap" in done.stderr

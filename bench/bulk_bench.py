"""Bulk submission against one request a job, through the HTTP door and the Python client.

10,000 no-op jobs (empty payloads) submitted with `Client.submit_many` (one `POST /job/`
with an array) and with `Client.submit` in a loop (one `POST /job/` a job), alternating in
one run, on a controller with its journal on and 2 local no-op workers that run the jobs as
they come. What is timed is the submission: from the first request until every job is
answered (journaled). Between rounds the controller's queue drains. The target (issue #42):
bulk at least 5 times the jobs/s of one request a job.
"""

from __future__ import annotations

import time
from typing import Any

from bench.common import socket_dir
from bench.e2e_bench import HANDLER
from controller.client import Client
from tests.helpers import live_controller, wait_for_condition

JOBS = 10_000
ROUNDS = 2
TARGET = 5.0


def _bulk(client: Client, jobs: int) -> float:
    start = time.perf_counter()
    made = client.submit_many([b""] * jobs)
    elapsed = time.perf_counter() - start
    assert len(made) == jobs
    return jobs / elapsed


def _single(client: Client, jobs: int) -> float:
    start = time.perf_counter()
    for _ in range(jobs):
        client.submit(b"")
    return jobs / (time.perf_counter() - start)


def _drained(client: Client) -> None:
    """Wait until the controller has no job pending (the previous round's have run)."""
    http = client._http
    assert http is not None
    wait_for_condition(lambda: http.request("GET", "/health/").json()["pending"] == 0, 120)


def main(jobs: int = JOBS, rounds: int = ROUNDS) -> dict[str, Any]:
    figures: dict[str, list[float]] = {"bulk": [], "single": []}
    with (
        socket_dir() as tmp,
        live_controller(
            tmp, "--workers", "2", "--", "--handler", HANDLER, "--log-level", "ERROR"
        ) as ctl,
        Client(ctl.url) as client,
    ):
        client.submit_many([b""] * 500)  # warm up both paths
        for _ in range(500):
            client.submit(b"")
        for _ in range(rounds):
            for label, run in (("bulk", _bulk), ("single", _single)):
                _drained(client)
                figures[label].append(run(client, jobs))
    bulk, single = max(figures["bulk"]), max(figures["single"])
    ratio = bulk / single
    print(
        f"HTTP bulk submission, {jobs:,} no-op jobs, journal on: submit_many (one request) "
        f"{', '.join(f'{r:,.0f}' for r in figures['bulk'])} jobs/s; submit one request a job "
        f"{', '.join(f'{r:,.0f}' for r in figures['single'])} jobs/s; ratio {ratio:.1f}x "
        f"[target >= {TARGET:g}x]",
        flush=True,
    )
    return {
        "bulk_jobs_per_s": [round(r) for r in figures["bulk"]],
        "single_jobs_per_s": [round(r) for r in figures["single"]],
        "ratio": round(ratio, 2),
    }


if __name__ == "__main__":
    main()

"""The no-op job and the job of a given length (bench/work.py's `do`) for each peer (Huey,
Celery, Dramatiq, RQ, Gearman), and the client side of `make bench-peers`. Runs in the peers'
own venv (.venv-peers), never in ours: nothing here imports the controller.

    python peers_tasks.py measure SYSTEM JOBS ONE_AT_A_TIME   -> one JSON line
    python peers_tasks.py lengths SYSTEM ROUNDS JSON          -> one JSON line
    python peers_tasks.py gearman-worker                     -> a Gearman worker

`lengths` takes a JSON list of [label, payload, jobs] (payload `sleep SECONDS` or `busy
SECONDS`; for the system `gearman-cmd`, Gearman's command worker running bench/work.sh, the
script's own line) and answers {label: jobs/s}, each the median of ROUNDS rounds.

The Redis URL comes from PEERS_REDIS (each system its own database), the Gearman port from
PEERS_GEARMAN_PORT. The worker processes are started (and stopped, by pid) by bench/peers.py.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import work  # type: ignore[import-not-found]  # bench/work.py (bench/ is on PYTHONPATH)

REDIS = os.environ.get("PEERS_REDIS", "redis://127.0.0.1:6379")
GEARMAN = f"127.0.0.1:{os.environ.get('PEERS_GEARMAN_PORT', '4730')}"
TIMEOUT = 120


def _db(n: int) -> str:
    return f"{REDIS}/{n}"


# ---------------------------------------------------------------- Huey (database 1)
try:
    from huey import RedisHuey

    huey = RedisHuey("bench", url=_db(1))

    @huey.task()
    def huey_noop() -> bytes:
        return b""

    @huey.task()
    def huey_work(kind: str, seconds: float) -> bytes:
        work.do(kind, seconds)
        return b""
except ImportError:  # pragma: no cover (only in the peers' venv)
    pass

# ---------------------------------------------------------------- Celery (database 2)
try:
    from celery import Celery

    celery_app = Celery("peers_tasks", broker=_db(2), backend=_db(2))
    celery_app.conf.update(worker_prefetch_multiplier=4, broker_connection_retry_on_startup=True)

    @celery_app.task
    def celery_noop() -> str:
        return ""

    @celery_app.task
    def celery_work(kind: str, seconds: float) -> str:
        work.do(kind, seconds)
        return ""
except ImportError:  # pragma: no cover
    pass

# ---------------------------------------------------------------- Dramatiq (database 3)
try:
    import dramatiq
    from dramatiq.brokers.redis import RedisBroker
    from dramatiq.results import Results
    from dramatiq.results.backends import RedisBackend

    _broker = RedisBroker(url=_db(3))
    _broker.add_middleware(Results(backend=RedisBackend(url=_db(3))))
    dramatiq.set_broker(_broker)

    @dramatiq.actor(store_results=True)
    def dramatiq_noop() -> str:
        return ""

    @dramatiq.actor(store_results=True)
    def dramatiq_work(kind: str, seconds: float) -> str:
        work.do(kind, seconds)
        return ""
except ImportError:  # pragma: no cover
    pass


# ---------------------------------------------------------------- RQ (database 4)
def rq_noop() -> bytes:
    return b""


def rq_work(kind: str, seconds: float) -> bytes:
    work.do(kind, seconds)
    return b""


# ---------------------------------------------------------------- the client side


def _gearman_task(system: str, payload: str) -> tuple[str, str]:
    """The Gearman function and its data: a no-op, the Python worker's `work` or the command
    worker's `work_cmd`."""
    if not payload:
        return "noop", ""
    return ("work_cmd" if system == "gearman-cmd" else "work"), payload


def _submit_and_wait(
    system: str, payload: str = ""
) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    """(submit one job, wait for a submitted job's result) for `system`: a no-op, or with a
    payload `KIND SECONDS` that job."""
    kind, seconds = payload.split() if payload else ("", "0")
    args = (kind, float(seconds))
    if system == "huey":
        submit = (lambda: huey_work(*args)) if payload else huey_noop
        return submit, lambda r: r.get(blocking=True, timeout=TIMEOUT)
    if system == "celery":
        submit = (lambda: celery_work.delay(*args)) if payload else celery_noop.delay
        return submit, lambda r: r.get(timeout=TIMEOUT)
    if system == "dramatiq":
        submit = (lambda: dramatiq_work.send(*args)) if payload else dramatiq_noop.send
        return submit, lambda m: m.get_result(block=True, timeout=TIMEOUT * 1000)
    if system == "rq":
        import redis
        from rq import Queue

        queue = Queue("bench", connection=redis.Redis.from_url(_db(4)))
        if payload:
            return lambda: queue.enqueue(rq_work, *args), lambda job: _rq_wait(job)
        return lambda: queue.enqueue(rq_noop), lambda job: _rq_wait(job)
    if system in ("gearman", "gearman-cmd"):
        import python3_gearman as gearman

        client = gearman.GearmanClient([GEARMAN])
        task, data = _gearman_task(system, payload)
        return (
            lambda: client.submit_job(task, data, background=False, wait_until_complete=False),
            lambda request: client.wait_until_jobs_completed([request], poll_timeout=TIMEOUT),
        )
    raise SystemExit(f"unknown system {system!r}")


def _throughput(system: str, jobs: int, payload: str = "", rounds: int = 1) -> float:
    """Jobs/s: `jobs` submitted, then every result collected (after 20 jobs one at a time,
    which also wait for the workers to be ready); with `rounds`, the median of that many
    rounds of `jobs // rounds`."""
    submit, wait = _submit_and_wait(system, payload)
    for _ in range(20):
        wait(submit())
    count = max(1, jobs // rounds)
    return statistics.median(_round(system, count, payload, submit, wait) for _ in range(rounds))


def _round(
    system: str,
    jobs: int,
    payload: str,
    submit: Callable[[], Any],
    wait: Callable[[Any], None],
) -> float:
    start = time.perf_counter()
    if system.startswith("gearman"):  # its client takes a batch and waits for all of it
        import python3_gearman as gearman

        client = gearman.GearmanClient([GEARMAN])
        task, data = _gearman_task(system, payload)
        for first in range(0, jobs, 500):
            batch = [{"task": task, "data": data} for _ in range(min(500, jobs - first))]
            done = client.submit_multiple_jobs(
                batch, wait_until_complete=True, poll_timeout=TIMEOUT
            )
            failed = [r for r in done if r.state != gearman.JOB_COMPLETE]
            if failed:
                raise RuntimeError(f"{len(failed)} Gearman jobs ended {failed[0].state}")
    else:
        pending = [submit() for _ in range(jobs)]
        for handle in pending:
            wait(handle)
    return jobs / (time.perf_counter() - start)


def lengths(system: str, rounds: int, rows: list[list[Any]]) -> dict[str, float]:
    """Jobs/s of each [label, payload, jobs] in `rows`: the median of `rounds` rounds."""
    return {label: _throughput(system, jobs, payload, rounds) for label, payload, jobs in rows}


def _rq_wait(job: Any) -> None:
    result = job.latest_result(timeout=TIMEOUT)
    if result is None:
        raise TimeoutError(f"rq job {job.id} did not end")


def measure(system: str, jobs: int, one_at_a_time: int) -> dict[str, Any]:
    rate = _throughput(system, jobs)
    submit, wait = _submit_and_wait(system)
    latencies = []
    for _ in range(one_at_a_time):
        begin = time.perf_counter()
        wait(submit())
        latencies.append(time.perf_counter() - begin)
    latencies.sort()
    return {
        "jobs_per_s": round(rate),
        "p50_ms": round(statistics.median(latencies) * 1000, 3),
        "p99_ms": round(latencies[int(len(latencies) * 0.99) - 1] * 1000, 3),
    }


def gearman_worker() -> None:
    import python3_gearman as gearman

    worker = gearman.GearmanWorker([GEARMAN])
    worker.register_task("noop", lambda _worker, _job: "")
    worker.register_task("work", _gearman_work)
    worker.work()


def _gearman_work(_worker: Any, job: Any) -> str:
    kind, seconds = job.data.split()
    work.do(kind, float(seconds))
    return ""


if __name__ == "__main__":
    # Run as a script, but the tasks must be named after the module the workers import.
    import peers_tasks  # type: ignore[import-not-found]

    if sys.argv[1] == "gearman-worker":
        peers_tasks.gearman_worker()
    elif sys.argv[1] == "lengths":
        rates = peers_tasks.lengths(sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]))
        print(json.dumps(rates), flush=True)
    else:
        figures = peers_tasks.measure(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        print(json.dumps(figures), flush=True)

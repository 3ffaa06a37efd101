"""The no-op job for each peer (Huey, Celery, Dramatiq, RQ, Gearman), and the client side of
`make bench-peers`. Runs in the peers' own venv (.venv-peers), never in ours: nothing here
imports the controller.

    python peers_tasks.py measure SYSTEM JOBS ONE_AT_A_TIME   -> one JSON line
    python peers_tasks.py gearman-worker                     -> a Gearman worker

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
except ImportError:  # pragma: no cover
    pass


# ---------------------------------------------------------------- RQ (database 4)
def rq_noop() -> bytes:
    return b""


# ---------------------------------------------------------------- the client side


def _submit_and_wait(system: str) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    """(submit one no-op job, wait for a submitted job's result) for `system`."""
    if system == "huey":
        return huey_noop, lambda r: r.get(blocking=True, timeout=TIMEOUT)
    if system == "celery":
        return celery_noop.delay, lambda r: r.get(timeout=TIMEOUT)
    if system == "dramatiq":
        return dramatiq_noop.send, lambda m: m.get_result(block=True, timeout=TIMEOUT * 1000)
    if system == "rq":
        import redis
        from rq import Queue

        queue = Queue("bench", connection=redis.Redis.from_url(_db(4)))
        return lambda: queue.enqueue(rq_noop), lambda job: _rq_wait(job)
    if system == "gearman":
        import python3_gearman as gearman

        client = gearman.GearmanClient([GEARMAN])
        return (
            lambda: client.submit_job("noop", "", background=False, wait_until_complete=False),
            lambda request: client.wait_until_jobs_completed([request], poll_timeout=TIMEOUT),
        )
    raise SystemExit(f"unknown system {system!r}")


def _rq_wait(job: Any) -> None:
    result = job.latest_result(timeout=TIMEOUT)
    if result is None:
        raise TimeoutError(f"rq job {job.id} did not end")


def measure(system: str, jobs: int, one_at_a_time: int) -> dict[str, Any]:
    submit, wait = _submit_and_wait(system)
    for _ in range(20):  # warm up (and wait for the workers to be ready)
        wait(submit())
    start = time.perf_counter()
    if system == "gearman":  # its client takes a batch and waits for all of it
        import python3_gearman as gearman

        client = gearman.GearmanClient([GEARMAN])
        for first in range(0, jobs, 500):
            batch = [{"task": "noop", "data": ""} for _ in range(min(500, jobs - first))]
            client.submit_multiple_jobs(batch, wait_until_complete=True, poll_timeout=TIMEOUT)
    else:
        pending = [submit() for _ in range(jobs)]
        for handle in pending:
            wait(handle)
    rate = jobs / (time.perf_counter() - start)
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
    worker.work()


if __name__ == "__main__":
    # Run as a script, but the tasks must be named after the module the workers import.
    import peers_tasks  # type: ignore[import-not-found]

    if sys.argv[1] == "gearman-worker":
        peers_tasks.gearman_worker()
    else:
        figures = peers_tasks.measure(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        print(json.dumps(figures), flush=True)

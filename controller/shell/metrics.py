"""The optional Prometheus endpoint (`metrics_address`), with prometheus_client.

Histograms are observed in the event loop as tasks start and finish; the rest
is copied from the core's counters once a second by a trio task, so the HTTP
thread that prometheus_client runs only ever reads its own thread-safe metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from controller.config import ClientAddress
from controller.core import Core, TaskFinished, TaskProgress, TaskState
from controller.usage import Usage

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

# Seconds between copies of the core's counters into the exported metrics.
REFRESH_INTERVAL = 1.0
# Latency buckets from 0.5 ms (an idle system) to a minute (a long queue).
BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


# Queues (and labels) with a series of their own at most: names come from workers.
MAX_NAMED = 200


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        # Imported here: a controller without metrics_address does not load it (3 MB of RSS).
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.outcomes = Counter(
            "controller_tasks", "Finished tasks by outcome", ["outcome"], registry=r
        )
        self.queued = Gauge("controller_queue_depth", "Tasks waiting for a worker", registry=r)
        self.running = Gauge("controller_tasks_running", "Tasks on a worker", registry=r)
        self.scheduled = Gauge(
            "controller_tasks_scheduled", "Tasks waiting for their time (delay, retry)", registry=r
        )
        self.workers = Gauge("controller_workers", "Live workers", registry=r)
        self.idle = Gauge("controller_workers_idle", "Idle workers", registry=r)
        self.by_kind = Gauge(
            "controller_workers_by_kind",
            "Live workers of each kind (local, calculator, poller)",
            ["kind"],
            registry=r,
        )
        self.by_queue = Gauge(
            "controller_queue_workers", "Live workers serving each queue", ["queue"], registry=r
        )
        self.by_label = Gauge(
            "controller_label_workers", "Live workers with each label", ["label"], registry=r
        )
        self.paused = Gauge(
            "controller_queue_paused", "1 while a queue is paused", ["queue"], registry=r
        )
        self.retries = Counter(
            "controller_retries", "Tasks placed again after a failure", registry=r
        )
        self.losses = Counter(
            "controller_worker_losses", "Workers dropped, by cause", ["cause"], registry=r
        )
        self.placement = Histogram(
            "controller_placement_seconds",
            "Time from queued to accepted by a worker",
            buckets=BUCKETS,
            registry=r,
        )
        self.end_to_end = Histogram(
            "controller_task_seconds",
            "Time from submitted to finished",
            buckets=BUCKETS,
            registry=r,
        )
        self.job_cpu = Counter(
            "controller_job_cpu_seconds",
            "CPU seconds (user + system) jobs' attempts used, as local workers measured",
            registry=r,
        )
        self.job_wall = Counter(
            "controller_job_wall_seconds",
            "Wall-clock seconds of jobs' attempts, as local workers measured",
            registry=r,
        )
        self.job_failures = Counter(
            "controller_job_failures",
            "Jobs that failed, by reason (limit, error, timeout, lost, placement)",
            ["reason"],
            registry=r,
        )
        self.redis_up = Gauge(
            "controller_redis_up", "1 while the Redis stream door reaches Redis", registry=r
        )
        self.redis_lag = Gauge(
            "controller_redis_lag",
            "Entries of the Redis stream not yet read by any controller of the group",
            registry=r,
        )
        self.redis_pending = Gauge(
            "controller_redis_pending",
            "Entries of the Redis stream read by the group, not yet acknowledged",
            registry=r,
        )
        # The Redis door's status(), when there is one.
        self.redis_status: Callable[[], dict[str, Any]] | None = None
        self._seen: dict[str, float] = {}
        # Queue and label names given series so far (at most MAX_NAMED each: workers name
        # them, and a series is never dropped).
        self._queues_seen: set[str] = set()
        self._labels_seen: set[str] = set()

    def serve(self, address: ClientAddress) -> Any:
        """Start the HTTP endpoint in prometheus_client's own daemon thread."""
        from prometheus_client import start_http_server

        server, _thread = start_http_server(address.port, addr=address.host, registry=self.registry)
        return server

    def task_started(self, progress: TaskProgress) -> None:
        if progress.state is TaskState.RUNNING:
            self.placement.observe(progress.waited)

    def task_finished(self, finished: TaskFinished) -> None:
        self.outcomes.labels(finished.state.value).inc()
        self.end_to_end.observe(finished.age)
        if finished.reason:
            self.job_failures.labels(finished.reason).inc()

    def attempt_used(self, usage: Usage) -> None:
        """What one attempt used (a local worker's report)."""
        self.job_cpu.inc(usage.cpu)
        self.job_wall.inc(usage.wall)

    def refresh(self, core: Core) -> None:
        self.queued.set(core.queued)
        self.running.set(len(core.tasks) - core.queued - core.scheduled)
        self.scheduled.set(core.scheduled)
        self.workers.set(len(core.workers))
        self.idle.set(core.idle_workers)
        kinds = {"local": 0, "calculator": 0, "poller": 0}
        for worker in core.workers.values():  # once a second: a scan is fine
            kinds[worker.kind.label] = kinds.get(worker.kind.label, 0) + 1
        for kind, count in kinds.items():
            self.by_kind.labels(kind).set(count)
        queues: dict[str, int] = dict.fromkeys(self._queues_seen, 0)
        labels: dict[str, int] = dict.fromkeys(self._labels_seen, 0)
        for worker in core.workers.values():
            for name in worker.queues:
                if name in queues or len(queues) < MAX_NAMED:
                    queues[name] = queues.get(name, 0) + 1
            for name in worker.labels:
                if name in labels or len(labels) < MAX_NAMED:
                    labels[name] = labels.get(name, 0) + 1
        paused = core.paused
        for name in paused:
            if len(queues) < MAX_NAMED:
                queues.setdefault(name, 0)
        for name, count in queues.items():  # a queue seen once stays, at 0 workers
            self.by_queue.labels(name).set(count)
            self.paused.labels(name).set(1 if name in paused else 0)
        for name, count in labels.items():
            self.by_label.labels(name).set(count)
        self._queues_seen.update(queues)
        self._labels_seen.update(labels)
        self._advance(self.retries, "retries", core.counters.retries)
        for cause, total in core.counters.worker_losses.items():
            self._advance(self.losses.labels(cause), f"loss:{cause}", total)
        if self.redis_status is not None:
            redis = self.redis_status()
            self.redis_up.set(1 if redis["connected"] else 0)
            if redis["lag"] is not None:
                self.redis_lag.set(redis["lag"])
            if redis["pending"] is not None:
                self.redis_pending.set(redis["pending"])

    def _advance(self, counter: Any, key: str, total: float) -> None:
        delta = total - self._seen.get(key, 0)
        if delta > 0:
            counter.inc(delta)
            self._seen[key] = total

    async def run(self, core: Core) -> None:
        while True:
            self.refresh(core)
            await trio.sleep(REFRESH_INTERVAL)

"""The Redis door's streams, one per queue (docs/redis.md, "Queues"): which it reads, how many
entries each may bring, and the entries held aside because no worker here can take them.

Queue `default` is the configured stream (`jobs`), queue `q` the stream `jobs.q`. A
controller reads only the streams of the queues its workers serve (a lane is made, and its
group created, when a worker first serves its queue), and from each only as many entries as
it can start soon: the idle workers that serve the queue plus a prefetch, less what this
controller already holds of that queue and has not started.

An entry that none of this controller's workers could take (its `requires` names a label
none of them has) is *parked*: held, neither run nor refused, and not kept fresh, so that
after `claim_after` a controller with such a worker claims it. Parked entries still count
against their lane's room, so that a controller never hoards a stream it cannot serve.
Nothing here does I/O: the door asks, and carries out what it decides.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from controller.core import Core
from controller.core.model import Worker, WorkerState
from controller.doors.redis import codec
from controller.doors.redis.stream_calls import Entry
from controller.job_ids import DoorName
from controller.job_states import JobState
from controller.jobs import Job
from controller.options import DEFAULT_QUEUE, OPTION_NAMES, BadOption, JobOptions, parse

# Entries read beyond the idle workers, so that a worker never waits for a round trip.
PREFETCH = 10

# An entry's fields that carry job options (as text), by their bytes.
OPTION_FIELDS = {name.encode(): name for name in OPTION_NAMES}


@dataclass(eq=False, slots=True)
class Lane:
    """One queue's stream, as this controller reads it."""

    queue: str
    stream: str
    defaults: JobOptions  # the door's default options, with this queue
    ready: bool = False  # its group is set up and our own pending entries read again
    # Why its stream key cannot be read ("" when it can: it holds a stream or nothing), and
    # when it is tried again (trio time) after waiting `backoff` seconds: meanwhile the
    # lane is left out of reads and claims, and the other lanes go on.
    failing: str = ""
    retry_at: float = 0.0
    backoff: float = 0.0
    failures: int = 0  # times in a row it failed (its log lines are rate-limited by it)


@dataclass(eq=False, slots=True)
class Parked:
    """An entry held aside: no worker here can take its job (yet)."""

    entry: Entry
    options: JobOptions
    lane: Lane


@dataclass(eq=False, slots=True)
class Lanes:
    """Every lane this controller has read, by queue and by stream, and what it parked."""

    stream: str  # the configured stream: queue `default`
    defaults: JobOptions
    by_queue: dict[str, Lane] = field(default_factory=dict)
    by_stream: dict[str, Lane] = field(default_factory=dict)
    parked: dict[str, Parked] = field(default_factory=dict)  # job id -> its parked entry

    def lane(self, queue: str) -> Lane:
        """The lane of `queue` (made on first use)."""
        lane = self.by_queue.get(queue)
        if lane is None:
            defaults = self.defaults
            if queue != defaults.queue:
                defaults = replace(defaults, queue=queue)
            lane = Lane(queue, codec.queue_stream(self.stream, queue), defaults)
            self.by_queue[queue] = lane
            self.by_stream[lane.stream] = lane
        return lane

    def served(self, workers: Iterable[Worker]) -> list[Lane]:
        """The lanes of the queues these workers serve, `default` first when it is one."""
        queues: set[str] = set()
        for worker in workers:
            queues |= worker.queues
        return [self.lane(queue) for queue in sorted(queues, key=lambda q: (q != DEFAULT_QUEUE, q))]

    def unready(self) -> None:
        """After a failure: every lane sets up its group and reads its own entries again."""
        for lane in self.by_queue.values():
            lane.ready = False

    def rooms(
        self, served: list[Lane], core: Core, held: Iterable[Job | None]
    ) -> dict[Lane, tuple[int, int]]:
        """Per lane `served`: how many more entries this controller can start soon, and how
        many of its queue wait here. With one lane, the core's counts (every door's
        queued jobs, every idle worker); with several, per queue: the idle workers serving
        it, less the jobs `held` of that queue not started yet; parked entries count too."""
        if len(served) == 1:
            waiting = core.queued + len(self.parked)
            return {served[0]: (core.idle_workers + PREFETCH - waiting, waiting)}
        free = free_by_queue(core.workers.values())
        counts = dict.fromkeys(served, 0)
        by_queue = {lane.queue: lane for lane in served}
        for job in held:
            if job is not None and job.door == DoorName.REDIS and job.state is JobState.PENDING:
                lane = by_queue.get(job.options.queue)
                if lane is not None:
                    counts[lane] += 1
        for parked in self.parked.values():
            if parked.lane in counts:
                counts[parked.lane] += 1
        return {
            lane: (free.get(lane.queue, 0) + PREFETCH - waiting, waiting)
            for lane, waiting in counts.items()
        }


def entry_options(
    fields: dict[bytes, bytes], lane: Lane, stream: str, now_wall: float
) -> JobOptions:
    """The job options among an entry's fields (text), over its lane's defaults. A `queue`
    field must name the lane's own queue: the stream says which queue an entry is in, and
    an entry that says otherwise was added to the wrong stream. Raises BadOption."""
    given: dict[str, str] = {}
    for key, value in fields.items():
        name = OPTION_FIELDS.get(key)
        if name is not None:
            try:
                given[name] = value.decode()
            except UnicodeDecodeError:
                raise BadOption(f"{name} is not UTF-8 text") from None
    if not given:
        return lane.defaults
    options = parse(given, lane.defaults, now_wall, text=True)
    if options.queue != lane.queue:
        raise BadOption(
            f"queue {options.queue!r} given in stream {lane.stream!r}, which is queue "
            f"{lane.queue!r}: its stream is {codec.queue_stream(stream, options.queue)!r}"
        )
    return options


def can_take(workers: Iterable[Worker], options: JobOptions) -> bool:
    """Whether one of `workers` serves the job's queue and has every label it requires."""
    queue, requires = options.queue, options.requires
    return any(queue in w.queues and requires <= w.labels for w in workers)


def free_by_queue(workers: Iterable[Worker]) -> dict[str, int]:
    """Idle workers per queue they serve (a worker serving two counts for both)."""
    free: dict[str, int] = {}
    for worker in workers:
        if worker.state is WorkerState.IDLE:
            for queue in worker.queues:
                free[queue] = free.get(queue, 0) + 1
    return free

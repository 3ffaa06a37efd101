"""The controller's assembly: every part it is made of and every connection between them.

`assemble` is the one place that builds the parts a configuration asks for and connects
them; nothing else assigns a part's hooks. Read it top to bottom to see the controller:

- `WriteAhead` (shell/durability.py): answers held until the journal has what they announce;
- `CoreShell` (shell/core_shell.py): the pure `Core` on main.sock, the workers' links and
  channels, and the core's timer;
- `JobDesk` (shell/desk.py): the job book, the journal and the core, for every door;
- the doors (doors/): UDP always (and the calculators' link inside it), HTTP with
  `http_address` (the job API, the pollers' endpoints, the console), Redis with `redis`;
- `Committer` (shell/committer.py) with a journal, and `JournalRefusals` (shell/refusals.py),
  what the desk does with changes the journal could not store;
- `PeriodicJobs` (shell/schedules.py), with `RedisClaims` when several hosts share a stream;
- `Metrics` (shell/metrics.py) with `metrics_address`.

`Controller.bind` opens every listening socket before anything runs (so that a start-up
error is a plain `StartupError`), `Controller.serve` starts the parts in their order.
The `controller` command (controller/main.py) adds the local workers' supervisor,
systemd's notifications and the signals.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from controller.config import Config
from controller.doors.udp.shell import UdpDoor
from controller.errors import StartupError
from controller.job_ids import DoorName
from controller.jobs import JobBook
from controller.journal import Journal
from controller.journal_file import Recovered
from controller.shell.committer import Committer
from controller.shell.core_shell import CoreShell
from controller.shell.desk import JobDesk
from controller.shell.desk_ports import Door
from controller.shell.durability import WriteAhead, commit_load
from controller.shell.metrics import Metrics
from controller.shell.recovery import recover
from controller.shell.refusals import JournalRefusals
from controller.shell.schedules import Claims, PeriodicJobs

if TYPE_CHECKING:  # imported when configured: hypercorn and redis-py weigh about 20 MB
    from controller.doors.http.shell import HttpDoor
    from controller.doors.redis.door import RedisDoor


@dataclass(eq=False)
class Controller:
    """The assembled parts (see the module's docstring); doors not configured are None."""

    config: Config
    journal: Journal | None
    recovered: Recovered | None
    shell: CoreShell
    desk: JobDesk
    udp: UdpDoor
    http: HttpDoor | None
    redis: RedisDoor | None
    committer: Committer | None
    periodic: PeriodicJobs
    metrics: Metrics | None
    _metrics_server: Any = None
    _bound: bool = False

    async def bind(self) -> None:
        """Listen on every socket, or raise StartupError (once; `serve` calls it too). The
        HTTP door first and main.sock next: local workers, and tests, take main.sock as the
        sign that the doors are up."""
        if self._bound:
            return
        self._bound = True
        if self.http is not None:
            self.http.bind()
        await self.shell.bind()
        self.udp.bind()
        address = self.config.metrics_address
        if self.metrics is not None and address is not None:
            try:
                self._metrics_server = self.metrics.serve(address)
            except OSError as exc:
                raise StartupError(
                    f"metrics_address {address.host}:{address.port}: {exc.strerror}"
                ) from None

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run every part until cancelled; started once the journal's jobs are back and every
        door serves."""
        await self.bind()
        try:
            async with trio.open_nursery() as nursery:
                if self.committer is not None:
                    await nursery.start(self.committer.run)
                await nursery.start(self.desk.run)
                if self.recovered is not None:
                    recover(self.desk, self.recovered, trio.current_time())
                await nursery.start(self.shell.serve)
                await nursery.start(self.udp.serve)
                if self.http is not None:
                    await nursery.start(self.http.serve)
                if self.redis is not None:
                    await nursery.start(self.redis.run)
                if self.config.schedules:  # after recovery: a job made before a crash is known
                    await nursery.start(self.periodic.run)
                if self.metrics is not None:
                    nursery.start_soon(self.metrics.run, self.shell.core)
                task_status.started()
        finally:
            if self._metrics_server is not None:
                self._metrics_server.shutdown()
                self._metrics_server = None


def assemble(
    config: Config,
    journal: Journal | None = None,
    recovered: Recovered | None = None,
    metrics: Metrics | None = None,
    busy_poll: float | None = 0.0,
) -> Controller:
    """Build the parts `config` asks for and connect them. Call it inside trio.run (the job
    book reads the trio clock once); nothing listens until `Controller.bind`."""
    book = JobBook(result_retention=config.result_retention)
    book.wall_offset = time.time() - trio.current_time()
    write_ahead = WriteAhead(journal)
    shell = CoreShell(config, write_ahead=write_ahead, metrics=metrics, busy_poll=busy_poll)
    desk = JobDesk(
        book,
        shell,
        journal,
        write_ahead=write_ahead,
        max_log_size=config.max_log_size,
        output_retention=config.output_retention,
        max_pending=config.max_pending,
        max_pending_bytes=config.max_pending_bytes,
    )
    redis = None
    if config.redis is not None:
        from controller.doors.redis.door import RedisDoor

        redis = RedisDoor(config, desk, shell)
    udp = UdpDoor(config, shell, desk, reports={"redis": redis.status} if redis else {})
    http = None
    if config.http_address is not None:
        from controller.doors.http.shell import HttpDoor

        http = HttpDoor(config, desk, shell, redis_status=redis.status if redis else None)
    if metrics is not None and redis is not None:
        metrics.redis_status = redis.status

    # The core's outlets: where jobs that end, move, write output or report their usage go,
    # and where the remote kinds' hand-outs and the Redis door's room look come from.
    shell.connect(
        finished=desk.finished,
        progress=desk.progress,
        output=desk.task_output,
        usage=desk.task_usage,  # each attempt's, before its outcome
        perform=udp.calculators.perform,
        hand_out=http.pollers.hand_out if http is not None else None,
        room=redis.look_for_room if redis is not None else None,
    )
    # A local worker's progress report goes to the job its task is (desk.progressed checks it).
    shell.on_reported = lambda ref, job_id, progress, status: (
        desk.progressed(job, progress, status, ref)
        if (job := desk.book.get(str(job_id))) is not None
        else None
    )
    # The doors that tell their submitters how jobs ended, and who follows every job.
    doors: dict[DoorName, Door] = {DoorName.UDP: udp}
    if redis is not None:
        doors[DoorName.REDIS] = redis
    desk.connect(
        doors=doors,
        on_finished=http.job_ended if http is not None else None,
        on_output=http.output_grew if http is not None else None,
        on_change=http.events.job_changed if http is not None else None,
    )

    committer = None
    if journal is not None:
        refusals = JournalRefusals(desk)
        live = shell.core.tasks  # every door's queued and running tasks
        core = shell.core
        committer = Committer(
            journal,
            on_committed=refusals.committed,
            in_flight=lambda: commit_load(len(live), core.queued, core.scheduled, len(write_ahead)),
            on_rejected=refusals.rejected,
        )

    claims: Claims | None = None
    if redis is not None and config.schedules:
        from controller.doors.redis.periodic_claims import RedisClaims

        claims = RedisClaims(
            redis.calls.redis, redis.consumer, config.result_retention, redis.in_thread
        )
    periodic = PeriodicJobs(
        config,
        desk,
        journal,
        recovered.schedules if recovered is not None else None,
        claims,
    )
    return Controller(
        config, journal, recovered, shell, desk, udp, http, redis, committer, periodic, metrics
    )

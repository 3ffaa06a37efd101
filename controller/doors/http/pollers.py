"""The pollers' side of the HTTP door: `GET /ping/`, the leases, and a poller's reports.

A poller waits in `/ping/` for a job; the core's poller kind (controller/core/pollers.py)
treats it as an idle worker and, when it places a job on it, asks for a `HandOut`: this
module answers the waiting `/ping/` with that job and a fresh lease. A poller's
`PUT /job/{id}/` (its `worker` and `state`) is taken only from the poller holding the job
under that lease; what it reports goes to the core as the calculators' reports do, through
the core shell's `execute`.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from controller.core import HandOut
from controller.doors.http import codec
from controller.doors.http.asgi import Request, Response, json_response
from controller.doors.http.codec import ApiError, Update
from controller.job_ids import MAX_ID_LENGTH
from controller.job_states import JobState
from controller.jobs import Job
from controller.shell.core_shell import CoreShell
from controller.shell.desk import JobDesk

# Bytes of randomness in a poller's lease (128 bits).
LEASE_BYTES = 16


@dataclass(eq=False)
class PingWaiter:
    """A poller's /ping/ waiting for a job."""

    event: trio.Event = field(default_factory=trio.Event)
    job: Job | None = None
    lease: str = ""


class PollerDoor:
    """The pollers' endpoints: the waiting `/ping/`s by poller name, and the lease checks."""

    def __init__(
        self, desk: JobDesk, shell: CoreShell, refuse: Callable[[ApiError], Response]
    ) -> None:
        self.desk = desk
        self.book = desk.book
        self.core = shell.core
        self.execute = shell.execute
        self.pollers = shell.core.pollers
        self.refuse = refuse  # the door's answer to a refused request (counted)
        self.pings: dict[str, PingWaiter] = {}  # by poller name

    def hand_out(self, action: HandOut) -> None:
        """The scheduler placed a job on a poller: answer its waiting /ping/ with it."""
        now = trio.current_time()
        waiter = self.pings.pop(action.name, None)
        job = self.book.get(str(action.job))
        if waiter is None or job is None:
            self.execute(self.pollers.undeliverable(action.name, now))
            return
        waiter.job = job
        waiter.lease = secrets.token_urlsafe(LEASE_BYTES)
        waiter.event.set()
        self.pollers.handed(action.name, now, waiter.lease)
        self.desk.leased(job.ref, waiter.lease)

    async def ping(self, request: Request) -> Response:
        """GET /ping/?worker=NAME: a job and its lease when one is placed on the poller
        within `?wait=`, else 204."""
        try:
            worker = request.query_params.get("worker")
            if not worker:
                raise ApiError(400, "give ?worker=NAME")
            if len(worker) > MAX_ID_LENGTH:
                raise ApiError(400, f"worker is longer than {MAX_ID_LENGTH} characters")
            wait = codec.parse_number(
                request.query_params.get("wait"), "wait", 0.0, 0.0, codec.MAX_WAIT
            )
            serves = codec.parse_declared(request.query_params)
        except ApiError as exc:
            return self.refuse(exc)
        waiter = PingWaiter()
        earlier = self.pings.get(worker)
        if earlier is not None:
            earlier.event.set()  # one request per poller: the older one answers 204
        self.pings[worker] = waiter
        self.execute(self.pollers.ping(worker, trio.current_time(), serves))
        try:
            if waiter.job is None:
                with trio.move_on_after(wait):
                    await waiter.event.wait()
        finally:
            if self.pings.get(worker) is waiter:
                del self.pings[worker]
                if waiter.job is None:  # nothing came: the poller is idle no more
                    self.execute(self.pollers.gave_up(worker, trio.current_time()))
        if waiter.job is None:
            return Response(status=204)
        await self.desk.write_ahead.committed()  # the lease survives a restart
        answer = codec.job_json(waiter.job, self.book.wall_offset, self.core.worker_name)
        answer["lease"] = waiter.lease  # in this answer only
        return json_response(answer)

    def report(self, job: Job, update: Update) -> None:
        """A poller's `PUT /job/{id}/`: taken only from the poller holding the job, with its
        lease (ApiError 409 otherwise)."""
        name = update.worker
        now = trio.current_time()
        lease = update.lease or ""
        holds = self.pollers.holds
        if name and job.task is not None and not holds(name, job.ref, lease):
            self.pollers.adopt(name, job.task_id, lease, now)  # held before a restart?
        if not name or not holds(name, job.ref, lease):
            who = f" ({name})" if name else ""
            raise ApiError(
                409, f"no poller{who} holds this job under that lease: the report is refused"
            )
        if update.log is not None:  # first: a follower of the job sees it before its end
            self.desk.logged(job, update.log, now)
        final = update.state in (JobState.FINISHED, JobState.FAILED)
        if update.progress is not None and final:  # before its end, which keeps it
            self.desk.progressed(job, *update.progress, job.ref)
        if final and update.usage is not None and job.task is not None:
            self.desk.scheduling.attempt_used(job.ref, job.task.job, update.usage)
        if update.state is JobState.WORKING or update.state is None:
            actions = self.pollers.working(name, job.ref, now)
        elif update.state is JobState.FINISHED:
            actions = self.pollers.finished(name, job.ref, update.result or b"", now)
        else:
            actions = self.pollers.failed(name, job.ref, update.error or "", now)
        self.execute(actions)
        if update.progress is not None and not final:  # after `working` starts its attempt
            self.desk.progressed(job, *update.progress, job.ref)

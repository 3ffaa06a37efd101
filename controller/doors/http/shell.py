"""The HTTP door's shell: the job API's routes and its server, on hypercorn's trio server in
the controller's own loop.

Every handler runs in the controller's own trio loop, so it reads the job book
and calls the job desk directly: no threads, no locks, no copies. What a body
means and what a job looks like is codec.py; who may ask is access.py; the
pollers' `/ping/` and leases are pollers.py; the console's pages are console/.
This module routes and waits: a new job's 201 waits for its journal commit
(`WriteAhead.committed`), and `?wait=` long-polls wait on one trio.Event per
job, set when the job ends, so a thousand of them cost no CPU while they wait.
"""

from __future__ import annotations

import codecs
import logging
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import trio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.trio.worker_context import WorkerContext

from controller.config import Config
from controller.doors.http import codec, flows, keepalive
from controller.doors.http.access import Gate, read_tokens
from controller.doors.http.asgi import (
    Endpoint,
    Request,
    Response,
    Router,
    StreamingResponse,
    error_response,
    json_response,
)
from controller.doors.http.bodies import BodyBudget, read_body
from controller.doors.http.codec import ApiError
from controller.doors.http.connections import (
    Connections,
    OneOneServer,
    OneOneStream,
    serve_connections,
)
from controller.doors.http.console.handlers import Console
from controller.doors.http.console.session import TokenFile
from controller.doors.http.events import EventHub, listen, parse_last_id
from controller.doors.http.openapi import OPENAPI
from controller.doors.http.pollers import PollerDoor
from controller.doors.http.queues import idle_queue, queue_report
from controller.doors.http.server_config import hypercorn_config
from controller.errors import StartupError
from controller.job_ids import DoorName
from controller.job_states import JobState
from controller.jobs import Job
from controller.shell.core_shell import CoreShell
from controller.shell.desk import RETRY_AFTER, JobDesk

log = logging.getLogger("controller.http")


# A connection that sends no request for this long is closed (also the keep-alive idle time),
# and so is one silent this long in the middle of a request's body. Read when the door starts
# serving and at each body: tests lower it by setting controller.doors.http.shell.IDLE_TIMEOUT.
IDLE_TIMEOUT = 5.0
# What GET /job/{id}/output/ answers.
TEXT = "text/plain; charset=utf-8"
# A 503 (the journal refuses, or no room for more jobs) says when to try again.
_RETRY_AFTER_HEADER = ((b"retry-after", b"%d" % RETRY_AFTER),)


class HttpDoor:
    """The HTTP door's shell: the app, its listening socket, and the long-poll waiters."""

    def __init__(
        self,
        config: Config,
        desk: JobDesk,
        shell: CoreShell,
        redis_status: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        """`redis_status`: the Redis door's status, for /health/ (None: no Redis door)."""
        assert config.http_address is not None
        self.config = config
        self.desk = desk
        self.core = shell.core
        self.book = desk.book
        self.pollers = PollerDoor(desk, shell, self._refuse)  # /ping/ and the leases
        self.flows = flows.BatchDoor(self)  # /batch/
        self.max_payload = config.max_extra_size
        self.max_body = codec.max_body(config.max_extra_size)
        self.max_bulk_body = codec.max_bulk_body(config.max_extra_size)  # a POST /job/ array's
        # What the bodies being read may hold together: two of the largest.
        self.bodies = BodyBudget(2 * self.max_bulk_body)
        self.started_at = 0.0
        self.counters = {"requests": 0, "jobs_added": 0, "errors": 0}
        self.redis_status = redis_status
        self._ended: dict[str, trio.Event] = {}
        self._grew: dict[str, trio.Event] = {}  # by job id: set when its output grows or it ends
        self.events = EventHub()  # GET /events/: told of every job's change by the desk
        self._sockets: Any = None
        # The bearer tokens, for the API and the console's logins alike: the file must be
        # usable at start (else the start stops), then it is read again as it changes.
        self.tokens: TokenFile | None = None
        if config.http_token_file:
            read_tokens(config.http_token_file)
            self.tokens = TokenFile(config.http_token_file)
        routes: list[tuple[str, Endpoint, list[str]]] = [
            ("/health/", self.health, ["GET"]),
            ("/job/", self.jobs, ["GET", "POST"]),
            ("/ping/", self.pollers.ping, ["GET"]),
            ("/openapi.json", self.openapi, ["GET"]),
            ("/queue/", self.queues, ["GET"]),
            ("/events/", self.events_stream, ["GET"]),
            ("/batch/", self.flows.batches, ["POST"]),
        ]  # each also without its trailing slash (no redirect), and /job/{id}/:
        patterns: list[tuple[str, Endpoint, list[str]]] = [
            ("/job/{job_id}/retry/", self.retry, ["POST"]),
            ("/job/{job_id}/output/", self.output, ["GET"]),
            ("/queue/{name}/", self.queue, ["PUT"]),
            ("/batch/{batch_id}/", self.flows.batch, ["GET"]),
        ]
        self.console = Console(self)  # `/` and /ui/...
        routes += self.console.routes()
        patterns += self.console.patterns()
        self.gate = Gate(config.allowed_clients, self.tokens, self.console.session_ok)
        self.app = Router(
            routes, self.job, ["GET", "PUT", "DELETE"], self.gate.refusal, patterns=patterns
        )
        self.options = config.job_options(DoorName.HTTP)
        self._rate = self.console.job_ended
        self.connections = Connections(config.max_connections, config.max_connections_per_client)
        self._idle_timer = keepalive.usable()

    # ------------------------------------------------------------ serving

    def bind(self) -> None:
        """Listen (before the nursery, so that an error is a plain StartupError); with
        http_tls, its certificate and key are loaded here, so that a bad one stops the start."""
        address = self.config.http_address
        assert address is not None
        hc = hypercorn_config(self.config, IDLE_TIMEOUT, bool(self._idle_timer))
        tls = self.config.http_tls
        if tls is not None:
            try:
                hc.create_ssl_context()
            except (OSError, ValueError) as exc:  # missing, unreadable, not PEM, not a pair
                why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
                raise StartupError(
                    f"http_tls: cannot load the certificate {tls.cert} with the key {tls.key}: "
                    f"{why or type(exc).__name__}"
                ) from None
        try:
            self._sockets = hc.create_sockets()
            for sock in self._listening():
                sock.listen(hc.backlog)
        except OSError as exc:
            raise StartupError(
                f"http_address {address.host}:{address.port}: {exc.strerror or exc}"
            ) from None

    def _listening(self) -> list[socket.socket]:
        """The listening sockets: TLS ones with http_tls, plain ones without (never both)."""
        return [*self._sockets.secure_sockets, *self._sockets.insecure_sockets]

    def address(self) -> tuple[str, int]:
        sock: socket.socket = self._listening()[0]
        host, port = sock.getsockname()[:2]
        return host, port

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        if self._sockets is None:
            self.bind()
        self.started_at = trio.current_time()
        host, port = self.address()
        scheme = "https" if self.config.http_tls is not None else "http"
        log.info("HTTP job API and console on %s://%s:%d/", scheme, host, port)
        hc = hypercorn_config(self.config, IDLE_TIMEOUT, bool(self._idle_timer))
        app = ASGIWrapper(self.app)  # type: ignore[arg-type]
        context = WorkerContext(None)
        idle_timer = self._idle_timer

        async def connection(stream: trio.abc.Stream) -> None:
            state = {"stream": stream}  # scope["state"]: /events/ closes a stuck stream
            server = OneOneServer(app, hc, context, state, stream)  # type: ignore[arg-type]
            if idle_timer:
                timer = keepalive.fit(server, self.config.http_body_timeout, state, stream.aclose)
                if timer is not None and isinstance(stream, OneOneStream):
                    stream.on_receive = timer.heard  # a head that keeps coming is not idle
            await server.run()

        ssl_context = hc.create_ssl_context() if self._sockets.secure_sockets else None
        listeners = [
            (trio.socket.from_stdlib_socket(sock), ssl_context)
            for sock in self._sockets.secure_sockets
        ] + [
            (trio.socket.from_stdlib_socket(sock), None) for sock in self._sockets.insecure_sockets
        ]
        try:
            await serve_connections(
                listeners, connection, self.connections, task_status=task_status
            )
        finally:
            await context.terminated.set()

    def job_ended(self, job: Job) -> None:
        """The desk's hook: a job ended (or was deleted): wake its long-polls, count it for
        the console's chart."""
        self._rate(job)
        event = self._ended.pop(job.id, None)
        if event is not None:
            event.set()
        self.output_grew(job)

    def output_grew(self, job: Job) -> None:
        """The desk's hook: a job's output grew (or the job ended): wake its followers."""
        event = self._grew.pop(job.id, None)
        if event is not None:
            event.set()

    # ------------------------------------------------------------ endpoints

    async def health(self, request: Request) -> Response:
        uptime = trio.current_time() - self.started_at
        return json_response(
            {
                "uptime": f"{uptime:.9f}s",
                "workers": len(self.core.workers),
                "pending": self.core.queued,
            }
        )

    async def jobs(self, request: Request) -> Response:
        self.counters["requests"] += 1
        try:
            if request.method == "POST":
                return await self._add(request)
            query = request.query_params
            state = codec.parse_state(query.get("state"))
            queue = codec.parse_queue(query.get("queue"))
            limit = codec.parse_number(
                query.get("limit"), "limit", codec.DEFAULT_LIMIT, 1, codec.MAX_LIMIT, whole=True
            )
            offset = self.book.wall_offset
            name_of = self.core.worker_name
            listing = {
                job.id: codec.job_json(job, offset, name_of)
                for job in self.book.latest(int(limit), state, queue)
            }
            return json_response(listing)
        except ApiError as exc:
            return self._refuse(exc)

    async def _add(self, request: Request) -> Response:
        """POST /job/: one job (an object) or several (an array), all made or none, each
        answered as a single POST would (an existing id: that job), in one journal commit."""
        body = await self._body(request, self.max_bulk_body)
        news, many = codec.parse_new_jobs(body, self.max_payload, self.options)
        flows.check_after(self.book, news, many, self._existing)
        self._admit(news)
        now = trio.current_time()
        answers: list[Job] = []
        made: list[Job] = []
        for new in news:
            job = self._existing(new)
            if job is None:
                job = self._make(new, now)
                made.append(job)
            answers.append(job)
        if made:
            await self.desk.write_ahead.committed()  # 201 only once the jobs are on disk
            lost = [job for job in made if self.book.get(job.id) is not job]
            if lost:  # the journal could not record them
                raise ApiError(500, f"the job could not be recorded: {lost[0].error}")
        status = 201 if made else 200
        if not many:
            return self._job_response(answers[0], status)
        offset, name_of = self.book.wall_offset, self.core.worker_name
        return json_response([codec.job_json(job, offset, name_of) for job in answers], status)

    def _existing(self, new: codec.NewJob) -> Job | None:
        """The job a submission names that exists already (its `id`), or the live job that
        holds its `unique_key`: it is the answer, and nothing is made."""
        if new.id is not None:
            existing = self.book.get(new.id)
            if existing is not None:
                return existing
        return self.desk.holder(new.options.unique_key)

    def _admit(self, news: list[codec.NewJob]) -> None:
        """ApiError 503 unless the jobs these submissions would make (those that name no
        existing job, nor one named earlier among them) fit: the journal records, and there is
        room under max_pending and max_pending_bytes for all of them together."""
        count = size = 0
        seen: set[str] = set()
        for new in news:
            if new.id is not None:
                if new.id in seen:
                    continue
                seen.add(new.id)
            if self._existing(new) is None:
                count += 1
                size += len(new.payload)
        if not count:
            return
        desk = self.desk
        refusal = desk.refusal()
        if refusal:
            raise ApiError(503, f"the journal cannot record new jobs now: {refusal}")
        if not desk.room(size, count):
            raise ApiError(503, desk.busy(size, count))

    def _make(self, new: codec.NewJob, now: float) -> Job:
        """A new job from a checked submission (staged for the journal, not yet on disk)."""
        job = self.desk.submit(
            new.id or codec.new_job_id(),
            DoorName.HTTP,
            None,
            self.desk.book.pick_task_id(),
            new.payload,
            now,
            name=new.name,
            info_url=new.info_url,
            download_url=new.download_url,
            options=new.options,
        )
        self.counters["jobs_added"] += 1
        return job

    async def job(self, request: Request) -> Response:
        self.counters["requests"] += 1
        try:
            job = self.lookup(request)
            if request.method == "GET":
                wait = codec.parse_number(
                    request.query_params.get("wait"), "wait", 0.0, 0.0, codec.MAX_WAIT
                )
                if wait > 0 and not job.state.final:
                    event = self._ended.get(job.id)
                    if event is None:
                        event = self._ended[job.id] = trio.Event()
                    with trio.move_on_after(wait):
                        await event.wait()
                return self._job_response(job, 200)
            if request.method == "DELETE":
                self.desk.delete(job, trio.current_time())
                await self.desk.write_ahead.committed()  # 200 only once that is on disk
                return self._job_response(job, 200)
            return await self._update(job, request)
        except ApiError as exc:
            return self._refuse(exc)

    async def _update(self, job: Job, request: Request) -> Response:
        update = codec.parse_update(await self._body(request), self.max_payload)
        state = job.state
        if state is JobState.DELETED:
            raise ApiError(409, "the job is deleted: it takes no change")
        if update.log is not None and state.final:
            raise ApiError(409, f"the job is {state.value}: its log is closed")
        if update.state is JobState.CANCELED:
            if state.final and state is not JobState.CANCELED:
                raise ApiError(409, f"the job is {state.value}: it can no longer be canceled")
            if update.log is not None:
                self.desk.logged(job, update.log, trio.current_time())
            self.desk.cancel(job, trio.current_time())
        elif update.worker is not None or update.state is not None:
            self.pollers.report(job, update)  # a poller's: it must hold the job's lease
        elif update.log is not None:
            self.desk.logged(job, update.log, trio.current_time())
        await self.desk.write_ahead.committed()  # 200 only once the change is on disk
        return self._job_response(job, 200)

    async def retry(self, request: Request) -> Response:
        """POST /job/{id}/retry/: a failed or canceled job back to pending."""
        self.counters["requests"] += 1
        try:
            job = self.lookup(request)
            if not self.desk.retry(job, trio.current_time()):
                raise ApiError(409, self.desk.no_retry(job))
            await self.desk.write_ahead.committed()  # 200 only once that is on disk
            return self._job_response(job, 200)
        except ApiError as exc:
            return self._refuse(exc)

    async def output(self, request: Request) -> Response | StreamingResponse:
        """GET /job/{id}/output/: what the job wrote to stderr, as text; `?follow=1` streams
        it until the job ends."""
        self.counters["requests"] += 1
        try:
            job = self.lookup(request)
            follow = codec.parse_flag(request.query_params.get("follow"), "follow")
        except ApiError as exc:
            return self._refuse(exc)
        if not follow or job.state.final or request.scope["method"] == "HEAD":
            return Response(job.output.decode("utf-8", "replace").encode(), 200, TEXT)
        return StreamingResponse(self._follow(job), 200, TEXT)

    async def _follow(self, job: Job) -> AsyncIterator[bytes]:
        """The job's output so far, then each piece as it comes, until the job ends. One
        event per followed job (shared by its followers) wakes them; nothing runs between."""
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        sent = 0  # bytes of the job's output (counted since it began) already sent
        while True:
            total, data = job.output_since(sent)
            sent = total
            ended = job.state.final
            text = decoder.decode(data, final=ended)
            if text:
                yield text.encode()
                continue  # more may have come, or the job ended, while it was sent
            if ended:
                return
            event = self._grew.get(job.id)
            if event is None:
                event = self._grew[job.id] = trio.Event()
            await event.wait()

    async def events_stream(self, request: Request) -> Response | StreamingResponse:
        """GET /events/: job changes as Server-Sent Events (events.py)."""
        self.counters["requests"] += 1
        try:
            queue = codec.parse_queue(request.query_params.get("queue"))
            last_id = parse_last_id(
                request.header(b"last-event-id"), request.query_params.get("last_event_id")
            )
        except ApiError as exc:
            return self._refuse(exc)
        return listen(self.events, queue, last_id)

    async def queues(self, request: Request) -> Response:
        """GET /queue/: every queue that has jobs, workers or a pause."""
        self.counters["requests"] += 1
        return json_response(queue_report(self.core))

    async def queue(self, request: Request) -> Response:
        """PUT /queue/{name}/ {"paused": true|false, "concurrency": n|null, "rate": "N/s"|null}
        (any of them)."""
        self.counters["requests"] += 1
        try:
            name = codec.parse_queue(request.path_params["name"])
            assert name is not None
            settings = codec.parse_queue_settings(await self._body(request))
            if "paused" in settings:
                self.desk.pause(name, settings["paused"])
            if "concurrency" in settings or "rate" in settings:
                concurrency, rate = self.core.limits(name)
                concurrency = settings.get("concurrency", concurrency)
                self.desk.limit(name, concurrency, settings.get("rate", rate))
            await self.desk.write_ahead.committed()  # 200 only once that is on disk
            return json_response({name: queue_report(self.core).get(name, idle_queue())})
        except ApiError as exc:
            return self._refuse(exc)

    async def openapi(self, request: Request) -> Response:
        return json_response(OPENAPI)

    # ------------------------------------------------------------ helpers

    def lookup(self, request: Request) -> Job:
        """The job the path's `job_id` names; ApiError 404 if there is none."""
        job_id = request.path_params["job_id"]
        job = self.book.get(job_id)
        if job is None:
            raise ApiError(404, f"no job {job_id[:200]!r}")
        return job

    async def _body(self, request: Request, array_limit: int = 0) -> bytes:
        return await self._body_of(request, self.max_body, array_limit)

    async def _body_of(self, request: Request, limit: int, array_limit: int = 0) -> bytes:
        # The request's whole time, from its first byte (its head's) to its last.
        deadline = keepalive.request_deadline(request.scope, self.config.http_body_timeout)
        return await read_body(
            request, limit, IDLE_TIMEOUT, deadline, array_limit, budget=self.bodies
        )

    def _job_response(self, job: Job, status: int) -> Response:
        return json_response(
            codec.job_json(job, self.book.wall_offset, self.core.worker_name), status
        )

    def _refuse(self, exc: ApiError) -> Response:
        self.counters["errors"] += 1
        if exc.status == 503:  # what refuses new jobs now passes: they may come again later
            return Response(codec.dumps(exc.body()), 503, "application/json", _RETRY_AFTER_HEADER)
        return error_response(exc.status, exc.message)

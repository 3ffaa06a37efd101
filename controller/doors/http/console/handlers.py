"""The console's endpoints, served by the HTTP door in the controller's own loop.

Every page checks the browser's session first, or a valid bearer token of the API (with
`http_token_file`: else 401 and the login form as its body; the login page itself is an
ordinary 200), and every POST its session and CSRF token (else 401, 403): a bearer token
opens pages, never forms. Each action then calls the job desk, as the JSON API does, waits
for the journal, and answers 303 to the page to show next (post, redirect, get). The
session cookie is taken on one API path only: `GET /job/{id}/output`, which a job's page
shows in a frame (a read, so SameSite=Strict is all it needs). A wrong token at the login
counts against its address as a wrong bearer token does (controller/doors/http/access.py).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import trio

from controller.doors.http import codec
from controller.doors.http.access import BEARER
from controller.doors.http.asgi import Request, Response, Scope, error_response, json_response
from controller.doors.http.batch_report import report_of
from controller.doors.http.codec import ApiError
from controller.doors.http.console import pages, pages_batches, pages_jobs, views
from controller.doors.http.console.session import Sessions, parse_cookies
from controller.doors.http.console.stats import EndRate
from controller.doors.http.console.web import (
    HTML,
    SECURITY_HEADERS,
    STATIC_TYPES,
    Handler,
    Seen,
    by_method,
    read_form,
    static_files,
    then_target,
)
from controller.doors.http.queues import queue_report
from controller.job_ids import MAX_ID_LENGTH
from controller.job_states import JobState
from controller.jobs import Job

if TYPE_CHECKING:
    from controller.config import Config
    from controller.core import Core
    from controller.doors.http.access import Gate
    from controller.doors.http.console.session import TokenFile
    from controller.jobs import JobBook
    from controller.shell.desk import JobDesk

T = TypeVar("T")

PAGE_SIZE = 50
# Pages past this are not asked for by any pager (400).
MAX_PAGE = 100_000
# Queues offered by the jobs list's filter, at most (a name is up to 200 characters).
MAX_QUEUES_SHOWN = 1000
# The queue filter's walk over the kept jobs is done again no sooner than this many times
# its own duration after the last (at most a tenth of the loop's time).
QUEUES_EFFORT = 10.0


def page_of(found: Iterator[T], page: int, size: int) -> tuple[list[T], int, bool]:
    """Page `page` (from 0) of `found`, its number, and whether a later one exists; a page
    past the last is the last. One pass over `found` at most, whatever the page asked for:
    the jobs before the page are passed over in C (islice into a bounded deque), keeping
    the last `size` of them for when the page asked for is past the end."""
    before = deque(itertools.islice(enumerate(found), page * size), maxlen=size)
    shown = list(itertools.islice(found, size))
    if shown:
        return shown, page, len(shown) == size and next(found, None) is not None
    if not before:
        return [], 0, False
    total = before[-1][0] + 1
    last = (total - 1) // size
    return [job for n, job in before if n >= last * size], last, False


class Door(Protocol):
    """What the console reads of the HTTP door that serves it (controller/doors/http/shell.py)."""

    @property
    def config(self) -> Config: ...
    @property
    def tokens(self) -> TokenFile | None: ...
    @property
    def desk(self) -> JobDesk: ...
    @property
    def book(self) -> JobBook: ...
    @property
    def core(self) -> Core: ...
    @property
    def redis_status(self) -> Callable[[], dict[str, Any]] | None: ...
    @property
    def counters(self) -> dict[str, int]: ...
    @property
    def gate(self) -> Gate: ...
    def lookup(self, request: Request) -> Job: ...


class Console:
    """The console's routes, its session keeper and the chart's counts."""

    def __init__(self, door: Door) -> None:
        config = door.config
        self.sessions = Sessions(door.tokens, secure=config.http_tls is not None)
        self.door = door
        self.desk = door.desk
        self.book = door.book
        self.core = door.core
        self.rate = EndRate()
        self.static = static_files()
        # The queues kept jobs name (the jobs list's filter), for (jobs kept, submitted) as
        # `_queues_key`, gathered again no sooner than `_queues_next`.
        self._queues: set[str] = set()
        self._queues_key = (-1, -1)
        self._queues_next = 0.0

    def routes(self) -> list[tuple[str, Handler, list[str]]]:
        return [
            ("/", self.page(self.overview), ["GET"]),
            ("/ui/", self.page(self.overview), ["GET"]),
            ("/ui/stats/", self.page(self.stats), ["GET"]),
            ("/ui/jobs/", self.page(self.jobs), ["GET"]),
            (
                "/ui/queues/",
                by_method(self.page(self.queues), self.action(self.pause)),
                ["GET", "POST"],
            ),
            ("/ui/workers/", self.page(self.workers), ["GET"]),
            ("/ui/bulk/", self.action(self.bulk), ["POST"]),
            ("/ui/login/", self.login, ["GET", "POST"]),
            ("/ui/logout/", self.action(self.logout), ["POST"]),
        ]

    def patterns(self) -> list[tuple[str, Handler, list[str]]]:
        return [
            ("/ui/static/{name}", self.static_file, ["GET"]),
            ("/ui/jobs/{job_id}/cancel", self.action(self.cancel), ["POST"]),
            ("/ui/jobs/{job_id}/retry", self.action(self.retry), ["POST"]),
            ("/ui/jobs/{job_id}/delete", self.action(self.delete), ["POST"]),
            ("/ui/jobs/{job_id}", self.page(self.job), ["GET"]),
            ("/ui/batches/{batch_id}", self.page(self.batch), ["GET"]),
            ("/ui/queues/{name}", self.action(self.pause), ["POST"]),
        ]

    def job_ended(self, job: Job) -> None:
        """A job ended: one more in the chart's current second (O(1))."""
        state = job.state
        if state is JobState.FINISHED or state is JobState.FAILED:
            self.rate.record(trio.current_time(), state is JobState.FAILED)

    def session_ok(self, scope: Scope) -> bool:
        """Whether a request carries a good console session (for `GET /job/{id}/output`)."""
        cookies: dict[str, str] = {}
        for name, value in scope["headers"]:
            if name == b"cookie":
                cookies = parse_cookies(bytes(value).decode("latin-1"))
                break
        browser = self.sessions.browser_of(cookies)
        return self.sessions.valid(cookies, browser, trio.current_time())

    # ------------------------------------------------------------ plumbing

    def _html(self, text: str, seen: Seen, status: int = 200) -> Response:
        # errors="replace": a name a client sent may hold a lone surrogate.
        body = text.encode("utf-8", "replace")
        return Response(body, status, HTML, [*seen.headers, *SECURITY_HEADERS])

    def _login_needed(
        self,
        request: Request,
        seen: Seen,
        error: str = "",
        then: str | None = None,
        status: int = 401,
    ) -> Response:
        if then is None:  # the page asked for, to show once logged in
            then = "/"
            if request.method == "GET" and not request.scope["path"].startswith("/ui/login"):
                query = request.scope["query_string"].decode("latin-1")
                then = then_target(request.scope["path"] + ("?" + query if query else ""))
        csrf = self.sessions.csrf(seen.browser)
        tokens = self.sessions.tokens
        where = str(tokens.path) if tokens is not None else ""
        response = self._html(pages.login_page(csrf, error, then, where), seen, status)
        if status == 401:
            response.headers.append((b"www-authenticate", b"Bearer"))
        return response

    def _see_other(self, location: str, headers: Sequence[tuple[bytes, bytes]] = ()) -> Response:
        return Response(
            b"", 303, None, [(b"location", location.encode("utf-8")), *headers, *SECURITY_HEADERS]
        )

    def page(self, render: Callable[[Request, Seen], Awaitable[Response]]) -> Handler:
        """A GET endpoint: 401 and the login form without a good session or bearer token."""

        async def endpoint(request: Request) -> Response:
            seen = Seen(self.sessions, request, trio.current_time())
            if not seen.valid and BEARER not in request.scope:
                return self._login_needed(request, seen)
            try:
                return await render(request, seen)
            except ApiError as exc:
                return self._html(
                    pages.message_page(f"{exc.status}", exc.message), seen, exc.status
                )

        return endpoint

    def action(self, do: Callable[[Request, Seen, dict[str, str]], Awaitable[Response]]) -> Handler:
        """A POST endpoint: 401 without a good session, 403 without the form's CSRF token."""

        async def endpoint(request: Request) -> Response:
            seen = Seen(self.sessions, request, trio.current_time())
            if not seen.valid:
                return self._login_needed(request, seen)
            try:
                form = await read_form(request)
                if seen.headers or not self.sessions.csrf_ok(seen.browser, form.get("csrf")):
                    raise ApiError(
                        403, "this form's CSRF token is missing or wrong: reload the page"
                    )
                return await do(request, seen, form)
            except ApiError as exc:
                return self._html(
                    pages.message_page(f"{exc.status}", exc.message), seen, exc.status
                )

        return endpoint

    def _ctx(self, seen: Seen) -> dict[str, Any]:
        return {"csrf": self.sessions.csrf(seen.browser), "logout": self.sessions.login_needed}

    def _job(self, request: Request) -> Job:
        return self.door.lookup(request)

    # ------------------------------------------------------------ pages

    async def static_file(self, request: Request) -> Response:
        name = request.path_params["name"]
        body = self.static.get(name)
        if body is None:
            return error_response(404, "no such file among the console's own")
        kind = STATIC_TYPES[Path(name).suffix]
        return Response(body, 200, kind, [(b"cache-control", b"max-age=300")])

    async def overview(self, request: Request, seen: Seen) -> Response:
        now = trio.current_time()
        door = self.door
        redis = door.redis_status() if door.redis_status is not None else None
        workers, more = views.worker_data(self.core, now)
        offset = self.book.wall_offset
        latest = [views.job_row(job, now, offset) for job in self.book.latest(views.LATEST_JOBS)]
        html = pages.overview_page(
            views.summary(self.core, self.book),
            views.counters(self.core, door.counters, door.gate.refused),
            redis,
            workers,
            more,
            queue_report(self.core),
            latest,
            self.rate.per_minute(now),
            **self._ctx(seen),
        )
        return self._html(html, seen)

    async def stats(self, request: Request, seen: Seen) -> Response:
        response = json_response(self.rate.as_json(trio.current_time(), self.book.wall_offset))
        response.headers.append((b"cache-control", b"no-store"))
        return response

    async def jobs(self, request: Request, seen: Seen) -> Response:
        query = request.query_params
        state_text = query.get("state", "")
        queue_text = query.get("queue", "")
        state = codec.parse_state(state_text or None)
        queue = codec.parse_queue(queue_text or None)
        search = query.get("q", "")[:MAX_ID_LENGTH].strip()
        page = int(codec.parse_number(query.get("page"), "page", 0, 0, MAX_PAGE, whole=True))
        now = trio.current_time()
        offset = self.book.wall_offset
        found = views.matching(self.book, state, queue, search)
        jobs, page, has_next = page_of(found, page, PAGE_SIZE)
        html = pages_jobs.jobs_page(
            [views.job_row(job, now, offset) for job in jobs],
            states=[s.value for s in JobState],
            queues=self.queue_names(queue_text, now),
            state=state_text,
            queue=queue_text,
            search=search,
            page=page,
            has_next=has_next,
            page_size=PAGE_SIZE,
            **self._ctx(seen),
        )
        return self._html(html, seen)

    def queue_names(self, chosen: str, now: float) -> list[str]:
        """The queue filter's choices: every queue a kept job names, a worker serves or a
        pause holds, and `chosen` (at most MAX_QUEUES_SHOWN, by name). The kept jobs' names
        are gathered again when jobs came or went since, but no more often than makes that
        walk a tenth of the loop's time (QUEUES_EFFORT)."""
        book = self.book
        key = (len(book), self.core.counters.submitted)
        if key != self._queues_key and now >= self._queues_next:
            self._queues_key = key
            self._queues = {job.options.queue for job in book}
            self._queues_next = now + QUEUES_EFFORT * (trio.current_time() - now)
        shown = sorted(self._queues.union(queue_report(self.core)))[:MAX_QUEUES_SHOWN]
        if chosen and chosen not in shown:
            shown = sorted([*shown, chosen])
        return shown

    async def job(self, request: Request, seen: Seen) -> Response:
        job = self._job(request)
        offset = self.book.wall_offset
        name_of = self.core.worker_name
        fields = codec.job_json(job, offset, name_of)
        finished = job.state is JobState.FINISHED
        html = pages_jobs.job_page(
            fields,
            job.payload,
            job.result if finished else None,
            views.attempts_data(job, offset, name_of),
            views.actions_of(job),
            **self._ctx(seen),
        )
        return self._html(html, seen)

    async def batch(self, request: Request, seen: Seen) -> Response:
        """A batch: its counts, its then job and its jobs (ApiError 404 when none)."""
        book = self.book
        report = report_of(book, self.desk.waits.batches, request.path_params["batch_id"])
        jobs = []
        for job_id in report["ids"][: pages_batches.MAX_LISTED]:
            job = book.get(job_id)
            if job is not None:
                jobs.append((job_id, job.state.value, job.options.queue))
        then = book.get(report["then"])
        then_state = then.state.value if then is not None else ""
        html = pages_batches.batch_page(report, jobs, then_state, **self._ctx(seen))
        return self._html(html, seen)

    async def queues(self, request: Request, seen: Seen) -> Response:
        return self._html(pages.queues_page(queue_report(self.core), **self._ctx(seen)), seen)

    async def workers(self, request: Request, seen: Seen) -> Response:
        workers, more = views.worker_data(self.core, trio.current_time())
        return self._html(pages.workers_page(workers, more, **self._ctx(seen)), seen)

    # ------------------------------------------------------------ login

    async def login(self, request: Request) -> Response:
        now = trio.current_time()
        seen = Seen(self.sessions, request, now)
        if not self.sessions.login_needed:
            return self._see_other("/", seen.headers)
        if request.method == "GET":
            if seen.valid:
                return self._see_other("/", seen.headers)
            return self._login_needed(request, seen, status=200)  # the form is the page
        try:
            form = await read_form(request)
        except ApiError as exc:
            return self._html(pages.message_page(f"{exc.status}", exc.message), seen, exc.status)
        if seen.headers or not self.sessions.csrf_ok(seen.browser, form.get("csrf")):
            message = "this form's CSRF token is missing or wrong: reload the page"
            return self._html(pages.message_page("403", message), seen, 403)
        then = then_target(form.get("then", "/"))
        token = form.get("token", "").strip()
        hashed = self.sessions.check_token(token, now)
        if hashed is None:
            if token:  # a guess: it counts against the address (an empty form does not)
                client = request.scope.get("client")
                self.door.gate.strike(client[0] if client else "")
            return self._login_needed(request, seen, "That token is not in the token file.", then)
        return self._see_other(then, self.sessions.session_cookies(seen.browser, hashed))

    async def logout(self, request: Request, seen: Seen, form: dict[str, str]) -> Response:
        target = "/ui/login" if self.sessions.login_needed else "/"
        return self._see_other(target, self.sessions.logout_cookies())

    # ------------------------------------------------------------ actions

    async def _committed(self) -> None:
        await self.desk.write_ahead.committed()  # the next page shows what is on disk

    def _back_to(self, job: Job) -> Response:
        return self._see_other(pages.job_href(job.id))

    async def cancel(self, request: Request, seen: Seen, form: dict[str, str]) -> Response:
        job = self._job(request)
        state = job.state
        if state.final and state is not JobState.CANCELED:
            raise ApiError(409, f"the job is {state.value}: it can no longer be canceled")
        self.desk.cancel(job, trio.current_time())
        await self._committed()
        return self._back_to(job)

    async def retry(self, request: Request, seen: Seen, form: dict[str, str]) -> Response:
        job = self._job(request)
        if not self.desk.retry(job, trio.current_time()):
            raise ApiError(409, self.desk.no_retry(job))
        await self._committed()
        return self._back_to(job)

    async def delete(self, request: Request, seen: Seen, form: dict[str, str]) -> Response:
        job = self._job(request)
        self.desk.delete(job, trio.current_time())
        await self._committed()
        return self._back_to(job)

    async def pause(self, request: Request, seen: Seen, form: dict[str, str]) -> Response:
        """Pause or resume the queue of the path, or (POST /ui/queues) of the form's `name`."""
        name = codec.parse_queue(request.path_params.get("name", form.get("name", "")))
        assert name is not None
        paused = form.get("paused")
        if paused not in ("0", "1"):
            raise ApiError(400, "give paused=1 or paused=0")
        self.desk.pause(name, paused == "1")
        await self._committed()
        return self._see_other("/ui/queues")

    async def bulk(self, request: Request, seen: Seen, form: dict[str, str]) -> Response:
        """Retry or delete every failed job of a filter (at most BULK_LIMIT): the first POST
        shows how many, the second (with `confirm`) does it."""
        action = form.get("action")
        if action not in ("retry", "delete"):
            raise ApiError(400, "action is retry or delete")
        if form.get("state") != "failed":
            raise ApiError(400, "only failed jobs are retried or deleted all at once")
        queue_text = form.get("queue", "")
        queue = codec.parse_queue(queue_text or None)
        search = form.get("q", "")[:MAX_ID_LENGTH]
        fields = [("state", "failed"), ("queue", queue_text), ("q", search)]
        found = views.matching(self.book, JobState.FAILED, queue, search)
        chosen = [job for _, job in zip(range(views.BULK_LIMIT + 1), found, strict=False)]
        capped = len(chosen) > views.BULK_LIMIT
        chosen = chosen[: views.BULK_LIMIT]
        ctx = self._ctx(seen)
        if form.get("confirm") != "1":
            page = pages_jobs.bulk_page(action, len(chosen), capped, fields, **ctx)
            return self._html(page, seen)
        now = trio.current_time()
        done = 0
        for job in chosen:
            if job.state is not JobState.FAILED:
                continue  # it changed since (a worker, another operator)
            if action == "retry":
                done += self.desk.retry(job, now)
            else:
                self.desk.delete(job, now)
                done += 1
        await self._committed()
        return self._html(pages_jobs.bulk_done_page(action, done, fields, **ctx), seen)

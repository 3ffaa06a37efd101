"""Flows over HTTP (DESIGN.md section 17): the check of the `after` option in `POST /job/` (one
job or an array), and batches: `POST /batch/` makes its jobs as a bulk array would and a `then`
job that waits for them all (as `after_any`), `GET /batch/{batch_id}/` counts its jobs by
state. A batch is its `then` job: that job's `after` holds the batch's jobs and its `batch` the
batch's id, so the journal keeps a batch with the job, and a batch is known while its `then`
job is (the desk's `waits.batches` finds it by id)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import trio

from controller.dependencies import after_refusal
from controller.doors.http import codec
from controller.doors.http.asgi import Request, Response, json_response
from controller.doors.http.batch_report import report_of
from controller.doors.http.codec import ApiError, NewJob
from controller.jobs import Job, JobBook

if TYPE_CHECKING:
    from controller.core import Core
    from controller.options import JobOptions
    from controller.shell.desk import JobDesk


class HttpDoor(Protocol):
    """What batches need of the HTTP door's shell (controller/doors/http/shell.py)."""

    @property
    def book(self) -> JobBook: ...

    @property
    def core(self) -> Core: ...

    @property
    def desk(self) -> JobDesk: ...

    @property
    def counters(self) -> dict[str, int]: ...

    @property
    def options(self) -> JobOptions: ...

    @property
    def max_payload(self) -> int: ...

    @property
    def max_bulk_body(self) -> int: ...

    def _admit(self, news: list[NewJob]) -> None: ...

    def _existing(self, new: NewJob) -> Job | None: ...

    def _make(self, new: NewJob, now: float) -> Job: ...

    def _refuse(self, exc: ApiError) -> Response: ...

    async def _body_of(self, request: Request, limit: int, array_limit: int = 0) -> bytes: ...


def check_after(
    book: JobBook, news: list[NewJob], many: bool, existing: Callable[[NewJob], Job | None]
) -> None:
    """ApiError 400 when a new job's `after` names a job that is neither held here nor earlier
    in the array (itself or a later one: a cycle), for the first such job; a submission that
    names an `existing` job makes nothing and is not checked."""
    positions: dict[str, int] = {}
    for index, new in enumerate(news):
        if new.id is not None:
            positions.setdefault(new.id, index)
    for index, new in enumerate(news):
        after = new.options.after
        if not after or existing(new) is not None:
            continue
        why = after_refusal(after, new.id or "", book, index, positions)
        if why:
            named = f" (id {new.id[:200]!r})" if new.id is not None else ""
            raise ApiError(400, f"job {index}{named}: {why}" if many else why)


def parse_batch(body: bytes, max_payload: int, door: HttpDoor) -> tuple[list[NewJob], NewJob]:
    """The body of `POST /batch/`: `{"jobs": [job, ...], "then": job}`, each job as `POST /job/`
    takes it; the `then` job may not give `after` or `after_any` (they are the batch's)."""
    try:
        text = body.decode(json.detect_encoding(body), "surrogatepass")
        data = json.loads(text)
    except (ValueError, RecursionError):
        raise ApiError(400, "the body is not valid JSON") from None
    if not isinstance(data, dict) or set(data) != {"jobs", "then"}:
        raise ApiError(400, 'the body must be a JSON object {"jobs": [job, ...], "then": job}')
    jobs, then = data["jobs"], data["then"]
    if not isinstance(jobs, list):
        raise ApiError(400, f"jobs must be an array of jobs, got {type(jobs).__name__}")
    if not isinstance(then, dict):
        raise ApiError(400, f"then must be a job (an object), got {type(then).__name__}")
    if "after" in then or "after_any" in then:
        raise ApiError(400, "then: after and after_any are the batch's: leave them out")
    news, _ = codec.parse_new_jobs(json.dumps(jobs).encode(), max_payload, door.options)
    try:
        last = codec.parse_new_job(json.dumps(then).encode(), max_payload, door.options)
    except ApiError as exc:
        message = exc.message.replace("the body must be", "it must be")
        raise ApiError(exc.status, f"then: {message}") from None
    return news, last


def _check_then_key(then: NewJob, news: list[NewJob], desk: JobDesk) -> None:
    """ApiError unless the `then` job's unique_key (if any) is free: a batch is recorded by its
    `then` job, so one that another job would answer for cannot be made."""
    key = then.options.unique_key
    if not key:
        return
    if any(new.options.unique_key == key for new in news):
        raise ApiError(400, f"then: its unique_key {key!r} is a job's of the batch")
    holder = desk.holder(key)
    if holder is not None:
        raise ApiError(
            409,
            f"then: its unique_key {key!r} is held by the live job {holder.id}: "
            "a batch's then job must be made",
        )


class BatchDoor:
    """`POST /batch/` and `GET /batch/{batch_id}/`, served with the HTTP door's parts."""

    def __init__(self, door: HttpDoor) -> None:
        self.door = door

    async def batches(self, request: Request) -> Response:
        """POST /batch/: the jobs, made as a bulk array would be, and the `then` job, waiting
        for them, in one journal commit; 201 and {"id", "jobs", "then"}."""
        door = self.door
        door.counters["requests"] += 1
        try:
            body = await door._body_of(request, door.max_bulk_body)
            news, then = parse_batch(body, door.max_payload, door)
            book, desk = door.book, door.desk
            check_after(book, news, True, door._existing)
            if then.id is not None and any(new.id == then.id for new in news):
                raise ApiError(400, f"then: its id {then.id[:200]!r} is a job's of the batch")
            if then.id is not None and book.get(then.id) is not None:
                raise ApiError(409, f"then: a job {then.id[:200]!r} exists already")
            _check_then_key(then, news, desk)
            door._admit([*news, dataclasses.replace(then, options=door.options)])
            now = trio.current_time()
            jobs = [door._existing(new) or door._make(new, now) for new in news]
            batch_id = codec.new_job_id()
            after = tuple(dict.fromkeys(job.id for job in jobs))
            options = dataclasses.replace(then.options, after=after, after_any=True, batch=batch_id)
            last = door._make(dataclasses.replace(then, options=options), now)
            desk.waits.batches[batch_id] = last.id
            await desk.write_ahead.committed()  # 201 only once the jobs are on disk
            lost = [job for job in (*jobs, last) if book.get(job.id) is not job]
            if lost:  # the journal could not record them
                raise ApiError(500, f"the job could not be recorded: {lost[0].error}")
            offset, name_of = book.wall_offset, door.core.worker_name
            answer = {
                "id": batch_id,
                "jobs": [codec.job_json(job, offset, name_of) for job in jobs],
                "then": codec.job_json(last, offset, name_of),
            }
            return json_response(answer, 201)
        except ApiError as exc:
            return door._refuse(exc)

    async def batch(self, request: Request) -> Response:
        """GET /batch/{batch_id}/: {"id", "counts": {state: n}, "ids", "then"}."""
        door = self.door
        door.counters["requests"] += 1
        try:
            return json_response(batch_report(door.desk.book, door.desk.waits.batches, request))
        except ApiError as exc:
            return door._refuse(exc)


def batch_report(book: JobBook, batches: dict[str, str], request: Request) -> dict[str, Any]:
    """The batch the path's `batch_id` names (ApiError 404 when none): its jobs counted by state
    (a job already forgotten is not counted), their ids, its `then` job's id."""
    batch_id = request.path_params["batch_id"]
    return report_of(book, batches, batch_id)

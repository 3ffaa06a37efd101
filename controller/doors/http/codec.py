"""The HTTP job API's codec, pure: request bodies in, job objects out, errors as values.

The shell (controller/doors/http/shell.py) owns the server and the clock; this
module decides what a body means and what a job looks like in JSON, so that
every rule about fields and errors is in one place and testable without a
server. A bad request can only raise `ApiError`, which carries the HTTP
status and the message of the error object `{"code": status, "message": ...}`.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from controller import datagram as dg
from controller import declared, options
from controller.core.limits import parse_rate
from controller.core.model import TaskState
from controller.datagram import BadPacket
from controller.job_ids import (
    ID_RULE,
    MAX_ID_LENGTH,
    MAX_TEXT,
    UDP_ID_PREFIX,
    UDP_ID_RULE,
    valid_id,
)
from controller.job_states import JobState
from controller.jobs import Job
from controller.options import JobOptions, rfc3339
from controller.progress import check_http as check_progress
from controller.usage import Usage, usage_from_json

# ?wait= is capped so that a forgotten long-poll does not hold a connection for ever.
MAX_WAIT = 60.0
DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
# Room for the other fields around the largest payload.
BODY_OVERHEAD = 64 * 1024
# The most bytes JSON may spell one byte of a payload with: a character escaped as \u00XX (6
# bytes for 1; base64 needs 4 for 3).
ESCAPED = 6
# Jobs one `POST /job/` array may carry (more: 413).
MAX_BULK = 10_000
# Room an array's body has beyond a single job's body: 1 KiB a job, so that 10,000 small jobs
# fit whatever max_extra_size is.
BULK_JOB_ROOM = 1024
# Longest text fields (MAX_TEXT, the default, is controller/job_ids.py's).
MAX_ERROR = 100_000
MAX_LOG = 1_000_000

NEW_JOB_FIELDS = frozenset(
    {"name", "info_url", "download_url", "payload", "payload_b64", "id", *options.OPTION_NAMES}
)
QUEUE_FIELDS = frozenset({"paused", "concurrency", "rate"})
# The largest queue concurrency taken (a whole number, as a rate's N).
MAX_CONCURRENCY = 1_000_000_000
UPDATE_FIELDS = frozenset(
    {
        "state",
        "log",
        "worker",
        "lease",
        "result",
        "result_b64",
        "error",
        "usage",
        "progress",
        "status",
    }
)
# A poller's lease is a token the controller made (about 22 characters); anything longer is not one.
MAX_LEASE = 200
USER_STATES = frozenset({"canceled"})
POLLER_STATES = frozenset({"working", "finished", "failed"})


class ApiError(Exception):
    """A request refused: `status` is the HTTP status, `message` says why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def body(self) -> dict[str, Any]:
        return {"code": self.status, "message": self.message}


@dataclass(frozen=True, slots=True)
class NewJob:
    id: str | None
    payload: bytes
    name: str
    info_url: str
    download_url: str
    options: JobOptions


@dataclass(frozen=True, slots=True)
class Update:
    state: JobState | None
    log: str | None
    worker: str | None
    result: bytes | None
    error: str | None
    lease: str | None = None
    usage: Usage | None = None  # a poller's report of what its attempt used
    progress: tuple[float, str] | None = None  # a poller's `progress` and `status`


def max_body(max_payload: int) -> int:
    """The largest request body worth reading for payloads up to `max_payload` bytes, however
    a standard JSON encoder escapes their text."""
    return max_payload * ESCAPED + BODY_OVERHEAD


def max_bulk_body(max_payload: int) -> int:
    """The largest body of a `POST /job/` array: a single job's, plus BULK_JOB_ROOM a job."""
    return max_body(max_payload) + MAX_BULK * BULK_JOB_ROOM


def new_job_id() -> str:
    """A new job id: a UUID4 in upper case."""
    return str(uuid.uuid4()).upper()


def _object(body: bytes, allowed: frozenset[str]) -> dict[str, Any]:
    if not body:  # no body: every field left out (white space alone is not JSON)
        return {}
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        raise ApiError(400, "the body is not valid JSON") from None
    return _fields(data, allowed)


def _fields(data: Any, allowed: frozenset[str]) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object")
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ApiError(400, f"unknown field {unknown[0]!r} (known: {', '.join(sorted(allowed))})")
    for name, value in data.items():
        # null is never taken as "not given": a field is left out, or has a value of its
        # type (text, a number, a list...). PUT /queue/{name}/, where null removes a limit,
        # reads its own body (parse_queue_settings).
        if value is None:
            raise ApiError(400, f"{name} must not be null (leave it out, or give a value)")
    return data


def _text(data: dict[str, Any], name: str, limit: int = MAX_TEXT) -> str | None:
    value = data.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise ApiError(400, f"{name} must be text, got {type(value).__name__}")
    if len(value) > limit:
        raise ApiError(400, f"{name} is longer than {limit} characters")
    return value


def _bytes(data: dict[str, Any], name: str, max_size: int) -> bytes | None:
    """`name` or `name_b64` (the datagram format's reader), with the API's statuses."""
    try:
        return dg.bytes_param(data, name, max_size, where="")
    except BadPacket as exc:
        raise ApiError(413 if exc.code.endswith("_too_large") else 400, exc.message) from None


def parse_new_job(
    body: bytes,
    max_payload: int,
    defaults: JobOptions = options.DEFAULT,
    now_wall: float | None = None,
) -> NewJob:
    """The body of `POST /job/` (every field optional; the options over `defaults`)."""
    data = _object(body, NEW_JOB_FIELDS)
    return _new_job(data, max_payload, defaults, time.time() if now_wall is None else now_wall)


def parse_new_jobs(
    body: bytes,
    max_payload: int,
    defaults: JobOptions = options.DEFAULT,
    now_wall: float | None = None,
) -> tuple[list[NewJob], bool]:
    """The body of `POST /job/`: one job (an object) or several (an array of them, at most
    MAX_BULK: more is 413). True when it was an array. Every element is checked; the first
    bad one's error names its index (and its id when it has one)."""
    wall = time.time() if now_wall is None else now_wall
    try:
        text = body.decode(json.detect_encoding(body), "surrogatepass")
    except ValueError:  # UnicodeDecodeError
        raise ApiError(400, "the body is not valid JSON") from None
    start = _SPACE.match(text).end()  # type: ignore[union-attr]
    if not text.startswith("[", start):
        return [parse_new_job(body, max_payload, defaults, wall)], False
    news = []
    for index, data in enumerate(_elements(text, start)):
        try:
            news.append(_new_job(_fields(data, NEW_JOB_FIELDS), max_payload, defaults, wall))
        except ApiError as exc:
            job_id = data.get("id") if isinstance(data, dict) else None
            named = f" (id {job_id[:200]!r})" if isinstance(job_id, str) else ""
            message = exc.message.replace("the body must be", "it must be")
            raise ApiError(exc.status, f"job {index}{named}: {message}") from None
    return news, True


# JSON's white space, between an array's elements.
_SPACE = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


def _elements(text: str, start: int) -> list[Any]:
    """The elements of the JSON array at `text[start]`, read one at a time, so that an array
    of more than MAX_BULK is refused (413) without building it whole."""
    items: list[Any] = []
    at = _SPACE.match(text, start + 1).end()  # type: ignore[union-attr]
    try:
        if text.startswith("]", at):
            at += 1
        else:
            while True:
                item, at = _DECODER.raw_decode(text, at)
                items.append(item)
                if len(items) > MAX_BULK:
                    raise ApiError(413, f"more than {MAX_BULK} jobs in one request")
                at = _SPACE.match(text, at).end()  # type: ignore[union-attr]
                if text.startswith(",", at):
                    at = _SPACE.match(text, at + 1).end()  # type: ignore[union-attr]
                    continue
                if not text.startswith("]", at):
                    raise ValueError("expected , or ]")
                at += 1
                break
    except (ValueError, RecursionError):
        raise ApiError(400, "the body is not valid JSON") from None
    if _SPACE.match(text, at).end() != len(text):  # type: ignore[union-attr]
        raise ApiError(400, "the body is not valid JSON")
    return items


def _new_job(
    data: dict[str, Any], max_payload: int, defaults: JobOptions, now_wall: float
) -> NewJob:
    try:
        chosen = options.parse(data, defaults, now_wall)
    except options.BadOption as exc:
        raise ApiError(400, str(exc)) from None
    job_id = _text(data, "id", MAX_ID_LENGTH)
    if job_id is not None and not valid_id(job_id):
        raise ApiError(400, ID_RULE)
    if job_id is not None and job_id.startswith(UDP_ID_PREFIX):
        raise ApiError(400, UDP_ID_RULE)
    return NewJob(
        id=job_id,
        payload=_bytes(data, "payload", max_payload) or b"",
        name=_text(data, "name") or "",
        info_url=_text(data, "info_url") or "",
        download_url=_text(data, "download_url") or "",
        options=chosen,
    )


def parse_update(body: bytes, max_result: int) -> Update:
    """The body of `PUT /job/{id}/`: `state` and/or `log`, and what a poller reports."""
    data = _object(body, UPDATE_FIELDS)
    state_name = _text(data, "state", 40)
    state = None
    if state_name is not None:
        if state_name not in USER_STATES | POLLER_STATES:
            known = ", ".join(sorted(USER_STATES | POLLER_STATES))
            raise ApiError(400, f"state {state_name!r} cannot be set (one of: {known})")
        state = JobState(state_name)
    update = Update(
        state=state,
        log=_text(data, "log", MAX_LOG),
        worker=_text(data, "worker", MAX_ID_LENGTH),
        result=_bytes(data, "result", max_result),
        error=_text(data, "error", MAX_ERROR),
        lease=_text(data, "lease", MAX_LEASE),
        usage=_usage(data),
        progress=_progress(data),
    )
    if update.state is None and update.log is None:
        raise ApiError(400, "give state and/or log")
    if update.progress is not None and update.worker is None:
        raise ApiError(400, "progress comes from the poller holding the job: give worker")
    return update


def _progress(data: dict[str, Any]) -> tuple[float, str] | None:
    """A poller's `progress` (a number from 0 to 1) and `status` (text, optional)."""
    if "progress" not in data:
        if "status" in data:
            raise ApiError(400, "status comes with progress")
        return None
    progress, status = data["progress"], data.get("status", "")
    why = check_progress(progress, status)
    if why is not None:
        raise ApiError(400, why)
    return float(progress), status


def _usage(data: dict[str, Any]) -> Usage | None:
    if "usage" not in data:
        return None
    try:
        return usage_from_json(data["usage"])
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None


def parse_queue(value: str | None) -> str | None:
    """`?queue=NAME` of `GET /job/`, or a queue's name in a path."""
    if value is None:
        return None
    if not options.valid_name(value):
        raise ApiError(400, f"a queue name must match {options.NAME_RULE}, got {value[:80]!r}")
    return value


def parse_queue_settings(body: bytes) -> dict[str, Any]:
    """The body of `PUT /queue/{name}/`: any of `paused` (true|false), `concurrency` (a
    whole number >= 1, null: none) and `rate` ("N/s" or "N/m", null: none), at least one;
    returns those given, `rate` as a `Rate`."""
    try:
        data = json.loads(body) if body else None
    except (ValueError, RecursionError):
        raise ApiError(400, "the body is not valid JSON") from None
    if not isinstance(data, dict) or not data:
        raise ApiError(400, "give paused, concurrency or rate in a JSON object")
    unknown = sorted(set(data) - QUEUE_FIELDS)
    if unknown:
        known = ", ".join(sorted(QUEUE_FIELDS))
        raise ApiError(400, f"unknown field {unknown[0][:80]!r} (known: {known})")
    out: dict[str, Any] = {}
    if "paused" in data:
        if not isinstance(data["paused"], bool):
            raise ApiError(400, "give paused: true or false")
        out["paused"] = data["paused"]
    if "concurrency" in data:
        n = data["concurrency"]
        if n is not None and (
            isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CONCURRENCY
        ):
            raise ApiError(400, f"concurrency must be a whole number 1..{MAX_CONCURRENCY} or null")
        out["concurrency"] = n
    if "rate" in data:
        try:
            out["rate"] = None if data["rate"] is None else parse_rate(data["rate"])
        except ValueError as exc:
            raise ApiError(400, f"rate: {exc} (or null)") from None
    return out


def parse_state(value: str | None) -> JobState | None:
    """`?state=NAME` of `GET /job/`."""
    if value is None:
        return None
    try:
        return JobState(value)
    except ValueError:
        known = ", ".join(state.value for state in JobState)
        raise ApiError(400, f"unknown state {value!r} (one of: {known})") from None


def parse_flag(value: str | None, name: str) -> bool:
    """A yes-or-no query parameter: 1, true or yes; 0, false, no or empty (absent: no)."""
    if value is None:
        return False
    word = value.lower()
    if word in ("1", "true", "yes"):
        return True
    if word in ("", "0", "false", "no"):
        return False
    raise ApiError(400, f"{name} must be 1 or 0")


def parse_number(
    value: str | None,
    name: str,
    default: float,
    low: float,
    high: float,
    *,
    whole: bool = False,
) -> float:
    """A query parameter that is a number (a whole one with `whole`) from `low` to `high`."""
    if value is None:
        return default
    try:
        number = float(int(value)) if whole else float(value)
    except ValueError:
        kind = "a whole number" if whole else "a number"
        raise ApiError(400, f"{name} must be {kind}, got {value[:40]!r}") from None
    if number != number:  # NaN
        raise ApiError(400, f"{name} must be a number, got {value[:40]!r}")
    if not low <= number <= high:
        raise ApiError(400, f"{name} must be from {low:g} to {high:g}, got {value[:40]!r}")
    return number


def parse_declared(query: Mapping[str, str]) -> declared.Declared:
    """`?queues=A,B&labels=X,Y` of `/ping/`: what the poller serves and has (no queue:
    `default`)."""
    try:
        return declared.read(query.get("queues", ""), query.get("labels", ""))
    except declared.BadDeclaration as exc:
        raise ApiError(400, str(exc)) from None


def dumps(body: Any) -> bytes:
    """A JSON answer: ASCII only, so that any text a client sent (a lone surrogate too)
    comes back without an encoding error."""
    return json.dumps(body, separators=(",", ":")).encode("ascii")


def job_json(job: Job, wall_offset: float, name_of: Callable[[int], str] = str) -> dict[str, Any]:
    """The job object of the API (`wall_offset` turns the trio clock into wall-clock time;
    `name_of` names a worker by its number: a poller's name, a calculator's host:port)."""
    state = job.state
    holder = job.worker
    worker = name_of(holder) if holder else None
    out: dict[str, Any] = {
        "id": job.id,
        "task_id": job.task_id,
        "door": job.door,
        "name": job.name,
        "state": state.value,
        "added_at": rfc3339(job.added_at + wall_offset),
        "updated_at": rfc3339(max(job.updated_at, job.added_at) + wall_offset),
        "attempts": job.task.attempts if job.task is not None else job.attempts,
        "worker": worker,
        "info_url": job.info_url,
        "download_url": job.download_url,
        "log": job.log,
        "error": job.error,
        "failed_post": job.failed_post,
        **options.as_fields(job.options),
        # What its latest attempt used, and why it failed (DESIGN.md section 15).
        "usage": job.usage.to_json() if job.usage is not None else None,
        "reason": job.reason or None,
    }
    out["progress"] = progress = job.progress  # what its worker last reported, or None
    out["status"] = job.progress_status if progress is not None else None
    task = job.task
    if task is not None and task.state is TaskState.SCHEDULED and task.attempts:
        out["run_at"] = rfc3339(task.deadline + wall_offset)  # waiting to be retried
    if state is JobState.DELETED:
        return out
    dg.put_bytes(out, "payload", job.payload)
    if state is JobState.FINISHED:
        dg.put_bytes(out, "result", job.result)
    return out

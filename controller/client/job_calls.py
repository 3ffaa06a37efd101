"""What `Client` and `AsyncClient` share: the URL's scheme read, a job's request built, the
controller's answers read.

`split_url` tells http://, https://, udp:// and redis:// URLs apart; `request_body` is the JSON
of a submitted job (HTTP and UDP alike); `checked` reads an HTTP answer, raising `KeyError`
(404) or `ControllerError` for a refusal; `outcome` is an ended job's result bytes or
`JobFailed`. Waits longer than the server's longest `?wait=` (MAX_WAIT) are several of them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar
from urllib.parse import quote, urlsplit

from controller import datagram as dg
from controller.client.errors import ControllerError, JobFailed
from controller.client.http import Answer
from controller.client.http_endpoint import url_port
from controller.job_states import JobState

# get, cancel and retry over udp://.
NO_SUCH_REQUEST = (
    "get, cancel and retry need http:// or redis:// (the UDP door has no such request)"
)
# The states of an ended job object.
FINAL = frozenset(state.value for state in JobState if state.final)
# Longest single ?wait= the server allows; longer waits are several of them.
MAX_WAIT = 60.0
# Jobs the HTTP door takes in one `POST /job/` array; `submit_many` sends more as several.
MAX_BULK = 10_000


def payload_bytes(payload: bytes | str) -> bytes:
    """A job's payload as bytes (a str in UTF-8); TypeError for anything else."""
    if isinstance(payload, str):
        return payload.encode("utf-8")
    if isinstance(payload, bytes | bytearray | memoryview):
        return bytes(payload)
    raise TypeError(f"payload must be bytes or str, got {type(payload).__name__}")


def request_body(
    payload: bytes, name: str | None, job_id: str | None, options: dict[str, Any]
) -> dict[str, Any]:
    """The JSON object a job is submitted with, over HTTP and UDP."""
    body: dict[str, Any] = {}
    dg.put_bytes(body, "payload", payload)
    if name is not None:
        body["name"] = name
    if job_id is not None:
        body["id"] = job_id
    body.update(options)
    return body


def bulk_element(
    spec: Any, check: Callable[..., dict[str, Any]]
) -> tuple[bytes, str | None, str | None, dict[str, Any]]:
    """One element of `submit_many`: a payload (bytes or str) or a dict of `submit()`'s
    keyword arguments, as (payload, name, id, options); `check(**options)` reads the options
    (`jobfields.option_fields`). TypeError or ValueError for a bad one."""
    if not isinstance(spec, dict):
        return payload_bytes(spec), None, None, {}
    given = dict(spec)
    data = payload_bytes(given.pop("payload", b""))
    name, job_id = given.pop("name", None), given.pop("id", None)
    for field, value in (("name", name), ("id", job_id)):
        if value is not None and not isinstance(value, str):
            raise TypeError(f"{field} must be a str, got {type(value).__name__}")
    return data, name, job_id, check(**given)


def bulk_bodies(
    elements: list[tuple[bytes, str | None, str | None, dict[str, Any]]],
) -> list[list[dict[str, Any]]]:
    """The `POST /job/` arrays that carry `elements`, at most MAX_BULK each."""
    bodies = [request_body(*element) for element in elements]
    return [bodies[start : start + MAX_BULK] for start in range(0, len(bodies), MAX_BULK)]


J = TypeVar("J")
# submit_batch over another scheme than http(s)://.
NO_BATCH = "submit_batch needs http:// or https:// (POST /batch/ is the HTTP door's)"


@dataclass(frozen=True)
class Batch(Generic[J]):
    """A batch `submit_batch` made: its id, its jobs in order, and its `then` job (which runs
    once they have all ended, whatever their outcomes)."""

    id: str
    jobs: list[J]
    then: J


def batch_body(jobs: Iterable[Any], then: Any, check: Callable[..., dict[str, Any]]) -> Any:
    """The body of `POST /batch/`: each job (and `then`) as `bulk_element` reads it; `then`
    may not give `after` or `after_any` (they are the batch's). TypeError or ValueError."""
    bodies = [request_body(*bulk_element(spec, check)) for spec in jobs]
    if len(bodies) > MAX_BULK:
        raise ValueError(f"a batch has at most {MAX_BULK} jobs, got {len(bodies)}")
    if isinstance(then, dict) and ("after" in then or "after_any" in then):
        raise ValueError("then: after and after_any are the batch's: leave them out")
    return {"jobs": bodies, "then": request_body(*bulk_element(then, check))}


def checked_batch(resp: Answer) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    """A `POST /batch/` answer: (its id, its jobs' objects, its then job's object)."""
    data = checked(resp)
    jobs, then = data.get("jobs"), data.get("then")
    if not isinstance(jobs, list) or not isinstance(then, dict):
        raise ControllerError(resp.status, "the answer is not a batch")
    return str(data.get("id", "")), [job if isinstance(job, dict) else {} for job in jobs], then


def checked_list(resp: Answer) -> list[dict[str, Any]]:
    """An HTTP answer's JSON array of job objects (errors as `checked`)."""
    try:
        data = resp.json()
    except ValueError:
        raise ControllerError(resp.status, resp.text[:200]) from None
    if resp.status >= 400 or not isinstance(data, list):
        checked(resp)
        raise ControllerError(resp.status, "the answer is not a list of jobs")
    return [job if isinstance(job, dict) else {} for job in data]


def outcome(data: dict[str, Any]) -> bytes:
    """The result of an ended job object, or JobFailed."""
    state = data.get("state", "")
    if state == "finished":
        return dg.read_bytes(data, "result") or b""
    raise JobFailed(str(data.get("id")), str(state), str(data.get("error", "")))


def checked(resp: Answer) -> dict[str, Any]:
    """An HTTP answer's JSON object; KeyError for a 404, ControllerError for another refusal
    or an answer that is not JSON."""
    try:
        data = resp.json()
    except ValueError:
        raise ControllerError(resp.status, resp.text[:200]) from None
    if resp.status >= 400:
        message = data.get("message", "") if isinstance(data, dict) else ""
        if resp.status == 404:
            raise KeyError(message or "no such job")
        raise ControllerError(resp.status, str(message))
    return data if isinstance(data, dict) else {}


def job_path(job_id: str) -> str:
    """The path of a job's object in the HTTP API."""
    return f"/job/{quote(job_id, safe='')}/"


def wait_query(wait: float) -> dict[str, str] | None:
    """The `?wait=` of a GET that waits `wait` seconds (at most MAX_WAIT); None: no wait."""
    return {"wait": f"{min(wait, MAX_WAIT):.3f}"} if wait > 0 else None


def split_url(url: str) -> tuple[str, str, int]:
    """A client URL's (scheme, host, port); ValueError when it is none of the four kinds."""
    parts = urlsplit(url)
    port = url_port(parts, 6379 if parts.scheme == "redis" else None)
    if parts.scheme == "redis" and parts.hostname and port is not None:
        return parts.scheme, parts.hostname, port or 6379
    if parts.scheme not in ("http", "https", "udp") or not parts.hostname or not port:
        raise ValueError(
            "expected http://HOST:PORT[/PREFIX/], https://HOST:PORT[/PREFIX/], udp://HOST:PORT"
            f" or redis://HOST:PORT/DB, got {url!r}"
        )
    return parts.scheme, parts.hostname, port


def remaining(deadline: float | None) -> float:
    """How long the next wait may be: MAX_WAIT without a deadline."""
    return MAX_WAIT if deadline is None else max(0.0, deadline - time.monotonic())

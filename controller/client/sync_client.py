"""The blocking client: `Client` (shareable by threads) and its `Job`; `AsyncClient`
(controller/client/async_client.py) is the same with coroutines, for asyncio or trio.

    from controller.client import Client, JobFailed
    with Client("http://127.0.0.1:8080") as client:
        job = client.submit(b"input", name="demo")
        print(job.result(timeout=30))

`url` is `http://HOST:PORT[/PREFIX/]` or `https://HOST:PORT[/PREFIX/]` (the HTTP job
API; https checks the certificate against the system's trust store, or only against
`ca_file=` when given; HTTPS_PROXY, HTTP_PROXY and NO_PROXY are honoured),
`udp://HOST:PORT` (the UDP front door; the client picks each job's task_id, and
`id`, `get`, `cancel` and `retry` are not available there) or `redis://HOST:PORT/DB` (the
Redis stream `jobs`, or `?stream=NAME`, that controllers consume; see
controller/client/redis_backend.py).
`job.state` uses the job states of the HTTP API (waiting, scheduled, pending, requested,
working, finished, failed, canceled, deleted) for all three.
`submit` also takes the job options (queue, priority, requires, delay or run_at,
max_retries, retry_delay, timeout, placement_timeout, owner, unique_key, after, after_any;
controller/client/jobfields.py), checked before anything is sent; a job whose `unique_key`
a live job holds makes nothing, and the `Job` returned is that live job (over redis:// the
`Job` turns into it once a controller has read the entry: its `id` changes); `retry(id)`
puts a failed or canceled job back (HTTP and Redis).
`job.result()` returns the result bytes, raises `JobFailed` (its `error` says
why; a canceled or deleted job too) or the builtin `TimeoutError`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime
from typing import Any

import redis

from controller.client.errors import ControllerError
from controller.client.http import HttpPool
from controller.client.job_calls import (
    FINAL,
    MAX_WAIT,
    NO_BATCH,
    NO_SUCH_REQUEST,
    Batch,
    batch_body,
    bulk_bodies,
    bulk_element,
    checked,
    checked_batch,
    checked_list,
    job_path,
    outcome,
    payload_bytes,
    remaining,
    request_body,
    split_url,
    wait_query,
)
from controller.client.jobfields import as_text, initial_state, option_fields
from controller.client.redis_backend import DUPLICATE, NO_LISTENER, RedisBackend
from controller.client.udp_backend import UdpBackend
from controller.doors.udp import words
from controller.job_states import JobState


def _retried(job_id: str, state: str) -> None:
    """A Redis retry's answer (the state the job has afterwards) as the HTTP door's: a job
    that was not failed or canceled is a conflict (409), one without a hash unknown."""
    if state == "pending":
        return
    if not state:
        raise KeyError(f"no job {job_id!r}")
    if state == NO_LISTENER:
        raise ControllerError("redis", "no controller listens for retries on this stream")
    raise ControllerError(409, f"job {job_id} is {state}: only a failed or canceled job is retried")


@contextlib.contextmanager
def _redis_errors() -> Iterator[None]:
    """Redis failures as ControllerError("redis", why)."""
    try:
        yield
    except redis.RedisError as exc:
        raise ControllerError("redis", str(exc) or type(exc).__name__) from None


class Job:
    """A submitted job (blocking); `state` is the latest state seen."""

    def __init__(self, client: Client, data: dict[str, Any], task_id: int = 0) -> None:
        self._client = client
        self._data = data
        self._task_id = task_id
        self.id: str = str(data["id"])

    @property
    def state(self) -> str:
        if self._data.get("state") not in FINAL:
            if self._client.scheme == "udp":
                found = self._client._udp().peek(self._task_id)
                if found is not None:
                    self._data = self._client._udp_job(self.id, found)
            elif self._client.scheme == "redis":
                self._data = self._client._fetch(self, 0.0)
        return str(self._data.get("state", "pending"))

    @property
    def info(self) -> dict[str, Any]:
        """The job object as last seen (over http://: every field of the API's job)."""
        return dict(self._data)

    def refresh(self) -> str:
        """Read the job's state anew."""
        self._data = self._client._fetch(self, 0.0)
        return self.state

    def result(self, timeout: float | None = None) -> bytes:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._data.get("state") not in FINAL:
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"job {self.id} did not end within {timeout:g} s")
            self._data = self._client._fetch(self, remaining(deadline))
        return self._client._result(self, self._data)

    def __repr__(self) -> str:
        return f"<Job {self.id} {self._data.get('state')}>"


class Client:
    """Blocking client; one may be shared by threads."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        ca_file: str | None = None,
        timeout: float = 30.0,
    ) -> None:
        self.scheme, host, port = split_url(url)
        self.timeout = timeout
        self._http: HttpPool | None = None
        self._udp_backend: UdpBackend | None = None
        self._redis: RedisBackend | None = None
        if self.scheme in ("http", "https"):
            self._http = HttpPool(url, token=token, timeout=MAX_WAIT + timeout, ca_file=ca_file)
        elif self.scheme == "redis":
            self._redis = RedisBackend(url, timeout)
        else:
            self._udp_backend = UdpBackend(host, port)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
        if self._udp_backend is not None:
            self._udp_backend.close()
        if self._redis is not None:
            self._redis.close()

    def submit(
        self,
        payload: bytes | str = b"",
        *,
        name: str | None = None,
        id: str | None = None,
        queue: str | None = None,
        priority: int | None = None,
        requires: Sequence[str] | None = None,
        delay: float | None = None,
        run_at: datetime | None = None,
        max_retries: int | None = None,
        retry_delay: float | None = None,
        timeout: float | None = None,
        placement_timeout: float | None = None,
        owner: str | None = None,
        unique_key: str | None = None,
        after: Sequence[str] | None = None,
        after_any: bool | None = None,
    ) -> Job:
        """Submit a job. The options left None are not sent (the controller's defaults
        apply); a bad one raises ValueError with the controller's message, before sending.
        `delay`, `retry_delay`, `timeout` and `placement_timeout` are seconds, `run_at` an
        aware datetime, `requires` a list of labels. With `unique_key`, while a live job holds
        that key nothing is made and the `Job` is that one (DESIGN.md section 17). With
        `after` (ids of jobs the controller holds) the job waits in state `waiting` until they
        have all ended, and is canceled when one failed or was canceled unless `after_any`."""
        options = option_fields(
            queue=queue,
            priority=priority,
            requires=requires,
            delay=delay,
            run_at=run_at,
            max_retries=max_retries,
            retry_delay=retry_delay,
            timeout=timeout,
            placement_timeout=placement_timeout,
            owner=owner,
            unique_key=unique_key,
            after=after,
            after_any=after_any,
        )
        return self._submit(payload_bytes(payload), name, id, options)

    def submit_many(self, jobs: Iterable[Any]) -> list[Job]:
        """Submit several jobs: each a payload (bytes or str) or a dict of `submit()`'s
        keyword arguments (all checked before anything is sent); their `Job`s in order.
        Over http(s):// one request (`POST /job/` with an array) per 10,000 jobs, all of a
        request made or none (ControllerError naming the first bad job's index in it);
        over udp:// one submission each, over redis:// one pipeline of entries."""
        elements = [bulk_element(spec, option_fields) for spec in jobs]
        if self._http is None:
            return self._submit_each(elements)
        out: list[Job] = []
        for body in bulk_bodies(elements):
            out += [
                Job(self, data)
                for data in checked_list(self._http.request("POST", "/job/", json=body))
            ]
        return out

    def submit_batch(self, jobs: Iterable[Any], *, then: Any) -> Batch[Job]:
        """Submit a batch (`POST /batch/`, http(s):// only): `jobs` as `submit_many` takes
        them, all made or none, and `then` (a payload or a dict of `submit()`'s keyword
        arguments, without `after`), which waits in state `waiting` and runs once they have
        all ended, whatever their outcomes. The `Batch` has `.id`, `.jobs` and `.then`."""
        body = batch_body(jobs, then, option_fields)
        if self._http is None:
            raise ValueError(NO_BATCH)
        batch_id, made, last = checked_batch(self._http.request("POST", "/batch/", json=body))
        return Batch(batch_id, [Job(self, data) for data in made], Job(self, last))

    def _submit_each(self, elements: list[tuple[bytes, str | None, str | None, Any]]) -> list[Job]:
        """udp:// one submission each (no id anywhere, checked first); redis:// one pipeline."""
        if self._redis is not None:
            entries = []
            for data, name, job_id, options in elements:
                entries.append((data, name, job_id, as_text(options), initial_state(options)))
            with _redis_errors():
                ids = self._redis.submit_many(entries)
            return [Job(self, {"id": i, "state": e[4]}) for i, e in zip(ids, entries, strict=True)]
        if any(element[2] is not None for element in elements):
            raise ValueError("udp:// picks each job's task_id itself: id is not accepted")
        return [self._submit(*element) for element in elements]

    def _submit(
        self, data: bytes, name: str | None, id: str | None, options: dict[str, Any]
    ) -> Job:
        if self._http is not None:
            resp = self._http.request("POST", "/job/", json=request_body(data, name, id, options))
            return Job(self, checked(resp))
        if self._redis is not None:
            state = initial_state(options)
            with _redis_errors():
                job_id = self._redis.submit(data, name, id, as_text(options), state)
            return Job(self, {"id": job_id, "state": state})
        if id is not None:
            raise ValueError("udp:// picks each job's task_id itself: id is not accepted")
        udp = self._udp()
        task_id = next(udp.task_ids)
        params: dict[str, Any] = {"task_id": task_id, **request_body(data, None, None, options)}
        acked = udp.request("add_task", params, time.monotonic() + self.timeout)
        held = acked.get("id")  # a live job holds its unique_key: that job, nothing made
        if isinstance(held, str) and held:
            return Job(self, {"id": held, "state": "pending"}, udp.task_id_of(held))
        return Job(self, {"id": udp.job_id(task_id), "state": "pending"}, task_id)

    def get(self, id: str) -> Job:
        if self._redis is not None:
            with _redis_errors():
                data = self._redis.read(id)
            if data is None:
                raise KeyError(f"no job {id!r}")
            return Job(self, data)
        return Job(self, checked(self._need_http().request("GET", job_path(id))))

    def cancel(self, id: str) -> Job:
        if self._redis is not None:
            with _redis_errors():
                self._redis.cancel(id)
            return self.get(id)
        resp = self._need_http().request("PUT", job_path(id), json={"state": "canceled"})
        if resp.status == 409:  # it ended already: its final state is the answer
            return self.get(id)
        return Job(self, checked(resp))

    def retry(self, id: str) -> Job:
        """Put a failed or canceled job back to `pending` (a fresh `max_retries`); the job.
        ControllerError with status 409 when it is in another state, KeyError if unknown."""
        if self._redis is not None:
            with _redis_errors():
                state = self._redis.retry(id)
            _retried(id, state)
            return self.get(id)
        return Job(self, checked(self._need_http().request("POST", job_path(id) + "retry/")))

    # ------------------------------------------------------------ for Job

    def _need_http(self) -> HttpPool:
        if self._http is None:
            raise ValueError(NO_SUCH_REQUEST)
        return self._http

    def _udp(self) -> UdpBackend:
        assert self._udp_backend is not None
        return self._udp_backend

    def _udp_job(self, job_id: str, params: dict[str, Any]) -> dict[str, Any]:
        read = words.STATE_OF_WORD.get(str(params.get("status")), JobState.PENDING)
        state = read.value
        return {"id": job_id, "state": state, "error": params.get("error", ""), "udp": params}

    def _fetch(self, job: Job, wait: float) -> dict[str, Any]:
        if self._redis is not None:
            with _redis_errors():
                if wait <= 0:
                    data = self._redis.read(job.id)
                else:
                    data = self._redis.wait(job.id, time.monotonic() + wait)
            if data is not None and data.get("state") == DUPLICATE:
                # A live job held the entry's unique_key: the job is that one from now on.
                job.id = str(data.get("duplicate_of", ""))
                with _redis_errors():
                    data = self._redis.read(job.id)
            return data if data is not None else {"id": job.id, "state": "pending"}
        if self._http is not None:
            return checked(self._http.request("GET", job_path(job.id), query=wait_query(wait)))
        udp = self._udp()
        if wait <= 0:
            found = udp.peek(job._task_id)
            if found is None:
                found = udp.request("get_task", {"task_id": job._task_id}, time.monotonic() + 5)
            return self._udp_job(job.id, found)
        params_out = udp.outcome(job._task_id, time.monotonic() + wait)
        return self._udp_job(job.id, params_out)

    def _result(self, job: Job, data: dict[str, Any]) -> bytes:
        if self._redis is not None and data.get("state") == "finished":
            return bytes(data.get("result", b""))
        if self._http is not None or data.get("state") != "finished":
            return outcome(data)
        deadline = time.monotonic() + self.timeout
        return self._udp().result_bytes(job._task_id, data["udp"], deadline)

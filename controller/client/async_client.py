"""The async client: `AsyncClient` and its `AsyncJob`, under asyncio or trio alike.

Over http:// and https:// it has its own `AsyncHttpPool`; udp:// and redis:// jobs run on
the blocking `Client` (controller/client/sync_client.py) in threads. The calls and their
answers are `Client`'s.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

import anyio

from controller.client.http import AsyncHttpPool
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
from controller.client.jobfields import option_fields
from controller.client.sync_client import Client, Job


class AsyncJob:
    """A submitted job (async); `state` is the latest state seen, `refresh()` reads it anew."""

    def __init__(self, client: AsyncClient, data: dict[str, Any], sync: Job | None = None) -> None:
        self._client = client
        self._data = data
        self._sync = sync  # udp:// and redis:// jobs run on the blocking backend, in a thread
        self._id = str(data["id"])

    @property
    def id(self) -> str:
        """The job's id (over redis://, that of the live job holding its unique_key once a
        controller found one)."""
        return self._sync.id if self._sync is not None else self._id

    @property
    def state(self) -> str:
        if self._sync is not None:
            if self._client.scheme == "udp":  # udp:// reads what its receiver has seen
                return self._sync.state
            return str(self._sync._data.get("state", "pending"))
        return str(self._data.get("state", "pending"))

    async def refresh(self) -> str:
        if self._sync is not None:
            return await anyio.to_thread.run_sync(self._sync.refresh)
        self._data = await self._client._get_json(self.id, 0.0)
        return self.state

    async def result(self, timeout: float | None = None) -> bytes:
        if self._sync is not None:
            # A cancelled wait leaves the thread to finish its (bounded) wait on its own.
            return await anyio.to_thread.run_sync(
                self._sync.result, timeout, abandon_on_cancel=True
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._data.get("state") not in FINAL:
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"job {self.id} did not end within {timeout:g} s")
            self._data = await self._client._get_json(self.id, remaining(deadline))
        return outcome(self._data)

    def __repr__(self) -> str:
        return f"<AsyncJob {self.id} {self.state}>"


class AsyncClient:
    """The same as `Client`, with coroutines; runs under asyncio and trio alike."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        ca_file: str | None = None,
        timeout: float = 30.0,
    ) -> None:
        self.scheme, _, _ = split_url(url)
        self._http: AsyncHttpPool | None = None
        self._sync: Client | None = None
        if self.scheme in ("http", "https"):
            timeout = MAX_WAIT + timeout
            self._http = AsyncHttpPool(url, token=token, timeout=timeout, ca_file=ca_file)
        else:
            self._sync = Client(url, token=token, timeout=timeout)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
        if self._sync is not None:
            await anyio.to_thread.run_sync(self._sync.close)

    async def submit(
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
    ) -> AsyncJob:
        """As `Client.submit`."""
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
        data = payload_bytes(payload)
        if self._sync is not None:
            sync_client = self._sync
            job = await anyio.to_thread.run_sync(
                lambda: sync_client._submit(data, name, id, options)
            )
            return AsyncJob(self, {"id": job.id}, job)
        assert self._http is not None
        resp = await self._http.request("POST", "/job/", json=request_body(data, name, id, options))
        return AsyncJob(self, checked(resp))

    async def submit_many(self, jobs: Iterable[Any]) -> list[AsyncJob]:
        """As `Client.submit_many`."""
        elements = [bulk_element(spec, option_fields) for spec in jobs]
        if self._sync is not None:
            sync_client = self._sync
            made = await anyio.to_thread.run_sync(sync_client._submit_each, elements)
            return [AsyncJob(self, {"id": job.id}, job) for job in made]
        assert self._http is not None
        out: list[AsyncJob] = []
        for body in bulk_bodies(elements):
            resp = await self._http.request("POST", "/job/", json=body)
            out += [AsyncJob(self, data) for data in checked_list(resp)]
        return out

    async def submit_batch(self, jobs: Iterable[Any], *, then: Any) -> Batch[AsyncJob]:
        """As `Client.submit_batch`."""
        body = batch_body(jobs, then, option_fields)
        if self._http is None:
            raise ValueError(NO_BATCH)
        resp = await self._http.request("POST", "/batch/", json=body)
        batch_id, made, last = checked_batch(resp)
        return Batch(batch_id, [AsyncJob(self, data) for data in made], AsyncJob(self, last))

    async def get(self, id: str) -> AsyncJob:
        if self._sync is not None and self.scheme == "redis":
            job = await anyio.to_thread.run_sync(self._sync.get, id)
            return AsyncJob(self, {"id": job.id}, job)
        return AsyncJob(self, await self._get_json(id, 0.0))

    async def cancel(self, id: str) -> AsyncJob:
        if self._sync is not None and self.scheme == "redis":
            job = await anyio.to_thread.run_sync(self._sync.cancel, id)
            return AsyncJob(self, {"id": job.id}, job)
        http = self._need_http()
        resp = await http.request("PUT", job_path(id), json={"state": "canceled"})
        if resp.status == 409:
            return await self.get(id)
        return AsyncJob(self, checked(resp))

    async def retry(self, id: str) -> AsyncJob:
        """As `Client.retry`."""
        if self._sync is not None and self.scheme == "redis":
            job = await anyio.to_thread.run_sync(self._sync.retry, id)
            return AsyncJob(self, {"id": job.id}, job)
        resp = await self._need_http().request("POST", job_path(id) + "retry/")
        return AsyncJob(self, checked(resp))

    def _need_http(self) -> AsyncHttpPool:
        if self._http is None:
            raise ValueError(NO_SUCH_REQUEST)
        return self._http

    async def _get_json(self, job_id: str, wait: float) -> dict[str, Any]:
        query = wait_query(wait)
        return checked(await self._need_http().request("GET", job_path(job_id), query=query))

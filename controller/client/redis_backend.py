"""The client's redis:// backend (blocking; `AsyncClient` runs it in threads).

`submit` marks the job `pending` (or `scheduled`, when it waits for a time) in
`job:<id>` unless it has a state already, then adds the entry (XADD) to its queue's
stream, in one round trip; `get` reads the hash; `cancel` and `retry` run the cancel
and retry scripts of controller/doors/redis/codec.py. Waiting for an outcome never polls: one
thread per client reads `<stream>:results` with a blocking XREAD and wakes the
waiters of the ids it sees; a waiter reads the hash after it has registered (and
after that thread has fixed where it starts), so an outcome written before the wait
began is found there.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qs, urlsplit, urlunsplit

import redis

from controller.doors.redis import codec as streams
from controller.doors.redis.codec import DUPLICATE, NO_LISTENER
from controller.job_ids import ID_RULE, valid_id
from controller.options import DEFAULT_QUEUE, rfc3339

__all__ = ["DUPLICATE", "NO_LISTENER", "RedisBackend", "parse_url"]

# How long one blocking XREAD of the results waits (ms): also how soon close() is noticed.
WATCH_BLOCK_MS = 1000
RETENTION_MS = 3_600_000  # a cancel's hash lives as long as a default outcome


def parse_url(url: str) -> tuple[str, str]:
    """(the Redis URL without the query, the stream name) from redis://HOST:PORT/DB?stream=N."""
    parts = urlsplit(url)
    if parts.scheme != "redis" or not parts.hostname:
        raise ValueError(f"expected redis://HOST:PORT/DB[?stream=NAME], got {url!r}")
    stream = parse_qs(parts.query).get("stream", ["jobs"])[0]
    if not stream:
        raise ValueError(f"the stream name is empty in {url!r}")
    return urlunsplit((parts.scheme, parts.netloc, parts.path, "", "")), stream


# One entry to add: payload, name, id, option fields as text, the state `job:<id>` starts in.
Entry = tuple[bytes, str | None, str | None, dict[str, str] | None, str]


class RedisBackend:
    def __init__(self, url: str, timeout: float) -> None:
        redis_url, self.stream = parse_url(url)
        self._url = redis_url
        self._timeout = timeout
        self.redis = redis.Redis.from_url(
            redis_url, socket_connect_timeout=timeout, socket_timeout=timeout
        )
        self.results = streams.results_stream(self.stream)
        self._cancel = self.redis.register_script(streams.CANCEL_SCRIPT)
        self._retry = self.redis.register_script(streams.RETRY_SCRIPT)
        self._lock = threading.Lock()
        self._waiters: dict[str, list[threading.Event]] = {}
        self._watcher: threading.Thread | None = None
        self._closed = threading.Event()

    def close(self) -> None:
        self._closed.set()
        self.redis.close()

    def submit(
        self,
        payload: bytes,
        name: str | None,
        job_id: str | None,
        options: dict[str, str] | None = None,
        state: str = "pending",
    ) -> str:
        """Add the entry; `options` are its option fields, as text (jobfields.as_text), and
        `state` what `job:<id>` says until a controller has the job."""
        return self.submit_many([(payload, name, job_id, options, state)])[0]

    def submit_many(self, jobs: Sequence[Entry]) -> list[str]:
        """Add the entries (each as `submit`'s arguments) in one round trip: a pipeline,
        sent once every id is checked. Their ids, in order."""
        pipe = self.redis.pipeline(transaction=False)  # one round trip; no MULTI needed
        ids = []
        for payload, name, job_id, options, state in jobs:
            if job_id is None:
                job_id = str(uuid.uuid4()).upper()
            elif not valid_id(job_id):
                raise ValueError(ID_RULE)
            fields: dict[Any, Any] = {"payload": payload, "id": job_id}
            if name is not None:
                fields["name"] = name
            fields.update(options or {})
            pipe.hsetnx(streams.job_key(job_id), "state", state)
            pipe.xadd(self.queue_stream(fields.get("queue", DEFAULT_QUEUE)), fields)
            ids.append(job_id)
        pipe.execute()
        return ids

    def queue_stream(self, queue: str) -> str:
        """The stream of a queue's entries: the configured one for `default`, else
        `<stream>.<queue>` (results of every queue go to `<stream>:results`)."""
        return self.stream if queue == DEFAULT_QUEUE else f"{self.stream}.{queue}"

    def read(self, job_id: str) -> dict[str, Any] | None:
        """The job's hash as a job object (`result` as bytes), or None if it has none. An entry
        whose unique_key a live job held has state DUPLICATE and `duplicate_of` (that job)."""
        raw: Any = self.redis.hgetall(streams.job_key(job_id))
        if not raw:
            return None
        if raw.get(b"state") == DUPLICATE.encode():
            held = raw.get(b"duplicate_of", b"").decode("utf-8", "replace")
            return {"id": job_id, "state": DUPLICATE, "duplicate_of": held}
        return {
            "id": job_id,
            "state": raw.get(b"state", b"pending").decode(),
            "result": raw.get(b"result", b""),
            "error": raw.get(b"error", b"").decode("utf-8", "replace"),
            "updated_at": raw.get(b"updated_at", b"").decode(),
        }

    def wait(self, job_id: str, deadline: float) -> dict[str, Any] | None:
        """The job object once it is final (or a duplicate), or as it is at `deadline`."""
        event = threading.Event()
        with self._lock:
            self._waiters.setdefault(job_id, []).append(event)
            self._start_watcher()
        try:
            while True:
                data = self.read(job_id)
                if data is not None and data["state"] in (*streams.FINAL_STATES, DUPLICATE):
                    return data
                left = deadline - time.monotonic()
                if left <= 0 or not event.wait(left):
                    return data
                event.clear()
                with self._lock:
                    self._waiters.setdefault(job_id, []).append(event)
        finally:
            with self._lock:
                waiting = self._waiters.get(job_id)
                if waiting is not None and event in waiting:
                    waiting.remove(event)
                    if not waiting:
                        del self._waiters[job_id]

    def cancel(self, job_id: str) -> str:
        """Cancel the job (its controller stops it); returns the state it has afterwards."""
        state = self._cancel(
            keys=[
                streams.job_key(job_id),
                self.results,
                streams.cancel_channel(self.stream),
            ],
            args=[job_id, rfc3339(time.time()), streams.CANCEL_ERROR, RETENTION_MS],
        )
        return state.decode() if isinstance(state, bytes) else str(state)

    def retry(self, job_id: str) -> str:
        """Ask the controllers to run a failed or canceled job again; the state it has
        afterwards (`pending` when asked; NO_LISTENER: nobody listens; "": no such job)."""
        state = self._retry(
            keys=[streams.job_key(job_id), streams.retry_channel(self.stream)],
            args=[job_id, rfc3339(time.time())],
        )
        return state.decode() if isinstance(state, bytes) else str(state)

    # ------------------------------------------------------------ the results thread

    def _start_watcher(self) -> None:
        """Start reading the results stream from its current end (caller holds the lock)."""
        if self._watcher is not None and self._watcher.is_alive():
            return
        last: Any = self.redis.xrevrange(self.results, count=1)
        start = last[0][0] if last else b"0-0"
        self._watcher = threading.Thread(
            target=self._watch, args=(start,), name="controller-client-results", daemon=True
        )
        self._watcher.start()

    def _watch(self, start: bytes) -> None:
        # A connection of its own, closed here: close() does not wait for a blocked read.
        conn = redis.Redis.from_url(
            self._url,
            socket_connect_timeout=self._timeout,
            socket_timeout=self._timeout + WATCH_BLOCK_MS / 1000,
        )
        try:
            self._watch_on(conn, start)
        finally:
            conn.close()

    def _watch_on(self, conn: redis.Redis, start: bytes) -> None:
        last = start
        backoff = 0.1
        while not self._closed.is_set():
            try:
                answer: Any = conn.xread({self.results: last}, count=1000, block=WATCH_BLOCK_MS)
            except redis.RedisError:
                if self._closed.wait(backoff):
                    return
                backoff = min(backoff * 2, 5.0)
                self._wake_all()  # waiters read the hash again meanwhile
                continue
            backoff = 0.1
            for _stream, entries in answer or ():
                for entry_id, fields in entries:
                    last = entry_id
                    job_id = fields.get(b"id", b"").decode("utf-8", "replace")
                    with self._lock:
                        events = self._waiters.pop(job_id, ())
                    for event in events:
                        event.set()

    def _wake_all(self) -> None:
        with self._lock:
            waiting, self._waiters = self._waiters, {}
        for events in waiting.values():
            for event in events:
                event.set()

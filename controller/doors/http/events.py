"""`GET /events/`: job changes as Server-Sent Events, from a ring of the last ones.

The job desk tells `EventHub.job_changed` of every change of a job's state (made, started,
back to pending or scheduled, ended, canceled, deleted, retried). With nobody listening
that costs one tuple appended to a ring of `RING_SIZE` (no JSON, no bytes): what a client
resuming with `Last-Event-ID` needs. Each listener (`Subscriber`) has a buffer of at
most `BUFFER_SIZE` events; one that falls further behind is dropped (its buffer freed, its
stream ended: it may come back with its Last-Event-ID), so a slow or silent client costs a
bounded amount and never holds up the others or the desk.

Sequence numbers grow by one per event. A controller starts counting from its start time
in microseconds, so that the ids of a controller before a restart are below the ring of
the one after it: a `Last-Event-ID` the ring no longer holds (too old, or from before a
restart) gets an `event: reset` first, then the events from now on.

`EventStream` is the ASGI answer: `text/event-stream`, a comment every `KEEPALIVE` seconds
while nothing happens, a send that does not finish within `SEND_TIMEOUT` (the client reads
nothing) or a client dropped for falling behind closes the connection, and the stream ends
cleanly (its last chunk) when the controller stops (a send under way then gets STOP_GRACE to
end, and its connection is closed after that).
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import trio

from controller.doors.http.asgi import Receive, Scope, Send, StreamingResponse
from controller.doors.http.codec import ApiError
from controller.jobs import Job
from controller.options import NAME_RULE

RING_SIZE = 10_000  # the events a Last-Event-ID may resume from
# The events one listener may have unsent before it is dropped: the whole ring (a resume
# fits), as references to the ring's own tuples (80 KB a listener at most).
BUFFER_SIZE = RING_SIZE
CHUNK = 500  # the most events written in one send
KEEPALIVE = 15.0  # seconds between comments on a quiet stream
SEND_TIMEOUT = 30.0  # a send that takes longer closes the connection
DROP_GRACE = 5.0  # a dropped listener's last send may take this long before the close
STOP_GRACE = 1.0  # how long the last chunk may take when the controller stops
MEDIA_TYPE = "text/event-stream"
# What a reconnecting EventSource waits (milliseconds), sent once at the start.
RETRY_MS = 1000

_QUEUE_SCHEMA = {"type": "string", "pattern": "^" + NAME_RULE + "$"}

# (sequence number, job id, state word, queue, progress)
Change = tuple[int, str, str, str, float | None]


def encode(change: Change) -> bytes:
    """One event as it goes on the wire."""
    seq, job_id, state, queue, progress = change
    data = json.dumps(
        {"id": job_id, "state": state, "queue": queue, "progress": progress},
        ensure_ascii=False,
        separators=(",", ":"),
    )
    return f"id: {seq}\ndata: {data}\n\n".encode("utf-8", "surrogatepass")


def reset_event(oldest: int) -> bytes:
    """The event a client whose Last-Event-ID the ring no longer holds sees first."""
    return b'event: reset\ndata: {"oldest":%d}\n\n' % oldest


def parse_last_id(header: str | None, query: str | None) -> int | None:
    """The Last-Event-ID header, else the `last_event_id` query parameter (None: neither;
    an empty one is none, as EventSource means it); ApiError 400 when not a whole number."""
    text = header if header is not None else query
    if text is None or not text.strip():
        return None
    text = text.strip()
    if not text.isascii() or not text.isdigit() or len(text) > 20:
        raise ApiError(
            400, f"Last-Event-ID must be an event's id (a whole number), got {text[:40]!r}"
        )
    return int(text)


class Subscriber:
    """One listener: its queue filter, its unsent events, and whether it was dropped."""

    __slots__ = ("buffer", "dropped", "gone", "queue", "wake")

    def __init__(self, queue: str | None) -> None:
        self.queue = queue
        self.buffer: deque[Change] = deque()
        self.dropped = False
        self.wake = trio.Event()  # set when an event comes (a new one each wait)
        self.gone = trio.Event()  # set when it is dropped

    def offer(self, change: Change) -> bool:
        """Take a change (if it passes the filter); False once the buffer is over."""
        if self.queue is not None and change[3] != self.queue:
            return True
        if len(self.buffer) >= BUFFER_SIZE:
            return False
        self.buffer.append(change)
        self.wake.set()
        return True


class EventHub:
    """The ring of the last events and the listeners (see the module's docstring)."""

    def __init__(self, first: int | None = None) -> None:
        self.ring: deque[Change] = deque(maxlen=RING_SIZE)
        self.next_seq = first if first is not None else int(time.time() * 1_000_000)
        self.subscribers: set[Subscriber] = set()
        self.dropped = 0  # listeners dropped for falling behind, since the start

    def job_changed(self, job: Job) -> None:
        """The desk's hook: `job`'s state changed."""
        change: Change = (
            self.next_seq,
            job.id,
            job.state.value,
            job.options.queue,
            job.progress,  # None until its worker reports it (controller/progress.py)
        )
        self.next_seq += 1
        self.ring.append(change)
        if self.subscribers:
            for sub in [s for s in self.subscribers if not s.offer(change)]:
                self.drop(sub)

    def drop(self, sub: Subscriber) -> None:
        self.subscribers.discard(sub)
        sub.buffer.clear()
        sub.dropped = True
        sub.wake.set()
        sub.gone.set()
        self.dropped += 1

    def subscribe(self, queue: str | None, last_id: int | None) -> tuple[Subscriber, bool]:
        """A new listener, with what it missed since `last_id` in its buffer; True when
        `last_id` is one the ring no longer holds (the client missed events: reset)."""
        sub = Subscriber(queue)
        missed = False
        if last_id is not None:
            oldest = self.ring[0][0] if self.ring else self.next_seq
            if oldest - 1 <= last_id < self.next_seq:
                for change in self.ring:  # at most BUFFER_SIZE: it fits
                    if change[0] > last_id:
                        sub.offer(change)
            else:
                missed = True
        self.subscribers.add(sub)
        return sub, missed

    def oldest(self) -> int:
        return self.ring[0][0] if self.ring else self.next_seq


class EventStream(StreamingResponse):
    """The ASGI answer of `GET /events/` for one listener."""

    def __init__(self, hub: EventHub, sub: Subscriber, reset: bool) -> None:
        self.status = 200
        self.headers = [
            (b"content-type", MEDIA_TYPE.encode()),
            (b"cache-control", b"no-store"),
            (b"x-accel-buffering", b"no"),  # nginx: pass each event on at once
        ]
        self.hub = hub
        self.sub = sub
        self.reset = reset
        self.started = False
        self.sent = trio.Event()  # set when no send is under way
        self.sent.set()
        self.guard = trio.CancelScope()  # its deadline: when the connection is closed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = scope.get("state", {}).get("stream")  # the connection (shell.py)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_until_disconnect, receive, nursery.cancel_scope)
                nursery.start_soon(self._watch, stream)
                start = {"type": "http.response.start", "status": 200, "headers": self.headers}
                await self._send(send, start)
                self.started = True
                first = b"retry: %d\n\n" % RETRY_MS
                if self.reset:
                    first += reset_event(self.hub.oldest())
                await self._body(send, first)
                await self._pump(send)  # until dropped: the close, with no last chunk
                nursery.cancel_scope.cancel()
        except BaseException as exc:  # the controller stops: the last chunk, then the close
            if _cancelled(exc) and self.started and not self.sub.dropped:
                with trio.CancelScope(shield=True):
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(_close_after, stream, STOP_GRACE)
                        with contextlib.suppress(Exception):  # the connection is gone
                            await send({"type": "http.response.body", "body": b""})
                        nursery.cancel_scope.cancel()
            raise
        finally:
            self.hub.subscribers.discard(self.sub)

    async def _pump(self, send: Send) -> None:
        sub = self.sub
        while not sub.dropped:
            if sub.buffer:
                buffer = sub.buffer
                count = min(len(buffer), CHUNK)
                await self._body(send, b"".join(encode(buffer.popleft()) for _ in range(count)))
                continue
            sub.wake = trio.Event()
            with trio.move_on_after(KEEPALIVE):
                await sub.wake.wait()
                continue
            await self._body(send, b": keep-alive\n\n")

    async def _body(self, send: Send, data: bytes) -> None:
        await self._send(send, {"type": "http.response.body", "body": data, "more_body": True})

    async def _send(self, send: Send, message: dict[str, Any]) -> None:
        """Send, with the connection closed if it takes over SEND_TIMEOUT (hypercorn's
        send cannot be cancelled: a client that reads nothing would hold it for ever)."""
        self.guard.deadline = trio.current_time() + SEND_TIMEOUT
        self.sent = trio.Event()
        await send(message)
        self.guard.deadline = math.inf
        self.sent.set()

    async def _watch(self, stream: Any) -> None:
        """Close the connection when the guard's deadline passes, or soon after the
        listener is dropped; cancelled (the controller stops, the client left) in the
        middle of a send, give it STOP_GRACE to end, then close."""
        try:
            with self.guard:
                await self.sub.gone.wait()
                self.guard.deadline = min(self.guard.deadline, trio.current_time() + DROP_GRACE)
                await trio.sleep_forever()
        except BaseException as exc:
            if _cancelled(exc) and not self.sent.is_set() and stream is not None:
                with trio.CancelScope(shield=True):
                    with trio.move_on_after(STOP_GRACE):
                        await self.sent.wait()
                    if not self.sent.is_set():
                        await _close(stream)
            raise
        if stream is not None:
            await _close(stream)


def _cancelled(exc: BaseException) -> bool:
    """Whether `exc` is a cancellation (alone or in a group: a nursery's way)."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(trio.Cancelled)[1] is None
    return isinstance(exc, trio.Cancelled)


async def _close_after(stream: Any, delay: float) -> None:
    await trio.sleep(delay)
    if stream is not None:
        await _close(stream)


async def _close(stream: Any) -> None:
    """Close the connection's stream under a send that is stuck: the send fails at once."""
    with trio.CancelScope(shield=True):
        await trio.aclose_forcefully(stream)


async def _until_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


def listen(hub: EventHub, queue: str | None, last_id: int | None) -> EventStream:
    """The answer for one new listener."""
    sub, reset = hub.subscribe(queue, last_id)
    return EventStream(hub, sub, reset)


def openapi_path(errors: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    """`/events/` in /openapi.json (`errors`: openapi.py's error answers)."""
    last_id = {"type": "string", "pattern": "^[0-9]{1,20}$"}
    return {
        "get": {
            "summary": "job changes as Server-Sent Events, as they happen (a stream that "
            "lasts until the client or the controller leaves)",
            "parameters": [
                {"name": "queue", "in": "query", "required": False, "schema": _QUEUE_SCHEMA},
                {
                    "name": "Last-Event-ID",
                    "in": "header",
                    "required": False,
                    "description": "resume after this event (from the last 10,000)",
                    "schema": last_id,
                },
                {
                    "name": "last_event_id",
                    "in": "query",
                    "required": False,
                    "description": "the same, for a client that cannot send the header",
                    "schema": last_id,
                },
            ],
            "responses": {
                "200": {
                    "description": "events `id: N` and `data: {id, state, queue, progress}`; "
                    "`event: reset` first when the ring no longer holds Last-Event-ID; a "
                    "comment every 15 s",
                    "content": {MEDIA_TYPE: {"schema": {"type": "string"}}},
                },
                **errors(400, 401, 403),
            },
        }
    }

"""The little of ASGI the HTTP door needs: a request, a response, and a router.

Fixed paths, each also without its trailing slash, then `/job/{id}/` and a few
patterns: an exact dict lookup first. No framework: Starlette's layers (error and
exception middlewares, the router's regex per route, a wrapper around every `send`)
cost ~6% of the controller's CPU per request with the door busy, which is the door's
ceiling (docs/performance.md, "What bounds the figures").
A handler that raises is logged and answered 500 with the JSON error object;
the lifespan protocol is answered so that hypercorn starts and stops cleanly.
"""

from __future__ import annotations

import contextlib
import http
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping, Sequence
from typing import Any
from urllib.parse import parse_qsl

import trio

from controller.containment import INTERNAL_MESSAGE, contained
from controller.doors.http import codec

log = logging.getLogger("controller.http")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# The job's path: /job/{id}/ (and /job/{id}); other paths with a part in them are `patterns`.
JOB_PREFIX = "/job/"
# The versions served; any other (an HTTP/2 preface inside a connection) is answered 505.
HTTP_VERSIONS = ("1.1", "1.0")


class ClientDisconnect(Exception):
    """The client went away before its request body ended."""


class BodyTimeout(Exception):
    """The client was silent too long in the middle of its body, or took too long in all."""


class Request:
    """One HTTP request: method, path parameters, query, headers and the body as a stream."""

    __slots__ = ("_query", "_receive", "method", "path_params", "scope")

    def __init__(self, scope: Scope, receive: Receive, path_params: dict[str, str]) -> None:
        self.scope = scope
        self._receive = receive
        method: str = scope["method"]
        # HEAD is answered as GET is (hypercorn leaves the body out).
        self.method = "GET" if method == "HEAD" else method
        self.path_params = path_params
        self._query: dict[str, str] | None = None

    @property
    def query_params(self) -> dict[str, str]:
        """The query's parameters (the last of a repeated name, as Starlette's did)."""
        if self._query is None:
            text = self.scope["query_string"].decode("latin-1")
            self._query = dict(parse_qsl(text, keep_blank_values=True))
        return self._query

    def header(self, name: bytes) -> str | None:
        """A request header by its lower-case name."""
        for key, value in self.scope["headers"]:
            if key == name:
                return bytes(value).decode("latin-1")
        return None

    async def stream(
        self, silence: float = math.inf, deadline: float = math.inf
    ) -> AsyncIterator[bytes]:
        """The body as it arrives; ClientDisconnect if the client leaves first, BodyTimeout
        if it sends nothing for `silence` seconds or is not done by `deadline` (trio time)."""
        while True:
            message: Message | None = None
            with trio.move_on_at(min(deadline, trio.current_time() + silence)):
                message = await self._receive()
            if message is None:
                if trio.current_time() >= deadline:
                    raise BodyTimeout("the request's body did not end in time")
                raise BodyTimeout(f"the client sent nothing for {silence:g} s mid-body")
            if message["type"] == "http.disconnect":
                raise ClientDisconnect
            body = message.get("body", b"")
            if body:
                yield body
            if not message.get("more_body", False):
                return


class Response:
    """A whole answer: status, body and headers (content-length and -type added)."""

    __slots__ = ("body", "headers", "status")

    def __init__(
        self,
        body: bytes = b"",
        status: int = 200,
        media_type: str | None = None,
        headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> None:
        self.body = body
        self.status = status
        bodiless = status < 200 or status in (204, 304)
        head = [] if bodiless else [(b"content-length", b"%d" % len(body))]
        if media_type is not None:
            head.append((b"content-type", media_type.encode("latin-1")))
        head.extend(headers)
        self.headers = head

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
        await send({"type": "http.response.body", "body": self.body})


class StreamingResponse:
    """An answer whose body comes as it is made: chunked over HTTP/1.1 (no content-length).
    A client that goes away (`http.disconnect`) ends it at once: `chunks` is closed, and
    nothing of it runs afterwards."""

    __slots__ = ("chunks", "headers", "status")

    def __init__(
        self, chunks: AsyncIterator[bytes], status: int = 200, media_type: str | None = None
    ) -> None:
        self.chunks = chunks
        self.status = status
        self.headers = [] if media_type is None else [(b"content-type", media_type.encode())]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_until_disconnect, receive, nursery.cancel_scope)
            async with contextlib.aclosing(self.chunks) as chunks:  # type: ignore[type-var]
                async for chunk in chunks:
                    if chunk:
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            nursery.cancel_scope.cancel()


async def _until_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


def json_response(body: Any, status: int = 200) -> Response:
    return Response(codec.dumps(body), status, "application/json")


def error_response(status: int, message: str) -> Response:
    """The error object; its message is never empty (the status's phrase stands in)."""
    if not message:
        message = _PHRASES.get(status, "the request failed")
    return json_response({"code": status, "message": message}, status)


_PHRASES = {status.value: status.phrase for status in http.HTTPStatus}


Endpoint = Callable[[Request], Awaitable[Response | StreamingResponse]]


class Router:
    """ASGI app: paths to endpoints, each with the methods it takes (HEAD where GET is);
    `gate(scope)` may refuse a request first (its answer, or None)."""

    def __init__(
        self,
        routes: Sequence[tuple[str, Endpoint, Sequence[str]]],
        job_endpoint: Endpoint,
        job_methods: Sequence[str],
        gate: Callable[[Scope], Response | None] = lambda scope: None,
        patterns: Sequence[tuple[str, Endpoint, Sequence[str]]] = (),
    ) -> None:
        """`patterns`: paths with one part named in braces, such as "/queue/{name}/" (the part
        is one path segment, given to the endpoint as `path_params[name]`)."""
        self._gate = gate
        self._patterns: list[tuple[str, str, str, tuple[Endpoint, frozenset[str]]]] = []
        for path, endpoint, methods in patterns:
            prefix, rest = path.split("{", 1)
            name, suffix = rest.split("}", 1)
            self._patterns.append(
                (prefix, name, suffix.rstrip("/"), (endpoint, _with_head(methods)))
            )
        self._exact: dict[str, tuple[Endpoint, frozenset[str]]] = {}
        for path, endpoint, methods in routes:
            entry = (endpoint, _with_head(methods))
            self._exact[path] = entry
            if path.endswith("/") and path != "/":  # the same path without the slash
                self._exact[path[:-1]] = entry
        self._job = (job_endpoint, _with_head(job_methods))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        if scope.get("http_version", "1.1") not in HTTP_VERSIONS:
            # (No "Connection: close": h11 would then fail the connection on the bytes the
            # client sent after it, the rest of the preface, before this answer is out.)
            await error_response(505, "only HTTP/1.1 is served here")(scope, receive, send)
            return
        try:
            refusal = self._gate(scope)
        except Exception as exc:
            contained("checking who may ask over HTTP", exc, trio.current_time())
            refusal = error_response(500, INTERNAL_MESSAGE)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        path: str = scope["path"]
        params: dict[str, str] = {}
        entry = self._exact.get(path)
        response: Response | StreamingResponse
        if entry is None and self._patterns:
            entry, params = self._match(path)
        if entry is None and path.startswith(JOB_PREFIX):
            job_id = path[len(JOB_PREFIX) :]
            if job_id.endswith("/"):
                job_id = job_id[:-1]
            if job_id and "/" not in job_id:
                entry = self._job
                params = {"job_id": job_id}
        if entry is None:
            response = error_response(404, "no such path")
        elif scope["method"] not in entry[1]:
            response = error_response(405, "method not allowed here")
            response.headers.append((b"allow", ", ".join(sorted(entry[1])).encode("ascii")))
        else:
            try:
                response = await entry[0](Request(scope, receive, params))
            except Exception as exc:
                contained("an HTTP request", exc, trio.current_time(), f"{scope['method']} {path}")
                response = error_response(500, INTERNAL_MESSAGE)
        await response(scope, receive, send)

    def _match(self, path: str) -> tuple[tuple[Endpoint, frozenset[str]] | None, dict[str, str]]:
        trimmed = path[:-1] if path.endswith("/") else path
        for prefix, name, suffix, entry in self._patterns:
            if not trimmed.startswith(prefix) or not trimmed.endswith(suffix):
                continue
            value = trimmed[len(prefix) : len(trimmed) - len(suffix)]
            if value and "/" not in value:
                return entry, {name: value}
        return None, {}


def _with_head(methods: Sequence[str]) -> frozenset[str]:
    return frozenset([*methods, "HEAD"] if "GET" in methods else methods)


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        kind = message["type"]
        await send({"type": f"{kind}.complete"})
        if kind == "lifespan.shutdown":
            return

"""The Redis door's busy path: script calls on one connection served by the controller's reactor.

The door's two calls per batch of jobs, "new entries with their states" and
"these outcomes, then acknowledge", are Lua scripts (codec.py).
Run through redis-py in a worker thread they cost ~400 us of the controller's
CPU each under load, not the ~110 us they cost alone: redis-py's Python
running in a thread beside the busy trio loop makes both take turns at the
GIL, ~15 context switches per call (docs/architecture.md, "Decisions").
So `LoopLink` sends them on a non-blocking socket watched by the `Reactor`:
commands packed by hiredis (`pack_command`), answers parsed by hiredis's
`Reader`, matched to their callers in order (Redis answers a connection's
commands in the order sent). Connecting (a blocking connect, AUTH, SELECT) runs
in a thread once per connection. Everything else the door does (blocking
reads, claims, group set-up, the cancel channel) stays in redis-py.

`ThreadLink` is the same interface over redis-py in a thread, for what
`LoopLink` does not speak: TLS (`rediss://`).

Failures are redis-py's exceptions, so the door treats both links alike:
`redis.ConnectionError` for a lost or refused connection (every call waiting
on it fails with it), `redis.TimeoutError` when an answer is overdue,
`redis.ResponseError` for an error answer (a missing script is loaded with
EVAL and never seen by the caller).
"""

from __future__ import annotations

import _socket
import collections
import hashlib
import select
import socket
from typing import Any, Protocol

import hiredis
import redis
import redis.connection
import redis.exceptions
import trio

from controller.reactor import Reactor

# Bytes read per readiness event (larger reads made glibc map and unmap memory around small
# answers, as with the worker frames in controller/wire.py).
RECV_SIZE = 64 * 1024
_IN = select.EPOLLIN
_OUT = select.EPOLLOUT


class Link(Protocol):
    async def script(self, source: str, keys: list[Any], args: list[Any]) -> Any: ...

    def close(self) -> None: ...


def link_for(url: str, reactor: Reactor, timeout: float, fallback: redis.Redis) -> Link:
    """A `LoopLink` for redis:// and unix:// URLs, else a `ThreadLink` over `fallback`."""
    if url.startswith(("redis://", "unix://")):
        params: dict[str, Any] = redis.connection.parse_url(url)  # type: ignore[no-untyped-call]
        return LoopLink(params, reactor, timeout)
    return ThreadLink(fallback, reactor)


class _Waiter:
    """One caller's place in the queue of answers."""

    __slots__ = ("answer", "done")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.answer: Any = None


class LoopLink:
    """One Redis connection on the reactor: commands pipelined, answers matched in order."""

    def __init__(self, params: dict[str, Any], reactor: Reactor, timeout: float) -> None:
        """`params`: redis-py's `parse_url` of the URL; `timeout`: seconds an answer may take
        (and a connect) before the connection is given up as broken."""
        self.params = params
        self.reactor = reactor
        self.timeout = timeout
        self._sock: _socket.socket | None = None
        self._reader = self._new_reader()
        self._out = bytearray()  # commands not yet sent whole
        self._sent = 0  # bytes of _out already sent
        self._events = 0
        self._waiting: collections.deque[_Waiter] = collections.deque()
        self._connecting = trio.Lock()
        self._shas: dict[str, str] = {}

    @staticmethod
    def _new_reader() -> hiredis.Reader:
        return hiredis.Reader(
            protocolError=redis.exceptions.InvalidResponse,
            replyError=redis.exceptions.ResponseError,
        )

    # ------------------------------------------------------------ calls

    async def script(self, source: str, keys: list[Any], args: list[Any]) -> Any:
        """EVALSHA of `source`; EVAL when Redis does not have it (a restart, SCRIPT FLUSH)."""
        sha = self._shas.get(source)
        if sha is None:
            sha = self._shas[source] = hashlib.sha1(source.encode()).hexdigest()
        try:
            return await self.call("EVALSHA", sha, len(keys), *keys, *args)
        except redis.exceptions.ResponseError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
        return await self.call("EVAL", source, len(keys), *keys, *args)

    async def call(self, *command: Any) -> Any:
        """Send one command and wait for its answer (several callers may wait at once)."""
        if self._sock is None:
            async with self._connecting:
                if self._sock is None:
                    await self._connect()
        waiter = _Waiter()
        self._waiting.append(waiter)
        self._out += hiredis.pack_command(command)
        self._flush()
        with trio.move_on_after(self.timeout):
            await waiter.done.wait()
        if not waiter.done.is_set():
            self._broken(redis.exceptions.TimeoutError(f"no answer from Redis in {self.timeout} s"))
        answer = waiter.answer
        if isinstance(answer, redis.exceptions.RedisError):
            raise answer
        return answer

    def close(self) -> None:
        self._broken(redis.exceptions.ConnectionError("the link was closed"))

    # ------------------------------------------------------------ connection

    async def _connect(self) -> None:
        sock = await self.reactor.in_thread(self._open, abandon_on_cancel=True)
        self._sock = _socket.socket(sock.family, sock.type, sock.proto, sock.detach())
        self._sock.setblocking(False)
        self._reader = self._new_reader()
        self._events = 0
        self._watch(_IN)

    def _open(self) -> socket.socket:
        """A connected, authenticated socket on the right database (blocking, in a thread)."""
        params = self.params
        try:
            if "path" in params:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(self.timeout)
                sock.connect(params["path"])
            else:
                address = (params.get("host", "localhost"), params.get("port", 6379))
                sock = socket.create_connection(address, timeout=self.timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as exc:
            raise redis.exceptions.ConnectionError(f"connecting to Redis: {exc}") from None
        try:
            if params.get("password") is not None:
                user = params.get("username")
                auth = ("AUTH", user, params["password"]) if user else ("AUTH", params["password"])
                self._ask(sock, auth)
            if params.get("db"):
                self._ask(sock, ("SELECT", params["db"]))
        except BaseException:
            sock.close()
            raise
        return sock

    def _ask(self, sock: socket.socket, command: tuple[Any, ...]) -> None:
        reader = self._new_reader()
        try:
            sock.sendall(hiredis.pack_command(command))
            while (answer := reader.gets()) is False:
                data = sock.recv(RECV_SIZE)
                if not data:
                    raise OSError("Redis closed the connection")
                reader.feed(data)
        except OSError as exc:
            raise redis.exceptions.ConnectionError(f"talking to Redis: {exc}") from None
        if isinstance(answer, redis.exceptions.ResponseError):
            raise answer

    def _watch(self, events: int) -> None:
        if self._sock is not None and events != self._events:
            self._events = events
            self.reactor.watch(self._sock, events, self._on_ready)

    def _flush(self) -> None:
        sock = self._sock
        if sock is None:
            return
        try:
            with memoryview(self._out) as view, view[self._sent :] as rest:
                self._sent += sock.send(rest)
        except BlockingIOError:
            pass
        except OSError as exc:
            self._broken(redis.exceptions.ConnectionError(f"writing to Redis: {exc}"))
            return
        if self._sent == len(self._out):  # all sent (offsets, not copies: a big write
            self._out.clear()  # goes out in many pieces)
            self._sent = 0
            self._watch(_IN)
        else:
            self._watch(_IN | _OUT)

    def _on_ready(self, events: int) -> None:
        if events & _OUT:
            self._flush()
        if not events & ~_OUT or self._sock is None:
            return
        try:
            data = self._sock.recv(RECV_SIZE)
        except BlockingIOError:
            return
        except OSError as exc:
            self._broken(redis.exceptions.ConnectionError(f"reading from Redis: {exc}"))
            return
        if not data:
            self._broken(redis.exceptions.ConnectionError("Redis closed the connection"))
            return
        self._reader.feed(data)
        try:
            while (answer := self._reader.gets()) is not False:
                if not self._waiting:
                    raise redis.exceptions.InvalidResponse("an answer nobody asked for")
                waiter = self._waiting.popleft()
                waiter.answer = answer
                waiter.done.set()
        except redis.exceptions.InvalidResponse as exc:
            self._broken(redis.exceptions.ConnectionError(f"Redis sent garbage: {exc}"))

    def _broken(self, error: redis.exceptions.RedisError) -> None:
        """Drop the connection; every call waiting on it fails with `error`."""
        if self._sock is not None:
            self.reactor.forget(self._sock)
            self._sock.close()
            self._sock = None
        self._out.clear()
        self._sent = 0
        while self._waiting:
            waiter = self._waiting.popleft()
            waiter.answer = error
            waiter.done.set()


class ThreadLink:
    """The same calls through redis-py in a worker thread (for rediss://)."""

    def __init__(self, client: redis.Redis, reactor: Reactor) -> None:
        self.client = client
        self.reactor = reactor
        self._scripts: dict[str, Any] = {}

    async def script(self, source: str, keys: list[Any], args: list[Any]) -> Any:
        script = self._scripts.get(source)
        if script is None:
            script = self._scripts[source] = self.client.register_script(source)
        return await self.reactor.in_thread(
            lambda: script(keys=keys, args=args), abandon_on_cancel=True
        )

    def close(self) -> None:
        pass

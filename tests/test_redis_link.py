"""The Redis door's busy-path link (controller/doors/redis/script_link.py) against a real
redis-server: answers matched to callers in order, scripts loaded again when Redis forgot
them, error answers, AUTH and SELECT, Unix sockets, and every failure as redis-py's
exception."""

from __future__ import annotations

import select
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import trio

from controller.doors.redis.script_link import LoopLink, ThreadLink, link_for
from controller.reactor import Reactor
from tests.helpers import (
    REDIS_SERVER,
    RedisServer,
    free_tcp_port,
    redis_server,
    wait_for_condition,
)

pytestmark = pytest.mark.skipif(
    REDIS_SERVER is None, reason="redis-server is not installed (apt-get install redis-server)"
)

ECHO = "return {KEYS[1], ARGV[1]}"
INCR = "return redis.call('INCR', KEYS[1])"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path) as server:
        yield server


async def started(nursery: trio.Nursery) -> Reactor:
    reactor = Reactor()
    await nursery.start(reactor.run)
    return reactor


def loop_link(url: str, reactor: Reactor, timeout: float = 5.0) -> LoopLink:
    link = link_for(url, reactor, timeout, redis.Redis.from_url(url))
    assert isinstance(link, LoopLink)
    return link


async def test_many_callers_get_their_own_answers(server: RedisServer, nursery) -> None:
    reactor = await started(nursery)
    link = loop_link(server.url, reactor)
    answers: dict[int, Any] = {}

    async def ask(n: int) -> None:
        answers[n] = await link.script(ECHO, [f"k{n}"], [n])

    async with trio.open_nursery() as callers:  # all sent before the first answer is read
        for n in range(200):
            callers.start_soon(ask, n)
    assert answers == {n: [f"k{n}".encode(), str(n).encode()] for n in range(200)}
    # A payload larger than a socket buffer, both ways (sent and read in many pieces).
    big = bytes(range(256)) * 32768
    asked: list[int] = []
    watch = link._watch

    def spy(events: int) -> None:
        asked.append(events)
        watch(events)

    link._watch = spy  # type: ignore[method-assign]
    assert await link.script(ECHO, ["big"], [big]) == [b"big", big]
    assert select.EPOLLOUT in {events & select.EPOLLOUT for events in asked}  # it waited to send
    link.close()


async def test_a_script_redis_forgot_is_loaded_again(server: RedisServer, nursery) -> None:
    reactor = await started(nursery)
    link = loop_link(server.url, reactor)
    assert await link.script(INCR, ["n"], []) == 1
    redis.Redis.from_url(server.url).script_flush()  # as after a restart without persistence
    assert await link.script(INCR, ["n"], []) == 2
    assert await link.script(INCR, ["n"], []) == 3
    link.close()


async def test_an_error_answer_is_a_response_error_and_the_link_goes_on(
    server: RedisServer, nursery
) -> None:
    reactor = await started(nursery)
    link = loop_link(server.url, reactor)
    redis.Redis.from_url(server.url).set("text", "x")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        await link.script("return redis.call('XLEN', KEYS[1])", ["text"], [])
    assert await link.script(ECHO, ["a"], ["b"]) == [b"a", b"b"]
    link.close()


async def test_password_database_and_unix_socket(tmp_path: Path, nursery) -> None:
    path = tmp_path / "r.sock"
    with redis_server(tmp_path, "--requirepass", "s3cret", "--unixsocket", str(path)) as server:
        reactor = await started(nursery)
        port = server.port
        for url in (f"redis://:s3cret@127.0.0.1:{port}/3", f"unix://:s3cret@{path}?db=3"):
            link = loop_link(url, reactor)
            await link.script("return redis.call('SET', KEYS[1], ARGV[1])", ["where"], [url])
            link.close()
            db3 = redis.Redis(port=port, password="s3cret", db=3)
            assert db3.get("where") == url.encode()
            assert redis.Redis(port=port, password="s3cret", db=0).get("where") is None
        link = loop_link(f"redis://:wrong@127.0.0.1:{port}/0", reactor)
        with pytest.raises(redis.ResponseError, match=r"WRONGPASS|invalid"):
            await link.script(ECHO, ["a"], ["b"])


async def test_refused_then_redis_stops_midway_then_comes_back(
    server: RedisServer, nursery
) -> None:
    reactor = await started(nursery)
    link = loop_link(f"redis://127.0.0.1:{free_tcp_port()}/0", reactor)
    with pytest.raises(redis.ConnectionError, match="connecting to Redis"):
        await link.script(ECHO, ["a"], ["b"])
    link = loop_link(server.url, reactor)
    assert await link.script(ECHO, ["a"], ["b"]) == [b"a", b"b"]
    stuck: list[BaseException] = []

    async def wait_long() -> None:
        try:
            await link.call("BLPOP", "nothing", 0)  # waits until Redis goes away
        except redis.RedisError as exc:
            stuck.append(exc)

    async with trio.open_nursery() as waiting:
        waiting.start_soon(wait_long)
        await trio.to_thread.run_sync(
            lambda: wait_for_condition(lambda: _clients_blocked(server) == 1)
        )
        server.stop(kill=True)
    assert len(stuck) == 1 and isinstance(stuck[0], redis.ConnectionError), stuck
    with pytest.raises(redis.ConnectionError):
        await link.script(ECHO, ["a"], ["b"])
    server.start()
    assert await link.script(ECHO, ["a"], ["again"]) == [b"a", b"again"]
    link.close()


def _clients_blocked(server: RedisServer) -> int:
    info: Any = redis.Redis.from_url(server.url).info("clients")
    return int(info["blocked_clients"])


async def test_a_silent_or_garbled_server_is_a_broken_connection(nursery) -> None:
    reactor = await started(nursery)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(10)  # a link that never connects fails the test, not hangs it
        port = listener.getsockname()[1]
        accepted: list[socket.socket] = []

        def serve(answer: bytes) -> None:
            conn, _ = listener.accept()
            conn.settimeout(10)
            accepted.append(conn)
            conn.recv(65536)
            if answer:
                conn.sendall(answer)

        thread = threading.Thread(target=serve, args=(b"",))
        thread.start()
        link = loop_link(f"redis://127.0.0.1:{port}/0", reactor, timeout=0.3)
        with pytest.raises(redis.TimeoutError, match="no answer"):
            await link.script(ECHO, ["a"], ["b"])
        thread.join()
        thread = threading.Thread(target=serve, args=(b"?what\r\n",))
        thread.start()
        with pytest.raises(redis.ConnectionError, match="garbage"):
            await link.script(ECHO, ["a"], ["b"])
        thread.join()
        # Two answers to one command: the caller gets the first, and the connection is
        # dropped, so the next command goes on a new one (not answered by the stray second).
        thread = threading.Thread(target=serve, args=(b"+OK\r\n+STRAY\r\n",))
        thread.start()
        assert await link.call("PING") == b"OK"
        thread.join()
        thread = threading.Thread(target=serve, args=(b"+PONG\r\n",))
        thread.start()
        assert await link.call("PING") == b"PONG"
        thread.join()
        assert len(accepted) == 4
        for conn in accepted:
            conn.close()


async def test_the_thread_link_answers_the_same(server: RedisServer, nursery) -> None:
    reactor = await started(nursery)
    client = redis.Redis.from_url(server.url)
    link = link_for("rediss://127.0.0.1:1/0", reactor, 5.0, client)  # TLS: not on the loop
    assert isinstance(link, ThreadLink)
    assert await link.script(ECHO, ["a"], ["b"]) == [b"a", b"b"]
    assert await link.script(INCR, ["n"], []) == 1
    client.script_flush()
    assert await link.script(INCR, ["n"], []) == 2
    link.close()

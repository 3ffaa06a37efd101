"""The client's HTTP layer (controller/client/http.py) against scripted servers: kept
connections, a server that closed one meanwhile, answers cut short or malformed, silence,
refusal. Blocking and async (trio and asyncio) alike."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Callable, Iterator

import pytest
import trio

from controller.client.http import AsyncHttpPool, HttpPool
from tests.helpers import free_tcp_port

OK = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"ok":true}'
Script = Callable[[socket.socket, int], None]


def read_request(conn: socket.socket) -> bytes:
    """One request's head and body (Content-Length), or b"" when the client left."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            while len(body) < int(line.split(b":")[1]):
                body += conn.recv(65536)
    return data


class Server:
    """A TCP server on a free port running `script(connection, n)` for its n-th connection."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.accepted = 0
        self.requests: list[bytes] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._run, args=(conn, self.accepted), daemon=True).start()

    def _run(self, conn: socket.socket, n: int) -> None:
        with conn, contextlib.suppress(OSError):
            self.script(conn, n)

    def close(self) -> None:
        self.sock.close()


@contextlib.contextmanager
def serving(script: Script) -> Iterator[Server]:
    server = Server(script)
    try:
        yield server
    finally:
        server.close()


def answer_all(conn: socket.socket, n: int, server: list[Server]) -> None:
    while request := read_request(conn):
        server[0].requests.append(request)
        conn.sendall(OK)


def keep_alive() -> Script:
    holder: list[Server] = []

    def script(conn: socket.socket, n: int) -> None:
        answer_all(conn, n, holder)

    script.holder = holder  # type: ignore[attr-defined]
    return script


@contextlib.contextmanager
def keep_alive_server() -> Iterator[Server]:
    script = keep_alive()
    with serving(script) as server:
        script.holder.append(server)  # type: ignore[attr-defined]
        yield server


def test_a_kept_connection_serves_the_next_request():
    with keep_alive_server() as server:
        pool = HttpPool("127.0.0.1", server.port, token="secret", timeout=5)
        for _ in range(3):
            answer = pool.request("POST", "/job/", json={"payload": "x"})
            assert (answer.status, answer.json()) == (200, {"ok": True})
        assert pool.request("GET", "/job/a%20b/", query={"wait": "1.000"}).status == 200
        pool.close()
    assert server.accepted == 1
    first = server.requests[0]
    assert first.startswith(b"POST /job/ HTTP/1.1\r\n")
    assert b"Authorization: Bearer secret" in first and b'{"payload":"x"}' in first
    assert server.requests[3].startswith(b"GET /job/a%20b/?wait=1.000 HTTP/1.1\r\n")


def test_a_connection_the_server_closed_meanwhile_is_replaced():
    def once_then_close(conn: socket.socket, n: int) -> None:
        read_request(conn)
        conn.sendall(OK)  # and close: the client still holds the connection as kept

    with serving(once_then_close) as server:
        pool = HttpPool("127.0.0.1", server.port, timeout=5)
        assert [pool.request("GET", "/health/").status for _ in range(3)] == [200, 200, 200]
        pool.close()
    assert server.accepted == 3


def test_a_reused_connection_closed_unread_is_retried_once_on_a_new_one():
    # The server reads the request on the kept connection and closes it unanswered
    # (as a server does whose idle timeout ran out as the request came): sent again.
    def script(conn: socket.socket, n: int) -> None:
        read_request(conn)
        conn.sendall(OK)
        if n == 1:
            read_request(conn)  # the second request: dropped, connection closed
            return
        answer_all(conn, n, [server])

    with serving(script) as server:
        pool = HttpPool("127.0.0.1", server.port, timeout=5)
        pool.request("GET", "/health/")
        # The peek sees nothing yet (the server has not closed): the request goes out on it.
        assert pool.request("GET", "/health/").status == 200
        pool.close()
    assert server.accepted == 2


@pytest.mark.parametrize(
    ("reply", "message"),
    [
        (b"", "closed the connection without answering"),
        (b'HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\n{"cut', "closed the connection mid-answer"),
        (b"SMTP ready\r\n\r\n", "malformed HTTP answer"),
    ],
)
def test_a_bad_answer_on_a_new_connection_is_a_connection_error(reply, message):
    def script(conn: socket.socket, n: int) -> None:
        read_request(conn)
        conn.sendall(reply)

    with serving(script) as server:
        pool = HttpPool("127.0.0.1", server.port, timeout=5)
        with pytest.raises(ConnectionError, match=message) as info:
            pool.request("POST", "/job/", json={})
        assert f"http://127.0.0.1:{server.port}" in str(info.value)
        pool.close()
    assert server.accepted == 1  # not sent again: the server may have acted on it


def test_silence_is_a_timeout_error_and_refusal_a_connection_refused_error():
    def silent(conn: socket.socket, n: int) -> None:
        read_request(conn)
        conn.recv(1)  # until the client gives up

    with serving(silent) as server:
        pool = HttpPool("127.0.0.1", server.port, timeout=5)
        with pytest.raises(TimeoutError, match=r"no answer within 0\.3 s"):
            pool.request("GET", "/job/x/", timeout=0.3)
        pool.close()
    port = free_tcp_port()
    with pytest.raises(ConnectionRefusedError, match=f"http://127.0.0.1:{port}"):
        HttpPool("127.0.0.1", port).request("GET", "/health/")


def test_a_closed_pool_refuses_requests():
    with keep_alive_server() as server:
        pool = HttpPool("127.0.0.1", server.port)
        pool.close()
        with pytest.raises(ValueError, match="closed"):
            pool.request("GET", "/health/")


async def _async_rounds(port: int) -> list[int]:
    pool = AsyncHttpPool("127.0.0.1", port, timeout=5)
    try:
        return [(await pool.request("GET", "/health/")).status for _ in range(3)]
    finally:
        await pool.aclose()


async def test_async_pool_keeps_and_replaces_connections_under_trio():
    with keep_alive_server() as kept:
        assert await _async_rounds(kept.port) == [200, 200, 200]
    assert kept.accepted == 1

    def once_then_close(conn: socket.socket, n: int) -> None:
        read_request(conn)
        conn.sendall(OK)

    with serving(once_then_close) as closing:
        assert await _async_rounds(closing.port) == [200, 200, 200]
    assert closing.accepted == 3


def test_async_pool_under_asyncio():
    with keep_alive_server() as server:
        assert asyncio.run(_async_rounds(server.port)) == [200, 200, 200]
    assert server.accepted == 1


async def test_async_errors_and_a_cancelled_request_leaves_no_kept_connection():
    def script(conn: socket.socket, n: int) -> None:
        read_request(conn)
        if n == 1:
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\n{")
            return
        conn.recv(1)  # silent until the client goes

    with serving(script) as server:
        pool = AsyncHttpPool("127.0.0.1", server.port, timeout=5)
        with pytest.raises(ConnectionError, match="mid-answer"):
            await pool.request("GET", "/health/")
        with pytest.raises(TimeoutError, match=r"no answer within 0\.2 s"):
            await pool.request("GET", "/health/", timeout=0.2)
        with trio.move_on_after(0.2) as scope:
            await pool.request("GET", "/health/")
        assert scope.cancelled_caught
        await pool.aclose()
    assert server.accepted == 3
    port = free_tcp_port()
    with pytest.raises(ConnectionRefusedError, match=f"http://127.0.0.1:{port}"):
        await AsyncHttpPool("127.0.0.1", port).request("GET", "/health/")

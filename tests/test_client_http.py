"""The client's HTTP layer (controller/client/http.py, http_endpoint.py, httpwire.py)
against scripted servers: kept connections, a server that closed one meanwhile, answers cut
short or malformed, silence, refusal; blocking and async (trio and asyncio) alike. And the
codec by property: any framing cut anywhere, random bytes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import h11
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.client.http import AsyncHttpPool, HttpPool, _peer_closed
from controller.client.http_endpoint import endpoint
from controller.client.httpwire import MAX_HEAD, Exchange, StreamedAnswer
from controller.tokens import token_problem
from tests.helpers import free_tcp_port, wait_until

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
        pool = HttpPool(f"http://127.0.0.1:{server.port}", token="secret", timeout=5)
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
        pool = HttpPool(f"http://127.0.0.1:{server.port}", timeout=5)
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
        pool = HttpPool(f"http://127.0.0.1:{server.port}", timeout=5)
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
        pool = HttpPool(f"http://127.0.0.1:{server.port}", timeout=5)
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
        pool = HttpPool(f"http://127.0.0.1:{server.port}", timeout=5)
        with pytest.raises(TimeoutError, match=r"no answer within 0\.3 s"):
            pool.request("GET", "/job/x/", timeout=0.3)
        pool.close()
    port = free_tcp_port()
    with pytest.raises(ConnectionRefusedError, match=f"http://127.0.0.1:{port}"):
        HttpPool(f"http://127.0.0.1:{port}").request("GET", "/health/")


def test_a_closed_pool_refuses_requests():
    with keep_alive_server() as server:
        pool = HttpPool(f"http://127.0.0.1:{server.port}")
        pool.close()
        with pytest.raises(ValueError, match="closed"):
            pool.request("GET", "/health/")


async def _async_rounds(port: int) -> list[int]:
    pool = AsyncHttpPool(f"http://127.0.0.1:{port}", timeout=5)
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
    after_first: dict[int, bytes] = {}  # what each silent connection got after its request

    def script(conn: socket.socket, n: int) -> None:
        read_request(conn)
        if n == 1:
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\n{")
        elif n in (2, 3):  # silent: a second request here would mean it was kept
            after_first[n] = conn.recv(65536)  # b"" once the client closes it
        else:
            conn.sendall(OK)

    with serving(script) as server:
        pool = AsyncHttpPool(f"http://127.0.0.1:{server.port}", timeout=5)
        with pytest.raises(ConnectionError, match="mid-answer"):
            await pool.request("GET", "/health/")
        with pytest.raises(TimeoutError, match=r"no answer within 0\.2 s"):
            await pool.request("GET", "/health/", timeout=0.2)
        with trio.move_on_after(0.2) as scope:
            await pool.request("GET", "/health/")
        assert scope.cancelled_caught
        assert (await pool.request("GET", "/health/")).status == 200  # on a new connection
        await wait_until(lambda: len(after_first) == 2)
        await pool.aclose()
    assert server.accepted == 4
    assert after_first == {2: b"", 3: b""}  # the timed-out and the cancelled one: closed
    port = free_tcp_port()
    with pytest.raises(ConnectionRefusedError, match=f"http://127.0.0.1:{port}"):
        await AsyncHttpPool(f"http://127.0.0.1:{port}").request("GET", "/health/")


def test_urls_and_tokens_that_cannot_be_used_are_value_errors():
    from controller.client import Client

    for url, host, port in (
        ("http://ctl.example:8080/", "ctl.example", 8080),
        ("http://[::1]:8080", "::1", 8080),
        ("https://ctl.example:8443/jobs-api/", "ctl.example", 8443),
    ):
        where = endpoint(url)
        assert (where.host, where.port) == (host, port)
    for bad in (
        "http://h:99999",
        "http://h:abc",
        "http://h",
        "ftp://h:1",
        "http://u@h:1",
        "http://h:1/?q",
    ):
        with pytest.raises(ValueError, match=r"http\[s\]://HOST:PORT"):
            endpoint(bad)
    for bad in ("http://h:99999", "udp://h:abc", "redis://h:abc/0"):
        with pytest.raises(ValueError, match="expected http://HOST:PORT"):
            Client(bad)
    assert token_problem("s3cret-token") == ""
    assert token_problem("two words") and token_problem("s\u00e9cret")


# ---------------------------------------------------------------- the codec, by property


def _answer_bytes(status: int, body: bytes, framing: str, cuts: list[int], interim: bool) -> bytes:
    head = b"HTTP/1.1 100 Continue\r\n\r\n" if interim else b""
    head += b"HTTP/1.1 %d Whatever\r\nServer: x\r\n" % status
    if framing == "length":
        return head + b"Content-Length: %d\r\n\r\n" % len(body) + body
    if framing == "close":
        return head + b"Connection: close\r\n\r\n" + body
    out = head + b"Transfer-Encoding: chunked\r\n\r\n"
    at = 0
    for cut in [*sorted(set(cuts)), len(body)]:
        if cut > at:
            out += b"%x;ext=1\r\n%s\r\n" % (cut - at, body[at:cut])
            at = cut
    return out + b"0\r\nTrailer: yes\r\n\r\n"


def _feed_in_pieces(data: bytes, splits: list[int], method: str = "GET") -> Any:
    exchange = Exchange()
    exchange.request(method, "/x/", b"Host: h:1\r\n", b"")
    at = 0
    for split in [*sorted(set(splits)), len(data)]:
        if split > at:
            answer = exchange.feed(data[at:split])
            if answer is not None:
                return answer
            at = split
    return exchange.feed(b"")  # the end of the stream


@settings(max_examples=300, deadline=None)
@given(
    status=st.sampled_from([200, 201, 400, 404, 409, 500]),
    body=st.binary(max_size=300),
    framing=st.sampled_from(["length", "chunked", "close"]),
    cuts=st.lists(st.integers(0, 300), max_size=5),
    splits=st.lists(st.integers(0, 700), max_size=8),
    interim=st.booleans(),
)
def test_any_framing_in_any_pieces_gives_the_same_answer(
    status, body, framing, cuts, splits, interim
):
    data = _answer_bytes(status, body, framing, [c for c in cuts if c < len(body)], interim)
    answer = _feed_in_pieces(data, splits)
    assert (answer.status, answer.body) == (status, body)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=400), st.lists(st.integers(0, 400), max_size=4))
def test_bytes_from_a_peer_raise_only_connection_error(data, splits):
    for prefix in (
        b"",
        b"HTTP/1.1 200 OK\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
    ):
        with contextlib.suppress(ConnectionError):
            _feed_in_pieces(prefix + data, splits)


def test_no_body_answers_and_what_ends_a_kept_connection():
    assert _feed_in_pieces(b"HTTP/1.1 204 No Content\r\n\r\n", []).body == b""
    assert _feed_in_pieces(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n", [], "HEAD").body == b""
    for head, keep in (
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", True),
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok", False),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", False),
        # h11's rule: an HTTP/1.0 answer closes the connection, keep-alive or not
        (b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nok", False),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA", False),
    ):
        exchange = Exchange()
        exchange.request("GET", "/", b"", b"")
        assert exchange.feed(head) is not None
        assert exchange.reusable() is keep, head
    for bad, why in (
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n", "Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "Content-Length"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", "Transfer-Encoding"),
        (b"HTTP/1.1 200 OK\r\n bad header\r\n\r\n", "continuation line"),
        (b"HTTP/1.1 101 Switching\r\n\r\n", "SWITCH_UPGRADE"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "chunk header"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x2\r\nok\r\n", "chunk header"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1_0\r\n", "chunk header"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n+2\r\nok\r\n", "chunk header"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nokXX", "chunk footer"),
        (b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * 20_000, "head over"),
    ):
        with pytest.raises(ConnectionError, match=why):
            _feed_in_pieces(bad, [])
    with pytest.raises(ValueError, match="request target"):
        Exchange().request("GET", "/a b", b"", b"")
    with pytest.raises(ValueError, match="token"):
        HttpPool("http://127.0.0.1:1", token="two\r\nX-Injected: 1")


async def test_the_client_library_raises_builtins_for_an_unreachable_controller():
    from controller.client import AsyncClient, Client

    port = free_tcp_port()
    with Client(f"http://127.0.0.1:{port}") as client, pytest.raises(ConnectionRefusedError):
        client.submit(b"x")
    async with AsyncClient(f"http://127.0.0.1:{port}") as aclient:
        with pytest.raises(ConnectionRefusedError, match=f"127.0.0.1:{port}"):
            await aclient.get("some-id")


def test_a_kept_connection_is_checked_whatever_its_descriptor_number():
    # select() cannot take descriptors over 1023; a busy client has them.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} leaves no descriptor over 1023 to test")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    ours, theirs = socket.socketpair()
    high = os.dup2(ours.fileno(), 1500)
    try:
        assert _peer_closed(high) is False  # open, nothing to read: reusable
        theirs.close()
        assert _peer_closed(high) is True  # the other end closed it
    finally:
        os.close(high)
        ours.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_forked_child_does_not_use_its_parents_kept_connections():
    with keep_alive_server() as server:
        pool = HttpPool(f"http://127.0.0.1:{server.port}", timeout=5)
        assert pool.request("GET", "/health/").status == 200  # one connection kept
        pid = os.fork()
        if pid == 0:  # the child: its own connection, or exit 1
            try:
                ok = pool.request("GET", "/health/").status == 200
            finally:
                os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert pool.request("GET", "/health/").status == 200  # the parent's still serves
        pool.close()
    assert server.accepted == 2  # the parent's connection, and the child's own


# ---------------------------------------------------------------- the codec against h11


def _h11_answer(data: bytes, method: str) -> tuple[int, bytes] | None:
    """What h11 makes of an answer that ends with the stream: (status, body), or None when
    it refuses it."""
    conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
    conn.send(h11.Request(method=method, target="/x/", headers=[(b"Host", b"h:1")]))
    conn.send(h11.EndOfMessage())
    status, body = 0, b""
    try:
        conn.receive_data(data)
        conn.receive_data(b"")
        while True:
            event = conn.next_event()
            if isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return status, body
            elif isinstance(event, h11.ConnectionClosed) or event is h11.NEED_DATA:
                return None
    except h11.RemoteProtocolError:
        return None


def _codec_answer(data: bytes, method: str, splits: list[int]) -> tuple[int, bytes] | None:
    try:
        answer = _feed_in_pieces(data, splits, method)
    except ConnectionError:
        return None
    return answer.status, answer.body


_STATUS_LINES = st.sampled_from(
    [
        b"HTTP/1.1 200 OK",
        b"HTTP/1.1 201 Created",
        b"HTTP/1.1 404 Not Found",
        b"HTTP/1.1 204 No Content",
        b"HTTP/1.1 304 Not Modified",
        b"HTTP/1.0 200 OK",
        b"HTTP/1.1 200",
        b"HTTP/1.1 200 ",
        b"HTTP/1.1 599 Whatever it is",
        b"HTTP/1.1 100 Continue",
        b"HTTP/1.1 101 Switching",
        b"HTTP/1.1 99 Low",
        b"HTTP/1.1 1000 High",
        b"HTTP/1.1 2x0 Bad",
        b"HTTP/2 200 OK",
        b"HTTP/1.1  200 OK",
        b"http/1.1 200 OK",
        b"HTTP/1.1 200 O\x01K",
        b"ICY 200 OK",
        b"",
    ]
)
_HEADER_LINES = st.sampled_from(
    [
        b"Content-Type: application/json",
        b"Content-Length: 0",
        b"Content-Length: 3",
        b"Content-Length: 5",
        b"Content-Length:5",
        b"Content-Length:  5  ",
        b"Content-Length: 05",
        b"Content-Length: -1",
        b"Content-Length: 5, 5",
        b"Content-Length: x",
        b"Content-Length: 99999999999999999999999",
        b"content-length: 5",
        b"Transfer-Encoding: chunked",
        b"Transfer-Encoding: Chunked",
        b"Transfer-Encoding: gzip",
        b"Transfer-Encoding: gzip, chunked",
        b"Transfer-Encoding: chunked, chunked",
        b"Transfer-Encoding:",
        b"Connection: close",
        b"Connection: keep-alive",
        b"X-Other: y",
        b"X-Empty:",
        b"X-Tab:\tv\t",
        b"X-Ctl: a\x01b",
        b"X-Del: a\x7fb",
        b"X-High: \xe9t\xe9",
        b"X-Folded: a",
        b" continued",
        b"\tcontinued",
        b"NoColon",
        b": no name",
        b"Bad Name: v",
        b"Bad@Name: v",
        b"X-Space : v",
        b"X-Null: \x00",
        b"X-CR: a\rb",
    ]
)
_CHUNK_SIZES = st.sampled_from(
    [b"%x", b"%X", b"0%x", b"%x;ext=1", b"%x ; ext", b"%x ", b" %x", b"0x%x", b"+%x", b"%x\t"]
)


@st.composite
def _answers(draw: st.DrawFn) -> bytes:
    out = b""
    if draw(st.booleans()):
        out += b"HTTP/1.1 100 Continue\r\n\r\n"
    out += draw(_STATUS_LINES) + b"\r\n"
    out += b"".join(line + b"\r\n" for line in draw(st.lists(_HEADER_LINES, max_size=5)))
    out += draw(st.sampled_from([b"\r\n", b"\n", b""]))
    if draw(st.booleans()):  # chunks
        for data in draw(st.lists(st.binary(min_size=1, max_size=20), max_size=3)):
            size = draw(_CHUNK_SIZES)
            out += size.replace(b"%x", b"%x" % len(data)).replace(b"%X", b"%X" % len(data))
            out += b"\r\n" + data + draw(st.sampled_from([b"\r\n", b"\n", b"XX", b""]))
        out += draw(st.sampled_from([b"0\r\n\r\n", b"0\r\nT: v\r\n\r\n", b"0\r\n", b""]))
    else:
        out += draw(st.binary(max_size=12))
    return out


@settings(max_examples=2000, deadline=None)
@given(
    data=_answers(),
    method=st.sampled_from(["GET", "POST", "HEAD"]),
    splits=st.lists(st.integers(0, 300), max_size=4),
)
def test_the_codec_gives_h11s_answer_or_both_refuse(data, method, splits):
    assert _codec_answer(data, method, splits) == _h11_answer(data, method), data


@settings(max_examples=1000, deadline=None)
@given(
    prefix=st.sampled_from(
        [b"", b"HTTP/1.1 200 OK\r\n", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"]
    ),
    data=st.binary(max_size=200),
)
def test_the_codec_gives_h11s_answer_or_both_refuse_for_any_bytes(prefix, data):
    assert _codec_answer(prefix + data, "GET", []) == _h11_answer(prefix + data, "GET")


@pytest.mark.parametrize("cut_at", range(1, 69, 5))
def test_streamed_answer_reads_chunks_cut_anywhere(cut_at: int) -> None:
    raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n4\r\ndefg\r\n0\r\n\r\n"
    assert 0 < cut_at < len(raw)
    answer = StreamedAnswer("GET")  # b"" would be the end of the stream: both pieces hold bytes
    body = answer.feed(raw[:cut_at]) + answer.feed(raw[cut_at:])
    assert (answer.status, body, answer.ended) == (200, b"abcdefg", True)
    cut_short = StreamedAnswer("GET")
    cut_short.feed(raw[:60])
    with pytest.raises(ConnectionError, match="mid-answer"):
        cut_short.feed(b"")

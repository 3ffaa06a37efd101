"""The HTTP door against careless and hostile clients (issue 39's HTTP items, DESIGN.md
section 12): one-request connections in a row, h2c and the HTTP/2 preface, one address
holding many connections, refused tokens slowed down, and error bodies that say why;
against an in-process controller over real sockets, and a real `curl`."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import subprocess

import pytest
import trio

from controller.doors.http.asgi import error_response
from tests.helpers import wait_until
from tests.test_http import http_controller
from tests.test_http_conn import _read_until_closed

_OPENED: list[trio.socket.SocketType] = []


@pytest.fixture(autouse=True)
def _close_what_the_test_opened():
    yield
    while _OPENED:
        sock = _OPENED.pop()
        if sock.fileno() >= 0:
            with contextlib.suppress(OSError):
                os.close(sock.detach())


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


async def _connect(url: str, source: str = "127.0.0.1") -> trio.SocketStream:
    """A connection from `source` (any 127.0.0.0/8 address is this machine's)."""
    sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
    _OPENED.append(sock)
    await sock.bind((source, 0))
    await sock.connect(_host_port(url))
    return trio.SocketStream(sock)


async def _answer(stream: trio.SocketStream, request: bytes) -> bytes:
    """Send `request` and read one answer whose body is JSON (up to its closing brace)."""
    await stream.send_all(request)
    got = b""
    with trio.fail_after(10):
        while b"\r\n\r\n" not in got or not got.rstrip().endswith(b"}"):
            chunk = await stream.receive_some(65536)
            assert chunk, got
            got += chunk
    return got


def _get(path: str = "/health/", extra: str = "") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n{extra}\r\n".encode()


def _post(body: bytes, path: str = "/job/") -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


def _body(answer: bytes) -> dict[str, object]:
    return json.loads(answer.split(b"\r\n\r\n", 1)[1])


# ------------------------------------------------------------ places of ended connections


async def test_one_request_connections_in_a_row_never_run_out_of_places(sockdir):
    """Three times max_connections one-request connections, each ended by the client (as
    curl does) or by the answer (`Connection: close`): every one is served."""
    async with http_controller(sockdir, workers=1, max_connections=4) as ctl:
        for i in range(12):
            stream = await _connect(ctl.url)
            if i % 2:
                answer = await _answer(stream, _get(extra="Connection: close\r\n"))
                assert (await _read_until_closed(stream)) == b""  # the answer ended it
            else:
                answer = await _answer(stream, _get())
            assert answer.startswith(b"HTTP/1.1 200"), (i, answer)
            await stream.aclose()
        assert ctl.web.connections.refused == 0


async def test_an_ended_connection_frees_its_place_within_a_second(sockdir):
    async with http_controller(sockdir, workers=1) as ctl:
        conns = ctl.web.connections
        by_client = await _connect(ctl.url)
        assert (await _answer(by_client, _get())).startswith(b"HTTP/1.1 200")
        await by_client.aclose()  # the client closes it
        await wait_until(lambda: conns.open == 0, timeout=1.0)
        by_answer = await _connect(ctl.url)
        assert (await _answer(by_answer, _get(extra="Connection: close\r\n"))).startswith(
            b"HTTP/1.1 200"
        )
        await wait_until(lambda: conns.open == 0, timeout=1.0)  # the client did nothing
        # a client that half-closes after its request still reads its answer
        half = await _connect(ctl.url)
        await half.send_all(_get())
        await half.send_eof()
        assert (await _read_until_closed(half)).startswith(b"HTTP/1.1 200")
        await wait_until(lambda: conns.open == 0, timeout=1.0)
        assert conns.by_client == {}


async def test_http_client_with_connection_close_in_a_row(sockdir):
    """The standard library's client, one connection a request, from another thread."""
    async with http_controller(sockdir, workers=1, max_connections=3) as ctl:
        host, port = _host_port(ctl.url)

        def one() -> int:
            conn = http.client.HTTPConnection(host, port, timeout=10)
            try:
                conn.request("GET", "/health/", headers={"Connection": "close"})
                response = conn.getresponse()
                response.read()
                return response.status
            finally:
                conn.close()

        statuses = [await trio.to_thread.run_sync(one) for _ in range(10)]
        assert statuses == [200] * 10


async def test_a_long_poll_whose_client_left_frees_its_place(sockdir):
    async with http_controller(sockdir, workers=0) as ctl:
        stream = await _connect(ctl.url)
        await stream.send_all(_get("/ping/?worker=p1&wait=60"))
        await wait_until(lambda: ctl.web.connections.open == 1)
        await stream.aclose()
        await wait_until(lambda: ctl.web.connections.open == 0, timeout=1.5)


# ------------------------------------------------------------ HTTP/1.1 only


async def test_an_h2c_upgrade_is_answered_as_plain_http_1_1(sockdir):
    async with http_controller(sockdir, workers=1) as ctl:
        stream = await _connect(ctl.url)
        upgrade = "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
        upgrade += "HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n"
        answer = await _answer(stream, _get(extra=upgrade))
        assert answer.startswith(b"HTTP/1.1 200") and _body(answer)["workers"] == 1
        # the connection stays HTTP/1.1
        assert (await _answer(stream, _get())).startswith(b"HTTP/1.1 200")


async def test_a_websocket_upgrade_is_answered_as_plain_http_1_1(sockdir):
    """No WebSocket is served: the offer is ignored as h2c's is (hypercorn answered 500 or
    400 with an empty body)."""
    async with http_controller(sockdir, workers=1) as ctl:
        for key in ("Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n", ""):
            stream = await _connect(ctl.url)
            offer = f"Connection: Upgrade\r\nUpgrade: websocket\r\n{key}"
            offer += "Sec-WebSocket-Version: 13\r\n"
            answer = await _answer(stream, _get(extra=offer))
            assert answer.startswith(b"HTTP/1.1 200") and _body(answer)["workers"] == 1
            assert (await _answer(stream, _get())).startswith(b"HTTP/1.1 200")


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
async def test_curl_http2_over_cleartext_gets_its_answer(sockdir):
    async with http_controller(sockdir, workers=1) as ctl:
        done = await trio.to_thread.run_sync(
            lambda: subprocess.run(
                ["curl", "-sS", "--http2", "--max-time", "10", f"{ctl.url}/health/"],
                capture_output=True,
                check=False,
                env={**os.environ, "NO_PROXY": "*"},
            )
        )
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["workers"] == 1


async def test_the_http2_preface_inside_a_connection_gets_505(sockdir):
    async with http_controller(sockdir, workers=1) as ctl:
        stream = await _connect(ctl.url)
        assert (await _answer(stream, _get())).startswith(b"HTTP/1.1 200")
        await stream.send_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        rest = await _read_until_closed(stream)
        assert rest.startswith(b"HTTP/1.1 505"), rest
        assert b"\x00\x00" not in rest  # no HTTP/2 frame
        # then the rest of the preface ("SM") is no request: 400, and the connection closed
        first, second = rest.split(b"HTTP/1.1 400")
        assert json.loads(first.split(b"\r\n\r\n", 1)[1])["code"] == 505
        assert _body(b"HTTP/1.1 400" + second)["message"]


async def test_a_request_hypercorn_cannot_read_gets_a_json_error(sockdir):
    async with http_controller(sockdir, workers=1) as ctl:
        stream = await _connect(ctl.url)
        await stream.send_all(b"NOT HTTP AT ALL\r\n\r\n")
        answer = await _read_until_closed(stream)
        assert answer.startswith(b"HTTP/1.1 400"), answer
        body = _body(answer)
        assert body["code"] == 400 and body["message"]


# ------------------------------------------------------------ one address, many connections


async def test_one_address_cannot_take_every_place(sockdir):
    """A client holding slow requests on as many connections as it can open gets
    max_connections_per_client of them; /health/ from elsewhere is still served."""
    async with http_controller(
        sockdir, workers=1, max_connections=10, max_connections_per_client=3
    ) as ctl:
        conns = ctl.web.connections
        held = []
        for _ in range(12):
            stream = await _connect(ctl.url, source="127.0.0.2")
            with contextlib.suppress(trio.BrokenResourceError):
                await stream.send_all(b"GET /health/ HTTP/1.1\r\n")  # and then a byte now and then
            held.append(stream)
        await wait_until(lambda: conns.refused == 9)
        assert conns.by_client == {"127.0.0.2": 3}
        for stream in held[3:]:  # closed at once, unanswered
            assert await _read_until_closed(stream, timeout=2) == b""
        other = await _connect(ctl.url)
        assert (await _answer(other, _get())).startswith(b"HTTP/1.1 200")
        # the slow client's own three are still served
        assert (await _answer(held[0], b"Host: x\r\n\r\n")).startswith(b"HTTP/1.1 200")
        for stream in held:
            await stream.aclose()
        await wait_until(lambda: conns.open == 1)
        assert conns.by_client == {"127.0.0.1": 1}


def test_an_error_object_never_has_an_empty_message():
    assert json.loads(error_response(409, "").body)["message"] == "Conflict"
    assert json.loads(error_response(499, "").body)["message"]
    assert json.loads(error_response(404, "no job 'x'").body)["message"] == "no job 'x'"


async def _hold_a_body(url: str, source: str, size: int) -> trio.SocketStream:
    """A POST /job/ from `source` whose body (an unfinished job array) stops after `size`
    bytes: the controller holds them while it waits for the rest."""
    stream = await _connect(url, source)
    head = f"POST /job/ HTTP/1.1\r\nHost: x\r\nContent-Length: {size + 10}\r\n\r\n"
    await stream.send_all(head.encode() + b"[" + b" " * (size - 1))
    return stream


async def test_bodies_being_read_share_one_budget_one_client_half_of_it(sockdir):
    """Slow uploads cannot take the controller's memory, and one address cannot take the
    others' room: the bodies being read hold at most two of the largest body together, one
    address at most half of that; past either a request is 503 (try again)."""
    async with http_controller(sockdir, workers=0, max_extra_size=1000) as ctl:
        budget = ctl.web.bodies
        part = budget.limit // 2 - 100  # near the largest body, a job array's
        job = _post(b'{"payload": "' + b"x" * 300 + b'"}')
        first = await _hold_a_body(ctl.url, "127.0.0.2", part)
        await wait_until(lambda: budget.held == part)
        # The same address again: past its half, while another address is served.
        assert (await _answer(await _connect(ctl.url, "127.0.0.2"), job)).startswith(
            b"HTTP/1.1 503"
        )
        assert (await _answer(await _connect(ctl.url, "127.0.0.4"), job)).startswith(
            b"HTTP/1.1 201"
        )
        second = await _hold_a_body(ctl.url, "127.0.0.3", part)
        await wait_until(lambda: budget.held == 2 * part)
        crowded = await _answer(await _connect(ctl.url, "127.0.0.4"), job)
        assert crowded.startswith(b"HTTP/1.1 503") and b"bodies" in crowded
        assert b"retry-after" in crowded.lower()
        await first.aclose()
        await second.aclose()
        await wait_until(lambda: budget.held == 0 and not budget.by_client)
        assert (await _answer(await _connect(ctl.url, "127.0.0.4"), job)).startswith(
            b"HTTP/1.1 201"
        )

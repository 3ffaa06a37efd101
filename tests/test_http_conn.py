"""The HTTP door's connections: the cap on open ones, HTTP/1.1 only, the silences and the
body's time limit, against an in-process controller over real sockets; a real controller
under a small descriptor limit; and a calculator's report forged from another port."""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import socket
import urllib.request
from pathlib import Path

import pytest
import trio

from controller import containment
from controller.doors.http import connections, keepalive
from controller.doors.http import shell as http_module
from tests.helpers import live_controller, run_udp_client, wait_for_condition, wait_until
from tests.test_http import client, http_controller

SHORT_IDLE = 0.5  # the door's IDLE_TIMEOUT in these tests


_OPENED: list[trio.SocketStream] = []


@pytest.fixture(autouse=True)
def _close_what_the_test_opened():
    yield
    while _OPENED:
        with contextlib.suppress(OSError):
            os.close(_OPENED.pop().socket.detach())


async def _connect(url: str) -> trio.SocketStream:
    host, port = url.removeprefix("http://").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    _OPENED.append(stream)
    return stream


async def _read_until_closed(stream: trio.SocketStream, timeout: float = 10.0) -> bytes:
    """Everything the server sends until it closes the connection (fails on a timeout)."""
    got = b""
    with trio.fail_after(timeout):
        while True:
            try:
                chunk = await stream.receive_some(65536)
            except trio.BrokenResourceError:  # reset: closed too
                return got
            if not chunk:
                return got
            got += chunk


async def _get(stream: trio.SocketStream, path: str = "/health/") -> bytes:
    await stream.send_all(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    got = b""
    with trio.fail_after(10):
        while b"\r\n\r\n" not in got or not got.endswith(b"}"):
            chunk = await stream.receive_some(65536)
            assert chunk, got
            got += chunk
    return got


@pytest.fixture
def short_idle(monkeypatch):
    monkeypatch.setattr(http_module, "IDLE_TIMEOUT", SHORT_IDLE)


async def test_a_connection_past_max_connections_is_closed_at_once(sockdir):
    async with http_controller(sockdir, workers=1, max_connections=3) as ctl:
        held = [await _connect(ctl.url) for _ in range(3)]
        await wait_until(lambda: ctl.web.connections.open == 3)
        extra = await _connect(ctl.url)
        assert await _read_until_closed(extra) == b""  # accepted, then closed with no answer
        assert ctl.web.connections.refused == 1
        # the ones within the limit are served
        assert (await _get(held[0])).startswith(b"HTTP/1.1 200")
        for stream in held:
            await stream.aclose()
        await wait_until(lambda: ctl.web.connections.open == 0)
        again = await _connect(ctl.url)
        assert (await _get(again)).startswith(b"HTTP/1.1 200")
        await again.aclose()


async def test_the_http2_preface_is_closed_without_switching(sockdir):
    async with http_controller(sockdir, workers=1) as ctl:
        stream = await _connect(ctl.url)
        await stream.send_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        assert await _read_until_closed(stream) == b""  # no SETTINGS frame, nothing


async def test_the_http2_preface_in_small_pieces_is_closed_too(sockdir):
    async with http_controller(sockdir, workers=1) as ctl:
        stream = await _connect(ctl.url)
        for piece in (b"PR", b"I * HT", b"TP/2.0\r", b"\n\r\nSM\r\n\r\n"):
            await stream.send_all(piece)
        assert await _read_until_closed(stream) == b""


async def test_http_1_1_still_served_after_refusing_http2(sockdir):
    async with http_controller(sockdir, workers=1) as ctl:
        stream = await _connect(ctl.url)
        assert (await _get(stream)).startswith(b"HTTP/1.1 200")
        assert (await _get(stream)).startswith(b"HTTP/1.1 200")  # kept alive
        await stream.aclose()


async def test_an_idle_kept_alive_connection_is_closed(sockdir, short_idle):
    async with http_controller(sockdir, workers=1) as ctl:
        stream = await _connect(ctl.url)
        assert (await _get(stream)).startswith(b"HTTP/1.1 200")
        assert await _read_until_closed(stream) == b""
        await wait_until(lambda: ctl.web.connections.open == 0)


async def test_an_idle_connection_is_closed_with_hypercorns_own_timer(
    sockdir, short_idle, monkeypatch
):
    monkeypatch.setattr(keepalive, "usable", lambda: False)
    fitted: list[object] = []
    monkeypatch.setattr(keepalive, "fit", fitted.append)
    async with http_controller(sockdir, workers=1) as ctl:
        stream = await _connect(ctl.url)
        assert (await _get(stream)).startswith(b"HTTP/1.1 200")
        assert await _read_until_closed(stream) == b""
    assert fitted == []


async def test_a_connection_silent_mid_head_is_closed(sockdir, short_idle):
    async with http_controller(sockdir, workers=1) as ctl:
        stream = await _connect(ctl.url)
        await stream.send_all(b"GET /health/ HTTP/1.1\r\nHost: x\r\n")  # no blank line: more due
        assert await _read_until_closed(stream) == b""
        await wait_until(lambda: ctl.web.connections.open == 0)


async def _trickle(stream: trio.SocketStream, data: bytes, pause: float) -> None:
    """A slow client: `data` a few bytes at a time, `pause` seconds apart (the pacing is the
    behaviour under test, not a wait for something to settle)."""
    for start in range(0, len(data), 4):
        await stream.send_all(data[start : start + 4])
        await trio.sleep(pause)


async def test_a_head_that_keeps_coming_is_served_past_the_idle_time(sockdir, short_idle):
    """Only silence ends a connection mid-head: a head trickled over several idle times,
    never silent for one, is answered."""
    async with http_controller(sockdir, workers=1) as ctl:
        stream = await _connect(ctl.url)
        head = b"GET /health/ HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 20 + b"\r\n\r\n"
        await _trickle(stream, head, SHORT_IDLE / 4)  # ~2 s in all, 4 x SHORT_IDLE
        got = b""
        with trio.fail_after(10):
            while b"\r\n\r\n" not in got:
                chunk = await stream.receive_some(65536)
                assert chunk, got
                got += chunk
        assert got.startswith(b"HTTP/1.1 200"), got


async def test_a_head_slower_than_http_body_timeout_is_cut(sockdir, short_idle):
    async with http_controller(sockdir, workers=1, http_body_timeout=1.0) as ctl:
        stream = await _connect(ctl.url)
        head = b"GET /health/ HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200 + b"\r\n\r\n"
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await _trickle(stream, head, SHORT_IDLE / 4)  # ~7 s: past 1 s + the idle time
        assert await _read_until_closed(stream) == b""
        await wait_until(lambda: ctl.web.connections.open == 0)


async def test_a_head_is_cut_once_http_body_timeout_has_passed_since_its_first_byte(sockdir):
    """A head that keeps coming (never silent for the idle time) is cut when its time is up:
    one trickled over about 3 s with 1 s allowed is never answered."""
    async with http_controller(sockdir, workers=1, http_body_timeout=1.0) as ctl:
        stream = await _connect(ctl.url)
        head = b"GET /health/ HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 80 + b"\r\n\r\n"
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await _trickle(stream, head, 0.1)  # 29 sends, about 3 s
        assert await _read_until_closed(stream) == b""
        await wait_until(lambda: ctl.web.connections.open == 0)


async def test_a_head_silent_for_a_while_is_still_cut_when_its_time_is_up(sockdir):
    """A head that stops for more than a second (the keep-alive watch then waits for silence
    to end the connection) is cut all the same when http_body_timeout has passed: its end,
    sent after that, gets no answer."""
    async with http_controller(sockdir, workers=1, http_body_timeout=2.0) as ctl:
        stream = await _connect(ctl.url)
        await stream.send_all(b"GET /health/ HTTP/1.1\r\n")
        await trio.sleep(3.0)  # silent past the cut, short of the 5 s silence rule
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await stream.send_all(b"Host: x\r\n\r\n")
        assert await _read_until_closed(stream) == b""
        await wait_until(lambda: ctl.web.connections.open == 0)


async def test_a_connection_silent_mid_body_is_closed(sockdir, short_idle):
    async with http_controller(sockdir, workers=1) as ctl:
        stream = await _connect(ctl.url)
        await stream.send_all(
            b"POST /job/ HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"payload": '
        )
        answer = await _read_until_closed(stream)
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert ctl.desk.book.latest(10, None) == []  # nothing was added


async def test_a_body_slower_than_http_body_timeout_is_cut(sockdir):
    async with http_controller(sockdir, workers=1, http_body_timeout=1.0) as ctl:
        stream = await _connect(ctl.url)
        await stream.send_all(
            b'POST /job/ HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"payload": "'
        )

        async def trickle() -> None:  # a byte every 0.1 s: never silent, never done
            while True:
                await trio.sleep(0.1)
                try:
                    await stream.send_all(b"a")
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return

        async with trio.open_nursery() as nursery:
            nursery.start_soon(trickle)
            answer = await _read_until_closed(stream)
            nursery.cancel_scope.cancel()
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert b"did not end in time" in answer


async def test_a_request_s_time_runs_from_its_first_byte_to_its_last(sockdir):
    """http_body_timeout is the head's time and the body's together: a head trickled over
    about 1.5 s leaves its body about 0.5 s of 2, and a body that would take 1 s more is 408
    (it would have been in time counted from the body's own first byte)."""
    async with http_controller(sockdir, workers=1, http_body_timeout=2.0) as ctl:
        stream = await _connect(ctl.url)
        head = b"POST /job/ HTTP/1.1\r\nHost: x\r\nContent-Length: 22\r\nX-Pad: abc\r\n\r\n"
        await _trickle(stream, head, 0.1)  # 16 sends, about 1.6 s
        body = b'{"payload": "abcdefg"}'  # 22 bytes, 11 sends 0.1 s apart

        async def trickle() -> None:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                for start in range(0, len(body), 2):
                    await stream.send_all(body[start : start + 2])
                    await trio.sleep(0.1)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(trickle)
            answer = await _read_until_closed(stream)
            nursery.cancel_scope.cancel()
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert ctl.desk.book.latest(10, None) == []


@pytest.mark.parametrize("path", ["/nosuch/", "/job/"])
async def test_a_broken_chunked_body_is_refused_quietly(sockdir, caplog, path):
    """hypercorn refuses the broken body (400) and closes the connection while the handler
    may be answering too: the two take turns, nothing is logged as a failure, and the door
    goes on."""
    async with http_controller(sockdir, workers=1) as ctl:
        for attempt in range(30):
            stream = await _connect(ctl.url)
            await stream.send_all(
                f"POST {path} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
            )
            for _ in range(attempt % 10):  # the broken chunk at a different moment each time
                await trio.lowlevel.checkpoint()
            await stream.send_all(b"zz\r\n")  # not a chunk size
            answer = await _read_until_closed(stream)  # closed (a reset may eat the answer)
            assert answer == b"" or answer.startswith((b"HTTP/1.1 400", b"HTTP/1.1 404")), answer
            await stream.aclose()
        await wait_until(lambda: ctl.web.connections.open == 0)
        assert (await _get(await _connect(ctl.url))).startswith(b"HTTP/1.1 200")
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, caplog.text[-3000:]


async def test_connections_that_fail_log_one_traceback_not_one_each(monkeypatch, caplog):
    monkeypatch.setattr(containment, "FAILURES", containment.Failures())  # a first failure

    async def failing(stream: trio.abc.Stream) -> None:
        raise RuntimeError("a bug one connection reaches")

    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    slots = connections.Connections(10)
    async with trio.open_nursery() as nursery:
        await nursery.start(connections.serve_connections, [(listener, None)], failing, slots)
        for _ in range(20):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await _read_until_closed(stream)  # closed: that connection alone
            await stream.aclose()
        await wait_until(lambda: containment.FAILURES.total == 20)
        nursery.cancel_scope.cancel()
    assert caplog.text.count("Traceback") == 1, caplog.text[-3000:]


def test_the_hypercorn_names_the_door_uses_are_there():
    from hypercorn.trio.tcp_server import TCPServer
    from hypercorn.trio.worker_context import WorkerContext

    params = list(inspect.signature(TCPServer.__init__).parameters)
    assert params == ["self", "app", "config", "context", "state", "stream"]
    assert list(inspect.signature(WorkerContext.__init__).parameters) == ["self", "max_requests"]
    assert inspect.iscoroutinefunction(TCPServer.run)
    assert hasattr(WorkerContext(None), "terminated")


# ---------------------------------------------------------------- descriptors run out

NOFILE = 128


def _open_idle(port: int, count: int) -> list[socket.socket]:
    held = []
    for _ in range(count):
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        except ConnectionResetError:  # one past max_connections, closed at once
            continue
        held.append(sock)
    return held


def _workers(url: str) -> int | None:
    try:
        with urllib.request.urlopen(f"{url}/health/", timeout=5) as answer:
            return int(json.load(answer)["workers"])
    except OSError:
        return None


def _log(tmp: Path) -> str:
    return (tmp / "controller.log").read_text(errors="replace")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/usr/bin/prlimit").exists(), reason="needs prlimit (util-linux)")
def test_out_of_descriptors_the_controller_stays_up_and_recovers(tmp_path):
    launcher = ("/usr/bin/prlimit", f"--nofile={NOFILE}")
    with live_controller(
        tmp_path,
        "--workers",
        "1",
        launcher=launcher,
        max_connections=1000,
        max_connections_per_client=1000,  # all from one address here
    ) as ctl:
        port = int(ctl.url.rsplit(":", 1)[1])
        held = _open_idle(port, 2 * NOFILE)  # more than it has descriptors for
        wait_for_condition(lambda: "cannot accept" in _log(tmp_path), 15)
        # Jobs still flow meanwhile or once the idle connections are closed (5 s).
        out = run_udp_client(ctl.udp_port, "--timeout", "30", "add", "7", "--payload", "x")
        assert out.returncode == 0, out.stderr
        assert ctl.proc.poll() is None
        for sock in held:
            sock.close()
        out = run_udp_client(ctl.udp_port, "--timeout", "30", "add", "8", "--payload", "y")
        assert out.returncode == 0, out.stderr
        assert ctl.proc.poll() is None


@pytest.mark.slow
@pytest.mark.skipif(not Path("/usr/bin/prlimit").exists(), reason="needs prlimit (util-linux)")
def test_max_connections_keeps_descriptors_for_the_rest(tmp_path):
    launcher = ("/usr/bin/prlimit", f"--nofile={NOFILE}")
    with live_controller(tmp_path, "--workers", "1", launcher=launcher, max_connections=40) as ctl:
        port = int(ctl.url.rsplit(":", 1)[1])
        held = _open_idle(port, 2 * NOFILE)
        out = run_udp_client(ctl.udp_port, "--timeout", "30", "add", "9", "--payload", "z")
        assert out.returncode == 0, out.stderr
        for sock in held:
            sock.close()
        wait_for_condition(lambda: _workers(ctl.url) == 1)  # once the closes are seen
        assert ctl.proc.poll() is None
        # The cap kept descriptors free: no accept ever failed.
        assert "cannot accept" not in _log(tmp_path)


# ---------------------------------------------------------------- calculators cannot forge


async def test_a_forged_completed_task_from_another_port_is_acknowledged_and_ignored(sockdir):
    async with http_controller(sockdir, workers=0) as ctl:
        door = ("127.0.0.1", ctl.udp_port)
        calc = trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        forger = trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        with calc, forger:
            await calc.bind(("127.0.0.1", 0))
            await forger.bind(("127.0.0.1", 0))

            async def send(sock, method, txid=None, **params):
                packet = {"method": method, "params": params, "packet_type": 0}
                if txid is not None:
                    packet.update(packet_type=1, transmission_id=txid)
                await sock.sendto(json.dumps(packet).encode(), door)

            await send(calc, "heartbeat", status="ready")
            await wait_until(lambda: len(ctl.shell.core.workers) == 1)
            async with client(ctl.url) as http:
                job = (await http.post("/job/", json={"id": "calc-job", "payload": "in"})).json()
                with trio.fail_after(10):
                    perform = json.loads((await calc.recvfrom(65536))[0])
                assert perform["method"] == "perform_task"
                ack = {
                    "method": "ack",
                    "packet_type": 2,
                    "transmission_id": perform["transmission_id"],
                }
                await calc.sendto(json.dumps(ack).encode(), door)
                await wait_until(lambda: ctl.desk.book.get("calc-job").state.value == "working")
                # From another port of the same host: acknowledged, counted, not taken.
                await send(forger, "heartbeat", status="busy")
                task_id = job["task_id"]
                await send(
                    forger, "completed_task", 7, task_id=task_id, status="success", result="FORGED"
                )
                with trio.fail_after(10):
                    answer = json.loads((await forger.recvfrom(65536))[0])
                assert answer["transmission_id"] == 7 and "error" not in answer
                assert ctl.shell.core.calculators.ignored_reports == 1
                assert (await http.get("/job/calc-job/")).json()["state"] == "working"
                await send(
                    calc, "completed_task", 8, task_id=task_id, status="success", result="real"
                )
                done = (await http.get("/job/calc-job/", params={"wait": 10})).json()
                assert done["state"] == "finished" and done["result"] == "real"

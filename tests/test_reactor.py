"""The reactor's exchanges on real Unix sockets: split frames, big payloads, silent peers,
failures reported without re-entering the caller, and the order of events."""

from __future__ import annotations

import select
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from controller import reactor as reactor_module
from controller import wire
from controller.containment import FAILURES
from controller.reactor import Reactor
from controller.transport import Incoming, Outgoing, listen_unix
from gen import worker_protocol_pb2 as pb
from tests.helpers import wait_until

REQUEST = pb.ControlMsg(type=pb.CTRL_SET_TASK, task_id=7)


class Box:
    """Collects results and wakes the test when one arrives."""

    def __init__(self) -> None:
        self.items: list[object] = []
        self.event = trio.Event()

    def __call__(self, *item: object) -> None:
        self.items.append(item[0] if len(item) == 1 else item)
        self.event.set()

    async def wait(self) -> Any:
        with trio.fail_after(10):
            await self.event.wait()
        return self.items[-1]


@pytest.fixture
def listener(sockdir: Path):
    """A listening socket at sockdir/w.sock, closed after the test."""
    with listen_unix(sockdir / "w.sock", 8) as sock:
        yield sock


async def started(nursery: trio.Nursery) -> Reactor:
    reactor = Reactor()
    await nursery.start(reactor.run)
    return reactor


async def serve_once(listener: socket.socket, answer: bytes, chunk: int = 0) -> None:
    """A peer (in a thread) that reads one request, then writes `answer` in `chunk`-byte pieces."""

    def peer() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.setblocking(True)
            conn.recv(1 << 20)
            step = chunk or len(answer)
            for i in range(0, len(answer), step):
                conn.sendall(answer[i : i + step])

    await trio.to_thread.run_sync(peer)


@pytest.mark.parametrize("chunk", [0, 1, 7])
async def test_outgoing_reads_an_answer_in_any_pieces(sockdir: Path, listener, nursery, chunk):
    reactor = await started(nursery)
    listener.setblocking(True)
    extra = bytes(range(256)) * 4
    answer = wire.encode_frame(pb.WorkerResponse(task_id=7), extra)
    nursery.start_soon(serve_once, listener, answer, chunk)
    box = Box()
    Outgoing(
        reactor, sockdir / "w.sock", wire.encode_frame(REQUEST), pb.WorkerResponse, box, timeout=5
    )
    msg, got = await box.wait()
    assert msg.task_id == 7 and got == extra


async def test_outgoing_closes_its_socket_even_when_the_answers_callback_fails(
    sockdir: Path, listener
):
    """The answer is handled before the socket is closed (a close is a system call on the
    way to the next datagram), and the close still happens when the handler raises; the
    failure is logged and the reactor goes on."""
    listener.setblocking(True)
    answer = wire.encode_frame(pb.WorkerResponse(task_id=7))
    after_answer: list[bytes] = []

    def peer() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.setblocking(True)
            conn.settimeout(10)
            conn.recv(1 << 20)
            conn.sendall(answer)
            after_answer.append(conn.recv(1))  # b"": the dialler closed

    def done(result: object) -> None:
        raise RuntimeError("the handler failed")

    async with trio.open_nursery() as nursery:
        reactor = await started(nursery)
        Outgoing(
            reactor,
            sockdir / "w.sock",
            wire.encode_frame(REQUEST),
            pb.WorkerResponse,
            done,
            timeout=5,
        )
        failed_before = FAILURES.total
        await trio.to_thread.run_sync(peer)
        await wait_until(lambda: FAILURES.total > failed_before)
        nursery.cancel_scope.cancel()
    assert after_answer == [b""]


async def test_big_request_and_answer_both_ways(sockdir: Path, listener, nursery):
    """A 4 MB extra is more than a socket buffer holds: both sides go on as the peer reads."""
    reactor = await started(nursery)
    payload = b"p" * (4 << 20)
    result = b"r" * (4 << 20)
    served = Box()

    def on_frame(conn: Incoming[pb.ControlMsg], msg: pb.ControlMsg, extra: bytes) -> None:
        served(len(extra))
        conn.reply(wire.encode_frame(pb.WorkerResponse(task_id=msg.task_id), result))

    def on_accept(events: int) -> None:
        conn, _ = listener.accept()
        # left blocking, as the controller and the worker leave what they accept
        Incoming(reactor, conn, pb.ControlMsg, on_frame, served, timeout=5, max_extra_size=8 << 20)

    reactor.watch(listener, select.EPOLLIN, on_accept)
    box = Box()
    Outgoing(
        reactor,
        sockdir / "w.sock",
        wire.encode_frame(REQUEST, payload),
        pb.WorkerResponse,
        box,
        timeout=5,
        max_extra_size=8 << 20,
    )
    msg, got = await box.wait()
    assert served.items == [len(payload)]
    assert msg.task_id == 7 and got == result


async def test_silent_peer_times_out(sockdir: Path, listener, nursery, autojump_clock):
    """The listener accepts (in the kernel) and never answers."""
    reactor = await started(nursery)
    box = Box()
    start = trio.current_time()
    Outgoing(
        reactor, sockdir / "w.sock", wire.encode_frame(REQUEST), pb.WorkerResponse, box, timeout=2
    )
    result = await box.wait()
    assert isinstance(result, wire.PeerTimeout)
    assert trio.current_time() - start == pytest.approx(2.0, abs=0.01)


async def test_incoming_that_never_completes_its_frame_times_out(
    sockdir: Path, nursery, autojump_clock
):
    reactor = await started(nursery)
    a, b = socket.socketpair()
    # `a` stays blocking, like an accepted socket: Incoming must never block on it
    b.send(wire.encode_frame(REQUEST)[:2])  # half a frame, then silence
    errors = Box()
    start = trio.current_time()
    Incoming(reactor, a, pb.ControlMsg, lambda *args: None, errors, timeout=3)
    _, exc = await errors.wait()
    assert isinstance(exc, wire.PeerTimeout)
    assert trio.current_time() - start == pytest.approx(3.0, abs=0.01)
    assert a.fileno() == -1  # closed: nothing answered it
    b.close()


async def test_incoming_from_a_peer_that_sends_nothing_does_not_block_the_loop(
    nursery, autojump_clock
):
    """A connection whose peer sends nothing, on a socket left blocking as accepted ones
    are: Incoming's first read returns at once (a blocking read would hang the reactor),
    and the connection is dropped after `timeout`."""
    reactor = await started(nursery)
    a, b = socket.socketpair()
    # A guard, so that a regression fails instead of hanging: a blocking read gives up
    # after 2 s (SO_RCVTIMEO leaves Python's idea of the socket's mode alone).
    a.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 2, 0))
    errors = Box()
    start_real, start = time.perf_counter(), trio.current_time()
    Incoming(reactor, a, pb.ControlMsg, lambda *args: None, errors, timeout=3)
    assert time.perf_counter() - start_real < 1.0
    _, exc = await errors.wait()
    assert isinstance(exc, wire.PeerTimeout)
    assert trio.current_time() - start == pytest.approx(3.0, abs=0.01)
    assert a.fileno() == -1
    b.close()


async def test_garbage_request_gets_an_error_answer(sockdir: Path, nursery):
    reactor = await started(nursery)
    a, b = socket.socketpair()
    # `a` stays blocking, like an accepted socket: Incoming must never block on it
    b.send(b"\xff" * 11)  # a varint that never ends

    def answer(conn: Incoming[pb.ControlMsg], exc: wire.RemoteProtocolError) -> None:
        conn.reply(wire.encode_frame(pb.WorkerResponse(error=pb.WORKER_ERR_FAILED)))

    Incoming(reactor, a, pb.ControlMsg, lambda *args: None, answer, timeout=3)
    b.settimeout(5)
    data = b.recv(100)
    assert wire.whole_frame(pb.WorkerResponse, data, 0) == (
        pb.WorkerResponse(error=pb.WORKER_ERR_FAILED),
        b"",
    )
    assert b.recv(100) == b""  # and then closed
    b.close()


async def test_failed_dial_reports_on_the_next_turn_not_inside_the_call(sockdir: Path, nursery):
    reactor = await started(nursery)
    box = Box()
    Outgoing(reactor, sockdir / "nobody.sock", b"x", pb.WorkerResponse, box, timeout=2)
    assert box.items == []  # the caller is never re-entered
    result = await box.wait()
    assert isinstance(result, FileNotFoundError)


async def test_workers_answers_are_served_before_new_datagrams(nursery):
    """Sockets watched with last=True wait for the others that are ready in the same round."""
    reactor = Reactor()
    order: list[str] = []
    low_a, low_b = socket.socketpair()
    high_a, high_b = socket.socketpair()
    for sock in (low_a, high_a):
        sock.setblocking(False)
    low_b.send(b"x")  # ready first
    high_b.send(b"y")
    reactor.watch(low_a, select.EPOLLIN, lambda ev: order.append(low_a.recv(1).decode()), last=True)
    reactor.watch(high_a, select.EPOLLIN, lambda ev: order.append(high_a.recv(1).decode()))
    await nursery.start(reactor.run)
    await wait_until(lambda: len(order) == 2, timeout=5)
    assert order == ["y", "x"]
    for sock in (low_b, high_b):
        sock.close()


async def test_cancelled_timers_do_not_fire_and_sockets_close_with_the_reactor(autojump_clock):
    fired: list[float] = []
    a, b = socket.socketpair()
    async with trio.open_nursery() as nursery:
        reactor = await started(nursery)
        reactor.call_at(5.0, fired.append).cancel()
        reactor.call_at(7.0, fired.append)
        reactor.watch(a, select.EPOLLIN, lambda ev: None)
        await trio.sleep(10)
        nursery.cancel_scope.cancel()
    assert fired == [pytest.approx(7.0)]
    assert a.fileno() == -1  # still watched when the reactor stopped: closed by it
    b.close()


@pytest.mark.parametrize("busy_poll", [0.002, None], ids=["fixed", "adaptive"])
async def test_busy_polling_reactor_serves_and_then_sleeps(
    sockdir: Path, listener, autojump_clock, busy_poll
):
    """With busy_poll it answers as usual, and once quiet it sleeps: the clock can jump."""
    fired: list[float] = []
    async with trio.open_nursery() as nursery:
        reactor = Reactor(busy_poll=busy_poll)
        await nursery.start(reactor.run)

        def on_frame(conn: Incoming[pb.ControlMsg], msg: pb.ControlMsg, extra: bytes) -> None:
            conn.reply(wire.encode_frame(pb.WorkerResponse(task_id=msg.task_id)))

        def on_accept(events: int) -> None:
            conn, _ = listener.accept()
            # left blocking, as the controller and the worker leave what they accept
            Incoming(reactor, conn, pb.ControlMsg, on_frame, lambda *args: None, timeout=5)

        reactor.watch(listener, select.EPOLLIN, on_accept)  # the peer runs in the same reactor
        box = Box()
        Outgoing(
            reactor,
            sockdir / "w.sock",
            wire.encode_frame(REQUEST),
            pb.WorkerResponse,
            box,
            timeout=5,
        )
        msg, _ = await box.wait()
        assert msg.task_id == 7
        reactor.call_at(trio.current_time() + 60, fired.append)
        with trio.fail_after(120):  # the mock clock only jumps while every task sleeps
            while not fired:
                await trio.sleep(1)
        nursery.cancel_scope.cancel()


async def test_full_listen_backlog_is_retried_until_the_timeout(
    sockdir: Path, nursery, autojump_clock
):
    reactor = await started(nursery)
    with listen_unix(sockdir / "w.sock", 0) as full:
        pending = []
        while True:  # fill the backlog: nobody accepts
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
            try:
                sock.connect(str(sockdir / "w.sock"))
            except BlockingIOError:
                sock.close()
                break
            pending.append(sock)
        box = Box()
        start = trio.current_time()
        Outgoing(reactor, sockdir / "w.sock", b"x", pb.WorkerResponse, box, timeout=0.5)
        result = await box.wait()
        assert isinstance(result, wire.PeerTimeout) and "listen backlog full" in str(result)
        assert trio.current_time() - start == pytest.approx(0.5, abs=0.01)
        assert full.fileno() >= 0
        for sock in pending:
            sock.close()


async def test_adaptive_polling_opens_while_events_flow_and_closes_when_quiet(monkeypatch):
    """Events close together open the poll window (up to its cap); a quiet spell shuts it."""
    # Windows of milliseconds, so that a loaded test machine still counts the burst as one.
    monkeypatch.setattr(reactor_module, "ADAPTIVE_START", 0.002)
    monkeypatch.setattr(reactor_module, "ADAPTIVE_MAX", 0.05)
    a, b = socket.socketpair()
    box = Box()
    with a, b:
        async with trio.open_nursery() as nursery:
            reactor = Reactor(busy_poll=None)
            await nursery.start(reactor.run)
            reactor.watch(a, select.EPOLLIN, lambda events: box(a.recv(64)))
            assert reactor._window == 0
            windows = []
            for _ in range(20):  # a burst: each byte written as soon as the last is served
                box.event = trio.Event()
                b.send(b"x")
                await box.wait()
                windows.append(reactor._window)
            # Open from the second event on (it grows only while polling falls short).
            assert all(0 < window <= 0.05 for window in windows[1:])
            await trio.sleep(0.3)  # quiet: far longer than any window
            box.event = trio.Event()
            b.send(b"x")
            await box.wait()
            assert reactor._window == 0
            assert len(box.items) == 21
            nursery.cancel_scope.cancel()


async def test_in_thread_counts_its_calls_while_they_run_and_passes_results_and_errors():
    """While a call runs in a thread the reactor does not poll (the thread needs the GIL):
    the count says so, and it comes back to zero however the call ends."""
    release = threading.Event()
    async with trio.open_nursery() as nursery:
        reactor = Reactor(busy_poll=None)
        await nursery.start(reactor.run)
        box = Box()

        async def call() -> None:
            box(await reactor.in_thread(lambda: release.wait(10) and "done"))

        nursery.start_soon(call)
        await wait_until(lambda: reactor._threads == 1, timeout=5)
        release.set()
        assert await box.wait() == "done"
        assert reactor._threads == 0
        with pytest.raises(ZeroDivisionError):
            await reactor.in_thread(lambda: 1 / 0)
        assert reactor._threads == 0
        # A call that mostly waits is not counted: the reactor may poll meanwhile.
        release.clear()
        entered = threading.Event()
        waited = Box()

        def wait_in_thread() -> str:
            entered.set()
            release.wait(10)
            return "waited"

        async def call_waiting() -> None:
            waited(await reactor.in_thread(wait_in_thread, mostly_waits=True))

        nursery.start_soon(call_waiting)
        await wait_until(entered.is_set, timeout=5)
        assert reactor._threads == 0
        release.set()
        assert await waited.wait() == "waited"
        nursery.cancel_scope.cancel()

"""The HTTP door's keep-alive timer (controller/doors/http/keepalive.py) under trio's MockClock,
standing in for hypercorn's TCPServer; and in place in a live hypercorn."""

from __future__ import annotations

import math
from typing import Any

import trio

from controller.doors.http import keepalive
from controller.doors.http.keepalive import GRACE, IdleTimer

KEEP_ALIVE = 4.0  # what the HTTP door gives hypercorn: its idle time minus GRACE


class Connection:
    """What hypercorn's TCPServer does with its timer: its task group, its idle action."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        self.closed_at = math.inf
        self.actions = 0
        self.timer = IdleTimer()

    def spawn(self, func: Any, *args: Any) -> None:  # hypercorn's TaskGroup.spawn
        self.nursery.start_soon(func, *args)

    async def idle_timeout(self) -> None:  # TCPServer._idle_timeout, less the server's end
        self.actions += 1
        await trio.sleep(KEEP_ALIVE)
        self.closed_at = trio.current_time()

    async def idle(self) -> None:
        await self.timer.restart(self, self.idle_timeout)

    async def busy(self) -> None:
        await self.timer.stop()


async def test_an_idle_connection_closes_after_grace_plus_keep_alive(autojump_clock):
    async with trio.open_nursery() as nursery:
        conn = Connection(nursery)
        start = trio.current_time()
        await conn.idle()  # opened, no request
    assert conn.closed_at - start == GRACE + KEEP_ALIVE and conn.actions == 1


async def test_requests_keep_it_open_and_the_clock_starts_at_the_last_one(autojump_clock):
    async with trio.open_nursery() as nursery:
        conn = Connection(nursery)
        await conn.idle()
        for _ in range(50):  # a request every 0.3 s for 15 s: never idle for long
            await trio.sleep(0.2)
            await conn.busy()
            await trio.sleep(0.1)
            await conn.idle()
        last = trio.current_time()
    assert conn.closed_at - last == GRACE + KEEP_ALIVE and conn.actions == 1


async def test_a_request_during_hypercorns_wait_cancels_it(autojump_clock):
    async with trio.open_nursery() as nursery:
        conn = Connection(nursery)
        await conn.idle()
        await trio.sleep(GRACE + 1.0)  # hypercorn's wait is running
        assert conn.actions == 1
        await conn.busy()
        await trio.sleep(KEEP_ALIVE * 3)  # a long request: nothing closes it
        assert conn.closed_at == math.inf
        await conn.idle()
        last = trio.current_time()
    assert conn.closed_at - last == GRACE + KEEP_ALIVE and conn.actions == 2


async def test_a_connection_that_ends_mid_request_leaves_no_task_behind(autojump_clock):
    # hypercorn closes a connection whose client left mid-request without a restart: the
    # watcher must leave on its own, or the connection's task group would never end.
    with trio.fail_after(GRACE * 3):
        async with trio.open_nursery() as nursery:
            conn = Connection(nursery)
            await conn.idle()
            await trio.sleep(0.1)
            await conn.busy()  # and no restart ever comes
    assert conn.actions == 0


async def test_a_connection_that_ended_lets_its_task_group_go_at_once(autojump_clock):
    # The client closed an idle connection (or the server did, after its answer): hypercorn
    # waits for the watcher before it lets the connection go, and its place with it.
    for idle_for in (0.1, GRACE + 1.0):  # before hypercorn's wait, and during it
        async with trio.open_nursery() as nursery:
            conn = Connection(nursery)
            await conn.idle()
            await trio.sleep(idle_for)
            ended = trio.current_time()
            conn.timer.end()
        assert trio.current_time() == ended and conn.closed_at == math.inf
        await conn.idle()  # a restart after the end starts nothing
        assert not conn.timer._watching


async def test_one_watcher_however_many_requests(autojump_clock):
    async with trio.open_nursery() as nursery:
        conn = Connection(nursery)
        spawned = []
        real_spawn = conn.spawn

        def counting(func: Any, *args: Any) -> None:
            spawned.append(trio.current_time())
            real_spawn(func, *args)

        conn.spawn = counting  # type: ignore[method-assign]
        await conn.idle()
        for _ in range(1000):  # 1,000 requests in 1 s
            await conn.busy()
            await trio.sleep(0.001)
            await conn.idle()
    assert len(spawned) <= 3, spawned  # hypercorn's own timer: one task per request


def test_fit_gives_a_hypercorn_server_an_idle_timer():
    from hypercorn.config import Config
    from hypercorn.trio.tcp_server import TCPServer
    from hypercorn.trio.worker_context import WorkerContext

    server = TCPServer(None, Config(), WorkerContext(None), {}, None)
    assert keepalive.usable() is True
    assert isinstance(keepalive.fit(server), keepalive.IdleTimer)
    assert isinstance(server.idle_task, IdleTimer)


def test_a_hypercorn_without_the_timer_keeps_its_own(monkeypatch):
    from hypercorn.trio import tcp_server, worker_context

    class Other:
        async def restart(self, task_group: Any, action: Any) -> None: ...

        async def stop(self) -> None: ...

    monkeypatch.delattr(tcp_server, "TrioSingleTask")
    assert keepalive.usable() is False
    monkeypatch.setattr(tcp_server, "TrioSingleTask", Other, raising=False)
    assert keepalive.usable() is False  # not the class the worker context has
    monkeypatch.setattr(worker_context, "TrioSingleTask", Other)

    class Server:
        idle_task = worker_context.TrioSingleTask()

    server = Server()
    mine = server.idle_task
    monkeypatch.undo()
    assert keepalive.fit(server) is None and server.idle_task is mine

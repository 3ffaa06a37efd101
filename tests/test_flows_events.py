"""GET /events/ and `jobctl watch`: job changes as Server-Sent Events, in order, filtered by
queue, resumed with Last-Event-ID, a slow client dropped alone, the access rules, the end of
the stream when the controller stops, and `jobctl watch` against a live controller."""

from __future__ import annotations

import ipaddress
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.lowlevel

from controller.client import Client
from controller.client.jobctl_watch import EventReader
from controller.doors.http import events as events_module
from tests.helpers import live_controller, wait_until
from tests.test_http import Running, client, http_controller


class Listener:
    """One client of /events/: the events it has read, as (name, id, data)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, Any]] = []
        self.status = 0
        self.ended = False

    def states(self, job_id: str) -> list[str]:
        return [data["state"] for name, _, data in self.events if data.get("id") == job_id]

    def ids(self) -> list[int]:
        return [int(seq) for name, seq, _ in self.events if name == "message"]

    async def run(self, http: httpx.AsyncClient, **kwargs: Any) -> None:
        reader = EventReader()
        async with http.stream("GET", "/events/", **kwargs) as resp:
            self.status = resp.status_code
            if resp.status_code != 200:
                await resp.aread()
                self.ended = True
                return
            assert resp.headers["content-type"] == "text/event-stream"
            async for piece in resp.aiter_raw():
                for name, seq, data in reader.feed(piece):
                    self.events.append((name, seq, json.loads(data)))
        self.ended = True


async def _listening(ctl: Running, count: int) -> None:
    await wait_until(lambda: len(ctl.web.events.subscribers) == count)


async def test_a_jobs_life_comes_in_order_and_the_stream_ends_cleanly_on_stop(sockdir):
    listener = Listener()
    async with (
        http_controller(sockdir, workers=1) as ctl,
        client(ctl.url) as http,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(listener.run, http)
        await _listening(ctl, 1)
        resp = await http.post("/job/", json={"id": "life", "payload": "x"})
        assert resp.status_code == 201
        await wait_until(lambda: "finished" in listener.states("life"))
        # made (handed out at once to the idle worker: requested), started, ended
        assert listener.states("life") == ["requested", "working", "finished"]
        first = listener.events[0][2]
        assert first == {
            "id": "life",
            "state": "requested",
            "queue": "default",
            "progress": None,
        }
        ids = listener.ids()
        assert ids == list(range(ids[0], ids[0] + len(ids)))
        # canceled, retried, deleted: one event each
        await http.post("/job/", json={"id": "held", "queue": "nobody"})
        await http.put("/job/held/", json={"state": "canceled"})
        await http.post("/job/held/retry/")
        await http.delete("/job/held/")
        await wait_until(lambda: "deleted" in listener.states("held"))
        assert listener.states("held") == [
            "pending",
            "canceled",
            "pending",
            "canceled",
            "deleted",
        ]
        nursery.cancel_scope.cancel()


async def test_the_stream_ends_with_its_last_chunk_when_the_controller_stops(sockdir):
    listener = Listener()
    failure: list[BaseException] = []

    async def listen(url: str) -> None:
        try:
            async with client(url) as http:
                await listener.run(http)
        except httpx.HTTPError as exc:  # an incomplete chunked body would say so
            failure.append(exc)

    async with trio.open_nursery() as outer:
        async with http_controller(sockdir, workers=0) as ctl:
            outer.start_soon(listen, ctl.url)
            await _listening(ctl, 1)
        await wait_until(lambda: listener.ended or bool(failure))
    assert failure == [] and listener.ended and listener.status == 200


async def test_the_queue_filter_and_bad_queries(sockdir):
    mail, everything = Listener(), Listener()
    async with http_controller(sockdir, workers=0) as ctl, client(ctl.url) as http:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: mail.run(http, params={"queue": "mail"}))
            nursery.start_soon(everything.run, http)
            await _listening(ctl, 2)
            await http.post("/job/", json={"id": "a", "queue": "default"})
            await http.post("/job/", json={"id": "m", "queue": "mail"})
            await wait_until(lambda: len(everything.events) == 2 and len(mail.events) == 1)
            assert mail.events[0][2]["id"] == "m" and mail.events[0][2]["queue"] == "mail"
            nursery.cancel_scope.cancel()
        for params in ({"queue": "Bad Name"}, {"last_event_id": "x1"}):
            resp = await http.get("/events/", params=params)
            assert resp.status_code == 400 and resp.json()["code"] == 400
        resp = await http.get("/events/", headers={"Last-Event-ID": "-5"})
        assert resp.status_code == 400
        assert ctl.web.events.subscribers == set()


async def test_last_event_id_resumes_and_an_id_the_ring_lost_gets_a_reset(sockdir, monkeypatch):
    monkeypatch.setattr(events_module, "RING_SIZE", 4)
    async with http_controller(sockdir, workers=0) as ctl, client(ctl.url) as http:
        ctl.web.events = hub = events_module.EventHub()  # with the smaller ring
        ctl.desk.on_change = hub.job_changed
        for n in range(3):
            await http.post("/job/", json={"id": f"j{n}"})
        seqs = [change[0] for change in hub.ring]
        for kwargs in (
            {"headers": {"Last-Event-ID": str(seqs[0])}},
            {"params": {"last_event_id": str(seqs[0])}},
        ):
            resumed = Listener()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lambda: resumed.run(http, **kwargs))  # noqa: B023
                await wait_until(lambda: len(resumed.events) == 2)  # noqa: B023
                assert [d["id"] for _, _, d in resumed.events] == ["j1", "j2"]
                assert resumed.ids() == seqs[1:]
                nursery.cancel_scope.cancel()
        for n in range(3, 6):  # j0's event leaves the ring of 4
            await http.post("/job/", json={"id": f"j{n}"})
        late = Listener()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: late.run(http, headers={"Last-Event-ID": str(seqs[0])}))
            await wait_until(lambda: len(late.events) == 1)
            name, _, data = late.events[0]
            assert name == "reset" and data == {"oldest": hub.ring[0][0]}
            await http.post("/job/", json={"id": "after"})
            await wait_until(lambda: len(late.events) == 2)
            assert late.events[1][2]["id"] == "after"  # then the events from now on
            nursery.cancel_scope.cancel()


async def test_ids_after_a_restart_are_above_the_ones_before(sockdir, tmp_path):
    journal = tmp_path / "journal.sqlite3"
    async with http_controller(sockdir, workers=0, journal=journal) as ctl, client(ctl.url) as h:
        await h.post("/job/", json={"id": "before"})
        before = ctl.web.events.ring[-1][0]
    async with http_controller(sockdir, workers=0, journal=journal) as ctl, client(ctl.url) as h:
        assert ctl.desk.book.get("before") is not None  # the job came back, not its events
        assert len(ctl.web.events.ring) == 0
        late = Listener()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: late.run(h, headers={"Last-Event-ID": str(before)}))
            await wait_until(lambda: len(late.events) == 1)
            assert late.events[0][0] == "reset"
            await h.post("/job/", json={"id": "after"})
            await wait_until(lambda: len(late.events) == 2)
            assert int(late.events[1][1]) > before
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("why", ["behind", "send timeout"])
async def test_a_client_that_reads_nothing_is_dropped_and_the_others_go_on(
    sockdir, monkeypatch, why
):
    """Its buffer fills (behind: dropped), or a send to it takes too long (send timeout,
    with a buffer too big to fill): either way its connection is closed."""
    if why == "behind":
        monkeypatch.setattr(events_module, "BUFFER_SIZE", 50)
        monkeypatch.setattr(events_module, "DROP_GRACE", 0.2)
    else:
        monkeypatch.setattr(events_module, "BUFFER_SIZE", 10**7)
        monkeypatch.setattr(events_module, "SEND_TIMEOUT", 0.3)
    good = Listener()
    async with http_controller(sockdir, workers=0) as ctl, client(ctl.url) as http:
        hub = ctl.web.events
        await http.post("/job/", json={"id": "x" * 200, "queue": "nobody"})
        job = ctl.desk.book.get("x" * 200)
        assert job is not None
        host, port = ctl.web.address()
        stuck = socket.socket()
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stuck.connect((host, port))
        stuck.sendall(b"GET /events/ HTTP/1.1\r\nHost: x\r\n\r\n")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(good.run, http)
            await _listening(ctl, 2)
            sent = 0
            while len(hub.subscribers) == 2:  # its socket fills, then its buffer or time
                assert sent < 200_000, "the client that reads nothing was never dropped"
                for _ in range(20):
                    hub.job_changed(job)
                sent += 20
                await wait_until(lambda: len(good.events) == sent)  # noqa: B023
            assert hub.dropped == (1 if why == "behind" else 0)
            hub.job_changed(job)
            await wait_until(lambda: len(good.events) == sent + 1)
            # the dropped client's connection is closed by the controller
            stuck.setblocking(False)

            def closed() -> bool:
                try:
                    while stuck.recv(65536):
                        pass
                except BlockingIOError:
                    return False
                except OSError:
                    return True
                return True

            await wait_until(closed)
            nursery.cancel_scope.cancel()
        stuck.close()
        ids = good.ids()
        assert ids == list(range(ids[0], ids[0] + len(ids)))


async def test_a_client_that_reads_nothing_does_not_hold_up_the_stop(sockdir, monkeypatch):
    """The controller stops while a send to a client that reads nothing is stuck: the
    connection is closed after a short grace, and the stop goes on."""
    monkeypatch.setattr(events_module, "BUFFER_SIZE", 10**7)
    stuck = socket.socket()
    with trio.fail_after(20):
        async with http_controller(sockdir, workers=0) as ctl, client(ctl.url) as http:
            hub = ctl.web.events
            await http.post("/job/", json={"id": "x" * 200, "queue": "nobody"})
            job = ctl.desk.book.get("x" * 200)
            assert job is not None
            stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            stuck.connect(ctl.web.address())
            stuck.sendall(b"GET /events/ HTTP/1.1\r\nHost: x\r\n\r\n")
            await _listening(ctl, 1)
            (sub,) = hub.subscribers
            while len(sub.buffer) < 1000:  # its sender is stuck: events wait for it
                for _ in range(100):
                    hub.job_changed(job)
                await trio.lowlevel.checkpoint()
    stuck.close()


async def test_the_access_rules_hold(sockdir, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("secret\n")
    async with http_controller(sockdir, workers=0, http_token_file=tokens) as ctl:
        async with client(ctl.url) as http:
            resp = await http.get("/events/")
            assert resp.status_code == 401
            resp = await http.get("/events/", headers={"Authorization": "Bearer wrong"})
            assert resp.status_code == 401
        listener = Listener()
        bearer = {"Authorization": "Bearer secret"}
        async with client(ctl.url, headers=bearer) as http, trio.open_nursery() as nursery:
            nursery.start_soon(listener.run, http)
            await _listening(ctl, 1)
            await http.post("/job/", json={"id": "t"})
            await wait_until(lambda: len(listener.events) == 1)
            nursery.cancel_scope.cancel()
    elsewhere = [ipaddress.ip_network("10.0.0.0/8")]
    async with (
        http_controller(sockdir, workers=0, allowed_clients=elsewhere) as ctl,
        client(ctl.url) as http,
    ):
        assert (await http.get("/events/")).status_code == 403


async def test_a_listener_counts_toward_max_connections(sockdir):
    listener = Listener()
    async with (
        http_controller(sockdir, workers=0, max_connections=1) as ctl,
        client(ctl.url) as http,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(listener.run, http)
        await _listening(ctl, 1)
        async with client(ctl.url) as other:
            try:
                await other.get("/health/")
                raise AssertionError("a second connection was served")
            except httpx.TransportError:  # accepted and closed at once, unanswered
                pass
        assert ctl.web.connections.refused == 1
        nursery.cancel_scope.cancel()


# ---------------------------------------------------------------- jobctl watch, live


def _read_lines(proc: subprocess.Popen[bytes], until: str, timeout: float = 30) -> list[str]:
    """What `proc` printed, line by line, until a line holds `until`."""
    lines: list[str] = []
    assert proc.stdout is not None
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    pending = b""
    deadline = time.monotonic() + timeout
    while not any(until in line for line in lines):
        assert time.monotonic() < deadline, lines
        if selector.select(deadline - time.monotonic()):
            chunk = os.read(proc.stdout.fileno(), 65536)
            assert chunk, f"jobctl watch ended: {lines}"
            pending += chunk
            *done, pending = pending.split(b"\n")
            lines += [line.decode() for line in done]
    return lines


def _watching(proc: subprocess.Popen[bytes], lib: Client) -> None:
    """Wait until `jobctl watch` is connected: a job made now shows (a watch that is not
    yet connected would not see it), one probe every 2 s."""
    for probe in range(10):
        lib.submit(b"p", id=f"probe-{probe}", queue="nobody")
        try:
            _read_lines(proc, f"probe-{probe}", timeout=2)
            return
        except AssertionError:
            assert proc.poll() is None, "jobctl watch ended"
    raise AssertionError("jobctl watch never showed a job")


def test_jobctl_watch_prints_a_jobs_states_and_exits_0_on_ctrl_c(tmp_path: Path) -> None:
    handler = ("--", "--handler", "tests.worker_handlers:upper")
    with live_controller(tmp_path, "--workers", "1", *handler) as ctl:
        cmd = [sys.executable, "-m", "controller.client.jobctl", "--url", ctl.url, "watch"]
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
            try:
                with Client(ctl.url) as lib:
                    _watching(proc, lib)
                    lib.submit(b"hello", id="watched")
                    lines = _read_lines(proc, "watched  finished")
            finally:
                proc.send_signal(signal.SIGINT)
                status = proc.wait(timeout=10)
            assert proc.stderr is not None
            errors = proc.stderr.read()
    assert status == 0 and errors == b""
    mine = [line.split() for line in lines if "  watched  " in line]
    assert [fields[3] for fields in mine] == ["requested", "working", "finished"]
    date, clock, job_id, _, queue, progress = mine[-1]
    assert (job_id, queue, progress) == ("watched", "default", "-")
    assert len(date) == 10 and len(clock) == 8


async def test_jobctl_watch_resumes_after_the_last_event_when_its_connection_drops(sockdir):
    """The controller drops the watch's connection and makes a job at once (before it can
    connect again): the watch says so on stderr, connects again with its last event's id,
    and prints that job's events too; a bad queue name is a usage error."""
    async with http_controller(sockdir, workers=0) as ctl, client(ctl.url) as http:
        hub = ctl.web.events
        cmd = [sys.executable, "-m", "controller.client.jobctl", "--url", ctl.url, "watch"]
        proc = await trio.lowlevel.open_process(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        printed = bytearray()

        async def read() -> None:
            assert proc.stdout is not None
            while chunk := await proc.stdout.receive_some():
                printed.extend(chunk)

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read)
                await _listening(ctl, 1)
                await http.post("/job/", json={"id": "before-drop"})
                await wait_until(lambda: b"before-drop" in printed)
                for sub in list(hub.subscribers):
                    hub.drop(sub)
                await http.post("/job/", json={"id": "in-the-gap"})
                assert not hub.subscribers  # made before the watch came back (it waits 0.5 s)
                await wait_until(lambda: b"in-the-gap" in printed, timeout=20)
                assert proc.poll() is None
                proc.send_signal(signal.SIGINT)
                assert await proc.wait() == 0
            assert proc.stderr is not None
            errors = await proc.stderr.receive_some()
        finally:
            if proc.poll() is None:
                proc.kill()
            await proc.wait()
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    await pipe.aclose()
        assert b"connecting again" in errors and b"missed" not in errors
        assert [line.split()[3] for line in printed.decode().splitlines()] == [
            "pending",
            "pending",
        ]
        bad = await trio.run_process(
            [*cmd, "--queue", "Bad Name"], capture_stdout=True, capture_stderr=True, check=False
        )
        assert bad.returncode == 2 and b"400" in bad.stderr

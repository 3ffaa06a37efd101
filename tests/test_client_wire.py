"""What the client library sends for job options and retries, scheme by scheme, against
scripted peers: the `POST /job/` body, the `add_task` datagram, the Redis entry (a real
redis-server); options refused before anything is sent, with the controller's own messages;
and `scheduled` read as a live state while waiting for a result."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import redis
import trio

from controller import datagram as dg
from controller.client import AsyncClient, Client, ControllerError
from controller.client.jobfields import option_fields
from controller.doors.redis import codec
from controller.options import DEFAULT, BadOption, parse
from tests.helpers import REDIS_SERVER, RedisServer, redis_server

JOB = {"id": "J1", "state": "scheduled", "queue": "gpu"}


# ---------------------------------------------------------------- a scripted HTTP server


class HttpScript:
    """An HTTP server on a free port: answers its requests, in order, with `answers`
    ((status, JSON body)), one connection at a time; records (method, path, body)."""

    def __init__(self, answers: list[tuple[int, Any]]) -> None:
        self.answers = list(answers)
        self.requests: list[tuple[str, str, Any]] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn, contextlib.suppress(OSError):
                while self._answer(conn):
                    pass

    def _answer(self, conn: socket.socket) -> bool:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return False
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        length = 0
        for line in lines[1:]:
            if line.lower().startswith("content-length:"):
                length = int(line.split(":")[1])
        while len(body) < length:
            body += conn.recv(65536)
        method, path, _ = lines[0].split(" ")
        self.requests.append((method, path, json.loads(body) if body else None))
        status, answer = self.answers.pop(0)
        out = json.dumps(answer).encode()
        reason = {200: "OK", 201: "Created", 404: "Not Found", 409: "Conflict"}[status]
        conn.sendall(
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(out)}\r\n\r\n".encode()
            + out
        )
        return True

    def close(self) -> None:
        self.sock.close()


@contextlib.contextmanager
def http_script(*answers: tuple[int, Any]) -> Iterator[HttpScript]:
    server = HttpScript(list(answers))
    try:
        yield server
    finally:
        server.close()


ALL_OPTIONS: dict[str, Any] = {
    "queue": "gpu",
    "priority": 7,
    "requires": ("cuda", "ssd"),
    "delay": 2.5,
    "max_retries": 4,
    "retry_delay": 1,
    "timeout": 30,
    "placement_timeout": 0.5,
    "owner": "alice@example",
}
ALL_JSON: dict[str, Any] = {**ALL_OPTIONS, "requires": ["cuda", "ssd"]}


def test_http_submit_sends_the_options_given_as_json_body_fields():
    with http_script((201, JOB), (201, JOB)) as server, Client(server.url) as client:
        job = client.submit(b"in", name="n", id="J1", **ALL_OPTIONS)
        assert job.info["queue"] == "gpu"
        client.submit("plain")
    (method, path, body), (_, _, plain) = server.requests
    assert (method, path) == ("POST", "/job/")
    assert body == {"payload": "in", "name": "n", "id": "J1", **ALL_JSON}
    assert plain == {"payload": "plain"}  # options left None are not sent


def test_run_at_travels_as_rfc3339_text_in_utc():
    moment = datetime(2030, 1, 2, 3, 4, 5, 250000, tzinfo=timezone(timedelta(hours=2)))
    with http_script((201, JOB)) as server, Client(server.url) as client:
        client.submit(b"", run_at=moment)
    assert server.requests[0][2]["run_at"] == "2030-01-02T01:04:05.250000Z"


def test_retry_posts_to_the_jobs_retry_path_and_a_conflict_is_a_409_controller_error():
    conflict = {"code": 409, "message": "job J1 is working: only failed or canceled"}
    with (
        http_script((200, {"id": "J/1", "state": "pending"}), (409, conflict)) as server,
        Client(server.url) as client,
    ):
        assert client.retry("J/1").state == "pending"
        with pytest.raises(ControllerError) as info:
            client.retry("J1")
    assert info.value.status == 409
    assert "only failed or canceled" in info.value.message
    assert [r[:2] for r in server.requests] == [
        ("POST", "/job/J%2F1/retry/"),
        ("POST", "/job/J1/retry/"),
    ]


def test_async_submit_and_retry_send_the_same():
    answers = ((201, JOB), (200, {"id": "J1", "state": "pending"}), (404, {"message": "no"}))

    async def main(url: str) -> None:
        async with AsyncClient(url) as client:
            await client.submit(b"in", **ALL_OPTIONS)
            assert (await client.retry("J1")).state == "pending"
            with pytest.raises(KeyError):
                await client.retry("gone")

    with http_script(*answers) as server:
        trio.run(main, server.url)
    assert server.requests[0][2] == {"payload": "in", **ALL_JSON}
    assert server.requests[1][:2] == ("POST", "/job/J1/retry/")


def test_a_scheduled_job_is_waited_for_like_any_live_one():
    waiting = {"id": "J1", "state": "scheduled"}
    done = {"id": "J1", "state": "finished", "result": "out"}
    with (
        http_script((201, waiting), (200, waiting), (200, done)) as server,
        Client(server.url) as client,
    ):
        job = client.submit(b"in", delay=60)
        assert job.state == "scheduled"
        assert job.result(timeout=30) == b"out"
    assert [r[1].split("?")[0] for r in server.requests] == ["/job/", "/job/J1/", "/job/J1/"]


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"priority": 101}, {"priority": 101}),
        ({"priority": 1.5}, {"priority": 1.5}),
        ({"queue": "Bad Queue"}, {"queue": "Bad Queue"}),
        ({"requires": ["ok", ""]}, {"requires": ["ok", ""]}),
        ({"requires": "gpu"}, {"requires": "gpu"}),
        ({"delay": -1}, {"delay": -1}),
        ({"timeout": float("nan")}, {"timeout": float("nan")}),
        ({"max_retries": 101}, {"max_retries": 101}),
        ({"retry_delay": 4000}, {"retry_delay": 4000}),
        ({"owner": "a b"}, {"owner": "a b"}),
    ],
)
def test_a_bad_option_is_the_controllers_message_as_a_value_error(options, field):
    with pytest.raises(BadOption) as controller_says:
        parse(field, DEFAULT, 0.0)
    with pytest.raises(ValueError) as info:
        option_fields(**options)
    assert str(info.value) == str(controller_says.value)


def test_time_options_that_cannot_be_read_are_value_errors():
    with pytest.raises(ValueError, match="aware datetime"):
        option_fields(run_at=datetime(2030, 1, 1))  # naive on purpose
    with pytest.raises(ValueError, match="must be a datetime"):
        option_fields(run_at="2030-01-01T00:00:00Z")
    with pytest.raises(ValueError, match="delay or run_at, not both"):
        option_fields(delay=1, run_at=datetime.now(UTC))


def test_a_bad_option_sends_nothing_over_any_scheme():
    with http_script() as server, Client(server.url) as client:
        with pytest.raises(ValueError, match="priority"):
            client.submit(b"", priority=500)
        with pytest.raises(ValueError, match="a label must match"):
            client.submit(b"", requires=["GPU"])
    assert server.requests == []
    with udp_peer() as peer, Client(f"udp://127.0.0.1:{peer.port}") as client:
        with pytest.raises(ValueError, match="queue must match"):
            client.submit(b"", queue="")
        assert peer.packets == []


# ---------------------------------------------------------------- udp://


class UdpPeer:
    """A front door that acknowledges each add_task and answers it at once with success."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.packets: list[dict[str, Any]] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                data, address = self.sock.recvfrom(dg.MAX_DATAGRAM)
            except OSError:
                return
            packet = json.loads(data)
            if packet.get("method") != "add_task":
                continue
            self.packets.append(packet)
            self.sock.sendto(dg.ack(packet["transmission_id"]), address)
            task_id = packet["params"]["task_id"]
            notify = {"task_id": task_id, "status": "success", "result": "ok"}
            self.sock.sendto(dg.request("notify_task", notify), address)

    def close(self) -> None:
        self.sock.close()


@contextlib.contextmanager
def udp_peer() -> Iterator[UdpPeer]:
    peer = UdpPeer()
    try:
        yield peer
    finally:
        peer.close()


def test_udp_submit_sends_the_options_as_add_task_params():
    moment = datetime(2031, 5, 6, 7, 8, 9, tzinfo=UTC)
    with udp_peer() as peer, Client(f"udp://127.0.0.1:{peer.port}") as client:
        options = {**ALL_OPTIONS, "delay": None, "run_at": moment}
        assert client.submit(b"x", **options).result(timeout=10) == b"ok"
        assert client.submit(b"y").result(timeout=10) == b"ok"
    first, second = (packet["params"] for packet in peer.packets)
    expected = {"task_id": first["task_id"], "payload": "x", **ALL_JSON}
    del expected["delay"]  # None: not sent
    assert first == {**expected, "run_at": "2031-05-06T07:08:09.000000Z"}
    assert second == {"task_id": second["task_id"], "payload": "y"}


def test_retry_over_udp_is_a_value_error():
    with (
        udp_peer() as peer,
        Client(f"udp://127.0.0.1:{peer.port}") as client,
        pytest.raises(ValueError, match="retry need http:// or redis://"),
    ):
        client.retry("udp-x")


# ---------------------------------------------------------------- redis://

needs_redis = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed")


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed")
    server: RedisServer
    with redis_server(Path(tmp_path_factory.mktemp("wire"))) as server:
        yield server.url


@needs_redis
def test_redis_submit_writes_the_options_as_text_fields_on_the_queues_stream(redis_url):
    r = redis.Redis.from_url(redis_url)
    moment = datetime(2032, 1, 1, tzinfo=UTC)
    with Client(f"{redis_url}?stream=wire") as client:
        client.submit(b"p", id="R1", **ALL_OPTIONS)
        assert client.submit(b"q", id="R2", run_at=moment, requires=[]).state == "scheduled"
        client.submit(b"r", id="R3")
        client.submit(b"s", id="R4", queue="default")
    default: Any = r.xrange("wire")
    gpu: Any = r.xrange("wire.gpu")
    assert [fields[b"id"] for _, fields in default] == [b"R2", b"R3", b"R4"]
    assert r.hget("job:R2", "state") == b"scheduled" and r.hget("job:R3", "state") == b"pending"
    assert [fields[b"id"] for _, fields in gpu] == [b"R1"]  # its queue's stream
    entries = [gpu[0][1], *(fields for _, fields in default)]
    assert entries[0] == {
        b"payload": b"p",
        b"id": b"R1",
        b"queue": b"gpu",
        b"priority": b"7",
        b"requires": b"cuda,ssd",
        b"delay": b"2.5",
        b"max_retries": b"4",
        b"retry_delay": b"1",
        b"timeout": b"30",
        b"placement_timeout": b"0.5",
        b"owner": b"alice@example",
    }
    assert entries[1] == {
        b"payload": b"q",
        b"id": b"R2",
        b"requires": b"",
        b"run_at": b"2032-01-01T00:00:00.000000Z",
    }
    assert entries[2] == {b"payload": b"r", b"id": b"R3"}
    for fields in entries:  # and the controller reads each as the client meant
        text = {k.decode(): v.decode() for k, v in fields.items()}
        parse(text, DEFAULT, time.time(), text=True)


@needs_redis
def test_redis_retry_makes_the_hash_pending_and_announces_the_id(redis_url):
    r = redis.Redis.from_url(redis_url)
    r.hset("job:F1", mapping={"state": "failed", "error": "boom", "result": b""})
    r.pexpire("job:F1", 60_000)
    r.hset("job:C1", mapping={"state": "canceled", "error": "canceled by a user"})
    r.hset("job:W1", mapping={"state": "working"})
    listener = r.pubsub(ignore_subscribe_messages=True)
    listener.subscribe(codec.retry_channel("retry"))
    try:
        with Client(f"{redis_url}?stream=retry") as client:
            job = client.retry("F1")
            assert job.state == "pending"
            assert client.retry("C1").state == "pending"
            with pytest.raises(ControllerError) as info:
                client.retry("W1")
            assert info.value.status == 409
            assert "working" in info.value.message
            with pytest.raises(KeyError):
                client.retry("nobody")
        heard: list[bytes] = []
        deadline = time.monotonic() + 10
        while len(heard) < 2 and time.monotonic() < deadline:
            # None also for the subscription's own confirmation, which is skipped
            message = listener.get_message(timeout=1)
            if message is not None:
                heard.append(message["data"])
    finally:
        listener.close()
    assert heard == [b"F1", b"C1"]
    assert r.hgetall("job:F1").keys() == {b"state", b"updated_at"}
    assert r.pttl("job:F1") == -1  # a pending job's hash does not expire
    assert r.hget("job:W1", "state") == b"working"


@needs_redis
def test_redis_retry_with_no_controller_listening_changes_nothing(redis_url):
    r = redis.Redis.from_url(redis_url)
    r.hset("job:F2", mapping={"state": "failed", "error": "boom"})

    async def main() -> None:
        async with AsyncClient(f"{redis_url}?stream=nobody-listens") as client:
            with pytest.raises(ControllerError) as info:
                await client.retry("F2")
            assert info.value.status == "redis"
            assert "no controller listens" in info.value.message

    trio.run(main)
    assert r.hgetall("job:F2") == {b"state": b"failed", b"error": b"boom"}

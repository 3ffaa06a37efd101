"""udp-client's engine against a scripted controller on a real UDP socket: lost datagrams,
a notification before its acknowledgement, a lost notification found with get_task, a large
result read in chunks, refusals, timeouts, repeats, and run_many's window and errors."""

from __future__ import annotations

import base64
import contextlib
import functools
import socket as stdsocket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from controller import datagram as dg
from controller.client import udp_engine
from controller.client.exit_status import EXIT_FAILED, EXIT_TIMEOUT
from controller.client.udp_engine import Outcome, UdpSession
from tests.helpers import wait_until

Packet = dict[str, Any]
Address = tuple[str, int]


class Script:
    """The controller's side: `on(packet, addr)` decides what to answer (with `send`)."""

    def __init__(self, on: Callable[[Script, Packet, Address], None]) -> None:
        self.on = on
        self.sock = stdsocket.socket(stdsocket.AF_INET, stdsocket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.setblocking(False)
        self.received: list[Packet] = []
        self._txid = 1000

    def send(self, packet: bytes, addr: Address) -> None:
        self.sock.sendto(packet, addr)

    def notify(self, addr: Address, task_id: int, **params: Any) -> int:
        self._txid += 1
        params = {"task_id": task_id, "status": "success", "result": "r", **params}
        params = {key: value for key, value in params.items() if value is not None}
        self.send(dg.request("notify_task", params, self._txid), addr)
        return self._txid

    def of(self, method: str) -> list[Packet]:
        return [p for p in self.received if p.get("method") == method]

    async def serve(self) -> None:
        while True:
            try:
                data, addr = self.sock.recvfrom(65536)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self.sock)
                continue
            packet = dg.decode(data)
            assert packet is not None
            self.received.append(packet)
            self.on(self, packet, addr)


def acks(script: Script, packet: Packet, addr: Address, **params: Any) -> None:
    script.send(dg.ack(packet["transmission_id"], params or None), addr)


@asynccontextmanager
async def session(
    on: Callable[[Script, Packet, Address], None], timeout: float = 10.0
) -> AsyncIterator[tuple[UdpSession, Script]]:
    script = Script(on)
    sock = stdsocket.socket(stdsocket.AF_INET, stdsocket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    client = UdpSession(sock, script.sock.getsockname(), timeout)
    with sock, script.sock, trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(script.serve)
            nursery.start_soon(client.receive)
            yield client, script
            nursery.cancel_scope.cancel()


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    """Repeats and polls in tens of milliseconds instead of tenths of seconds."""
    monkeypatch.setattr(dg, "RESEND_FIRST", 0.05)
    monkeypatch.setattr(udp_engine, "POLL_AFTER", 0.05)


def ack_and_notify(script: Script, packet: Packet, addr: Address) -> None:
    if packet.get("method") == "add_task":
        acks(script, packet, addr)
        script.notify(addr, packet["params"]["task_id"], result=packet["params"].get("payload"))


async def test_a_lost_add_task_is_sent_again_with_the_same_transmission_id(quick) -> None:
    def on(script: Script, packet: Packet, addr: Address) -> None:
        if packet.get("method") == "add_task" and len(script.of("add_task")) == 1:
            return  # the first copy is lost
        ack_and_notify(script, packet, addr)

    async with session(on) as (client, script):
        outcome = await client.run_task(7, {"payload": "hi"})
        assert outcome == Outcome(7, "success", b"hi", latency=outcome.latency)
        assert outcome.latency > 0
        first, second = script.of("add_task")
        assert first == second  # the same request, the same transmission_id
        # the notification was acknowledged with its own transmission id
        await wait_until(lambda: len(script.of("ack")) == 1)
        assert [p["transmission_id"] for p in script.of("ack")] == [1001]
        assert client._requests == {} and client._jobs == {}


async def test_a_notification_before_the_acknowledgement_ends_the_job_and_its_repeats(
    quick,
) -> None:
    def on(script: Script, packet: Packet, addr: Address) -> None:
        if packet.get("method") == "add_task" and len(script.of("add_task")) == 1:
            script.notify(addr, 3)  # the acknowledgement itself is lost

    async with session(on) as (client, _script):
        outcome = await client.run_task(3, {})
        assert outcome.status == "success" and outcome.result == b"r"
        assert client._requests == {}  # add_task is not sent again


async def test_a_lost_notification_is_found_with_get_task_and_a_large_result_read_in_chunks(
    quick,
) -> None:
    big = bytes(range(256)) * 300  # 76,800 bytes: three chunks

    def on(script: Script, packet: Packet, addr: Address) -> None:
        method, params = packet.get("method"), packet.get("params", {})
        if method == "add_task":
            acks(script, packet, addr)  # and the notification never comes
        elif method == "get_task":
            # running at the first question, finished at the second
            done = len(script.of("get_task")) > 1
            status = {"status": "success", "result_size": len(big)} if done else {}
            acks(script, packet, addr, task_id=5, **(status or {"status": "running"}))
        elif method == "get_result":
            if len(script.of("get_result")) == 1:  # the notification comes after all, now
                script.notify(addr, 5, result=None, result_size=len(big))
            offset, length = params["offset"], params["length"]
            chunk = base64.b64encode(big[offset : offset + length]).decode()
            acks(script, packet, addr, task_id=5, offset=offset, result_b64=chunk)

    async with session(on) as (client, script):
        outcome = await client.run_task(5, {})
        assert outcome.status == "success" and outcome.result == big
        assert len(script.of("get_task")) == 2 and len(script.of("get_result")) == 3
        # the notification that came while the result was read was a repeat, and so is one
        # now: both acknowledged all the same
        assert client.duplicates == 1
        script.notify(client.sock.getsockname(), 5)
        await wait_until(lambda: client.duplicates == 2)
        await wait_until(lambda: len(script.of("ack")) == 2)


async def test_refusals_and_silences_end_each_job_with_a_reason(quick) -> None:
    def on(script: Script, packet: Packet, addr: Address) -> None:
        task_id = packet.get("params", {}).get("task_id")
        if packet.get("method") != "add_task":
            return  # get_task goes unanswered
        if task_id == 1:
            error = {"code": "bad_task_id", "message": "task_id must be >= 1"}
            reply = dg.error_ack(packet["transmission_id"], error["code"], error["message"], 999)
            assert reply is not None
            script.send(reply, addr)
        elif task_id == 2:
            acks(script, packet, addr)  # and then nothing at all
        # task 3: silence

    async with session(on, timeout=0.3) as (client, _script):
        outcomes: dict[int, Outcome] = {}
        await client.run_many([1, 2, 3], {}, 3, lambda o: outcomes.__setitem__(o.task_id, o))
        assert outcomes[1].status == "refused"
        assert outcomes[1].error == "bad_task_id: task_id must be >= 1"
        assert outcomes[1].exit_code == EXIT_FAILED
        assert (outcomes[2].status, outcomes[2].error) == ("timeout", "no notification in time")
        assert (outcomes[3].status, outcomes[3].error) == (
            "timeout",
            "add_task was not acknowledged",
        )
        assert outcomes[3].exit_code == EXIT_TIMEOUT
        assert client._requests == {} and client._jobs == {}


async def test_every_copy_of_a_notification_is_acknowledged_and_reported_once(quick) -> None:
    def on(script: Script, packet: Packet, addr: Address) -> None:
        if packet.get("method") == "add_task":
            acks(script, packet, addr)
            for _ in range(3):
                script.notify(addr, 9, status="error", error="boom")

    async with session(on) as (client, script):
        reported: list[Outcome] = []
        await client.run_many([9], {}, 1, reported.append)
        assert [(o.status, o.error) for o in reported] == [("error", "boom")]
        await wait_until(lambda: client.duplicates == 2 and len(script.of("ack")) == 3)
        assert len({p["transmission_id"] for p in script.of("ack")}) == 3


async def test_run_many_keeps_the_window_full_and_no_fuller(quick) -> None:
    notified: set[int] = set()
    most = 0

    def pending(script: Script) -> list[int]:
        sent = [p["params"]["task_id"] for p in script.of("add_task")]
        return [task_id for task_id in sent if task_id not in notified]

    def holds(script: Script, count: int) -> bool:
        return len(pending(script)) == count

    def on(script: Script, packet: Packet, addr: Address) -> None:
        nonlocal most
        if packet.get("method") == "add_task":
            acks(script, packet, addr)
            most = max(most, len(pending(script)))

    async with session(on) as (client, script):
        reported: list[int] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                client.run_many, range(1, 21), {}, 4, lambda o: reported.append(o.task_id)
            )
            for done in range(20):
                await wait_until(functools.partial(holds, script, min(4, 20 - done)))
                oldest = pending(script)[0]
                notified.add(oldest)
                script.notify(client.sock.getsockname(), oldest)
        assert reported == list(range(1, 21)) and most == 4
        assert len(script.of("add_task")) == 20


async def test_an_error_in_on_outcome_stops_the_batch_and_is_raised(quick) -> None:
    async with session(ack_and_notify) as (client, script):

        def fussy(outcome: Outcome) -> None:
            raise RuntimeError(f"cannot take {outcome.task_id}")

        with pytest.raises(RuntimeError, match="cannot take"):
            await client.run_many(range(1, 100), {"payload": "p"}, 2, fussy)
        assert client._jobs == {} and client._requests == {}
        assert len(script.of("add_task")) == 2  # nothing more was sent


async def test_a_task_id_already_running_in_the_session_is_refused_and_not_sent(quick) -> None:
    def on(script: Script, packet: Packet, addr: Address) -> None:
        if packet.get("method") == "add_task":
            acks(script, packet, addr)  # notified only when the test says so

    async with session(on) as (client, script):
        async with trio.open_nursery() as nursery:
            first: list[Outcome] = []

            async def run_first() -> None:
                first.append(await client.run_task(4, {}))

            nursery.start_soon(run_first)
            await wait_until(lambda: len(script.of("add_task")) == 1)
            again = await client.run_task(4, {})
            assert again.status == "refused" and "already running" in again.error
            script.notify(client.sock.getsockname(), 4)
        assert first[0].status == "success" and len(script.of("add_task")) == 1


async def test_cancelling_a_caller_forgets_its_job(quick) -> None:
    def on(script: Script, packet: Packet, addr: Address) -> None:
        if packet.get("method") == "add_task":
            acks(script, packet, addr)

    async with session(on) as (client, script):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.run_task, 6, {})
            # acknowledged, waiting for its notification: then its caller goes away
            await wait_until(lambda: 6 in client._jobs and client._jobs[6].request is None)
            nursery.cancel_scope.cancel()
        assert client._jobs == {} and client._requests == {}
        # a notification for it now is a repeat
        script.notify(client.sock.getsockname(), 6)
        await wait_until(lambda: client.duplicates == 1)


# ---------------------------------------------------------------- the one resend rule


def test_the_resend_rule_doubles_from_its_first_wait_to_its_cap_and_ends() -> None:
    waits = [dg.resend_after(sent) for sent in range(1, dg.RESEND_COUNT + 2)]
    assert waits[:5] == [0.2, 0.4, 0.8, 1.6, 2.0]
    assert set(waits[4:-1]) == {dg.RESEND_MAX} and waits[-1] is None


@pytest.fixture
def few_repeats(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dg, "RESEND_FIRST", 0.01)
    monkeypatch.setattr(dg, "RESEND_MAX", 0.02)
    monkeypatch.setattr(dg, "RESEND_COUNT", 3)


async def test_udp_client_sends_a_request_at_most_one_plus_the_rules_count(few_repeats) -> None:
    async with session(lambda *_: None, timeout=1.0) as (client, script):
        outcome = await client.run_task(9, {})
        assert outcome.status == "timeout" and "not acknowledged" in outcome.error
        assert len(script.of("add_task")) == 1 + 3


def test_the_librarys_udp_client_follows_the_same_rule(few_repeats) -> None:
    from controller.client import Client

    silent = stdsocket.socket(stdsocket.AF_INET, stdsocket.SOCK_DGRAM)
    silent.bind(("127.0.0.1", 0))
    silent.settimeout(0.5)
    port = silent.getsockname()[1]
    with silent, Client(f"udp://127.0.0.1:{port}", timeout=1.0) as client:
        with pytest.raises(TimeoutError, match="add_task was not acknowledged"):
            client.submit(b"x")
        copies = []
        with contextlib.suppress(TimeoutError):
            while True:
                copies.append(dg.decode(silent.recv(65536)))
    assert [packet["method"] for packet in copies] == ["add_task"] * (1 + 3)  # type: ignore[index]


async def test_a_calculators_unacknowledged_report_follows_the_rule_then_the_heartbeats(
    few_repeats,
) -> None:
    from worker.calculator import Calculator
    from worker.runner import build_runner

    controller = stdsocket.socket(stdsocket.AF_INET, stdsocket.SOCK_DGRAM)
    controller.bind(("127.0.0.1", 0))
    controller.setblocking(False)
    calculator = Calculator(
        controller.getsockname(), build_runner(None, None, 1000), pulse_period=0.1
    )
    seen: list[str] = []
    with controller, trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(calculator.run)
            address = None
            while len([m for m in seen if m == "completed_task"]) < 3 + 1 + 3:
                await trio.lowlevel.wait_readable(controller)
                data, address = controller.recvfrom(65536)
                packet = dg.decode(data)
                assert packet is not None
                seen.append(str(packet.get("method")))
                if seen == ["heartbeat"]:  # give it a job; acknowledge nothing it sends
                    controller.sendto(dg.request("perform_task", {"task_id": 5}, 77), address)
            nursery.cancel_scope.cancel()
    reports = [i for i, method in enumerate(seen) if method == "completed_task"]
    # At most 1 + 3 sent on their own (sent, then the rule's 3 repeats); every later one
    # goes right after a heartbeat.
    alone = [i for i in reports if seen[i - 1] != "heartbeat"]
    assert 1 <= len(alone) <= 4 and len(reports) >= 7, seen

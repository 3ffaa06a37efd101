"""The pure front door with raw datagrams: every rule of the UDP door (docs/protocol.md)."""

from __future__ import annotations

import base64
import ipaddress
import json
import logging

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from controller import datagram as dg
from controller import transmissions
from controller.core.model import Task, TaskState
from controller.datagram import MAX_INLINE_RESULT
from controller.doors.udp.actions import Delivered, Send, Submit
from controller.doors.udp.codec import FrontDoor
from controller.job_ids import DoorName
from controller.job_states import JobState
from controller.jobs import MAX_FORGET_PER_CALL, Job, JobBook
from controller.transmissions import NOTIFY_FIRST_INTERVAL, TRANSMISSION_MEMORY

CLIENT = ("127.0.0.1", 40000)
PAD = b"x" * 40  # makes a request big enough for its error reply to fit under it
OTHER = ("127.0.0.2", 40001)

_FINAL = {
    TaskState.SUCCESS: JobState.FINISHED,
    TaskState.ERROR: JobState.FAILED,
    TaskState.FAILED_POST: JobState.FAILED,
}


class Door:
    """The pure door with a pure stand-in for its shell and the job desk: Submit and Delivered
    are carried out on a real job book at once; the sends are returned."""

    def __init__(self, result_retention: float = 3600.0, **kwargs) -> None:
        self.book = JobBook(result_retention=result_retention)
        self.tasks: dict[int, Task] = {}
        self.submitted: list[tuple[int, bytes, object]] = []
        kwargs.setdefault("allowed_clients", [ipaddress.ip_network("127.0.0.0/8")])
        kwargs.setdefault("status_report", lambda: {"tasks": {"queued": len(self.tasks)}})
        self.door = FrontDoor(self.book, **kwargs)
        self.stats = self.door.stats

    def _apply(self, actions, now) -> list[Send]:
        for action in actions:
            if isinstance(action, Submit):
                ref = len(self.submitted) + 1
                self.submitted.append((action.task_id, action.payload, action.addr))
                task = self.tasks[ref] = Task(ref, action.task_id, action.payload, action.job_id)
                job = Job(action.job_id, ref, action.task_id, DoorName.UDP, action.addr, task=task)
                self.book.add(job)
            elif isinstance(action, Delivered):
                self.book.retain(self.book.get(action.job_id), now)
        return [action for action in actions if isinstance(action, Send)]

    def datagram(self, data, addr, now):
        return self._apply(self.door.datagram(data, addr, now), now)

    def expire(self, now):
        for job in self.book.expire(now):
            self.door.forget(job)
        return self._apply(self.door.expire(now), now)

    def next_deadline(self):
        return min(self.door.next_deadline(), self.book.next_deadline())

    def finish(self, ref, state, result, error, now):
        job = self.book.finish(
            self.tasks[ref].job,
            _FINAL[state],
            now,
            result=result,
            error=error,
            failed_post=state is TaskState.FAILED_POST,
        )
        return self._apply(self.door.job_finished(job, now), now)

    def known(self, addr, task_id) -> bool:
        return self.book.get(f"udp-{addr[0]}-{addr[1]}-{task_id}") is not None


def door(**kwargs) -> tuple[Door, Door]:
    fd = Door(**kwargs)
    return fd, fd


def packet(method="add_task", txid=1, ptype=1, **params) -> bytes:
    return json.dumps(
        {"method": method, "params": params, "packet_type": ptype, "transmission_id": txid}
    ).encode()


def sent(sends):
    return [(json.loads(s.data), s.addr) for s in sends]


def finish(fd, ref, state=TaskState.SUCCESS, result=b"", error="", now=0.0):
    return sent(fd.finish(ref, state, result, error, now))


def test_add_task_acknowledged_and_submitted_once():
    fd, sched = door()
    [(ack, addr)] = sent(fd.datagram(packet(task_id=5, payload="hi"), CLIENT, 0.0))
    assert ack == {"method": "ack", "packet_type": 2, "transmission_id": 1}
    assert addr == CLIENT
    assert sched.submitted == [(5, b"hi", CLIENT)]
    # every copy acknowledged, acted on once
    [(again, _)] = sent(fd.datagram(packet(task_id=5, payload="hi"), CLIENT, 0.1))
    assert again == ack and len(sched.submitted) == 1


def test_single_quoted_form_accepted():
    fd, sched = door()
    data = b"{'method': 'add_task', 'params': {'task_id': 5}, 'packet_type': 1, 'transmission_id': 1598326709621}"
    [(ack, _)] = sent(fd.datagram(data, CLIENT, 0.0))
    assert ack["transmission_id"] == 1598326709621 and "error" not in ack
    assert sched.submitted == [(5, b"", CLIENT)]


def test_payload_b64():
    fd, sched = door()
    fd.datagram(packet(task_id=1, payload_b64=base64.b64encode(b"\x00\xff").decode()), CLIENT, 0)
    assert sched.submitted[0][1] == b"\x00\xff"


def test_duplicate_task_while_live_is_only_acknowledged():
    fd, sched = door()
    fd.datagram(packet(txid=1, task_id=5), CLIENT, 0.0)
    [(ack, _)] = sent(fd.datagram(packet(txid=2, task_id=5), CLIENT, 0.0))
    assert ack["transmission_id"] == 2 and len(sched.submitted) == 1
    fd.datagram(packet(txid=3, task_id=5), OTHER, 0.0)  # another client's task 5 is its own
    assert len(sched.submitted) == 2


def test_duplicate_of_finished_task_gets_stored_outcome_again():
    fd, sched = door()
    fd.datagram(packet(txid=1, task_id=5), CLIENT, 0.0)
    finish(fd, 1, result=b"r")
    out = sent(fd.datagram(packet(txid=2, task_id=5), CLIENT, 1.0))
    assert [p["method"] for p, _ in out] == ["ack", "notify_task"]
    assert out[1][0]["params"] == {"task_id": 5, "status": "success", "result": "r"}
    assert len(sched.submitted) == 1


def test_success_notified_type_1_and_repeated_with_doubling_until_acked():
    fd, _ = door(notify_retries=3)
    fd.datagram(packet(task_id=5), CLIENT, 0.0)
    [(note, addr)] = finish(fd, 1, result=b"out", now=10.0)
    assert addr == CLIENT and note["packet_type"] == 1
    assert note["params"] == {"task_id": 5, "status": "success", "result": "out"}
    txid = note["transmission_id"]
    t = 10.0
    for interval in (NOTIFY_FIRST_INTERVAL, 1.0, 2.0):
        t += interval
        assert fd.expire(t - 0.001) == []
        [(again, _)] = sent(fd.expire(t))
        assert again == note
    assert fd.expire(t + 100) == []  # notify_retries used up
    assert fd.stats.notify_repeats == 3
    assert txid


def test_ack_stops_repeats():
    fd, _ = door()
    fd.datagram(packet(task_id=5), CLIENT, 0.0)
    [(note, _)] = finish(fd, 1, result=b"out")
    ack = {"method": "ack", "packet_type": 2, "transmission_id": note["transmission_id"]}
    assert fd.datagram(json.dumps(ack).encode(), CLIENT, 0.1) == []
    assert fd.expire(100.0) == []


def test_ack_from_another_address_is_ignored():
    fd, _ = door()
    fd.datagram(packet(task_id=5), CLIENT, 0.0)
    [(note, _)] = finish(fd, 1, result=b"out")
    ack = {"method": "ack", "packet_type": 2, "transmission_id": note["transmission_id"]}
    fd.datagram(json.dumps(ack).encode(), OTHER, 0.1)
    assert len(fd.expire(NOTIFY_FIRST_INTERVAL)) == 1


@pytest.mark.parametrize("state", [TaskState.ERROR, TaskState.FAILED_POST])
def test_error_and_failed_post_sent_type_0_with_message(state):
    fd, _ = door()
    fd.datagram(packet(task_id=5), CLIENT, 0.0)
    [(note, _)] = finish(fd, 1, state=state, error="why")
    assert note == {
        "method": "notify_task",
        "packet_type": 0,
        "params": {"task_id": 5, "status": state.value, "error": "why"},
    }
    assert fd.expire(100.0) == []


def test_large_result_announced_and_read_in_chunks():
    fd, _ = door()
    fd.datagram(packet(task_id=5), CLIENT, 0.0)
    result = bytes(range(256)) * 400  # 102,400 bytes
    [(note, _)] = finish(fd, 1, result=result)
    assert note["params"] == {"task_id": 5, "status": "success", "result_size": len(result)}
    got = b""
    txid = 10
    while len(got) < len(result):
        txid += 1
        [(ack, _)] = sent(
            fd.datagram(
                packet("get_result", txid, task_id=5, offset=len(got), length=40000), CLIENT, 1
            )
        )
        chunk = base64.b64decode(ack["params"]["result_b64"])
        assert 0 < len(chunk) <= 32768
        got += chunk
    assert got == result


def test_binary_result_goes_base64():
    fd, _ = door()
    fd.datagram(packet(task_id=5), CLIENT, 0.0)
    [(note, _)] = finish(fd, 1, result=b"\xff\xfe")
    assert base64.b64decode(note["params"]["result_b64"]) == b"\xff\xfe"
    assert len(json.dumps(note)) < MAX_INLINE_RESULT


def test_get_task_statuses_and_only_to_submitter():
    fd, sched = door()
    fd.datagram(packet(txid=1, task_id=5), CLIENT, 0.0)

    def status(addr, txid):
        request = packet("get_task", txid, task_id=5, pad=PAD.decode())
        [(ack, _)] = sent(fd.datagram(request, addr, 0.0))
        return ack

    assert status(CLIENT, 2)["params"]["status"] == "queued"
    sched.tasks[1].state = TaskState.ASSIGNING
    assert status(CLIENT, 3)["params"]["status"] == "running"
    assert status(OTHER, 4)["error"]["code"] == "unknown_task"
    finish(fd, 1, state=TaskState.ERROR, error="bad")
    ack = status(CLIENT, 5)
    assert ack["params"] == {"task_id": 5, "status": "error", "error": "bad"}


def test_source_outside_allowed_clients_dropped_and_counted():
    fd, sched = door()
    assert fd.datagram(packet(task_id=5), ("10.1.2.3", 5), 0.0) == []
    assert fd.stats.not_allowed == 1 and sched.submitted == []


def test_ipv4_mapped_ipv6_source_is_checked_as_ipv4():
    fd, sched = door()
    fd.datagram(packet(task_id=5), ("::ffff:127.0.0.1", 5), 0.0)
    assert len(sched.submitted) == 1


def error_code(fd, data, addr=CLIENT):
    out = sent(fd.datagram(data, addr, 0.0))
    if not out:
        return None
    [(ack, _)] = out
    assert len(json.dumps(ack, separators=(",", ":"))) <= len(data), (
        "error reply outgrew the request"
    )
    return ack["error"]["code"]


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (b"this is not json", None),
        (b"[1, 2, 3]", None),
        (
            b'{"method": "add_task", "params": {"task_id": 5, "payload": "%s"}, "transmission_id": 7}'
            % PAD,
            "bad_packet_type",
        ),
        (
            b'{"method": "add_task", "params": {"task_id": 5, "payload": "%s"}, "packet_type": 9, "transmission_id": 7}'
            % PAD,
            "bad_packet_type",
        ),
        (b'{"method": "add_task", "params": {"task_id": 5}, "packet_type": 1}', None),
        (
            b'{"method": "add_task", "params": {"task_id": 5}, "packet_type": 1, "transmission_id": "x"}',
            None,
        ),
        (packet(task_id=0, pad=PAD.decode()), "bad_task_id"),
        (packet(task_id="5", pad=PAD.decode()), "bad_task_id"),
        (packet(task_id=True, pad=PAD.decode()), "bad_task_id"),
        (packet(comment="a request with no task id at all"), "bad_task_id"),
        (packet("frobnicate", task_id=5, pad=PAD.decode()), "unknown_method"),
        (packet(task_id=5, payload=7), "bad_payload"),
        (packet(task_id=5, payload_b64="***"), "bad_payload"),
        (packet(task_id=5, payload="x" * 101), "payload_too_large"),
        (b'{"method":"x","packet_type":1,"transmission_id":1}', None),  # reply would outgrow it
        (b"\xff" * 65536, None),
        (
            b'{"method": "add_task", "params": [5], "packet_type": 1, "transmission_id": 7, "pad": "%s"}'
            % PAD,
            "bad_params",
        ),
    ],
    ids=[
        "not-json",
        "not-object",
        "missing-packet-type",
        "wrong-packet-type",
        "missing-transmission-id",
        "wrong-transmission-id",
        "task-id-0",
        "task-id-string",
        "task-id-bool",
        "task-id-missing",
        "unknown-method",
        "payload-not-text",
        "payload-bad-b64",
        "payload-too-large",
        "tiny-unknown-method-withheld",
        "64k-garbage",
        "params-not-object",
    ],
)
def test_bad_input(data, code):
    fd, sched = door(max_payload=100)
    assert error_code(fd, data) == code
    assert sched.submitted == []


def test_flood_of_garbage_is_silent_logs_little_and_valid_traffic_flows(caplog):
    fd, sched = door()
    with caplog.at_level(logging.WARNING, logger="controller.frontdoor"):
        for i in range(10_000):
            assert fd.datagram(b"\x00garbage%d" % i, CLIENT, i * 0.0001) == []
    assert len(caplog.records) == 1
    assert fd.stats.unparseable == 10_000
    [(ack, _)] = sent(fd.datagram(packet(task_id=5), CLIENT, 1.0))
    assert "error" not in ack and len(sched.submitted) == 1


def test_records_kept_for_retention_after_ack_then_removed():
    fd, sched = door(result_retention=100)
    fd.datagram(packet(task_id=5), CLIENT, 0.0)
    [(note, _)] = finish(fd, 1, result=b"r", now=1.0)
    ack = {"method": "ack", "packet_type": 2, "transmission_id": note["transmission_id"]}
    fd.datagram(json.dumps(ack).encode(), CLIENT, 2.0)
    fd.expire(101.999)
    assert fd.known(CLIENT, 5)
    fd.expire(102.0)
    assert not fd.known(CLIENT, 5)
    fd.datagram(packet(txid=9, task_id=5), CLIENT, 103.0)  # now it is a new task
    assert len(sched.submitted) == 2


def test_transmission_ids_remembered_for_one_memory_and_forgotten_after_two():
    # A retention shorter than the memory: an add_task is remembered too (the book would
    # forget the job before a late copy could come).
    fd, _sched = door(result_retention=TRANSMISSION_MEMORY / 2)
    first = fd.datagram(packet(txid=1, task_id=5), CLIENT, 0.0)
    assert fd.next_deadline() == TRANSMISSION_MEMORY
    fd.expire(TRANSMISSION_MEMORY)
    # Still answered as a repeat (the same acknowledgement, nothing queued again) ...
    again = fd.datagram(packet(txid=1, task_id=5), CLIENT, TRANSMISSION_MEMORY + 1)
    # (the first may be held for its job's outcome; a copy goes at once)
    assert again == [Send(first[0].data, CLIENT)] and fd.stats.duplicates == 1
    assert fd.next_deadline() == 2 * TRANSMISSION_MEMORY
    fd.expire(2 * TRANSMISSION_MEMORY)  # ... and gone one memory later
    assert fd.next_deadline() == float("inf")
    assert fd.door.seen.get(CLIENT, 1) is None


def test_an_add_task_that_made_a_job_is_answered_by_the_book_not_remembered():
    fd, sched = door()  # result_retention 3600 s: the job outlives any transmission memory
    [first] = fd.datagram(packet(txid=1, task_id=5), CLIENT, 0.0)
    assert len(fd.door.seen) == 0 and fd.next_deadline() == float("inf")
    assert first.batched  # an answer to the job's submitter: it may leave with the next batch
    # A copy (the acknowledgement was lost) finds the job: acknowledged again, acts on nothing.
    again = fd.datagram(packet(txid=1, task_id=5), CLIENT, 3 * TRANSMISSION_MEMORY)
    assert again == [Send(first.data, CLIENT)] and len(sched.submitted) == 1
    assert fd.stats.duplicates == 1
    # Once the job ended, a copy is acknowledged and its outcome sent again (the client
    # drops a repeated notification, delivery is at-least-once and the client drops repeats).
    finish(fd, 1, result=b"r", now=1.0)
    [(ack, _), (note, _)] = sent(fd.datagram(packet(txid=1, task_id=5), CLIENT, 2.0))
    assert ack == json.loads(first.data)
    assert note["method"] == "notify_task" and note["params"]["result"] == "r"
    assert len(sched.submitted) == 1 and len(fd.door.seen) == 0
    # Requests that made no job are still remembered: a refused add_task, a get_task.
    fd.datagram(packet(txid=2, task_id=0), CLIENT, 2.0)
    fd.datagram(packet("get_task", txid=3, task_id=5), CLIENT, 2.0)
    assert len(fd.door.seen) == 2


def test_retention_forgets_in_bounded_batches():
    fd, _ = door(result_retention=10)
    count = MAX_FORGET_PER_CALL + 5
    for i in range(1, count + 1):
        fd.datagram(packet(txid=i, task_id=i), CLIENT, 0.0)
        finish(fd, i, state=TaskState.ERROR, error="x")  # error outcomes retain at once
    fd.expire(10.0)
    assert len(fd.book) == 5
    assert fd.next_deadline() <= 10.0  # the rest is due: the timer fires again at once
    fd.expire(10.0)
    assert len(fd.book) == 0


def test_status_answered_to_allowed_clients_only():
    fd, _ = door()
    fd.datagram(packet(txid=1, task_id=5), CLIENT, 0.0)
    [(ack, _)] = sent(fd.datagram(packet("status", 2), CLIENT, 0.0))
    assert ack["params"]["tasks"] == {"queued": 1}
    assert ack["params"]["front_door"]["received"] == 2
    assert fd.datagram(packet("status", 3), ("192.0.2.1", 9), 0.0) == []


def test_encoded_notification_never_over_60000_bytes():
    fd, _ = door()
    fd.datagram(packet(task_id=5), CLIENT, 0.0)
    result = b"\xff" * 50_000  # fits raw, but its base64 would not
    [(note, _)] = finish(fd, 1, result=result)
    assert note["params"] == {"task_id": 5, "status": "success", "result_size": 50_000}


def test_get_result_refuses_unfinished_tasks_and_bad_ranges():
    fd, _ = door()
    fd.datagram(packet(txid=1, task_id=5), CLIENT, 0.0)

    def code(txid, **params):
        [(ack, _)] = sent(
            fd.datagram(packet("get_result", txid, task_id=5, pad="x" * 60, **params), CLIENT, 0.0)
        )
        return ack.get("error", {}).get("code")

    assert code(2) == "no_result"
    finish(fd, 1, result=b"r" * 10)
    assert code(3, offset=-1) == "bad_range"
    assert code(4, length="all") == "bad_range"
    assert code(5, offset=0, length=4) is None


def test_error_ack_always_carries_code_and_message_shortened_to_fit():
    fd, _ = door()
    for pad in (PAD * 3, PAD, b""):
        data = packet("frobnicate", 7, task_id=5, pad=pad.decode())
        out = sent(fd.datagram(data, CLIENT, 0.0))
        if not out:
            assert pad == b""  # even {"code", "message": ""} would outgrow it: silence
            continue
        [(ack, _)] = out
        assert set(ack["error"]) == {"code", "message"}
        assert ack["error"]["code"] == "unknown_method"
        assert len(json.dumps(ack, separators=(",", ":"))) <= len(data)
        fd = door()[0]  # a fresh door: the same transmission id would get the same answer


def test_lone_surrogate_in_a_text_payload_is_taken_as_bytes_not_a_crash():
    fd, sched = door()
    data = b'{"method":"add_task","packet_type":1,"transmission_id":1,"params":{"task_id":5,"payload":"\\ud800x"}}'
    [(ack, _)] = sent(fd.datagram(data, CLIENT, 0.0))
    assert "error" not in ack
    assert sched.submitted == [(5, "\ud800x".encode("utf-8", "surrogatepass"), CLIENT)]


@given(st.one_of(st.integers(), st.booleans()))
def test_plain_ack_is_the_json_of_the_ack_object(txid):
    """The preformatted acknowledgement is byte for byte what json gives (bool included)."""
    expected = {"method": "ack", "packet_type": dg.IS_ACK, "transmission_id": txid}
    assert dg.ack(txid) == json.dumps(expected, separators=(",", ":")).encode()
    assert json.loads(dg.ack(txid)) == expected


def test_request_memory_is_capped_under_a_flood_of_distinct_ids(monkeypatch):
    """A flood of distinct transmission ids: never more than MAX_TRANSMISSIONS remembered,
    and the newest are the ones kept."""
    monkeypatch.setattr(transmissions, "MAX_TRANSMISSIONS", 100)
    seen = transmissions.Seen()
    for txid in range(1, 1001):
        seen.remember(CLIENT, txid, transmissions.PLAIN_ACK, 0.0)
        assert len(seen) <= 100
    assert seen.get(CLIENT, 1000) == (dg.ack(1000),)
    assert seen.get(CLIENT, 1) is None


_hosts = st.one_of(
    st.ip_addresses(v=4).map(str),
    st.ip_addresses(v=6).map(str),
    st.sampled_from(["127.0.0.1", "::7f00:1", "::ffff:127.0.0.1", "fe80::1%eth0", "fe80::1%lo"]),
)
_requests = st.tuples(
    st.tuples(_hosts, st.integers(0, 65535)),
    st.one_of(st.integers(0, 2**64 - 1), st.integers(-5, 5), st.integers(2**64 - 2, 2**70)),
)


@given(st.lists(_requests, min_size=1, max_size=30, unique=True), st.lists(_requests, max_size=30))
@example([(("127.0.0.1", 9), 5), (("::7f00:1", 9), 5), (("127.0.0.1", 9), 2**64 + 5)], [])
def test_request_memory_keeps_every_sender_and_id_apart(remembered, others):
    """Each (sender, transmission id) is its own entry, whatever the address family, scope,
    port or id (in or out of 64 bits): no two share one, and none is found that was not kept."""
    seen = transmissions.Seen()
    for n, (addr, txid) in enumerate(remembered):
        seen.remember(addr, txid, f"answer {n}".encode(), 0.0)
    for n, (addr, txid) in enumerate(remembered):
        assert seen.get(addr, txid) == (f"answer {n}".encode(),)
    for addr, txid in others:
        if (addr, txid) not in remembered:
            assert seen.get(addr, txid) is None


@pytest.mark.parametrize(
    "text",
    [
        ' \n{"a": [1, 2.5, "x"]}',  # white space before: the cheap path hands over to json.loads
        '{"a": [1, 2.5, "x"]}\r\n ',  # and after
        '{"a": [1, 2.5, "x"]}',
        "{'a': [1, 2.5, 'x']}",  # the single-quoted literal form
    ],
)
def test_datagram_parsing_reads_what_json_reads(text):
    assert dg.parse_packet(text.encode()) == {"a": [1, 2.5, "x"]}
    if not text.startswith("{'"):
        assert dg.decode(text.encode()) == {"a": [1, 2.5, "x"]}


@pytest.mark.parametrize(
    "data", [b'{"a": 1} {"b": 2}', b'{"a": 1}x', b'{"a": 1', b"\xff{}", b"[1, 2]", b""]
)
def test_datagram_parsing_refuses_what_json_refuses(data):
    with pytest.raises(dg.BadPacket):
        dg.parse_packet(data)
    assert dg.decode(data) is None


def test_answers_to_a_jobs_submitter_are_the_ones_marked_for_batches():
    fd, _ = door()
    [ack] = fd.datagram(packet(txid=1, task_id=5), CLIENT, 0.0)
    [note] = [a for a in fd.finish(1, TaskState.SUCCESS, b"r", "", 1.0) if isinstance(a, Send)]
    assert ack.batched and note.batched
    [status] = fd.datagram(packet("get_task", txid=2, task_id=5), CLIENT, 1.0)
    [refused] = fd.datagram(packet(txid=3, task_id=0, pad=PAD.decode()), CLIENT, 1.0)
    assert not status.batched and not refused.batched and refused.independent


def test_the_literal_form_is_read_up_to_4096_bytes_only():
    fd, sched = door()
    small = "{'method': 'add_task', 'params': {'task_id': 5, 'payload': '%s'}, 'packet_type': 1, 'transmission_id': 7}"
    fits = small % ("x" * (4096 - len(small % "")))
    assert len(fits.encode()) == 4096
    [(ack, _)] = sent(fd.datagram(fits.encode(), CLIENT, 0.0))
    assert "error" not in ack and len(sched.submitted) == 1
    big = (small % ("y" * 5000)).replace("'transmission_id': 7", "'transmission_id': 8")
    assert fd.datagram(big.encode(), CLIENT, 0.1) == []  # not JSON: silence, counted
    assert len(sched.submitted) == 1 and fd.stats.unparseable == 1


def test_get_result_answers_at_most_60000_bytes_whatever_length_asks():
    fd, _ = door()
    fd.datagram(packet(task_id=5), CLIENT, 0.0)
    finish(fd, 1, result=bytes(range(256)) * 1000)
    for length in (60_000, 10**9, 2**63):
        [answer] = fd.datagram(
            packet("get_result", 10 + length % 7, task_id=5, offset=0, length=length), CLIENT, 1.0
        )
        assert len(answer.data) <= 60_000


def test_status_is_never_over_1200_bytes_and_keeps_its_counts():
    workers = [
        {
            "id": n,
            "kind": "poller",
            "name": "p" * 200 + str(n),
            "pid": None,
            "state": "idle",
            "task": 0,
            "last_pulse_s": 0.1,
            "done": n,
        }
        for n in range(500)
    ]

    def report():
        return {
            "workers": [dict(w) for w in workers],
            "workers_total": 500,
            "kinds": {"poller": {"workers": 500, "idle": 500, "done": 124750}},
            "tasks": {"queued": 0, "running": 0, "success": 124750},
            "worker_losses": {f"cause {n}": n for n in range(100)},
            "redis": {"connected": False, "last_error": "e" * 5000},
        }

    fd, _ = door(status_report=report)
    for txid in (1, 2**62):
        [answer] = fd.datagram(packet("status", txid), CLIENT, 0.0)
        assert len(answer.data) <= 1200
        params = json.loads(answer.data)["params"]
        assert params["workers_total"] == 500 and params["tasks"]["success"] == 124750
        assert params["kinds"]["poller"]["done"] == 124750
    assert fd.datagram(packet("status", 3), ("192.0.2.1", 9), 0.0) == []  # not a client


def test_udp_memory_keeps_every_delivered_job():
    """udp_memory bounds copies of answers, never the records: every delivered job stays."""
    fd, _ = door(memory=5000)
    for task_id in range(1, 21):  # each delivered job holds ~1,300 bytes (result + record)
        fd.datagram(packet(txid=task_id, task_id=task_id), CLIENT, 0.0)
        [(note, _)] = finish(fd, task_id, result=b"r" * 1000)
        ack = {"method": "ack", "packet_type": 2, "transmission_id": note["transmission_id"]}
        fd.datagram(json.dumps(ack).encode(), CLIENT, 0.1)  # delivered: kept for retention
    assert all(fd.known(CLIENT, t) for t in range(1, 21))
    assert fd.door.seen.held_bytes <= 5000


def test_udp_memory_sheds_remembered_answers_under_a_flood_of_requests():
    fd, _ = door(memory=20_000)
    for txid in range(1, 5000):  # get_task for unknown tasks: each answer remembered
        fd.datagram(packet("get_task", txid, task_id=1) + PAD, CLIENT, 0.0)
    assert fd.door.seen.held_bytes <= 20_000


def test_a_job_of_another_door_with_a_udp_id_is_not_the_clients() -> None:
    """An HTTP job named like a UDP job (accepted before such ids were refused, and still
    in an older journal) is neither answered for nor resent to the UDP client."""
    book = JobBook()
    book.add(Job("udp-127.0.0.1-9-1", 1, 1, DoorName.HTTP, None))
    door = FrontDoor(book, allowed_clients=[ipaddress.ip_network("127.0.0.0/8")])
    for method in ("add_task", "get_task"):
        packet = {"method": method, "packet_type": 1, "transmission_id": 3}
        (reply,) = door.datagram(
            json.dumps({**packet, "params": {"task_id": 1, "pad": "x" * 99}}).encode(),
            ("127.0.0.1", 9),
            0.0,
        )
        assert isinstance(reply, Send)
        assert json.loads(reply.data)["error"]["code"] in ("bad_task_id", "unknown_task")

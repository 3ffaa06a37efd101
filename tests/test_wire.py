"""Framing: round trips under any chunking, and every malformed input's named error."""

from __future__ import annotations

import itertools
import socket
from typing import Any

import pytest
import trio
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from hypothesis import given, settings
from hypothesis import strategies as st

from controller import declared, wire
from gen import worker_protocol_pb2 as pb

u64 = st.integers(min_value=0, max_value=2**64 - 1)

control_msgs = st.builds(
    lambda t, tid: pb.ControlMsg(type=t, task_id=tid) if tid is not None else pb.ControlMsg(type=t),
    st.sampled_from(list(pb.ControlType.values())),
    st.none() | u64,
)
responses = st.builds(
    lambda e, tid: pb.WorkerResponse(error=e, task_id=tid),
    st.sampled_from(list(pb.WorkerError.values())),
    u64,
)
pulses = st.builds(
    lambda t, w, tid, n: pb.WorkerPulse(type=t, worker_id=w, task_id=tid, next_pulse=n),
    st.sampled_from(list(pb.PulseType.values())),
    u64,
    u64,
    u64,
)


def decode_in_chunks(msg_type, data: bytes, cuts: list[int], max_extra=wire.DEFAULT_MAX_EXTRA_SIZE):
    decoder = wire.FrameDecoder(msg_type, max_extra)
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    frame = None
    for start, end in itertools.pairwise(points):
        decoder.feed(data[start:end])
        frame = frame or decoder.next_frame()
    return frame or decoder.next_frame()


@settings(max_examples=300)
@given(
    msg=control_msgs | responses,
    extra=st.binary(max_size=3000),
    cuts=st.lists(st.integers(0, 10**6), max_size=40),
)
def test_roundtrip_any_chunking(msg, extra, cuts):
    data = wire.encode_frame(msg, extra)
    frame = decode_in_chunks(type(msg), data, cuts)
    assert frame is not None
    got, got_extra = frame
    assert got == msg and got_extra == extra


@given(msg=control_msgs | responses | pulses, extra=st.binary(max_size=200))
def test_roundtrip_one_byte_at_a_time(msg, extra):
    if isinstance(msg, pb.WorkerPulse):
        extra = b""
    data = wire.encode_frame(msg, extra)
    decoder = wire.FrameDecoder(type(msg))
    frame = None
    for i in range(len(data)):
        assert frame is None, "a frame completed before its last byte"
        decoder.feed(data[i : i + 1])
        frame = decoder.next_frame()
    assert frame == (msg, extra)


@settings(max_examples=500)
@given(
    data=st.binary(max_size=200),
    msg_type=st.sampled_from([pb.WorkerPulse, pb.ControlMsg, pb.WorkerResponse]),
)
def test_random_bytes_parse_or_raise_protocol_error(data, msg_type):
    decoder = wire.FrameDecoder(msg_type, max_extra_size=1000)
    decoder.feed(data)
    try:
        decoder.next_frame()
        decoder.eof()
    except wire.RemoteProtocolError:
        pass


def _outcome(step):
    try:
        return ("frame", step())
    except wire.RemoteProtocolError as exc:
        return (type(exc), str(exc))


@settings(max_examples=500)
@given(
    data=st.binary(max_size=300) | (control_msgs | responses).map(wire.encode_frame),
    tail=st.binary(max_size=20),
    cut=st.integers(0, 400),
    msg_type=st.sampled_from([pb.WorkerPulse, pb.ControlMsg, pb.WorkerResponse]),
)
def test_frame_reader_agrees_with_feed_then_next_frame(data, tail, cut, msg_type):
    """The reader's one-read fast path answers exactly what the general decoder answers."""
    data += tail
    cut = min(cut, len(data))
    reader = wire.FrameReader(msg_type, max_extra_size=1000)
    slow = wire.FrameDecoder(msg_type, max_extra_size=1000)
    ours, peer = socket.socketpair()
    ours.setblocking(False)

    def fast_step():
        frame = None
        for piece in (data[:cut], data[cut:]):
            if piece:
                peer.send(piece)
            frame = frame or reader.read(ours)
        return frame

    def slow_step():
        slow.feed(data[:cut])
        first = slow.next_frame()
        slow.feed(data[cut:])
        return first or slow.next_frame()

    with ours, peer:
        assert _outcome(fast_step) == _outcome(slow_step)


def test_varint_over_ten_bytes():
    decoder = wire.FrameDecoder(pb.WorkerPulse)
    decoder.feed(b"\xff" * 11)
    with pytest.raises(wire.VarintTooLong):
        decoder.next_frame()


def test_endless_varint_detected_at_eleventh_byte_even_in_pieces():
    decoder = wire.FrameDecoder(pb.WorkerPulse)
    decoder.feed(b"\x80" * 10)
    with pytest.raises(wire.VarintTooLong):
        decoder.next_frame()


def test_header_over_4k():
    decoder = wire.FrameDecoder(pb.WorkerPulse)
    decoder.feed(wire.encode_varint(wire.MAX_HEADER_SIZE + 1))
    with pytest.raises(wire.HeaderTooLarge):
        decoder.next_frame()


def test_header_of_exactly_4k_is_waited_for():
    decoder = wire.FrameDecoder(pb.WorkerPulse)
    decoder.feed(wire.encode_varint(wire.MAX_HEADER_SIZE))
    assert decoder.next_frame() is None


def test_extra_size_2_pow_63_fails_at_once():
    header = pb.ControlMsg(type=pb.CTRL_SET_TASK, task_id=1, extra_size=2**63).SerializeToString()
    decoder = wire.FrameDecoder(pb.ControlMsg, max_extra_size=16 * 1024 * 1024)
    decoder.feed(wire.encode_varint(len(header)) + header)
    with pytest.raises(wire.ExtraTooLarge, match="9223372036854775808"):
        decoder.next_frame()


def test_extra_over_configured_limit():
    data = wire.encode_frame(pb.WorkerResponse(), b"x" * 101)
    decoder = wire.FrameDecoder(pb.WorkerResponse, max_extra_size=100)
    decoder.feed(data)
    with pytest.raises(wire.ExtraTooLarge):
        decoder.next_frame()


def test_malformed_message():
    decoder = wire.FrameDecoder(pb.WorkerPulse)
    decoder.feed(b"\x03\xff\xff\xff")
    with pytest.raises(wire.MalformedMessage):
        decoder.next_frame()


@pytest.mark.parametrize("cut", [1, 3, 6])
def test_eof_mid_frame(cut):
    data = wire.encode_frame(pb.ControlMsg(type=pb.CTRL_SET_TASK, task_id=9), b"payload")
    decoder = wire.FrameDecoder(pb.ControlMsg)
    decoder.feed(data[:cut])
    assert decoder.next_frame() is None
    with pytest.raises(wire.Truncated):
        decoder.eof()


def test_a_pulse_response_cannot_carry_extra():
    with pytest.raises(ValueError):
        wire.encode_frame(pb.PulseResponse(), b"x")


def test_an_output_pulse_carries_its_bytes_within_the_pulse_cap():
    pulse = pb.WorkerPulse(type=pb.PULSE_OUTPUT, worker_id=3, task_id=7)
    data = wire.encode_frame(pulse, b"one\n\xff")
    frame = wire.whole_frame(pb.WorkerPulse, data, wire.MAX_PULSE_EXTRA)
    assert frame is not None and frame[1] == b"one\n\xff" and frame[0].extra_size == 5
    huge = wire.encode_frame(pulse, bytes(wire.MAX_PULSE_EXTRA + 1))
    with pytest.raises(wire.ExtraTooLarge):
        wire.whole_frame(pb.WorkerPulse, huge, wire.MAX_PULSE_EXTRA)


# A REGISTER as a worker built before `queues` and `labels` encodes it, byte by byte:
# type (field 1) REGISTER is 0, the default, so it is not sent; next_pulse (field 4) = 2.
OLD_REGISTER = b"\x02" + b"\x20\x02"


def old_pulse_type() -> Any:
    """WorkerPulse as it was before fields 5 and 6: what an older controller decodes with."""
    return _old_type("WorkerPulse", 4)


def old_response_type() -> Any:
    """PulseResponse as it was before `takes_output` (3): what an older worker decodes with."""
    return _old_type("PulseResponse", 2)


def _old_type(name: str, last_field: int) -> Any:
    proto = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(proto)
    proto.name = "old_worker_protocol.proto"
    proto.package = "old.protocol"
    [message] = [m for m in proto.message_type if m.name == name]
    kept = [f for f in message.field if f.number <= last_field]
    del message.field[:]
    message.field.extend(kept)
    for each in proto.message_type:
        for field in each.field:
            if field.HasField("type_name"):  # an enum's
                field.type_name = field.type_name.replace(".controller.", ".old.")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"old.protocol.{name}"))


def test_an_old_workers_register_parses_with_no_queues_nor_labels():
    frame = wire.whole_frame(pb.WorkerPulse, OLD_REGISTER, wire.DEFAULT_MAX_EXTRA_SIZE)
    assert frame is not None
    msg, extra = frame
    assert msg.type == pb.PULSE_REGISTER and msg.next_pulse == 2 and extra == b""
    assert list(msg.queues) == [] and list(msg.labels) == []
    old = old_pulse_type()
    assert wire.encode_frame(old(type=0, next_pulse=2)) == OLD_REGISTER


def test_a_new_register_is_read_by_an_older_controller_as_a_plain_register():
    new = pb.WorkerPulse(
        type=pb.PULSE_REGISTER, next_pulse=2, queues=["default", "gpu.q"], labels=["ssd"]
    )
    data = new.SerializeToString()
    old = old_pulse_type().FromString(data)  # unknown fields 5 and 6 are skipped
    assert old.type == pb.PULSE_REGISTER and old.next_pulse == 2
    assert pb.WorkerPulse.FromString(data) == new  # and read back whole by this version


def test_the_largest_declaration_allowed_fits_the_header_limit():
    queues = [f"{n:02d}".ljust(63, "q") for n in range(32)]  # 64 names, 2048 characters
    labels = list("abcdefghijklmnopqrstuvwxyz012345")
    longest = pb.WorkerPulse(
        type=pb.PULSE_REGISTER, next_pulse=2**64 - 1, worker_id=2**64 - 1, task_id=2**64 - 1,
        queues=queues, labels=labels,
    )  # fmt: skip
    assert declared.read(list(longest.queues), list(longest.labels)).labels  # allowed
    frame = wire.encode_frame(longest)
    assert len(frame) < wire.MAX_HEADER_SIZE
    assert wire.whole_frame(pb.WorkerPulse, frame, 0) is None  # a long header: the decoder
    decoder = wire.FrameDecoder(pb.WorkerPulse)
    decoder.feed(frame)
    assert decoder.next_frame() == (longest, b"")


def nonblocking_pair():
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    return a, b


async def test_frame_over_socket():
    a, b = nonblocking_pair()
    with a, b:
        msg = pb.WorkerResponse(error=pb.WORKER_ERR_OK, task_id=5)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: wire.send_frame(a, msg, b"result" * 100_000, timeout=1))
            got, extra = await wire.recv_frame(b, pb.WorkerResponse, timeout=1)
        assert got.task_id == 5 and extra == b"result" * 100_000


async def test_silent_peer_times_out(autojump_clock):
    a, b = nonblocking_pair()
    with a, b:
        data = wire.encode_frame(pb.ControlMsg(type=pb.CTRL_SET_TASK, task_id=1), b"abcdef")
        a.send(data[:-2])
        start = trio.current_time()
        with pytest.raises(wire.PeerTimeout):
            await wire.recv_frame(b, pb.ControlMsg, timeout=2.0)
        assert trio.current_time() - start == pytest.approx(2.0)


async def test_half_frame_then_close_is_truncated():
    a, b = nonblocking_pair()
    with b:
        data = wire.encode_frame(pb.ControlMsg(type=pb.CTRL_SET_TASK, task_id=1), b"abcdef")
        a.send(data[:-3])
        a.close()
        with pytest.raises(wire.Truncated):
            await wire.recv_frame(b, pb.ControlMsg, timeout=2.0)


async def test_peer_that_stops_reading_times_out(autojump_clock):
    a, b = nonblocking_pair()
    with a, b, pytest.raises(wire.PeerTimeout):
        await wire.send_frame(a, pb.WorkerResponse(), b"x" * (64 << 20), timeout=3.0)


def test_an_older_worker_reads_a_register_answer_that_offers_output_as_a_plain_one():
    new = pb.PulseResponse(error=pb.CTRL_ERR_OK, worker_id=9, takes_output=True)
    old = old_response_type().FromString(new.SerializeToString())  # field 3 is skipped
    assert old.error == pb.CTRL_ERR_OK and old.worker_id == 9


def test_an_older_controllers_register_answer_offers_no_output():
    old = old_response_type()(error=pb.CTRL_ERR_OK, worker_id=9)
    new = pb.PulseResponse.FromString(old.SerializeToString())
    assert new.worker_id == 9 and new.takes_output is False

"""``max_gradient_len``: the receiver's bound on total_chunks and on the values of a
gradient, and where it comes among the other rules, against both implementations.
"""

from __future__ import annotations

import pytest

from gradstream.errors import ArrowIpcError, ChecksumMismatchError, FrameError
from support.cases import assert_same_bits, frames_of, ramp
from support.frames import HEADER, frame
from support.impls import session

# --------------------------------------------------------------------------- max_gradient_len

HOSTILE_TOTAL = 0xFFFFFFFF


def _empty_payload(impl) -> bytes:
    return session(impl).encode_gradient(ramp(0))[0].arrow_ipc_bytes


def test_hostile_total_chunks_is_refused_at_the_first_frame(impl):
    # Thousands of tiny valid frames announcing 2^32-1 chunks: refused by the first one,
    # before the rest is looked at (without the limit this would decode them all).
    payload = _empty_payload(impl)
    wire = b"".join(frame(i, HOSTILE_TOTAL, payload) for i in range(5000))
    with pytest.raises(FrameError) as info:
        session(impl).decode_frames(wire)
    assert str(info.value) == "total_chunks 4294967295 above max_gradient_len 1073741824"
    assert info.value.detail == str(info.value)
    assert (info.value.chunk_index, info.value.offset) == (0, 0)


def test_total_chunks_limit_is_the_sessions(impl):
    grad = ramp(3)
    wire = session(impl, 1).encode_frames(grad)  # 3 chunks of one value
    assert_same_bits(session(impl, 1, max_gradient_len=3).decode_frames(wire), grad)
    with pytest.raises(FrameError) as info:
        session(impl, 1, max_gradient_len=2).decode_frames(wire)
    assert str(info.value) == "total_chunks 3 above max_gradient_len 2"
    assert (info.value.chunk_index, info.value.offset) == (0, 0)


def test_total_chunks_limit_in_a_later_frame_names_it(impl):
    # The first frame sets the total; a later one that disagrees is "disagree" (rule 5,
    # first sentence), even when its total is also above the limit.
    s = session(impl, 2)
    frames = frames_of(s.encode_gradient(ramp(4)))
    wire = frames[0] + frame(1, HOSTILE_TOTAL, _empty_payload(impl))
    with pytest.raises(FrameError) as info:
        s.decode_frames(wire)
    assert str(info.value) == (
        "chunks disagree on total_chunks: chunk 0 says 2, chunk 1 says 4294967295"
    )
    assert (info.value.chunk_index, info.value.offset) == (1, len(frames[0]))


def test_total_chunks_limit_comes_before_out_of_range_and_checksum(impl):
    payload = _empty_payload(impl)
    wire = frame(7, 5, payload, checksum=0)
    with pytest.raises(FrameError) as info:
        session(impl, max_gradient_len=4).decode_frames(wire)
    assert str(info.value) == "total_chunks 5 above max_gradient_len 4"
    assert info.value.chunk_index == 7


def test_truncation_comes_before_total_chunks_limit(impl):
    wire = HEADER.pack(0, HOSTILE_TOTAL, 100, 0) + b"\x00" * 50
    with pytest.raises(FrameError, match=r"^truncated frame: chunk 0 declares a 100-byte"):
        session(impl).decode_frames(wire)


def test_payload_len_limit_comes_before_total_chunks_limit(impl):
    wire = HEADER.pack(0, HOSTILE_TOTAL, 1000, 0)
    with pytest.raises(FrameError, match=r"above max_payload_len 999$"):
        session(impl, max_payload_len=999).decode_frames(wire)


def test_values_crossing_max_gradient_len(impl):
    s = session(impl, 4)
    frames = frames_of(s.encode_gradient(ramp(12)))  # 4 + 4 + 4 values
    with pytest.raises(FrameError) as info:
        session(impl, 4, max_gradient_len=10).decode_frames(b"".join(frames))
    assert str(info.value) == "gradient exceeds max_gradient_len 10: 12 values by chunk 2"
    assert info.value.detail == str(info.value)
    assert (info.value.chunk_index, info.value.offset) == (2, len(frames[0]) + len(frames[1]))


def test_values_are_counted_in_arrival_order(impl):
    s = session(impl, 4)
    frames = frames_of(s.encode_gradient(ramp(10)))  # 4 + 4 + 2 values
    wire = frames[2] + frames[0] + frames[1]  # 2, 6, 10 values so far
    with pytest.raises(FrameError) as info:
        session(impl, 4, max_gradient_len=9).decode_frames(wire)
    assert str(info.value) == "gradient exceeds max_gradient_len 9: 10 values by chunk 1"
    assert (info.value.chunk_index, info.value.offset) == (1, len(frames[2]) + len(frames[0]))


def test_gradient_exactly_at_max_gradient_len_is_accepted(impl):
    grad = ramp(12)
    wire = session(impl, 4).encode_frames(grad)
    assert_same_bits(session(impl, 4, max_gradient_len=12).decode_frames(wire), grad)
    assert_same_bits(session(impl, 5, max_gradient_len=12).decode_frames(wire), grad)


def test_one_frame_with_more_values_than_the_limit(impl):
    # A single chunk may hold any number of values (the receiver's chunk_size does not
    # matter): the limit counts the values decoded.
    wire = session(impl, 100).encode_frames(ramp(5))
    with pytest.raises(FrameError) as info:
        session(impl, 2, max_gradient_len=4).decode_frames(wire)
    assert str(info.value) == "gradient exceeds max_gradient_len 4: 5 values by chunk 0"
    assert (info.value.chunk_index, info.value.offset) == (0, 0)


def test_checksum_and_payload_come_before_the_values_limit(impl):
    s = session(impl, 100)
    chunk = s.encode_gradient(ramp(5))[0]
    bad_crc = frame(0, 1, chunk.arrow_ipc_bytes, checksum=chunk.checksum ^ 1)
    with pytest.raises(ChecksumMismatchError):
        session(impl, max_gradient_len=1).decode_frames(bad_crc)
    with pytest.raises(ArrowIpcError):
        session(impl, max_gradient_len=1).decode_frames(frame(0, 1, b"not arrow"))


def test_smallest_max_gradient_len_accepts_the_empty_and_one_value_gradients(impl):
    small = session(impl, max_gradient_len=1)
    empty = session(impl).encode_frames(ramp(0))
    assert len(small.decode_frames(empty)) == 0
    assert_same_bits(small.decode_frames(session(impl).encode_frames(ramp(1))), ramp(1))
    # Two one-value chunks: 2 chunks are above the limit of 1 value.
    with pytest.raises(FrameError, match=r"^total_chunks 2 above max_gradient_len 1$"):
        small.decode_frames(session(impl, 1).encode_frames(ramp(2)))
    # One two-value chunk: the values are.
    with pytest.raises(FrameError, match=r"^gradient exceeds max_gradient_len 1: 2 values"):
        small.decode_frames(session(impl).encode_frames(ramp(2)))


def test_empty_gradient_at_total_chunks_one_passes_any_limit(impl):
    # max(max_gradient_len, 1): the empty gradient is one chunk of zero values.
    wire = frame(0, 1, _empty_payload(impl))
    assert len(session(impl, max_gradient_len=1).decode_frames(wire)) == 0

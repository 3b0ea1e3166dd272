"""The docs/spec/decoding-rules.md decoding rules for chunks and frames, hand-picked cases against
both
implementations: checksum errors, decode_chunks' rules and decode_frames' rules, and the
order in which they apply.

Every test takes the `impl` fixture (see tests/conftest.py): both implementations must
raise the same exception classes, with the same fields and messages.
"""

from __future__ import annotations

import zlib
from types import SimpleNamespace

import pytest

from gradstream.errors import (
    ArrowIpcError,
    ChecksumMismatchError,
    FrameError,
    IncompleteStreamError,
)
from support.cases import assert_same_bits, frames_of, make_chunk, ramp
from support.frames import HEADER, frame
from support.impls import session

# --------------------------------------------------------------------------- checksum errors


@pytest.mark.parametrize("k", [0, 2])
def test_flipped_bit_in_chunk_k_is_checksum_mismatch(impl, k):
    s = session(impl, 3)
    chunks = s.encode_gradient(ramp(9))
    payload = bytearray(chunks[k].arrow_ipc_bytes)
    payload[len(payload) // 2] ^= 0x10
    corrupted = bytes(payload)
    expected, actual = chunks[k].checksum, zlib.crc32(corrupted)
    message = f"Checksum mismatch on chunk {k}: expected {expected:#010x}, got {actual:#010x}"

    bad = list(chunks)
    bad[k] = impl.GradientChunk("s", k, 3, corrupted, expected)
    assert bad[k].verify_checksum() is False
    with pytest.raises(ChecksumMismatchError) as info:
        s.decode_chunks(bad)
    assert (info.value.chunk_index, info.value.expected, info.value.actual) == (k, expected, actual)
    assert str(info.value) == message

    frames = frames_of(chunks)
    frames[k] = frame(k, 3, corrupted, expected)
    with pytest.raises(ChecksumMismatchError) as info:
        s.decode_frames(b"".join(frames))
    assert (info.value.chunk_index, info.value.expected, info.value.actual) == (k, expected, actual)
    assert str(info.value) == message


def test_checksum_message_pads_to_eight_hex_digits(impl):
    payload = session(impl).encode_gradient([1.0])[0].arrow_ipc_bytes
    chunk = make_chunk(impl, 0, 1, payload, checksum=0x1)
    with pytest.raises(ChecksumMismatchError, match=r"expected 0x00000001, got 0x[0-9a-f]{8}$"):
        session(impl).decode_chunks([chunk])


def test_frames_are_checked_in_arrival_order(impl):
    # Frame 1 arrives first with a bad CRC; frame 0 (bad Arrow) would only fail later.
    s = session(impl, 2)
    chunks = s.encode_gradient(ramp(4))
    wire = frame(1, 2, chunks[1].arrow_ipc_bytes, chunks[1].checksum ^ 1) + frame(0, 2, b"junk")
    with pytest.raises(ChecksumMismatchError) as info:
        s.decode_frames(wire)
    assert info.value.chunk_index == 1


def test_chunks_crc_and_decode_interleave_in_index_order(impl):
    # Chunk 0 has a valid CRC over junk, chunk 1 a bad CRC: chunk 0's Arrow error wins.
    s = session(impl, 2)
    chunks = s.encode_gradient(ramp(4))
    bad = [make_chunk(impl, 0, 2, b"junk"), make_chunk(impl, 1, 2, chunks[1].arrow_ipc_bytes, 7)]
    with pytest.raises(ArrowIpcError) as info:
        s.decode_chunks(reversed(bad))
    assert info.value.chunk_index == 0


# --------------------------------------------------------------------------- decode_chunks rules


def test_missing_chunk_is_incomplete_stream(impl):
    s = session(impl, 2)
    chunks = s.encode_gradient(ramp(10))  # 5 chunks
    with pytest.raises(IncompleteStreamError) as info:
        s.decode_chunks([chunks[0], chunks[3]])
    assert (info.value.received, info.value.total) == (2, 5)
    assert str(info.value) == "Incomplete chunk stream: received 2 of 5 chunks"


def test_duplicate_chunk_index_is_frame_error(impl):
    s = session(impl, 2)
    chunks = s.encode_gradient(ramp(6))
    with pytest.raises(FrameError) as info:
        s.decode_chunks([chunks[1], chunks[0], chunks[1]])
    assert str(info.value) == "duplicate chunk index 1"
    assert (info.value.detail, info.value.chunk_index, info.value.offset) == (
        "duplicate chunk index 1",
        1,
        None,
    )


def test_out_of_range_chunk_index_is_frame_error(impl):
    s = session(impl, 2)
    chunks = s.encode_gradient(ramp(6))  # 3 chunks
    stray = make_chunk(impl, 7, 3, chunks[0].arrow_ipc_bytes)
    with pytest.raises(FrameError) as info:
        s.decode_chunks([*chunks, stray])
    assert str(info.value) == "chunk index 7 out of range for total_chunks 3"
    assert (info.value.chunk_index, info.value.offset) == (7, None)


def test_total_chunks_zero_is_out_of_range(impl):
    payload = session(impl).encode_gradient([])[0].arrow_ipc_bytes
    with pytest.raises(FrameError) as info:
        session(impl).decode_chunks([make_chunk(impl, 0, 0, payload)])
    assert str(info.value) == "chunk index 0 out of range for total_chunks 0"
    with pytest.raises(FrameError) as info:
        session(impl).decode_frames(frame(0, 0, payload))
    assert (str(info.value), info.value.chunk_index, info.value.offset) == (
        "chunk index 0 out of range for total_chunks 0",
        0,
        0,
    )


def test_inconsistent_totals_is_frame_error(impl):
    s = session(impl, 2)
    chunks = s.encode_gradient(ramp(10))  # 5 chunks
    odd = make_chunk(impl, 3, 4, chunks[3].arrow_ipc_bytes)
    with pytest.raises(FrameError) as info:
        s.decode_chunks([chunks[4], odd, chunks[0], chunks[1], chunks[2]])
    assert str(info.value) == "chunks disagree on total_chunks: chunk 0 says 5, chunk 3 says 4"
    assert (info.value.chunk_index, info.value.offset) == (3, None)


def test_total_is_taken_from_lowest_index(impl):
    # Sorted first is chunk 1 (total 2); chunk 2 then is out of range for 2... unless it
    # first disagrees on the total, which rule 3 checks first.
    s = session(impl, 2)
    chunks = s.encode_gradient(ramp(6))  # 3 chunks
    a = make_chunk(impl, 1, 2, chunks[1].arrow_ipc_bytes)
    with pytest.raises(FrameError) as info:
        s.decode_chunks([chunks[2], a])
    assert str(info.value) == "chunks disagree on total_chunks: chunk 1 says 2, chunk 2 says 3"
    assert info.value.chunk_index == 2


def test_frame_rules_come_before_incomplete_and_checksum(impl):
    s = session(impl, 2)
    chunks = s.encode_gradient(ramp(6))  # 3 chunks
    corrupt = make_chunk(impl, 0, 3, chunks[0].arrow_ipc_bytes, checksum=0)
    # Duplicate + incomplete + bad CRC: the duplicate is reported.
    with pytest.raises(FrameError, match="duplicate chunk index 0"):
        s.decode_chunks([corrupt, corrupt])
    # Incomplete + bad CRC: incomplete is reported.
    with pytest.raises(IncompleteStreamError):
        s.decode_chunks([corrupt, chunks[1]])


def test_chunk_field_values_out_of_u32_range_in_duck_chunks(impl):
    duck = SimpleNamespace(chunk_index=-1, total_chunks=1, checksum=0, arrow_ipc_bytes=b"")
    with pytest.raises(OverflowError):
        session(impl).decode_chunks([duck])


# --------------------------------------------------------------------------- decode_frames rules


def test_truncated_payload_is_frame_error_with_offset(impl):
    s = session(impl, 3)
    frames = frames_of(s.encode_gradient(ramp(9)))
    wire = b"".join(frames)
    last_offset = len(frames[0]) + len(frames[1])
    declared = len(frames[2]) - 16
    with pytest.raises(FrameError) as info:
        s.decode_frames(wire[:-1])
    assert str(info.value) == (
        f"truncated frame: chunk 2 declares a {declared}-byte payload "
        f"but only {declared - 1} bytes follow"
    )
    assert (info.value.chunk_index, info.value.offset) == (2, last_offset)


def test_header_alone_is_truncated_frame(impl):
    with pytest.raises(FrameError) as info:
        session(impl).decode_frames(HEADER.pack(0, 1, 500, 0))
    assert (
        str(info.value)
        == "truncated frame: chunk 0 declares a 500-byte payload but only 0 bytes follow"
    )
    assert (info.value.chunk_index, info.value.offset) == (0, 0)


@pytest.mark.parametrize("n", [1, 5, 15])
def test_truncated_first_header_is_frame_error(impl, n):
    s = session(impl)
    wire = s.encode_frames(ramp(3))
    with pytest.raises(FrameError) as info:
        s.decode_frames(wire[:n])
    assert str(info.value) == f"truncated frame header: {n} of 16 bytes"
    assert (info.value.chunk_index, info.value.offset) == (None, 0)


@pytest.mark.parametrize("n", [1, 15])
def test_truncated_header_after_a_frame_is_incomplete_stream(impl, n):
    s = session(impl, 3)
    frames = frames_of(s.encode_gradient(ramp(9)))
    with pytest.raises(IncompleteStreamError) as info:
        s.decode_frames(frames[0] + frames[1][:n])
    assert (info.value.received, info.value.total) == (1, 3)
    assert str(info.value) == "Incomplete chunk stream: received 1 of 3 chunks"


def test_missing_frames_at_end_is_incomplete_stream(impl):
    s = session(impl, 3)
    frames = frames_of(s.encode_gradient(ramp(9)))
    with pytest.raises(IncompleteStreamError) as info:
        s.decode_frames(frames[2] + frames[0])
    assert (info.value.received, info.value.total) == (2, 3)


@pytest.mark.parametrize("extra", [b"\x00", b"xyz", b"\x00" * 16, b"\x00" * 40])
def test_trailing_bytes_are_frame_error(impl, extra):
    s = session(impl, 3)
    wire = s.encode_frames(ramp(9))
    with pytest.raises(FrameError) as info:
        s.decode_frames(wire + extra)
    assert str(info.value) == f"{len(extra)} bytes left over after the last chunk"
    assert info.value.offset == len(wire)


def test_second_stream_after_a_complete_one_is_left_over(impl):
    s = session(impl, 3)
    wire = s.encode_frames(ramp(2))
    with pytest.raises(FrameError) as info:
        s.decode_frames(wire + wire)
    assert str(info.value) == f"{len(wire)} bytes left over after the last chunk"
    assert info.value.offset == len(wire)


def test_hostile_payload_len_is_refused_before_reading(impl):
    with pytest.raises(FrameError) as info:
        session(impl).decode_frames(HEADER.pack(0, 1, 0xFFFFFFFF, 0))
    assert str(info.value) == (
        "chunk 0 declares a 4294967295-byte payload, above max_payload_len 268435456"
    )
    assert (info.value.chunk_index, info.value.offset) == (0, 0)


def test_hostile_payload_len_in_second_frame_reports_its_offset(impl):
    s = session(impl, 3)
    frames = frames_of(s.encode_gradient(ramp(6)))
    wire = frames[1] + HEADER.pack(0, 2, 0xFFFFFFFF, 0) + b"\x00" * 8
    with pytest.raises(FrameError) as info:
        s.decode_frames(wire)
    assert (info.value.chunk_index, info.value.offset) == (0, len(frames[1]))
    assert "4294967295-byte payload, above max_payload_len 268435456" in str(info.value)


def test_payload_len_limit_is_the_sessions(impl):
    grad = ramp(10)
    wire = session(impl, 10).encode_frames(grad)
    size = len(wire) - 16
    assert_same_bits(session(impl, 10, max_payload_len=size).decode_frames(wire), grad)
    with pytest.raises(FrameError) as info:
        session(impl, 10, max_payload_len=size - 1).decode_frames(wire)
    assert str(info.value) == (
        f"chunk 0 declares a {size}-byte payload, above max_payload_len {size - 1}"
    )


def test_payload_len_limit_comes_before_truncation(impl):
    # The payload both exceeds the limit and is truncated: rule 3 wins over rule 4.
    wire = HEADER.pack(4, 9, 1000, 0) + b"\x00" * 10
    with pytest.raises(FrameError, match="above max_payload_len 999"):
        session(impl, max_payload_len=999).decode_frames(wire)


def test_frames_disagree_on_total(impl):
    s = session(impl, 2)
    chunks = s.encode_gradient(ramp(10))  # 5 chunks
    frames = frames_of(chunks)
    odd = frame(3, 4, chunks[3].arrow_ipc_bytes)
    wire = frames[2] + frames[0] + odd
    with pytest.raises(FrameError) as info:
        s.decode_frames(wire)
    # The first *frame* (chunk 2) sets the total, not the lowest index.
    assert str(info.value) == "chunks disagree on total_chunks: chunk 2 says 5, chunk 3 says 4"
    assert (info.value.chunk_index, info.value.offset) == (3, len(frames[2]) + len(frames[0]))


def test_truncation_comes_before_total_disagreement(impl):
    s = session(impl, 2)
    frames = frames_of(s.encode_gradient(ramp(4)))
    wire = frames[0] + HEADER.pack(1, 7, 100, 0) + b"\x00" * 50
    with pytest.raises(FrameError, match=r"^truncated frame: chunk 1 declares a 100-byte"):
        s.decode_frames(wire)


def test_frame_index_out_of_range(impl):
    s = session(impl, 2)
    chunks = s.encode_gradient(ramp(4))  # 2 chunks
    frames = frames_of(chunks)
    wire = frames[0] + frame(2, 2, chunks[1].arrow_ipc_bytes)
    with pytest.raises(FrameError) as info:
        s.decode_frames(wire)
    assert str(info.value) == "chunk index 2 out of range for total_chunks 2"
    assert (info.value.chunk_index, info.value.offset) == (2, len(frames[0]))


def test_total_disagreement_comes_before_out_of_range(impl):
    s = session(impl, 2)
    chunks = s.encode_gradient(ramp(4))
    wire = frames_of(chunks)[0] + frame(9, 3, chunks[1].arrow_ipc_bytes)
    with pytest.raises(FrameError, match=r"^chunks disagree on total_chunks: chunk 0 says 2"):
        s.decode_frames(wire)


def test_duplicate_frame(impl):
    s = session(impl, 2)
    frames = frames_of(s.encode_gradient(ramp(6)))
    with pytest.raises(FrameError) as info:
        s.decode_frames(frames[1] + frames[1])
    assert str(info.value) == "duplicate chunk index 1"
    assert (info.value.chunk_index, info.value.offset) == (1, len(frames[1]))


def test_duplicate_comes_before_checksum(impl):
    s = session(impl, 2)
    chunks = s.encode_gradient(ramp(6))
    frames = frames_of(chunks)
    wire = frames[1] + frame(1, 3, chunks[1].arrow_ipc_bytes, checksum=0)
    with pytest.raises(FrameError, match=r"^duplicate chunk index 1$"):
        s.decode_frames(wire)


def test_reading_stops_after_total_frames(impl):
    # A one-chunk stream followed by garbage that is not even a full header: left over,
    # not a truncated-header error, because reading stopped after the one frame.
    s = session(impl)
    wire = s.encode_frames(ramp(3))
    with pytest.raises(FrameError) as info:
        s.decode_frames(wire + b"\xff" * 3)
    assert str(info.value) == "3 bytes left over after the last chunk"
    assert info.value.chunk_index is None

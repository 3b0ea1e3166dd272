"""Frames by hand: the header, frames built with their CRC (or another), streams split
into their frames and joined again, and chunks decoded both ways."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

from gradstream.errors import GradientStreamError
from support.impls import session

# A frame: this header (chunk_index, total_chunks, payload length, CRC-32 of the
# payload, each a little-endian u32), then the payload.
HEADER = struct.Struct("<IIII")
HEADER_LEN = HEADER.size


def frame(index: int, total: int, payload: bytes, checksum: int | None = None) -> bytes:
    """A frame of ``payload``, with its correct CRC-32 unless ``checksum`` is given."""
    crc = zlib.crc32(payload) if checksum is None else checksum
    return HEADER.pack(index, total, len(payload), crc) + payload


def split_frames(wire: bytes) -> list[tuple[int, int, bytes]]:
    """(chunk_index, total_chunks, payload) of each frame of a valid stream."""
    frames, pos = [], 0
    while pos < len(wire):
        index, total, length, _ = HEADER.unpack_from(wire, pos)
        frames.append((index, total, wire[pos + HEADER_LEN : pos + HEADER_LEN + length]))
        pos += HEADER_LEN + length
    return frames


def join_frames(parts: list[tuple[int, int, bytes]]) -> bytes:
    """The frames of (chunk_index, total_chunks, payload), each with its correct CRC."""
    return b"".join(frame(i, t, p) for i, t, p in parts)


def frame_offsets(parts: list[tuple[int, int, bytes]]) -> list[int]:
    """The offset of each frame of join_frames(parts)."""
    offsets, pos = [], 0
    for _, _, p in parts:
        offsets.append(pos)
        pos += HEADER_LEN + len(p)
    return offsets


def both_ways(
    impl: ModuleType,
    parts: list[tuple[int, int, bytes]],
    out: Callable[[], np.ndarray] | None = None,
    **kwargs: Any,
) -> tuple[Any, Any]:
    """(decode_chunks outcome, decode_frames outcome) of chunks (index, total, payload)
    with correct CRCs, the frames in the order given (decode_chunks gets that order too).
    An outcome is the array or the GradientStreamError raised. With ``out`` (a factory),
    decode_frames writes into a fresh array from it."""
    s = session(impl, **kwargs)
    chunks = [impl.GradientChunk("s", i, t, p, zlib.crc32(p)) for i, t, p in parts]
    wire = join_frames(parts)
    kw = {} if out is None else {"out": out()}
    outcomes = []
    for call in (lambda: s.decode_chunks(chunks), lambda: s.decode_frames(wire, **kw)):
        try:
            outcomes.append(call())
        except GradientStreamError as exc:
            outcomes.append(exc)
    return outcomes[0], outcomes[1]


def assert_error(
    got: Any, cls: type, detail: str, chunk_index: int | None, offset: Any = "skip"
) -> None:
    assert type(got) is cls, f"expected {cls.__name__}, got {got!r}"
    assert got.detail == detail, got.detail
    assert got.chunk_index == chunk_index, got
    if offset != "skip":
        assert got.offset == offset, got

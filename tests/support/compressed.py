"""What the compression tests (codec/test_compression*.py) share: sessions of 64-value
chunks, sparse gradients, frames with their CRC, and one payload decoded both ways.
"""

from __future__ import annotations

import importlib
import zlib
from types import ModuleType
from typing import Any

import numpy as np

import gradstream.reference as ref
from gradstream.errors import ArrowIpcError, GradientStreamError
from support.frames import HEADER, HEADER_LEN, frame
from support.values import float32_bits as bits

CODEC_IDS = {"lz4": 0, "zstd": 1}  # CompressionType in Arrow's Message.fbs


# Not support.impls.session: here the chunk size is 64 when not given.
def session(impl: ModuleType, chunk_size: int = 64, **kwargs: Any) -> Any:
    return impl.GradientStreamSession("s", chunk_size, **kwargs)


def sparse(n: int, seed: int = 0) -> np.ndarray:
    """n values, nine in ten of them zeros (+0.0), the rest raw bit patterns."""
    rng = np.random.default_rng(seed)
    words = rng.integers(0, 2**32, n, dtype=np.uint32)
    words[rng.random(n) < 0.9] = 0
    return words.view(np.float32)


def assert_bit_equal(got: Any, want: np.ndarray, what: str = "") -> None:
    assert isinstance(got, np.ndarray), what
    assert got.dtype == np.float32 and got.ndim == 1, what
    assert got.shape == (want.size,), what
    assert np.array_equal(bits(got), bits(want)), what


def split_frames(wire: bytes) -> list[tuple[int, int, int, bytes]]:
    """(chunk_index, total_chunks, checksum, payload) of each frame of a valid stream."""
    frames, pos = [], 0
    while pos < len(wire):
        index, total, length, crc = HEADER.unpack_from(wire, pos)
        payload = wire[pos + HEADER_LEN : pos + HEADER_LEN + length]
        assert len(payload) == length
        frames.append((index, total, crc, payload))
        pos += HEADER_LEN + length
    return frames


def decode_both_ways(s: Any, payload: bytes) -> list[Any]:
    """The outcomes (array or GradientStreamError) of one payload, with its correct CRC,
    as the only chunk of a gradient: [decode_chunks, decode_frames]."""
    outcomes = []
    # A chunk object of the session's own implementation.
    mod = ref if isinstance(s, ref.GradientStreamSession) else importlib.import_module("gradstream")
    crc = zlib.crc32(payload)
    for call in (
        lambda: s.decode_chunks([mod.GradientChunk("s", 0, 1, payload, crc)]),
        lambda: s.decode_frames(frame(0, 1, payload)),
    ):
        try:
            outcomes.append(call())
        except GradientStreamError as exc:
            outcomes.append(exc)
    return outcomes


def assert_arrow_error(outcome: Any, chunk_index: int, detail: str | None = None) -> None:
    assert isinstance(outcome, ArrowIpcError), f"expected ArrowIpcError, got {outcome!r}"
    assert outcome.chunk_index == chunk_index, outcome
    if detail is not None:
        assert outcome.detail == detail

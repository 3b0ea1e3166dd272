"""A buffer that does not shrink is stored as it is (issue 23): Arrow IPC marks it by an
uncompressed length of -1, so compression never puts more than a few bytes a chunk beside
the uncompressed payload on the wire. The native writer marks it; both implementations
read it (docs/guides/dtypes-and-shapes.md, "Layout and compression")."""

from __future__ import annotations

import numpy as np
import pytest

import gradstream as gs
import gradstream.reference as ref
from support.payloads import the_batch


def declared_lengths(payload: bytes) -> list[int]:
    message = the_batch(payload)
    return [
        int.from_bytes(message.body[offset : offset + 8], "little", signed=True)
        for offset, length in message.buffers
        if length > 0
    ]


@pytest.mark.parametrize("codec", ["lz4", "zstd"])
def test_random_values_go_uncompressed_and_the_reference_reads_them(codec: str) -> None:
    # Random bits: no codec shrinks them.
    grad = np.random.default_rng(7).integers(0, 2**32, 4096, dtype=np.uint32).view(np.float32)
    w = gs.GradientStreamSession("x", 4096, layout="compact", compression=codec)
    (chunk,) = w.encode_gradient(grad)
    assert declared_lengths(chunk.arrow_ipc_bytes) == [-1]
    plain = gs.GradientStreamSession("x", 4096, layout="compact").encode_frames(grad)
    frames = w.encode_frames(grad)
    # The length prefix, the BodyCompression table, padding: 64 bytes a chunk at most.
    assert len(frames) <= len(plain) + 64
    for reader in (ref, gs):
        back = reader.GradientStreamSession("x", 4096).decode_frames(frames)
        assert np.array_equal(back.view(np.uint32), grad.view(np.uint32))


@pytest.mark.parametrize("codec", ["lz4", "zstd"])
def test_the_native_side_reads_the_references_compressed_random_values(codec: str) -> None:
    # The reference writes through pyarrow, which stores every buffer compressed, grown or
    # not: the native reader takes both forms.
    grad = np.random.default_rng(9).integers(0, 2**32, 4096, dtype=np.uint32).view(np.float32)
    frames = ref.GradientStreamSession("x", 4096, compression=codec).encode_frames(grad)
    back = gs.GradientStreamSession("x", 4096).decode_frames(frames)
    assert np.array_equal(back.view(np.uint32), grad.view(np.uint32))


def test_in_the_seed_layout_the_index_shrinks_and_random_values_stay_as_they_are() -> None:
    grad = np.random.default_rng(8).integers(0, 2**32, 4096, dtype=np.uint32).view(np.float32)
    s = gs.GradientStreamSession("x", 4096, compression="zstd")
    (chunk,) = s.encode_gradient(grad)
    index, values = declared_lengths(chunk.arrow_ipc_bytes)
    assert index == 4 * 4096 and values == -1

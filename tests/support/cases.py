"""The small gradients and hand-made Arrow payloads of the hand-picked cases (api/,
codec/test_encoding.py, rules/): a ramp of values, bit-for-bit checks, frames of chunks,
and Arrow IPC files and streams written with pyarrow.
"""

from __future__ import annotations

import zlib

import numpy as np
import pyarrow as pa
import pyarrow.ipc

from support.frames import frame

SEED_SCHEMA = pa.schema(
    [
        pa.field("index", pa.int32(), nullable=False),
        pa.field("value", pa.float32(), nullable=False),
    ]
)


def bits(values: np.ndarray) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).view(np.uint32)


def assert_same_bits(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.dtype == np.float32
    assert actual.ndim == 1
    np.testing.assert_array_equal(bits(actual), bits(expected).reshape(-1))


def frames_of(chunks) -> list[bytes]:
    return [frame(c.chunk_index, c.total_chunks, c.arrow_ipc_bytes, c.checksum) for c in chunks]


def make_chunk(impl, index: int, total: int, payload: bytes, checksum: int | None = None):
    crc = zlib.crc32(payload) if checksum is None else checksum
    return impl.GradientChunk("s", index, total, payload, crc)


def ramp(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.float32) * np.float32(0.5) - np.float32(3.0)

"""The bytes of a few tensor sets, fixed: SHA-256 digests of what the native session's
``encode_tensors`` writes for sets built from bit patterns anyone can rebuild.

Recorded from the Python set layer over the native codec (``gradstream._tensors``); the
Rust core's tensor-set encoder must write the same bytes (its own test,
``tensors::encode``'s ``sets_match_the_recorded_python_bytes``, rebuilds these sets
and checks their CRC-32s and lengths, recorded here too), so that binding it cannot
change a byte on the wire.
"""

from __future__ import annotations

import hashlib
import math
import zlib
from typing import Any

import numpy as np
import pytest

from support.impls import load_impl
from support.tensor_sets import BF16, numpy_dtype

# The multiplier of each value width: value i of a tensor is i * M + seed, modulo 2**bits,
# taken as the dtype's bits (NaNs, infinities and subnormals included).
MULTIPLIERS = {2: 40503, 4: 2654435761, 8: 11400714819323198485}


def pattern(dtype: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    width = numpy_dtype(dtype).itemsize
    i = np.arange(math.prod(shape), dtype=np.uint64)
    words = i * np.uint64(MULTIPLIERS[width]) + np.uint64(seed)
    return words.astype(f"u{width}").view(numpy_dtype(dtype)).reshape(shape)


MIXED: list[tuple[str, str, tuple[int, ...], int]] = [
    ("layer.w", "float16", (3, 4), 1),
    ("scale", "float32", (), 2),
    ("empty", "float64", (0, 3), 3),
    ("β/ü name", "float32", (7,), 4),
    ("bf", "bfloat16", (5,), 5),
    ("d", "float64", (2, 3, 2), 6),
]

# (id, session keywords, tensors, SHA-256, CRC-32, length)
GOLDEN: list[tuple[str, dict[str, Any], list[Any], str, int, int]] = [
    (
        "mixed-seed-4",
        {"chunk_size": 4},
        MIXED,
        "d1e67af226d21019bceae73d5f3f9f4a5c2b45ab136133c5df7606a0871e8089",
        150289276,
        14218,
    ),
    (
        "mixed-compact-5-bfloat16",
        {"chunk_size": 5, "layout": "compact", "wire_dtype": "bfloat16"},
        MIXED,
        "b225f0e6ab61ab702f44cd0e9f94e9bac1374598869609100668d82c603d00f5",
        2610481093,
        13864,
    ),
    (
        "float64-wire",
        {"chunk_size": 65536, "wire_dtype": "float64"},
        [("a", "float32", (10,), 7), ("b", "float16", (2, 2), 8)],
        "618c42131c70321d9a2c399a6f3a1d3995d3e79d67a4b9bec0f5f11f0ad9ba66",
        4141625934,
        3430,
    ),
    (
        "empty-set",
        {},
        [],
        "2b356217eda4b5fc95c33d38a7297c5fc25bbadf1f6d84cb8babb225dd562469",
        790166562,
        1034,
    ),
]


@pytest.mark.skipif(BF16 is None, reason="needs ml_dtypes for the bfloat16 tensors")
@pytest.mark.parametrize(
    ("keywords", "tensors", "sha256", "crc32", "length"),
    [pytest.param(*case[1:], id=case[0]) for case in GOLDEN],
)
def test_encode_tensors_writes_the_recorded_bytes(
    keywords: dict[str, Any], tensors: list[Any], sha256: str, crc32: int, length: int
) -> None:
    native = load_impl("native")
    keywords = {"chunk_size": 65536, **keywords}
    chunk_size = keywords.pop("chunk_size")
    s = native.GradientStreamSession("golden", chunk_size, **keywords)
    wire = bytes(s.encode_tensors([(n, pattern(d, shape, seed)) for n, d, shape, seed in tensors]))
    got = (hashlib.sha256(wire).hexdigest(), zlib.crc32(wire), len(wire))
    assert got == (sha256, crc32, length)

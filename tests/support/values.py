"""float32 values whose bits a round trip must keep: NaN payloads, signed zeros,
infinities, subnormals."""

from __future__ import annotations

from typing import Any

import numpy as np

# Bit patterns that a float64 round trip or a canonicalising copy would change: one of
# each kind, each with a counterpart in the other dtypes (support/dtypes.py SPECIALS lines
# them up), in an order the wire golden hashes (codec/test_wire_golden.py) pin.
SPECIAL_BITS = np.array(
    [
        0x7FC0_0001,  # quiet NaN with payload
        0xFFFF_FFFF,  # negative NaN, all payload bits set
        0x7F80_0001,  # signalling NaN
        0x7FBF_FFFF,  # signalling NaN, all payload bits
        0x8000_0000,  # -0.0
        0x0000_0000,  # +0.0
        0x7F80_0000,  # +inf
        0xFF80_0000,  # -inf
        0x0000_0001,  # smallest subnormal
        0x807F_FFFF,  # largest negative subnormal
        0x7F7F_FFFF,  # largest finite
        0x3F80_0000,  # 1.0
    ],
    dtype=np.uint32,
)

# All the patterns the tests pick from: SPECIAL_BITS, then more that a uniform draw rarely
# hits (the plain quiet NaN, a negative one with a payload, more subnormals, the smallest
# normal, the most negative finite).
ALL_SPECIAL_BITS = np.concatenate(
    [
        SPECIAL_BITS,
        np.array(
            [
                0x7FC0_0000,  # quiet NaN
                0xFFC0_1234,  # negative quiet NaN with payload
                0x8000_0001,  # smallest negative subnormal
                0x007F_FFFF,  # largest subnormal
                0x0080_0000,  # smallest normal
                0xFF7F_FFFF,  # most negative finite
            ],
            dtype=np.uint32,
        ),
    ]
)


def special(n: int) -> np.ndarray:
    """n values cycling through SPECIAL_BITS (NaN payloads, -0.0, subnormals...)."""
    return np.resize(SPECIAL_BITS, n).view(np.float32)


def float32_bits(values: Any) -> np.ndarray:
    """The raw bits of float32 values, flat, C order."""
    return np.ascontiguousarray(values, dtype=np.float32).reshape(-1).view(np.uint32)

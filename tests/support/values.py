"""float32 values whose bits a round trip must keep: NaN payloads, signed zeros,
infinities, subnormals."""

from __future__ import annotations

from typing import Any

import numpy as np

# Bit patterns that a float64 round trip or a canonicalising copy would change.
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


def special(n: int) -> np.ndarray:
    """n values cycling through SPECIAL_BITS (NaN payloads, -0.0, subnormals...)."""
    return np.resize(SPECIAL_BITS, n).view(np.float32)


def float32_bits(values: Any) -> np.ndarray:
    """The raw bits of float32 values, flat, C order."""
    return np.ascontiguousarray(values, dtype=np.float32).reshape(-1).view(np.uint32)

"""The int8 wire's blockwise absmax quantization (docs/spec/wire-format.md, "The int8
wire"), in numpy: float32 values as blocks of ``BLOCK`` int8 values with one float32 scale
each. Every step is one IEEE float32 operation, so that the native core (int8.rs) makes the
same bytes and decodes the same values:

- a block's scale is ``absmax / 127`` (float32 division); below 127 x 2^-149 it is
  ``absmax x 2^149 / 127`` rounded down, in steps of 2^-149 (at least one); the float32
  below it when ``127 * scale`` overflows (absmax near
  float32's largest); NaN (every value 0) for a block holding a NaN or an infinity, so
  that it arrives as all NaN; 0 for a block of zeros;
- a value is ``round_half_even(x / scale)`` (float32 division), clamped to -127..127;
- a value decodes as ``q * scale`` in float32.

Apart from the writer and the reader because both use it and it judges no bytes.
"""

from __future__ import annotations

import numpy as np

# Values a block holds (a chunk's last block may hold fewer); a receiver reads each
# block's length from the list offsets and assumes nothing about it.
BLOCK = 512

# Below 127 steps of the smallest subnormal (as bits) a scale is rounded down.
_SUBNORMAL_FLOOR = 127
_NAN = np.array([0x7FC0_0000], dtype=np.uint32).view(np.float32)[0]


def quantize(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``values`` (1-D float32) as (int8 values, one float32 scale per block)."""
    n = len(values)
    blocks = -(-n // BLOCK)
    padded = np.zeros(blocks * BLOCK, dtype=np.float32)
    padded[:n] = values
    rows = padded.reshape(blocks, BLOCK)
    finite = np.isfinite(rows).all(axis=1)
    with np.errstate(invalid="ignore"):
        absmax = np.abs(rows).max(axis=1, initial=np.float32(0))
    with np.errstate(over="ignore", invalid="ignore"):
        steps = absmax / np.float32(127)
        overflows = np.isinf(np.float32(127) * steps)
    steps = np.where(overflows, np.nextafter(steps, np.float32(0)), steps)
    # A few subnormal steps: rounded down (in units of the smallest subnormal, exact in
    # float64; at least one), so that the block's largest value takes all 127 steps.
    few = steps.view(np.uint32) < _SUBNORMAL_FLOOR
    units = np.where(few, absmax, np.float32(0)).astype(np.float64) * 2.0**149
    floored = np.maximum(np.floor(units / 127.0), 1.0).astype(np.uint32).view(np.float32)
    steps = np.where(few, floored, steps)
    scales = np.where(finite, np.where(absmax == 0, np.float32(0), steps), _NAN).astype(np.float32)
    usable = finite & (absmax != 0)
    q = np.zeros((blocks, BLOCK), dtype=np.int8)
    if usable.any():
        steps = rows[usable] / scales[usable][:, None]
        q[usable] = np.clip(np.rint(steps), -127, 127).astype(np.int8)
    return q.reshape(-1)[:n], scales


def dequantize(q: np.ndarray, scales: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """int8 values ``q``, block ``k`` being the next ``lengths[k]`` of them with scale
    ``scales[k]``, as float32."""
    # A peer's scale may overflow or be NaN: float32 arithmetic says what it gives.
    with np.errstate(over="ignore", invalid="ignore"):
        return q.astype(np.float32) * np.repeat(scales.astype(np.float32), lengths)

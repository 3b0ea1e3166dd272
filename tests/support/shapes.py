"""What the shape tests (tensors/test_shape*.py) share: the shapes tried, the
``gradient_shape`` metadata of payloads, and payloads carrying any metadata.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from support.values import float32_bits as bits


def values_of(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """A float32 array of ``shape`` holding raw bit patterns (NaN payloads included)."""
    n = math.prod(shape)
    words = np.random.default_rng(seed).integers(0, 2**32, n, dtype=np.uint32)
    return words.view(np.float32).reshape(shape)


def assert_shaped(got: Any, want: np.ndarray) -> None:
    assert isinstance(got, np.ndarray)
    assert got.dtype == np.float32
    assert got.shape == want.shape, (got.shape, want.shape)
    assert got.flags.c_contiguous
    assert np.array_equal(bits(got), bits(want))

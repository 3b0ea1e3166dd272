"""Shared fixtures: every semantic test runs against both implementations."""

from __future__ import annotations

import importlib
from types import ModuleType

import numpy as np
import pytest


def load_impl(name: str) -> ModuleType:
    """An implementation by name: "reference" is the pure-Python gradstream.reference;
    "native" is the package top level, which re-exports the Rust classes, and is skipped
    until the extension is built."""
    if name == "reference":
        return importlib.import_module("gradstream.reference")
    try:
        importlib.import_module("gradstream._native")
    except ImportError as exc:
        pytest.skip(f"native extension not built: {exc}")
    return importlib.import_module("gradstream")


@pytest.fixture(params=["reference", "native"])
def impl(request: pytest.FixtureRequest) -> ModuleType:
    """The module whose GradientStreamSession / GradientChunk are under test."""
    return load_impl(request.param)


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

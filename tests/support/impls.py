"""The two implementations by name, the pairs of them (encoder, decoder), the settings the
tests try, and what may come out of a decoder."""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Any

import pytest
from hypothesis import HealthCheck

from gradstream.errors import (
    ArrowIpcError,
    ChecksumMismatchError,
    FrameError,
    IncompleteStreamError,
)

IMPL_NAMES = ["reference", "native"]
PAIRS = [(a, b) for a in IMPL_NAMES for b in IMPL_NAMES]  # (encoder, decoder)
PAIR_IDS = [f"{a}-to-{b}" for a, b in PAIRS]
LAYOUTS = ["seed", "compact"]
CODECS = ["lz4", "zstd"]
PATHS = ["socket", "streams"]
# The impl fixture is function-scoped but stateless: hypothesis may reuse it.
FIXTURE_OK = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
# What a decoder may raise on hostile bytes (the rest must not escape).
ERROR_CLASSES = (ArrowIpcError, ChecksumMismatchError, FrameError, IncompleteStreamError)
# The fields of a GradientStreamError, to compare errors field by field.
ERROR_FIELDS = ("chunk_index", "offset", "expected", "actual", "received", "total", "detail")
# GRADSTREAM_DIFF_SCALE=20 multiplies every max_examples, for a longer soak run.
SCALE = float(os.environ.get("GRADSTREAM_DIFF_SCALE", "1"))


def examples(n: int) -> int:
    return max(1, round(n * SCALE))


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


def session(impl: ModuleType, chunk_size: int = 4, **kwargs: Any) -> Any:
    return impl.GradientStreamSession("s", chunk_size, **kwargs)

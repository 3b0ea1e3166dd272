"""One wording per error: the core's Rust ``Display`` and the Python class built from the
same fields (which the reference raises too) must say the same thing, for every variant."""

from __future__ import annotations

import pytest

import gradstream.errors as errors

native = pytest.importorskip("gradstream._native")


def test_error_texts_agree() -> None:
    samples = native._error_samples()
    classes = {type(exc) for exc, _ in samples}
    # Every class the core raises (SettingError and TensorSetError come from the bindings
    # and the tensor-set layer, not from the core's error type).
    assert classes == {
        errors.ArrowIpcError,
        errors.ChecksumMismatchError,
        errors.IncompleteStreamError,
        errors.StreamIOError,
        errors.FrameError,
        errors.GradientSizeError,
        errors.GradientDtypeError,
        errors.StreamTimeoutError,
    }
    for exc, rust_text in samples:
        if isinstance(exc, errors.StreamIOError) and not isinstance(exc, errors.StreamTimeoutError):
            # OSError renders as "[Errno N] strerror"; the core as "I/O error: strerror".
            assert rust_text == f"I/O error: {exc.strerror}"
            assert exc.errno is not None
            continue
        assert str(exc) == rust_text, type(exc).__name__

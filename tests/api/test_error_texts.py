"""One wording per error: the core's Rust ``Display`` and the Python class built from the
same fields (which the reference raises too) must say the same thing, for every variant."""

from __future__ import annotations

import pytest

import gradstream.errors as errors

native = pytest.importorskip("gradstream._native")


def test_error_texts_agree() -> None:
    samples = native._error_samples()
    classes = {type(exc) for exc, _ in samples}
    # Every class the core raises (SettingError comes from the bindings, not from the
    # core's error type).
    assert classes == {
        errors.ArrowIpcError,
        errors.ChecksumMismatchError,
        errors.IncompleteStreamError,
        errors.StreamIOError,
        errors.FrameError,
        errors.GradientSizeError,
        errors.GradientDtypeError,
        errors.StreamTimeoutError,
        errors.StreamDeadlineError,
        errors.TensorSetError,
        errors.ProtocolError,
        errors.AuthenticationError,
        errors.TlsError,
        errors.DeliveryError,
    }
    noted = 0
    for exc, rust_text in samples:
        # An error met on one tensor of a set (the core's Noted) is its inner error's
        # class with the note added; the core's text is what a traceback shows: the
        # error's text, then each note on a line of its own.
        rust_text, *rust_notes = rust_text.split("\n")
        assert getattr(exc, "__notes__", []) == rust_notes, type(exc).__name__
        noted += bool(rust_notes)
        if isinstance(exc, errors.StreamIOError) and not isinstance(exc, errors.StreamTimeoutError):
            # OSError renders as "[Errno N] strerror"; the core as "I/O error: strerror".
            assert rust_text == f"I/O error: {exc.strerror}"
            assert exc.errno is not None
            continue
        assert str(exc) == rust_text, type(exc).__name__
    assert noted >= 3
    set_errors = [exc for exc, _ in samples if isinstance(exc, errors.TensorSetError)]
    assert {exc.name for exc in set_errors} == {"fc.weight", None}

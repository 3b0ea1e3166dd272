"""What the differential tests (codec/test_differential*.py) share: gradients drawn
as raw bit patterns, frames as named tuples, and the outcome of a decoder (an array or a
``gradstream.errors`` exception) compared field by field between the implementations.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np
import pytest

import gradstream as gs
import gradstream._dtypes as _dtypes
import gradstream.reference as ref
from support.frames import HEADER
from support.impls import ERROR_CLASSES
from support.values import ALL_SPECIAL_BITS

IMPLS: dict[str, ModuleType] = {"native": gs, "reference": ref}


def footer_emptied(payload: bytes) -> bool:
    """Whether a damaged payload's footer now lists no record batch (as the reference's
    footer walk reads it): a valid Arrow file of no batches for a reader that accepts the
    footer, a chunk of no values. The spec's one exception allows that reading."""
    return ref._footer_blocks(memoryview(payload)) == []


def make_gradient(length: int, seed: int, kind: str) -> np.ndarray:
    """A float32 vector: 'bits' (uniform uint32 patterns), 'special' (half of them from
    ALL_SPECIAL_BITS) or 'normal' (standard normal floats)."""
    rng = np.random.default_rng(seed)
    if kind == "normal":
        return rng.standard_normal(length, dtype=np.float32)
    words = rng.integers(0, 2**32, size=length, dtype=np.uint32)
    if kind == "special":
        mask = rng.random(length) < 0.5
        words[mask] = rng.choice(ALL_SPECIAL_BITS, size=int(mask.sum()))
    return words.view(np.float32)


class Frame(NamedTuple):
    chunk_index: int
    total_chunks: int
    payload_len: int
    checksum: int
    payload: bytes

    def pack(self) -> bytes:
        return HEADER.pack(*self[:4]) + self.payload

    def __repr__(self) -> str:  # payloads are hundreds of bytes: keep failure reports short
        index, total, length, crc = self[:4]
        payload = f"<{len(self.payload)} bytes>"
        return f"Frame({index}, {total}, payload_len={length}, checksum={crc:#010x}, {payload})"


def join_frames(frames: list[Frame]) -> bytes:
    return b"".join(f.pack() for f in frames)


def frame_of(chunk: Any) -> Frame:
    payload = chunk.arrow_ipc_bytes
    return Frame(chunk.chunk_index, chunk.total_chunks, len(payload), chunk.checksum, payload)

    # ArrowIpcError: the detail is pyarrow's or arrow-rs's own wording; class and
    # chunk_index are all that must agree.


def sessions(chunk_size: int = 65_536, **kwargs: Any) -> dict[str, Any]:
    return {
        name: impl.GradientStreamSession("diff", chunk_size, **kwargs)
        for name, impl in IMPLS.items()
    }


def outcome_of(call: Callable[[], Any], who: str) -> Any:
    """Call a decoder: its array, or the gradstream.errors exception it raised; anything
    else escaping (a Rust panic derives from BaseException) fails the test."""
    try:
        out = call()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:
        if type(exc) not in ERROR_CLASSES:
            raise AssertionError(
                f"{who} let {type(exc).__module__}.{type(exc).__qualname__} escape: {exc!r}"
            ) from exc
        return exc
    assert isinstance(out, np.ndarray), f"{who} returned {type(out).__name__}"
    # A mutated field type can make a float16/bfloat16/float64 column: still a gradient.
    assert _dtypes.dtype_name(out.dtype) is not None and out.ndim == 1, (
        f"{who} returned {out.dtype} {out.shape}"
    )
    return out


def report_disagreements(counted: Counter[str], what: str) -> None:
    """Warn once with every disagreement docs/spec/decoding-rules.md leaves open (one Arrow library
    accepting a CRC-valid odd file that the other refuses), most frequent first."""
    if counted:
        lines = "\n".join(f"  {n:4d} x {case}" for case, n in counted.most_common())
        warnings.warn(f"{what} (allowed, recorded only):\n{lines}", stacklevel=2)


def counted_disagreements(what: str) -> tuple[Counter[str], Any]:
    """A counter of disagreements for a test module to fill, and the autouse module
    fixture that reports them (report_disagreements) once the module's tests are done;
    the module binds both to module-level names, where pytest finds the fixture."""
    counted: Counter[str] = Counter()

    @pytest.fixture(scope="module", autouse=True)
    def report() -> Iterator[None]:
        yield
        report_disagreements(counted, what)

    return counted, report

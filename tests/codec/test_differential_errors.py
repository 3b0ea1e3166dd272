"""Differential property tests of error agreement: hostile mutations of valid streams
(chunks dropped, duplicated, moved, fields changed, bytes flipped, cut or added), decoded
by the native extension and by ``gradstream.reference``, must give the same outcome: the
same ``gradstream.errors`` class with the same fields, or bit-equal values.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, NamedTuple

import numpy as np
import pytest
from hypothesis import event, given, note, settings
from hypothesis import strategies as st

pytest.importorskip("gradstream._native", reason="native extension not built")

import gradstream as gs
from gradstream.errors import (
    ArrowIpcError,
    ChecksumMismatchError,
    FrameError,
    IncompleteStreamError,
)
from support.differential import (
    IMPLS,
    Frame,
    counted_disagreements,
    footer_emptied,
    frame_of,
    join_frames,
    make_gradient,
    outcome_of,
    sessions,
)
from support.frames import HEADER
from support.impls import examples

U32_MAX = 0xFFFF_FFFF


# What the helpers below take to draw values: a composite's draw or st.data().draw.
Draw = Callable[..., Any]


# --------------------------------------------------------------------------- outcomes


Outcome = Any  # a decoded np.ndarray or a gradstream.errors exception


def run(decode: Callable[[Any], Any], arg: Any, who: str) -> Outcome:
    """Call a decoder; only gradstream.errors classes may escape, anything else fails."""
    outcome: Outcome = outcome_of(lambda: decode(arg), who)
    return outcome


def describe(outcome: Outcome) -> str:
    if isinstance(outcome, np.ndarray):
        return f"array of {len(outcome)} {outcome.dtype}"
    return f"{type(outcome).__name__}({vars(outcome)})"


def assert_same_outcome(native: Outcome, reference: Outcome, what: str) -> None:
    context = f"{what}: native gave {describe(native)}, reference gave {describe(reference)}"
    if isinstance(native, np.ndarray) or isinstance(reference, np.ndarray):
        assert isinstance(native, np.ndarray) and isinstance(reference, np.ndarray), context
        assert native.shape == reference.shape, context
        assert native.dtype == reference.dtype, context
        assert native.tobytes() == reference.tobytes(), context
        return
    assert type(native) is type(reference), context
    if isinstance(native, IncompleteStreamError):
        assert (native.received, native.total) == (reference.received, reference.total), context
        assert str(native) == str(reference), context
        return
    assert native.chunk_index == reference.chunk_index, context
    if isinstance(native, ChecksumMismatchError):
        assert (native.expected, native.actual) == (reference.expected, reference.actual), context
        assert str(native) == str(reference), context
    elif isinstance(native, FrameError):
        assert native.offset == reference.offset, context
        # docs/spec/decoding-rules.md fixes these texts, so they must match verbatim.
        assert native.detail == reference.detail, context


# Disagreements docs/spec/decoding-rules.md leaves open (a CRC-valid but odd Arrow file that one
# Arrow
# library accepts and the other refuses) are recorded here and reported once, not failed.
DISAGREEMENTS, _report_disagreements = counted_disagreements(
    "native and reference Arrow decoders disagreed on CRC-valid mutated payloads "
    "(counted per decode_chunks and decode_frames call)"
)


# --------------------------------------------------------------------------- error agreement


class Base(NamedTuple):
    """A valid encoding: its frames and the values it decodes to."""

    frames: list[Frame]
    values: np.ndarray

    def __repr__(self) -> str:
        return f"Base({len(self.values)} values in {self.frames!r})"


@st.composite
def bases(draw: st.DrawFn) -> Base:
    length = draw(st.integers(0, 40))
    chunk_size = draw(st.sampled_from([1, 2, 3, 5, 8, 64]))
    seed = draw(st.integers(0, 2**32 - 1))
    source = draw(st.sampled_from(sorted(IMPLS)))
    grad = make_gradient(length, seed, "special")
    chunks = IMPLS[source].GradientStreamSession("src", chunk_size).encode_gradient(grad)
    return Base([frame_of(c) for c in chunks], grad)


def edge_u32(draw: Draw, frames: list[Frame], current: int) -> int:
    total = frames[0].total_chunks if frames else 1
    edges = [0, 1, total, total + 1, U32_MAX, max(current - 1, 0), current + 1]
    value: int = draw(st.one_of(st.sampled_from(edges), st.integers(0, U32_MAX)))
    return min(value, U32_MAX)


FIELDS = ("chunk_index", "total_chunks", "payload_len", "checksum")


LIST_OPS = ("dup", "drop", "move", "reorder", "field", "concat")


FRAME_BYTE_OPS = ("flip", "truncate", "append")


CHUNK_PAYLOAD_OPS = ("flip", "truncate", "append")


def apply_list_op(draw: Draw, op: str, frames: list[Frame], fields: tuple[str, ...]) -> str:
    """Mutate a list of frames (or chunks, as frames) in place; return a description."""
    if op == "concat":
        frames.extend(draw(bases()).frames)
        return "concat another stream"
    if not frames:
        return f"{op} (nothing to do)"
    i = draw(st.integers(0, len(frames) - 1))
    if op == "dup":
        j = draw(st.integers(0, len(frames)))
        frames.insert(j, frames[i])
        return f"duplicate frame {i} at {j}"
    if op == "drop":
        del frames[i]
        return f"drop frame {i}"
    if op == "move":
        j = draw(st.integers(0, len(frames) - 1))
        frames.insert(j, frames.pop(i))
        return f"move frame {i} to {j}"
    if op == "reorder":
        frames[:] = draw(st.permutations(frames))
        return "reorder frames"
    assert op == "field"
    field = draw(st.sampled_from(fields))
    value = edge_u32(draw, frames, getattr(frames[i], field))
    changes: dict[str, Any] = {field: value}
    frames[i] = frames[i]._replace(**changes)
    return f"frame {i}: {field} = {value}"


def apply_payload_op(draw: Draw, op: str, frames: list[Frame]) -> str:
    """Mutate one chunk's payload bytes (keeping its stored checksum)."""
    if not frames:
        return f"{op} (nothing to do)"
    i = draw(st.integers(0, len(frames) - 1))
    payload = frames[i].payload
    if op == "flip" and payload:
        bit = draw(st.integers(0, 8 * len(payload) - 1))
        payload = flip_bit(payload, bit)
        what = f"flip payload bit {bit}"
    elif op in ("flip", "truncate"):
        cut = draw(st.integers(0, max(len(payload) - 1, 0)))
        payload = payload[:cut]
        what = f"truncate payload at {cut}"
    else:
        payload = payload + draw(st.binary(min_size=1, max_size=32))
        what = "append bytes to payload"
    frames[i] = frames[i]._replace(payload=payload, payload_len=len(payload))
    return f"chunk {i}: {what}"


def apply_byte_op(draw: Draw, op: str, wire: bytes) -> tuple[bytes, str]:
    if op == "flip" and wire:
        bit = draw(st.integers(0, 8 * len(wire) - 1))
        return flip_bit(wire, bit), f"flip bit {bit}"
    if op in ("flip", "truncate"):
        cut = draw(st.integers(0, max(len(wire) - 1, 0)))
        return wire[:cut], f"truncate at {cut}"
    extra = draw(
        st.one_of(
            st.binary(min_size=1, max_size=40),
            # Something that looks like a frame header, to get past rule 2.
            st.tuples(*[st.integers(0, 4)] * 4).map(lambda h: HEADER.pack(*h)),
        )
    )
    return wire + extra, f"append {len(extra)} bytes"


def flip_bit(data: bytes, bit: int) -> bytes:
    out = bytearray(data)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


def decoding_sessions(draw: Draw) -> dict[str, Any]:
    limit = draw(
        st.one_of(
            st.just(gs.DEFAULT_MAX_PAYLOAD_LEN),
            st.integers(1, 3000),
            st.just(U32_MAX),
        )
    )
    return sessions(7, max_payload_len=limit)


def make_chunk_objects(draw: Draw, frames: list[Frame]) -> list[Any]:
    """Chunk objects of either class (or duck-typed) from frames."""
    kinds = ["native", "reference", "duck"]
    pick = draw(st.sampled_from([*kinds, "mixed"]))
    start = draw(st.integers(0, 2)) if pick == "mixed" else 0
    out = []
    for i, f in enumerate(frames):
        kind = kinds[(start + i) % 3] if pick == "mixed" else pick
        fields = (f.chunk_index, f.total_chunks, f.payload, f.checksum)
        if kind == "duck":
            out.append(
                SimpleNamespace(
                    chunk_index=f.chunk_index,
                    total_chunks=f.total_chunks,
                    arrow_ipc_bytes=f.payload,
                    checksum=f.checksum,
                )
            )
        else:
            out.append(IMPLS[kind].GradientChunk("m", *fields))
    return out


def compare_decoders(ss: dict[str, Any], method: str, arg: Any, what: str) -> None:
    native = run(getattr(ss["native"], method), arg, f"native {method}")
    reference = run(getattr(ss["reference"], method), arg, f"reference {method}")
    event(f"{method}: {type(native).__name__}")
    assert_same_outcome(native, reference, what)


@settings(max_examples=examples(800), deadline=None)
@given(base=bases(), data=st.data())
def test_mutated_frames_agree(base: Base, data: st.DataObject) -> None:
    draw = data.draw
    frames = list(base.frames)
    ops = draw(st.lists(st.sampled_from(LIST_OPS + FRAME_BYTE_OPS), min_size=1, max_size=3))
    # Frame-level mutations first (they need frame boundaries), then byte-level ones.
    done = [apply_list_op(draw, op, frames, FIELDS) for op in ops if op in LIST_OPS]
    wire = join_frames(frames)
    for op in (op for op in ops if op in FRAME_BYTE_OPS):
        wire, what = apply_byte_op(draw, op, wire)
        done.append(what)
    note(f"mutations: {done}")
    ss = decoding_sessions(draw)
    wrap = draw(st.sampled_from([bytes, bytearray, memoryview]))
    compare_decoders(ss, "decode_frames", wrap(wire), f"decode_frames after {done}")


@settings(max_examples=examples(800), deadline=None)
@given(base=bases(), data=st.data())
def test_mutated_chunks_agree(base: Base, data: st.DataObject) -> None:
    draw = data.draw
    frames = list(base.frames)
    ops = draw(st.lists(st.sampled_from(LIST_OPS + CHUNK_PAYLOAD_OPS), min_size=1, max_size=3))
    done = []
    for op in ops:
        if op in LIST_OPS:
            done.append(
                apply_list_op(draw, op, frames, ("chunk_index", "total_chunks", "checksum"))
            )
        else:
            done.append(apply_payload_op(draw, op, frames))
    note(f"mutations: {done}")
    chunks = make_chunk_objects(draw, frames)
    compare_decoders(sessions(7), "decode_chunks", chunks, f"decode_chunks after {done}")


# One payload mutated and its CRC recomputed, so that the mutated file reaches the Arrow
# decoders. pyarrow and arrow-rs may differ on a strange-but-valid file (a flipped bit in
# padding or metadata); then each side must give a correct-length array or ArrowIpcError,
# and the disagreement is recorded rather than failed. If both accept, the values must be
# bit-equal.


def patched_payload(draw: Draw, base: Base) -> tuple[list[Frame], int, str]:
    frames = list(base.frames)
    k = draw(st.integers(0, len(frames) - 1))
    payload = frames[k].payload
    kind = draw(st.sampled_from(["flip", "flip", "flip", "flip", "truncate", "append"]))
    if kind == "flip":
        bits = draw(st.lists(st.integers(0, 8 * len(payload) - 1), min_size=1, max_size=2))
        for bit in bits:
            payload = flip_bit(payload, bit)
        what = f"flip payload bits {bits} (of {len(payload)} bytes)"
    elif kind == "truncate":
        cut = draw(st.integers(0, len(payload) - 1))
        payload = payload[:cut]
        what = f"truncate payload at {cut}"
    else:
        extra = draw(st.binary(min_size=1, max_size=16))
        payload = payload + extra
        what = f"append {extra!r} to payload"
    frames[k] = frames[k]._replace(
        payload=payload, payload_len=len(payload), checksum=zlib.crc32(payload)
    )
    return frames, k, f"chunk {k}: {what}, CRC patched"


def is_dtype_disagreement(outcome: Outcome) -> bool:
    """A FrameError of the dtype rules (docs/spec/decoding-rules.md, step 8)."""
    return isinstance(outcome, FrameError) and outcome.detail.startswith(
        ("chunks disagree on the value dtype", "chunks disagree on gradient_dtype")
    )


def assert_agree_or_arrow_error(
    native: Outcome, reference: Outcome, k: int, payload: bytes, original: np.ndarray, what: str
) -> None:
    expected_len = len(original)
    if isinstance(native, np.ndarray) and isinstance(reference, np.ndarray):
        assert_same_outcome(native, reference, what)
        event("patched payload: both accept")
        return
    if not isinstance(native, np.ndarray) and not isinstance(reference, np.ndarray):
        if is_dtype_disagreement(native) or is_dtype_disagreement(reference):
            # The flip made a valid column of another dtype (float16, float64...) in one
            # reader's eyes, or in both: the chunks then disagree on their dtype.
            for out in (native, reference):
                assert is_dtype_disagreement(out) or isinstance(out, ArrowIpcError), what
            if type(native) is not type(reference):
                DISAGREEMENTS["one reader sees another dtype, the other refuses"] += 1
            event("patched payload: a dtype disagreement")
            return
        assert_same_outcome(native, reference, what)
        assert isinstance(native, ArrowIpcError), what
        assert native.chunk_index == k, what
        event("patched payload: both ArrowIpcError")
        return
    accepted = "native" if isinstance(native, np.ndarray) else "reference"
    refused = reference if accepted == "native" else native
    if footer_emptied(payload):
        # The flip emptied the footer's record-batch list: a valid Arrow file of no
        # batches, i.e. no values for this chunk, for arrow-rs (as for the original);
        # pyarrow may read the damaged footer differently and refuse. Both readings are
        # allowed.
        DISAGREEMENTS[f"only {accepted} accepts a footer listing no batches (0 values)"] += 1
        event(f"patched payload: only {accepted} accepts an empty footer")
        return
    for who, out in (("native", native), ("reference", reference)):
        if isinstance(out, np.ndarray):
            # The same bytes, though a flip in the schema may have made them another
            # dtype's (8 bytes of float32 read as one float64, say).
            assert out.nbytes == 4 * expected_len, (
                f"{what}: {who} accepted {len(out)} values of {out.dtype}"
            )
        else:
            assert isinstance(out, ArrowIpcError) or is_dtype_disagreement(out), (
                f"{what}: {who} gave {describe(out)}"
            )
            assert out.chunk_index == k, f"{what}: {who} gave {describe(out)}"
    out = native if accepted == "native" else reference
    same = out.dtype == np.float32 and np.array_equal(out.view(np.uint32), original)
    intact = "values intact" if same else "values changed"
    detail = re.sub(r"\b\d+\b", "N", refused.detail)  # group by wording, not by numbers
    DISAGREEMENTS[f"only {accepted} accepts ({intact}); other says: {detail}"] += 1
    event(f"patched payload: only {accepted} accepts")


@settings(max_examples=examples(800), deadline=None)
@given(base=bases(), data=st.data())
def test_crc_patched_payload_mutation(base: Base, data: st.DataObject) -> None:
    frames, k, what = patched_payload(data.draw, base)
    note(what)
    ss = sessions(7)
    chunks = make_chunk_objects(data.draw, frames)
    wire = join_frames(frames)
    for method, arg in (("decode_chunks", chunks), ("decode_frames", wire)):
        native = run(getattr(ss["native"], method), arg, f"native {method}")
        reference = run(getattr(ss["reference"], method), arg, f"reference {method}")
        assert_agree_or_arrow_error(
            native,
            reference,
            k,
            frames[k].payload,
            base.values.view(np.uint32),
            f"{method} after {what}",
        )

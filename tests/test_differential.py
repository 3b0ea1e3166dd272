"""Differential property tests: the native extension against ``gradstream.reference``.

Hypothesis draws gradients (lengths biased toward chunk-size multiples and their
neighbours, values drawn as raw float32 bit patterns) and hostile mutations of valid
streams; the native module and the pure-Python reference must agree on every outcome:
the same chunks, bit-equal values, or the same ``gradstream.errors`` class with the same
fields. Hand-picked cases of single rules live in test_semantics.py.
"""

from __future__ import annotations

import re
import warnings
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from types import ModuleType, SimpleNamespace
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, event, example, given, note, settings
from hypothesis import strategies as st

pytest.importorskip("gradstream._native", reason="native extension not built")

import gradstream as gs
import gradstream._dtypes as _dtypes
import gradstream.reference as ref
from gradstream.errors import (
    ArrowIpcError,
    ChecksumMismatchError,
    FrameError,
    IncompleteStreamError,
)
from support.frames import HEADER, HEADER_LEN
from support.impls import ERROR_CLASSES, examples

U32_MAX = 0xFFFF_FFFF
IMPLS: dict[str, ModuleType] = {"native": gs, "reference": ref}


# What the helpers below take to draw values: a composite's draw or st.data().draw.
Draw = Callable[..., Any]


# Round trips: at most this many values and this many chunks per gradient, so that the
# reference (tens of microseconds per chunk and operation) keeps the file fast.
MAX_LEN = 300_000
MAX_CHUNKS = 600
# Arrival orders of up to this many chunks are hypothesis permutations (so they shrink);
# longer ones are numpy permutations seeded by hypothesis.
MAX_DRAWN_PERMUTATION = 64

# Bit patterns the uniform draw rarely hits: NaNs with payloads (quiet and signalling,
# both signs), infinities, signed zeros, subnormals, extremes.
SPECIAL_BITS = np.array(
    [
        0x7FC0_0000,  # quiet NaN
        0x7FC0_0001,  # quiet NaN with payload
        0x7F80_0001,  # signalling NaN
        0x7FBF_FFFF,  # signalling NaN, all payload bits
        0xFFFF_FFFF,  # negative NaN, all payload bits
        0xFFC0_1234,
        0x7F80_0000,  # +inf
        0xFF80_0000,  # -inf
        0x0000_0000,  # +0.0
        0x8000_0000,  # -0.0
        0x0000_0001,  # smallest subnormal
        0x8000_0001,
        0x007F_FFFF,  # largest subnormal
        0x807F_FFFF,
        0x0080_0000,  # smallest normal
        0x7F7F_FFFF,  # largest finite
        0xFF7F_FFFF,
        0x3F80_0000,  # 1.0
    ],
    dtype=np.uint32,
)


# --------------------------------------------------------------------------- helpers


def make_gradient(length: int, seed: int, kind: str) -> np.ndarray:
    """A float32 vector: 'bits' (uniform uint32 patterns), 'special' (half of them from
    SPECIAL_BITS) or 'normal' (standard normal floats)."""
    rng = np.random.default_rng(seed)
    if kind == "normal":
        return rng.standard_normal(length, dtype=np.float32)
    words = rng.integers(0, 2**32, size=length, dtype=np.uint32)
    if kind == "special":
        mask = rng.random(length) < 0.5
        words[mask] = rng.choice(SPECIAL_BITS, size=int(mask.sum()))
    return words.view(np.float32)


def n_chunks_for(length: int, chunk_size: int) -> int:
    size = max(chunk_size, 1)
    return max(1, -(-length // size))


def assert_bits(actual: Any, expected_bits: np.ndarray, what: str) -> None:
    assert isinstance(actual, np.ndarray), what
    assert actual.dtype == np.float32, what
    assert actual.ndim == 1, what
    assert actual.shape == expected_bits.shape, f"{what}: {actual.shape} != {expected_bits.shape}"
    # array_equal on uint32 views: NaN payloads, -0.0 and subnormals must survive exactly.
    assert np.array_equal(actual.view(np.uint32), expected_bits), what


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


def split_frames(wire: bytes) -> list[Frame]:
    """Split a *valid* frame stream into its frames."""
    frames, offset = [], 0
    while offset < len(wire):
        index, total, length, crc = HEADER.unpack_from(wire, offset)
        body = offset + HEADER_LEN
        assert body + length <= len(wire), "encode_frames wrote a truncated frame"
        frames.append(Frame(index, total, length, crc, wire[body : body + length]))
        offset = body + length
    return frames


def join_frames(frames: list[Frame]) -> bytes:
    return b"".join(f.pack() for f in frames)


def frame_of(chunk: Any) -> Frame:
    payload = chunk.arrow_ipc_bytes
    return Frame(chunk.chunk_index, chunk.total_chunks, len(payload), chunk.checksum, payload)


# --------------------------------------------------------------------------- outcomes


Outcome = Any  # a decoded np.ndarray or a gradstream.errors exception


def run(decode: Callable[[Any], Any], arg: Any, who: str) -> Outcome:
    """Call a decoder; only gradstream.errors classes may escape, anything else fails."""
    try:
        out = decode(arg)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # PanicException derives from BaseException
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
        # The README fixes these texts, so they must match verbatim.
        assert native.detail == reference.detail, context
    # ArrowIpcError: the detail is pyarrow's or arrow-rs's own wording; class and
    # chunk_index are all that must agree.


def sessions(chunk_size: int = 65_536, **kwargs: Any) -> dict[str, Any]:
    return {
        name: impl.GradientStreamSession("diff", chunk_size, **kwargs)
        for name, impl in IMPLS.items()
    }


# Disagreements the README leaves open (a CRC-valid but odd Arrow file that one Arrow
# library accepts and the other refuses) are recorded here and reported once, not failed.
DISAGREEMENTS: Counter[str] = Counter()


@pytest.fixture(scope="module", autouse=True)
def _report_disagreements() -> Iterator[None]:
    yield
    if DISAGREEMENTS:
        lines = "\n".join(f"  {n:4d} x {what}" for what, n in DISAGREEMENTS.most_common())
        warnings.warn(
            "native and reference Arrow decoders disagreed on CRC-valid mutated payloads "
            f"(allowed, recorded only; counted per decode_chunks and decode_frames call):\n{lines}",
            stacklevel=1,
        )


# --------------------------------------------------------------------------- 1. round trips


class Case(NamedTuple):
    chunk_size: int  # as given to the session; 0 is raised to 1
    length: int
    seed: int
    values: str  # 'bits' | 'special' | 'normal'
    order: tuple[int, ...] | None  # arrival order; None: a permutation seeded by `seed`
    layout: str = "seed"  # payload columns: 'seed' (index + value) or 'compact' (value)


CHUNK_SIZES = st.one_of(st.sampled_from([0, 1, 2, 7, 4096, 65_536]), st.integers(1, 100_000))


@st.composite
def cases(draw: st.DrawFn) -> Case:
    chunk_size = draw(CHUNK_SIZES)
    size = max(chunk_size, 1)
    cap = min(MAX_LEN, size * MAX_CHUNKS)
    near_multiple = st.builds(
        lambda k, delta: k * size + delta,
        st.integers(1, cap // size),
        st.sampled_from([-1, 0, 1]),
    )
    length = draw(
        st.one_of(
            st.sampled_from([0, 1]),
            near_multiple,
            near_multiple,  # twice: the interesting sizes get half of all draws
            st.integers(0, cap),
        )
    )
    length = min(length, cap)
    seed = draw(st.integers(0, 2**32 - 1))
    values = draw(st.sampled_from(["bits", "special", "normal"]))
    n = n_chunks_for(length, chunk_size)
    order = tuple(draw(st.permutations(range(n)))) if n <= MAX_DRAWN_PERMUTATION else None
    layout = draw(st.sampled_from(["seed", "compact"]))
    return Case(chunk_size, length, seed, values, order, layout)


def edge_examples(test: Callable[..., None]) -> Callable[..., None]:
    """@example the edge lengths around chunk multiples for chunk sizes 4096 and 65536."""
    for size in (4096, 65_536):
        lengths = {0, 1, 2, size - 1, size, size + 1, 2 * size - 1, 2 * size, 2 * size + 1}
        lengths |= {k * size + d for k in (3, MAX_LEN // size) for d in (-1, 0, 1)}
        lengths |= {MAX_LEN}
        for i, length in enumerate(sorted(n for n in lengths if 0 <= n <= MAX_LEN)):
            test = example(case=Case(size, length, i, "special", None))(test)
    # A few more: chunk size 0 (raised to 1), 1 and 7 around their multiples.
    for size, length in [(0, 0), (0, 1), (0, 2), (1, 1), (1, 600), (7, 6), (7, 7), (7, 8)]:
        test = example(case=Case(size, length, length, "bits", None))(test)
    return test


@settings(max_examples=examples(120), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
@edge_examples
def test_round_trip_agrees(case: Case) -> None:
    grad = make_gradient(case.length, case.seed, case.values)
    expected = grad.view(np.uint32)
    n = n_chunks_for(case.length, case.chunk_size)
    event(f"chunks: {'1' if n == 1 else '2-16' if n <= 16 else '17+'}")
    ss = sessions(case.chunk_size, layout=case.layout)

    # Encoding: the same chunk sequence from both, each with a correct CRC.
    chunks = {name: s.encode_gradient(grad) for name, s in ss.items()}
    for name, cs in chunks.items():
        assert len(cs) == n, name
        assert [c.chunk_index for c in cs] == list(range(n)), name
        assert all(c.total_chunks == n for c in cs), name
        for c in cs:
            assert isinstance(c, IMPLS[name].GradientChunk)
            assert c.checksum == zlib.crc32(c.arrow_ipc_bytes), (name, c.chunk_index)

    # Chunk k holds exactly values [k*c, (k+1)*c): each payload decoded alone, by the
    # other implementation (as chunk 0 of 1), gives its slice.
    size = max(case.chunk_size, 1)
    if n <= MAX_DRAWN_PERMUTATION:
        for name, cs in chunks.items():
            other = "reference" if name == "native" else "native"
            for k, c in enumerate(cs):
                alone = IMPLS[other].GradientChunk("x", 0, 1, c.arrow_ipc_bytes, c.checksum)
                got = ss[other].decode_chunks([alone])
                assert_bits(got, expected[k * size : (k + 1) * size], f"{name} chunk {k}")

    frames = {name: s.encode_frames(grad) for name, s in ss.items()}
    for name, wire in frames.items():
        assert isinstance(wire, bytes), name
        # The frames are exactly the chunks, header + payload, in index order.
        assert split_frames(wire) == [frame_of(c) for c in chunks[name]], name
        assert ss[name].encode_frames(grad, as_buffer=True).to_pybytes() == wire, name

    # Decoding: all four (decoder, encoder) pairs, for chunks and for frames.
    for dec, s in ss.items():
        for src in IMPLS:
            assert_bits(s.decode_chunks(chunks[src]), expected, f"{dec} chunks of {src}")
            assert_bits(s.decode_frames(frames[src]), expected, f"{dec} frames of {src}")

    # Any arrival order decodes the same, for chunks and for frames.
    order = case.order
    if order is None:
        order = tuple(np.random.default_rng(case.seed).permutation(n).tolist())
    for src in IMPLS:
        shuffled = [chunks[src][i] for i in order]
        wire = join_frames([frame_of(c) for c in shuffled])
        for dec, s in ss.items():
            assert_bits(s.decode_chunks(shuffled), expected, f"{dec} shuffled chunks of {src}")
            assert_bits(s.decode_frames(wire), expected, f"{dec} shuffled frames of {src}")

    # A list mixing native and reference chunks (and arriving in that order).
    mixed = [chunks["native" if i % 2 else "reference"][i] for i in order]
    for dec, s in ss.items():
        assert_bits(s.decode_chunks(iter(mixed)), expected, f"{dec} mixed chunks")


# --------------------------------------------------------------------------- 2. error agreement


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
    """A FrameError of the dtype rules (README "Decoding rules", step 8)."""
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
    if ref._footer_blocks(memoryview(payload)) == []:
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


# --------------------------------------------------------------------------- 4. regressions
# Disagreements the property test above found, where one side silently returned fewer
# values than the chunk holds while the other raised ArrowIpcError. Both now refuse.


class Flat:
    """Just enough bounds-checked flatbuffer reading to find fields of the Arrow IPC
    footer and messages. Every method returns None when the bytes do not lead there."""

    def __init__(self, buf: bytes) -> None:
        self.buf = buf

    def read(self, pos: int | None, size: int, signed: bool = False) -> int | None:
        if pos is None or not 0 <= pos <= len(self.buf) - size:
            return None
        return int.from_bytes(self.buf[pos : pos + size], "little", signed=signed)

    def root(self, pos: int) -> int | None:
        offset = self.read(pos, 4)
        return None if offset is None else pos + offset

    def slot(self, table: int | None, field: int) -> int | None:
        """Position of the vtable slot of `field` (None if the vtable is too short)."""
        soffset = self.read(table, 4, signed=True)
        if table is None or soffset is None:
            return None
        vtable = table - soffset
        vtable_len = self.read(vtable, 2)
        slot = vtable + 4 + 2 * field
        if vtable_len is None or vtable_len < 6 + 2 * field:
            return None
        return slot if slot + 2 <= len(self.buf) else None

    def field(self, table: int | None, field: int) -> int | None:
        """Position of a present field's data; None if absent (or unreadable)."""
        voffset = self.read(self.slot(table, field), 2)
        return None if not voffset or table is None else table + voffset

    def vector(self, pos: int | None) -> tuple[int, int] | None:
        """(start, length) of the vector a field at `pos` points to."""
        offset = self.read(pos, 4)
        length = None if offset is None or pos is None else self.read(pos + offset, 4)
        if offset is None or length is None or pos is None:
            return None
        return pos + offset + 4, length


# Field ids in Arrow's File.fbs (Footer) and Message.fbs (Message).
FOOTER_RECORD_BATCHES = 3
MESSAGE_HEADER_TYPE = 1
BLOCK_SIZE = 24  # struct Block { offset: long; metaDataLength: int; bodyLength: long }


def footer_table(flat: Flat) -> int | None:
    buf = flat.buf
    footer_len = flat.read(len(buf) - 10, 4)
    if footer_len is None or buf[-6:] != b"ARROW1" or footer_len > len(buf) - 10:
        return None
    return flat.root(len(buf) - 10 - footer_len)


def footer_lacks_record_batches(payload: bytes) -> bool:
    """The footer is readable and its recordBatches field is absent."""
    flat = Flat(payload)
    table = footer_table(flat)
    return table is not None and flat.field(table, FOOTER_RECORD_BATCHES) is None


def header_type_positions(payload: bytes) -> list[int | None]:
    """For each record-batch block listed in the footer: the position of its message's
    header_type byte (None: the field is absent, which reads as NONE)."""
    flat = Flat(payload)
    blocks = flat.vector(flat.field(footer_table(flat), FOOTER_RECORD_BATCHES))
    if blocks is None:
        return []
    start, count = blocks
    positions = []
    for i in range(min(count, 64)):
        offset = flat.read(start + i * BLOCK_SIZE, 8, signed=True)
        if offset is None:
            break
        # An encapsulated message: 0xFFFFFFFF continuation, int32 length, flatbuffer.
        body = offset + 8 if flat.read(offset, 4) == 0xFFFF_FFFF else offset + 4
        if flat.read(body, 4) is None:
            break
        positions.append(flat.field(flat.root(body), MESSAGE_HEADER_TYPE))
    return positions


def has_none_message_block(payload: bytes) -> bool:
    """A record-batch block of the footer holds a message of header type NONE (0)."""
    return any(pos is None or payload[pos] == 0 for pos in header_type_positions(payload))


def without_record_batches(payload: bytes) -> bytes:
    """The payload with its footer's recordBatches field marked absent."""
    flat = Flat(payload)
    slot = flat.slot(footer_table(flat), FOOTER_RECORD_BATCHES)
    assert slot is not None and not footer_lacks_record_batches(payload)
    out = payload[:slot] + b"\x00\x00" + payload[slot + 2 :]
    assert footer_lacks_record_batches(out)
    return out


def with_none_message(payload: bytes) -> bytes:
    """The payload with its (first) record batch message's header type set to NONE."""
    (pos, *_) = header_type_positions(payload)
    assert pos is not None and payload[pos] == 3  # MessageHeader.RecordBatch
    out = payload[:pos] + b"\x00" + payload[pos + 1 :]
    assert has_none_message_block(out)
    return out


SEED_VALUES = np.array([1.5, -0.0, np.nan], dtype=np.float32)


def seed_payload(source: str) -> bytes:
    session = IMPLS[source].GradientStreamSession("s")
    return bytes(session.encode_gradient(SEED_VALUES)[0].arrow_ipc_bytes)


def assert_both_refuse(payload: bytes) -> None:
    """Both implementations raise ArrowIpcError naming chunk 0, for chunks and frames."""
    ss = sessions()
    crc = zlib.crc32(payload)
    chunk = gs.GradientChunk("s", 0, 1, payload, crc)
    wire = HEADER.pack(0, 1, len(payload), crc) + payload
    for method, arg in (("decode_chunks", [chunk]), ("decode_frames", wire)):
        for name, session in ss.items():
            with pytest.raises(ArrowIpcError) as info:
                getattr(session, method)(arg)
            assert info.value.chunk_index == 0, (name, method)


@pytest.mark.parametrize("source", sorted(IMPLS))
def test_footer_without_record_batches_is_refused(source: str) -> None:
    # pyarrow reads such a footer as "no batches" (0 values: the chunk's data silently
    # gone); arrow-rs, which the original runs, refuses it. Both of ours refuse.
    assert_both_refuse(without_record_batches(seed_payload(source)))


@pytest.mark.parametrize("source", sorted(IMPLS))
def test_record_batch_block_with_none_message_is_refused(source: str) -> None:
    # arrow-rs's FileDecoder returns "no batch" for a NONE message; skipping it would lose
    # the block's values silently.
    assert_both_refuse(with_none_message(seed_payload(source)))


@pytest.mark.parametrize("source", sorted(IMPLS))
def test_corrupt_leading_magic_is_refused(source: str) -> None:
    payload = bytearray(seed_payload(source))
    payload[0] ^= 1
    assert_both_refuse(bytes(payload))


def test_detectors_see_valid_payloads_as_valid() -> None:
    # The detectors must not excuse anything in an untouched payload of either writer.
    for source in IMPLS:
        payload = seed_payload(source)
        assert not footer_lacks_record_batches(payload)
        assert not has_none_message_block(payload)
        assert header_type_positions(payload) != []


@pytest.mark.parametrize("source", sorted(IMPLS))
def test_footer_listing_a_block_twice_is_refused(source: str) -> None:
    # The amplification attack: without the check, each listing decodes the block again,
    # so a small payload could decode to gigabytes.
    schema = pa.schema([pa.field("value", pa.float32(), nullable=False)])
    batch = pa.record_batch([pa.array(np.ones(64, np.float32))], schema=schema)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, schema) as writer:
        writer.write_batch(batch)
        writer.write_batch(batch)
    payload = sink.getvalue().to_pybytes()
    blocks = ref._footer_blocks(memoryview(payload))
    assert blocks is not None and len(blocks) == 2
    first, second = blocks[0][0], blocks[1][0]
    footer_at = len(payload) - 10 - int.from_bytes(payload[-10:-6], "little")
    at = payload.index(second.to_bytes(8, "little"), footer_at)
    patched = payload[:at] + first.to_bytes(8, "little") + payload[at + 8 :]
    assert ref._footer_blocks(memoryview(patched)) == [blocks[0], blocks[0]]
    assert_both_refuse(patched)

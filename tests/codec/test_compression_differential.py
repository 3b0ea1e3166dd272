"""Compressed payloads, differential: the native extension and the reference decode the
same compressed payloads, valid and mutated (fields of the batch rewritten through
support/payloads.py, each with a correct CRC), to the same outcome.
"""

from __future__ import annotations

import functools
import importlib
import re
import resource
import struct
import zlib
from types import ModuleType
from typing import Any, NamedTuple

import hypothesis
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

import gradstream.reference as ref
from gradstream.errors import (
    ArrowIpcError,
    ChecksumMismatchError,
    FrameError,
    IncompleteStreamError,
)
from support.compressed import (
    CODEC_IDS,
    assert_arrow_error,
    assert_bit_equal,
    decode_both_ways,
    session,
    sparse,
    split_frames,
)
from support.differential import counted_disagreements, footer_emptied, outcome_of
from support.frames import frame
from support.impls import CODECS, FIXTURE_OK, LAYOUTS, examples
from support.impls import load_impl as module
from support.payloads import Flat, footer_blocks, rebuild, the_batch
from support.values import ALL_SPECIAL_BITS
from support.values import float32_bits as bits

# --------------------------------------------------------------------------- differential


def event(value: str) -> None:
    """hypothesis's event, and nothing in a plain test (the fixed cases call the checks too)."""
    if currently_in_test_context():
        hypothesis.event(value)


def note(value: str) -> None:
    if currently_in_test_context():
        hypothesis.note(value)


def native_or_skip() -> ModuleType:
    return module("native")


try:
    importlib.import_module("gradstream._native")
    NATIVE_BUILT = True
except ImportError:
    NATIVE_BUILT = False


needs_native = pytest.mark.skipif(not NATIVE_BUILT, reason="native extension not built")


def gradients() -> st.SearchStrategy[np.ndarray]:
    """Gradients of 0..3000 values: raw bit patterns, special values, or mostly zeros."""

    @st.composite
    def build(draw: st.DrawFn) -> np.ndarray:
        n = draw(st.one_of(st.sampled_from([0, 1, 63, 64, 65]), st.integers(0, 3000)))
        seed = draw(st.integers(0, 2**32 - 1))
        kind = draw(st.sampled_from(["bits", "special", "zeros", "sparse"]))
        rng = np.random.default_rng(seed)
        words = rng.integers(0, 2**32, n, dtype=np.uint32)
        if kind == "special":
            words = rng.choice(ALL_SPECIAL_BITS, n)
        elif kind == "zeros":
            words[:] = 0
        elif kind == "sparse":
            words[rng.random(n) < 0.95] = 0
        return np.ascontiguousarray(words, dtype=np.uint32).view(np.float32)

    return build()


@needs_native
@settings(max_examples=examples(60), deadline=None, suppress_health_check=FIXTURE_OK)
@given(
    grad=gradients(),
    codec=st.sampled_from(CODECS),
    layout=st.sampled_from(LAYOUTS),
    chunk_size=st.sampled_from([1, 7, 64, 1000, 4096]),
)
def test_differential_round_trip(grad: np.ndarray, codec: str, layout: str, chunk_size: int):
    native = native_or_skip()
    impls = {"native": native, "reference": ref}
    event(f"{codec} {layout}")
    for src, mod in impls.items():
        s = mod.GradientStreamSession("d", chunk_size, layout=layout, compression=codec)
        wire = s.encode_frames(grad)
        chunks = s.encode_gradient(grad)
        for c in chunks:
            assert c.checksum == zlib.crc32(c.arrow_ipc_bytes)
        for dst, other in impls.items():
            rx = other.GradientStreamSession("r", 3)
            assert_bit_equal(rx.decode_frames(wire), grad, f"{src} -> {dst} frames")
            assert_bit_equal(rx.decode_chunks(chunks), grad, f"{src} -> {dst} chunks")


# CRC-valid mutations of compressed payloads. Both implementations must give the same
# exception class and chunk_index (and, for FrameError, the same detail and offset). When
# one accepts what the other's Arrow library refuses (a flipped bit in padding or in
# metadata that one reader tolerates), the refusal must be ArrowIpcError on that chunk
# and the acceptance must hold the chunk's value count; these are counted and reported.
DISAGREEMENTS, _report_disagreements = counted_disagreements(
    "native and reference disagreed on CRC-valid mutated compressed payloads"
)


def describe(outcome: Any) -> str:
    if isinstance(outcome, np.ndarray):
        return f"array of {len(outcome)} float32"
    return f"{type(outcome).__name__}({vars(outcome)})"


INTERESTING_PREFIXES = [-1, 0, 1, 2**40, 2**63 - 1, -2]


class Mutated(NamedTuple):
    frames: list[tuple[int, int, int, bytes]]  # (chunk_index, total_chunks, crc, payload)
    k: int  # the chunk whose payload was mutated (its CRC recomputed)
    original: bytes  # that payload before the mutation
    what: str

    def __repr__(self) -> str:  # payloads are hundreds of bytes: keep reports short
        return f"Mutated({self.what!r})"


@st.composite
def mutated(draw: st.DrawFn) -> Mutated:
    """A compressed gradient's frames with one payload mutated and its CRC recomputed."""
    n = draw(st.integers(0, 300))
    chunk_size = draw(st.sampled_from([50, 128, 1000]))
    codec = draw(st.sampled_from(CODECS))
    layout = draw(st.sampled_from(LAYOUTS))
    source = draw(st.sampled_from(["native", "reference"]))
    grad = sparse(n, seed=draw(st.integers(0, 1000)))
    mod = native_or_skip() if source == "native" else ref
    s = mod.GradientStreamSession("m", chunk_size, layout=layout, compression=codec)
    frames = split_frames(s.encode_frames(grad))
    k = draw(st.integers(0, len(frames) - 1))
    index, total, _, payload = frames[k]
    data = bytearray(payload)
    kind = draw(st.sampled_from(["flip", "flip", "prefix", "field", "truncate", "append"]))
    what = f"{source} {codec} {layout}, {n} values by {chunk_size}, chunk {k}: "
    if kind == "flip":
        flips = draw(st.lists(st.integers(0, 8 * len(data) - 1), min_size=1, max_size=3))
        for bit in flips:
            data[bit // 8] ^= 1 << (bit % 8)
        what += f"flip bits {flips}"
    elif kind in ("prefix", "field"):
        batch = the_batch(payload)
        (block,) = footer_blocks(payload)
        body = block.offset + block.meta_len
        if kind == "prefix" and any(length >= 8 for _, length in batch.buffers):
            o = draw(st.sampled_from([o for o, length in batch.buffers if length >= 8]))
            rows = batch.rows
            value = draw(st.sampled_from([*INTERESTING_PREFIXES, 4 * rows, 8 * rows, 8 * rows + 1]))
            struct.pack_into("<q", data, body + o, value)
            what += f"buffer at {o} declares {value}"
        else:
            field = draw(st.sampled_from(["rows", "codec", "method", "length"]))
            value = draw(st.sampled_from([-1, 0, 1, 2, 7, 8, 2000, 2**31]))
            if field == "rows":
                batch = batch._replace(rows=value)
            elif field == "codec":
                batch = batch._replace(compression=(max(-128, min(value, 127)), 0))
            elif field == "method":
                batch = batch._replace(compression=(CODEC_IDS[codec], max(-128, min(value, 127))))
            elif batch.buffers:
                i = draw(st.integers(0, len(batch.buffers) - 1))
                buffers = list(batch.buffers)
                buffers[i] = (buffers[i][0], value)
                batch = batch._replace(buffers=buffers)
            data = bytearray(rebuild(payload, batch))
            what += f"{field} = {value}"
    elif kind == "truncate":
        cut = draw(st.integers(0, len(data) - 1))
        del data[cut:]
        what += f"truncate at {cut}"
    else:
        extra = draw(st.binary(min_size=1, max_size=16))
        data += extra
        what += f"append {extra!r}"
    frames[k] = (index, total, zlib.crc32(data), bytes(data))
    event(f"mutation: {kind}")
    return Mutated(frames, k, payload, what)


def alone(mod: ModuleType, payload: bytes) -> Any:
    """The outcome of one payload decoded as the only chunk, with no limit in the way."""
    s = mod.GradientStreamSession("a", 7)
    chunk = mod.GradientChunk("a", 0, 1, payload, zlib.crc32(payload))
    return outcome_of(lambda: s.decode_chunks([chunk]), mod.__name__)


def assert_same_error(nat: Any, refo: Any, context: str) -> None:
    assert type(nat) is type(refo), context
    if isinstance(nat, IncompleteStreamError):
        assert (nat.received, nat.total) == (refo.received, refo.total), context
        return
    assert nat.chunk_index == refo.chunk_index, context
    if isinstance(nat, FrameError):
        assert (nat.detail, nat.offset) == (refo.detail, refo.offset), context
    if isinstance(nat, ChecksumMismatchError):
        assert (nat.expected, nat.actual) == (refo.expected, refo.actual), context
    if isinstance(nat, ArrowIpcError):
        new = [e.detail.startswith(("compressed ", "unknown IPC compression")) for e in (nat, refo)]
        for who, by_new in zip(("native", "reference"), new, strict=True):
            event(f"{who} refused by {'the new checks' if by_new else 'another rule'}")
        if all(new):  # the same rules, in the same order: the same words
            assert nat.detail == refo.detail, context


@needs_native
@settings(max_examples=examples(250), deadline=None, suppress_health_check=FIXTURE_OK)
@given(case=mutated(), limit=st.sampled_from([2**30, 300, 120, 60, 1]))
def test_differential_mutated_compressed_payloads(case: Mutated, limit: int):
    check_mutated(case, limit)


def check_mutated(case: Mutated, limit: int) -> None:
    """The mutated payload alone first: where the two Arrow readers legitimately differ on
    it, the refusal must be ArrowIpcError and the acceptance must hold the chunk's values
    (then the whole stream may differ too, at that chunk or at a later one: recorded, not
    failed). Otherwise the whole stream must give the same outcome from both."""
    native = native_or_skip()
    frames, k, original, what = case
    note(what)
    payload = frames[k][3]
    by_itself = {"native": alone(native, payload), "reference": alone(ref, payload)}
    verdicts = {name: isinstance(o, np.ndarray) for name, o in by_itself.items()}
    if verdicts["native"] != verdicts["reference"]:
        accepted = "native" if verdicts["native"] else "reference"
        refused = by_itself["reference" if verdicts["native"] else "native"]
        context = f"{what}: alone, only {accepted} accepts; other gave {describe(refused)}"
        assert isinstance(refused, ArrowIpcError) and refused.chunk_index == 0, context
        if footer_emptied(payload) and len(by_itself[accepted]) == 0:
            # The damage emptied the footer's record-batch list (a zero forward offset,
            # say: flatbuffers' C++ verifier under pyarrow refuses it, the Rust one reads
            # an empty list): a file of no batches, no values, the spec's one exception.
            DISAGREEMENTS[f"only {accepted} accepts a footer listing no batches (0 values)"] += 1
            event(f"payload alone: only {accepted} accepts an empty footer")
            return
        expected = len(ref.decode_payload(memoryview(original), 0))
        assert len(by_itself[accepted]) == expected, context
        detail = re.sub(r"\b\d+\b", "N", refused.detail)  # group by wording, not numbers
        DISAGREEMENTS[f"only {accepted} accepts; other says: {detail}"] += 1
        event(f"payload alone: only {accepted} accepts")
        return
    if verdicts["native"]:
        assert by_itself["native"].dtype == by_itself["reference"].dtype, what
        assert np.array_equal(bits(by_itself["native"]), bits(by_itself["reference"])), what
    else:
        assert_same_error(by_itself["native"], by_itself["reference"], f"{what} (alone)")
    sessions = {
        name: mod.GradientStreamSession("r", 7, max_gradient_len=limit)
        for name, mod in (("native", native), ("reference", ref))
    }
    wire = b"".join(frame(i, t, p, crc) for i, t, crc, p in frames)
    for method in ("decode_frames", "decode_chunks"):
        outcomes = {}
        for name, s in sessions.items():
            mod = native if name == "native" else ref
            arg: Any = wire
            if method == "decode_chunks":
                arg = [mod.GradientChunk("m", i, t, p, crc) for i, t, crc, p in frames]
            outcomes[name] = outcome_of(functools.partial(getattr(s, method), arg), name)
        nat, refo = outcomes["native"], outcomes["reference"]
        context = f"{method} after {what}: native {describe(nat)}, reference {describe(refo)}"
        event(f"{method}: native {type(nat).__name__}, reference {type(refo).__name__}")
        if isinstance(nat, np.ndarray) or isinstance(refo, np.ndarray):
            assert isinstance(nat, np.ndarray) and isinstance(refo, np.ndarray), context
            assert nat.dtype == refo.dtype, context
            assert np.array_equal(bits(nat), bits(refo)), context
        else:
            assert_same_error(nat, refo, context)


def with_batch_list_at_itself(payload: bytes) -> bytes:
    """The payload with its footer's recordBatches offset set to zero, so that it points at
    itself: the list's length is then read from those four zero bytes."""
    flat = Flat(payload)
    footer_len = flat.read(len(payload) - 10, 4)
    assert footer_len is not None
    at = flat.field(flat.root(len(payload) - 10 - footer_len), 3)  # Footer.recordBatches
    assert at is not None
    return payload[:at] + bytes(4) + payload[at + 4 :]


@needs_native
@pytest.mark.parametrize("source", ["native", "reference"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_batch_list_offset_of_zero_empties_the_footer_or_is_refused(source: str, layout: str):
    """A hypothesis draw found it (a flipped bit made the offset point back at the field):
    arrow-rs's verifier reads a list of no batches, flatbuffers' C++ verifier under pyarrow
    refuses a zero offset. Each reading is allowed, and nothing else."""
    mod = native_or_skip() if source == "native" else ref
    s = mod.GradientStreamSession("m", 50, layout=layout, compression="zstd")
    frames = split_frames(s.encode_frames(sparse(233, seed=0)))
    index, total, _, payload = frames[0]
    damaged = with_batch_list_at_itself(payload)
    assert footer_emptied(damaged)
    for impl in (native_or_skip(), ref):
        out = alone(impl, damaged)
        if isinstance(out, np.ndarray):
            assert len(out) == 0, impl.__name__
        else:
            assert isinstance(out, ArrowIpcError) and out.chunk_index == 0, describe(out)
    frames[0] = (index, total, zlib.crc32(damaged), damaged)
    check_mutated(Mutated(frames, 0, payload, f"{source} {layout}: batch list at itself"), 2**30)


def test_a_dictionary_batch_is_refused_before_anything_is_decompressed(impl: ModuleType):
    """A dictionary column beside `value`, its one 100 MB string of zeros compressed to a
    few KB: pyarrow would decode (and decompress) every dictionary batch before any record
    batch, past max_gradient_len's bound. No gradient payload has dictionary batches."""
    size = 100_000_000
    values = pa.array(np.arange(4, dtype=np.float32))
    tags = pa.DictionaryArray.from_arrays(
        pa.array([0, 0, 0, 0], pa.int32()), pa.array([b"\0" * size], pa.binary())
    )
    schema = pa.schema([pa.field("value", pa.float32(), nullable=False), pa.field("d", tags.type)])
    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(compression="zstd")
    with pa.ipc.new_file(sink, schema, options=options) as writer:
        writer.write_batch(pa.record_batch([values, tags], schema=schema))
    payload = sink.getvalue().to_pybytes()
    assert len(payload) < size // 1000
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for outcome in decode_both_ways(session(impl, max_gradient_len=16), payload):
        assert_arrow_error(
            outcome, 0, "IPC footer lists 1 dictionary batch(es); a gradient payload has none"
        )
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 50 * 1024, f"peak RSS grew {grown_kib} KiB"

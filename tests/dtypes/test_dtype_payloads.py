"""The dtype rules on arrival, against both implementations: which value columns and
``gradient_dtype`` metadata a receiver accepts, the bound on compressed batches, the
differential test, and regressions.

Hostile payloads are built with pyarrow (``payload``) and carry correct CRCs, so that they
reach the dtype rules.
"""

from __future__ import annotations

import asyncio
import math
from types import ModuleType
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import gradstream._dtypes as _dtypes
import gradstream.reference as ref
from gradstream.errors import ArrowIpcError, FrameError, GradientDtypeError
from support import TESTS
from support.aio import run, socketpair_ends
from support.dtypes import (
    BF16_FIELD,
    DTYPES,
    SPECIALS,
    WORD,
    assert_values,
    bits,
    expected,
    from_bits,
    numpy_dtype,
    payload,
    rejected,
    sample,
    schema_of,
)
from support.frames import assert_error, both_ways, frame, join_frames, split_frames
from support.frames import frame_offsets as offsets_of
from support.impls import CODECS, IMPL_NAMES, LAYOUTS, examples, session
from support.impls import load_impl as module
from support.payloads import rebuild, the_batch, with_buffer

NOT_A_FLOAT = (
    "'value' column is not Float16, Float32, Float64, gradstream.bfloat16 or a list of Int8"
)


BAD_DTYPE = "gradient_dtype metadata is not float16, bfloat16, float32 or float64"


# --------------------------------------------------------------------------- payload rules


ACCEPTED_COLUMNS = {
    # case: (arrow type, field metadata, dtype handed back)
    "float16": (pa.float16(), None, "float16"),
    "float32": (pa.float32(), None, "float32"),
    "float64": (pa.float64(), None, "float64"),
    "bfloat16": (pa.uint16(), BF16_FIELD, "bfloat16"),
    "bfloat16-no-ext-metadata": (
        pa.uint16(),
        {b"ARROW:extension:name": b"gradstream.bfloat16"},
        "bfloat16",
    ),
    "bfloat16-other-ext-metadata": (
        pa.uint16(),
        {b"ARROW:extension:name": b"gradstream.bfloat16", b"ARROW:extension:metadata": b"x"},
        "bfloat16",
    ),
    # A float column is its dtype whatever extension name its field carries.
    "float32-named-bfloat16": (pa.float32(), BF16_FIELD, "float32"),
    "float16-named-bfloat16": (pa.float16(), BF16_FIELD, "float16"),
    "float64-named-other": (pa.float64(), {b"ARROW:extension:name": b"foo.bar"}, "float64"),
    "float32-other-metadata": (pa.float32(), {b"unit": b"m/s"}, "float32"),
}


REFUSED_COLUMNS = {
    "int32": (pa.int32(), None),
    "uint16-plain": (pa.uint16(), None),
    "uint16-other-extension": (pa.uint16(), {b"ARROW:extension:name": b"foo.bfloat16"}),
    "uint16-name-as-other-key": (pa.uint16(), {b"extension:name": b"gradstream.bfloat16"}),
    "int16-named-bfloat16": (pa.int16(), BF16_FIELD),
    "uint32-named-bfloat16": (pa.uint32(), BF16_FIELD),
    "uint64": (pa.uint64(), None),
}


@pytest.mark.parametrize("case", list(ACCEPTED_COLUMNS))
def test_value_column_types_accepted(impl: ModuleType, case: str):
    arrow_type, field_metadata, name = ACCEPTED_COLUMNS[case]
    words = sample(name, 9)
    p = payload(words, arrow_type=arrow_type, field_metadata=field_metadata, layout="seed")
    for got in both_ways(impl, [(0, 1, p)]):
        assert_values(got, name, words)


@pytest.mark.parametrize("case", list(REFUSED_COLUMNS))
def test_value_column_types_refused(impl: ModuleType, case: str):
    arrow_type, field_metadata = REFUSED_COLUMNS[case]
    width = arrow_type.bit_width // 8
    words = np.arange(6, dtype=f"u{width}")
    good = payload(np.zeros(4, np.float32), "float32")
    bad = payload(words, arrow_type=arrow_type, field_metadata=field_metadata)
    for got in both_ways(impl, [(0, 2, good), (1, 2, bad)]):
        assert_error(got, ArrowIpcError, NOT_A_FLOAT, 1)
    # Before any record batch: a file with none is refused as well.
    schema = pa.schema([pa.field("value", arrow_type, metadata=field_metadata)])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, schema):
        pass
    for got in both_ways(impl, [(0, 1, sink.getvalue().to_pybytes())]):
        assert_error(got, ArrowIpcError, NOT_A_FLOAT, 0)


@pytest.mark.parametrize(
    "text", ["float", "Float32", "float32 ", " float16", "", "int8", "bf16", "float128", "[4]"]
)
def test_gradient_dtype_grammar(impl: ModuleType, text: str):
    p = payload(np.zeros(3, np.float32), "float32", metadata={"gradient_dtype": text})
    for got in both_ways(impl, [(0, 1, p)]):
        assert_error(got, ArrowIpcError, BAD_DTYPE, 0)


@pytest.mark.parametrize("result", DTYPES)
@pytest.mark.parametrize("column", DTYPES)
def test_gradient_dtype_names_the_dtype_handed_back(impl: ModuleType, column: str, result):
    words = sample(column, 14, seed=4)
    p = payload(words, column, metadata={"gradient_dtype": result}, layout="seed")
    want = expected(words, column, column, result)
    for got in both_ways(impl, [(0, 1, p)]):
        assert_values(got, result, want)


def test_gradient_dtype_listed_twice_counts_once_the_first(impl: ModuleType):
    p = payload(
        np.zeros(3, np.float32),
        "float32",
        metadata={"gradient_dtype": "float64", "gradient_dtypX": "bfloat16"},
    )
    twice = p.replace(b"gradient_dtypX", b"gradient_dtype")
    assert twice.count(b"gradient_dtype") == 2 * p.count(b"gradient_dtype")
    first = schema_of(twice).metadata[b"gradient_dtype"].decode()
    for got in both_ways(impl, [(0, 1, twice)]):
        assert isinstance(got, np.ndarray) and got.dtype == numpy_dtype(first)


def test_checks_within_a_payload_come_in_order(impl: ModuleType):
    """Missing column, then the column's type, then gradient_dtype's grammar, all before
    the record batches (nulls) and before gradient_shape's grammar."""
    meta = {"gradient_dtype": "half", "gradient_shape": "[x]"}
    cases = [
        # a missing value column beats a bad gradient_dtype
        (
            payload(np.zeros(2, np.float32), "float32", metadata=meta).replace(b"value", b"valuX"),
            "Arrow IPC block missing 'value' column",
        ),
        # the column's type beats a bad gradient_dtype
        (payload(np.zeros(2, np.int32), arrow_type=pa.int32(), metadata=meta), NOT_A_FLOAT),
        # a bad gradient_dtype beats nulls and a bad gradient_shape
        (payload(np.zeros(3, np.float16), "float16", metadata=meta, nulls=True), BAD_DTYPE),
        # with a good gradient_dtype: the nulls, then the shape
        (
            payload(
                np.zeros(3, np.float16), "float16", nulls=True, metadata={"gradient_shape": "[x]"}
            ),
            "'value' column has 1 null value(s)",
        ),
        (
            payload(np.zeros(3, np.float16), "float16", metadata={"gradient_shape": "[x]"}),
            "gradient_shape metadata is not a list of at most 32 non-negative integers: [x]",
        ),
    ]
    for p, detail in cases:
        for got in both_ways(impl, [(0, 1, p)]):
            assert_error(got, ArrowIpcError, detail, 0)


def _dtype_parts(first: bytes, second: bytes, n: int = 2) -> list[tuple[int, int, bytes]]:
    return [(0, n, first), (1, n, second)]


DISAGREEMENTS = {
    # case: (chunk 0's payload, chunk 1's payload, what chunk 0 says, what chunk 1 says)
    "float32-float16": (
        lambda: payload(np.zeros(2, np.float32), "float32"),
        lambda: payload(np.zeros(2, np.float16), "float16"),
        "holds float32",
        "holds float16",
    ),
    "bfloat16-float16": (
        lambda: payload(np.zeros(2, np.uint16), "bfloat16"),
        lambda: payload(np.zeros(2, np.float16), "float16"),
        "holds bfloat16",
        "holds float16",
    ),
    "float64-bfloat16": (
        lambda: payload(np.zeros(2, np.float64), "float64", layout="seed"),
        lambda: payload(np.zeros(2, np.uint16), "bfloat16", compression="zstd"),
        "holds float64",
        "holds bfloat16",
    ),
    "dtype-vs-none": (
        lambda: payload(np.zeros(2, np.float32), "float32", metadata={"gradient_dtype": "float64"}),
        lambda: payload(np.zeros(2, np.float32), "float32"),
        "says float64",
        "says none",
    ),
    "none-vs-dtype": (
        lambda: payload(np.zeros(2, np.float16), "float16"),
        lambda: payload(np.zeros(2, np.float16), "float16", metadata={"gradient_dtype": "float16"}),
        "says none",
        "says float16",
    ),
    "dtype-vs-dtype": (
        lambda: payload(np.zeros(2, np.float16), "float16", metadata={"gradient_dtype": "float32"}),
        lambda: payload(np.zeros(2, np.float16), "float16", metadata={"gradient_dtype": "float64"}),
        "says float32",
        "says float64",
    ),
}


def _disagree_text(first_index: int, first: str, index: int, second: str) -> str:
    what = "the value dtype" if first.startswith("holds") else "gradient_dtype"
    return f"chunks disagree on {what}: chunk {first_index} {first}, chunk {index} {second}"


@pytest.mark.parametrize("case", list(DISAGREEMENTS))
def test_chunks_disagree_on_dtypes(impl: ModuleType, case: str):
    """decode_frames compares with the first chunk to arrive (offset: the header's),
    decode_chunks with the lowest index (offset None)."""
    make0, make1, says0, says1 = DISAGREEMENTS[case]
    p0, p1 = make0(), make1()
    parts = _dtype_parts(p0, p1)
    chunks_got, frames_got = both_ways(impl, parts)
    detail = _disagree_text(0, says0, 1, says1)
    assert_error(chunks_got, FrameError, detail, 1, None)
    assert_error(frames_got, FrameError, detail, 1, offsets_of(parts)[1])
    # Chunk 1 arrives first: decode_frames blames chunk 0; decode_chunks still chunk 1.
    backwards = parts[::-1]
    chunks_got, frames_got = both_ways(impl, backwards)
    assert_error(chunks_got, FrameError, detail, 1, None)
    assert_error(
        frames_got, FrameError, _disagree_text(1, says1, 0, says0), 0, offsets_of(backwards)[1]
    )


def test_value_dtype_is_compared_before_gradient_dtype(impl: ModuleType):
    p0 = payload(np.zeros(2, np.float32), "float32", metadata={"gradient_dtype": "float64"})
    p1 = payload(np.zeros(2, np.float16), "float16")
    for got in both_ways(impl, _dtype_parts(p0, p1)):
        assert_error(got, FrameError, _disagree_text(0, "holds float32", 1, "holds float16"), 1)


def test_dtype_checks_come_before_the_record_batches(impl: ModuleType):
    """A chunk that disagrees on a dtype is refused for that before its batches are read:
    before its nulls, its gradient_shape (grammar and agreement), max_gradient_len and
    out='s size."""
    p0 = payload(np.zeros(2, np.float32), "float32", metadata={"gradient_shape": "[4]"})
    shape_meta = {"gradient_shape": "[x]"}
    detail = _disagree_text(0, "holds float32", 1, "holds float16")
    for p1 in (
        payload(np.zeros(2, np.float16), "float16", nulls=True),
        payload(np.zeros(2, np.float16), "float16", metadata=shape_meta),
        payload(np.zeros(2, np.float16), "float16", metadata={"gradient_shape": "[5]"}),
        payload(np.zeros(50, np.float16), "float16", metadata={"gradient_shape": "[4]"}),
    ):
        parts = _dtype_parts(p0, p1)
        for got in both_ways(impl, parts, out=lambda: np.zeros(4, np.float32), max_gradient_len=10):
            assert_error(got, FrameError, detail, 1)
    # gradient_dtype likewise.
    p1 = payload(
        np.zeros(2, np.float32), "float32", metadata={"gradient_dtype": "float64", **shape_meta}
    )
    for got in both_ways(impl, _dtype_parts(p0, p1)):
        assert_error(got, FrameError, _disagree_text(0, "says none", 1, "says float64"), 1)


def test_out_dtype_is_checked_before_the_record_batches(impl: ModuleType):
    """GradientDtypeError comes before the chunk's nulls, gradient_shape, max_gradient_len
    and out= size, but after its column type and gradient_dtype grammar."""
    f16 = np.zeros(8, np.float16)
    for p in (
        payload(f16, "float16", nulls=True),
        payload(f16, "float16", metadata={"gradient_shape": "[x]"}),
        payload(np.zeros(80, np.float16), "float16"),  # over max_gradient_len and out.size
    ):
        _, got = both_ways(
            impl, [(0, 1, p)], out=lambda: np.zeros(8, np.float32), max_gradient_len=10
        )
        assert type(got) is GradientDtypeError, got
        assert (got.expected, got.received, got.chunk_index) == ("float32", "float16", 0)
    for p, detail in (
        (payload(np.zeros(8, np.int32), arrow_type=pa.int32()), NOT_A_FLOAT),
        (payload(f16, "float16", metadata={"gradient_dtype": "f16"}), BAD_DTYPE),
    ):
        _, got = both_ways(impl, [(0, 1, p)], out=lambda: np.zeros(8, np.float32))
        assert_error(got, ArrowIpcError, detail, 0)
    # The handed-back dtype is gradient_dtype's, not the column's.
    p = payload(f16, "float16", metadata={"gradient_dtype": "float32"})
    _, got = both_ways(impl, [(0, 1, p)], out=lambda: np.zeros(8, np.float16))
    assert type(got) is GradientDtypeError
    assert (got.expected, got.received) == ("float16", "float32")
    _, got = both_ways(impl, [(0, 1, p)], out=lambda: np.ones(8, np.float32))
    assert isinstance(got, np.ndarray) and not got.any()


# --------------------------------------------------------------------------- compressed bound


def _float64_seed_template(codec: str, rows: int) -> bytes:
    return payload(np.zeros(rows, np.float64), "float64", layout="seed", compression=codec)


@pytest.mark.parametrize("codec", CODECS)
def test_seed_float64_compressed_batch_is_within_the_bound(impl: ModuleType, codec: str):
    """A seed float64 batch declares 12 bytes a row (index and value), what its columns
    need: accepted, from either encoder. Its value column is not nullable: a bitmap there
    may declare nothing (the all-buffers bound of 16 bytes a row is not what stops it)."""
    words = sample("float64", 1000)
    words[::3] = 0
    for enc in IMPL_NAMES:
        tx = session(module(enc), 1000, compression=codec, keep_dtype=True)
        assert_values(
            session(impl).decode_frames(tx.encode_frames(from_bits(words, "float64"))),
            "float64",
            words,
        )
    rows = 1000
    template = _float64_seed_template(codec, rows)
    batch = the_batch(template)
    assert len(batch.buffers) == 4  # index validity, index data, value validity, value data
    values = np.frombuffer(words.tobytes(), np.uint8)
    index = np.arange(rows, dtype=np.int32)

    def prefixed(raw: bytes) -> bytes:
        return len(raw).to_bytes(8, "little") + pa.compress(raw, codec=codec, asbytes=True)

    batch = with_buffer(batch, 1, prefixed(index.tobytes()))
    batch = with_buffer(batch, 3, prefixed(values.tobytes()))
    for extra, ok in ((0, True), (1, False), (4 * rows, False)):
        hostile = rebuild(template, with_buffer(batch, 2, prefixed(b"\xff" * extra)))
        for got in both_ways(impl, [(0, 1, hostile)]):
            if ok:
                assert_values(got, "float64", words)
            else:
                assert_error(
                    got,
                    ArrowIpcError,
                    f"compressed IPC buffer 2 (validity bitmap of non-nullable column 1) "
                    f"declares {extra} bytes uncompressed; {rows} rows need at most 0",
                    0,
                )


# --------------------------------------------------------------------------- differential


_SHAPES = st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple)


@st.composite
def gradients(draw: Any) -> tuple[str, np.ndarray]:
    name = draw(st.sampled_from(DTYPES))
    shape = draw(_SHAPES)
    n = math.prod(shape)
    width = 8 * np.dtype(WORD[name]).itemsize
    word = st.one_of(
        st.sampled_from(SPECIALS[name]),
        st.integers(0, 2**width - 1),
        st.floats(allow_nan=False, width=64).map(
            lambda x: int(_dtypes.cast(np.array([x]), "float64", name).view(WORD[name])[0])
        ),
    )
    words = draw(st.lists(word, min_size=n, max_size=n))
    return name, np.array(words, dtype=WORD[name]).reshape(shape)


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    grad=gradients(),
    layout=st.sampled_from(LAYOUTS),
    compression=st.sampled_from([None, "lz4", "zstd"]),
    keep_shape=st.booleans(),
    keep_dtype=st.booleans(),
    wire_dtype=st.sampled_from([None, *DTYPES]),
    chunk_size=st.integers(1, 40),
)
def test_differential_dtypes(
    grad, layout, compression, keep_shape, keep_dtype, wire_dtype, chunk_size
):
    """Both encoders, both decoders (four pairings, frames and chunks): the same bits, the
    dtype and shape handed back, and the cast rule's values."""
    name, words = grad
    values = from_bits(words.reshape(-1), name, words.shape)
    kwargs = dict(
        layout=layout,
        compression=compression,
        keep_shape=keep_shape,
        keep_dtype=keep_dtype,
        wire_dtype=wire_dtype,
    )
    note(f"{name} {words.shape} {kwargs} chunk_size={chunk_size}")
    senders = [session(module(m), chunk_size, **kwargs) for m in IMPL_NAMES]
    if name != "float32" and not keep_dtype and wire_dtype is None:
        messages = set()
        for s in senders:
            with pytest.raises(TypeError) as info:
                s.encode_frames(values)
            messages.add(str(info.value))
        assert messages == {rejected(name)}
        return
    result = name if keep_dtype else "float32"
    want = expected(words.reshape(-1), name, wire_dtype or name, result)
    shape = words.shape if keep_shape else (words.size,)
    results = []
    for s in senders:
        wire = s.encode_frames(values)
        chunks = s.encode_gradient(values)
        for m in IMPL_NAMES:
            rx = session(module(m), 7)
            for got in (rx.decode_frames(wire), rx.decode_chunks(chunks[::-1])):
                assert_values(got, result, want, shape)
                results.append(bits(got))
            out = np.empty(shape, dtype=numpy_dtype(result))
            rx.decode_frames(join_frames(split_frames(wire)[::-1]), out=out)
            assert np.array_equal(bits(out), want)
    assert all(np.array_equal(results[0], r) for r in results)


# A transfer of a cast gradient over a socket, for the streaming receivers' path.
@pytest.mark.parametrize("path", ["socket", "streams"])
def test_stream_with_dtypes(impl: ModuleType, path: str):
    words = sample("float64", 50)
    tx = session(impl, 8, keep_dtype=True, wire_dtype="float16", keep_shape=True)
    rx = session(impl, 3)
    grad = from_bits(words, "float64", (5, 10))

    async def main() -> list[np.ndarray]:
        async with socketpair_ends(path) as (txs, rxs):

            async def send_two() -> None:
                await tx.stream_to(grad, txs)
                await tx.stream_to(grad[:2], txs)

            async def receive_two() -> list[np.ndarray]:
                return [await rx.receive_from(rxs), await rx.receive_from(rxs)]

            _, got = await asyncio.gather(send_two(), receive_two())
            return got

    first, second = run(main)
    want = expected(words, "float64", "float16", "float64")
    assert_values(first, "float64", want, (5, 10))
    assert_values(second, "float64", want[:20], (2, 10))


# --------------------------------------------------------------------------- review findings


@pytest.mark.parametrize("name", IMPL_NAMES)
def test_values_past_max_gradient_len_are_counted_not_held(name: str):
    """A float16 column handed back as float64 holds 4x its wire bytes: a receiver must
    refuse it at max_gradient_len without storing it first (peak RSS, in a subprocess)."""
    script = f"""
import resource, sys, numpy as np
sys.path.insert(0, {str(TESTS)!r})
from support.impls import load_impl
mod = load_impl({name!r})
n = 32 << 20
tx = mod.GradientStreamSession("x", n, keep_dtype=True, wire_dtype="float16", layout="compact")
wire = tx.encode_frames(np.ones(n, np.float64))
del tx
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    mod.GradientStreamSession("x", max_gradient_len=1).decode_frames(wire)
except Exception as e:
    print(type(e).__name__, e)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) >> 10)
"""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    error, growth = done.stdout.strip().splitlines()
    assert error == "FrameError gradient exceeds max_gradient_len 1: 33554432 values by chunk 0"
    # Storing would take 256 MiB (float64) or more; the wire itself is 64 MiB.
    assert int(growth) < 48, done.stdout


def test_structure_is_checked_before_the_dtypes_in_both():
    """A compressed batch over the room is an ArrowIpcError even where the dtype rules
    would also fail (out= of another dtype, chunks of another dtype)."""
    tx = session(ref, 7, keep_dtype=True, compression="lz4")
    wire = tx.encode_frames(np.arange(10, dtype=np.float16))
    for name in IMPL_NAMES:
        rx = session(module(name), 7, max_gradient_len=5)
        with pytest.raises(ArrowIpcError) as info:
            rx.decode_frames(wire, out=np.empty(10, np.float32))
        assert info.value.chunk_index == 0
        assert info.value.detail == (
            "compressed record batch declares 7 rows, more than the 5 values max_gradient_len "
            "still allows"
        )


@pytest.mark.parametrize("name", IMPL_NAMES)
def test_an_empty_gradients_shape_numpy_cannot_make_is_refused(name: str):
    """[0, 2**31, 2**30] holds no values, but numpy cannot make it (non-zero dimensions
    past 2**60 values): our ArrowIpcError, not numpy's ValueError."""
    for text, ok in (("[0,1073741824,1073741824]", True), ("[0,2147483648,1073741824]", False)):
        schema = pa.schema([pa.field("value", pa.float32(), nullable=False)])
        schema = schema.with_metadata({"gradient_shape": text})
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, schema) as writer:
            writer.write_batch(pa.record_batch([pa.array([], pa.float32())], schema=schema))
        wire = frame(0, 1, sink.getvalue().to_pybytes())
        s = session(module(name), 7)
        if ok:
            assert s.decode_frames(wire).shape == (0, 1 << 30, 1 << 30)
            continue
        with pytest.raises(ArrowIpcError) as info:
            s.decode_frames(wire)
        assert info.value.detail == (
            f"gradient_shape metadata {text} is beyond what numpy can make: its non-zero "
            "dimensions multiply past 2^60"
        )

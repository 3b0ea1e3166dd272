"""The compressed-buffer bomb (issue 11, hole 1), from a hostile peer, against both
implementations: a CRC-valid payload of kilobytes whose validity bitmap and value buffer
each declare, and really decompress to, 8 bytes a row for 2^26 float16 rows. A reader
that trusts the declared lengths allocates 1 GiB for a 128 MiB gradient (16 GiB at the
default max_gradient_len) and accepts a gradient of zeros.

Each declared length is now bounded by what its column needs, before anything is
decompressed (docs/spec/decoding-rules.md, step 8): the column's width times the rows for its
data, rows/8 rounded up for the validity bitmap of a nullable column, nothing for that
of a non-nullable one. The payloads are built in support/bomb.py.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from types import ModuleType

import numpy as np
import pyarrow as pa
import pytest

from support.aio import run
from support.bomb import (
    ROWS,
    at_the_bound,
    bomb,
    declared,
    measure_in_subprocess,
    receive,
    template,
    with_rows,
)
from support.compressed import assert_arrow_error, decode_both_ways, session
from support.frames import frame
from support.impls import CODECS, IMPL_NAMES, PATHS
from support.payloads import write_ipc_file

GRADIENT_BYTES = 2 * ROWS  # the bomb's gradient: 2^26 float16 values


def bomb_detail(rows: int = ROWS, bytes_a_row: int = 8) -> str:
    # The first buffer out of bounds: the value column's bitmap, where none may be.
    return (
        f"compressed IPC buffer 0 (validity bitmap of non-nullable column 0) declares "
        f"{bytes_a_row * rows} bytes uncompressed; {rows} rows need at most 0"
    )


# --------------------------------------------------------------------------- the attack


@pytest.mark.parametrize("codec", CODECS)
def test_the_bomb_is_refused_by_decode_frames_and_decode_chunks(impl: ModuleType, codec: str):
    payload = bomb(codec)
    assert len(payload) < 8 * 2**20  # 33 KB (zstd), 4.4 MB (lz4): under max_payload_len
    for outcome in decode_both_ways(session(impl), payload):
        assert_arrow_error(outcome, 0, bomb_detail())


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("codec", CODECS)
def test_the_bomb_is_refused_by_receive_from(impl: ModuleType, codec: str, path: str):
    payload = bomb(codec)
    wire = frame(0, 1, payload, zlib.crc32(payload))
    got = run(lambda: receive(session(impl), wire, path))
    assert_arrow_error(got, 0, bomb_detail())


def test_the_bomb_at_the_default_max_gradient_len_is_refused(impl: ModuleType):
    """2^30 rows, the default max_gradient_len, each buffer declaring 8 GiB (16 GiB in all)
    from about a megabyte: refused like the small one, before anything is decompressed."""
    payload = bomb("zstd", 2**30)
    assert len(payload) < 2 * 2**20
    s = impl.GradientStreamSession("s")
    assert s.max_gradient_len == 2**30
    for outcome in decode_both_ways(s, payload):
        assert_arrow_error(outcome, 0, bomb_detail(2**30))


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("impl_name", IMPL_NAMES)
def test_peak_rss_of_receiving_the_bomb(impl_name: str, codec: str, tmp_path: Path):
    """In a fresh process, the high-water mark of a receive over a socket: the refused bomb
    raises it by about its payload (a receiver holds one), nowhere near the 128 MiB
    gradient it would make, let alone the 1 GiB it declares."""
    got = measure_in_subprocess(impl_name, bomb(codec), tmp_path)
    assert got["accepted"] is False and got["detail"] == bomb_detail(), got
    assert got["growth"] < 2 * got["payload"] + 16 * 2**20, got


@pytest.mark.parametrize("impl_name", IMPL_NAMES)
def test_peak_rss_of_the_bomb_made_honest(impl_name: str, tmp_path: Path):
    """The same gradient in a payload that declares only what its column needs (2 bytes a
    row, no bitmap) is a real 128 MiB gradient of zeros, accepted; the docs/spec/wire-format.md
    bound holds:
    the payload, its decompressed column while it is decoded, and the gradient."""
    got = measure_in_subprocess(impl_name, at_the_bound("zstd"), tmp_path)
    assert got == {**got, "accepted": True, "dtype": "float16", "size": ROWS}, got
    assert got["growth"] < got["payload"] + 2 * GRADIENT_BYTES + 16 * 2**20, got


# --------------------------------------------------------------------------- the bounds

VALUES = np.arange(1000, dtype=np.float32)


def buffer_detail(index: int, what: str, size: int, rows: int, bound: int) -> str:
    return (
        f"compressed IPC buffer {index} ({what}) declares {size} bytes uncompressed; "
        f"{rows} rows need at most {bound}"
    )


def compressed(codec: str, data: bytes, size: int | None = None) -> bytes:
    """A compressed IPC buffer of ``data``, declaring its length (or ``size``)."""
    length = len(data) if size is None else size
    return declared(length, pa.compress(data, codec=codec, asbytes=True))


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("codec", CODECS)
def test_a_value_buffer_may_declare_its_width_times_the_rows(
    impl: ModuleType, codec: str, dtype: str
):
    width = np.dtype(dtype).itemsize
    values = VALUES.astype(dtype)
    exact = with_rows(template(codec, dtype), 1000, {1: compressed(codec, values.tobytes())})
    for outcome in decode_both_ways(session(impl, keep_dtype=True), exact):
        assert isinstance(outcome, np.ndarray) and outcome.dtype == dtype, outcome
        assert np.array_equal(outcome, values)
    over = with_rows(template(codec, dtype), 1000, {1: compressed(codec, values.tobytes() + b"\0")})
    detail = buffer_detail(1, "data of column 0", 1000 * width + 1, 1000, 1000 * width)
    for outcome in decode_both_ways(session(impl), over):
        assert_arrow_error(outcome, 0, detail)


@pytest.mark.parametrize("codec", CODECS)
def test_the_seed_index_may_declare_four_bytes_a_row(impl: ModuleType, codec: str):
    index = np.arange(1000, dtype=np.int32).tobytes()
    values = compressed(codec, VALUES.tobytes())
    payload = template(codec, "float32", "seed")
    exact = with_rows(payload, 1000, {1: compressed(codec, index), 3: values})
    for outcome in decode_both_ways(session(impl), exact):
        assert isinstance(outcome, np.ndarray) and np.array_equal(outcome, VALUES), outcome
    over = with_rows(payload, 1000, {1: compressed(codec, index + b"\0"), 3: values})
    for outcome in decode_both_ways(session(impl), over):
        assert_arrow_error(outcome, 0, buffer_detail(1, "data of column 0", 4001, 1000, 4000))


@pytest.mark.parametrize("rows", [1000, 1001])
@pytest.mark.parametrize("codec", CODECS)
def test_a_nullable_column_may_carry_a_bitmap_of_its_rows(impl: ModuleType, codec: str, rows: int):
    """Where a bitmap is allowed (a nullable column, as another writer may send: the
    docs/spec/wire-format.md refuses nulls, not bitmaps), it may declare rows/8 rounded up, no
    more."""
    values = compressed(codec, np.arange(rows, dtype=np.float32).tobytes())
    payload = template(codec, "float32", nullable=True)
    need = -(-rows // 8)
    exact = with_rows(payload, rows, {0: compressed(codec, b"\xff" * need), 1: values})
    for outcome in decode_both_ways(session(impl), exact):
        assert isinstance(outcome, np.ndarray) and outcome.size == rows, outcome
    over = with_rows(payload, rows, {0: compressed(codec, b"\xff" * (need + 1)), 1: values})
    detail = buffer_detail(0, "validity bitmap of column 0", need + 1, rows, need)
    for outcome in decode_both_ways(session(impl), over):
        assert_arrow_error(outcome, 0, detail)


@pytest.mark.parametrize("codec", CODECS)
def test_a_non_nullable_column_may_carry_no_bitmap(impl: ModuleType, codec: str):
    values = compressed(codec, VALUES.tobytes())
    payload = template(codec, "float32")
    empty = with_rows(payload, 1000, {0: compressed(codec, b""), 1: values})
    for outcome in decode_both_ways(session(impl), empty):
        assert isinstance(outcome, np.ndarray) and np.array_equal(outcome, VALUES), outcome
    one = with_rows(payload, 1000, {0: compressed(codec, b"\xff"), 1: values})
    detail = buffer_detail(0, "validity bitmap of non-nullable column 0", 1, 1000, 0)
    for outcome in decode_both_ways(session(impl), one):
        assert_arrow_error(outcome, 0, detail)


def test_nulls_in_a_compressed_column_are_still_the_null_rule(impl: ModuleType):
    schema = pa.schema([pa.field("value", pa.float32())])
    batch = pa.record_batch([pa.array([1.0, None, 3.0], pa.float32())], schema=schema)
    for outcome in decode_both_ways(session(impl), write_ipc_file(schema, batch, "zstd")):
        assert_arrow_error(outcome, 0, "'value' column has 1 null value(s)")


def test_a_buffer_past_the_columns_may_declare_nothing(impl: ModuleType):
    values = compressed("lz4", VALUES.tobytes())
    payload = template("lz4", "float32")
    extra = with_rows(payload, 1000, {1: values, 2: compressed("lz4", b"\0" * 8)})
    for outcome in decode_both_ways(session(impl), extra):
        assert_arrow_error(outcome, 0, buffer_detail(2, "past the last column", 8, 1000, 0))


@pytest.mark.parametrize(
    "arrow_type", [pa.utf8(), pa.bool_(), pa.list_(pa.float32()), pa.decimal128(10, 2)]
)
def test_a_column_without_a_width_cannot_be_compressed(impl: ModuleType, arrow_type):
    """Only integer and floating-point columns have a width to bound their buffers by."""
    other = pa.array([None, None], arrow_type)
    schema = pa.schema([pa.field("value", pa.float32()), pa.field("x", arrow_type)])
    batch = pa.record_batch([pa.array([1.0, 2.0], pa.float32()), other], schema=schema)
    for codec in CODECS:
        for outcome in decode_both_ways(session(impl), write_ipc_file(schema, batch, codec)):
            assert_arrow_error(
                outcome,
                0,
                "compressed record batch has column 1 of a type other than integer or "
                "floating point",
            )
    # Uncompressed, the same file decodes as before: only `value` is read.
    for outcome in decode_both_ways(session(impl), write_ipc_file(schema, batch)):
        assert isinstance(outcome, np.ndarray) and outcome.tolist() == [1.0, 2.0], outcome


def test_all_buffers_together_may_declare_sixteen_bytes_a_row(impl: ModuleType):
    """Each column within its width is not enough: many columns must not multiply what a
    batch can make a reader allocate. Two float64 columns (16 bytes a row) pass; a third,
    one-byte column does not."""
    fields = [pa.field("a", pa.float64(), False), pa.field("value", pa.float64(), False)]
    columns = [pa.array(np.zeros(1000)), pa.array(VALUES.astype(np.float64))]
    schema = pa.schema(fields)
    two = write_ipc_file(schema, pa.record_batch(columns, schema=schema), "zstd")
    for outcome in decode_both_ways(session(impl, keep_dtype=True), two):
        assert isinstance(outcome, np.ndarray) and np.array_equal(outcome, VALUES), outcome
    schema = schema.append(pa.field("b", pa.int8(), False))
    columns.append(pa.array(np.zeros(1000, np.int8)))
    three = write_ipc_file(schema, pa.record_batch(columns, schema=schema), "zstd")
    for outcome in decode_both_ways(session(impl), three):
        assert_arrow_error(
            outcome,
            0,
            "compressed IPC buffers declare 17000 bytes uncompressed in all, more than their "
            "1000-row batch can hold",
        )


def test_the_bounds_come_after_the_rows(impl: ModuleType):
    """The rows against max_gradient_len first (they bound everything else), then the
    buffers in order."""
    s = session(impl, max_gradient_len=ROWS - 1)
    for outcome in decode_both_ways(s, bomb("zstd")):
        assert_arrow_error(
            outcome,
            0,
            f"compressed record batch declares {ROWS} rows, more than the {ROWS - 1} values "
            "max_gradient_len still allows",
        )

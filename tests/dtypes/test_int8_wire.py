"""The int8 wire (``wire_dtype="int8"``, docs/spec/wire-format.md "The int8 wire"), against
both implementations: the two encode and decode alike (differential, hypothesis), every
value within the documented bound of its block, non-finite blocks arrive as NaN, the
dtype handed back, its size against float32, tensor sets, ``reduce_into=``, and the
payloads a hostile peer could send instead.
"""

from __future__ import annotations

import asyncio
import zlib
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import gradstream as gs
from gradstream.errors import ArrowIpcError, FrameError
from support.dtypes import bits, from_bits, numpy_dtype, sample
from support.frames import assert_error, both_ways, split_frames
from support.impls import IMPL_NAMES, PAIR_IDS, PAIRS, examples, session
from support.impls import load_impl as module
from support.payloads import write_ipc_file

BLOCK = 512  # what both writers use (the readers take any block length)
# |x - y| <= BOUND * absmax of the value's block (docs/spec/wire-format.md).
BOUND = (1 + 2**-15) / 254

float32s = hnp.arrays(
    np.float32,
    st.integers(0, 3 * BLOCK + 7),
    elements=st.floats(width=32, allow_nan=True, allow_infinity=True),
)


def blocks_of(n: int, chunk_size: int) -> list[slice]:
    """The blocks the writers make: BLOCK values at a time from each chunk's start."""
    out = []
    for start in range(0, n, chunk_size):
        end = min(start + chunk_size, n)
        out.extend(slice(b, min(b + BLOCK, end)) for b in range(start, end, BLOCK))
    return out


def assert_within_bound(sent: np.ndarray, got: np.ndarray, chunk_size: int) -> None:
    """Each finite block comes back within its bound; a block with a NaN or an infinity
    comes back all NaN."""
    assert got.dtype == np.float32 and got.shape == sent.shape
    for block in blocks_of(len(sent), chunk_size):
        x, y = sent[block].astype(np.float64), got[block].astype(np.float64)
        if not np.isfinite(x).all():
            assert np.isnan(y).all(), (block, x, y)
            continue
        absmax = np.abs(x).max()
        if absmax < 2.0**-100:
            continue  # beside the subnormals, float32's own steps are coarser than the bound
        assert (np.abs(x - y) <= BOUND * absmax).all(), (block, np.abs(x - y).max(), absmax)


@pytest.mark.parametrize(("encoder", "decoder"), PAIRS, ids=PAIR_IDS)
@settings(max_examples=examples(40), deadline=None)
@given(grad=float32s, chunk_size=st.integers(1, 2 * BLOCK + 3))
def test_both_implementations_decode_each_others_int8_frames_alike(
    encoder: str, decoder: str, grad: np.ndarray, chunk_size: int
):
    chunk_size = max(chunk_size, -(-len(grad) // 40))  # at most 40 chunks: time
    tx = session(module(encoder), chunk_size, wire_dtype="int8")
    wire = tx.encode_frames(grad)
    got = session(module(decoder), chunk_size).decode_frames(wire)
    # The oracle: the reference's own round trip, bit for bit.
    ref = module("reference")
    want = session(ref, chunk_size).decode_frames(
        session(ref, chunk_size, wire_dtype="int8").encode_frames(grad)
    )
    assert np.array_equal(bits(got), bits(want))
    assert_within_bound(grad, got, chunk_size)


@pytest.mark.parametrize("impl", IMPL_NAMES)
@settings(max_examples=examples(60), deadline=None)
@given(
    grad=hnp.arrays(
        np.float32,
        st.integers(1, 2 * BLOCK + 5),
        elements=st.floats(-(2.0**100), 2.0**100, width=32)
        | st.floats(-(2.0**-90), 2.0**-90, width=32)
        | st.floats(-(2.0**-130), 2.0**-130, width=32),
    ),
)
@example(grad=np.array([2.0**-136, 0.3 * 2.0**-136, -0.61 * 2.0**-136], np.float32))
def test_decoded_values_quantize_back_to_the_same_values(impl: str, grad: np.ndarray):
    """What arrives, sent again on the int8 wire (a relay, a ring all-gather), arrives
    bit for bit: each block gets its scale and its values back (docs/spec/wire-format.md).
    Blocks of magnitude up to 2^100, subnormal ones included."""
    m = module(impl)
    once = session(m, 700).decode_frames(session(m, 700, wire_dtype="int8").encode_frames(grad))
    twice = session(m, 700).decode_frames(session(m, 700, wire_dtype="int8").encode_frames(once))
    assert np.array_equal(bits(twice), bits(once))


@pytest.mark.parametrize("impl", IMPL_NAMES)
def test_special_blocks(impl: str):
    """Zeros, a block with an infinity or a NaN (all NaN, the neighbours untouched), the
    block's largest magnitude exact, subnormals kept by the smallest step."""
    grad = np.full(4 * BLOCK, 0.25, dtype=np.float32)
    grad[:BLOCK] = 0
    grad[BLOCK + 3] = np.inf
    grad[2 * BLOCK + 9] = np.nan
    grad[3 * BLOCK] = -3.0
    tiny = np.array([3, 100, 0], dtype=np.uint32).view(np.float32)
    grad = np.concatenate([grad, tiny])
    m = module(impl)
    got = session(m, len(grad)).decode_frames(
        session(m, len(grad), wire_dtype="int8").encode_frames(grad)
    )
    assert (got[:BLOCK] == 0).all()
    assert np.isnan(got[BLOCK : 3 * BLOCK]).all()
    assert got[3 * BLOCK] == -3.0
    assert np.array_equal(bits(got[-3:]), bits(tiny))
    assert_within_bound(grad, got, len(grad))


@pytest.mark.parametrize("impl", IMPL_NAMES)
@pytest.mark.parametrize("source", ["float16", "float64"])
def test_a_kept_dtype_comes_back_in_its_own_dtype(impl: str, source: str):
    """keep_dtype: the values travel as float32 quantized to int8 and come back in the
    sender's dtype (gradient_dtype), by the cast rule from the dequantized float32."""
    m = module(impl)
    grad = np.random.default_rng(3).standard_normal(1500).astype(numpy_dtype(source))
    tx = session(m, 700, wire_dtype="int8", keep_dtype=True)
    got = session(m, 700).decode_frames(tx.encode_frames(grad))
    assert got.dtype == numpy_dtype(source)
    as_f32 = session(m, 700, wire_dtype="int8").encode_frames(grad)  # float32 handed back
    back32 = session(m, 700).decode_frames(as_f32)
    assert back32.dtype == np.float32
    # The kept-dtype result is the float32 result cast to the sender's dtype.
    assert np.array_equal(got.astype(np.float64), back32.astype(got.dtype).astype(np.float64))


def test_wire_bytes_against_float32():
    """At the default chunk size a gradient's int8 frames are at most 0.26 x its compact
    float32 frames (one byte a value, 8 a block, Arrow's own bytes per chunk)."""
    grad = np.random.default_rng(1).standard_normal(1 << 20).astype(np.float32)
    for m in (gs, module("reference")):
        int8 = len(m.GradientStreamSession("a", wire_dtype="int8").encode_frames(grad))
        f32 = len(m.GradientStreamSession("a", layout="compact").encode_frames(grad))
        assert int8 <= 0.26 * f32, (m.__name__, int8 / f32)
        assert int8 >= 0.25 * f32


@pytest.mark.parametrize("impl", IMPL_NAMES)
def test_reduce_into_adds_the_dequantized_values(impl: str):
    m = module(impl)
    grad = from_bits(sample("float32", 3000, seed=5), "float32")
    wire = session(m, 1000, wire_dtype="int8").encode_frames(grad)
    plain = session(m, 1000).decode_frames(wire)
    total = np.arange(3000, dtype=np.float32)
    session(m, 1000).decode_frames(wire, reduce_into=total)
    assert np.array_equal(total, np.arange(3000, dtype=np.float32) + plain, equal_nan=True)


@pytest.mark.parametrize(("encoder", "decoder"), PAIRS, ids=PAIR_IDS)
def test_tensor_sets_travel_on_the_int8_wire(encoder: str, decoder: str):
    """Names, shapes and dtypes are kept; every tensor's values are the int8 wire's."""
    tensors = {
        "w": np.random.default_rng(7).standard_normal((30, 40)).astype(np.float32),
        "b": np.linspace(-1, 1, 10, dtype=np.float16),
        "empty": np.zeros((0, 3), dtype=np.float64),
    }
    tx = session(module(encoder), 500, wire_dtype="int8", keep_dtype=True, keep_shape=True)
    got = session(module(decoder), 500).decode_tensors(tx.encode_tensors(tensors))
    assert list(got) == list(tensors)
    for name, sent in tensors.items():
        assert got[name].shape == sent.shape and got[name].dtype == sent.dtype, name
    flat = tensors["w"].reshape(-1)
    assert_within_bound(flat, got["w"].reshape(-1), 500)
    assert not np.array_equal(got["w"], tensors["w"])  # lossy, as documented


# ------------------------------------------------------------------ hostile payloads


FLOAT32 = pa.float32()


def int8_payload(
    q: list[int],
    offsets: list[int],
    scales: list[float],
    *,
    scale_type: pa.DataType = FLOAT32,
    scale_name: str = "scale",
    list_nulls: bool = False,
    item_nulls: bool = False,
    scale_nulls: bool = False,
    metadata: dict[str, str] | None = None,
    compression: str | None = None,
) -> bytes:
    """An int8-wire payload written by pyarrow with the given columns, as a hostile or
    foreign writer could make it."""

    def validity(n: int, on: bool) -> pa.Buffer | None:
        if not on:
            return None
        return pa.py_buffer(np.packbits(np.arange(n) > 0, bitorder="little").tobytes())

    item = pa.Array.from_buffers(
        pa.int8(), len(q), [validity(len(q), item_nulls), pa.py_buffer(np.array(q, np.int8))]
    )
    list_type = pa.list_(pa.field("item", pa.int8(), nullable=item_nulls))
    rows = len(offsets) - 1
    blocks = pa.Array.from_buffers(
        list_type,
        rows,
        [validity(rows, list_nulls), pa.py_buffer(np.array(offsets, np.int32))],
        children=[item],
    )
    scale_values = np.array(scales, dtype=scale_type.to_pandas_dtype())
    scale = pa.Array.from_buffers(
        scale_type, rows, [validity(rows, scale_nulls), pa.py_buffer(scale_values)]
    )
    schema = pa.schema(
        [
            pa.field("value", list_type, nullable=list_nulls),
            pa.field(scale_name, scale_type, nullable=scale_nulls),
        ],
        metadata=metadata,
    )
    batch = pa.RecordBatch.from_arrays([blocks, scale], schema=schema)
    return write_ipc_file(schema, batch, compression)


@pytest.mark.parametrize("impl", IMPL_NAMES)
def test_a_foreign_block_layout_decodes_block_by_block(impl: str):
    """A receiver reads each block's length from the offsets: blocks of any length, and a
    child holding values past the last offset (not the rows'), decode alike."""
    body = int8_payload([1, -2, 3, 127, -127, 5, 99], [0, 1, 5, 6], [0.5, 2.0, -1.0])
    got, streamed = both_ways(module(impl), [(0, 1, body)])
    want = np.array([0.5, -4.0, 6.0, 254.0, -254.0, -5.0], dtype=np.float32)
    for outcome in (got, streamed):
        assert np.array_equal(outcome, want), outcome


NO_SCALE = "an int8 'value' column needs a Float32 'scale' column"


@pytest.mark.parametrize("impl", IMPL_NAMES)
@pytest.mark.parametrize(
    ("case", "kwargs", "detail"),
    [
        ("no scale column", {"scale_name": "scales"}, NO_SCALE),
        ("a float64 scale", {"scale_type": pa.float64()}, NO_SCALE),
        ("null blocks", {"list_nulls": True}, "'value' column has 1 null value(s)"),
        ("null scales", {"scale_nulls": True}, "'scale' column has 1 null value(s)"),
        (
            "null int8 values",
            {"item_nulls": True},
            "'value' column's Int8 column has 1 null value(s)",
        ),
        (
            "compressed",
            {"compression": "lz4"},
            "compressed record batch has column 0 of a type other than integer or floating point",
        ),
    ],
)
def test_hostile_int8_payloads_are_refused(
    impl: str, case: str, kwargs: dict[str, Any], detail: str
):
    body = int8_payload([1, 2, 3, 4], [0, 2, 4], [1.0, 2.0], **kwargs)
    for outcome in both_ways(module(impl), [(0, 1, body)]):
        assert_error(outcome, ArrowIpcError, detail, 0)


@pytest.mark.parametrize("impl", IMPL_NAMES)
def test_chunks_of_int8_and_float32_in_one_gradient_are_refused(impl: str):
    m = module(impl)
    grad = np.linspace(-1, 1, 8, dtype=np.float32)
    int8 = split_frames(session(m, 4, wire_dtype="int8").encode_frames(grad))
    f32 = split_frames(session(m, 4, layout="compact").encode_frames(grad))
    for parts, first, second in (
        ([int8[0], f32[1]], "int8", "float32"),
        ([f32[0], int8[1]], "float32", "int8"),
    ):
        for outcome in both_ways(m, parts):
            assert_error(
                outcome,
                FrameError,
                f"chunks disagree on the value dtype: chunk 0 holds {first}, chunk 1 holds "
                f"{second}",
                1,
            )


@pytest.mark.parametrize("impl", IMPL_NAMES)
def test_the_int8_payload_is_covered_by_the_crc(impl: str):
    m = module(impl)
    wire = bytearray(session(m, 600, wire_dtype="int8").encode_frames(np.ones(600, np.float32)))
    (_, _, body), *_ = split_frames(bytes(wire))
    crc = zlib.crc32(body)
    wire[16 + len(body) // 2] ^= 1
    with pytest.raises(gs.ChecksumMismatchError) as info:
        session(m, 600).decode_frames(bytes(wire))
    assert info.value.expected == crc


# ------------------------------------------------------------------ over connections


@pytest.mark.parametrize("size", [50_000, 3_000_000], ids=["small", "large"])
def test_int8_over_a_blocking_connection_to_an_asyncio_receiver(size: int):
    """gradstream.sync sends on the int8 wire (sealed and acknowledged as every transfer
    of a connection), an asyncio receiver with default settings gets what the int8 wire
    carries: the values a local encode and decode give, bit for bit."""
    import asyncio
    import threading

    import gradstream.sync as gsync

    grad = np.random.default_rng(size).standard_normal(size).astype(np.float32)
    int8 = gs.GradientStreamSession("x", wire_dtype="int8")
    want = gs.GradientStreamSession("x").decode_frames(int8.encode_frames(grad))
    got: list[np.ndarray] = []

    async def receive(ready: threading.Event, address: list[str]) -> None:
        listener = await gs.listen("127.0.0.1:0")
        address.append(listener.address)
        ready.set()
        async with await listener.accept() as conn:
            got.append(await conn.recv())
        await listener.close()

    ready, address = threading.Event(), []
    thread = threading.Thread(target=lambda: asyncio.run(receive(ready, address)))
    thread.start()
    assert ready.wait(20)
    with gsync.connect(address[0], session=int8) as conn:
        assert conn.send(grad) >= 1
    thread.join(30)
    assert len(got) == 1 and np.array_equal(bits(got[0]), bits(want))


async def _asyncio_round_trip(grad: np.ndarray) -> np.ndarray:
    listener = await gs.listen(
        "127.0.0.1:0", session=gs.GradientStreamSession("rx", wire_dtype="int8")
    )

    async def echo() -> None:
        async with await listener.accept() as conn:
            await conn.send(await conn.recv())

    task = asyncio.ensure_future(echo())
    async with await gs.connect(
        listener.address, session=gs.GradientStreamSession("tx", wire_dtype="int8")
    ) as conn:
        await conn.send(grad)
        back = await conn.recv()
    await task
    await listener.close()
    return back


def test_int8_both_ways_between_asyncio_peers():
    """Each side quantizes what it sends: a gradient sent, echoed back on the int8 wire,
    is quantized twice (the second time, values already on the first one's grid mostly
    stay put); a float16 gradient comes back as float16 (keep_dtype, a connection's
    default)."""
    grad = np.random.default_rng(9).standard_normal(100_000).astype(np.float32)
    back = asyncio.run(_asyncio_round_trip(grad))
    assert back.dtype == np.float32
    once = gs.GradientStreamSession("x").decode_frames(
        gs.GradientStreamSession("x", wire_dtype="int8").encode_frames(grad)
    )
    twice = gs.GradientStreamSession("x").decode_frames(
        gs.GradientStreamSession("x", wire_dtype="int8").encode_frames(once)
    )
    assert np.array_equal(bits(back), bits(twice))
    half = asyncio.run(_asyncio_round_trip(grad.astype(np.float16)))
    assert half.dtype == np.float16


@pytest.mark.parametrize("impl", IMPL_NAMES)
def test_offsets_past_the_values_in_a_batch_of_no_rows_are_refused(impl: str):
    """pyarrow's validation skips the offsets of a batch with no rows; a reader that
    trusted them would slice past the Int8 values (pyarrow's flatten aborts the
    process). Both refuse the payload."""
    list_type = pa.list_(pa.field("item", pa.int8(), nullable=False))
    empty = pa.array([], type=pa.int8())
    blocks = pa.Array.from_buffers(
        list_type, 0, [None, pa.py_buffer(np.array([2], np.int32))], children=[empty]
    )
    scale = pa.array([], type=pa.float32())
    schema = pa.schema([pa.field("value", list_type), pa.field("scale", pa.float32())])
    body = write_ipc_file(schema, pa.RecordBatch.from_arrays([blocks, scale], schema=schema))
    for outcome in both_ways(module(impl), [(0, 1, body)]):
        assert type(outcome) is ArrowIpcError, outcome


@pytest.mark.parametrize("impl", IMPL_NAMES)
def test_extension_names_on_int8_fields_are_seen_through(impl: str):
    """As a Float32 value column is Float32 whatever extension name its field carries,
    an int8 list and its scale are read by their storage types in both readers."""
    body = int8_payload([1, 2, 3, 4], [0, 2, 4], [1.0, 0.5])
    schema = pa.ipc.open_file(pa.py_buffer(body)).schema
    tagged = schema.set(1, schema.field(1).with_metadata({b"ARROW:extension:name": b"some.other"}))
    batch = pa.ipc.open_file(pa.py_buffer(body)).get_batch(0)
    body = write_ipc_file(tagged, pa.RecordBatch.from_arrays(batch.columns, schema=tagged))
    for outcome in both_ways(module(impl), [(0, 1, body)]):
        assert np.array_equal(outcome, np.array([1, 2, 1.5, 2], np.float32)), outcome


def test_a_peer_with_a_small_max_payload_len_takes_int8_chunks_that_fit():
    """The sender's check before sending measures float32 payloads: on the int8 wire a
    chunk whose float32 payload would be over the peer's max_payload_len but whose int8
    payload is under it is sent, and arrives."""

    async def main() -> np.ndarray:
        small = gs.GradientStreamSession("rx", max_payload_len=100_000)
        listener = await gs.listen("127.0.0.1:0", session=small)

        async def receive() -> np.ndarray:
            async with await listener.accept() as conn:
                return await conn.recv()

        task = asyncio.ensure_future(receive())
        int8 = gs.GradientStreamSession("tx", wire_dtype="int8")
        async with await gs.connect(listener.address, session=int8) as conn:
            await conn.send(np.ones(200_000, np.float32))
        got = await task
        await listener.close()
        return got

    assert np.array_equal(asyncio.run(main()), np.ones(200_000, np.float32))


def test_one_send_on_the_int8_wire_the_next_as_it_is():
    """send(wire_dtype=) is that gradient's wire alone, on either face; a value the
    setting refuses, or int8 on a compressed session, is refused before anything is
    sent, in the setting's words."""
    import threading

    import gradstream.sync as gsync

    grad = np.random.default_rng(4).standard_normal(70_000).astype(np.float32)
    quantized = gs.GradientStreamSession("x").decode_frames(
        gs.GradientStreamSession("x", wire_dtype="int8").encode_frames(grad)
    )
    got: list[np.ndarray] = []
    listener = gsync.listen("127.0.0.1:0")

    def receive() -> None:
        with listener.accept(timeout=20) as conn:
            got.extend(conn)

    thread = threading.Thread(target=receive)
    thread.start()
    with gsync.connect(listener.address) as conn:
        conn.send(grad, wire_dtype="int8")
        conn.send(grad)
        with pytest.raises(gs.SettingError) as info:
            conn.send(grad, wire_dtype="int4")
        assert info.value.setting == "wire_dtype"
        with pytest.raises(TypeError):
            conn.send(grad, wire_dtype=8)  # type: ignore[arg-type]
    thread.join(30)
    listener.close()
    assert len(got) == 2
    assert np.array_equal(bits(got[0]), bits(quantized))
    assert np.array_equal(bits(got[1]), bits(grad))

    async def compressed() -> None:
        listener = await gs.listen("127.0.0.1:0")
        session = gs.GradientStreamSession(compression="lz4")
        async with await gs.connect(listener.address, session=session) as conn:
            with pytest.raises(gs.SettingError, match="does not combine with compression"):
                await conn.send(grad, wire_dtype="int8")
        await listener.close()

    asyncio.run(compressed())


@pytest.mark.parametrize("impl", IMPL_NAMES)
def test_list_offsets_of_a_ragged_byte_count_are_refused_without_a_panic(
    impl: str, capfd: pytest.CaptureFixture[str]
):
    """An offsets buffer that is not a whole number of 4-byte offsets (13 bytes for
    three): arrow-rs would panic on it (a caught panic, but its message on stderr for
    every such frame); the native reader refuses it first. The reference's pyarrow reads
    the three offsets and ignores the byte: a payload damaged inside its Arrow messages,
    the spec's one exception (docs/spec/decoding-rules.md)."""
    from support.payloads import rebuild, the_batch, with_buffer

    body = int8_payload([1, 2, 3, 4], [0, 2, 4], [1.0, 0.5])
    batch = the_batch(body)
    offsets = batch.body[batch.buffers[1][0] : batch.buffers[1][0] + batch.buffers[1][1]]
    ragged = rebuild(body, with_buffer(batch, 1, offsets + b"\0"))
    for outcome in both_ways(module(impl), [(0, 1, ragged)]):
        if impl == "native":
            assert_error(
                outcome,
                ArrowIpcError,
                "int8 'value' list offsets take 13 bytes: not a whole number of 4-byte offsets",
                0,
            )
        else:
            assert np.array_equal(outcome, np.array([1, 2, 1.5, 2], np.float32)), outcome
    assert "panicked" not in capfd.readouterr().err

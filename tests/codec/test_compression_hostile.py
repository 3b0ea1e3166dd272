"""Hostile compressed payloads, against both implementations.

Before anything is decompressed, a compressed record batch is held to bounds (rows against
what max_gradient_len still allows, each buffer's declared uncompressed length against what
its column needs, known codec and method), because an Arrow reader allocates whatever a
buffer declares. The bounds of each buffer, and the bomb from a hostile peer, are in
codec/test_compression_bomb.py.

Hostile payloads are built byte by byte, independently of the reference's own flatbuffer
walk, with the payload surgery of support/payloads.py (``the_batch``, ``with_buffer``,
``rebuild``...). Every such payload gets a correct CRC, so that it reaches the Arrow
decoders.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import gradstream.reference as ref
from gradstream.errors import ArrowIpcError, FrameError
from support.aio import T
from support.compressed import (
    assert_arrow_error,
    assert_bit_equal,
    decode_both_ways,
    session,
    sparse,
    split_frames,
)
from support.frames import frame
from support.impls import CODECS, LAYOUTS
from support.memory import proc_status
from support.payloads import footer_blocks, rebuild, the_batch, value_buffer, with_buffer
from support.values import special


@functools.lru_cache(maxsize=64)
def compressed_payload(codec: str, layout: str, n: int, kind: str = "special") -> bytes:
    """A payload of n values written by the reference (pyarrow)."""
    values = special(n) if kind == "special" else sparse(n)
    return ref.encode_payload(values, layout, codec)


# --------------------------------------------------------------------------- hostile payloads


def test_rebuilt_payloads_decode_like_the_originals(impl: ModuleType):
    """The byte-level builder is faithful: rebuilding a real payload from the fields read
    out of it gives a payload both decoders read to the same values; so the hostile
    variants below fail on the field they change and on nothing else."""
    s = session(impl)
    for codec in CODECS:
        for layout in LAYOUTS:
            for n in (0, 1, 1000):
                payload = compressed_payload(codec, layout, n)
                rebuilt = rebuild(payload, the_batch(payload))
                assert the_batch(rebuilt) == the_batch(payload)
                for outcome in decode_both_ways(s, rebuilt):
                    assert_bit_equal(outcome, special(n), f"{codec} {layout} {n}")


ROWS_MESSAGE = (
    "compressed record batch declares {rows} rows, more than the {room} values "
    "max_gradient_len still allows"
)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("codec", CODECS)
def test_rows_above_max_gradient_len_are_refused(impl: ModuleType, codec: str, layout: str):
    payload = compressed_payload(codec, layout, 2000, "sparse")
    rx = session(impl, max_gradient_len=1000)
    for outcome in decode_both_ways(rx, payload):
        assert_arrow_error(outcome, 0, ROWS_MESSAGE.format(rows=2000, room=1000))
    # At the limit: accepted.
    exact = session(impl, max_gradient_len=2000)
    for outcome in decode_both_ways(exact, payload):
        assert_bit_equal(outcome, sparse(2000))


def test_room_counts_the_values_accepted_before(impl: ModuleType):
    tx = session(ref, 600, compression="lz4")
    grad = sparse(2000)
    frames = split_frames(tx.encode_frames(grad))  # 600, 600, 600, 200 values
    rx = session(impl, max_gradient_len=1000)

    def wire(order: list[int]) -> bytes:
        return b"".join(frame(frames[i][0], 4, frames[i][3]) for i in order)

    # decode_frames: the values accepted so far in arrival order.
    for order, failing, room in (
        ([0, 1, 2, 3], 1, 400),  # 600 accepted
        ([1, 0, 2, 3], 0, 400),  # chunk 1 arrived first and fits; chunk 0 does not
        ([3, 2, 1, 0], 1, 200),  # 200 + 600 accepted
    ):
        with pytest.raises(ArrowIpcError) as info:
            rx.decode_frames(wire(order))
        assert_arrow_error(info.value, failing, ROWS_MESSAGE.format(rows=600, room=room))
    # decode_chunks: the chunks before it in index order, whatever the order given.
    chunks = [impl.GradientChunk("s", i, t, p, crc) for i, t, crc, p in frames]
    for given_order in (chunks, chunks[::-1]):
        with pytest.raises(ArrowIpcError) as info:
            rx.decode_chunks(given_order)
        assert_arrow_error(info.value, 1, ROWS_MESSAGE.format(rows=600, room=400))
    # Without compression the same gradient is the FrameError of the limit (frames) and
    # unlimited (chunks): unchanged.
    plain = session(ref, 600)
    with pytest.raises(FrameError, match="gradient exceeds max_gradient_len 1000"):
        rx.decode_frames(plain.encode_frames(grad))
    assert_bit_equal(rx.decode_chunks(plain.encode_gradient(grad)), grad)


@pytest.mark.parametrize("codec", CODECS)
def test_buffer_declaring_a_terabyte_is_refused_before_any_allocation(impl: ModuleType, codec: str):
    payload = compressed_payload(codec, "compact", 1000, "sparse")
    batch = the_batch(payload)
    i = value_buffer(batch)
    data = bytearray(batch.body[batch.buffers[i][0] :][: batch.buffers[i][1]])
    data[:8] = (2**40).to_bytes(8, "little")
    hostile = rebuild(payload, with_buffer(batch, i, bytes(data)))
    s = session(impl)
    detail = "compressed IPC buffer 1 (data of column 0) declares 1099511627776 bytes "
    detail += "uncompressed; 1000 rows need at most 4000"

    def decode() -> list[Any]:
        return decode_both_ways(s, hostile)

    decode()  # warm up (first use of a codec or pool)
    t0 = time.monotonic()
    outcomes, growth = with_rss_growth(decode)
    assert time.monotonic() - t0 < 1.0
    assert growth < 100 * 2**20, f"RSS grew by {growth / 2**20:.0f} MiB"
    for outcome in outcomes:
        assert_arrow_error(outcome, 0, detail)


def with_rss_growth(call: Callable[[], T]) -> tuple[T, int]:
    """call()'s result and how far the peak RSS rose above the RSS before it (resetting
    the peak where the kernel allows; otherwise only a rise above the old peak shows)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # peak RSS := current RSS
        before = proc_status("VmRSS")
    except OSError:
        before = proc_status("VmHWM")
    result = call()
    return result, proc_status("VmHWM") - before


BOMB_BYTES = 256 * 2**20  # what a bomb buffer really decompresses to


@functools.lru_cache(maxsize=2)
def bomb(codec: str) -> bytes:
    """A compact payload declaring 1000 rows whose value buffer is a genuine compressed
    stream of 256 MiB of zeros (some kilobytes), with that length declared: a reader
    without the bound on the declared length allocates and fills all of it."""
    payload = compressed_payload(codec, "compact", 1000, "sparse")
    batch = the_batch(payload)
    zeros = np.zeros(BOMB_BYTES, np.uint8)  # calloc'd: reading it maps the zero page
    stream = pa.compress(zeros, codec=codec, asbytes=True)
    data = BOMB_BYTES.to_bytes(8, "little") + stream
    return rebuild(payload, with_buffer(batch, value_buffer(batch), data))


def test_bomb_is_real():
    """The control: pyarrow alone, handed the bomb, really allocates it (the buffer is
    larger than the batch needs, which Arrow readers accept)."""
    # Memory pyarrow's pool kept from earlier tests would serve the bomb without the RSS
    # rising: hand it back first, so that the control does not depend on the test order.
    pa.default_memory_pool().release_unused()
    (got, growth) = with_rss_growth(
        lambda: pa.ipc.open_file(pa.py_buffer(bomb("zstd"))).get_batch(0)
    )
    assert got.num_rows == 1000
    assert growth > BOMB_BYTES // 2, f"RSS grew by {growth / 2**20:.0f} MiB only"
    del got


@pytest.mark.parametrize("codec", CODECS)
def test_bomb_is_refused_without_decompressing(impl: ModuleType, codec: str):
    payload = bomb(codec)
    s = session(impl)
    outcomes, growth = with_rss_growth(lambda: decode_both_ways(s, payload))
    assert growth < 100 * 2**20, f"RSS grew by {growth / 2**20:.0f} MiB"
    for outcome in outcomes:
        assert_arrow_error(
            outcome,
            0,
            f"compressed IPC buffer 1 (data of column 0) declares {BOMB_BYTES} bytes "
            "uncompressed; 1000 rows need at most 4000",
        )


@pytest.mark.parametrize("codec", CODECS)
def test_bomb_under_a_small_declared_length_is_refused(impl: ModuleType, codec: str):
    """The same 256 MiB stream declaring 4000 bytes, the bound of 1000 float32 rows: the
    decompressor must stop at the declared length rather than follow the stream."""
    payload = compressed_payload(codec, "compact", 1000, "sparse")
    batch = the_batch(payload)
    stream = bomb(codec)
    stream_batch = the_batch(stream)
    o, n = stream_batch.buffers[value_buffer(stream_batch)]
    data = (4000).to_bytes(8, "little") + stream_batch.body[o + 8 : o + n]
    hostile = rebuild(payload, with_buffer(batch, value_buffer(batch), data))
    s = session(impl)
    outcomes, growth = with_rss_growth(lambda: decode_both_ways(s, hostile))
    assert growth < 100 * 2**20, f"RSS grew by {growth / 2**20:.0f} MiB"
    for outcome in outcomes:
        assert_arrow_error(outcome, 0)


@functools.lru_cache(maxsize=2)
def zeros_payload(codec: str, n: int) -> bytes:
    return ref.encode_payload(np.zeros(n, np.float32), "compact", codec)


@pytest.mark.parametrize("codec", CODECS)
def test_legit_large_batch_is_refused_by_rows_before_decompressing(impl: ModuleType, codec):
    """A real 64M-value payload of zeros (kilobytes compressed) sent to a receiver that
    accepts 1000 values: refused by its rows, nothing decompressed."""
    n = BOMB_BYTES // 4
    payload = zeros_payload(codec, n)
    assert len(payload) < 2 * 2**20
    s = session(impl, max_gradient_len=1000)
    outcomes, growth = with_rss_growth(lambda: decode_both_ways(s, payload))
    assert growth < 100 * 2**20, f"RSS grew by {growth / 2**20:.0f} MiB"
    for outcome in outcomes:
        assert_arrow_error(outcome, 0, ROWS_MESSAGE.format(rows=n, room=1000))


@pytest.mark.parametrize("declared", [-2, -(2**63)])
def test_negative_declared_length_other_than_minus_one_is_refused(impl: ModuleType, declared):
    payload = compressed_payload("zstd", "compact", 100)
    batch = the_batch(payload)
    i = value_buffer(batch)
    o, n = batch.buffers[i]
    data = declared.to_bytes(8, "little", signed=True) + batch.body[o + 8 : o + n]
    for outcome in decode_both_ways(session(impl), rebuild(payload, with_buffer(batch, i, data))):
        assert_arrow_error(
            outcome,
            0,
            f"compressed IPC buffer 1 (data of column 0) declares {declared} bytes "
            "uncompressed; 100 rows need at most 400",
        )


@pytest.mark.parametrize("codec", CODECS)
def test_buffer_stored_uncompressed_is_read(impl: ModuleType, codec: str):
    """A declared length of -1: the bytes after the prefix are the buffer as it is (what
    writers do when compression does not pay)."""
    payload = compressed_payload(codec, "seed", 300)
    batch = the_batch(payload)
    raw = np.arange(300, dtype=np.int32).tobytes(), special(300).tobytes()
    batch = with_buffer(batch, 1, (-1).to_bytes(8, "little", signed=True) + raw[0])
    batch = with_buffer(batch, 3, (-1).to_bytes(8, "little", signed=True) + raw[1])
    for outcome in decode_both_ways(session(impl), rebuild(payload, batch)):
        assert_bit_equal(outcome, special(300))


@pytest.mark.parametrize("length", [1, 5, 7])
@pytest.mark.parametrize("codec", CODECS)
def test_short_buffer_without_length_prefix(impl: ModuleType, codec: str, length: int):
    payload = compressed_payload(codec, "compact", 100)
    batch = the_batch(payload)
    hostile = rebuild(payload, with_buffer(batch, value_buffer(batch), b"\x01" * length))
    for outcome in decode_both_ways(session(impl), hostile):
        assert_arrow_error(
            outcome, 0, f"compressed IPC buffer of {length} bytes has no length prefix"
        )


@pytest.mark.parametrize("codec_id", [2, 3, 127, -1, -128])
def test_unknown_codec(impl: ModuleType, codec_id: int):
    # The codec is a flatbuffer `byte` (int8): 0xFF is -1.
    payload = compressed_payload("zstd", "seed", 100)
    batch = the_batch(payload)._replace(compression=(codec_id, 0))
    for outcome in decode_both_ways(session(impl), rebuild(payload, batch)):
        assert_arrow_error(outcome, 0, f"unknown IPC compression codec {codec_id}")


@pytest.mark.parametrize("method", [1, 2, -1])
def test_unknown_method(impl: ModuleType, method: int):
    payload = compressed_payload("lz4", "seed", 100)
    batch = the_batch(payload)._replace(compression=(0, method))
    for outcome in decode_both_ways(session(impl), rebuild(payload, batch)):
        assert_arrow_error(outcome, 0, f"unknown IPC compression method {method}")


def test_check_order(impl: ModuleType):
    """Several faults in one batch: the codec, then the method (they say how to read the
    buffers at all), then the rows, then each buffer; the first fault found is named."""
    payload = compressed_payload("zstd", "compact", 2000, "sparse")
    batch = the_batch(payload)
    short = with_buffer(batch, value_buffer(batch), b"\x01" * 5)
    rx = session(impl, max_gradient_len=1000)
    cases = [
        (short._replace(compression=(5, 3)), "unknown IPC compression codec 5"),
        (short._replace(compression=(1, 3)), "unknown IPC compression method 3"),
        (short, ROWS_MESSAGE.format(rows=2000, room=1000)),
    ]
    for hostile, detail in cases:
        for outcome in decode_both_ways(rx, rebuild(payload, hostile)):
            assert_arrow_error(outcome, 0, detail)


def ipc_file(batches: list[np.ndarray], codec: str, legacy: bool = False) -> bytes:
    """A compact-layout payload of several record batches, written by pyarrow."""
    schema = ref.COMPACT_SCHEMA
    options = pa.ipc.IpcWriteOptions(compression=codec, use_legacy_format=legacy)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, schema, options=options) as writer:
        for values in batches:
            writer.write_batch(pa.record_batch([pa.array(values)], schema=schema))
    return sink.getvalue().to_pybytes()


def test_every_batch_of_a_payload_is_checked(impl: ModuleType):
    """Each batch's rows are held to the room left: the room before the chunk, less the
    rows of the compressed batches before it in the same payload (so that many batches
    cannot multiply what one payload makes a reader allocate)."""
    first, second = sparse(600), special(600)
    payload = ipc_file([first, second], "lz4")
    both = np.concatenate([first, second])
    for outcome in decode_both_ways(session(impl), payload):
        assert_bit_equal(outcome, both)
    for outcome in decode_both_ways(session(impl, max_gradient_len=1000), payload):
        assert_arrow_error(outcome, 0, ROWS_MESSAGE.format(rows=600, room=400))
    for outcome in decode_both_ways(session(impl, max_gradient_len=1200), payload):
        assert_bit_equal(outcome, both)
    for outcome in decode_both_ways(session(impl, max_gradient_len=599), payload):
        assert_arrow_error(outcome, 0, ROWS_MESSAGE.format(rows=600, room=599))
    # A hostile second batch is found too.
    bad = ipc_file([sparse(10), sparse(700)], "zstd")
    for outcome in decode_both_ways(session(impl, max_gradient_len=650), bad):
        assert_arrow_error(outcome, 0, ROWS_MESSAGE.format(rows=700, room=640))


def test_legacy_message_framing_is_checked(impl: ModuleType):
    """Messages written without the continuation marker (before Arrow 0.15) are read,
    and checked, too."""
    payload = ipc_file([sparse(1000)], "zstd", legacy=True)
    (block,) = footer_blocks(payload)
    assert payload[block.offset : block.offset + 4] != b"\xff\xff\xff\xff"
    for outcome in decode_both_ways(session(impl), payload):
        assert_bit_equal(outcome, sparse(1000))
    for outcome in decode_both_ways(session(impl, max_gradient_len=500), payload):
        assert_arrow_error(outcome, 0, ROWS_MESSAGE.format(rows=1000, room=500))


def test_codec_mislabelled_but_known_is_a_reader_error(impl: ModuleType):
    """An LZ4 body labelled ZSTD passes the checks; the decompressor then refuses it."""
    payload = compressed_payload("lz4", "compact", 100)
    batch = the_batch(payload)._replace(compression=(1, 0))
    for outcome in decode_both_ways(session(impl), rebuild(payload, batch)):
        assert_arrow_error(outcome, 0)


def test_uncompressed_receiver_limits_are_unchanged(impl: ModuleType):
    """The checks apply to compressed batches only: an uncompressed payload of 2000 values
    still meets max_gradient_len as before (FrameError after decoding, frames only)."""
    payload = ref.encode_payload(sparse(2000), "compact")
    rx = session(impl, max_gradient_len=1000)
    chunks_outcome, frames_outcome = decode_both_ways(rx, payload)
    assert_bit_equal(chunks_outcome, sparse(2000))
    assert isinstance(frames_outcome, FrameError)
    assert "gradient exceeds max_gradient_len 1000" in frames_outcome.detail

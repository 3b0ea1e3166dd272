"""Differential property tests: the native extension against ``gradstream.reference``.

Hypothesis draws gradients (lengths biased toward chunk-size multiples and their
neighbours, values drawn as raw float32 bit patterns); the native module and the
pure-Python reference must produce the same chunks and bit-equal values. Then regressions:
odd Arrow files both must refuse. The hostile mutations of valid streams are in
test_differential_errors.py; hand-picked cases of single rules in rules/ and
test_encoding.py.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

pytest.importorskip("gradstream._native", reason="native extension not built")

import gradstream as gs
import gradstream.reference as ref
from gradstream.errors import ArrowIpcError
from support.differential import IMPLS, Frame, frame_of, join_frames, make_gradient, sessions
from support.frames import HEADER, HEADER_LEN
from support.impls import examples
from support.payloads import Flat

# Round trips: at most this many values and this many chunks per gradient, so that the
# reference (tens of microseconds per chunk and operation) keeps the file fast.
MAX_LEN = 300_000


MAX_CHUNKS = 600


# Arrival orders of up to this many chunks are hypothesis permutations (so they shrink);
# longer ones are numpy permutations seeded by hypothesis.
MAX_DRAWN_PERMUTATION = 64


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


# --------------------------------------------------------------------------- round trips


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


# --------------------------------------------------------------------------- regressions
# Disagreements the property test above found, where one side silently returned fewer
# values than the chunk holds while the other raised ArrowIpcError. Both now refuse.


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

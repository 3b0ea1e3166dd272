"""Tensor sets on arrival: hostile manifests, and tensors that do not match their
manifest entry, against both implementations.

Hostile manifests are built with the sessions' ``_encode_manifest(text)``; hostile tensors
with ordinary sessions (``keep_shape=True, keep_dtype=True``).
"""

from __future__ import annotations

import json
import socket
import tracemalloc
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from gradstream.errors import (
    ChecksumMismatchError,
    FrameError,
    GradientStreamError,
    StreamIOError,
    StreamTimeoutError,
    TensorSetError,
)
from gradstream.reference._manifest import Entry
from gradstream.reference._manifest import manifest_json as manifest_text
from support.frames import HEADER, HEADER_LEN
from support.impls import IMPL_NAMES
from support.impls import load_impl as module
from support.tensor_sets import (
    MiB,
    assert_error,
    assert_set,
    described,
    expected,
    frames_of,
    manifest_codecs,
    note_of,
    outcome,
    raw,
    receive_bytes,
    run,
    session,
)

NOT_CHUNKED = (
    "not a tensor set: the first gradient has {} chunks; a set starts with a one-chunk manifest"
)


NO_MANIFEST = "not a tensor set: the first gradient has no gradstream_tensors manifest"


NOT_JSON = "tensor set manifest is not valid JSON"


TOO_DEEP = "tensor set manifest nests arrays or objects deeper than 32 levels"


def manifest_for(impl: ModuleType, entries: list[Entry], **kwargs: Any) -> bytes:
    return bytes(session(impl, **kwargs)._encode_manifest(manifest_text(entries)))


def tensor_frames(impl: ModuleType, value: Any, chunk_size: int = 4, **kwargs: Any) -> bytes:
    s = session(impl, chunk_size, keep_shape=True, keep_dtype=True, **kwargs)
    return bytes(s.encode_frames(value))


def everywhere(impl: ModuleType, data: bytes, **kwargs: Any) -> list[Any]:
    """The outcome of decode_tensors(data) and of receive_tensors over a socket and over
    asyncio streams, from a session with ``kwargs``."""
    s = session(impl, **kwargs)
    found = [outcome(lambda: s.decode_tensors(data))]
    for path in ("socket", "streams"):
        found.append(run(lambda path=path: receive_bytes(s, data, path)))
    return found


# --------------------------------------------------------------------------- manifests


@pytest.mark.parametrize("codec", manifest_codecs())
def test_parse_manifest_accepts_the_documented_form(codec: Any) -> None:
    write, parse_manifest = codec
    text = write(
        [
            Entry("fc.weight", "float32", (768, 3072)),
            Entry("s", "bfloat16", ()),
            Entry("e", "float64", (0, 10**18 - 1)),
        ]
    )
    assert text == (
        '{"format":"gradstream.tensors","version":1,"tensors":['
        '{"name":"fc.weight","dtype":"float32","shape":[768,3072]},'
        '{"name":"s","dtype":"bfloat16","shape":[]},'
        '{"name":"e","dtype":"float64","shape":[0,999999999999999999]}]}'
    )
    assert parse_manifest(text) == [
        Entry("fc.weight", "float32", (768, 3072)),
        Entry("s", "bfloat16", ()),
        Entry("e", "float64", (0, 10**18 - 1)),
    ]
    # Key order and whitespace are free; 32 dimensions are allowed; names are UTF-8.
    loose = (
        '{ "tensors" : [ {"shape":' + json.dumps([1] * 32) + ', "dtype":"float16", '
        '"name":"\\u00e9"} ], "version":1, "format":"gradstream.tensors" }'
    )
    assert parse_manifest(loose) == [Entry("é", "float16", (1,) * 32)]
    assert parse_manifest('{"format":"gradstream.tensors","version":1,"tensors":[]}') == []


def _doc(*entries: Any, **top: Any) -> str:
    doc = {"format": "gradstream.tensors", "version": 1, "tensors": list(entries)}
    doc.update(top)
    return json.dumps(doc)


def _entry(name: Any = "w", dtype: Any = "float32", shape: Any = (2,), **extra: Any) -> dict:
    e = {"name": name, "dtype": dtype, "shape": list(shape) if isinstance(shape, tuple) else shape}
    e.update(extra)
    return e


# (manifest text, TensorSetError text, .name)
HOSTILE_MANIFESTS = [
    ("{", NOT_JSON, None),
    ("", NOT_JSON, None),
    ('{"format":"gradstream.tensors","version":1,"tensors":[]} x', NOT_JSON, None),
    ("[1]", "tensor set manifest is a JSON array, not an object", None),
    ('{"format":"gradstream.tensors","version":NaN,"tensors":[]}', NOT_JSON, None),
    ("[" * 100_000 + "]" * 100_000, TOO_DEEP, None),  # refused before parsing: no crash
    (
        '{"format":"gradstream.tensors","version":1}',
        'tensor set manifest has no "tensors" key',
        None,
    ),
    (
        _doc(extra=1),
        'tensor set manifest has an unexpected key "extra" (its keys are format, version, tensors)',
        None,
    ),
    (
        '{"format":"gradstream.tensors","format":"gradstream.tensors","version":1,"tensors":[]}',
        'tensor set manifest repeats the key "format" in one JSON object',
        None,
    ),
    (
        _doc(format="gradstream.gradients"),
        'tensor set manifest format is "gradstream.gradients", not "gradstream.tensors"',
        None,
    ),
    (
        _doc(version=2),
        "tensor set manifest version 2 is not supported (this gradstream reads version 1)",
        None,
    ),
    (
        _doc(version=True),
        "tensor set manifest version true is not supported (this gradstream reads version 1)",
        None,
    ),
    (
        _doc(version=1.0),
        "tensor set manifest version 1.0 is not supported (this gradstream reads version 1)",
        None,
    ),
    (
        _doc(version="1"),
        'tensor set manifest version "1" is not supported (this gradstream reads version 1)',
        None,
    ),
    (_doc(tensors={"w": 1}), 'tensor set manifest "tensors" is a JSON object, not an array', None),
    (_doc(5), "tensor set manifest entry 1 of 1 is a JSON integer, not an object", None),
    (
        _doc(_entry(), {"name": "v", "dtype": "float32"}),
        'tensor set manifest entry 2 of 2 has no "shape" key',
        "v",
    ),
    (
        _doc(_entry(layout="seed")),
        'tensor set manifest entry 1 of 1 has an unexpected key "layout" (its keys are name, '
        "dtype, shape)",
        "w",
    ),
    (
        '{"format":"gradstream.tensors","version":1,"tensors":[{"name":"w","name":"v","dtype":"float32","shape":[]}]}',
        'tensor set manifest repeats the key "name" in one JSON object',
        None,
    ),
    (
        _doc(_entry(name=7)),
        "tensor set manifest entry 1 of 1: its name is a JSON integer, not a string",
        None,
    ),
    (
        _doc(_entry(name=None)),
        "tensor set manifest entry 1 of 1: its name is a JSON null, not a string",
        None,
    ),
    (_doc(_entry(name="")), "a tensor name is empty; names are non-empty strings", ""),
    (
        _doc(_entry(name="n" * 1025)),
        'tensor name "' + "n" * 76 + "... takes 1025 UTF-8 bytes, above the limit of 1024",
        "n" * 1025,
    ),
    # A lone surrogate escape: no UTF-8 form, refused after the parse as not JSON.
    (
        '{"format":"gradstream.tensors","version":1,"tensors":[{"name":"\\ud800","dtype":"float32","shape":[]}]}',
        NOT_JSON,
        None,
    ),
    (_doc(_entry(), _entry(shape=(1,))), 'tensor name "w" appears twice in the tensor set', "w"),
    (
        _doc(_entry(dtype="int8")),
        'tensor "w": dtype "int8" is not float16, bfloat16, float32 or float64',
        "w",
    ),
    (
        _doc(_entry(dtype=["float32"])),
        'tensor "w": dtype ["float32"] is not float16, bfloat16, float32 or float64',
        "w",
    ),
    (
        _doc(_entry(shape="[2]")),
        'tensor "w": its shape is a JSON string, not an array of integers',
        "w",
    ),
    (
        _doc(_entry(shape=(-1,))),
        'tensor "w": shape dimension -1 is not an integer of at most 18 digits',
        "w",
    ),
    (
        _doc(_entry(shape=(2.0,))),
        'tensor "w": shape dimension 2.0 is not an integer of at most 18 digits',
        "w",
    ),
    (
        _doc(_entry(shape=(True,))),
        'tensor "w": shape dimension true is not an integer of at most 18 digits',
        "w",
    ),
    (
        _doc(_entry(shape=(10**18,))),
        'tensor "w": shape dimension 1000000000000000000 is not an integer of at most 18 digits',
        "w",
    ),
    (_doc(_entry(shape=(1,) * 33)), 'tensor "w": its shape has 33 dimensions, more than 32', "w"),
]


@pytest.mark.parametrize("codec", manifest_codecs())
@pytest.mark.parametrize(("text", "message", "name"), HOSTILE_MANIFESTS)
def test_parse_manifest_refuses(codec, text, message, name):
    _, parse_manifest = codec
    with pytest.raises(TensorSetError) as info:
        parse_manifest(text)
    assert str(info.value) == message
    assert info.value.name == name


@pytest.mark.parametrize("impl_name", IMPL_NAMES)
def test_hostile_manifests_everywhere(impl_name):
    impl = module(impl_name)
    for text, message, name in HOSTILE_MANIFESTS[:-1:3] + HOSTILE_MANIFESTS[-1:]:
        data = bytes(session(impl)._encode_manifest(text))
        for got in everywhere(impl, data):
            assert type(got) is TensorSetError, (text[:50], got)
            assert str(got) == message
            assert got.name == name


def test_manifest_values_above_max_gradient_len(impl):
    cases = [
        (
            [Entry("a", "float32", (10, 11))],
            "tensor set holds 110 values, above max_gradient_len 100",
        ),
        (
            [Entry("a", "float16", (50,)), Entry("b", "float64", (1 << 30, 1 << 30))],
            f"tensor set holds {50 + (1 << 60)} values, above max_gradient_len 100",
        ),
    ]
    for entries, text in cases:
        data = manifest_for(impl, entries)
        for got in everywhere(impl, data, max_gradient_len=100):
            assert_error(got, TensorSetError, text, name=None)
    # Exactly the limit passes the manifest check (and then the set is cut short).
    data = manifest_for(impl, [Entry("a", "float32", (10, 10))])
    for got in everywhere(impl, data, max_gradient_len=100):
        assert_error(
            got,
            TensorSetError,
            "the tensor set ends after 0 of its 1 tensors",
            name=None,
            notes=[note_of("a", 1, 1)],
        )


def test_plain_gradients_are_not_tensor_sets(impl):
    s = session(impl, 4)
    multi = s.encode_frames(np.zeros(10, np.float32))  # 3 chunks
    for got in everywhere(impl, multi):
        assert_error(got, TensorSetError, NOT_CHUNKED.format(3), name=None)
    empty = s.encode_frames(np.zeros(0, np.float32))  # one chunk, no manifest
    for got in everywhere(impl, empty):
        assert_error(got, TensorSetError, NO_MANIFEST, name=None)
    # A one-chunk gradient with values: the manifest may hold none.
    one = s.encode_frames(np.zeros(1, np.float32))
    for got in everywhere(impl, one):
        assert_error(got, FrameError, "gradient exceeds max_gradient_len 0: 1 values by chunk 0")
    four = s.encode_frames(np.zeros(4, np.float32))
    for got in everywhere(impl, four):
        assert type(got) is FrameError and "exceeds max_gradient_len" in str(got)
    # A header saying 0 or 2**32-1 chunks, with no payload at all.
    for total in (0, 2, 0xFFFF_FFFF):
        data = HEADER.pack(0, total, 1 << 30, 0)
        for got in everywhere(impl, data):
            assert_error(got, TensorSetError, NOT_CHUNKED.format(total), name=None)


@pytest.mark.parametrize("path", ["socket", "streams"])
def test_huge_manifest_frame_refused_before_reading_it(impl, path):
    s = session(impl)
    declared = 16 * MiB + 1
    data = HEADER.pack(0, 1, declared, 0) + b"\x00" * 1000
    text = f"chunk 0 declares a {declared}-byte payload, above max_payload_len {16 * MiB}"

    async def main() -> Any:
        tracemalloc.start()
        try:
            # The peer stays connected: the error must not wait for the payload.
            got = await receive_bytes(s, data, path, close=False)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 4 * MiB, peak
        return got

    got = run(main)
    assert_error(got, FrameError, text)
    assert (got.chunk_index, got.offset) == (0, 0)
    mem = outcome(lambda: s.decode_tensors(data))
    assert described(mem) == described(got)
    # A session's smaller max_payload_len is the cap.
    small = session(impl, max_payload_len=1000)
    data = HEADER.pack(0, 1, 1001, 0)
    for got in everywhere(impl, data, max_payload_len=1000):
        assert_error(
            got, FrameError, "chunk 0 declares a 1001-byte payload, above max_payload_len 1000"
        )
    assert small.max_payload_len == 1000


def test_truncated_manifest_frames(impl):
    good = manifest_for(impl, [Entry("a", "float32", (2,))])
    truncated = f"truncated frame: chunk 0 declares a {len(good) - 16}-byte payload but"
    cases = [
        (good[:5], FrameError, "truncated frame header: 5 of 16 bytes", None),
        (good[:15], FrameError, "truncated frame header: 15 of 16 bytes", None),
        (
            good[:40],
            FrameError,
            f"{truncated} only 24 bytes follow",
            0,
        ),
        (
            good[:16],
            FrameError,
            f"{truncated} only 0 bytes follow",
            0,
        ),
    ]
    for data, cls, text, index in cases:
        found = everywhere(impl, data)
        for got in found:
            assert_error(got, cls, text)
            assert (got.chunk_index, got.offset) == (index, 0)
        assert len({repr(described(g)) for g in found}) == 1
    # A manifest frame that says chunk 3 of 1: the decoding rules' out-of-range error.
    bad = HEADER.pack(3, 1, len(good) - 16, HEADER.unpack_from(good)[3]) + good[16:]
    found = everywhere(impl, bad)
    assert all(type(g) is FrameError and "out of range" in str(g) for g in found), found
    # A damaged CRC.
    bad = good[:12] + b"\x00\x00\x00\x00" + good[16:]
    assert all(type(g) is ChecksumMismatchError for g in everywhere(impl, bad))


# ---------------------------------------------------------------------- tensors off their entry


def test_tensor_arriving_other_than_its_manifest_entry(impl):
    m = manifest_for(impl, [Entry("ok", "float64", ()), Entry("fc.weight", "float32", (4, 3))])
    ok = tensor_frames(impl, np.array(1.0))
    cases = [
        (
            np.zeros((3, 4), np.float16),
            'tensor "fc.weight" arrived as float16 [3,4]; the manifest says float32 [4,3]',
        ),
        (
            np.zeros((4, 3), np.float64)[:, :2],
            'tensor "fc.weight" arrived as float64 [4,2]; the manifest says float32 [4,3]',
        ),
        (
            np.zeros(12, np.float32),
            'tensor "fc.weight" arrived as float32 [12]; the manifest says float32 [4,3]',
        ),
    ]
    for value, text in cases:
        data = m + ok + tensor_frames(impl, value)
        for got in everywhere(impl, data):
            assert_error(
                got, TensorSetError, text, name="fc.weight", notes=[note_of("fc.weight", 2, 2)]
            )
    # Shape-less float32 frames match a 1-D float32 entry (the shape is the flat one).
    m1 = manifest_for(impl, [Entry("v", "float32", (3,))])
    plain = session(impl).encode_frames(np.arange(3, dtype=np.float32))
    for got in everywhere(impl, m1 + plain):
        assert_set(got, expected({"v": np.arange(3, dtype=np.float32)}))


def test_tensor_larger_than_its_manifest_entry_is_cut_off(impl):
    m = manifest_for(impl, [Entry("w", "float32", (2,))])
    data = m + tensor_frames(impl, np.zeros(40, np.float32), chunk_size=64)
    found = everywhere(impl, data)
    for got in found:
        assert type(got) is FrameError, got
        assert got.detail.startswith("gradient exceeds max_gradient_len 2: 40 values by chunk 0"), (
            got
        )
        assert got.__notes__ == [note_of("w", 1, 1)]
    # A total_chunks above what the entry allows is refused from the first header.
    hostile = m + HEADER.pack(0, 1_000_000, 0, 0)
    for got in everywhere(impl, hostile):
        assert type(got) is FrameError, got
    # A total_chunks the entry allows (2**29) over 1 MiB of empty frames: the walk to the
    # next tensor stops at the end of the data.
    big = manifest_for(impl, [Entry("w", "float32", (2**29,)), Entry("v", "float32", ())])
    data = big + HEADER.pack(0, 2**29, 0, 0) + bytes(MiB)
    other = session(module("native" if impl.__name__.endswith("reference") else "reference"))
    got = outcome(lambda: session(impl).decode_tensors(data))
    assert isinstance(got, GradientStreamError) and got.__notes__ == [note_of("w", 1, 2)]
    assert described(got) == described(outcome(lambda: other.decode_tensors(data)))
    assert len({repr(described(g)) for g in found}) == 1


def test_errors_while_receiving_carry_a_note(impl):
    s = session(impl, 2)
    t = {"a": raw((3,), "float32", 1), "b": raw((5,), "float16", 2), "c": raw((2, 2), "float64", 3)}
    wire = bytearray(s.encode_tensors(t))
    heads = frames_of(bytes(wire))
    # The second frame of tensor "b" (manifest, a0, a1, b0, b1, ...): flip a payload byte.
    offset, header = heads[4]
    assert header[:2] == (1, 3)
    wire[offset + HEADER_LEN + 10] ^= 0xFF
    for got in everywhere(impl, bytes(wire)):
        assert type(got) is ChecksumMismatchError
        assert got.chunk_index == 1
        assert got.__notes__ == [note_of("b", 2, 3)]


def test_timeouts(impl):
    s = session(impl, timeout=0.3)
    manifest = manifest_for(impl, [Entry("w", "float32", (2,))])

    async def main() -> None:
        a, b = socket.socketpair()
        with a, b:
            # Nothing at all.
            with pytest.raises(StreamTimeoutError) as info:
                await s.receive_tensors(b)
            assert (info.value.timeout, info.value.received, info.value.total) == (0.3, 0, None)
            # Half a manifest payload.
            a.sendall(manifest[:30])
            with pytest.raises(StreamTimeoutError) as info:
                await s.receive_tensors(b)
            assert info.value.total == 1
            assert not getattr(info.value, "__notes__", [])
        a, b = socket.socketpair()
        with a, b:
            # A manifest, then silence.
            a.sendall(manifest)
            with pytest.raises(StreamTimeoutError) as info:
                await s.receive_tensors(b)
            assert info.value.__notes__ == [note_of("w", 1, 1)]
        a, b = socket.socketpair()
        with a, b:
            # A sender whose peer never reads: a manifest larger than the socket buffers.
            many = [(f"{i:05d}" + "x" * 900, np.zeros(1, np.float32)) for i in range(4000)]
            with pytest.raises(StreamTimeoutError) as info:
                await s.stream_tensors(many, a)
            assert (info.value.received, info.value.total) == (0, 1)
        a, b = socket.socketpair()
        with a, b:
            # ... or a tensor larger than them.
            with pytest.raises(StreamTimeoutError) as info:
                await s.stream_tensors({"big": np.zeros(4_000_000, np.float32)}, a)
            assert info.value.__notes__ == ['while sending tensor "big" (1 of 1) of a tensor set']

    run(main)


def test_peer_gone(impl):
    s = session(impl)

    async def main() -> None:
        a, b = socket.socketpair()
        with a:
            b.close()
            with pytest.raises(StreamIOError) as info:
                await s.stream_tensors({"w": np.zeros(1000, np.float32)}, a)
            assert info.value.errno in (32, 104)  # EPIPE, ECONNRESET

    run(main)

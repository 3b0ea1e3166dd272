"""Named tensor sets (README "Tensor sets"), against both implementations.

A set is a manifest (a one-frame empty gradient whose schema metadata
``gradstream_tensors`` names each tensor with its dtype and shape) followed by one
keep_shape/keep_dtype gradient per tensor. The logic is shared (``gradstream._tensors``);
each implementation brings its own codec, so every round trip here also runs across the
two (encode with one, decode with the other), and the failure cases compare both.

Hostile manifests are built with the sessions' ``_encode_manifest(text)``; hostile tensors
with ordinary sessions (``keep_shape=True, keep_dtype=True``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import socket
import struct
import tracemalloc
from collections.abc import AsyncIterator, Callable
from types import ModuleType
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import gradstream._dtypes as dt
import gradstream._tensors as tensors_mod
from gradstream._tensors import Entry, manifest_text, parse_manifest
from gradstream.errors import (
    ChecksumMismatchError,
    FrameError,
    GradientStreamError,
    IncompleteStreamError,
    StreamIOError,
    StreamTimeoutError,
    TensorSetError,
)
from support.aio import T, close_all, tcp_socket_pair
from support.aio import run as run_under_deadline
from support.frames import HEADER, HEADER_LEN
from support.impls import IMPL_NAMES, PAIR_IDS, PAIRS
from support.impls import load_impl as module

try:
    import ml_dtypes

    BF16: Any = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is in requirements-dev.txt
    BF16 = None

needs_bf16 = pytest.mark.skipif(BF16 is None, reason="ml_dtypes not installed")

WIRE_DTYPES = [None, "float16", "bfloat16", "float32", "float64"]
DTYPES = [name for name in dt.DTYPES if name != "bfloat16" or BF16 is not None]
DEADLINE = 30.0
MiB = 1 << 20
NOT_CHUNKED = (
    "not a tensor set: the first gradient has {} chunks; a set starts with a one-chunk manifest"
)
NOT_PAIRS = "tensors must be a mapping of name to tensor or an iterable of (name, tensor) pairs"
NO_MANIFEST = "not a tensor set: the first gradient has no gradstream_tensors manifest"


# --------------------------------------------------------------------------- helpers


# Not support.impls.session: the chunks of a tensor set here carry the session id "set".
def session(impl: ModuleType, chunk_size: int = 4, **kwargs: Any) -> Any:
    return impl.GradientStreamSession("set", chunk_size, **kwargs)


def numpy_dtype(name: str) -> np.dtype:
    return BF16 if name == "bfloat16" else np.dtype(name)


def raw(shape: tuple[int, ...], name: str, seed: int) -> np.ndarray:
    """An array of dtype ``name`` holding random bit patterns (NaN payloads, subnormals,
    infinities, -0.0 included)."""
    itemsize = numpy_dtype(name).itemsize
    words = np.random.default_rng(seed).integers(
        0, 1 << (8 * itemsize), math.prod(shape), dtype=f"u{itemsize}", endpoint=False
    )
    return words.view(numpy_dtype(name)).reshape(shape)


def bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.dtype.itemsize}").reshape(-1)


def mixed_set(seed: int = 0) -> dict[str, np.ndarray]:
    """Mixed dtypes and shapes (0-d, empty, multi-dimensional), names out of sorted order."""
    t = {
        "layer2.weight": raw((3, 4), "float16", seed),
        "scale": raw((), "float32", seed + 1),
        "empty": raw((0, 3), "float64", seed + 2),
        "block": raw((2, 3, 2), "float64", seed + 3),
        "β/ünïcode name": raw((7,), "float32", seed + 4),
        "a.bias": raw((9,), "float32", seed + 5),
    }
    if BF16 is not None:
        t["layer1.bias"] = raw((5,), "bfloat16", seed + 6)
    return t


def expected(tensors: Any, wire_dtype: str | None = None) -> dict[str, tuple[str, tuple, Any]]:
    """name -> (dtype handed back, shape, bits) after a trip with ``wire_dtype``: each
    tensor cast to the wire dtype and back by the cast rule."""
    items = tensors.items() if isinstance(tensors, dict) else tensors
    out = {}
    for name, t in items:
        own = dt.prepare(t, keep_dtype=True, wire_dtype=None)
        wire = dt.prepare(t, keep_dtype=True, wire_dtype=wire_dtype)
        back = dt.cast(wire.values, wire.wire, own.wire)
        if own.wire == "bfloat16" and dt.hand_back("bfloat16") == "float32":
            back = dt.cast(back, "bfloat16", "float32")
        out[name] = (dt.hand_back(own.wire), tuple(own.values.shape), bits(back))
    return out


def assert_set(got: Any, want: dict[str, tuple[str, tuple, Any]]) -> None:
    assert isinstance(got, dict)
    assert list(got) == list(want)
    for name, (dtype, shape, want_bits) in want.items():
        g = got[name]
        assert isinstance(g, np.ndarray), name
        assert dt.dtype_name(g.dtype) == dtype, (name, g.dtype, dtype)
        assert g.shape == shape, (name, g.shape, shape)
        assert np.array_equal(bits(g), want_bits), name


def frames_of(data: bytes) -> list[tuple[int, tuple[int, int, int, int]]]:
    """(offset, header) of each frame of well-formed frames."""
    out, pos = [], 0
    while pos < len(data):
        header = HEADER.unpack_from(data, pos)
        out.append((pos, header))
        pos += HEADER_LEN + header[2]
    return out


def manifest_for(impl: ModuleType, entries: list[Entry], **kwargs: Any) -> bytes:
    return bytes(session(impl, **kwargs)._encode_manifest(manifest_text(entries)))


def tensor_frames(impl: ModuleType, value: Any, chunk_size: int = 4, **kwargs: Any) -> bytes:
    s = session(impl, chunk_size, keep_shape=True, keep_dtype=True, **kwargs)
    return bytes(s.encode_frames(value))


def outcome(call: Callable[[], T]) -> Any:
    try:
        return call()
    except GradientStreamError as exc:
        return exc


def described(result: Any) -> Any:
    """Something to compare outcomes by: an error's class, text, fields and notes; a set's
    names, dtypes, shapes and bits."""
    if isinstance(result, BaseException):
        fields = {k: v for k, v in vars(result).items() if k != "__notes__"}
        return (type(result).__name__, str(result), fields, getattr(result, "__notes__", []))
    return [(k, str(v.dtype), v.shape, bits(v).tobytes()) for k, v in result.items()]


# support.aio.run, under this file's own deadline (DEADLINE: 30 s, not 20).
run = functools.partial(run_under_deadline, deadline=DEADLINE)


@contextlib.asynccontextmanager
async def connection(path: str) -> AsyncIterator[tuple[Any, Any]]:
    """Two connected ends, each usable to send and to receive: sockets ("socket": an
    AF_UNIX socketpair; "tcp": loopback TCP) or (reader, writer) pairs ("streams" over a
    socketpair; "tcp-streams": asyncio.start_server on 127.0.0.1)."""
    writers: list[asyncio.StreamWriter] = []
    socks: list[socket.socket] = []
    server = None
    try:
        if path in ("socket", "streams"):
            a, b = socket.socketpair()
            socks += [a, b]
        elif path == "tcp":
            listener = socket.create_server(("127.0.0.1", 0))
            socks.append(listener)
            a = socket.create_connection(listener.getsockname())
            socks.append(a)
            b, _ = listener.accept()
            socks.append(b)
        if path == "streams":
            ra, wa = await asyncio.open_connection(sock=a)
            rb, wb = await asyncio.open_connection(sock=b)
            writers += [wa, wb]
            yield (ra, wa), (rb, wb)
        elif path == "tcp-streams":
            accepted: asyncio.Future[tuple[Any, Any]] = asyncio.get_running_loop().create_future()

            async def on_client(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
                writers.append(w)
                accepted.set_result((r, w))

            server = await asyncio.start_server(on_client, "127.0.0.1", 0)
            port = server.sockets[0].getsockname()[1]
            ra, wa = await asyncio.open_connection("127.0.0.1", port)
            writers.append(wa)
            yield (ra, wa), await accepted
        else:
            yield a, b
    finally:
        if server is not None:
            server.close()
        await close_all(writers, socks)


async def transfer(sender: Any, receiver: Any, tensors: Any, path: str, **kwargs: Any) -> Any:
    async with connection(path) as (tx, rx):
        sent, got = await asyncio.gather(
            sender.stream_tensors(tensors, tx, **kwargs.get("send", {})),
            receiver.receive_tensors(rx, **kwargs.get("receive", {})),
        )
        return sent, got


async def receive_bytes(s: Any, data: bytes, path: str, close: bool = True) -> Any:
    """receive_tensors over a socketpair whose peer wrote ``data`` (and closed when
    ``close``); the result or the GradientStreamError raised."""
    a, b = socket.socketpair()
    writer = None
    try:
        a.setblocking(False)
        loop = asyncio.get_running_loop()
        sending = asyncio.ensure_future(loop.sock_sendall(a, data))
        rx: Any = b
        if path == "streams":
            rx, writer = await asyncio.open_connection(sock=b)
        try:
            if close:
                await sending
                a.shutdown(socket.SHUT_WR)
            return await s.receive_tensors(rx)
        except GradientStreamError as exc:
            return exc
        finally:
            sending.cancel()
            with contextlib.suppress(BaseException):
                await sending
    finally:
        await close_all([writer] if writer is not None else [], [a, b])


def everywhere(impl: ModuleType, data: bytes, **kwargs: Any) -> list[Any]:
    """The outcome of decode_tensors(data) and of receive_tensors over a socket and over
    asyncio streams, from a session with ``kwargs``."""
    s = session(impl, **kwargs)
    found = [outcome(lambda: s.decode_tensors(data))]
    for path in ("socket", "streams"):
        found.append(run(lambda path=path: receive_bytes(s, data, path)))
    return found


def assert_error(got: Any, cls: type, text: str, name: Any = "skip", notes: Any = "skip") -> None:
    assert type(got) is cls, f"expected {cls.__name__}({text!r}), got {got!r}"
    assert str(got) == text, str(got)
    if name != "skip":
        assert got.name == name
    if notes != "skip":
        assert getattr(got, "__notes__", []) == notes


def note_of(name: str, k: int, n: int) -> str:
    return f"while receiving tensor {name!r} ({k} of {n}) of a tensor set"


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("wire_dtype", WIRE_DTYPES)
@pytest.mark.parametrize("compression", [None, "lz4", "zstd"])
@pytest.mark.parametrize("layout", ["seed", "compact"])
@pytest.mark.parametrize(("enc", "dec"), PAIRS, ids=PAIR_IDS)
def test_round_trip_in_memory(enc, dec, layout, compression, wire_dtype):
    settings_ = {"layout": layout, "compression": compression, "wire_dtype": wire_dtype}
    sender = session(module(enc), 3, **settings_)
    receiver = session(module(dec), 5)  # the receiver's own settings do not matter
    t = mixed_set()
    wire = sender.encode_tensors(t)
    assert isinstance(wire, bytes)
    assert_set(receiver.decode_tensors(wire), expected(t, wire_dtype))
    buffer = sender.encode_tensors(t, as_buffer=True)
    assert isinstance(buffer, pa.Buffer)
    assert_set(receiver.decode_tensors(buffer), expected(t, wire_dtype))
    # Framing: a one-frame manifest, then one run of frames per tensor.
    heads = frames_of(wire)
    assert heads[0][1][:2] == (0, 1)
    runs = [h for _, h in heads[1:] if h[0] == 0]
    assert len(runs) == len(t)
    assert [h[1] for h in runs] == [max(1, -(-v.size // 3)) for v in t.values()]


@pytest.mark.parametrize("wire_dtype", ["bfloat16", "float16", "float32"])
def test_zero_d_nans_through_a_wire_cast(impl, wire_dtype):
    """0-d NaNs cast to the wire dtype and back: canonical quiet NaNs of the tensor's own
    dtype, sign kept (written out here rather than computed by _dtypes.cast)."""
    t = {
        "f32": np.array(0x7F80_0001, np.uint32).view(np.float32),  # signalling NaN
        "f16": np.array(0xFE01, np.uint16).view(np.float16),  # negative NaN with payload
        "f64": np.array(0x7FF0_0000_0000_0001, np.uint64).view(np.float64),
        "one": np.array([np.nan, 1.0], np.float32)[1:].reshape(()),
    }
    s = session(impl, wire_dtype=wire_dtype)
    got = s.decode_tensors(s.encode_tensors(t))
    assert [(g.dtype, g.shape) for g in got.values()] == [(v.dtype, ()) for v in t.values()]
    # Casting to its own dtype keeps every bit.
    assert int(bits(got["f32"])[0]) == (0x7F80_0001 if wire_dtype == "float32" else 0x7FC0_0000)
    assert int(bits(got["f16"])[0]) == (0xFE01 if wire_dtype == "float16" else 0xFE00)
    assert int(bits(got["f64"])[0]) == 0x7FF8_0000_0000_0000
    assert float(got["one"]) == 1.0


@pytest.mark.parametrize("impl_name", IMPL_NAMES)
def test_manifest_is_the_documented_json(impl_name):
    impl = module(impl_name)
    t = {"fc.weight": np.zeros((768, 30), np.float32), "b": np.zeros(3, np.float16)}
    wire = session(impl, layout="compact").encode_tensors(t)
    _, (index, total, length, _) = frames_of(wire)[0]
    assert (index, total) == (0, 1)
    payload = wire[HEADER_LEN : HEADER_LEN + length]
    reader = pa.ipc.open_file(pa.py_buffer(payload))
    assert reader.schema.metadata == {
        b"gradstream_tensors": (
            b'{"format":"gradstream.tensors","version":1,"tensors":['
            b'{"name":"fc.weight","dtype":"float32","shape":[768,30]},'
            b'{"name":"b","dtype":"float16","shape":[3]}]}'
        )
    }
    assert reader.read_all().num_rows == 0
    # Each tensor is exactly what a keep_shape, keep_dtype session's encode_frames gives.
    rest = wire[HEADER_LEN + length :]
    sub = session(impl, layout="compact", keep_shape=True, keep_dtype=True)
    assert rest == sub.encode_frames(t["fc.weight"]) + sub.encode_frames(t["b"])


@pytest.mark.parametrize(("enc", "dec"), PAIRS, ids=PAIR_IDS)
def test_inputs_order_and_names(enc, dec):
    sender, receiver = session(module(enc)), session(module(dec))
    names = ["z", "a", "m", "é" * 512, "x" * 1024, "0"]  # 1024 UTF-8 bytes is allowed
    values = [raw((i + 1,), "float32", i) for i in range(len(names))]
    pairs = list(zip(names, values, strict=True))
    want = expected(pairs)
    for given_ in (pairs, iter(pairs), dict(pairs), [list(p) for p in pairs], tuple(pairs)):
        got = receiver.decode_tensors(sender.encode_tensors(given_))
        assert list(got) == names
        assert_set(got, want)


@pytest.mark.parametrize(("enc", "dec"), PAIRS, ids=PAIR_IDS)
def test_other_tensor_inputs(enc, dec):
    sender, receiver = session(module(enc), 2), session(module(dec))
    base = raw((4, 6), "float64", 1)
    t: dict[str, Any] = {
        "list": [[1.0, 2.0], [3.0, 4.0]],  # lists are float32
        "strided": base[:, ::2],  # copied once, C order
        "swapped": raw((5,), "float32", 2).astype(">f4"),
        "arrow16": pa.array(np.arange(4, dtype=np.float16)),
        "scalar64": np.array(2.5),
    }
    if BF16 is not None:
        bf = raw((6,), "bfloat16", 3)
        t["arrow-bf16"] = pa.ExtensionArray.from_storage(dt.BFloat16Type(), pa.array(bits(bf)))
    got = receiver.decode_tensors(sender.encode_tensors(t))
    assert_set(got, expected(t))
    assert got["list"].dtype == np.float32 and got["list"].shape == (2, 2)
    assert got["strided"].shape == (4, 3)
    assert got["swapped"].dtype == np.dtype("=f4")


def test_empty_sets(impl):
    s = session(impl)
    wire = s.encode_tensors({})
    assert len(frames_of(wire)) == 1
    assert s.decode_tensors(wire) == {}
    assert s.decode_tensors(b"") == {}
    assert s.decode_tensors(bytearray()) == {}
    assert s.encode_tensors([]) == wire
    assert s.encode_tensors(iter(())) == wire

    async def main() -> None:
        async with connection("socket") as (a, b):
            sent, got = await asyncio.gather(s.stream_tensors({}, a), s.receive_tensors(b))
            assert (sent, got) == (1, {})

    run(main)
    for path in ("socket", "streams"):
        # The peer closed before the set's first byte.
        assert run(lambda path=path: receive_bytes(s, b"", path)) == {}


@pytest.mark.parametrize("path", ["socket", "streams", "tcp", "tcp-streams"])
@pytest.mark.parametrize(("enc", "dec"), PAIRS, ids=PAIR_IDS)
def test_round_trip_streaming(enc, dec, path):
    t = mixed_set(7)
    for kwargs in ({}, {"layout": "compact", "compression": "zstd", "wire_dtype": "bfloat16"}):
        sender = session(module(enc), 3, **kwargs)
        receiver = session(module(dec), 2)
        sent, got = run(
            lambda sender=sender, receiver=receiver: transfer(sender, receiver, t, path)
        )
        assert_set(got, expected(t, kwargs.get("wire_dtype")))
        assert sent == len(frames_of(sender.encode_tensors(t)))


@pytest.mark.parametrize("path", ["socket", "streams"])
def test_the_bytes_streamed_are_encode_tensors(impl, path):
    s = session(impl, 3, layout="compact", compression="lz4", wire_dtype="float16")
    t = mixed_set(8)

    async def main() -> bytes:
        async with connection(path) as (a, b):
            sent = await s.stream_tensors(t, a)
            if path == "socket":
                a.shutdown(socket.SHUT_WR)
                b.setblocking(False)
                chunks = []
                loop = asyncio.get_running_loop()
                while chunk := await loop.sock_recv(b, 1 << 16):
                    chunks.append(chunk)
                b.setblocking(True)
            else:
                a[1].write_eof()
                chunks = [await b[0].read()]
            wire = b"".join(chunks)
            assert sent == len(frames_of(wire))
            return wire

    assert run(main) == s.encode_tensors(t)


@pytest.mark.parametrize("path", ["socket", "streams"])
def test_sets_back_to_back_on_one_connection(impl, path):
    s = session(impl, 3, layout="compact")
    sets = [mixed_set(1), {}, {"only": raw((4, 4), "float16", 9)}, mixed_set(2)]

    async def main() -> list[Any]:
        async with connection(path) as (a, b):

            async def send_all() -> None:
                for t in sets:
                    await s.stream_tensors(t, a)
                if path == "socket":
                    a.shutdown(socket.SHUT_WR)
                else:
                    a[1].write_eof()

            async def receive_all() -> list[Any]:
                got = [await s.receive_tensors(b) for _ in sets]
                got.append(await s.receive_tensors(b))  # the peer closed: {}
                return got

            return (await asyncio.gather(send_all(), receive_all()))[1]

    got = run(main)
    for g, t in zip(got, [*sets, {}], strict=True):
        assert_set(g, expected(t))


@pytest.mark.parametrize("dontwait", [True, False], ids=["msg-dontwait", "mode-switch"])
def test_socket_modes_are_put_back(impl, dontwait, monkeypatch):
    if not dontwait:
        monkeypatch.setattr(tensors_mod, "_DONTWAIT", 0)
    s = session(impl, 2)
    t = mixed_set(3)

    async def main() -> Any:
        a, b = socket.socketpair()
        with a, b:
            b.settimeout(7.0)
            _, got = await asyncio.gather(s.stream_tensors(t, a), s.receive_tensors(b))
            assert a.gettimeout() is None and a.getblocking()
            assert b.gettimeout() == 7.0
            return got

    assert_set(run(main), expected(t))


@pytest.mark.parametrize("path", ["socket", "streams"])
def test_full_duplex_sets_on_one_connection(impl, path):
    s = session(impl, 65536)
    # Larger than the socket buffers, so both directions must make progress together.
    mine = {"a": raw((600_000,), "float32", 1), "b": raw((3, 5), "float16", 2)}
    theirs = {"c": raw((300_000,), "float64", 3), "d": raw((), "float32", 4)}

    async def main() -> list[Any]:
        async with connection(path) as (x, y):
            return await asyncio.gather(
                s.stream_tensors(mine, x),
                s.receive_tensors(x),
                s.stream_tensors(theirs, y),
                s.receive_tensors(y),
            )

    _, from_y, _, from_x = run(main)
    assert_set(from_x, expected(mine))
    assert_set(from_y, expected(theirs))


def test_progress_counts_the_tensors_not_the_manifest(impl):
    s = session(impl, 3)
    t = mixed_set(4)
    wire = s.encode_tensors(t)
    manifest_len = HEADER_LEN + frames_of(wire)[0][1][2]
    tx, rx = impl.TransferProgress(), impl.TransferProgress()

    async def main() -> Any:
        async with connection("socket") as (a, b):
            return await asyncio.gather(
                s.stream_tensors(t, a, progress=tx), s.receive_tensors(b, progress=rx)
            )

    sent, got = run(main)
    assert_set(got, expected(t))
    frames = len(frames_of(wire))
    assert sent == frames
    for p in (tx, rx):
        assert (p.bytes, p.chunks, p.total_chunks) == (
            len(wire) - manifest_len,
            frames - 1,
            frames - 1,
        )


# --------------------------------------------------------------------------- the sender's checks


def test_input_must_be_a_mapping_or_pairs(impl):
    s = session(impl)
    cases = [
        (
            "names",
            f"{NOT_PAIRS}, not str",
        ),
        (
            b"xy",
            f"{NOT_PAIRS}, not bytes",
        ),
        (
            5,
            f"{NOT_PAIRS}, not int",
        ),
        (
            [("a", np.zeros(1, np.float32)), ("b", 1, 2)],
            "tensors item 2 is a 3-item tuple, not a (name, tensor) pair",
        ),
        ([np.zeros(2, np.float32)], "tensors item 1 is a ndarray, not a (name, tensor) pair"),
        (["ab"], "tensors item 1 is a str, not a (name, tensor) pair"),
        ([(1, np.zeros(1, np.float32))], "tensor names must be str, not int"),
        ({b"a": np.zeros(1, np.float32)}, "tensor names must be str, not bytes"),
    ]
    for tensors, text in cases:
        with pytest.raises(TypeError) as info:
            s.encode_tensors(tensors)
        assert str(info.value) == text


def test_bad_names(impl):
    s = session(impl)
    z = np.zeros(2, np.float32)
    long_name = "é" * 513
    cases = [
        ([("a", z), ("", z)], "a tensor name is empty; names are non-empty strings", ""),
        (
            [(long_name, z)],
            f"tensor name {repr(long_name)[:77]}... takes 1026 UTF-8 bytes, above the limit "
            "of 1024",
            long_name,
        ),
        (
            [("\ud800x", z)],
            "tensor name '\\ud800x' is not valid Unicode text (a lone surrogate): it has no "
            "UTF-8 form",
            "\ud800x",
        ),
        ([("a", z), ("b", z), ("a", z)], "tensor name 'a' appears twice in the tensor set", "a"),
    ]
    for tensors, text, name in cases:
        with pytest.raises(TensorSetError) as info:
            s.encode_tensors(tensors)
        assert info.value.name == name
        assert str(info.value) == text


def test_names_are_checked_before_any_tensor_or_byte(impl):
    s = session(impl)

    class Exploding:
        def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
            raise AssertionError("a tensor was converted before the names were checked")

    bad = [("a", Exploding()), ("b", Exploding()), ("a", Exploding())]
    with pytest.raises(TensorSetError, match="appears twice"):
        s.encode_tensors(bad)

    async def main() -> None:
        a, b = socket.socketpair()
        with a, b:
            with pytest.raises(TensorSetError, match="appears twice"):
                await s.stream_tensors(bad, a)
            b.setblocking(False)
            with pytest.raises(BlockingIOError):
                b.recv(1)  # not a byte was sent

    run(main)


def test_sender_errors_name_the_tensor(impl):
    s = session(impl)
    with pytest.raises(TypeError) as info:
        s.encode_tensors({"ok": np.zeros(2, np.float32), "ints": np.zeros(3, np.int32)})
    assert info.value.__notes__ == ["while encoding tensor 'ints' (2 of 2) of a tensor set"]
    with pytest.raises(TensorSetError) as deep:
        s.encode_tensors({"deep": np.zeros((1,) * 33, np.float32)})
    assert str(deep.value) == "tensor 'deep' has 33 dimensions; a tensor set carries at most 32"
    assert deep.value.name == "deep"

    async def main() -> None:
        a, b = socket.socketpair()
        with a, b:
            with pytest.raises(TypeError) as info:
                await s.stream_tensors({"x": np.zeros(1, np.float32), "y": None}, a)
            assert info.value.__notes__ == ["while sending tensor 'y' (2 of 2) of a tensor set"]
            b.setblocking(False)
            with pytest.raises(BlockingIOError):
                b.recv(1)

    run(main)


def test_streams_are_checked_before_anything_is_sent(impl):
    s = session(impl)
    t = {"a": np.zeros(1, np.float32)}

    async def main() -> None:
        with pytest.raises(
            TypeError,
            match=r"stream_tensors takes a connected socket\.socket, an asyncio\.StreamWriter or "
            r"a \(reader, writer\) pair, not str",
        ):
            await s.stream_tensors(t, "peer")
        with pytest.raises(TypeError, match=r"receive_tensors takes .* not int"):
            await s.receive_tensors(3)
        async with connection("streams") as ((ra, wa), _):
            with pytest.raises(TypeError, match=r"asyncio\.StreamReader"):
                await s.receive_tensors(wa)
            with pytest.raises(TypeError, match=r"asyncio\.StreamWriter"):
                await s.stream_tensors(t, ra)
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        with udp, pytest.raises(ValueError, match="SOCK_STREAM"):
            await s.stream_tensors(t, udp)
        closed = socket.socket()
        closed.close()
        with pytest.raises(StreamIOError) as info:
            await s.receive_tensors(closed)
        assert info.value.errno == 9

    run(main)


def test_manifest_too_big_for_a_frame_is_refused_before_sending(impl):
    s = session(impl, max_payload_len=4096)
    t = [(f"{i:04d}" + "n" * 200, np.zeros(1, np.float32)) for i in range(20)]
    limit = (
        ", above the 4096-byte limit of a manifest frame (max_payload_len, at most 16777216): "
        "send fewer tensors per set or shorter names"
    )
    with pytest.raises(TensorSetError) as info:
        s.encode_tensors(t)  # the JSON alone is too long
    assert str(info.value) == f"the tensor set's manifest takes 4975 bytes of JSON{limit}"
    with pytest.raises(TensorSetError) as info:
        s.encode_tensors(t[:10])  # the payload (the JSON is in it twice) is too long
    assert str(info.value).endswith(f" bytes{limit}")

    async def main() -> None:
        a, b = socket.socketpair()
        with a, b:
            with pytest.raises(TensorSetError, match="above the 4096-byte limit"):
                await s.stream_tensors(t, a)
            b.setblocking(False)
            with pytest.raises(BlockingIOError):
                b.recv(1)

    run(main)
    # Under the cap it goes through, and a receiver with the same cap takes it.
    assert list(s.decode_tensors(s.encode_tensors(t[:5]))) == [n for n, _ in t[:5]]


# --------------------------------------------------------------------------- manifests


def test_parse_manifest_accepts_the_documented_form():
    text = manifest_text(
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
    (
        "{",
        "tensor set manifest is not valid JSON: Expecting property name enclosed in double "
        "quotes: line 1 column 2 (char 1)",
        None,
    ),
    ("", "tensor set manifest is not valid JSON: Expecting value: line 1 column 1 (char 0)", None),
    (
        '{"format":"gradstream.tensors","version":1,"tensors":[]} x',
        "tensor set manifest is not valid JSON: Extra data: line 1 column 58 (char 57)",
        None,
    ),
    ("[1]", "tensor set manifest is a JSON array, not an object", None),
    (
        '{"format":"gradstream.tensors","version":NaN,"tensors":[]}',
        "tensor set manifest is not valid JSON: NaN is not a JSON value",
        None,
    ),
    ("[" * 100_000 + "]" * 100_000, None, None),  # nesting: not valid JSON, not a crash
    (
        '{"format":"gradstream.tensors","version":1}',
        "tensor set manifest has no 'tensors' key",
        None,
    ),
    (
        _doc(extra=1),
        "tensor set manifest has an unexpected key 'extra' (its keys are format, version, tensors)",
        None,
    ),
    (
        '{"format":"gradstream.tensors","format":"gradstream.tensors","version":1,"tensors":[]}',
        "tensor set manifest repeats the key 'format' in one JSON object",
        None,
    ),
    (
        _doc(format="gradstream.gradients"),
        "tensor set manifest format is 'gradstream.gradients', not 'gradstream.tensors'",
        None,
    ),
    (
        _doc(version=2),
        "tensor set manifest version 2 is not supported (this gradstream reads version 1)",
        None,
    ),
    (
        _doc(version=True),
        "tensor set manifest version True is not supported (this gradstream reads version 1)",
        None,
    ),
    (
        _doc(version=1.0),
        "tensor set manifest version 1.0 is not supported (this gradstream reads version 1)",
        None,
    ),
    (
        _doc(version="1"),
        "tensor set manifest version '1' is not supported (this gradstream reads version 1)",
        None,
    ),
    (_doc(tensors={"w": 1}), "tensor set manifest 'tensors' is a JSON object, not an array", None),
    (_doc(5), "tensor set manifest entry 1 of 1 is a JSON integer, not an object", None),
    (
        _doc(_entry(), {"name": "v", "dtype": "float32"}),
        "tensor set manifest entry 2 of 2 has no 'shape' key",
        "v",
    ),
    (
        _doc(_entry(layout="seed")),
        "tensor set manifest entry 1 of 1 has an unexpected key 'layout' (its keys are name, "
        "dtype, shape)",
        "w",
    ),
    (
        '{"format":"gradstream.tensors","version":1,"tensors":[{"name":"w","name":"v","dtype":"float32","shape":[]}]}',
        "tensor set manifest repeats the key 'name' in one JSON object",
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
        "tensor name "
        + repr("n" * 1025)[:77]
        + "... takes 1025 UTF-8 bytes, above the limit of 1024",
        "n" * 1025,
    ),
    (
        '{"format":"gradstream.tensors","version":1,"tensors":[{"name":"\\ud800","dtype":"float32","shape":[]}]}',
        "tensor name '\\ud800' is not valid Unicode text (a lone surrogate): it has no UTF-8 form",
        "\ud800",
    ),
    (_doc(_entry(), _entry(shape=(1,))), "tensor name 'w' appears twice in the tensor set", "w"),
    (
        _doc(_entry(dtype="int8")),
        "tensor 'w': dtype 'int8' is not float16, bfloat16, float32 or float64",
        "w",
    ),
    (
        _doc(_entry(dtype=["float32"])),
        "tensor 'w': dtype ['float32'] is not float16, bfloat16, float32 or float64",
        "w",
    ),
    (
        _doc(_entry(shape="[2]")),
        "tensor 'w': its shape is a JSON string, not an array of integers",
        "w",
    ),
    (
        _doc(_entry(shape=(-1,))),
        "tensor 'w': shape dimension -1 is not an integer of at most 18 digits",
        "w",
    ),
    (
        _doc(_entry(shape=(2.0,))),
        "tensor 'w': shape dimension 2.0 is not an integer of at most 18 digits",
        "w",
    ),
    (
        _doc(_entry(shape=(True,))),
        "tensor 'w': shape dimension True is not an integer of at most 18 digits",
        "w",
    ),
    (
        _doc(_entry(shape=(10**18,))),
        "tensor 'w': shape dimension 1000000000000000000 is not an integer of at most 18 digits",
        "w",
    ),
    (_doc(_entry(shape=(1,) * 33)), "tensor 'w': its shape has 33 dimensions, more than 32", "w"),
]


@pytest.mark.parametrize(("text", "message", "name"), HOSTILE_MANIFESTS)
def test_parse_manifest_refuses(text, message, name):
    with pytest.raises(TensorSetError) as info:
        parse_manifest(text)
    if message is None:
        assert str(info.value).startswith("tensor set manifest is not valid JSON: ")
    else:
        assert str(info.value) == message
    assert info.value.name == name


@pytest.mark.parametrize("impl_name", IMPL_NAMES)
def test_hostile_manifests_everywhere(impl_name):
    impl = module(impl_name)
    for text, message, name in HOSTILE_MANIFESTS[:-1:3] + HOSTILE_MANIFESTS[-1:]:
        data = bytes(session(impl)._encode_manifest(text))
        for got in everywhere(impl, data):
            assert type(got) is TensorSetError, (text[:50], got)
            if message is not None:
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
            "tensor 'fc.weight' arrived as float16 [3,4]; the manifest says float32 [4,3]",
        ),
        (
            np.zeros((4, 3), np.float64)[:, :2],
            "tensor 'fc.weight' arrived as float64 [4,2]; the manifest says float32 [4,3]",
        ),
        (
            np.zeros(12, np.float32),
            "tensor 'fc.weight' arrived as float32 [12]; the manifest says float32 [4,3]",
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
            assert info.value.__notes__ == ["while sending tensor 'big' (1 of 1) of a tensor set"]

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


# --------------------------------------------------------------------------- truncation, left-overs


def test_data_cut_anywhere(impl):
    """Every prefix of a set's frames: an error (never a smaller set), the same from
    decode_tensors and from a stream, the same from both implementations."""
    s = session(impl, 2)
    t = {"a": raw((3,), "float32", 1), "b": raw((0,), "float16", 2), "c": raw((2, 2), "float64", 3)}
    wire = s.encode_tensors(t)
    heads = frames_of(wire)
    tensor_starts = [off for off, h in heads[1:] if h[0] == 0]
    other = session(module("native" if impl.__name__.endswith("reference") else "reference"), 2)
    for cut in range(1, len(wire)):
        got = outcome(lambda cut=cut: s.decode_tensors(wire[:cut]))
        assert isinstance(got, (FrameError, IncompleteStreamError, TensorSetError)), (cut, got)
        assert described(got) == described(
            outcome(lambda cut=cut: other.decode_tensors(wire[:cut]))
        )
        if cut in tensor_starts:
            k = tensor_starts.index(cut)
            assert_error(
                got,
                TensorSetError,
                f"the tensor set ends after {k} of its 3 tensors",
                name=None,
                notes=[note_of("abc"[k], k + 1, 3)],
            )
        if cut % 7 == 0 or cut in tensor_starts or cut < HEADER_LEN:
            streamed = run(lambda cut=cut: receive_bytes(s, wire[:cut], "socket"))
            assert described(streamed) == described(got), cut


def test_bytes_left_over(impl):
    s = session(impl, 2)
    t = {"a": raw((3,), "float32", 1), "b": raw((4,), "float16", 2)}
    wire = s.encode_tensors(t)
    last_start = [off for off, h in frames_of(wire)[1:] if h[0] == 0][-1]
    got = outcome(lambda: s.decode_tensors(wire + b"\x01\x02\x03"))
    assert_error(
        got, FrameError, "3 bytes left over after the last chunk", notes=[note_of("b", 2, 2)]
    )
    assert got.offset == len(wire) - last_start
    # After an empty set's manifest.
    empty = s.encode_tensors({})
    got = outcome(lambda: s.decode_tensors(empty + b"x" * 20))
    assert_error(got, FrameError, "20 bytes left over after the last chunk", notes=[])
    assert got.offset == len(empty)
    # A stream reads nothing past the set: the rest is there for the next read.

    async def main() -> bytes:
        a, b = socket.socketpair()
        with a, b:
            a.sendall(wire + b"tail")
            a.shutdown(socket.SHUT_WR)
            assert_set(await s.receive_tensors(b), expected(t))
            return b.recv(100)

    assert run(main) == b"tail"


def test_decode_takes_any_bytes_like(impl):
    s = session(impl, 3)
    t = mixed_set(5)
    wire = s.encode_tensors(t)
    for data in (
        wire,
        bytearray(wire),
        memoryview(wire),
        np.frombuffer(wire, np.uint8),
        pa.py_buffer(wire),
    ):
        assert_set(s.decode_tensors(data), expected(t))
    with pytest.raises(TypeError):
        s.decode_tensors("text")


def test_bfloat16_without_ml_dtypes_comes_back_as_float32(impl, monkeypatch):
    if BF16 is None:
        pytest.skip("needs ml_dtypes to make the input")
    t = {"b": raw((4, 2), "bfloat16", 1), "f": raw((3,), "float32", 2)}
    monkeypatch.setattr(dt, "BFLOAT16", None)
    s = session(impl)
    got = s.decode_tensors(s.encode_tensors(t))
    assert got["b"].dtype == np.float32 and got["b"].shape == (4, 2)
    assert np.array_equal(
        bits(got["b"]), bits(dt.cast(bits(t["b"]).reshape(4, 2), "bfloat16", "float32"))
    )
    assert_set({"f": got["f"]}, expected({"f": t["f"]}))


# --------------------------------------------------------------------------- differential


@st.composite
def tensor_sets(draw: Any) -> list[tuple[str, np.ndarray]]:
    names = draw(st.lists(st.text(min_size=1, max_size=6), max_size=4, unique=True))
    out = []
    for i, name in enumerate(names):
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
        out.append((name, raw(shape, dtype, draw(st.integers(0, 2**32 - 1)) + i)))
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tensors=tensor_sets(),
    chunk_size=st.integers(1, 7),
    layout=st.sampled_from(["seed", "compact"]),
    compression=st.sampled_from([None, "lz4", "zstd"]),
    wire_dtype=st.sampled_from(WIRE_DTYPES),
)
def test_differential(tensors, chunk_size, layout, compression, wire_dtype):
    kwargs = {"layout": layout, "compression": compression, "wire_dtype": wire_dtype}
    impls = {name: module(name) for name in IMPL_NAMES}
    want = expected(tensors, wire_dtype)
    results = {}
    for enc, dec in PAIRS:
        wire = session(impls[enc], chunk_size, **kwargs).encode_tensors(tensors)
        got = session(impls[dec], 3).decode_tensors(wire)
        note(f"{enc}->{dec}: {described(got)}")
        assert_set(got, want)
        results[enc, dec] = described(got)
    assert len({repr(r) for r in results.values()}) == 1


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tensors=tensor_sets(),
    chunk_size=st.integers(1, 5),
    edits=st.lists(
        st.tuples(
            st.integers(0, 1000),  # which frame (modulo their count)
            st.integers(0, 3),  # which header field
            st.sampled_from([0, 1, 2, 3, 5, 64, 0xFFFF, 0xFFFF_FFFF, 16 * MiB + 1]),
        ),
        min_size=1,
        max_size=3,
    ),
    tail=st.sampled_from([b"", b"\x00", b"x" * 20]),  # bytes after the set
)
def test_differential_hostile_headers(tensors, chunk_size, edits, tail):
    """Frame headers of a set rewritten (counts, lengths, CRCs): both implementations,
    and a stream, give the same outcome."""
    impls = {name: module(name) for name in IMPL_NAMES}
    wire = bytearray(session(impls["reference"], chunk_size).encode_tensors(tensors))
    heads = frames_of(bytes(wire))
    for which, field, value in edits:
        offset = heads[which % len(heads)][0]
        struct.pack_into("<I", wire, offset + 4 * field, value)
    data = bytes(wire) + tail
    found = {
        name: described(outcome(lambda impl=impl: session(impl, 3).decode_tensors(data)))
        for name, impl in impls.items()
    }
    note(repr(found))
    assert found["reference"] == found["native"]
    if "bytes left over after the last chunk" in repr(found["native"]):
        # A stream stops where its last tensor ends by its own headers and leaves the rest
        # unread (for a next set); it may fail that tensor for another reason first.
        return
    s = session(impls["native"], 3)
    streamed = run(lambda: receive_bytes(s, data, "socket"))
    assert described(streamed) == found["native"]


# --------------------------------------------------------------------------- done when


def fake_model(target_bytes: int, seed: int) -> dict[str, Any]:
    """About ``target_bytes`` of mixed-dtype tensors: a few big matrices, many small
    vectors, made cheaply from one block of normal float32 values."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(1 << 22, dtype=np.float32)
    scale = target_bytes / (1 << 30)

    def make(shape: tuple[int, ...], dtype: str, k: int) -> np.ndarray:
        n = math.prod(shape)
        start = (k * 7919) % len(base)
        f32 = np.resize(base[start:], n).reshape(shape)
        if dtype == "bfloat16":
            return (f32.view(np.uint32) >> 16).astype(np.uint16).view(BF16)
        return f32.astype(dtype, copy=False)

    big = [
        ("embed.weight", (16384, 4096), "float32"),
        ("block0.attn.weight", (8192, 8192), "bfloat16"),
        ("block0.mlp.weight", (8192, 8192), "float16"),
        ("head.weight", (4096, 8192), "float64"),
        ("block1.mlp.weight", (8192, 4096), "float32"),
        ("block1.attn.weight", (4096, 8192), "bfloat16"),
        ("block2.proj.weight", (4096, 4096), "float16"),
    ]
    model: dict[str, Any] = {}
    for k, (name, (rows, cols), dtype) in enumerate(big):
        model[name] = make((max(1, int(rows * scale)), cols), dtype, k)
    sizes = [1, 7, 768, 3072, 4096, 65537, 0]
    dtypes = ["float32", "float16", "bfloat16", "float64"]
    for k in range(100 - len(big) - 1):
        n = sizes[k % len(sizes)]
        model[f"layers.{k}.bias"] = make((n,), dtypes[k % 4], len(big) + k)
    model["step_scale"] = make((), "float64", 999)
    return model


@needs_bf16
def test_done_when_1gib_model_streams_bit_equal_over_loopback_tcp():
    gs = module("native")
    model = fake_model(1 << 30, 0)
    assert len(model) == 100
    total = sum(v.nbytes for v in model.values())
    assert 0.95 * (1 << 30) <= total <= 1.1 * (1 << 30), total
    assert {dt.dtype_name(v.dtype) for v in model.values()} == {
        "float16",
        "bfloat16",
        "float32",
        "float64",
    }

    async def main() -> tuple[int, dict[str, np.ndarray]]:
        client, server = tcp_socket_pair()
        with client, server:
            tx = gs.GradientStreamSession("model", timeout=60)
            rx = gs.GradientStreamSession("model", timeout=60)
            return await asyncio.gather(
                tx.stream_tensors(model, client), rx.receive_tensors(server)
            )

    sent, got = run(main)
    assert list(got) == list(model)
    frames = 1
    for name in list(got):
        g, want = got.pop(name), model.pop(name)
        assert g.dtype == want.dtype and g.shape == want.shape, name
        assert np.array_equal(bits(g), bits(want)), name
        frames += max(1, -(-want.size // 65536))
        del g, want
    assert sent == frames


@needs_bf16
def test_done_when_lossy_bfloat16_wire_within_the_documented_error():
    gs = module("native")
    model = {
        name: v
        for name, v in fake_model(64 << 20, 1).items()
        if dt.dtype_name(v.dtype) != "bfloat16"
    }
    total = sum(v.nbytes for v in model.values())
    assert 40 * MiB <= total <= 80 * MiB, total

    async def main() -> tuple[int, dict[str, np.ndarray]]:
        client, server = tcp_socket_pair()
        with client, server:
            tx = gs.GradientStreamSession(
                "model", layout="compact", wire_dtype="bfloat16", timeout=60
            )
            rx = gs.GradientStreamSession("model", timeout=60)
            return await asyncio.gather(
                tx.stream_tensors(model, client), rx.receive_tensors(server)
            )

    _, got = run(main)
    assert list(got) == list(model)
    for name, want in model.items():
        g = got[name]
        src = dt.dtype_name(want.dtype)
        assert g.dtype == want.dtype and g.shape == want.shape, name
        cast = dt.cast(dt.cast(want, src, "bfloat16"), "bfloat16", src)
        assert np.array_equal(bits(g), bits(cast)), name
        x = want.astype(np.float64).reshape(-1)
        y = g.astype(np.float64).reshape(-1)
        normal = np.isfinite(x) & (np.abs(x) >= np.finfo(np.float32).tiny)
        if src == "float16":
            normal &= np.abs(x) >= np.finfo(np.float16).tiny
        assert np.all(np.abs(y[normal] - x[normal]) <= 2.0**-8 * np.abs(x[normal])), name


def test_a_manifest_shape_numpy_cannot_make_is_refused():
    """An empty tensor whose non-zero dimensions multiply past 2**60: numpy refuses to
    make it, so the manifest is refused (TensorSetError, not numpy's ValueError)."""
    ok = manifest_text([Entry("e", "float32", (0, 1 << 30, 1 << 30))])
    assert parse_manifest(ok) == [Entry("e", "float32", (0, 1 << 30, 1 << 30))]
    bad = manifest_text([Entry("e", "float32", (0, 1 << 31, 1 << 30))])
    with pytest.raises(TensorSetError) as info:
        parse_manifest(bad)
    assert info.value.name == "e"
    assert str(info.value) == (
        "tensor 'e': its shape [0, 2147483648, 1073741824] is beyond what numpy can make "
        "(its non-zero dimensions multiply past 2**60)"
    )

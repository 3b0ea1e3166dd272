"""Named tensor sets (docs/guides/tensor-sets.md), against both implementations: round trips
and the sender's checks.

A set is a manifest (a one-frame empty gradient whose schema metadata
``gradstream_tensors`` names each tensor with its dtype and shape) followed by one
keep_shape/keep_dtype gradient per tensor. Each implementation has its own set layer (the
native one in gradstream-core's ``tensors``, the reference's in Python), so every round
trip here also runs across the two (encode with one, decode with the other), and the
failure cases compare both.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import gradstream as gs
from gradstream.errors import StreamIOError, TensorSetError
from support.aio import close_all
from support.frames import HEADER_LEN
from support.impls import IMPL_NAMES, PAIR_IDS, PAIRS
from support.impls import load_impl as module
from support.tensor_sets import (
    BF16,
    WIRE_DTYPES,
    assert_set,
    bits,
    expected,
    frames_of,
    mixed_set,
    raw,
    receive_bytes,
    run,
    session,
)

NOT_PAIRS = "tensors must be a mapping of name to tensor or an iterable of (name, tensor) pairs"


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
        t["arrow-bf16"] = pa.ExtensionArray.from_storage(gs.BFloat16Type(), pa.array(bits(bf)))
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


def test_socket_modes_are_put_back(impl):
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
            # The quote: '"' and 76 characters of \u00e9 escapes, then "...".
            'tensor name "' + "\\u00e9" * 12 + "\\u00... takes 1026 UTF-8 bytes, above the "
            "limit of 1024",
            long_name,
        ),
        (
            [("\ud800x", z)],
            'tensor name "\\ud800x" is not valid Unicode text (a lone surrogate): it has no '
            "UTF-8 form",
            "\ud800x",
        ),
        ([("a", z), ("b", z), ("a", z)], 'tensor name "a" appears twice in the tensor set', "a"),
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
    assert info.value.__notes__ == ['while encoding tensor "ints" (2 of 2) of a tensor set']
    with pytest.raises(TensorSetError) as deep:
        s.encode_tensors({"deep": np.zeros((1,) * 33, np.float32)})
    assert str(deep.value) == 'tensor "deep" has 33 dimensions; a tensor set carries at most 32'
    assert deep.value.name == "deep"

    async def main() -> None:
        a, b = socket.socketpair()
        with a, b:
            with pytest.raises(TypeError) as info:
                await s.stream_tensors({"x": np.zeros(1, np.float32), "y": None}, a)
            assert info.value.__notes__ == ['while sending tensor "y" (2 of 2) of a tensor set']
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


@pytest.mark.parametrize(
    ("shape", "detail"),
    [
        ((0, 10**18), "shape dimension 1000000000000000000 is not an integer of at most 18 digits"),
        (
            (0, 1 << 31, 1 << 30),
            "its shape [0,2147483648,1073741824] is beyond what numpy can make (its non-zero "
            "dimensions multiply past 2**60)",
        ),
    ],
)
def test_a_sender_refuses_a_shape_every_receiver_refuses(impl, shape, detail):
    # An empty tensor numpy can make, but whose shape no receiver takes: refused before
    # anything is encoded, in the receiver's words, by both senders alike.
    s = session(impl, 4)
    with pytest.raises(TensorSetError) as info:
        # float16: numpy makes (0, 2**31, 2**30) of 2-byte values (its bound is 2**63 bytes).
        s.encode_tensors({"ok": np.zeros(2, np.float32), "e": np.empty(shape, np.float16)})
    assert str(info.value) == f'tensor "e": {detail}'
    assert info.value.name == "e"
    assert info.value.__notes__ == ['while encoding tensor "e" (2 of 2) of a tensor set']


def test_an_earlier_tensors_refusal_comes_before_a_later_ones_conversion_error(impl):
    # One pass over the set meets tensor "a"'s shape before tensor "b"'s conversion: the
    # native session converts in Python and checks in Rust, so it must still raise "a"'s.
    s = session(impl, 4)
    bad_shape = np.empty((0, 10**18), np.float32)
    with pytest.raises(TensorSetError) as info:
        s.encode_tensors({"a": bad_shape, "b": "not a tensor"})
    assert info.value.name == "a"
    assert info.value.__notes__ == ['while encoding tensor "a" (1 of 2) of a tensor set']
    # Without the earlier refusal, the conversion error itself, noted with its tensor.
    with pytest.raises(TypeError) as conversion:
        s.encode_tensors({"a": np.zeros(2, np.float32), "b": "not a tensor"})
    assert conversion.value.__notes__ == ['while encoding tensor "b" (2 of 2) of a tensor set']

"""Shared fixtures: every semantic test runs against both implementations. Also the
scaffolding the test files share (imported as ``from conftest import ...``): the frame
header, the parametrisations, and small helpers to build and split frame streams and to
run a transfer over a socketpair."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import socket
import struct
import zlib
from collections.abc import Awaitable, Callable
from types import ModuleType
from typing import Any, TypeVar

import numpy as np
import pytest
from hypothesis import HealthCheck

from gradstream.errors import (
    ArrowIpcError,
    ChecksumMismatchError,
    FrameError,
    GradientStreamError,
    IncompleteStreamError,
)

T = TypeVar("T")

# A frame: this header (chunk_index, total_chunks, payload length, CRC-32 of the
# payload, each a little-endian u32), then the payload.
HEADER = struct.Struct("<IIII")
HEADER_LEN = HEADER.size

IMPL_NAMES = ["reference", "native"]
PAIRS = [(a, b) for a in IMPL_NAMES for b in IMPL_NAMES]  # (encoder, decoder)
PAIR_IDS = [f"{a}-to-{b}" for a, b in PAIRS]
LAYOUTS = ["seed", "compact"]
CODECS = ["lz4", "zstd"]
PATHS = ["socket", "streams"]
DEADLINE = 20.0
# The impl fixture is function-scoped but stateless: hypothesis may reuse it.
FIXTURE_OK = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
# What a decoder may raise on hostile bytes (the rest must not escape).
ERROR_CLASSES = (ArrowIpcError, ChecksumMismatchError, FrameError, IncompleteStreamError)
# The fields of a GradientStreamError, to compare errors field by field.
ERROR_FIELDS = ("chunk_index", "offset", "expected", "actual", "received", "total", "detail")
# GRADSTREAM_DIFF_SCALE=20 multiplies every max_examples, for a longer soak run.
SCALE = float(os.environ.get("GRADSTREAM_DIFF_SCALE", "1"))


def examples(n: int) -> int:
    return max(1, round(n * SCALE))


def load_impl(name: str) -> ModuleType:
    """An implementation by name: "reference" is the pure-Python gradstream.reference;
    "native" is the package top level, which re-exports the Rust classes, and is skipped
    until the extension is built."""
    if name == "reference":
        return importlib.import_module("gradstream.reference")
    try:
        importlib.import_module("gradstream._native")
    except ImportError as exc:
        pytest.skip(f"native extension not built: {exc}")
    return importlib.import_module("gradstream")


@pytest.fixture(params=["reference", "native"])
def impl(request: pytest.FixtureRequest) -> ModuleType:
    """The module whose GradientStreamSession / GradientChunk are under test."""
    return load_impl(request.param)


# Bit patterns that a float64 round trip or a canonicalising copy would change.
SPECIAL_BITS = np.array(
    [
        0x7FC0_0001,  # quiet NaN with payload
        0xFFFF_FFFF,  # negative NaN, all payload bits set
        0x7F80_0001,  # signalling NaN
        0x7FBF_FFFF,  # signalling NaN, all payload bits
        0x8000_0000,  # -0.0
        0x0000_0000,  # +0.0
        0x7F80_0000,  # +inf
        0xFF80_0000,  # -inf
        0x0000_0001,  # smallest subnormal
        0x807F_FFFF,  # largest negative subnormal
        0x7F7F_FFFF,  # largest finite
        0x3F80_0000,  # 1.0
    ],
    dtype=np.uint32,
)


def special(n: int) -> np.ndarray:
    """n values cycling through SPECIAL_BITS (NaN payloads, -0.0, subnormals...)."""
    return np.resize(SPECIAL_BITS, n).view(np.float32)


# --------------------------------------------------------------------------- helpers


def session(impl: ModuleType, chunk_size: int = 4, **kwargs: Any) -> Any:
    return impl.GradientStreamSession("s", chunk_size, **kwargs)


def float32_bits(values: Any) -> np.ndarray:
    """The raw bits of float32 values, flat, C order."""
    return np.ascontiguousarray(values, dtype=np.float32).reshape(-1).view(np.uint32)


def frame(index: int, total: int, payload: bytes, checksum: int | None = None) -> bytes:
    """A frame of ``payload``, with its correct CRC-32 unless ``checksum`` is given."""
    crc = zlib.crc32(payload) if checksum is None else checksum
    return HEADER.pack(index, total, len(payload), crc) + payload


def split_frames(wire: bytes) -> list[tuple[int, int, bytes]]:
    """(chunk_index, total_chunks, payload) of each frame of a valid stream."""
    frames, pos = [], 0
    while pos < len(wire):
        index, total, length, _ = HEADER.unpack_from(wire, pos)
        frames.append((index, total, wire[pos + HEADER_LEN : pos + HEADER_LEN + length]))
        pos += HEADER_LEN + length
    return frames


def join_frames(parts: list[tuple[int, int, bytes]]) -> bytes:
    """The frames of (chunk_index, total_chunks, payload), each with its correct CRC."""
    return b"".join(frame(i, t, p) for i, t, p in parts)


def frame_offsets(parts: list[tuple[int, int, bytes]]) -> list[int]:
    """The offset of each frame of join_frames(parts)."""
    offsets, pos = [], 0
    for _, _, p in parts:
        offsets.append(pos)
        pos += HEADER_LEN + len(p)
    return offsets


def both_ways(
    impl: ModuleType,
    parts: list[tuple[int, int, bytes]],
    out: Callable[[], np.ndarray] | None = None,
    **kwargs: Any,
) -> tuple[Any, Any]:
    """(decode_chunks outcome, decode_frames outcome) of chunks (index, total, payload)
    with correct CRCs, the frames in the order given (decode_chunks gets that order too).
    An outcome is the array or the GradientStreamError raised. With ``out`` (a factory),
    decode_frames writes into a fresh array from it."""
    s = session(impl, **kwargs)
    chunks = [impl.GradientChunk("s", i, t, p, zlib.crc32(p)) for i, t, p in parts]
    wire = join_frames(parts)
    kw = {} if out is None else {"out": out()}
    outcomes = []
    for call in (lambda: s.decode_chunks(chunks), lambda: s.decode_frames(wire, **kw)):
        try:
            outcomes.append(call())
        except GradientStreamError as exc:
            outcomes.append(exc)
    return outcomes[0], outcomes[1]


def assert_error(
    got: Any, cls: type, detail: str, chunk_index: int | None, offset: Any = "skip"
) -> None:
    assert type(got) is cls, f"expected {cls.__name__}, got {got!r}"
    assert got.detail == detail, got.detail
    assert got.chunk_index == chunk_index, got
    if offset != "skip":
        assert got.offset == offset, got


def proc_status(key: str) -> int:
    """A size from /proc/self/status (VmRSS, VmHWM...), in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {key} in /proc/self/status")


# --------------------------------------------------------------------------- connections


def run(main: Callable[[], Awaitable[T]], deadline: float = DEADLINE) -> T:
    """asyncio.run(main()) under an overall deadline, so that a hang fails the test."""

    async def bounded() -> T:
        async with asyncio.timeout(deadline):
            return await main()

    return asyncio.run(bounded())


async def close_all(writers: list[asyncio.StreamWriter], socks: list[socket.socket]) -> None:
    """Close the stream writers (waiting for each, whatever it raises), then the sockets."""
    for w in writers:
        w.close()
        with contextlib.suppress(Exception):
            await w.wait_closed()
    for s in socks:
        s.close()


async def transfer(
    sender: Any, receiver: Any, grad: Any, path: str, **kwargs: Any
) -> tuple[int, Any]:
    """stream_to on one end of a socketpair, receive_from(**kwargs) on the other,
    concurrently, over sockets or asyncio streams: (what stream_to returned, what
    receive_from returned)."""
    a, b = socket.socketpair()
    writers: list[asyncio.StreamWriter] = []
    try:
        tx: Any = a
        rx: Any = b
        if path == "streams":
            _, wa = await asyncio.open_connection(sock=a)
            rb, wb = await asyncio.open_connection(sock=b)
            writers += [wa, wb]
            tx, rx = wa, rb
        sent, got = await asyncio.gather(
            sender.stream_to(grad, tx), receiver.receive_from(rx, **kwargs)
        )
        return sent, got
    finally:
        await close_all(writers, [a, b])


async def receive_bytes(s: Any, data: bytes, path: str, **kwargs: Any) -> Any:
    """receive_from(**kwargs) over a socketpair whose peer wrote ``data`` (it must fit the
    socket buffer) and closed; the result or the GradientStreamError raised."""
    a, b = socket.socketpair()
    writer = None
    try:
        a.sendall(data)
        a.shutdown(socket.SHUT_WR)
        rx: Any = b
        if path == "streams":
            rx, writer = await asyncio.open_connection(sock=b)
        try:
            return await s.receive_from(rx, **kwargs)
        except GradientStreamError as exc:
            return exc
    finally:
        await close_all([writer] if writer is not None else [], [a, b])


async def read_until_eof(sock: socket.socket) -> bytes:
    loop = asyncio.get_running_loop()
    sock.setblocking(False)
    buf = bytearray()
    while data := await loop.sock_recv(sock, 1 << 20):
        buf += data
    return bytes(buf)


def tcp_socket_pair() -> tuple[socket.socket, socket.socket]:
    """A connected pair of sockets over loopback TCP: (client, server)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    return client, server

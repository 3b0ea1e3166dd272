"""Streaming, fuzzed: hypothesis draws frame streams and cuts, sent by a raw peer to
both implementations, which must give the same outcome and leave no descriptor behind.

Connections, paths and deadlines as in test_streaming.py (helpers: support/streams.py).
"""

from __future__ import annotations

import asyncio
import errno
import socket
import struct
import zlib
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

pytest.importorskip("gradstream._native", reason="native extension not built")

import gradstream as gs
from gradstream.errors import (
    ArrowIpcError,
    ChecksumMismatchError,
    FrameError,
    IncompleteStreamError,
)
from support.aio import read_until_eof
from support.frames import HEADER, HEADER_LEN
from support.impls import PATHS
from support.streams import (
    IMPL_NAMES,
    IMPLS,
    U32_MAX,
    async_outcome,
    close_writer,
    describe,
    nfd,
    outcome,
    warm_up,
    wrap_receiver,
)

DATA_ERRORS = (ArrowIpcError, ChecksumMismatchError, FrameError, IncompleteStreamError)


# --------------------------------------------------------------------------- fuzz


@st.composite
def frame_streams(draw: Any) -> bytes:
    """A valid stream of a few small chunks, then hostile edits: of whole frames (drop,
    duplicate, swap, rewrite a header word, change a payload and fix its CRC so that the
    Arrow decoder sees it), then of bytes (bit flips, cuts, inserted garbage, a tail)."""
    n = draw(st.integers(0, 40))
    chunk = draw(st.integers(1, 8))
    values = np.arange(n, dtype=np.float32) * np.float32(0.5)
    frames = frames_of_prefix(gs.GradientStreamSession("f", chunk).encode_frames(values))
    frame_edits = ["drop", "dup", "swap", "header", "payload"]
    for edit in draw(st.lists(st.sampled_from(frame_edits), max_size=3)):
        i = draw(st.integers(0, len(frames) - 1)) if frames else 0
        j = draw(st.integers(0, len(frames) - 1)) if frames else 0
        if not frames:
            break
        if edit == "drop":
            del frames[i]
        elif edit == "dup":
            frames.insert(j, frames[i])
        elif edit == "swap":
            frames[i], frames[j] = frames[j], frames[i]
        elif edit == "header":
            word = draw(st.integers(0, 3))
            value = draw(st.sampled_from([0, 1, 2, 3, 7, 1 << 20, 1 << 28, U32_MAX]))
            frame = bytearray(frames[i])
            struct.pack_into("<I", frame, 4 * word, value)
            frames[i] = bytes(frame)
        else:
            payload = bytearray(frames[i][HEADER_LEN:])
            how = draw(st.sampled_from(["flip", "cut", "replace"]))
            if how == "flip" and payload:
                for _ in range(draw(st.integers(1, 3))):
                    at = draw(st.integers(0, len(payload) - 1))
                    payload[at] ^= 1 << draw(st.integers(0, 7))
            elif how == "cut":
                payload = payload[: draw(st.integers(0, len(payload)))]
            else:
                payload = bytearray(draw(st.binary(max_size=64)))
            index, total = HEADER.unpack_from(frames[i])[:2]
            frames[i] = HEADER.pack(index, total, len(payload), zlib.crc32(payload)) + payload
    data = bytearray(b"".join(frames))
    byte_edits = ["flip", "cut", "cut-near-a-frame-end", "garbage", "tail"]
    for edit in draw(st.lists(st.sampled_from(byte_edits), max_size=2)):
        if edit == "flip" and data:
            at = draw(st.integers(0, len(data) - 1))
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif edit == "cut":
            data = data[: draw(st.integers(0, len(data)))]
        elif edit == "cut-near-a-frame-end" and frames:
            end = sum(map(len, frames[: draw(st.integers(1, len(frames)))]))
            data = data[: max(0, end + draw(st.integers(-3, HEADER_LEN)))]
        elif edit == "garbage":
            at = draw(st.integers(0, len(data)))
            data[at:at] = draw(st.binary(min_size=1, max_size=40))
        elif edit == "tail":
            data += draw(st.binary(min_size=1, max_size=20))
    return bytes(data)


def frames_of_prefix(data: bytes) -> list[bytes]:
    """The whole frames at the start of data (as far as the headers make sense)."""
    out = []
    pos = 0
    while pos + HEADER_LEN <= len(data):
        end = pos + HEADER_LEN + HEADER.unpack_from(data, pos)[2]
        if end > len(data):
            break
        out.append(data[pos:end])
        pos = end
    return out


@pytest.mark.parametrize("path", PATHS)
def test_fuzz_receive_from_agrees_with_decode_frames(path: str) -> None:
    """Random and mutated frame streams, written by a peer that then closes: native
    receive_from gives only gradstream errors or values, and exactly what decode_frames
    gives for the bytes it consumed (it leaves whatever follows the last frame unread)."""
    session = gs.GradientStreamSession("fuzz", max_payload_len=1 << 16, max_gradient_len=64)

    async def receive(data: bytes) -> tuple[tuple[str, Any], bytes]:
        peer, ours = socket.socketpair()
        with peer, ours:
            peer.sendall(data)
            peer.close()
            stream, writer = await wrap_receiver(ours, path)
            async with asyncio.timeout(5):
                result = await async_outcome(session.receive_from(stream))
                if writer is None:
                    rest = await read_until_eof(ours)
                else:
                    rest = await stream.read()
                    await close_writer(writer)
        return result, rest

    with asyncio.Runner() as runner:
        start = runner.run(_count_fds_after_warm_up())

        @settings(
            max_examples=300,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        )
        @given(data=st.one_of(frame_streams(), st.binary(max_size=200)))
        def check(data: bytes) -> None:
            result, rest = runner.run(receive(data))
            note(f"result={result!r} rest={len(rest)} bytes")
            if result[0] == "err":
                assert isinstance(result[1], DATA_ERRORS), result
                assert describe(result) == describe(outcome(lambda: session.decode_frames(data)))
            else:
                assert data.endswith(rest)
                consumed = data[: len(data) - len(rest)]
                want = describe(outcome(lambda: session.decode_frames(consumed)))
                assert describe(result) == want
                if rest:
                    whole = outcome(lambda: session.decode_frames(data))
                    assert whole[0] == "err" and "left over" in str(whole[1])

        check()
        assert nfd() == start, f"{nfd() - start} descriptor(s) left open"


async def _count_fds_after_warm_up() -> int:
    await warm_up()
    return nfd()


@pytest.mark.parametrize("impl", IMPL_NAMES)
def test_socket_arguments_that_cannot_carry_a_gradient(impl: str) -> None:
    # Both implementations: a closed socket is StreamIOError(EBADF), a datagram socket a
    # ValueError, anything else a TypeError naming what is accepted.
    session = IMPLS[impl].GradientStreamSession("args")

    async def main() -> None:
        closed = socket.socket()
        closed.close()
        with pytest.raises(gs.StreamIOError) as info:
            await session.receive_from(closed)
        assert info.value.errno == errno.EBADF
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            with pytest.raises(ValueError, match=r"(?i)stream socket|SOCK_STREAM"):
                await session.receive_from(udp)
        with pytest.raises(TypeError, match="socket"):
            await session.receive_from(object())
        with pytest.raises(TypeError, match="socket"):
            await session.stream_to(np.ones(3, np.float32), object())

    asyncio.run(main())

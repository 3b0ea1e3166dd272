"""The reference's streaming API (docs/guides/limits.md): stream_to, receive_from and
receive_iter over sockets (socketpair, TCP on 127.0.0.1, AF_UNIX) and asyncio streams:
round trips, progress, the end of a stream and the limits on arrival. Timeouts,
cancellation and broken connections are in test_reference_streaming_failures.py.

Plain test functions running their own event loop with asyncio.run (no pytest-asyncio).
Every scenario is bounded by a global deadline so that a bug shows up as a failure, not
as a hung test run.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import numpy as np
import pytest

import gradstream.reference as ref
from gradstream.errors import FrameError, GradientStreamError, IncompleteStreamError
from support.frames import HEADER, frame
from support.links import (
    assert_same_bits,
    connect,
    frames_of,
    ramp,
    run,
    send_then_close,
    three_frames,
)


def recv_all(sock: socket.socket) -> bytes:
    """Everything a blocking socket receives until the peer closes (run in a thread)."""
    parts = []
    while data := sock.recv(1 << 20):
        parts.append(data)
    return b"".join(parts)


KINDS = [
    "socketpair",
    "tcp",
    "unix",
    "streams-tcp",
    "streams-socketpair",
    "socket-to-streams",
    "streams-to-socket",
]


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("size", [0, 1, 65536, 65537, 3_000_000])
def test_round_trip(kind: str, size: int) -> None:
    s = ref.GradientStreamSession("run-7", timeout=30)
    grad = ramp(size)

    async def main() -> tuple[int, np.ndarray]:
        async with connect(kind) as link:
            sent, got = await asyncio.gather(s.stream_to(grad, link.tx), s.receive_from(link.rx))
            return sent, got

    sent, got = run(main)
    assert sent == max(1, -(-size // 65536))
    assert_same_bits(got, grad)
    assert got.flags.owndata and got.flags.writeable


def test_readme_example() -> None:
    async def main() -> None:
        a, b = socket.socketpair()
        with a, b:
            s = ref.GradientStreamSession("run-7", timeout=30)
            grad = np.ones(10_000_000, np.float32)
            sent, got = await asyncio.gather(s.stream_to(grad, a), s.receive_from(b))
            assert sent == 153 and np.array_equal(got, grad)

    run(main)


@pytest.mark.parametrize("kind", KINDS)
def test_several_gradients_on_one_connection(kind: str) -> None:
    s = ref.GradientStreamSession("s", 1000)
    grads = [ramp(2500), ramp(0), ramp(1), ramp(3000) + 1]

    async def main() -> list[np.ndarray]:
        async with connect(kind) as link:

            async def send_all() -> None:
                for g in grads:
                    await s.stream_to(g, link.tx)

            async def receive_all() -> list[np.ndarray]:
                return [await s.receive_from(link.rx) for _ in grads]

            _, got = await asyncio.gather(send_all(), receive_all())
            return got

    for got, grad in zip(run(main), grads, strict=True):
        assert_same_bits(got, grad)


@pytest.mark.parametrize("kind", KINDS)
def test_receive_iter_ends_when_the_peer_closes(kind: str) -> None:
    s = ref.GradientStreamSession("s", 1000)
    # An empty gradient is a gradient (one empty frame), not the end.
    grads = [ramp(2500), ramp(0), ramp(7)]

    async def main() -> list[np.ndarray]:
        async with connect(kind) as link:

            async def send_all() -> None:
                for g in grads:
                    await s.stream_to(g, link.tx)
                await link.close_tx()

            async def receive_all() -> list[np.ndarray]:
                return [g async for g in s.receive_iter(link.rx)]

            _, got = await asyncio.gather(send_all(), receive_all())
            return got

    got = run(main)
    assert len(got) == len(grads)
    for g, grad in zip(got, grads, strict=True):
        assert_same_bits(g, grad)


@pytest.mark.parametrize("streams", [False, True])
@pytest.mark.parametrize("size", [0, 5, 65537, 3_000_000])
def test_bytes_on_the_wire_are_encode_frames(streams: bool, size: int) -> None:
    s = ref.GradientStreamSession("s", timeout=30)
    grad = ramp(size)

    async def main() -> bytes:
        a, b = socket.socketpair()
        with a, b:
            received = asyncio.ensure_future(asyncio.to_thread(recv_all, b))
            await send_then_close(s, grad, a, streams)
            return await received

    assert run(main) == s.encode_frames(grad)


def test_receiver_reads_no_byte_past_the_gradient() -> None:
    s = ref.GradientStreamSession("s", 3)
    wire = s.encode_frames(ramp(10))

    async def main(streams: bool) -> tuple[np.ndarray, bytes]:
        a, b = socket.socketpair()
        with a, b:
            a.sendall(wire + b"next!")
            if streams:
                r, w = await asyncio.open_connection(sock=b)
                got = await s.receive_from(r)
                rest = await r.read(100)
                w.close()
                return got, rest
            got = await s.receive_from(b)
            return got, b.recv(100)

    for streams in (False, True):
        got, rest = run(lambda streams=streams: main(streams))
        assert_same_bits(got, ramp(10))
        assert rest == b"next!"


def test_frames_in_any_order_on_a_stream() -> None:
    s = ref.GradientStreamSession("s", 4)
    frames = frames_of(s, ramp(10))

    async def main() -> np.ndarray:
        a, b = socket.socketpair()
        with a, b:
            a.sendall(frames[2] + frames[0] + frames[1])
            return await s.receive_from(b)

    assert_same_bits(run(main), ramp(10))


def test_full_duplex_on_one_socket_each_way() -> None:
    # Both ends send and receive at once on the same socket: the socket is put back in
    # blocking mode only when the last transfer on it ends.
    s = ref.GradientStreamSession("s", 10_000)
    g1, g2 = ramp(300_000), ramp(250_000) + 3

    async def main() -> tuple[np.ndarray, np.ndarray, float | None, float | None]:
        a, b = socket.socketpair()
        with a, b:
            b.settimeout(7.0)
            _, _, got_at_b, got_at_a = await asyncio.gather(
                s.stream_to(g1, a), s.stream_to(g2, b), s.receive_from(b), s.receive_from(a)
            )
            return got_at_b, got_at_a, a.gettimeout(), b.gettimeout()

    got_at_b, got_at_a, a_mode, b_mode = run(main)
    assert_same_bits(got_at_b, g1)
    assert_same_bits(got_at_a, g2)
    assert (a_mode, b_mode) == (None, 7.0)


@pytest.mark.parametrize("previous", [None, 0.0, 2.5])
def test_blocking_mode_is_restored_after_a_transfer(previous: float | None) -> None:
    s = ref.GradientStreamSession("s")

    async def main() -> tuple[float | None, float | None]:
        a, b = socket.socketpair()
        with a, b:
            a.settimeout(previous)
            b.settimeout(previous)
            await asyncio.gather(s.stream_to(ramp(100_000), a), s.receive_from(b))
            return a.gettimeout(), b.gettimeout()

    assert run(main) == (previous, previous)


def test_socket_mode_between_gradients_of_receive_iter_is_the_callers() -> None:
    s = ref.GradientStreamSession("s")

    async def main() -> list[float | None]:
        a, b = socket.socketpair()
        with a, b:
            a.sendall(s.encode_frames(ramp(3)) * 2)
            a.close()
            modes = []
            async for _ in s.receive_iter(b):
                modes.append(b.gettimeout())
            modes.append(b.gettimeout())
            return modes

    assert run(main) == [None, None, None]


def test_send_without_readiness_callbacks_falls_back_to_sendall(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A loop without add_writer (Windows' proactor): the sender falls back to sock_sendall.
    s = ref.GradientStreamSession("s")
    grad = ramp(3_000_000)

    async def main() -> bytes:
        loop = asyncio.get_running_loop()

        def no_writer(*args: object) -> None:
            raise NotImplementedError

        monkeypatch.setattr(loop, "add_writer", no_writer)
        a, b = socket.socketpair()
        with a, b:
            received = asyncio.ensure_future(asyncio.to_thread(recv_all, b))
            await s.stream_to(grad, a)
            a.shutdown(socket.SHUT_WR)
            return await received

    assert run(main) == s.encode_frames(grad)


# --------------------------------------------------------------------------- progress


def test_progress_counts_bytes_chunks_and_total() -> None:
    s = ref.GradientStreamSession("s", 1000)
    grad = ramp(4500)
    wire = s.encode_frames(grad)

    async def main() -> tuple[ref.TransferProgress, ref.TransferProgress, list[Any]]:
        a, b = socket.socketpair()
        with a, b:
            out, into = ref.TransferProgress(), ref.TransferProgress()
            seen = []

            async def watch() -> None:
                while into.chunks < 5:
                    seen.append((into.bytes, into.chunks, into.total_chunks))
                    await asyncio.sleep(0)

            await asyncio.gather(
                s.stream_to(grad, a, progress=out), s.receive_from(b, progress=into), watch()
            )
            return out, into, seen

    out, into, seen = run(main)
    for p in (out, into):
        assert (p.bytes, p.chunks, p.total_chunks) == (len(wire), 5, 5)
    assert seen == sorted(seen)  # never goes back
    assert "TransferProgress(bytes=" in repr(out)


def test_progress_adds_up_over_transfers_and_receive_iter() -> None:
    s = ref.GradientStreamSession("s", 1000)
    grads = [ramp(2500), ramp(0)]
    wire = b"".join(s.encode_frames(g) for g in grads)

    async def main() -> tuple[ref.TransferProgress, ref.TransferProgress]:
        a, b = socket.socketpair()
        with a, b:
            out, into = ref.TransferProgress(), ref.TransferProgress()

            async def send_all() -> None:
                for g in grads:
                    await s.stream_to(g, a, progress=out)
                a.shutdown(socket.SHUT_WR)

            async def receive_all() -> None:
                async for _ in s.receive_iter(b, progress=into):
                    pass

            await asyncio.gather(send_all(), receive_all())
            return out, into

    for p in run(main):
        assert (p.bytes, p.chunks, p.total_chunks) == (len(wire), 4, 4)


def test_progress_of_a_failed_receive_counts_what_arrived() -> None:
    s = ref.GradientStreamSession("s", 4)
    frames = frames_of(s, ramp(12))

    async def main() -> ref.TransferProgress:
        a, b = socket.socketpair()
        with a, b:
            a.sendall(frames[0] + frames[1][:20])
            a.close()
            p = ref.TransferProgress()
            with pytest.raises(FrameError):
                await s.receive_from(b, progress=p)
            return p

    p = run(main)
    assert (p.bytes, p.chunks, p.total_chunks) == (len(frames[0]) + 20, 1, 3)


def test_progress_must_be_a_reference_transfer_progress() -> None:
    s = ref.GradientStreamSession("s")

    async def main() -> None:
        a, b = socket.socketpair()
        with a, b:
            with pytest.raises(TypeError, match="progress"):
                await s.stream_to(ramp(3), a, progress=object())  # type: ignore[arg-type]
            with pytest.raises(TypeError, match="progress"):
                await s.receive_from(b, progress=5)  # type: ignore[arg-type]

    run(main)


# --------------------------------------------------------------------------- end of stream


async def _receive_after(
    kind: str, data: bytes, s: ref.GradientStreamSession, *, iterate: bool = False
) -> list[np.ndarray]:
    """Send `data`, close, and receive (receive_from, or everything receive_iter gives)."""
    async with connect(kind) as link:
        await link.send_raw(data)
        await link.close_tx()
        if iterate:
            return [g async for g in s.receive_iter(link.rx)]
        return [await s.receive_from(link.rx)]


EOF_KINDS = ["socketpair", "streams-socketpair", "socket-to-streams"]


@pytest.mark.parametrize("kind", EOF_KINDS)
def test_eof_before_any_byte(kind: str) -> None:
    s, _ = three_frames()
    (got,) = run(lambda: _receive_after(kind, b"", s))
    assert got.dtype == np.float32 and got.shape == (0,)
    assert run(lambda: _receive_after(kind, b"", s, iterate=True)) == []


@pytest.mark.parametrize("kind", EOF_KINDS)
@pytest.mark.parametrize("iterate", [False, True])
@pytest.mark.parametrize("n", [1, 15])
def test_eof_inside_the_first_header(kind: str, iterate: bool, n: int) -> None:
    s, frames = three_frames()
    with pytest.raises(FrameError) as info:
        run(lambda: _receive_after(kind, frames[0][:n], s, iterate=iterate))
    assert str(info.value) == f"truncated frame header: {n} of 16 bytes"
    assert (info.value.chunk_index, info.value.offset) == (None, 0)


@pytest.mark.parametrize("kind", EOF_KINDS)
@pytest.mark.parametrize("iterate", [False, True])
@pytest.mark.parametrize("n", [0, 1, 15])
def test_eof_between_frames_or_inside_a_later_header(kind: str, iterate: bool, n: int) -> None:
    s, frames = three_frames()
    with pytest.raises(IncompleteStreamError) as info:
        run(lambda: _receive_after(kind, frames[0] + frames[1][:n], s, iterate=iterate))
    assert (info.value.received, info.value.total) == (1, 3)


@pytest.mark.parametrize("kind", EOF_KINDS)
@pytest.mark.parametrize("iterate", [False, True])
@pytest.mark.parametrize("m", [0, 1, 100])
def test_eof_inside_a_payload(kind: str, iterate: bool, m: int) -> None:
    s, frames = three_frames()
    declared = len(frames[1]) - 16
    with pytest.raises(FrameError) as info:
        run(lambda: _receive_after(kind, frames[0] + frames[1][: 16 + m], s, iterate=iterate))
    assert str(info.value) == (
        f"truncated frame: chunk 1 declares a {declared}-byte payload but only {m} bytes follow"
    )
    assert (info.value.chunk_index, info.value.offset) == (1, len(frames[0]))


@pytest.mark.parametrize("kind", EOF_KINDS)
def test_receive_iter_yields_the_complete_gradients_before_a_truncated_one(kind: str) -> None:
    s, frames = three_frames()
    whole = b"".join(frames)
    got: list[np.ndarray] = []

    async def main() -> None:
        async with connect(kind) as link:
            await link.send_raw(whole + whole + frames[0] + frames[1][:30])
            await link.close_tx()
            async for g in s.receive_iter(link.rx):
                got.append(g)

    with pytest.raises(FrameError) as info:
        run(main)
    assert len(got) == 2
    # Offsets count from where this gradient started, not from the connection's start.
    assert (info.value.chunk_index, info.value.offset) == (1, len(frames[0]))


def test_error_offsets_count_from_where_receive_from_started() -> None:
    s, frames = three_frames()

    async def main() -> None:
        a, b = socket.socketpair()
        with a, b:
            a.sendall(b"".join(frames) + frames[1] + frames[1])
            assert len(await s.receive_from(b)) == 12
            await s.receive_from(b)

    with pytest.raises(FrameError) as info:
        run(main)
    assert str(info.value) == "duplicate chunk index 1"
    assert (info.value.chunk_index, info.value.offset) == (1, len(frames[1]))


# --------------------------------------------------------------------------- limits on arrival


@pytest.mark.parametrize("kind", EOF_KINDS)
def test_hostile_payload_len_is_refused_from_the_header_while_the_peer_stays(kind: str) -> None:
    s = ref.GradientStreamSession("s")

    async def main() -> None:
        async with connect(kind) as link:
            await link.send_raw(HEADER.pack(0, 1, 0xFFFFFFFF, 0))
            await s.receive_from(link.rx)  # the peer never closes: must not wait

    with pytest.raises(FrameError) as info:
        run(main)
    assert "4294967295-byte payload, above max_payload_len 268435456" in str(info.value)
    assert (info.value.chunk_index, info.value.offset) == (0, 0)


@pytest.mark.parametrize("kind", EOF_KINDS)
def test_hostile_total_chunks_is_refused_at_the_first_frame_while_the_peer_stays(
    kind: str,
) -> None:
    s = ref.GradientStreamSession("s")
    empty = s.encode_gradient(ramp(0))[0].arrow_ipc_bytes
    tiny = frame(0, 0xFFFFFFFF, empty)

    async def main() -> None:
        async with connect(kind) as link:
            await link.send_raw(tiny)
            await s.receive_from(link.rx)

    with pytest.raises(FrameError) as info:
        run(main)
    assert str(info.value) == "total_chunks 4294967295 above max_gradient_len 1073741824"
    assert (info.value.chunk_index, info.value.offset) == (0, 0)


def test_values_over_max_gradient_len_stop_the_stream_at_that_chunk() -> None:
    sender = ref.GradientStreamSession("s", 4)
    receiver = ref.GradientStreamSession("s", 4, max_gradient_len=10)
    frames = frames_of(sender, ramp(20))

    async def main() -> None:
        a, b = socket.socketpair()
        with a, b:
            # Only the first three of five frames: the third must be refused at once.
            a.sendall(b"".join(frames[:3]))
            await receiver.receive_from(b)

    with pytest.raises(FrameError) as info:
        run(main)
    assert str(info.value) == "gradient exceeds max_gradient_len 10: 12 values by chunk 2"
    assert (info.value.chunk_index, info.value.offset) == (2, len(frames[0]) + len(frames[1]))


def test_stream_errors_match_decode_frames() -> None:
    # The same receiver class makes both: compare them on a few damaged streams.
    s, frames = three_frames()
    bad_crc = bytearray(frames[1])
    bad_crc[-1] ^= 0xFF
    cases = [
        frames[0] + bytes(bad_crc) + frames[2],
        frames[0] + frames[0],
        frames[0] + HEADER.pack(9, 3, 0, 0),
        frames[0] + HEADER.pack(1, 4, 0, 0),
        frames[0] + frames[1] + HEADER.pack(2, 3, 2, 0) + b"xy",
    ]
    for wire in cases:
        with pytest.raises(GradientStreamError) as expected:
            s.decode_frames(wire)
        with pytest.raises(GradientStreamError) as actual:
            run(lambda wire=wire: _receive_after("socketpair", wire, s))
        assert type(actual.value) is type(expected.value)
        assert actual.value.__reduce__() == expected.value.__reduce__()

"""The socket path's small transfers on the caller's thread (issue 12, row 2;
crates/gradstream-py/src/fastpath.rs): a small send goes out in one non-blocking
``send``, a receive peeks at what the socket holds and takes a whole gradient there, and
anything else goes on in tokio as before. Nothing here times anything: the tests check
that the fast path ran (its counters) and that what comes out (values, errors and their
fields, progress counts, the bytes left on the socket, the socket's mode) is what the
reference gives and what the tokio path gave, on both sides of every threshold.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any

import numpy as np
import pytest

pytest.importorskip("gradstream._native", reason="native extension not built")

import gradstream as gs
import gradstream.reference as ref
from gradstream import _native
from gradstream.errors import FrameError, StreamDeadlineError, StreamTimeoutError
from support.aio import tcp_socket_pair
from support.streams import (
    assert_bit_equal,
    async_outcome,
    check_socket_intact,
    describe,
    gradient,
    run,
)

PEEK_MAX = 256 * 1024  # bytes a receive peeks at (fastpath.rs)
SEND_MAX = 128 * 1024  # bytes of values a send writes from the caller's thread
BIG_BUFFER = 4 << 20  # socket buffers that hold any gradient here whole
TRANSPORTS = ["tcp", "unix"]


def pair(transport: str) -> tuple[socket.socket, socket.socket]:
    """(peer, ours), blocking, with buffers that take a whole test gradient at once."""
    a, b = tcp_socket_pair() if transport == "tcp" else socket.socketpair()
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BIG_BUFFER)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BIG_BUFFER)
    return a, b


def counts() -> tuple[int, int]:
    """(sends, receives) the fast path finished so far."""
    return _native.fast_path_counts()


def largest_within(session: Any, limit: int) -> int:
    """The largest value count whose frames take at most ``limit`` bytes."""
    low, high = 0, limit
    while low < high:
        mid = (low + high + 1) // 2
        if session.frames_len(mid) <= limit:
            low = mid
        else:
            high = mid - 1
    return low


async def receive_each(
    impl: Any, wire: bytes, transport: str, *, tail: bytes = b"", **kwargs: Any
) -> tuple[tuple[Any, ...], bytes]:
    """Write ``wire + tail`` whole, then receive one gradient with ``impl``'s session:
    (the outcome's summary, the bytes the receive left on the socket)."""
    peer, ours = pair(transport)
    with peer, ours:
        peer.sendall(wire + tail)
        peer.shutdown(socket.SHUT_WR)
        session = impl.GradientStreamSession("s", kwargs.pop("chunk_size", 65536), **kwargs)
        got = describe(await async_outcome(session.receive_from(ours)))
        ours.setblocking(True)
        left = b""
        while data := ours.recv(1 << 20):
            left += data
        return got, left


# ---- differential: native (fast path) vs reference, around every threshold


def _threshold_cases() -> list[tuple[str, int, int]]:
    seed = gs.GradientStreamSession("s", 65536)
    at_peek = largest_within(seed, PEEK_MAX)
    small_chunks = gs.GradientStreamSession("s", 7)
    return [
        ("empty", 0, 65536),
        ("one value", 1, 65536),
        ("1,000 values", 1000, 65536),
        ("frames just within the peek", at_peek, 65536),
        ("frames one value over the peek", at_peek + 1, 65536),
        ("many chunks", largest_within(small_chunks, PEEK_MAX) // 3, 7),
    ]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(("case", "n", "chunk_size"), _threshold_cases())
def test_a_receive_gives_what_the_reference_gives_and_leaves_the_rest(
    transport: str, case: str, n: int, chunk_size: int
) -> None:
    s = gs.GradientStreamSession("s", chunk_size)
    wire = s.encode_frames(gradient(n, seed=n))
    tail = s.encode_frames(gradient(3, seed=1))  # the next gradient, which stays unread

    async def main() -> None:
        before = counts()[1]
        native = await receive_each(gs, wire, transport, tail=tail, chunk_size=chunk_size)
        fast = counts()[1] - before
        reference = await receive_each(ref, wire, transport, tail=tail, chunk_size=chunk_size)
        assert native == reference
        assert native[0][0] == "ok" and native[1] == tail
        # The fast path took exactly the gradients whose frames fit in one peek.
        assert fast == (1 if len(wire) <= PEEK_MAX else 0), (case, len(wire))

    run(main)


def _hostile_streams() -> list[tuple[str, bytes]]:
    s = gs.GradientStreamSession("s", 4)
    wire = s.encode_frames(gradient(10, seed=3))
    head = struct.Struct("<IIII")  # chunk_index, total_chunks, payload_len, checksum
    index, total, length, crc = head.unpack_from(wire)
    flipped = bytearray(wire)
    flipped[40] ^= 0xFF
    return [
        ("oversized payload_len", head.pack(index, total, 0xFFFF_FFF0, crc)),
        ("total over max_gradient_len", head.pack(index, 0xFFFF_FFFF, length, crc) + wire[16:]),
        ("damaged payload", bytes(flipped)),
        ("truncated header", wire[:9]),
        ("truncated payload", wire[:30]),
        ("a chunk missing", wire[: 16 + length]),
        ("duplicate chunk", wire[: 16 + length] * 2 + wire[16 + length :]),
    ]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(("case", "data"), _hostile_streams())
def test_a_hostile_stream_is_refused_as_by_the_reference(
    transport: str, case: str, data: bytes
) -> None:
    async def main() -> None:
        native = await receive_each(gs, data, transport, chunk_size=4)
        reference = await receive_each(ref, data, transport, chunk_size=4)
        assert native[0][0] == "err", case
        assert native[0] == reference[0], case

    run(main)


def test_an_oversized_header_is_refused_from_the_peek_without_waiting_for_its_payload() -> None:
    """A header announcing more than max_payload_len is refused at once, from the 16 bytes
    peeked (the payload never comes; the session has no timeout to end the wait)."""
    header = struct.pack("<IIII", 0, 1, 1 << 30, 0)

    async def main() -> None:
        peer, ours = pair("tcp")
        with peer, ours:
            peer.sendall(header)
            before = counts()[1]
            with pytest.raises(FrameError, match="max_payload_len") as raised:
                await gs.GradientStreamSession("s").receive_from(ours)
            assert raised.value.chunk_index == 0
            assert counts()[1] == before  # refused, not received

    run(main)


# ---- sends


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("n", [0, 1, 1000, SEND_MAX // 4, SEND_MAX // 4 + 1])
def test_a_send_writes_encode_frames_and_counts_it(transport: str, n: int) -> None:
    s = gs.GradientStreamSession("s", 4096)
    g = gradient(n, seed=5)
    wire = s.encode_frames(g)

    async def main() -> None:
        peer, ours = pair(transport)
        with peer, ours:
            progress = gs.TransferProgress()
            before = counts()[0]
            sent = await s.stream_to(g, ours, progress=progress)
            fast = counts()[0] - before
            ours.shutdown(socket.SHUT_WR)
            got = b""
            while data := peer.recv(1 << 20):
                got += data
            assert got == wire
            assert sent == progress.chunks == progress.total_chunks == max(1, -(-n // 4096))
            assert progress.bytes == len(wire)
            assert fast == (1 if n * 4 <= SEND_MAX else 0)
            check_socket_intact(ours)

    run(main)


def test_a_send_the_socket_cannot_take_at_once_goes_on_in_tokio_without_resending() -> None:
    """A small buffer takes part of the frames; the rest follows from tokio, and the peer
    gets every byte once, in order."""
    s = gs.GradientStreamSession("s", 1000)
    g = gradient(SEND_MAX // 4, seed=6)
    wire = s.encode_frames(g)

    async def main() -> None:
        peer, ours = socket.socketpair()
        with peer, ours:
            ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            progress = gs.TransferProgress()
            before = counts()[0]
            sending = asyncio.ensure_future(s.stream_to(g, ours, progress=progress))
            await asyncio.sleep(0.05)
            assert not sending.done()  # the peer has not read: the rest waits in tokio
            loop = asyncio.get_running_loop()
            peer.setblocking(False)
            got = bytearray()
            while len(got) < len(wire):
                got += await loop.sock_recv(peer, 1 << 16)
            assert await sending == progress.chunks == progress.total_chunks
            assert bytes(got) == wire and progress.bytes == len(wire)
            assert counts()[0] == before  # not all at once
            check_socket_intact(ours)

    run(main)


def test_a_send_to_a_closed_peer_raises_the_io_error_of_the_tokio_path() -> None:
    async def main() -> None:
        peer, ours = socket.socketpair()
        with ours:
            peer.close()
            with pytest.raises(gs.StreamIOError) as raised:
                await gs.GradientStreamSession("s").stream_to(gradient(10), ours)
            assert raised.value.errno == 32  # EPIPE

    run(main)


# ---- the socket's mode, waiting, timeouts and deadlines


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("mode", [None, 0.0, 5.0])
def test_round_trips_leave_the_callers_socket_mode_as_it_was(
    transport: str, mode: float | None
) -> None:
    s = gs.GradientStreamSession("s")

    async def main() -> None:
        a, b = pair(transport)
        with a, b:
            for sock in (a, b):
                sock.settimeout(mode)
            before = counts()
            for n in (1000, 1, 0):
                g = gradient(n, seed=n)
                got = await asyncio.gather(s.stream_to(g, a), s.receive_from(b))
                assert_bit_equal(got[1], g)
                echoed = await asyncio.gather(s.receive_from(a), s.stream_to(got[1], b))
                assert_bit_equal(echoed[0], g)
            assert counts()[0] - before[0] == 6
            for sock in (a, b):
                check_socket_intact(sock, mode)

    run(main)


def test_a_receive_waits_for_a_gradient_that_comes_later_on_the_loop() -> None:
    """Nothing there at first: the receive waits for readability without blocking the
    loop (another task runs meanwhile), then takes the gradient on this thread."""
    s = gs.GradientStreamSession("s", timeout=10)
    g = gradient(500, seed=8)

    async def main() -> None:
        peer, ours = pair("unix")
        with peer, ours:
            before = counts()[1]
            receiving = asyncio.ensure_future(s.receive_from(ours))
            ticks = 0
            for _ in range(5):
                await asyncio.sleep(0.01)
                ticks += 1
            assert not receiving.done() and ticks == 5
            peer.sendall(s.encode_frames(g))
            assert_bit_equal(await receiving, g)
            assert counts()[1] == before + 1

    run(main)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(
    ("sent", "kwargs"),
    [
        ("nothing", {"timeout": 0.2}),
        ("half a frame", {"timeout": 0.2}),
        ("one of three frames", {"timeout": 0.2}),
        ("one of three frames", {"timeout": 5, "deadline": 0.3}),
    ],
)
def test_a_stalled_peer_gives_the_timeout_or_deadline_error_of_the_reference(
    transport: str, sent: str, kwargs: dict[str, float]
) -> None:
    s = gs.GradientStreamSession("s", 4)
    wire = s.encode_frames(gradient(10, seed=9))
    first = 16 + struct.unpack_from("<I", wire, 8)[0]
    data = {"nothing": b"", "half a frame": wire[:20], "one of three frames": wire[:first]}[sent]

    async def outcome_of(impl: Any) -> tuple[Any, ...]:
        peer, ours = pair(transport)
        with peer, ours:
            peer.sendall(data)  # and then nothing, the connection kept open
            session = impl.GradientStreamSession("s", 4, **kwargs)
            result = await async_outcome(session.receive_from(ours))
            assert result[0] == "err"
            error = result[1]
            return (type(error), str(error), error.received, error.total)

    async def main() -> None:
        native, reference = await outcome_of(gs), await outcome_of(ref)
        assert native == reference
        late = "deadline" in kwargs
        assert native[0] is (StreamDeadlineError if late else StreamTimeoutError)

    run(main)


def test_a_receive_cancelled_while_waiting_consumes_nothing() -> None:
    s = gs.GradientStreamSession("s")
    g = gradient(100, seed=10)

    async def main() -> None:
        peer, ours = pair("tcp")
        with peer, ours:
            waiting = asyncio.ensure_future(s.receive_from(ours))
            await asyncio.sleep(0.02)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            peer.sendall(s.encode_frames(g))
            assert_bit_equal(await s.receive_from(ours), g)
            check_socket_intact(ours)

    run(main)


# ---- sequences on one socket


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_gradients_back_to_back_each_come_out_once_fast_and_slow_mixed(transport: str) -> None:
    s = gs.GradientStreamSession("s", 4096)
    sizes = [1000, 0, 1, 100_000, 5, 40_000, 3]  # 100,000 and 40,000: past the peek
    grads = [gradient(n, seed=k) for k, n in enumerate(sizes)]

    async def main() -> None:
        a, b = pair(transport)
        with a, b:
            for g in grads:  # all written before the first receive
                await s.stream_to(g, a)
            a.shutdown(socket.SHUT_WR)
            progress = gs.TransferProgress()
            before = counts()[1]
            got = [g async for g in s.receive_iter(b, progress=progress)]
            assert len(got) == len(grads)
            for back, g in zip(got, grads, strict=True):
                assert_bit_equal(back, g)
            wire = sum(len(s.encode_frames(g)) for g in grads)
            assert progress.bytes == wire
            assert (
                progress.total_chunks
                == progress.chunks
                == sum(max(1, -(-n // 4096)) for n in sizes)
            )
            assert counts()[1] - before == 5  # all but the two past the peek

    run(main)


def test_out_arrays_are_filled_and_checked_as_on_the_tokio_path() -> None:
    s = gs.GradientStreamSession("s")
    g = gradient(1000, seed=12)

    async def main() -> None:
        for room in (1000, 999, 1001):
            outcomes = []
            for impl in (gs, ref):
                peer, ours = pair("unix")
                with peer, ours:
                    peer.sendall(s.encode_frames(g))
                    dest = np.full((room,), np.nan, np.float32)
                    session = impl.GradientStreamSession("s")
                    result = await async_outcome(session.receive_from(ours, out=dest))
                    if result[0] == "ok":
                        assert result[1] is dest
                        assert_bit_equal(dest, g)
                        outcomes.append("ok")
                    else:
                        outcomes.append(describe(result))
            assert outcomes[0] == outcomes[1], room

    run(main)

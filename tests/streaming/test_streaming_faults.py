"""Streaming from hostile and broken peers: plain sockets write crafted bytes; what
they provoke must be exactly what docs/guides/limits.md, "Limits against a hostile or broken
peer" and "Decoding rules" promise, with nothing left behind (descriptors, blocking mode,
stray readers).

Connections, paths and deadlines as in test_streaming.py (helpers: support/streams.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import socket
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

pytest.importorskip("gradstream._native", reason="native extension not built")

import gradstream as gs
from gradstream.errors import (
    ArrowIpcError,
    ChecksumMismatchError,
    FrameError,
    GradientStreamError,
    IncompleteStreamError,
    StreamTimeoutError,
)
from support.frames import HEADER, HEADER_LEN, frame
from support.impls import PATHS
from support.memory import proc_status
from support.streams import (
    FAULT_GRAD,
    IMPL_NAMES,
    U32_MAX,
    WIRE,
    assert_bit_equal,
    async_outcome,
    check_socket_intact,
    chunks_of,
    close_writer,
    describe,
    fds_back_to,
    frames_of,
    gradient,
    need,
    nfd,
    outcome,
    run,
    warm_up,
    wrap_receiver,
    wrap_sender,
)

# Both native paths bound the time without a byte moving, not a whole frame (the streams
# path once bounded a whole readexactly()/drain(); these tests caught it).
NATIVE_TIMEOUT_PATHS = ["socket", "streams"]


def start_peak_rss() -> int:
    """Reset the peak RSS (VmHWM) to the current RSS where the kernel allows it; the
    current RSS, to subtract from peak_rss() later."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return proc_status("VmRSS")


def peak_rss() -> int:
    return proc_status("VmHWM")


(OFF0, FRAME0), (OFF1, FRAME1), (OFF2, FRAME2) = frames_of(WIRE)


def with_header(frame: bytes, **fields: int) -> bytes:
    values = dict(zip(("index", "total", "length", "crc"), HEADER.unpack_from(frame), strict=True))
    values.update(fields)
    return (
        HEADER.pack(values["index"], values["total"], values["length"], values["crc"])
        + frame[HEADER_LEN:]
    )


def flip_payload_bit(frame: bytes, at: int) -> bytes:
    out = bytearray(frame)
    out[HEADER_LEN + at] ^= 0x10
    return bytes(out)


def garbage_frame(index: int, total: int) -> bytes:
    return frame(index, total, b"not an arrow file, but the CRC is right")


@dataclass(frozen=True)
class Fault:
    """A peer that writes `data` and then closes (or, with `stall`, stays silent with the
    connection open; with `forever`, keeps writing `data` again and again)."""

    data: bytes
    check: Callable[[tuple[str, Any]], None]
    session: dict[str, Any] = field(default_factory=dict)
    stall: bool = False
    forever: bool = False
    left_over: bytes = b""
    fast: float | None = None  # seconds the receiver may take at most


def expect(
    cls: type[BaseException], *, text: str = "", **fields: Any
) -> Callable[[tuple[str, Any]], None]:
    def check(result: tuple[str, Any]) -> None:
        kind, value = result
        assert kind == "err", f"expected {cls.__name__}, got {value!r}"
        assert type(value) is cls, f"expected {cls.__name__}, got {value!r}"
        assert text in str(value)
        for name, want in fields.items():
            assert getattr(value, name) == want, (name, value)

    return check


def expect_values(want: np.ndarray) -> Callable[[tuple[str, Any]], None]:
    def check(result: tuple[str, Any]) -> None:
        kind, value = result
        assert kind == "ok", f"expected values, got {value!r}"
        assert_bit_equal(value, want)

    return check


FLIPPED = flip_payload_bit(FRAME1, 200)


TINY_FRAMES = gs.GradientStreamSession("tiny", 1).encode_frames(np.ones(1, np.float32))


FAULTS: dict[str, Fault] = {
    "closed-before-any-byte": Fault(b"", expect_values(gradient(0))),
    "complete-then-closed": Fault(WIRE, expect_values(FAULT_GRAD)),
    "bytes-after-the-last-frame-stay-unread": Fault(
        WIRE + b"next", expect_values(FAULT_GRAD), left_over=b"next"
    ),
    "closed-in-first-header": Fault(
        WIRE[:7],
        expect(
            FrameError, text="truncated frame header: 7 of 16 bytes", chunk_index=None, offset=0
        ),
    ),
    "closed-in-later-header": Fault(
        WIRE[: OFF1 + 9], expect(IncompleteStreamError, received=1, total=3)
    ),
    "closed-between-frames": Fault(WIRE[:OFF2], expect(IncompleteStreamError, received=2, total=3)),
    "closed-in-first-payload": Fault(
        WIRE[: OFF0 + HEADER_LEN + 3],
        expect(FrameError, text="truncated frame: chunk 0", chunk_index=0, offset=0),
    ),
    "closed-in-later-payload": Fault(
        WIRE[: OFF1 + HEADER_LEN + 100],
        expect(FrameError, text="truncated frame: chunk 1", chunk_index=1, offset=OFF1),
    ),
    "bit-flipped-in-payload": Fault(
        FRAME0 + FLIPPED + FRAME2,
        expect(
            ChecksumMismatchError,
            text="Checksum mismatch on chunk 1",
            chunk_index=1,
            expected=HEADER.unpack_from(FRAME1)[3],
            actual=zlib.crc32(FLIPPED[HEADER_LEN:]),
        ),
    ),
    "payload-not-arrow": Fault(
        FRAME0 + garbage_frame(1, 3) + FRAME2, expect(ArrowIpcError, chunk_index=1)
    ),
    "duplicate-frame": Fault(
        FRAME0 + FRAME0 + FRAME1 + FRAME2,
        expect(FrameError, text="duplicate chunk index 0", chunk_index=0, offset=len(FRAME0)),
    ),
    "inconsistent-total-chunks": Fault(
        FRAME0 + with_header(FRAME1, total=4) + FRAME2,
        expect(FrameError, text="chunks disagree on total_chunks"),
    ),
    "index-out-of-range": Fault(
        FRAME0 + with_header(FRAME1, index=7) + FRAME2,
        expect(FrameError, text="chunk index 7 out of range", chunk_index=7),
    ),
    "payload-len-above-max-payload-len": Fault(
        HEADER.pack(0, 1, U32_MAX, 0),
        expect(FrameError, text="above max_payload_len 268435456", chunk_index=0, offset=0),
        stall=True,  # the receiver must refuse from the header alone, not wait for 4 GiB
        fast=1.0,
    ),
    "payload-len-one-above-a-small-limit": Fault(
        HEADER.pack(0, 1, 1001, 0),
        expect(FrameError, text="1001-byte payload, above max_payload_len 1000", offset=0),
        session={"max_payload_len": 1000},
        stall=True,
        fast=1.0,
    ),
    "payload-len-at-the-limit-then-closed": Fault(
        HEADER.pack(0, 1, 1000, 0) + b"x" * 10,
        expect(FrameError, text="1000-byte payload but only 10 bytes follow", offset=0),
        session={"max_payload_len": 1000},
    ),
    "total-chunks-above-max-gradient-len": Fault(
        with_header(TINY_FRAMES, total=U32_MAX),
        expect(FrameError, text="total_chunks 4294967295 above max_gradient_len 1073741824"),
        forever=True,
        fast=1.0,
    ),
    "values-above-max-gradient-len": Fault(
        WIRE,
        expect(FrameError, text="gradient exceeds max_gradient_len 6: 8 values by chunk 1"),
        session={"max_gradient_len": 6},
    ),
    "frame-above-small-max-payload-len": Fault(
        WIRE,
        expect(FrameError, text="above max_payload_len 100", chunk_index=0, offset=0),
        session={"max_payload_len": 100},
    ),
    "stalled-in-first-header": Fault(
        WIRE[:7],
        expect(StreamTimeoutError, timeout=0.3, received=0, total=None),
        session={"timeout": 0.3},
        stall=True,
        fast=2.0,
    ),
    "stalled-after-a-frame": Fault(
        WIRE[: OFF1 + 20],
        expect(StreamTimeoutError, timeout=0.3, received=1, total=3),
        session={"timeout": 0.3},
        stall=True,
        fast=2.0,
    ),
}


async def feed(peer: socket.socket, fault: Fault) -> None:
    """Write the fault's bytes from a plain (non-blocking) socket with loop.sock_sendall."""
    loop = asyncio.get_running_loop()
    peer.setblocking(False)
    try:
        await loop.sock_sendall(peer, fault.data)
        while fault.forever:
            await loop.sock_sendall(peer, fault.data)
        if not fault.stall:
            peer.close()
            return
        await asyncio.Event().wait()  # stays silent until cancelled
    except OSError:  # forever: the receiver gave up and closed
        pass


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("receiver", IMPL_NAMES)
@pytest.mark.parametrize("name", list(FAULTS))
def test_broken_or_hostile_peer(receiver: str, path: str, name: str) -> None:
    """A raw socket peer writes crafted bytes; the receiver raises what docs/spec/decoding-rules.md
    says
    (the same as decode_frames for a closed peer), promptly, and leaves nothing behind:
    descriptors back to their count, the socket open in blocking mode."""
    mod = need(receiver)
    fault = FAULTS[name]
    rx = mod.GradientStreamSession("rx", 4, **fault.session)

    async def main() -> None:
        await warm_up()
        start = nfd()
        peer, ours = socket.socketpair()
        stream, writer = await wrap_receiver(ours, path)
        feeding = asyncio.ensure_future(feed(peer, fault))
        rss_before = start_peak_rss()
        t0 = time.monotonic()
        result = await async_outcome(rx.receive_from(stream))
        elapsed = time.monotonic() - t0
        rss_growth = peak_rss() - rss_before
        feeding.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await feeding
        fault.check(result)
        if isinstance(result[1], StreamTimeoutError):
            assert isinstance(result[1], TimeoutError)
            assert isinstance(result[1], OSError)
        if fault.fast is not None:
            assert elapsed < fault.fast, f"took {elapsed:.2f} s"
        assert rss_growth < 100 * 2**20, f"RSS grew by {rss_growth / 2**20:.0f} MiB"
        if not isinstance(result[1], StreamTimeoutError):
            # Exactly what decode_frames says about the bytes consumed.
            consumed = fault.data[: len(fault.data) - len(fault.left_over)]
            assert describe(result) == describe(outcome(lambda: rx.decode_frames(consumed)))
        if fault.left_over:
            if writer is None:
                ours.settimeout(2.0)
                assert ours.recv(100) == fault.left_over
                ours.settimeout(None)
            else:
                assert await stream.read() == fault.left_over
        if writer is None:
            check_socket_intact(ours)
        peer.close()
        if writer is not None:
            await close_writer(writer)
        ours.close()
        await fds_back_to(start)

    run(main)


@pytest.mark.parametrize("path", NATIVE_TIMEOUT_PATHS)
def test_timeout_counts_time_without_progress_native_receive(path: str) -> None:
    _timeout_counts_time_without_progress_receive("native", path)


@pytest.mark.parametrize("path", PATHS)
def test_timeout_counts_time_without_progress_reference_receive(path: str) -> None:
    _timeout_counts_time_without_progress_receive("reference", path)


def _timeout_counts_time_without_progress_receive(receiver: str, path: str) -> None:
    """A peer trickling a 1 MiB frame over ~1.2 s, never silent for more than ~50 ms,
    does not trip a 0.5 s timeout: it is time without a byte moving, not per frame."""
    mod = need(receiver)
    tx = gs.GradientStreamSession("tx", 1 << 18)
    grad = gradient(1 << 18, seed=5)
    wire = tx.encode_frames(grad)
    piece = len(wire) // 24 + 1

    def trickle(peer: socket.socket) -> None:
        with contextlib.suppress(OSError):
            for i in range(0, len(wire), piece):
                peer.sendall(wire[i : i + piece])
                time.sleep(0.05)
        peer.close()

    async def main() -> None:
        peer, ours = socket.socketpair()
        peer.settimeout(10)
        thread = threading.Thread(target=trickle, args=(peer,))
        thread.start()
        stream, writer = await wrap_receiver(ours, path)
        try:
            rx = mod.GradientStreamSession("rx", timeout=0.5)
            t0 = time.monotonic()
            got = await rx.receive_from(stream)
            assert time.monotonic() - t0 > 0.5  # the trickle did take longer than timeout
            assert_bit_equal(got, grad)
        finally:
            if writer is not None:
                await close_writer(writer)
            ours.close()
            await asyncio.to_thread(thread.join)

    run(main)


@pytest.mark.parametrize("path", NATIVE_TIMEOUT_PATHS)
def test_timeout_counts_time_without_progress_native_send(path: str) -> None:
    _timeout_counts_time_without_progress_send("native", path)


@pytest.mark.parametrize("path", PATHS)
def test_timeout_counts_time_without_progress_reference_send(path: str) -> None:
    _timeout_counts_time_without_progress_send("reference", path)


def _timeout_counts_time_without_progress_send(sender: str, path: str) -> None:
    """A peer reading 64 KiB every 25 ms (a 2 MiB frame takes ~0.8 s to go) does not
    trip a 0.4 s timeout on the sender."""
    mod = need(sender)
    grad = gradient(1 << 19, seed=6)
    tx = mod.GradientStreamSession("tx", 1 << 19, timeout=0.4)
    expected = tx.encode_frames(grad)

    def slow_reader(peer: socket.socket, into: bytearray) -> None:
        peer.settimeout(10)
        with contextlib.suppress(OSError):
            while data := peer.recv(65536):
                into += data
                time.sleep(0.025)

    async def main() -> None:
        peer, ours = socket.socketpair()
        got = bytearray()
        thread = threading.Thread(target=slow_reader, args=(peer, got))
        thread.start()
        stream, writer = await wrap_sender(ours, path)
        try:
            t0 = time.monotonic()
            assert await tx.stream_to(grad, stream) == 1
            assert time.monotonic() - t0 > 0.4  # the peer did take longer than timeout
        finally:
            if writer is not None:
                await close_writer(writer)
            ours.close()
            await asyncio.to_thread(thread.join)
            peer.close()
        assert bytes(got) == expected

    run(main)


@pytest.mark.parametrize("timeout", [None, 7.5, 0.0])
@pytest.mark.parametrize("receiver", IMPL_NAMES)
def test_socket_mode_is_put_back(receiver: str, timeout: float | None) -> None:
    """Blocking, with a timeout, or non-blocking: the socket's mode after a transfer
    (successful or failed) is the one it had before."""
    mod = need(receiver)
    rx = mod.GradientStreamSession("rx", 4)

    async def main() -> None:
        for data in (WIRE, WIRE[:7]):
            peer, ours = socket.socketpair()
            with peer, ours:
                ours.settimeout(timeout)
                peer.sendall(data)
                peer.close()
                await async_outcome(rx.receive_from(ours))
                check_socket_intact(ours, timeout)

    run(main)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("sender", IMPL_NAMES)
def test_a_peer_that_never_reads_times_the_sender_out(sender: str, path: str) -> None:
    """stream_to a peer that reads nothing, with timeout=0.3: StreamTimeoutError (a
    TimeoutError) with the chunk counts, within 2 s; the socket open and blocking."""
    mod = need(sender)
    grad = gradient(3_000_000, seed=13)
    tx = mod.GradientStreamSession("tx", timeout=0.3)

    async def main() -> None:
        await warm_up()
        start = nfd()
        peer, ours = socket.socketpair()
        stream, writer = await wrap_sender(ours, path)
        t0 = time.monotonic()
        with pytest.raises(StreamTimeoutError) as info:
            await tx.stream_to(grad, stream)
        assert time.monotonic() - t0 < 2.0
        exc = info.value
        assert isinstance(exc, TimeoutError) and isinstance(exc, GradientStreamError)
        assert exc.timeout == 0.3
        assert exc.total == chunks_of(len(grad))
        assert 0 <= exc.received < exc.total
        if writer is None:
            check_socket_intact(ours)
        else:
            await close_writer(writer, abort=True)
        peer.close()
        ours.close()
        await fds_back_to(start)

    run(main)


@pytest.mark.parametrize("impl_name", IMPL_NAMES)
def test_full_duplex_on_one_socket(impl_name: str) -> None:
    """A send and a receive at once on the same socket, on both ends (two peers
    exchanging gradients): both arrive; a native transfer leaves the caller's blocking
    sockets blocking throughout (it never changes the mode of the open file the caller
    shares), and the reference puts them back to blocking once the last transfer ends."""
    mod = need(impl_name)
    s = mod.GradientStreamSession("duplex", timeout=10)
    # `medium` is past the native socket path's small-gradient thresholds
    # (docs/spec/decoding-rules.md
    # "Streaming"): its send and receive run in tokio, as `big`'s do.
    small, medium, big = gradient(10, seed=14), gradient(40_000), gradient(2_000_000, seed=15)
    wire = s.encode_frames(big)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        a, b = socket.socketpair()
        with a, b:
            progress = mod.TransferProgress()
            receiving = asyncio.ensure_future(s.receive_from(a, progress=progress))
            await asyncio.sleep(0.05)
            # The first bytes of a large gradient: the native receive goes on in tokio.
            b.sendall(wire[:100_000])
            native = impl_name == "native"
            for _ in range(500):
                if not native or progress.bytes > 0:
                    break
                await asyncio.sleep(0.01)
            assert not native or progress.bytes > 0, "the receive never started"
            # The send on a ends long before the receive on a; the receive still waits
            # for the rest without the descriptor being made non-blocking under the caller.
            sent, back = await asyncio.gather(s.stream_to(medium, a), s.receive_from(b))
            assert sent == 1
            assert_bit_equal(back, medium)
            await asyncio.sleep(0.05)
            assert not receiving.done()
            # (The reference reads through the event loop's sock_recv, which needs the
            # descriptor non-blocking while it runs: only the native side keeps the mode.)
            assert not (native and _fd_nonblocking(a)), "a transfer changed the socket's mode"
            await loop.run_in_executor(None, b.sendall, wire[100_000:])
            assert_bit_equal(await receiving, big)
            got = await asyncio.gather(
                s.receive_from(a), s.stream_to(big, b), s.receive_from(b), s.stream_to(small, a)
            )
            assert_bit_equal(got[0], big)
            assert_bit_equal(got[2], small)
            check_socket_intact(a)
            check_socket_intact(b)
            assert not _fd_nonblocking(a) and not _fd_nonblocking(b)

    run(main)


def _fd_nonblocking(sock: socket.socket) -> bool:
    return bool(fcntl.fcntl(sock.fileno(), fcntl.F_GETFL) & os.O_NONBLOCK)

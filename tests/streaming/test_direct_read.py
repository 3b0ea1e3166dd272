"""The socket receive's direct read (docs/guides/buffers.md, "Performance"): a payload
that matches a template has its values read from the socket straight into ``out=`` and
checked there. Whatever arrives, ``receive_from(sock, out=)`` ends as ``decode_frames(wire,
out=)`` does on the same bytes (the same values, the same error and text), in both
layouts, sealed or not, whatever the sizes around the chunk boundaries and however the
bytes are cut into writes; after a failed CRC the call raises and ``out=`` holds what
docs/guides/buffers.md says. Connections (plain and TLS) receive through the same read."""

from __future__ import annotations

import asyncio
import socket
import threading
import zlib
from typing import Any, Literal

import numpy as np
import pytest

import gradstream as gs
from gradstream.errors import ChecksumMismatchError, GradientStreamError
from support.aio import run
from support.certs import Certificates
from support.connections import LOCAL

CHUNK = 64
HEADER = 16
Layout = Literal["seed", "compact"]
LAYOUTS: tuple[Layout, ...] = ("seed", "compact")


def session(layout: Layout, seal: bool = False) -> gs.GradientStreamSession:
    return gs.GradientStreamSession("direct", chunk_size=CHUNK, layout=layout, seal=seal)


def values(n: int) -> np.ndarray:
    """Every bit pattern spread out, NaNs included: values travel as raw bits."""
    bits = (np.arange(n, dtype=np.uint64) * 2_654_435_761) % 2**32
    return bits.astype(np.uint32).view(np.float32)


def frames(wire: bytes) -> list[tuple[int, int]]:
    """(start, payload length) of each frame in ``wire``."""
    out, at = [], 0
    while at < len(wire):
        length = int.from_bytes(wire[at + 8 : at + 12], "little")
        out.append((at, length))
        at += HEADER + length
    return out


def outcome(result: Any) -> tuple[str, str]:
    """An error's class and text, or "ok"."""
    if isinstance(result, BaseException):
        return type(result).__name__, str(result)
    return "ok", ""


def reference(s: gs.GradientStreamSession, wire: bytes, room: int) -> tuple[Any, np.ndarray]:
    """What decode_frames (the whole-payload read) gives into an out= of ``room``."""
    out = np.full(room, np.nan, np.float32)
    try:
        s.decode_frames(wire, out=out)
    except GradientStreamError as e:
        return e, out
    return None, out


def received(
    s: gs.GradientStreamSession, wire: bytes, room: int, pieces: tuple[int, ...] = ()
) -> tuple[Any, np.ndarray]:
    """``wire`` sent over a socketpair (in writes of the sizes in ``pieces``, in turn,
    when given) and then closed, received into an out= of ``room`` values."""
    out = np.full(room, np.nan, np.float32)
    a, b = socket.socketpair()

    def feed() -> None:
        with a:
            a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            at, turn = 0, 0
            while at < len(wire):
                step = pieces[turn % len(pieces)] if pieces else len(wire)
                try:
                    a.sendall(wire[at : at + step])
                except OSError:
                    return  # the receiver stopped at an error and closed its end
                at, turn = at + step, turn + 1

    sender = threading.Thread(target=feed)
    sender.start()
    try:
        run_result: Any = run(lambda: _receive(s, b, out))
    finally:
        b.close()
        sender.join()
    return run_result, out


async def _receive(s: gs.GradientStreamSession, sock: socket.socket, out: np.ndarray) -> Any:
    try:
        got = await s.receive_from(sock, out=out)
    except GradientStreamError as e:
        return e
    assert got is out
    return None


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("seal", [False, True])
@pytest.mark.parametrize("n", [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 4 * CHUNK, 4 * CHUNK + 3])
def test_receives_what_decode_frames_gives_at_sizes_around_the_chunks(
    layout: Layout, seal: bool, n: int
) -> None:
    s = session(layout, seal)
    g = values(n)
    wire = s.encode_frames(g)
    for room in sorted({n, max(n - 1, 0), n + 1}):
        want, want_out = reference(s, wire, room)
        for pieces in [(), (1, 7, 4099), (HEADER + 3, 333)]:
            got, out = received(s, wire, room, pieces)
            assert outcome(got) == outcome(want), (room, pieces)
            if want is None:
                assert same(out, want_out) and (room != n or same(out, g))


def corrupted(wire: bytes, at: int, reseal: bool) -> bytes:
    """``wire`` with byte ``at`` flipped; with ``reseal``, its frame's header CRC made
    to agree (so that the payload's reader, not the CRC, decides)."""
    bad = bytearray(wire)
    bad[at] ^= 0x40
    if reseal:
        for start, length in frames(wire):
            if start + HEADER <= at < start + HEADER + length:
                crc = zlib.crc32(bad[start + HEADER : start + HEADER + length])
                bad[start + 12 : start + 16] = crc.to_bytes(4, "little")
    return bytes(bad)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("reseal", [False, True])
def test_a_corrupt_byte_in_a_later_frame_ends_as_decode_frames_ends(
    layout: Layout, reseal: bool
) -> None:
    s = session(layout, seal=True)
    g = values(3 * CHUNK)
    wire = s.encode_frames(g)
    (start, length) = frames(wire)[1]
    # Every header byte and a spread of payload bytes: the constant bytes before the
    # values, the values, the footer and the seal's two copies.
    spots = list(range(start, start + HEADER)) + list(
        range(start + HEADER, start + HEADER + length, 5)
    )
    for at in spots:
        bad = corrupted(wire, at, reseal)
        want, want_out = reference(s, bad, g.size)
        got, out = received(s, bad, g.size, (1000,))
        assert outcome(got) == outcome(want), at
        if want is None:
            assert same(out, want_out), at


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_failed_crc_raises_and_out_holds_what_the_readme_says(layout: Layout) -> None:
    # Chunks of 65536 values: the gradient is larger than what the socket path's small
    # transfers peek at (256 KiB), so it takes the stream receiver, which reads chunk 1
    # in place (a small one, taken whole from the peek, leaves out= as it was there).
    chunk = 65536
    s = gs.GradientStreamSession("direct", chunk_size=chunk, layout=layout)
    g = values(3 * chunk)
    wire = s.encode_frames(g)
    start, _ = frames(wire)[1]
    # The last value of chunk 1, found by its bits (unique in these values).
    last = g[2 * chunk - 1].tobytes()
    at = wire.index(last, start + HEADER) + 3
    bad = corrupted(wire, at, reseal=False)
    got, out = received(s, bad, g.size)
    assert isinstance(got, ChecksumMismatchError) and got.chunk_index == 1
    assert outcome(got) == outcome(reference(s, bad, g.size)[0])
    # The chunks before are in; where chunk 1 goes, the bytes as they came (read in
    # place, then refused); after it, what was there before.
    assert same(out[:chunk], g[:chunk])
    flipped = bytearray(last)
    flipped[3] ^= 0x40
    assert out[2 * chunk - 1].tobytes() == bytes(flipped)
    assert np.isnan(out[2 * chunk :]).all()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_peer_that_closes_inside_a_later_frame(layout: Layout) -> None:
    s = session(layout)
    g = values(3 * CHUNK + 1)
    wire = s.encode_frames(g)
    start, length = frames(wire)[1]
    for cut in [start + 1, start + HEADER, start + HEADER + 7, start + HEADER + length - 1]:
        want, _ = reference(s, wire[:cut], g.size)
        got, _ = received(s, wire[:cut], g.size, (5, 11))
        assert outcome(got) == outcome(want) != ("ok", ""), cut


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tls", [False, True])
def test_connections_receive_into_out_in_both_layouts(
    layout: Layout, tls: bool, certs: Certificates
) -> None:
    s = session(layout)
    grads = [values(5 * CHUNK + 9), values(5 * CHUNK + 9)[::-1].copy(), values(1)]
    listen: dict[str, Any] = {"tls": certs.server} if tls else {}
    connect: dict[str, Any] = {"tls": certs.client} if tls else {}

    async def main() -> list[np.ndarray]:
        async with await gs.listen(LOCAL, session=s, **listen) as listener:

            async def receive() -> list[np.ndarray]:
                got = []
                async with await listener.accept() as conn:
                    for g in grads:
                        out = np.full(g.size, np.nan, np.float32)
                        assert await conn.recv(out=out) is out
                        got.append(out)
                return got

            receiving = asyncio.create_task(receive())
            async with await gs.connect(listener.address, session=s, **connect) as conn:
                for g in grads:
                    await conn.send(g)
            return await receiving

    for got, g in zip(run(main), grads, strict=True):
        assert same(got, g)

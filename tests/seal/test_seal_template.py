"""The native sealed payloads from its three writers are one payload: ``encode_frames``
(the template, both seal copies patched in place), the socket sender (the template's
pieces and the seal, one vectored write) and the asyncio-streams sender (the Arrow writer,
chunk by chunk). The transfer ids differ (one per gradient), so the id is put back before
the bytes are compared; each CRC is checked against zlib's. The settings around the seal:
the keyword, the property, frames_len, and the unsealed default.
"""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest

import gradstream as gs
from support.aio import read_until_eof, run
from support.frames import join_frames, split_frames
from support.impls import IMPL_NAMES, LAYOUTS, load_impl
from support.seals import gradient, sealed_session, transfer_of


def _with_transfer(wire: bytes, old: str, new: str) -> bytes:
    """The frames with the transfer id ``old`` (hex) replaced by ``new`` in every payload,
    and their CRCs recomputed."""
    parts = [(i, t, p.replace(old.encode(), new.encode())) for i, t, p in split_frames(wire)]
    return join_frames(parts)


async def _sent_bytes(s: gs.GradientStreamSession, g: np.ndarray, path: str) -> bytes:
    """What ``stream_to`` writes, over a socket or an asyncio StreamWriter."""
    a, b = socket.socketpair()
    with a, b:
        reading = asyncio.ensure_future(read_until_eof(b))
        if path == "socket":
            await s.stream_to(g, a)
            a.shutdown(socket.SHUT_WR)
        else:
            _, writer = await asyncio.open_connection(sock=a)
            await s.stream_to(g, writer)
            writer.close()
            await writer.wait_closed()
        return await reading


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("n", "chunk_size"), [(30, 7), (1, 1), (200_000, 65_536)])
def test_a_sealed_template_payload_is_the_arrow_writers(
    layout: str, n: int, chunk_size: int
) -> None:
    s = gs.GradientStreamSession("t", chunk_size, layout=layout, seal=True)
    g = gradient(n, seed=n)
    wire = s.encode_frames(g)
    # Each header's CRC is the payload's (join_frames recomputes them with zlib).
    assert join_frames(split_frames(wire)) == wire
    ours = transfer_of(wire)
    for path in ("socket", "streams"):
        sent = run(lambda path=path: _sent_bytes(s, g, path))
        theirs = transfer_of(sent)
        assert theirs != ours  # a fresh id per gradient
        assert join_frames(split_frames(sent)) == sent
        assert _with_transfer(sent, theirs, ours) == wire, path
    assert len(wire) == s.frames_len(n)


@pytest.mark.parametrize("name", IMPL_NAMES)
def test_the_seal_keyword_and_what_it_changes(name: str) -> None:
    impl = load_impl(name)
    plain, sealed = sealed_session(impl), sealed_session(impl, seal=True)
    assert (plain.seal, sealed.seal) == (False, True)
    assert repr(sealed).endswith("seal=True)")
    assert sealed.with_compression(True).seal is True
    with pytest.raises(TypeError, match=r"^seal must be a bool, got int$"):
        sealed_session(impl, seal=1)
    with pytest.raises(TypeError, match=r"^seal must be a bool, got NoneType$"):
        sealed_session(impl, seal=None)
    g = gradient(9, seed=1)
    # Sealed frames are longer by a fixed amount a chunk, which frames_len knows.
    assert len(sealed.encode_frames(g)) == sealed.frames_len(9) > plain.frames_len(9)
    # Two gradients, two transfers; the default stays the original's bytes.
    assert transfer_of(sealed.encode_frames(g)) != transfer_of(sealed.encode_frames(g))
    assert plain.encode_frames(g) == sealed_session(impl).encode_frames(g)
    out = bytearray(sealed.frames_len(9))
    assert sealed.encode_frames(g, out=out) == len(out)
    assert np.array_equal(sealed.decode_frames(bytes(out)).view(np.uint32), g.view(np.uint32))

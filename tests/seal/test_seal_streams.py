"""Sealed transfers over real connections (sockets and asyncio streams, both
implementations on either end): what a sealing session sends arrives, gradient after
gradient and set after set; a hostile peer's swapped, spliced or unsealed frames are
refused by a sealing receiver as decode_frames refuses them, with the same error, and its
swapped or spliced sealed frames by a receiver without ``seal`` too; and the
reference's seams for a connection seal with, and expect, an id of their own.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

import gradstream.reference as ref
from gradstream.errors import FrameError
from support.aio import receive_bytes, run, socketpair_ends
from support.frames import split_frames
from support.impls import IMPL_NAMES, PAIR_IDS, PAIRS, PATHS, load_impl
from support.seals import (
    bit_equal,
    error_fields,
    frames,
    gradient,
    lone_seal_text,
    outcome,
    seal_of,
    sealed_session,
    splice,
    swap_indices,
)
from support.tensor_sets import receive_bytes as receive_set_bytes


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_sealed_gradients_and_sets_cross_a_connection(pair: tuple[str, str], path: str) -> None:
    tx = sealed_session(load_impl(pair[0]), 5, seal=True, layout="compact")
    rx = sealed_session(load_impl(pair[1]), 7, seal=True)
    grads = [gradient(n, seed=n) for n in (0, 1, 23, 23)]
    tensors = {"a": gradient(12, 1).reshape(3, 4), "b": gradient(12, 2).reshape(4, 3)}

    async def main() -> None:
        async with socketpair_ends(path) as (a, b):

            async def send_all() -> None:
                for g in grads:
                    await tx.stream_to(g, a)
                await tx.stream_tensors(tensors, a)

            async def receive_all() -> list[Any]:
                got = [await rx.receive_from(b) for _ in grads]
                return [*got, await rx.receive_tensors(b)]

            _, got = await asyncio.gather(send_all(), receive_all())
        for want, back in zip(grads, got, strict=False):
            assert bit_equal(back, want)
        assert list(got[-1]) == ["a", "b"]
        assert all(bit_equal(got[-1][k], tensors[k]) for k in tensors)

    run(main)


@pytest.mark.parametrize("path", PATHS)
def test_a_hostile_peers_frames_fail_alike_over_every_path(path: str) -> None:
    sender = sealed_session(ref, 4, seal=True)
    g = gradient(10, seed=3)
    ours, theirs = sender.encode_frames(g), sender.encode_frames(g)
    plain = sealed_session(ref, 4).encode_frames(g)
    attacks = [swap_indices(ours), splice(ours, theirs, 2), plain, splice(ours, plain, 1)]
    for k, data in enumerate(attacks):
        expected: dict[bool, Any] = {}
        # Without seal=True, the unsealed gradient is taken; the sealed chunks swapped or
        # spliced are refused in the seal=True receiver's words.
        for seal in (True, False) if k != 2 else (True,):
            for name in IMPL_NAMES:
                rx = sealed_session(load_impl(name), 4, seal=seal)
                in_memory = outcome(lambda rx=rx, data=data: rx.decode_frames(data))
                streamed = run(lambda rx=rx, data=data: receive_bytes(rx, data, path))
                assert type(in_memory) is FrameError
                # decode_frames and the stream receiver refuse alike, and so do both sides.
                assert error_fields(streamed) == error_fields(in_memory)
                expected.setdefault(seal, error_fields(in_memory))
                assert error_fields(in_memory) == expected[seal]
        if k < 2:
            assert expected[False] == expected[True]


@pytest.mark.parametrize("path", PATHS)
def test_a_set_spliced_over_a_connection_fails_alike(path: str) -> None:
    tensors = {"x": gradient(8, 1).reshape(2, 4), "y": gradient(8, 2).reshape(2, 4)}
    sender = sealed_session(ref, 4, seal=True)
    ours, theirs = sender.encode_tensors(tensors), sender.encode_tensors(tensors)
    # The manifest and x of one set, y of the other (2 frames each).
    data = b"".join(frames(ours)[:3] + frames(theirs)[3:])
    described = []
    for name in IMPL_NAMES:
        for seal in (True, False):
            rx = sealed_session(load_impl(name), 4, seal=seal)
            got = run(lambda rx=rx: receive_set_bytes(rx, data, path))
            assert type(got) is FrameError and "expected transfer" in got.detail
            described.append(error_fields(got))
    assert all(d == described[0] for d in described)


def test_the_references_connection_seams_seal_with_the_id_they_are_given() -> None:
    ours, other = bytes(range(16)), bytes(range(1, 17))
    s = sealed_session(ref, 4)  # seal=False: the seams seal whatever the setting
    g = gradient(9, seed=4)
    wire = s._encode_frames_sealed(g, ours)
    assert [seal_of(p) for _, _, p in split_frames(wire)] == [
        lone_seal_text(ours, k, 3) for k in range(3)
    ]
    assert bit_equal(s._decode_frames_sealed(wire, ours), g)
    got = outcome(lambda: s._decode_frames_sealed(wire, other))
    assert type(got) is FrameError
    assert (
        got.detail
        == f"chunk 0 is sealed for transfer {ours.hex()}, expected transfer {other.hex()}"
    )
    # Native receivers, sealing or not, read them.
    for name in IMPL_NAMES:
        for seal in (False, True):
            native = sealed_session(load_impl(name), 4, seal=seal)
            assert bit_equal(native.decode_frames(wire), g)
    with pytest.raises(ValueError, match="a transfer id is 16 bytes, not 15"):
        s._encode_frames_sealed(g, ours[:15])
    with pytest.raises(TypeError, match="a transfer id is 16 bytes, not str"):
        s._decode_frames_sealed(wire, "00" * 16)
    tensors = {"w": gradient(5, 5)}
    set_wire = s._encode_tensors_sealed(tensors, ours)
    assert bit_equal(s._decode_tensors_sealed(set_wire, ours)["w"], tensors["w"])
    got = outcome(lambda: s._decode_tensors_sealed(set_wire, other))
    assert type(got) is FrameError and got.chunk_index == 0

    async def main() -> None:
        async with socketpair_ends("streams") as (a, b):
            sent, back = await asyncio.gather(
                s._stream_to_sealed(g, a, ours), s._receive_from_sealed(b, ours)
            )
            assert sent == 3 and bit_equal(back, g)
            sent, back = await asyncio.gather(
                s._stream_tensors_sealed(tensors, a, ours), s._receive_tensors_sealed(b, ours)
            )
            assert sent == 3 and bit_equal(back["w"], tensors["w"])
            # The next transfer under another id: refused, as a replay would be.
            _, refused = await asyncio.gather(
                s._stream_to_sealed(g, a, ours),
                outcome_of(s._receive_from_sealed(b, other)),
            )
            assert type(refused) is FrameError and "expected transfer" in refused.detail
        async with socketpair_ends("socket") as (a, b):
            a.close()
            assert await s._receive_from_sealed(b, ours) is None  # closed before a byte

    run(main)


async def outcome_of(awaitable: Any) -> Any:
    try:
        return await awaitable
    except FrameError as exc:
        return exc


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_receive_iter_holds_each_gradient_to_its_own_transfer(
    pair: tuple[str, str], path: str
) -> None:
    tx = sealed_session(load_impl(pair[0]), 4, seal=True)
    rx = sealed_session(load_impl(pair[1]), 4, seal=True)
    first, second = gradient(9, 1), gradient(3, 2)
    # Two sealed gradients (two ids: each is its own transfer), then an unsealed one.
    data = tx.encode_frames(first) + tx.encode_frames(second)
    data += sealed_session(load_impl(pair[0]), 4).encode_frames(first)

    async def main() -> tuple[list[Any], Any]:
        got: list[Any] = []
        async with socketpair_ends(path) as (a, b):
            if path == "socket":
                a.sendall(data)
                a.shutdown(socket.SHUT_WR)
            else:
                a.write(data)
                await a.drain()
                a.write_eof()
            try:
                async for g in rx.receive_iter(b):
                    got.append(g)
            except FrameError as exc:
                return got, exc
        return got, None

    got, error = run(main)
    assert [bit_equal(g, w) for g, w in zip(got, (first, second), strict=True)] == [True, True]
    assert type(error) is FrameError
    assert error.detail == "chunk 0 is not sealed; this receiver expects sealed chunks"

"""The defaults that hand back what was sent (docs/guides/connections.md, "Defaults"): a
session setting left unset takes the transport's default, one set explicitly always
wins. On a gradstream connection the unset layout, keep_shape and keep_dtype are
compact, True and True, so ``conn.send(a); conn.recv()`` is ``a`` (values, dtype,
shape); bare frames and ``protocol="seed"`` keep the original's, byte for byte."""

from __future__ import annotations

import asyncio
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import gradstream as gs
from gradstream.ray import RaySettings
from support.connections import LOCAL, read_to_end, run

SENT = [
    np.arange(12, dtype=np.float32).reshape(3, 4),
    np.linspace(-1, 1, 3000, dtype=np.float64).reshape(30, 100),
    (np.arange(24, dtype=np.float16) - 3).reshape(2, 3, 4),
    np.arange(-8, 8, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(4, 2, 2),
    np.array(2.5, np.float32),  # 0-d
    np.zeros((0, 3), np.float64),
    np.arange(200_000, dtype=np.float32).reshape(400, 500),  # several chunks
]


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(bits(a), bits(b))


async def round_trip(
    gradients: list[Any],
    *,
    client: gs.GradientStreamSession | None = None,
    server: gs.GradientStreamSession | None = None,
    protocol: str = "gradstream",
) -> tuple[list[np.ndarray], list[int]]:
    """What a listener's connection receives of ``gradients`` sent by ``connect``, and
    the wire bytes of each send."""
    async with await gs.listen(LOCAL, session=server, protocol=protocol) as listener:
        accepted = asyncio.create_task(listener.accept())
        async with await gs.connect(listener.address, session=client, protocol=protocol) as c:
            async with await accepted as conn:
                got, wire = [], []
                for gradient in gradients:
                    progress = gs.TransferProgress()
                    send = asyncio.create_task(c.send(gradient, progress=progress))
                    recv = asyncio.create_task(conn.recv())
                    await asyncio.wait({send, recv}, return_when=asyncio.FIRST_EXCEPTION)
                    if send.done() and send.exception() is not None:
                        recv.cancel()
                        await asyncio.wait({recv})
                        await send  # raises
                    got.append(await recv)
                    await send
                    wire.append(progress.bytes)
    return got, wire


def test_a_connection_hands_back_what_was_sent() -> None:
    got, _ = run(lambda: round_trip(SENT))
    for a, b in zip(SENT, got, strict=True):
        assert same(a, b), (a.dtype, a.shape, b.dtype, b.shape)


def test_the_connection_default_is_the_compact_layout() -> None:
    a = np.ones(100_000, np.float32)
    (_,), (compact,) = run(lambda: round_trip([a]))
    (_,), (seed,) = run(lambda: round_trip([a], client=gs.GradientStreamSession(layout="seed")))
    # The compact layout carries the values alone; the seed one an index beside them.
    assert a.nbytes < compact < 1.01 * a.nbytes
    assert seed > 1.9 * a.nbytes


def test_a_session_given_with_some_settings_keeps_the_connection_defaults_for_the_rest() -> None:
    s = gs.GradientStreamSession(chunk_size=1000)
    a = np.arange(5000, dtype=np.float64).reshape(50, 100)
    (b,), (wire,) = run(lambda: round_trip([a], client=s, server=s))
    assert same(a, b)
    # The connection's frames are those of the explicit defaults (sealed, as a
    # connection seals every transfer).
    twin = gs.GradientStreamSession(
        chunk_size=1000, layout="compact", keep_shape=True, keep_dtype=True, seal=True
    )
    assert wire == len(twin.encode_frames(a))
    # The session itself is unchanged: its own frames are still the original's.
    assert (s.layout, s.keep_shape, s.keep_dtype) == ("seed", False, False)


def test_a_setting_given_explicitly_wins_on_a_connection() -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    flat = gs.GradientStreamSession(keep_shape=False)
    (b,), _ = run(lambda: round_trip([a], client=flat))
    assert b.shape == (12,) and np.array_equal(b, a.reshape(-1))

    (_,), (wire,) = run(lambda: round_trip([a], client=gs.GradientStreamSession(layout="seed")))
    (_,), (compact_wire,) = run(lambda: round_trip([a]))
    assert wire > compact_wire

    strict = gs.GradientStreamSession(keep_dtype=False)
    with pytest.raises(TypeError, match="float64"):
        run(lambda: round_trip([a.astype(np.float64)], client=strict))
    # Explicitly the same as the default: the same frames.
    explicit = gs.GradientStreamSession(layout="compact", keep_shape=True, keep_dtype=True)
    (b,), (explicit_wire,) = run(lambda: round_trip([a], client=explicit))
    assert same(a, b) and explicit_wire == compact_wire


def test_wire_dtype_on_a_connection_hands_back_the_dtype_sent() -> None:
    # keep_dtype is unset: on a connection it is True, so the receiver gets the sender's
    # dtype back, rounded through the wire dtype.
    a = np.linspace(-1, 1, 1000, dtype=np.float32).reshape(10, 100)
    (b,), _ = run(lambda: round_trip([a], client=gs.GradientStreamSession(wire_dtype="bfloat16")))
    assert b.dtype == np.float32 and b.shape == (10, 100)
    assert np.allclose(a, b, rtol=2**-8, atol=0)


def test_seed_protocol_keeps_the_original_defaults() -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    (b,), (wire,) = run(lambda: round_trip([a], protocol="seed"))
    assert b.dtype == np.float32 and b.shape == (12,)
    assert wire == gs.GradientStreamSession().frames_len(12)
    with pytest.raises(TypeError, match="float64"):
        run(lambda: round_trip([a.astype(np.float64)], protocol="seed"))


def test_seed_protocol_frames_are_byte_identical_to_a_default_session() -> None:
    a = np.arange(70_000, dtype=np.float32).reshape(7, 10_000)

    async def main() -> bytes:
        received: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

        async def take(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            received.set_result(await read_to_end(reader))
            writer.close()

        server = await asyncio.start_server(take, "127.0.0.1", 0)
        async with server:
            address = server.sockets[0].getsockname()[:2]
            async with await gs.connect(address, protocol="seed") as conn:
                await conn.send(a)
            return await received

    assert run(main) == gs.GradientStreamSession().encode_frames(a)


def test_tensor_sets_and_serve_follow_the_same_defaults() -> None:
    a = np.arange(6, dtype=np.float16).reshape(2, 3)

    async def main() -> np.ndarray:
        got: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()

        async def handler(conn: Any) -> None:
            got.set_result(await conn.recv())

        async with await gs.serve(LOCAL, handler) as server:
            async with await gs.connect(server.address) as conn:
                await conn.send(a)
            return await got

    assert same(a, run(main))


def test_ray_settings_inherit_the_connection_defaults() -> None:
    s = RaySettings.checked().session()
    a = np.arange(6, dtype=np.float64).reshape(3, 2)
    (b,), (wire,) = run(lambda: round_trip([a], client=s, server=s))
    assert same(a, b) and wire < 1.5 * a.nbytes + 1000
    # An explicit layout still wins.
    seed = RaySettings.checked(layout="seed")
    assert seed.layout == "seed" and seed.session().layout == "seed"

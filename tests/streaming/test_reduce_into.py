"""Reducing while receiving (``reduce_into=acc, op="sum"``; docs/spec/wire-format.md "Reducing while
receiving"): the gradient is added into a float32 array instead of stored (the other
accumulator dtypes: test_reduce_dtypes.py), by
``decode_frames``, ``receive_from`` (a socket, small or large; asyncio streams) and
``Connection.recv``, in both implementations. Each value is added once, in float32,
whatever the gradient's dtype, so the result is ``acc + g.astype(float32)`` bit for bit
whatever order the chunks arrive in; several gradients added one after another in rank
order give numpy's sum in that order. Wrong arguments are refused before any byte is read.
"""

from __future__ import annotations

import asyncio
import random
import socket
from types import ModuleType
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gradstream as native
import gradstream.reference as reference
from gradstream.errors import GradientSizeError, SettingError
from support.connections import LOCAL, run
from support.frames import join_frames, split_frames
from support.values import float32_bits as bits

IMPLS = {"native": native, "reference": reference}


@pytest.fixture(params=sorted(IMPLS))
def gs(request: pytest.FixtureRequest) -> ModuleType:
    return IMPLS[request.param]


def grad(n: int, seed: int, dtype: Any = np.float32) -> np.ndarray:
    values = np.random.default_rng(seed).standard_normal(n) * 1e3
    return values.astype(dtype)


def expected_sum(acc: np.ndarray, *grads: np.ndarray) -> np.ndarray:
    """numpy's float32 sum in the order given: ((acc + g0) + g1) + ..."""
    total = acc.copy()
    for g in grads:
        total += np.asarray(g).reshape(total.shape).astype(np.float32)
    return total


@pytest.mark.parametrize("layout", ["seed", "compact"])
@pytest.mark.parametrize("n", [1, 7, 64, 65, 1000])
def test_decode_frames_adds_the_gradient_in_any_chunk_order(
    gs: ModuleType, layout: str, n: int
) -> None:
    session = gs.GradientStreamSession("sum", 16, layout=layout)
    g = grad(n, n)
    acc = grad(n, n + 1)
    start = acc.copy()
    frames = split_frames(session.encode_frames(g))
    random.Random(n).shuffle(frames)
    got = session.decode_frames(join_frames(frames), reduce_into=acc)
    assert got is acc
    assert np.array_equal(bits(acc), bits(expected_sum(start, g)))


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=200),
    st.integers(1, 40),
)
def test_native_and_reference_sums_agree_bit_for_bit(values: list[float], chunk: int) -> None:
    g = np.array(values, np.float32)
    acc = np.array(values[::-1], np.float32)
    wire = native.GradientStreamSession("sum", chunk).encode_frames(g)
    sums = []
    for gs in (native, reference):
        a = acc.copy()
        gs.GradientStreamSession("sum", chunk).decode_frames(wire, reduce_into=a)
        sums.append(bits(a))
    assert np.array_equal(sums[0], sums[1])
    assert np.array_equal(sums[0], bits(expected_sum(acc, g)))


@pytest.mark.parametrize(
    ("dtype", "settings_"),
    [
        (ml_dtypes.bfloat16, {"keep_dtype": True}),
        (np.float16, {"keep_dtype": True}),
        (np.float64, {"keep_dtype": True}),
        (np.float32, {"wire_dtype": "bfloat16"}),
    ],
)
def test_any_wire_dtype_adds_into_float32(
    gs: ModuleType, dtype: Any, settings_: dict[str, Any]
) -> None:
    sender = native.GradientStreamSession("sum", 100, **settings_)
    g = grad(333, 3, dtype)
    wire = sender.encode_frames(g)
    plain = gs.GradientStreamSession("sum", 100).decode_frames(wire)
    acc = grad(333, 4)
    start = acc.copy()
    gs.GradientStreamSession("sum", 100).decode_frames(wire, reduce_into=acc)
    assert np.array_equal(bits(acc), bits(expected_sum(start, plain)))


def test_the_accumulator_keeps_its_shape(gs: ModuleType) -> None:
    session = gs.GradientStreamSession("sum", 5)
    g = grad(12, 5)
    acc = np.ones((3, 4), np.float32)
    got = session.decode_frames(session.encode_frames(g), reduce_into=acc)
    assert got is acc and acc.shape == (3, 4)
    assert np.array_equal(bits(acc), bits(expected_sum(np.ones((3, 4), np.float32), g)))


@pytest.mark.parametrize("size", [9, 11, 0])
def test_a_gradient_of_another_size_is_a_size_error(gs: ModuleType, size: int) -> None:
    session = gs.GradientStreamSession("sum", 4)
    wire = session.encode_frames(grad(10, 6))
    with pytest.raises(GradientSizeError) as caught:
        session.decode_frames(wire, reduce_into=np.zeros(size, np.float32))
    assert caught.value.expected == size


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"reduce_into": np.zeros(4, np.float32), "op": "mean"}, SettingError),
        ({"reduce_into": np.zeros(4, np.float32), "out": np.zeros(4, np.float32)}, ValueError),
        ({"reduce_into": np.zeros(4, np.int32)}, TypeError),
        ({"reduce_into": np.zeros(8, np.float32)[::2]}, TypeError),
        ({"reduce_into": [0.0, 0.0, 0.0, 0.0]}, TypeError),
        ({"reduce_into": np.zeros(4, ">f4")}, TypeError),
        ({"reduce_into": np.frombuffer(bytearray(17), np.float32, 4, 1)}, TypeError),
    ],
)
def test_wrong_arguments_are_refused_before_any_byte(
    gs: ModuleType, kwargs: dict[str, Any], error: type[Exception]
) -> None:
    session = gs.GradientStreamSession("sum", 4)
    wire = session.encode_frames(grad(4, 7))
    with pytest.raises(error):
        session.decode_frames(wire, **kwargs)
    read_only = np.zeros(4, np.float32)
    read_only.flags.writeable = False
    with pytest.raises(TypeError):
        session.decode_frames(wire, reduce_into=read_only)
    assert not read_only.any()

    async def over_a_socket() -> None:
        a, b = socket.socketpair()
        with a, b:
            with pytest.raises(error):
                await session.receive_from(b, **kwargs)

    asyncio.run(over_a_socket())


@pytest.mark.parametrize("n", [1000, 300_000])
def test_receive_from_a_socket_adds_workers_in_rank_order(gs: ModuleType, n: int) -> None:
    """Three workers' gradients added one after another into one accumulator: numpy's
    float32 sum in rank order, bit for bit (a small gradient takes the caller's-thread
    path, a large one tokio's)."""
    grads = [grad(n, 10 + r) for r in range(3)]
    acc = np.zeros(n, np.float32)
    sender = native.GradientStreamSession("sum", 65536)
    receiver = gs.GradientStreamSession("sum", 65536)

    async def main() -> None:
        pairs = [socket.socketpair() for _ in grads]
        try:
            for (a, b), g in zip(pairs, grads, strict=True):
                sending = asyncio.ensure_future(sender.stream_to(g, a))
                got = await receiver.receive_from(b, reduce_into=acc)
                await sending
                assert got is acc
        finally:
            for a, b in pairs:
                a.close()
                b.close()

    asyncio.run(main())
    assert np.array_equal(bits(acc), bits(expected_sum(np.zeros(n, np.float32), *grads)))


def test_receive_from_asyncio_streams_adds(gs: ModuleType) -> None:
    g = grad(200_000, 20)
    acc = grad(200_000, 21)
    start = acc.copy()

    async def main() -> None:
        got: list[Any] = []

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            got.append(await gs.GradientStreamSession("sum").receive_from(reader, reduce_into=acc))
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        async with server:
            _, writer = await asyncio.open_connection(*server.sockets[0].getsockname()[:2])
            await native.GradientStreamSession("sum").stream_to(g, writer)
            writer.close()
            while not got:
                await asyncio.sleep(0.01)
        assert got[0] is acc

    run(main)
    assert np.array_equal(bits(acc), bits(expected_sum(start, g)))


@pytest.mark.parametrize("n", [10, 200_000])
def test_a_connection_receive_adds(n: int) -> None:
    # Connections are the native package's (the reference has none).
    g = grad(n, 30)
    acc = grad(n, 31)
    start = acc.copy()

    async def main() -> None:
        listener = await native.listen(LOCAL)
        accepting = asyncio.ensure_future(listener.accept())
        here = await native.connect(listener.address)
        there = await accepting
        async with listener, there, here:
            sending = asyncio.ensure_future(here.send(g))
            got = await there.recv(reduce_into=acc)
            await sending
            assert got is acc
            with pytest.raises(SettingError):
                await there.recv(reduce_into=acc, op="max")

    run(main)
    assert np.array_equal(bits(acc), bits(expected_sum(start, g)))


@pytest.mark.parametrize(("dtype", "lending"), [("float64", "max"), ("float32", "max")])
def test_the_engine_refuses_a_lending_it_does_not_know(dtype: str, lending: str) -> None:
    """The bindings' own check, below the session's: only "fill" and "sum" are lendings
    (the sum of every dtype: tests/streaming/test_reduce_dtypes.py)."""
    session = native.GradientStreamSession("sum", 4)
    wire = session.encode_frames(grad(4, 8))
    acc = np.zeros(4, np.dtype(dtype))
    with pytest.raises(ValueError, match="cannot lend"):
        session._engine.decode_frames(wire, (acc.view(np.uint8), dtype, lending))
    assert not acc.any()

"""``reduce_into=`` into float64, float16 and bfloat16 arrays (docs/guides/buffers.md "Sum
while receiving"): a float64 accumulator adds in float64, a float16 or bfloat16 one in
float32 with the sum rounded back by the cast rule; the native core and the reference
agree bit for bit, for every wire dtype, in any chunk order, over a connection too."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gradstream as native
import gradstream.reference as reference
from gradstream import _dtypes
from support.connections import LOCAL, run
from support.frames import join_frames, split_frames

DTYPES = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
}


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def raw(a: np.ndarray, name: str) -> np.ndarray:
    """``a`` as ``_dtypes.cast`` takes it (bfloat16 as its uint16 bits)."""
    return a.view(np.uint16) if name == "bfloat16" else a


def expected(acc: np.ndarray, acc_name: str, g: np.ndarray, g_name: str) -> np.ndarray:
    """The rule, written out in numpy: float64 adds in float64; float16 and bfloat16 in
    float32, rounded back by the cast rule."""
    if acc_name == "float64":
        return acc + _dtypes.cast(raw(g, g_name), g_name, "float64")
    wide = _dtypes.cast(raw(acc, acc_name), acc_name, "float32")
    total = wide + _dtypes.cast(raw(g, g_name), g_name, "float32")
    back = _dtypes.cast(np.asarray(total, np.float32), "float32", acc_name)
    return back.view(DTYPES[acc_name])


def values(n: int, seed: int, name: str) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(n) * 100
    return v.astype(np.float32).astype(DTYPES[name])


@pytest.mark.parametrize("acc_name", ["float64", "float16", "bfloat16"])
@pytest.mark.parametrize("g_name", list(DTYPES))
@pytest.mark.parametrize("impl", [native, reference], ids=["native", "reference"])
def test_every_accumulator_adds_every_wire_dtype_in_any_chunk_order(
    impl: Any, acc_name: str, g_name: str
) -> None:
    n = 3000
    g = values(n, 1, g_name)
    acc = values(n, 2, acc_name)
    start = acc.copy()
    session = native.GradientStreamSession("sum", 100, keep_dtype=True, layout="compact")
    frames = split_frames(session.encode_frames(g))
    random.Random(n).shuffle(frames)
    receiver = impl.GradientStreamSession("sum", 100, keep_dtype=True, layout="compact")
    got = receiver.decode_frames(join_frames(frames), reduce_into=acc)
    assert got is acc and acc.dtype == DTYPES[acc_name]
    assert np.array_equal(bits(acc), bits(expected(start, acc_name, g, g_name)))


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(["float64", "float16", "bfloat16"]),
    st.sampled_from(list(DTYPES)),
    st.lists(st.floats(width=16, allow_nan=False), min_size=1, max_size=300),
    st.integers(1, 40),
)
def test_native_and_reference_sums_agree_bit_for_bit(
    acc_name: str, g_name: str, floats: list[float], chunk: int
) -> None:
    # float16-representable values (infinities included) in every dtype, so that sums
    # overflow, cancel and round at the edges of the narrow dtypes.
    g = np.array(floats, np.float32).astype(DTYPES[g_name])
    acc = np.array(floats[::-1], np.float32).astype(DTYPES[acc_name])
    wire = native.GradientStreamSession("sum", chunk, keep_dtype=True).encode_frames(g)
    sums = []
    for impl in (native, reference):
        a = acc.copy()
        impl.GradientStreamSession("sum", chunk, keep_dtype=True).decode_frames(wire, reduce_into=a)
        sums.append(bits(a))
    assert np.array_equal(sums[0], sums[1])
    assert np.array_equal(sums[0], bits(expected(acc, acc_name, g, g_name)))


@pytest.mark.parametrize("acc_name", ["float64", "float16", "bfloat16"])
def test_a_connection_adds_workers_into_a_bucket_of_its_dtype(acc_name: str) -> None:
    grads = [values(50_000, k, acc_name) for k in range(3)]
    acc = np.zeros(50_000, DTYPES[acc_name])

    def session() -> native.GradientStreamSession:
        return native.GradientStreamSession("sum", keep_dtype=True, keep_shape=True)

    async def main() -> None:
        async with await native.listen(LOCAL, session=session()) as listener:
            accepting = asyncio.create_task(listener.accept())
            async with await native.connect(listener.address, session=session()) as here:
                async with await accepting as there:
                    for g in grads:
                        await asyncio.gather(here.send(g), there.recv(reduce_into=acc))

    run(main)
    want = np.zeros(50_000, DTYPES[acc_name])
    for g in grads:
        want = expected(want, acc_name, g, acc_name)
    assert np.array_equal(bits(acc), bits(want))

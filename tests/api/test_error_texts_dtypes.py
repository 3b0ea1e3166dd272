"""The dtype errors a user met (issue 23): a session that already takes every float
dtype (keep_dtype=True, a gradstream connection's default) does not advise
keep_dtype=True when it refuses something that is no gradient; an array-like whose
dtype cannot be read is not said to be "of dtype an unsupported dtype"."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

import gradstream as gs
from support.connections import LOCAL, run


class NoDlpack:
    """An array-like whose __dlpack__ fails and which has no dtype."""

    def __dlpack__(self, **_: Any) -> Any:
        raise BufferError("no export")

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


@pytest.mark.parametrize(
    "gradient",
    [memoryview(b"abcd"), b"abcd", memoryview(np.arange(4, dtype=np.int32))],
    ids=["memoryview-bytes", "bytes", "int32-buffer"],
)
def test_a_keep_dtype_session_does_not_advise_keep_dtype(gradient: Any) -> None:
    s = gs.GradientStreamSession(keep_dtype=True)
    with pytest.raises(TypeError) as info:
        s.encode_frames(gradient)
    text = str(info.value)
    assert "keep_dtype=True" not in text, text
    assert "takes float16, bfloat16, float32 and float64 values" in text


def test_a_float32_session_still_advises_keep_dtype() -> None:
    with pytest.raises(TypeError, match=r"keep_dtype=True") as info:
        gs.GradientStreamSession().encode_frames(memoryview(b"abcd"))
    assert "buffer format 'B' (float32 is 'f')" in str(info.value)


@pytest.mark.parametrize("keep_dtype", [False, True])
def test_an_unreadable_dtype_is_not_named_an_unsupported_dtype(keep_dtype: bool) -> None:
    with pytest.raises(TypeError) as info:
        gs.GradientStreamSession(keep_dtype=keep_dtype).encode_frames(NoDlpack())
    text = str(info.value)
    assert "an unsupported dtype" not in text
    assert text.startswith("gradient NoDlpack could not be read through __dlpack__ (no export)")


def test_a_connection_refuses_bytes_without_advising_its_own_default() -> None:
    async def main() -> str:
        async with await gs.listen(LOCAL) as listener:
            accepted = asyncio.create_task(listener.accept())
            async with await gs.connect(listener.address) as conn, await accepted:
                with pytest.raises(TypeError) as info:
                    await conn.send(memoryview(b"abcd"))
                return str(info.value)

    text = run(main)
    assert "keep_dtype=True" not in text and "buffer format 'B'" in text

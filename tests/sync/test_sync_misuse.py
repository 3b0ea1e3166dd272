"""Misuse gets our error naming the fix (docs/guides/blocking.md): asyncio ``connect``,
``listen`` and ``serve`` without ``await``; a call on a closed blocking connection; two
threads on one blocking connection keep the one-transfer-at-a-time rule under a race; a
blocking connection dropped unclosed warns with the blocking advice."""

from __future__ import annotations

import asyncio
import gc
import threading
import warnings

import numpy as np
import pytest

import gradstream as gs
import gradstream.sync as gsync
from gradstream.errors import SettingError, StreamIOError
from support.connections import LOCAL


def test_asyncio_connect_without_await_names_the_fix() -> None:
    pending = gs.connect("127.0.0.1:9")
    with pytest.raises(
        TypeError, match=r"await connect\(\) first \(or use gradstream\.sync\.connect"
    ):
        pending.send(np.ones(3, np.float32))  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match=r"await listen\(\) first"):
        gs.listen(LOCAL).accept()  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match=r"use async with \(or gradstream\.sync\.serve"):
        with gs.serve(LOCAL, print):  # type: ignore[attr-defined]
            pass
    assert "not awaited" in repr(pending)


def test_an_opening_never_awaited_warns() -> None:
    with pytest.warns(RuntimeWarning, match=r"connect\(\) was never awaited, so nothing"):
        gs.connect("127.0.0.1:9")
        gc.collect()


def test_asyncio_opening_awaited_and_entered() -> None:
    async def main() -> np.ndarray:
        async with gs.listen(LOCAL) as listener:
            async with gs.connect(listener.address) as conn:
                async with await listener.accept() as other:
                    _, got = await asyncio.gather(
                        conn.send(np.arange(5, dtype=np.float32)), other.recv()
                    )
            assert conn.closed
        return got

    np.testing.assert_array_equal(asyncio.run(main()), np.arange(5, dtype=np.float32))


def test_closed_connection_says_so() -> None:
    with gsync.listen(LOCAL) as listener:
        conn = gsync.connect(listener.address)
        other = listener.accept()
        conn.close()
        conn.close()  # idempotent
        with pytest.raises(StreamIOError, match="send on a closed connection") as info:
            conn.send(np.ones(3, np.float32))
        assert "open a new one" in str(info.value)
        with pytest.raises(StreamIOError, match="recv_tensors on a closed connection"):
            conn.recv_tensors()
        assert other.recv().size == 0  # the peer's close: the end, as in asyncio
        assert other.closed
        other.close()


def test_two_threads_one_transfer_at_a_time() -> None:
    """Many threads start a recv on one connection at once: exactly one runs, the others
    get the SettingError; the one gets the gradient."""
    with gsync.listen(LOCAL) as listener:
        with gsync.connect(listener.address) as conn, listener.accept() as other:
            barrier = threading.Barrier(8)
            got: list[np.ndarray] = []
            refused: list[BaseException] = []

            def take() -> None:
                barrier.wait()
                try:
                    got.append(conn.recv())
                except SettingError as exc:
                    refused.append(exc)

            threads = [threading.Thread(target=take) for _ in range(8)]
            for thread in threads:
                thread.start()
            while len(refused) < 7:
                threading.Event().wait(0.01)
            other.send(np.full(4, 2, np.float32))
            for thread in threads:
                thread.join(10)
            assert len(got) == 1 and len(refused) == 7
            np.testing.assert_array_equal(got[0], np.full(4, 2, np.float32))
            assert "one transfer at a time per connection" in str(refused[0])
            assert "recv while this connection is receiving" in str(refused[0])


def test_unclosed_blocking_connection_warns_with_blocking_advice() -> None:
    with gsync.listen(LOCAL) as listener:
        conn = gsync.connect(listener.address)
        other = listener.accept()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            del conn
            gc.collect()
        texts = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
        assert any("conn.close(), or with)" in text for text in texts), texts
        other.close()

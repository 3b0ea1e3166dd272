"""What the streaming tests (streaming/test_streaming*.py) share: connections over
every transport and path, descriptor and RSS counts, outcomes compared between the
implementations, and the frames of one fixed gradient.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import os
import socket
import time
from collections.abc import Awaitable, Callable
from functools import lru_cache
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import gradstream as gs
import gradstream.reference as ref
from gradstream.errors import GradientStreamError
from support.aio import run as run_under_deadline
from support.aio import tcp_socket_pair
from support.frames import HEADER, HEADER_LEN
from support.impls import ERROR_FIELDS

U32_MAX = 0xFFFF_FFFF


IMPLS: dict[str, ModuleType] = {"native": gs, "reference": ref}


IMPL_NAMES = list(IMPLS)


def has_streaming(mod: ModuleType) -> bool:
    cls = mod.GradientStreamSession
    methods = ("stream_to", "receive_from", "receive_iter")
    return all(hasattr(cls, m) for m in methods) and hasattr(mod, "TransferProgress")


def need(name: str) -> ModuleType:
    """The implementation, or skip while the reference's async methods are not written."""
    mod = IMPLS[name]
    if not has_streaming(mod):
        pytest.skip(f"gradstream.{name} has no streaming methods yet")
    return mod


@lru_cache(maxsize=32)
def gradient(n: int, seed: int = 0) -> np.ndarray:
    """n float32 values drawn as raw bit patterns (NaN payloads, -0.0, subnormals...)."""
    bits = np.random.default_rng(seed).integers(0, 2**32, n, dtype=np.uint32)
    values = bits.view(np.float32)
    values.flags.writeable = False  # shared by the cache: nobody may change it
    return values


def assert_bit_equal(got: Any, want: np.ndarray) -> None:
    assert isinstance(got, np.ndarray)
    assert got.dtype == np.float32 and got.ndim == 1
    assert got.shape == want.shape
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def chunks_of(n: int, chunk_size: int = 65536) -> int:
    return max(1, -(-n // chunk_size))


def nfd() -> int:
    # Event loops that are gone close their native hub's eventfd when collected: collect
    # first, so that a count is not lowered later by an earlier test's garbage.
    gc.collect()
    return len(os.listdir("/proc/self/fd"))


def frames_of(wire: bytes) -> list[tuple[int, bytes]]:
    """(offset, frame bytes) of each frame of a valid stream."""
    out = []
    pos = 0
    while pos < len(wire):
        length = HEADER_LEN + HEADER.unpack_from(wire, pos)[2]
        out.append((pos, wire[pos : pos + length]))
        pos += length
    return out


def outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "ok", call()
    except GradientStreamError as exc:
        return "err", exc


async def async_outcome(awaitable: Awaitable[Any]) -> tuple[str, Any]:
    try:
        return "ok", await awaitable
    except GradientStreamError as exc:
        return "err", exc


def describe(result: tuple[str, Any]) -> tuple[Any, ...]:
    """A comparable summary: the values' bits, or the error's class, text and fields."""
    kind, value = result
    if kind == "ok":
        return ("ok", value.dtype.str, value.shape, value.view(np.uint32).tobytes())
    fields = tuple(getattr(value, name, "-") for name in ERROR_FIELDS)
    return ("err", type(value), str(value), fields)


# support.aio.run, and any error the event loop only logged (a never-retrieved exception,
# a callback that raised) fails the test too.
run = functools.partial(run_under_deadline, fail_on_loop_errors=True)


async def warm_up() -> None:
    """One native transfer on this loop, so that its one-off resources (tokio runtime,
    the loop's completion hub) exist before a test counts descriptors."""
    a, b = socket.socketpair()
    with a, b:
        a.close()
        got = await gs.GradientStreamSession("warm").receive_from(b)
    assert got.shape == (0,)


async def fds_back_to(start: int, grace: float = 1.0) -> None:
    """Assert the descriptor count returns to start (allowing a short grace period for a
    worker thread to drop its duplicate of a socket)."""
    deadline = time.monotonic() + grace
    while nfd() != start and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert nfd() == start, f"{nfd() - start} descriptor(s) left open"


async def close_writer(writer: asyncio.StreamWriter, *, abort: bool = False) -> None:
    """Close (abort: drop what is still buffered, for a peer that will never read it)."""
    if abort:
        writer.transport.abort()
    else:
        writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


async def raw_pair(transport: str) -> tuple[socket.socket, socket.socket]:
    """(peer, ours): two blocking sockets, the peer's to be written by hand."""
    if transport == "tcp":
        return tcp_socket_pair()
    return socket.socketpair()


async def wrap_receiver(sock: socket.socket, path: str) -> tuple[Any, Any]:
    """(the stream receive_from takes, the writer to close or None)."""
    if path == "socket":
        return sock, None
    if sock.family == socket.AF_UNIX:
        reader, writer = await asyncio.open_unix_connection(sock=sock)
    else:
        reader, writer = await asyncio.open_connection(sock=sock)
    return reader, writer


async def wrap_sender(sock: socket.socket, path: str) -> tuple[Any, Any]:
    """(the stream stream_to takes, the writer to close or None)."""
    if path == "socket":
        return sock, None
    if sock.family == socket.AF_UNIX:
        _, writer = await asyncio.open_unix_connection(sock=sock)
    else:
        _, writer = await asyncio.open_connection(sock=sock)
    return writer, writer


def check_socket_intact(sock: socket.socket, timeout: float | None = None) -> None:
    """docs/spec/decoding-rules.md: the Python socket is not closed; its blocking mode is put
    back."""
    assert sock.fileno() != -1, "the transfer closed the caller's socket"
    assert sock.gettimeout() == timeout
    assert sock.getblocking() == (timeout != 0.0)


# The stream the fault cases start from (test_streaming_faults.py; the cancellation and
# life-cycle tests send it too): 10 values in chunks of 4, three frames.
FAULT_SESSION = gs.GradientStreamSession("faults", 4)
FAULT_GRAD = gradient(10, seed=11)
WIRE = FAULT_SESSION.encode_frames(FAULT_GRAD)

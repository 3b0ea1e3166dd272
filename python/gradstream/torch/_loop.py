"""The backend's event loop: one per process, on a daemon thread of its own, started
when the first group is made (not at import). Every collective is a coroutine run
there; the training thread only waits on a Work."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable
from concurrent.futures import Future
from typing import TypeVar

from .._aio import coroutine_of

T = TypeVar("T")

_lock = threading.Lock()
_loop: list[asyncio.AbstractEventLoop] = []


def loop() -> asyncio.AbstractEventLoop:
    """The backend's loop, started on first use."""
    with _lock:
        if not _loop:
            running = asyncio.new_event_loop()
            thread = threading.Thread(
                target=running.run_forever, name="gradstream.torch", daemon=True
            )
            thread.start()
            _loop.append(running)
        return _loop[0]


def submit(work: Awaitable[T]) -> Future[T]:
    """Run ``work`` (a coroutine, or the awaitable ``gradstream.listen`` returns) on the
    backend's loop; its concurrent future."""
    return asyncio.run_coroutine_threadsafe(coroutine_of(work), loop())

"""One asyncio event loop per process, on a daemon thread of its own, that owns every
gradstream connection and listener ``gradstream.ray`` makes in that process.

Ray calls a transport from its own threads (a ``_ray_system`` thread, the main thread of a
sync actor, the driver), and a sync actor method has no loop at all; gradstream's
connections belong to the loop that made them. So every call is handed to this loop and
its caller waits on the result: sync code with ``call``, async code with ``wait``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

from .._aio import coroutine_of

T = TypeVar("T")

# Each keyed by the process that made it: a forked child has neither the parent's loop
# thread nor, if one of the parent's threads held it at the fork, a free lock.
_lock: tuple[int, threading.Lock] = (os.getpid(), threading.Lock())
_loop: tuple[int, asyncio.AbstractEventLoop] | None = None


def _own_lock() -> threading.Lock:
    """This process's lock (a new one in a forked child: the parent's may be held by a
    thread the child does not have)."""
    global _lock
    pid, lock = _lock
    if pid != os.getpid():
        pid, lock = _lock = (os.getpid(), threading.Lock())
    return lock


def loop() -> asyncio.AbstractEventLoop:
    """This process's loop, started on first use (again in a forked child, whose copy of
    the parent's thread does not run)."""
    global _loop
    made = _loop
    if made is not None and made[0] == os.getpid():
        return made[1]
    with _own_lock():
        if _loop is not None and _loop[0] == os.getpid():
            return _loop[1]
        new = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(new)
            new.call_soon(ready.set)
            new.run_forever()

        threading.Thread(target=run, name="gradstream-ray-loop", daemon=True).start()
        ready.wait()
        _loop = (os.getpid(), new)
        return new


def submit(coro: Coroutine[Any, Any, T] | Awaitable[T]) -> concurrent.futures.Future[T]:
    """Schedule ``coro`` on this process's loop (from any thread but the loop's own);
    its future, which ``cancel()`` stops."""
    own = loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is own:
        if isinstance(coro, Coroutine):
            coro.close()
        raise RuntimeError("gradstream.ray: a blocking call made on its own event loop")
    return asyncio.run_coroutine_threadsafe(coroutine_of(coro), own)


def call(coro: Coroutine[Any, Any, T] | Awaitable[T]) -> T:
    """Run ``coro`` on this process's loop and wait for its result (from any thread but
    the loop's own)."""
    return submit(coro).result()


async def wait(coro: Coroutine[Any, Any, T]) -> T:
    """``call`` for async code: the caller's loop stays free while ``coro`` runs."""
    return await asyncio.wrap_future(submit(coro))

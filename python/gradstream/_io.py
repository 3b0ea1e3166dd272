"""Bounding Python-side waits: the one wait bound of the Python side, used by the
reference's stream I/O and the native session's asyncio-streams glue (the native core
bounds its own waits in tokio, with the same rules).

A transfer (one gradient, or one tensor set) waits under a ``Clock``: each wait at most
``timeout`` seconds (time without a byte moving), and all of them together at most
``deadline`` seconds from the transfer's start (a sender's at once, a receiver's at its
first byte, so that waiting for a gradient to begin is idle time).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TypeVar

from .errors import StreamDeadlineError, StreamTimeoutError

__all__ = ["Clock", "Stalled", "within"]

_T = TypeVar("_T")


class Stalled(Exception):
    """A wait ran out: no byte moved within the timeout, or the deadline passed (``late``).
    The caller, which knows the chunk counts, turns it into the error (``error``)."""

    def __init__(self, limit: float, late: bool = False) -> None:
        super().__init__(limit)
        self.limit = limit
        self.late = late

    def error(self, received: int, total: int | None) -> StreamTimeoutError:
        """StreamDeadlineError when the deadline passed, else StreamTimeoutError."""
        if self.late:
            return StreamDeadlineError(self.limit, received, total)
        return StreamTimeoutError(self.limit, received, total)


async def _bounded(awaitable: Awaitable[_T], seconds: float, expired: Stalled) -> _T:
    """``await awaitable``, raising ``expired`` when it takes more than ``seconds``."""
    try:
        async with asyncio.timeout(max(seconds, 0.0)) as bound:
            return await awaitable
    except TimeoutError:
        # A socket can raise TimeoutError itself (ETIMEDOUT): that one is an I/O error.
        if bound.expired():
            raise expired from None
        raise


async def within(awaitable: Awaitable[_T], timeout: float | None) -> _T:
    """``await awaitable``, raising Stalled when it takes more than ``timeout`` s."""
    if timeout is None:
        return await awaitable
    return await _bounded(awaitable, timeout, Stalled(timeout))


class Clock:
    """The waits of one transfer: ``timeout`` per wait, ``deadline`` for the whole from
    ``start()``. ``reset()`` readies it for the next transfer on the same stream."""

    def __init__(self, timeout: float | None, deadline: float | None = None) -> None:
        self.timeout = timeout
        self.deadline = deadline
        self._since: float | None = None

    def start(self) -> None:
        """Start the deadline, if it has not started."""
        if self._since is None:
            self._since = time.monotonic()

    def reset(self) -> None:
        self._since = None

    async def within(self, awaitable: Awaitable[_T]) -> _T:
        """``await awaitable`` under the timeout, or what is left of the deadline when
        that is shorter; Stalled (``late`` for the deadline) when it runs out."""
        if self.deadline is not None and self._since is not None:
            left = self.deadline - (time.monotonic() - self._since)
            if self.timeout is None or left < self.timeout:
                return await _bounded(awaitable, left, Stalled(self.deadline, late=True))
        return await within(awaitable, self.timeout)

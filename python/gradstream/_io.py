"""Bounding Python-side waits by the session's timeout: the one wait bound of the Python
side, used by the reference's stream I/O, the tensor-set layer's manifest I/O and the
native session's asyncio-streams glue (the native core bounds its own waits in tokio)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

__all__ = ["Stalled", "within"]

_T = TypeVar("_T")


class Stalled(Exception):
    """No byte moved within the session's timeout (turned into StreamTimeoutError by the
    caller, which knows the chunk counts)."""


async def within(awaitable: Awaitable[_T], timeout: float | None) -> _T:
    """``await awaitable``, raising Stalled when it takes more than ``timeout`` s."""
    if timeout is None:
        return await awaitable
    try:
        async with asyncio.timeout(timeout) as deadline:
            return await awaitable
    except TimeoutError:
        # A socket can raise TimeoutError itself (ETIMEDOUT): that one is an I/O error.
        if deadline.expired():
            raise Stalled from None
        raise

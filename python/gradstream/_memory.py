"""Memory kept for the next result (README "Performance", "Results without out="):
the native extension's allocator keeps the large blocks of released results (arrays that
``decode_frames`` and ``receive_from`` made, frames as a ``pyarrow.Buffer``) and serves
the next results from them, so a loop that drops last step's result reuses its pages
instead of faulting fresh memory in.

At most ``limit`` bytes are kept (2 GiB unless ``GRADSTREAM_KEEP_MEMORY`` or
``keep_memory`` says otherwise; 0 keeps none). ``bytes`` results are Python's own memory:
the last large one is written again by the next ``encode_frames`` of its length once
nothing else holds it.
"""

from __future__ import annotations

import os
from typing import NamedTuple

from . import _native
from .errors import SettingError

__all__ = ["KeptMemory", "keep_memory", "kept_memory", "release_memory"]

ENVIRONMENT = "GRADSTREAM_KEEP_MEMORY"


class KeptMemory(NamedTuple):
    """What the allocator keeps: ``held`` bytes in ``blocks`` blocks, at most ``limit``;
    ``reused``: allocations served from a kept block since the process started."""

    limit: int
    held: int
    blocks: int
    reused: int


def keep_memory(limit: int) -> None:
    """Keep at most ``limit`` bytes of released results' memory from now on (0: none);
    what is kept over the new limit goes back to the system at once."""
    _native.keep_memory(_checked(limit, "limit"))


def kept_memory() -> KeptMemory:
    return KeptMemory(*_native.kept_memory())


def release_memory() -> int:
    """Give every kept block back to the system; the number of bytes that were kept."""
    return _native.release_memory()


def _checked(limit: object, setting: str) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise SettingError(setting, f"{setting} must be a number of bytes (an int), not {limit!r}")
    if limit < 0:
        raise SettingError(setting, f"{setting} must be a number of bytes >= 0, not {limit}")
    return limit


def _limit_from_environment() -> None:
    """At import: ``GRADSTREAM_KEEP_MEMORY=<bytes>`` sets the limit (0 turns keeping off)."""
    text = os.environ.get(ENVIRONMENT)
    if text is None or not text.strip():
        return
    try:
        limit = int(text.strip())
    except ValueError:
        raise SettingError(
            ENVIRONMENT, f"{ENVIRONMENT} must be a number of bytes, not {text!r}"
        ) from None
    _native.keep_memory(_checked(limit, ENVIRONMENT))


_limit_from_environment()

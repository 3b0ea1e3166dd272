"""The progress bar of ``send`` (tqdm, on stderr): shown for a transfer that runs longer
than a second, when stderr is a terminal and ``--no-progress`` is not given.

It polls a ``TransferProgress`` from a task of its own while the transfer runs on the
same loop. Used by ``_cli_send``; tqdm is optional (no bar without it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

from . import TransferProgress
from ._cli_base import MIB, rate

__all__ = ["want_progress", "with_progress"]

T = TypeVar("T")

PROGRESS_POLL_S = 0.1
PROGRESS_DELAY_S = 1.0


def _tqdm_class() -> Callable[..., Any] | None:
    try:
        module = importlib.import_module("tqdm")
    except ImportError:
        return None
    return cast(Callable[..., Any], module.tqdm)


def want_progress(args: argparse.Namespace) -> bool:
    if args.no_progress:
        return False
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


async def _watch(progress: TransferProgress, desc: str) -> None:
    """Mirror `progress` in a tqdm bar until cancelled; shown only after ~1 s."""
    tqdm = _tqdm_class()
    if tqdm is None:
        return
    bar = tqdm(
        desc=desc,
        total=None,
        unit=" chunks",
        delay=PROGRESS_DELAY_S,
        leave=False,
        file=sys.stderr,
        dynamic_ncols=True,
    )
    start = time.perf_counter()
    try:
        while True:
            await asyncio.sleep(PROGRESS_POLL_S)
            total = progress.total_chunks
            if total and bar.total != total:
                bar.total = total
            moved = progress.bytes
            elapsed = time.perf_counter() - start
            # TransferProgress.bytes counts wire bytes (headers and Arrow framing included).
            wire = f"{moved / MIB:,.0f} MiB on the wire, {rate(moved, elapsed)}"
            bar.set_postfix_str(wire, refresh=False)
            bar.update(progress.chunks - bar.n)
    finally:
        bar.close()


async def with_progress(
    transfer: Awaitable[T], progress: TransferProgress, desc: str, enabled: bool
) -> T:
    """Await `transfer` while a concurrent task polls `progress` for the bar."""
    if not enabled:
        return await transfer
    watcher = asyncio.create_task(_watch(progress, desc))
    try:
        return await transfer
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher

"""The benchmark's sizes, and the small helpers every section uses: the gradient, a
bit-for-bit comparison, the clock, and the sessions of either implementation."""

from __future__ import annotations

import gc
import importlib
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]

MIB = 2**20
GIB = 2**30
CHUNK_SIZES = (4096, 65536, 1_048_576)
LAYOUTS = ("seed", "compact")
SEED = 4
# Gradients are a random block of this many values repeated (random values for 1 GiB take
# seconds to draw); the odd length keeps a misplaced chunk from matching by accident.
BLOCK = 1_000_003
COMPARE_STEP = 1 << 24
HOT_BUFFER = 1 << 20  # bytes: a socket buffer that stays in the CPU caches
GO = b"g"
# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class Config:
    mode: str  # "full", "quick" or "tiny" (the test's size)
    repeats: int
    limit_bytes: int  # memcpy and CRC buffers
    codec_elements: int  # encode/decode, native and reference alike
    e2e_elements: int  # end-to-end rows and raw TCP
    rss_elements: int
    pingpong_elements: int
    pingpong_seconds: float  # per repeat
    stall_timeout: float  # session timeout in the children: seconds without progress
    deadline: float  # seconds one turn (one repeat of one row) may take

    def describe(self) -> str:
        return (
            f"{self.mode} run, median of {self.repeats}; encode/decode "
            f"{self.codec_elements:,} values ({size_text(self.codec_elements * 4)}); end to end "
            f"{self.e2e_elements:,} values ({size_text(self.e2e_elements * 4)}); peak RSS "
            f"{size_text(self.rss_elements * 4)}"
        )


def make_config(
    quick: bool, tiny: bool, elements: int | None, repeats: int | None = None
) -> Config:
    if tiny:
        cfg = Config(
            mode="tiny",
            repeats=3,
            limit_bytes=8 * MIB,
            codec_elements=1 << 18,
            e2e_elements=1 << 20,
            rss_elements=1 << 20,
            pingpong_elements=1000,
            pingpong_seconds=0.05,
            stall_timeout=30.0,
            deadline=30.0,
        )
    elif quick:
        cfg = Config(
            mode="quick",
            repeats=3,
            limit_bytes=256 * MIB,
            codec_elements=16 * MIB,
            e2e_elements=64 * MIB,
            rss_elements=64 * MIB,
            pingpong_elements=1000,
            pingpong_seconds=0.3,
            stall_timeout=60.0,
            deadline=90.0,
        )
    else:
        cfg = Config(
            mode="full",
            repeats=5,
            limit_bytes=256 * MIB,
            codec_elements=64 * MIB,
            e2e_elements=256 * MIB,
            rss_elements=256 * MIB,
            pingpong_elements=1000,
            pingpong_seconds=1.0,
            stall_timeout=60.0,
            deadline=180.0,
        )
    changes: dict[str, Any] = {}
    if elements is not None:
        changes.update(codec_elements=elements, e2e_elements=elements, rss_elements=elements)
    if repeats is not None:
        changes["repeats"] = repeats
    if changes:
        cfg = Config(**{**asdict(cfg), **changes})
    return cfg


def size_text(n_bytes: int) -> str:
    if n_bytes >= GIB and n_bytes % GIB == 0:
        return f"{n_bytes // GIB} GiB"
    if n_bytes >= MIB:
        return f"{n_bytes / MIB:g} MiB"
    return f"{n_bytes / 1024:g} KiB"


# --------------------------------------------------------------------------- helpers


def make_gradient(n: int) -> F32:
    """n float32 values: a random normal block repeated (cheap to make at 1 GiB)."""
    block = np.random.default_rng(SEED).standard_normal(min(n, BLOCK), dtype=np.float32)
    out = np.empty(n, dtype=np.float32)
    for start in range(0, n, BLOCK):
        stop = min(start + BLOCK, n)
        out[start:stop] = block[: stop - start]
    return out


def same_bits(a: Any, b: F32) -> bool:
    """Bit-for-bit equality of two float32 vectors, in steps (no n-sized temporaries)."""
    a = np.asarray(a)
    if a.dtype != np.float32 or a.size != b.size:
        return False
    x, y = a.reshape(-1).view(np.uint32), b.reshape(-1).view(np.uint32)
    return all(
        np.array_equal(x[i : i + COMPARE_STEP], y[i : i + COMPARE_STEP])
        for i in range(0, x.size, COMPARE_STEP)
    )


def now_ns() -> int:
    """CLOCK_MONOTONIC: one clock for every process of the machine."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    gc.collect()
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def importable(module: str) -> bool:
    """Whether `module` imports here (an optional peer's row is skipped when it does not:
    installed but broken counts as absent)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def session_class(impl: str) -> Any:
    if impl == "native":
        import gradstream

        return gradstream.GradientStreamSession
    from gradstream import reference

    return reference.GradientStreamSession


def progress_class(impl: str) -> Any:
    if impl == "native":
        import gradstream

        return gradstream.TransferProgress
    from gradstream import reference

    return reference.TransferProgress


def layout_support(impl: str) -> str | None:
    """None when `impl` takes layout="compact"; otherwise why not (for the skip note)."""
    try:
        session_class(impl)("bench-probe", layout="compact")
    except (TypeError, ValueError) as exc:
        return f"{impl} GradientStreamSession(..., layout='compact') is not available yet ({exc})"
    return None


# The native drivers a row can turn off, to measure one against the path that serves its
# case without it (section 7): "caller_thread" (small transfers tried on the caller's
# thread), "handover" (an asyncio stream's plain socket driven natively). The direct read
# (values read from the socket straight into out=) was one until 0.3.0's run: 0.81-1.01 x
# the whole-payload read in every row, so it went (docs/performance.md); so did the asyncio
# connection's caller-thread try (1.06 x tokio, 2026-12-06): "caller_thread" now covers the
# socket path and the blocking face's connections.
DRIVERS = ("caller_thread", "handover")


def drivers_off(session: Any, off: tuple[str, ...]) -> Any:
    """``session`` (native) with the drivers in ``off`` turned off. The handover is turned
    off for the whole process: call it in a row's own child processes only."""
    unknown = set(off) - set(DRIVERS)
    if unknown:
        raise ValueError(f"unknown drivers {sorted(unknown)}")
    if "handover" in off:
        from gradstream import _handover

        _handover.lend_reader = lambda reader: None
        _handover.socket_to_write = lambda writer: None
    if "caller_thread" in off:
        session._engine = session._engine.with_drivers(False)
        # A connection uses the session's twin with the connection defaults (a fresh
        # engine, with every driver): it is turned off there too.
        twin = type(session)._for_connection(session, "gradstream")
        twin._engine = twin._engine.with_drivers(False)
    return session


@dataclass(frozen=True)
class SessionSpec:
    impl: str  # "native" or "reference"
    chunk_size: int = 65536
    layout: str | None = None  # None: the keyword is not passed (the seed layout)
    timeout: float | None = None
    off: tuple[str, ...] = ()  # native drivers turned off (drivers_off)

    def make(self) -> Any:
        kwargs: dict[str, Any] = {}
        if self.layout is not None:
            kwargs["layout"] = self.layout
        if self.timeout is not None:
            kwargs["timeout"] = self.timeout
        session = session_class(self.impl)("gradstream-bench", self.chunk_size, **kwargs)
        return drivers_off(session, self.off) if self.off else session


def layout_arg(layout: str, available: dict[str, str | None], impl: str) -> str | None:
    """The layout keyword to pass: none for the seed layout of a build without layouts."""
    return None if layout == "seed" and available[impl] is not None else layout

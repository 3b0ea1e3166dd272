"""`make demo`: a verified round trip of a large gradient, native and reference side by side.

    python -m gradstream.demo [--elements N] [--chunk-size N] [--repeats N]

Encodes a random float32 gradient (64M values by default) to frames, decodes them, checks
the result bit for bit, checks that each implementation decodes the other's frames, and
prints the throughput of both implementations (median of the repeats) and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import TypeVar

import numpy as np

import gradstream as gs
import gradstream.reference as ref

T = TypeVar("T")


def _timed(fn: Callable[[], T], repeats: int) -> tuple[T, float]:
    """Run fn `repeats` times; return its last result and the median time in seconds."""
    times = []
    result: T | None = None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    assert result is not None
    return result, statistics.median(times)


def _bit_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.array_equal(a.view(np.uint32), b.view(np.uint32)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gradstream.demo", description=__doc__)
    parser.add_argument("--elements", type=int, default=64 * 1024 * 1024)
    parser.add_argument("--chunk-size", type=int, default=gs.DEFAULT_CHUNK_SIZE)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    gradient = np.random.default_rng(7).standard_normal(args.elements, dtype=np.float32)
    gib = gradient.nbytes / 2**30
    native = gs.GradientStreamSession("demo", args.chunk_size)
    reference = ref.GradientStreamSession("demo", args.chunk_size)
    chunks = max(1, -(-args.elements // native.chunk_size))
    print(
        f"gradient: {args.elements:,} float32 values ({gradient.nbytes / 2**20:,.0f} MiB), "
        f"chunk_size {native.chunk_size:,} -> {chunks:,} chunks, median of {args.repeats}"
    )

    rows = []
    results = {}
    sessions: list[tuple[str, gs.GradientStreamSession | ref.GradientStreamSession]] = [
        ("native", native),
        ("reference", reference),
    ]
    for name, session in sessions:
        wire, t_enc = _timed(partial(session.encode_frames, gradient), args.repeats)
        back, t_dec = _timed(partial(session.decode_frames, wire), args.repeats)
        ok = _bit_equal(back, gradient)
        results[name] = (wire, t_enc, t_dec, ok)
        rows.append((name, t_enc, t_dec, len(wire), ok))
        del back

    print(f"{'':10} {'encode_frames':>22} {'decode_frames':>22} {'wire MiB':>10}  round trip")
    for name, t_enc, t_dec, wire_len, ok in rows:
        print(
            f"{name:10} {t_enc:8.3f} s {gib / t_enc * 1.073741824:7.2f} GB/s "
            f"{t_dec:8.3f} s {gib / t_dec * 1.073741824:7.2f} GB/s "
            f"{wire_len / 2**20:10.1f}  {'bit-equal' if ok else 'MISMATCH'}"
        )

    cross_ref = _bit_equal(reference.decode_frames(results["native"][0]), gradient)
    cross_native = _bit_equal(native.decode_frames(results["reference"][0]), gradient)
    print(f"reference decodes native frames: {'bit-equal' if cross_ref else 'MISMATCH'}")
    print(f"native decodes reference frames: {'bit-equal' if cross_native else 'MISMATCH'}")
    n_enc, n_dec = results["native"][1], results["native"][2]
    r_enc, r_dec = results["reference"][1], results["reference"][2]
    print(
        f"native vs reference: encode {r_enc / n_enc:.1f}x, decode {r_dec / n_dec:.1f}x, "
        f"encode+decode {(r_enc + r_dec) / (n_enc + n_dec):.1f}x"
    )
    verified = all(r[3] for r in results.values()) and cross_ref and cross_native
    print("verified" if verified else "VERIFICATION FAILED")
    return 0 if verified else 1


if __name__ == "__main__":
    sys.exit(main())

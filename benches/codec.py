"""In-memory encode_frames / decode_frames of both implementations, each checked bit for bit
and against the other's frames.

    python benches/codec.py [--elements N] [--chunk-size N] [--repeats N]

A random float32 gradient (64M values, 256 MiB, by default; standard normal, fixed seed),
encoded and decoded by the native module and by the reference (median of the repeats);
then each decodes the other's frames. Prints the times, the GB/s and the native /
reference ratios; exits non-zero if any round trip or cross-decode changes a bit. Then,
per layout, the native calls against numpy's memcpy in interleaved rounds: into reused
buffers (``out=``, the ratio to memcpy) and into new objects (the ratio to ``out=``). The
full peer comparison is ``python benches/bench.py``.
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

DEFAULT_ELEMENTS = 64 * 1024 * 1024
SEED = 7


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


def codec_benchmark(elements: int, chunk_size: int | None, repeats: int) -> int:
    """In-memory encode_frames / decode_frames of both implementations, verified."""
    size = gs.DEFAULT_CHUNK_SIZE if chunk_size is None else chunk_size
    gradient = np.random.default_rng(SEED).standard_normal(elements, dtype=np.float32)
    gib = gradient.nbytes / 2**30
    native = gs.GradientStreamSession("bench", size)
    reference = ref.GradientStreamSession("bench", size)
    chunks = max(1, -(-elements // native.chunk_size))
    print(
        f"gradient: {elements:,} float32 values ({gradient.nbytes / 2**20:,.0f} MiB), "
        f"chunk_size {native.chunk_size:,} -> {chunks:,} chunks, median of {repeats}"
    )

    rows = []
    results = {}
    sessions: list[tuple[str, gs.GradientStreamSession | ref.GradientStreamSession]] = [
        ("native", native),
        ("reference", reference),
    ]
    for name, session in sessions:
        wire, t_enc = _timed(partial(session.encode_frames, gradient), repeats)
        back, t_dec = _timed(partial(session.decode_frames, wire), repeats)
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
    verified = native_vs_memcpy(gradient, size, repeats) and verified
    print("verified" if verified else "VERIFICATION FAILED")
    return 0 if verified else 1


def native_vs_memcpy(gradient: np.ndarray, chunk_size: int, repeats: int) -> bool:
    """Per layout, rounds of: numpy memcpy into a reused array (the second of two copies,
    as the suite samples it), native encode/decode into reused buffers, and into new
    objects. Prints the medians and their ratios; True when every result is bit-equal."""
    print(f"{'native, median of ' + str(repeats):28} {'GB/s':>6} {'x memcpy':>9} {'x out=':>7}")
    return all(
        _layout_rounds(
            gradient, gs.GradientStreamSession("bench", chunk_size, layout=layout), layout, repeats
        )
        for layout in ("seed", "compact")
    )


def _layout_rounds(
    gradient: np.ndarray, session: gs.GradientStreamSession, layout: str, repeats: int
) -> bool:
    dst = np.empty_like(gradient)
    wire = session.encode_frames(gradient)
    frames, values = bytearray(len(wire)), np.ones_like(gradient)
    ops: dict[str, Callable[[], object]] = {
        "memcpy": partial(np.copyto, dst, gradient),
        "encode_frames(out=)": partial(session.encode_frames, gradient, out=frames),
        "decode_frames(out=)": partial(session.decode_frames, wire, out=values),
        "encode_frames(g)": partial(session.encode_frames, gradient),
        "decode_frames(wire)": partial(session.decode_frames, wire),
    }
    times: dict[str, list[float]] = {op: [] for op in ops}
    for _ in range(repeats):
        np.copyto(dst, gradient)
        for op, fn in ops.items():
            start = time.perf_counter()
            fn()
            times[op].append(time.perf_counter() - start)
    med = {op: statistics.median(t) for op, t in times.items()}
    for op, t in med.items():
        against = op.replace("(g)", "(out=)").replace("(wire)", "(out=)")
        vs_out = f"{med[against] / t:7.2f}" if against != op else ""
        print(
            f"{layout + ' ' + op:28} {gradient.nbytes / t / 1e9:6.2f} "
            f"{med['memcpy'] / t:9.2f} {vs_out:>7}"
        )
    return frames == wire and _bit_equal(values, gradient)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python benches/codec.py",
        description=(__doc__ or "").split("\n\n")[0],
    )
    parser.add_argument(
        "--elements",
        type=int,
        default=DEFAULT_ELEMENTS,
        metavar="N",
        help=f"float32 values in the gradient (default {DEFAULT_ELEMENTS:,})",
    )
    parser.add_argument(
        "--chunk-size",
        type=int,
        default=None,
        metavar="N",
        help="float32 values per chunk (default 65536)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs per measure (default 3)")
    args = parser.parse_args(argv)
    try:
        return codec_benchmark(args.elements, args.chunk_size, args.repeats)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

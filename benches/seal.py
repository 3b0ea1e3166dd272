"""What sealing costs the native codec: encode_frames (and decode_frames) of one gradient,
sealed and unsealed, side by side in one run, in both layouts.

    python benches/seal.py [--elements N] [--chunk-size N] [--repeats N]

A random float32 gradient (64M values, 256 MiB, by default; fixed seed). For each layout
the four sessions (unsealed, ``seal=True``) x (encode, decode) run in interleaved repeats
into reused buffers (``out=``), so that the figures are the codec's and not the page
faults of fresh memory; the medians, the GB/s of gradient, and sealed / unsealed ratios
are printed. Exits non-zero if a round trip changes a bit or a sealed frame stream does
not have ``frames_len``'s length.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

import gradstream as gs

DEFAULT_ELEMENTS = 64 * 1024 * 1024
SEED = 11


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def seal_benchmark(elements: int, chunk_size: int, repeats: int) -> int:
    gradient = np.random.default_rng(SEED).standard_normal(elements, dtype=np.float32)
    gb = gradient.nbytes / 1e9
    print(
        f"gradient: {elements:,} float32 values ({gradient.nbytes / 2**20:,.0f} MiB), "
        f"chunk_size {chunk_size:,}, median of {repeats} interleaved repeats, out= buffers"
    )
    failures = 0
    for layout in ("seed", "compact"):
        sessions = {
            sealed: gs.GradientStreamSession("bench", chunk_size, layout=layout, seal=sealed)
            for sealed in (False, True)
        }
        frames = {s: bytearray(sessions[s].frames_len(elements)) for s in sessions}
        # decode_frames copies a bytearray first (docs/spec/wire-format.md, differences); bytes are
        # read in
        # place, so each session decodes a bytes copy of its frames.
        wires = {s: bytes(sessions[s].encode_frames(gradient)) for s in sessions}
        back = {s: np.empty(elements, np.float32) for s in sessions}
        times: dict[tuple[bool, str], list[float]] = {}
        for _ in range(repeats):
            for sealed, session in sessions.items():
                out, dest = frames[sealed], back[sealed]
                encode = _seconds(lambda: session.encode_frames(gradient, out=out))  # noqa: B023
                wire = wires[sealed]
                decode = _seconds(lambda: session.decode_frames(wire, out=dest))  # noqa: B023
                times.setdefault((sealed, "encode"), []).append(encode)
                times.setdefault((sealed, "decode"), []).append(decode)
        for sealed in sessions:
            if not np.array_equal(back[sealed].view(np.uint32), gradient.view(np.uint32)):
                print(f"{layout} sealed={sealed}: the round trip changed bits")
                failures += 1
        extra = len(frames[True]) - len(frames[False])
        share = extra / len(frames[False])
        print(f"\n{layout}: sealed frames are {extra:,} bytes longer ({share:.3%})")
        for op in ("encode", "decode"):
            plain = statistics.median(times[(False, op)])
            sealed_s = statistics.median(times[(True, op)])
            print(
                f"  {op}: unsealed {plain:.3f} s ({gb / plain:.2f} GB/s), sealed {sealed_s:.3f} s "
                f"({gb / sealed_s:.2f} GB/s): sealed / unsealed speed {plain / sealed_s:.3f}"
            )
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=DEFAULT_ELEMENTS)
    parser.add_argument("--chunk-size", type=int, default=gs.DEFAULT_CHUNK_SIZE)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    return seal_benchmark(args.elements, args.chunk_size, args.repeats)


if __name__ == "__main__":
    sys.exit(main())

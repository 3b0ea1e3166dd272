"""Payload size and throughput with and without compression.

    python benches/compression.py [--values N] [--repeats K] [--impl native|reference]

For two kinds of gradient (random normal; 90 % zeros, the rest random normal) and each
layout and codec: the wire bytes of encode_frames against the gradient's own bytes, and
encode / decode throughput in GB/s of gradient (median of the repeats, all in one run).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import gradstream
from gradstream import reference


def _median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gradients(n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    normal = rng.standard_normal(n, dtype=np.float32)
    sparse = normal.copy()
    sparse[rng.random(n) < 0.9] = 0.0
    return {"random normal": normal, "90 % zeros": sparse}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", type=int, default=16 << 20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--impl", choices=("native", "reference"), default="native")
    args = parser.parse_args()
    module: Any = gradstream if args.impl == "native" else reference
    print(
        f"{args.impl}, {args.values:,} values ({args.values * 4 / 2**20:.0f} MiB), "
        f"chunk 65536, median of {args.repeats}"
    )
    print(
        f"{'gradient':<14} {'layout':<8} {'codec':<6} {'wire MiB':>9} {'x gradient':>10} "
        f"{'encode GB/s':>12} {'decode GB/s':>12}"
    )
    for kind, g in gradients(args.values).items():
        for layout in ("seed", "compact"):
            for codec in (None, "lz4", "zstd"):
                s = module.GradientStreamSession("bench", layout=layout, compression=codec)
                wire = s.encode_frames(g)
                back = s.decode_frames(wire)
                if not np.array_equal(back.view(np.uint32), g.view(np.uint32)):
                    raise SystemExit(f"{kind} {layout} {codec}: values changed")
                enc = _median_seconds(lambda s=s, g=g: s.encode_frames(g), args.repeats)
                dec = _median_seconds(lambda s=s, w=wire: s.decode_frames(w), args.repeats)
                print(
                    f"{kind:<14} {layout:<8} {codec or '-':<6} {len(wire) / 2**20:>9.1f} "
                    f"{len(wire) / g.nbytes:>10.3f} {g.nbytes / enc / 1e9:>12.2f} "
                    f"{g.nbytes / dec / 1e9:>12.2f}"
                )


if __name__ == "__main__":
    main()

"""Wire size and throughput of each dtype setting, against the float32 default.

    python benches/dtypes.py [--values N] [--repeats K] [--impl native|reference]

One random-normal float32 gradient, given in each input dtype the setting takes. For each
setting: the wire bytes of encode_frames against the float32 gradient's bytes, encode and
decode throughput in GB/s of float32-equivalent gradient (values x 4 bytes, so rows
compare as "how fast does a gradient of this many values move"), and the largest relative
error of what comes back against the float32 values. Median of the repeats, one run.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

import gradstream

# The sibling script (benches/ is the script directory, so on sys.path).
from compression import _median_seconds
from gradstream import _dtypes, reference


def _as_input(g: np.ndarray, name: str) -> np.ndarray:
    """``g`` in dtype ``name``, as a caller would hand it (ml_dtypes for bfloat16)."""
    values = _dtypes.cast(g, "float32", name)
    return _dtypes.as_hand_back(values, name) if name == "bfloat16" else values


# (label, input dtype, session keywords)
SETTINGS: list[tuple[str, str, dict[str, Any]]] = [
    ("float32 (default)", "float32", {}),
    ("float16 keep_dtype", "float16", {"keep_dtype": True}),
    ("bfloat16 keep_dtype", "bfloat16", {"keep_dtype": True}),
    ("float64 keep_dtype", "float64", {"keep_dtype": True}),
    ("float32 -> wire bfloat16", "float32", {"wire_dtype": "bfloat16"}),
    ("float32 -> wire float16", "float32", {"wire_dtype": "float16"}),
    ("float64 -> wire float32", "float64", {"wire_dtype": "float32"}),
    ("float32 -> wire int8", "float32", {"wire_dtype": "int8"}),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", type=int, default=16 << 20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--impl", choices=("native", "reference"), default="native")
    parser.add_argument("--layout", choices=("seed", "compact"), default="compact")
    args = parser.parse_args()
    module: Any = gradstream if args.impl == "native" else reference
    n = args.values
    print(
        f"{args.impl}, {n:,} values, layout {args.layout}, chunk 65536, median of "
        f"{args.repeats}; GB/s of float32-equivalent gradient ({n * 4 / 2**20:.0f} MiB)"
    )
    print(
        f"{'setting':<26} {'wire / f32':>10} {'encode GB/s':>12} {'decode GB/s':>12} "
        f"{'max rel err':>12}"
    )
    g = np.random.default_rng(7).standard_normal(n, dtype=np.float32)
    for label, source, keywords in SETTINGS:
        x = _as_input(g, source)
        s = module.GradientStreamSession("bench", layout=args.layout, **keywords)
        wire = s.encode_frames(x)
        back = s.decode_frames(wire)
        encode = _median_seconds(lambda s=s, x=x: s.encode_frames(x), args.repeats)
        decode = _median_seconds(lambda s=s, wire=wire: s.decode_frames(wire), args.repeats)
        err = np.max(np.abs(back.astype(np.float64) - g) / np.maximum(np.abs(g), 1e-30))
        print(
            f"{label:<26} {len(wire) / (4 * n):>10.3f} {4 * n / encode / 1e9:>12.2f} "
            f"{4 * n / decode / 1e9:>12.2f} {err:>12.2e}"
        )


if __name__ == "__main__":
    main()

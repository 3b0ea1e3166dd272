"""A whole model's gradients as one tensor set over loopback TCP.

    python benches/tensor_set.py [--gib G] [--repeats K]

The fake model of the tensor sets' done-when test (``fake_model`` in
tests/support/tensor_sets.py: 100 tensors of float32, float16, bfloat16 and float64, a few
big matrices and many small vectors; about 1 GiB by default), sent with stream_tensors and
received with receive_tensors at once, native on both ends, for a few settings; then the
reference once. Best of the repeats, one run.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import gradstream
from gradstream import reference
from support.aio import tcp_socket_pair as _tcp_pair
from support.tensor_sets import fake_model

SETTINGS: list[tuple[str, Any, dict[str, Any]]] = [
    ("native, seed layout", gradstream, {}),
    ("native, compact layout", gradstream, {"layout": "compact"}),
    (
        "native, compact, wire_dtype bfloat16",
        gradstream,
        {"layout": "compact", "wire_dtype": "bfloat16"},
    ),
    ("reference, seed layout", reference, {}),
]


async def _once(module: Any, model: dict[str, Any], keywords: dict[str, Any]) -> tuple[float, int]:
    client, server = _tcp_pair()
    with client, server:
        tx = module.GradientStreamSession("bench", **keywords)
        rx = module.GradientStreamSession("bench")
        start = time.perf_counter()
        sent, got = await asyncio.gather(
            tx.stream_tensors(model, client), rx.receive_tensors(server)
        )
        seconds = time.perf_counter() - start
    assert list(got) == list(model)
    return seconds, sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = fake_model(int(args.gib * (1 << 30)), 0)
    total = sum(v.nbytes for v in model.values())
    print(f"{len(model)} tensors, {total / 2**30:.2f} GiB, loopback TCP, best of {args.repeats}")
    for label, module, keywords in SETTINGS:
        repeats = args.repeats if module is gradstream else 1
        runs = [asyncio.run(_once(module, model, keywords)) for _ in range(repeats)]
        seconds = min(t for t, _ in runs)
        print(
            f"{label:<40} {runs[0][1]:>6} frames  {seconds:6.2f} s  "
            f"{total / seconds / 1e9:5.2f} GB/s of tensors"
        )


if __name__ == "__main__":
    main()

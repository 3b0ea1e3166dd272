"""The built wheel, as a user gets it: run by `make smoke` (part of `make test`) with the
Python of a fresh venv that has only the wheel and its dependencies installed, never the
source tree:

    python tests/smoke/wheel_smoke.py

It checks that the package imports from that venv's site-packages with the stable-ABI
extension (`_native.abi3.so`: one wheel for CPython 3.11 and later), that one gradient goes
over a `socket.socketpair()` and comes back bit for bit (NaN payloads, signed zeros and
infinities included, spanning several chunks and ending in a short one), and that the
venv's `gradstream` script answers `--help`. It prints one line and exits 0, or raises.
A script rather than a pytest test (the file name keeps it out of pytest's collection):
the fresh venv has no pytest.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np

import gradstream as gs
from gradstream import _native


def installed_from_site_packages() -> Path:
    """Where the package was imported from, refusing a source tree on sys.path."""
    package = Path(gs.__file__).resolve().parent
    site = {Path(sysconfig.get_paths()[key]).resolve() for key in ("purelib", "platlib")}
    assert package.parent in site, f"gradstream imported from {package}, not from {site}"
    extension = Path(_native.__file__).name
    assert extension == "_native.abi3.so", f"the extension is {extension}, not the abi3 build"
    return package


def gradient() -> np.ndarray:
    """Three full chunks and a short fourth, with the values a cast or a copy through a
    float could change: a NaN with a payload, -0.0, both infinities, the smallest
    subnormal."""
    values = np.random.default_rng(11).standard_normal(3 * gs.DEFAULT_CHUNK_SIZE + 7)
    grad = values.astype(np.float32)
    bits = grad.view(np.uint32)
    bits[:5] = [0x7FC0_1234, 0x8000_0000, 0x7F80_0000, 0xFF80_0000, 0x0000_0001]
    return grad


async def round_trip(grad: np.ndarray) -> tuple[int, np.ndarray]:
    a, b = socket.socketpair()
    with a, b:
        session = gs.GradientStreamSession("wheel-smoke", timeout=30)
        sent, got = await asyncio.gather(session.stream_to(grad, a), session.receive_from(b))
    return sent, got


def main() -> int:
    package = installed_from_site_packages()
    grad = gradient()
    sent, got = asyncio.run(round_trip(grad))
    assert sent == 4, f"{sent} chunks sent, 4 expected"
    assert got.dtype == grad.dtype and got.shape == grad.shape, (got.dtype, got.shape)
    assert np.array_equal(got.view(np.uint32), grad.view(np.uint32)), "values changed"
    script = Path(sys.executable).parent / "gradstream"
    usage = subprocess.run(
        [str(script), "--help"], capture_output=True, text=True, check=True, timeout=60
    )
    assert usage.stdout.startswith("usage: gradstream"), usage.stdout[:200]
    version = ".".join(map(str, sys.version_info[:3]))
    print(f"wheel smoke: ok (CPython {version}, {package}, {grad.size} values bit-equal)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

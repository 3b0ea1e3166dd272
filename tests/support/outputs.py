"""What the out= tests (api/test_out*.py) share: sentinel-filled out= arrays, the
checks of a filled array and of a GradientSizeError, and a receive from a raw peer.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from support.frames import frame


def ramp(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.float32) * np.float32(0.5) - np.float32(3.0)


def frames_of(s: Any, grad: np.ndarray) -> list[bytes]:
    return [
        frame(c.chunk_index, c.total_chunks, c.arrow_ipc_bytes, c.checksum)
        for c in s.encode_gradient(grad)
    ]


def sentinel_out(shape: int | tuple[int, ...]) -> np.ndarray:
    """A float32 out= array full of a value no test gradient holds."""
    return np.full(shape, np.float32(-12345.5), dtype=np.float32)
